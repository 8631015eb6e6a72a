# SPDX-License-Identifier: Apache-2.0
"""The real daemon (``python -m tieringd.daemon``) as a service on this machine: systemd's readiness
protocol read from a NOTIFY_SOCKET the test binds, the control socket refusing a user outside the
group (and logging it), SIGHUP with a bad file keeping the old settings, the proc connector, and a
restart after kill -9 that re-learns a live shim's regions with every byte intact.

The daemon borrows kernel settings (numa_balancing) while it runs and puts them back; each test
checks they are back."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tieringd.service.control import Client, ControlError
from tieringd.service.lifecycle import LifecycleConfig, ProcessWatcher, wait_readable

pytestmark = [pytest.mark.root, pytest.mark.bpf]

REPO = Path(__file__).resolve().parents[2]
SHIM = REPO / "build" / "libtieringd-shim.so"
KV = REPO / "build" / "tests" / "kv_workload"
SHARED_PREFIX = REPO / "build" / "tests" / "shared_prefix"


def numa_balancing() -> str:
    return Path("/proc/sys/kernel/numa_balancing").read_text().strip()


@pytest.fixture
def run_root():
    """A directory other users can traverse (pytest's tmp_path is 0700 root)."""
    d = tempfile.mkdtemp(prefix="tieringd-svc-", dir="/tmp")
    os.chmod(d, 0o755)
    yield Path(d)
    subprocess.run(["rm", "-rf", d])


class Daemon:
    """One ``tieringd`` process, its log in a file, optionally with a NOTIFY_SOCKET of ours."""

    def __init__(self, root: Path, config: str | None = None, notify: bool = False):
        self.root = root
        self.run_dir = root / "run"
        self.config = root / "tieringd.toml"
        if config is not None:
            self.config.write_text(config)
        self.log = root / f"daemon-{time.monotonic_ns()}.log"
        self.notify: socket.socket | None = None
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("TIERINGD_CONFIG", None)
        if notify:
            self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            path = str(root / f"notify-{time.monotonic_ns()}")
            self.notify.bind(path)
            env["NOTIFY_SOCKET"] = path
        args = [sys.executable, "-m", "tieringd.daemon", "--run-dir", str(self.run_dir)]
        if config is not None:
            args += ["--config", str(self.config)]
        self.proc = subprocess.Popen(args, env=env, cwd=REPO, stdout=open(self.log, "w"),
                                     stderr=subprocess.STDOUT)

    def messages(self, until: str, timeout_s: float = 90.0) -> list[dict]:
        """Datagrams on our NOTIFY_SOCKET up to (and with) the first one that sets ``until``."""
        got = []
        self.notify.settimeout(timeout_s)
        while True:
            data = self.notify.recv(4096).decode()
            msg = dict(line.split("=", 1) for line in data.split("\n"))
            got.append(msg)
            if until in msg:
                return got

    def wait_answers(self, timeout_s: float = 90.0) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                with Client(str(self.run_dir), timeout_s=5) as c:
                    if c.request("status")["ticks"]["count"] >= 1:
                        return time.monotonic()
            except (ConnectionError, ControlError, OSError):
                pass
            time.sleep(0.05)
        raise AssertionError(f"the daemon did not answer: {self.log.read_text()}")

    def ask(self, name: str, **params):
        with Client(str(self.run_dir)) as c:
            return c.request(name, **params)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(60)
        finally:
            if self.notify is not None:
                self.notify.close()

    def text(self) -> str:
        return self.log.read_text()


def test_ready_only_once_the_control_socket_answers_and_stopping_on_sigterm(run_root):
    before = numa_balancing()
    d = Daemon(run_root, notify=True)
    try:
        msgs = d.messages("READY")
        # the moment READY=1 arrives, both sockets answer
        with Client(str(d.run_dir), timeout_s=5) as c:
            st = c.request("status")
        assert socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET).connect_ex(str(d.run_dir / "registry.sock")) == 0
        assert all("READY" not in m for m in msgs[:-1])
        ready = msgs[-1]
        assert ready["MAINPID"] == str(d.proc.pid)
        assert "regions of" in ready["STATUS"] and ready["STATUS"].startswith("signal ")
        assert st["systemd"] == {"notify": True, "ready": True, "watchdog_usec": None}
        assert st["lifecycle"]["mechanism"] == "netlink proc connector"
        d.proc.send_signal(signal.SIGTERM)
        stopping = d.messages("STOPPING", timeout_s=30)[-1]
        assert stopping["STOPPING"] == "1" and "SIGTERM" in stopping["STATUS"]
        assert d.proc.wait(60) == 0
    finally:
        d.stop()
    assert numa_balancing() == before


