# SPDX-License-Identifier: Apache-2.0
"""Helpers for the shim's host tests: a live registry with an event log, and running a program
with and without the shim preloaded."""
from __future__ import annotations

import fcntl
import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

from tieringd.shim import registry

# Scripts import this module outside pytest (test_shim_dax.py --daemon, the guest half of
# tests/lab/test_dax_lab.py): there tests/ is not on sys.path, which tests/paths.py relies on.
_TESTS = str(Path(__file__).resolve().parent.parent)
if _TESTS not in sys.path:
    sys.path.append(_TESTS)
from paths import REPO  # noqa: E402
SHIM = REPO / "build" / "libtieringd-shim.so"
PROGS = REPO / "build" / "tests"


class LiveRegistry:
    """A Registry served from a thread, recording every event."""

    def __init__(self, run_dir: Path, **kw):
        self.events: list[tuple[str, dict]] = []
        self._cond = threading.Condition()
        self.reg = registry.Registry(str(run_dir), on_event=self._record, **kw)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self, kind: str, data: dict) -> None:
        with self._cond:
            self.events.append((kind, data))
            self._cond.notify_all()

    def start(self) -> "LiveRegistry":
        self.reg.start()
        self._thread = threading.Thread(target=self.reg.serve, args=(self._stop, 0.05), daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(5)
        self.reg.close()

    def of(self, pid: int, kind: str | None = None) -> list[dict]:
        with self._cond:
            return [d for k, d in self.events if d.get("pid") == pid and (kind is None or k == kind)]

    def wait_for(self, predicate, timeout: float = 15.0) -> bool:
        # The predicate may take the registry's lock, which is held while events are recorded:
        # never evaluate it under our own condition's lock.
        deadline = time.monotonic() + timeout
        while not predicate():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with self._cond:
                self._cond.wait(min(left, 0.2))
        return True

    def request(self, pid: int, msg, timeout: float = 5.0):
        # The serving thread and request() both poll; Registry's lock keeps them apart.
        return self.reg.request(pid, msg, timeout)


def shim_env(run_dir: Path | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TIERINGD_", "LD_PRELOAD"))}
    env["LD_PRELOAD"] = str(SHIM)
    env["TIERINGD_RUN_DIR"] = str(run_dir) if run_dir else "/nonexistent/tieringd"
    env.update(extra)
    return env


def plain_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TIERINGD_", "LD_PRELOAD"))}
    env.update(extra)
    return env


def run(cmd: list[str], env: dict[str, str], timeout: float = 300, input: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, input=input)


def start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


_FLOCK = struct.Struct("hhqqi4x")


def locked_by(path: str | Path) -> int | None:
    """PID of the process holding a write lock on ``path`` (the shim holds one on the file extent for
    the whole of a remap job), or None."""
    fd = os.open(path, os.O_RDWR)
    try:
        got = _FLOCK.unpack(fcntl.fcntl(fd, fcntl.F_GETLK, _FLOCK.pack(fcntl.F_WRLCK, 0, 0, 0, 0)))
        return got[4] if got[0] != fcntl.F_UNLCK else None
    finally:
        os.close(fd)
