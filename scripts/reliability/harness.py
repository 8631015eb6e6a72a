# SPDX-License-Identifier: Apache-2.0
"""What every part of the reliability suite shares (``make reliability``, docs/reliability.md).

- :class:`HostDaemon`: the real ``tieringd`` on this machine, in a run directory of its own (0755, so
  that other users' clients reach its sockets), its log in a file;
- :func:`result`: the one record a part writes (``--json OUT``), which ``run.py`` puts in its table:
  what was tried and how many, bytes lost, crashes, accesses refused and forbidden ones let through;
- :func:`arguments`: ``--json``, ``--quick`` (the short form ``make test`` runs) and ``--seed`` (every
  generator is seeded, the seed is printed, and ``--seed S`` replays a failure).

Nothing here decides an outcome: each part says what it tried and what came of it.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tieringd.kernel import procfs  # noqa: E402
from tieringd.service.control import Client, ControlError  # noqa: E402

SCHEMA = "tieringd.reliability/1"


def arguments(doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    ap.add_argument("--json", metavar="OUT", help="write the part's record here")
    ap.add_argument("--quick", action="store_true", help="the short form (make test): fewer inputs")
    ap.add_argument("--seed", type=int, default=None, help="replay: the seed a run printed")
    return ap


def seed_of(args: argparse.Namespace, part: str) -> int:
    """The run's seed: ``--seed``, else a fresh one; printed first, so that any failure replays."""
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 32)
    print(f"{part}: seed {seed} (replay: --seed {seed})", flush=True)
    return seed


def result(part: str, title: str, *, tried: int, unit: str, ok: bool, bytes_lost: int = 0,
           crashes: int = 0, refused: int = 0, let_through: int = 0, seed: int | None = None,
           figures: dict | None = None, cases: list | None = None, notes: str = "") -> dict:
    """A part's record. ``tried``: inputs, trials or faults (``unit`` says which); ``crashes``: the
    daemon died, or logged a traceback; ``refused``: forbidden accesses refused; ``let_through``:
    forbidden accesses that were not refused (the goal: 0)."""
    return {"schema": SCHEMA, "part": part, "title": title, "tried": tried, "unit": unit,
            "bytes_lost": bytes_lost, "crashes": crashes, "refused": refused,
            "let_through": let_through, "ok": bool(ok), "seed": seed, "figures": figures or {},
            "cases": cases or [], "notes": notes}


def write(args: argparse.Namespace, doc: dict) -> int:
    text = json.dumps(doc, indent=1, default=str)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    print(f"{doc['part']}: {doc['tried']} {doc['unit']}, bytes lost {doc['bytes_lost']}, crashes "
          f"{doc['crashes']}, refused {doc['refused']}, let through {doc['let_through']}: "
          f"{'ok' if doc['ok'] else 'FAILED'}", flush=True)
    return 0 if doc["ok"] else 1


def skip_unless_root(args: argparse.Namespace, part: str, title: str, unit: str) -> int | None:
    """None as root; else the part's record, skipped with the reason (the exit status to return)."""
    if os.geteuid() == 0:
        return None
    why = "skipped: needs root (a root tieringd, whose sockets judge peers by their credentials)"
    print(f"{part}: {why}", flush=True)
    return write(args, result(part, title, tried=0, unit=unit, ok=True, notes=why))


def rss_bytes(pid: int) -> int | None:
    st = procfs.read_status(pid)
    if not st or "VmRSS" not in st:
        return None
    return int(st["VmRSS"].split()[0]) * 1024


class HostDaemon:
    """``python -m tieringd.daemon`` as root on this machine. ``config``: the text of its file."""

    def __init__(self, config: str | None = None, tag: str = "daemon", nofile: int | None = None):
        """``nofile``: the daemon's soft open-files limit (a service's, where the test's shell has more)."""
        self.root = Path(tempfile.mkdtemp(prefix=f"tieringd-rel-{tag}-", dir="/tmp"))
        os.chmod(self.root, 0o755)
        self.run_dir = self.root / "run"
        self.log_path = self.root / "daemon.log"
        args = [sys.executable, "-m", "tieringd.daemon", "--run-dir", str(self.run_dir)]
        if config is not None:
            (self.root / "tieringd.toml").write_text(config)
            args += ["--config", str(self.root / "tieringd.toml")]
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
        env.pop("TIERINGD_CONFIG", None)
        def limits() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        self.proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=open(self.log_path, "w"),
                                     stderr=subprocess.STDOUT, preexec_fn=limits)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Until ``status`` answers with a tick done (a safety limit, not a figure); the seconds taken."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if not self.alive():
                raise RuntimeError(f"tieringd exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if self.ask("status", timeout_s=10)["ticks"]["count"] >= 1:
                    return time.monotonic() - t0
            except (ConnectionError, ControlError, OSError):
                pass
            time.sleep(0.05)
        raise RuntimeError(f"tieringd did not answer in {timeout_s} s:\n{self.log()[-3000:]}")

    def ask(self, name: str, timeout_s: float = 60.0, **params):
        with Client(str(self.run_dir), timeout_s=timeout_s) as c:
            return c.request(name, **params)

    def status_latency_s(self, timeout_s: float = 60.0) -> float | None:
        """Seconds a fresh connection's ``status`` takes to answer; None when it does not."""
        t0 = time.monotonic()
        try:
            self.ask("status", timeout_s=timeout_s)
        except (ConnectionError, ControlError, OSError) as e:
            self.last_unanswered = f"{type(e).__name__}: {e} after {time.monotonic() - t0:.1f} s"
            return None
        return time.monotonic() - t0

    def rss_bytes(self) -> int | None:
        return rss_bytes(self.pid)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tracebacks(self) -> list[str]:
        """Every traceback the daemon logged (its first line and its last): a handler that raised."""
        lines = self.log().splitlines()
        out = []
        for i, line in enumerate(lines):
            if line.startswith("Traceback"):
                end = next((j for j in range(i + 1, len(lines)) if not lines[j].startswith((" ", "Traceback"))),
                           len(lines) - 1)
                out.append(f"{lines[i - 1] if i else ''} … {lines[end]}")
        return out

    def stop(self) -> int:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def cleanup(self, keep_log: Path | None = None) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait()
        if keep_log is not None:
            keep_log.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.log_path, keep_log)
        shutil.rmtree(self.root, ignore_errors=True)