def test_a_user_outside_the_group_is_refused_in_words_and_the_refusal_logged(run_root):
    d = Daemon(run_root)
    try:
        d.wait_answers()
        # what tieringd.service.control.Client does: the refusal may close the socket before the request
        # is written (EPIPE); the error line is still there to read
        client = ("import socket, sys\n"
                  "s = socket.socket(socket.AF_UNIX)\n"
                  "s.connect(sys.argv[1])\n"
                  "try:\n"
                  "    s.sendall(b'{\"v\": 1, \"id\": 1, \"request\": \"status\"}\\n')\n"
                  "except BrokenPipeError:\n"
                  "    pass\n"
                  "print(s.makefile().readline(), end='')\n")
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                            "-c", client, str(d.run_dir / "control.sock")], capture_output=True, text=True,
                           timeout=30)
        assert r.returncode == 0, r.stderr
        answer = json.loads(r.stdout)
        assert answer["ok"] is False and answer["error"]["code"] == "forbidden"
        assert "uid 65534 may not use the tieringd control socket" in answer["error"]["message"]
        assert d.ask("status")["control"]["refusals"] == 1
        time.sleep(0.2)
        assert "control: refused pid" in d.text() and "uid 65534" in d.text()
    finally:
        assert d.stop() == 0


def test_sighup_with_a_bad_file_keeps_the_old_settings(run_root):
    d = Daemon(run_root, config="[policy]\ninterval_ms = 200\n")
    try:
        d.wait_answers()
        assert d.ask("policy-get")["policy"]["interval_ms"] == 200
        for bad, line in (("[policy]\ninterval_ms = 50\nintervall_ms = 5\n",
                           f"{d.config}:3: [policy] intervall_ms: unknown key"),
                          ('[policy]\ninterval_ms = 50\n[sampling]\ninterval_ms = "fast"\n',
                           f'{d.config}:4: [sampling] interval_ms: expected an integer (milliseconds), got "fast"')):
            d.config.write_text(bad)
            d.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 30
            while line not in d.text() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert f"reload refused, the old settings stay: {line}" in d.text()
            assert d.ask("policy-get")["policy"]["interval_ms"] == 200
        d.config.write_text("[policy]\ninterval_ms = 300\n")
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while d.ask("policy-get")["policy"]["interval_ms"] != 300 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert d.ask("policy-get")["policy"]["interval_ms"] == 300
        assert d.ask("status")["ticks"]["interval_ms"] == 300
    finally:
        assert d.stop() == 0


def test_the_proc_connector_reports_exec_and_exit_of_a_watched_pid():
    w = ProcessWatcher(LifecycleConfig(source="netlink"))
    child = subprocess.Popen(["sh", "-c", "read x; exec sleep 30"], stdin=subprocess.PIPE)
    try:
        w.watch([child.pid])
        child.stdin.write(b"go\n")
        child.stdin.flush()
        got = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(e.kind == "exec" for e in got):
            if wait_readable(w.fileno(), 0.1):
                got += w.handle()
        child.kill()
        child.wait()
        while time.monotonic() < deadline and not any(e.kind == "exit" for e in got):
            if wait_readable(w.fileno(), 0.1):
                got += w.handle()
        kinds = [e.kind for e in got if e.pid == child.pid]
        assert "exec" in kinds and kinds[-1] == "exit"
        assert all(e.time_ns <= time.monotonic_ns() for e in got)      # CLOCK_MONOTONIC stamps
    finally:
        child.kill()
        w.close()


