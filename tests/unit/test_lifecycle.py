# SPDX-License-Identifier: Apache-2.0
"""Exit and exec of real child processes, seen by the /proc polling fallback (and by the proc connector
where this kernel lets us subscribe: tests/host/test_service_host.py covers it as root)."""
import os
import subprocess
import sys
import time

import pytest

from tieringd.service import lifecycle
from tieringd.config import ConfigError, from_table
from tieringd.service.lifecycle import LifecycleConfig, ProcessWatcher, process_gone, wait_readable


def collect(w: ProcessWatcher, until, timeout_s: float = 10.0) -> list:
    got = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not until(got):
        if wait_readable(w.fileno(), 0.1):
            got += w.handle()
    return got


def test_poller_reports_exec_then_exit_of_a_watched_pid():
    w = ProcessWatcher(LifecycleConfig(source="poll", poll_interval_ms=20))
    assert w.mechanism == "/proc polling"
    child = subprocess.Popen(["sh", "-c", "read x; exec sleep 30"], stdin=subprocess.PIPE)
    try:
        w.watch([child.pid])
        time.sleep(0.2)                      # the poller has seen the shell
        child.stdin.write(b"go\n")
        child.stdin.flush()
        got = collect(w, lambda g: any(e.kind == "exec" for e in g))
        assert [(e.kind, e.pid) for e in got] == [("exec", child.pid)]
        child.kill()
        child.wait()
        got = collect(w, lambda g: any(e.kind == "exit" for e in g))
        assert [(e.kind, e.pid) for e in got] == [("exit", child.pid)]
        assert w.status()["events"] == {"exec": 1, "exit": 1}
        # reported once, not at every poll
        time.sleep(0.2)
        assert not wait_readable(w.fileno(), 0.1) or w.handle() == []
    finally:
        child.kill()
        w.close()


def test_an_unwatched_pid_is_never_reported():
    w = ProcessWatcher(LifecycleConfig(source="poll", poll_interval_ms=20))
    child = subprocess.Popen(["true"])
    child.wait()
    try:
        assert collect(w, lambda g: bool(g), timeout_s=0.5) == []
    finally:
        w.close()


def test_a_zombie_is_gone_a_live_process_is_not():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    while lifecycle.procfs.read_stat(child.pid)[0] != "Z":     # exited, not reaped: a zombie
        time.sleep(0.01)
    assert process_gone(child.pid)
    child.wait()
    assert process_gone(child.pid)
    assert not process_gone(os.getpid())


def test_lifecycle_table_is_checked():
    assert from_table(LifecycleConfig, "lifecycle", {"source": "poll"}).source == "poll"
    with pytest.raises(ConfigError, match=r'\[lifecycle\] source: expected "auto" or "netlink" or "poll", got "kernel"'):
        from_table(LifecycleConfig, "lifecycle", {"source": "kernel"})
    with pytest.raises(ConfigError, match=r"\[lifecycle\] poll_interval_ms: expected an integer in \[10, 3600000\]"):
        from_table(LifecycleConfig, "lifecycle", {"poll_interval_ms": 1})