class Watch:
    """While a part runs: the daemon's status latency and RSS every ``every_s`` (a thread)."""

    def __init__(self, daemon: HostDaemon, every_s: float = 0.5):
        import threading
        self.d, self.every_s = daemon, every_s
        self.latencies: list[float] = []
        self.unanswered = 0
        self.why_unanswered: list[str] = []       # what the probe got instead, to tell a stall from a refusal
        self.rss: list[int] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            lat = self.d.status_latency_s(timeout_s=30)
            if lat is None:
                self.unanswered += 1
                self.why_unanswered.append(getattr(self.d, "last_unanswered", "?"))
            else:
                self.latencies.append(lat)
            rss = self.d.rss_bytes()
            if rss:
                self.rss.append(rss)

    def stop(self) -> dict:
        self._stop.set()
        self._t.join(60)
        lat = sorted(self.latencies)
        return {"status_answers": len(lat), "status_unanswered": self.unanswered,
                "why_unanswered": self.why_unanswered[:5],
                "status_p50_ms": round(1000 * lat[len(lat) // 2], 1) if lat else None,
                "status_max_ms": round(1000 * lat[-1], 1) if lat else None,
                "rss_max_mb": round(max(self.rss) / 2**20, 1) if self.rss else None}


def interpreter_for(uid: int) -> list[str]:
    """A Python that ``uid`` may run, with this checkout's package importable: this interpreter when the
    user can reach it and the checkout, else the system's python3 with a readable copy of what the
    clients import (a checkout in root's home, 0700 on Debian, is out of other users' reach, its venv
    with it)."""
    exe = sys.executable
    probe = f"import sys; sys.path[:0] = [{str(REPO)!r}]; import tieringd"
    if subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", exe, "-c", probe],
                      capture_output=True, cwd="/").returncode == 0:
        return [exe]
    return ["/usr/bin/python3", "-c", f"import sys; sys.path[:0] = [{readable_copy()!r}]; sys.argv[:1] = ['-c']; "
            "exec(compile(sys.argv[1], '<client>', 'exec'))"]


_READABLE: str | None = None
# what the clients import (tieringctl's entry point, the control client, the shim protocol)
_CLIENT_IMPORTS = "import tieringd.service.control, tieringd.shim.protocol; from tieringd.cli import main"


def readable_copy() -> str:
    """A directory every user may read: this checkout's package and the third-party modules the
    clients import, copied from the venv (never the whole venv: it holds torch). Removed at exit."""
    global _READABLE
    if _READABLE is None:
        import atexit
        import site
        d = tempfile.mkdtemp(prefix="tieringd-reliability-")
        atexit.register(shutil.rmtree, d, True)
        shutil.copytree(REPO / "tieringd", Path(d) / "tieringd", ignore=shutil.ignore_patterns("__pycache__"))
        probe = (f"import sys; {_CLIENT_IMPORTS}; "
                 "print(' '.join({m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names)))")
        tops = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                              cwd=REPO).stdout.split()
        for sp in (Path(p) for p in site.getsitepackages() if os.path.isdir(p)):
            for name in tops:
                for src in sp.glob(name + "*"):
                    if name == "tieringd" or src.name.endswith((".dist-info", ".pth")) \
                            or src.name.split(".")[0] != name or (Path(d) / src.name).exists():
                        continue
                    if src.is_dir():
                        shutil.copytree(src, Path(d) / src.name, ignore=shutil.ignore_patterns("__pycache__"))
                    else:
                        shutil.copy(src, Path(d) / src.name)
        subprocess.run(["chmod", "-R", "a+rX", d], check=True)
        _READABLE = d
    return _READABLE