@pytest.mark.shim
def test_kill_9_then_restart_relearns_every_region_and_every_byte_holds(run_root):
    before = numa_balancing()
    d = Daemon(run_root)
    d.wait_answers()
    env = dict(os.environ, LD_PRELOAD=str(SHIM), TIERINGD_RUN_DIR=str(d.run_dir))
    kv = subprocess.Popen([str(KV), "--pool", "96M", "--prefix", "4M", "--context-blocks", "4", "--active", "2",
                           "--ring", "4", "--seconds", "25", "--report", "5", "--ticker-us", "0"],
                          env=env, stdout=subprocess.PIPE, text=True)
    try:
        start = json.loads(kv.stdout.readline())
        pool = int(start["pool_addr"])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not d.ask("regions", pid=kv.pid)["regions"]:
            time.sleep(0.1)
        regions = {(r["start"], r["length"]) for r in d.ask("regions", pid=kv.pid)["regions"]}
        assert any(s <= pool < s + n for s, n in regions)
        assert d.stop(signal.SIGKILL) == -signal.SIGKILL
        killed = time.monotonic()
        d2 = Daemon(run_root)
        answered = d2.wait_answers()
        while time.monotonic() - answered < 10:
            back = {(r["start"], r["length"]) for r in d2.ask("regions", pid=kv.pid)["regions"]}
            if back == regions:
                break
            time.sleep(0.05)
        relearned_s = time.monotonic() - answered
        print(f"regions of pid {kv.pid} back {relearned_s:.3f} s after the restarted daemon answered "
              f"({answered - killed:.2f} s after the kill)")
        assert back == regions
        assert relearned_s < 2.0, f"regions back {relearned_s:.2f} s after the daemon answered"
        assert "restored" in d2.text() or "kernel settings" in d2.text()
        end = json.loads(kv.communicate(timeout=120)[0].splitlines()[-1])
        assert end["event"] == "end" and end["ok"] and end["corrupt_bytes"] == 0 and kv.returncode == 0
        assert d2.stop() == 0
    finally:
        kv.kill()
        d.stop(signal.SIGKILL)
    assert numa_balancing() == before


@pytest.mark.shim
def test_a_prefix_three_processes_map_has_three_sharers_in_the_daemons_table(run_root):
    """shared_prefix under the shim with memfd backing: the prefix its first process fills and two
    forked ones inherit is mapped by all three; each one's private pool by itself. The daemon's
    sharing scan finds it from pagemap and kpagecount, and its own reports say so."""
    before = numa_balancing()
    d = Daemon(run_root)
    d.wait_answers()
    env = dict(os.environ, LD_PRELOAD=str(SHIM), TIERINGD_RUN_DIR=str(d.run_dir), TIERINGD_BACKING="memfd")
    sp = subprocess.Popen([str(SHARED_PREFIX), "--prefix", "16M", "--private", "16M", "--processes", "3",
                           "--seconds", "30", "--report", "10"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        starts = {}
        while len(starts) < 3:
            line = json.loads(sp.stdout.readline())
            if line["event"] == "start":
                starts[line["pid"]] = line

        def found() -> dict[int, tuple]:
            out = {}
            for pid, st in starts.items():
                regions = d.ask("regions", pid=pid)["regions"]
                prefix = [r for r in regions if r["start"] <= st["prefix_addr"] < r["start"] + r["length"]]
                private = [r for r in regions if r["start"] <= st["private_addr"] < r["start"] + r["length"]]
                if prefix and private:
                    out[pid] = (prefix[0]["shared_blocks"], prefix[0]["max_sharers"],
                                private[0]["shared_blocks"], prefix[0]["blocks"])
            return out
        deadline = time.monotonic() + 60          # a safety limit: the scan takes a few ticks here
        while time.monotonic() < deadline:
            got = found()
            if len(got) == 3 and all(p[0] >= 8 and p[1] == 3 for p in got.values()):
                break
            time.sleep(0.2)
        assert len(got) == 3 and all(p[1] == 3 and p[2] == 0 and p[0] >= 8 for p in got.values()), got
        pid = next(iter(starts))
        heat = d.ask("heat", pid=pid)["blocks"]
        by_address = dict(zip(heat["address"], heat["sharers"]))
        prefix_blocks = [starts[pid]["prefix_addr"] + i * (2 << 20) for i in range(8)]
        assert [by_address.get(a) for a in prefix_blocks] == [3] * 8, by_address
        while time.monotonic() < deadline:       # the three rows of each prefix block made one
            sharing = d.ask("status")["sharing"]
            if sharing["alias_groups"] >= 8:
                break
            time.sleep(0.2)
        assert sharing["enabled"] and sharing["shared_blocks"] >= 24 and sharing["alias_groups"] >= 8, sharing
        assert 0 < sharing["pages_examined_per_tick"] <= sharing["pages_per_tick"]
        print(f"sharing scan: {sharing['pages_examined_per_tick']:.0f} pages/tick, "
              f"{sharing['ms_per_tick']:.2f} ms/tick (max {sharing['ms_per_tick_max']:.1f})")
        sp.send_signal(signal.SIGTERM)
        ends = [json.loads(x) for x in sp.communicate(timeout=120)[0].splitlines() if '"end"' in x]
        assert len(ends) == 3 and all(e["ok"] for e in ends) and sp.returncode == 0
        assert d.stop() == 0
    finally:
        sp.kill()
        d.stop(signal.SIGKILL)
    assert numa_balancing() == before
