# SPDX-License-Identifier: Apache-2.0
"""Helpers for the samplers' host tests: the tests/progs workloads (built by make), run unmodified,
and tieringctl as a subprocess (optionally without the BPF capabilities)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from paths import REPO
PROGS = os.path.join(REPO, "build", "tests")
TIERINGCTL = [sys.executable, "-c", "from tieringd.cli import main; main()"]


def spearman(a, b) -> float:
    """Spearman's rank correlation (average ranks for ties), numpy only."""
    def ranks(x):
        x = np.asarray(x, float)
        order = np.argsort(x, kind="mergesort")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        for v in np.unique(x):                 # ties share their mean rank
            sel = x == v
            r[sel] = r[sel].mean()
        return r
    ra, rb = ranks(a), ranks(b)
    return float(np.corrcoef(ra, rb)[0, 1])


class Workload:
    """A tests/progs program started with --wait: its first JSON line, then go() / finish()."""

    def __init__(self, prog: str, *args: str):
        path = os.path.join(PROGS, prog)
        if not os.path.exists(path):
            pytest.skip(f"{path} is not built (make)")
        self.p = subprocess.Popen([path, "--wait", *args], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        self.info = json.loads(self.p.stdout.readline())
        self.pid = self.info["pid"]

    def go(self) -> list[dict]:
        """Lets it run; returns the JSON lines it printed up to {"done": true}."""
        self.p.stdin.write("go\n")
        self.p.stdin.flush()
        lines = []
        while True:
            line = json.loads(self.p.stdout.readline())
            lines.append(line)
            if line.get("done"):
                return lines

    def finish(self) -> None:
        if self.p.poll() is None:
            try:
                self.p.stdin.write("bye\n")
                self.p.stdin.flush()
            except BrokenPipeError:
                pass
            try:
                self.p.wait(5)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


def cli(*args, drop_caps=False, timeout=60):
    cmd = [*TIERINGCTL, *args]
    if drop_caps:
        cmd = ["setpriv", "--bounding-set", "-bpf,-perfmon,-sys_admin", "--", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
