#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A throw-away etcd cluster on the host's loopback: Debian's ``etcd-server`` (etcd 3.4), three members
by default, each with its own data folder, client and peer port. What the pool's host tests and the
two-host lab use; nothing in it is tieringd's.

    with EtcdCluster(tmp_dir) as etcd:       # started, every member healthy, a leader elected
        etcd.endpoints                        # ["127.0.0.1:PORT", …] (client ports)
        etcd.kill(1); etcd.start_member(1)    # a member killed (SIGKILL) and brought back
        etcd.leader()                         # which member leads now

    etcdcluster.py DIR [--members 3]          # run one until Ctrl-C, printing its endpoints

Standard library only (the lab runner imports it).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

# Generous against the defaults (100 ms, 1 s): the host's two cores are shared with TCG guests, and a
# member that misses heartbeats under that load would start elections that prove nothing.
HEARTBEAT_MS = 200
ELECTION_MS = 2000


class EtcdError(RuntimeError):
    pass


def etcd_binary() -> str | None:
    return shutil.which("etcd")


def free_ports(n: int) -> list[int]:
    """n ports nobody listens on now (bound and released: a tiny race with other programs)."""
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


class EtcdCluster:
    def __init__(self, base: Path, members: int = 3, token: str | None = None):
        self.base = Path(base)
        self.n = members
        ports = free_ports(2 * members)
        self.client_ports, self.peer_ports = ports[:members], ports[members:]
        self.token = token or f"tieringd-{os.getpid()}-{int(time.time())}"
        self.procs: dict[int, subprocess.Popen] = {}
        self._started: set[int] = set()

    @property
    def endpoints(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.client_ports]

    def _args(self, i: int) -> list[str]:
        cluster = ",".join(f"m{k}=http://127.0.0.1:{p}" for k, p in enumerate(self.peer_ports))
        url_c, url_p = f"http://127.0.0.1:{self.client_ports[i]}", f"http://127.0.0.1:{self.peer_ports[i]}"
        return [etcd_binary() or "etcd", "--name", f"m{i}", "--data-dir", str(self.base / f"m{i}"),
                "--listen-client-urls", url_c, "--advertise-client-urls", url_c,
                "--listen-peer-urls", url_p, "--initial-advertise-peer-urls", url_p,
                "--initial-cluster", cluster, "--initial-cluster-token", self.token,
                "--initial-cluster-state", "new" if i not in self._started else "existing",
                "--heartbeat-interval", str(HEARTBEAT_MS), "--election-timeout", str(ELECTION_MS),
                "--logger", "zap", "--log-outputs", str(self.base / f"m{i}.log")]

    def start_member(self, i: int) -> None:
        if i in self.procs and self.procs[i].poll() is None:
            return
        self.base.mkdir(parents=True, exist_ok=True)
        self.procs[i] = subprocess.Popen(self._args(i), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, start_new_session=True)
        self._started.add(i)

    def start(self, timeout_s: float = 60) -> "EtcdCluster":
        if etcd_binary() is None:
            raise EtcdError("etcd is not installed (Debian's etcd-server: make setup)")
        for i in range(self.n):
            self.start_member(i)
        self.wait_healthy(timeout_s)
        return self

    def healthy(self, i: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.endpoints[i]}/health", timeout=2) as r:
                return json.loads(r.read()).get("health") == "true"
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def wait_healthy(self, timeout_s: float = 60, members: list[int] | None = None) -> None:
        """Until every member asked (default: every running one) says healthy: it has a leader."""
        deadline = time.monotonic() + timeout_s
        want = members if members is not None else [i for i, p in self.procs.items() if p.poll() is None]
        while True:
            sick = [i for i in want if not self.healthy(i)]
            if not sick:
                return
            dead = [i for i in want if self.procs[i].poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "; ".join(f"m{i}: {self.log_tail(i)}" for i in (dead or sick))
                raise EtcdError(f"etcd members {dead or sick} not healthy "
                                f"({'exited' if dead else f'after {timeout_s:.0f} s'}): {logs}")
            time.sleep(0.2)

    def _post(self, i: int, path: str, body: dict) -> dict | None:
        """One request to member i's v3 gateway; None when it does not answer."""
        req = urllib.request.Request(f"http://{self.endpoints[i]}/v3/{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return json.loads(r.read())
        except (OSError, ValueError, urllib.error.URLError):
            return None

    def leader(self) -> int | None:
        """The index of the member that leads now (the one whose loss forces an election), or None
        when no running member says."""
        for i, p in self.procs.items():
            st = self._post(i, "maintenance/status", {}) if p.poll() is None else None
            if st and st.get("leader") and st.get("leader") == st.get("header", {}).get("member_id"):
                return i
        return None

    def make_leader(self, i: int, timeout_s: float = 30) -> None:
        """Hand the leadership to member i (etcd's MoveLeader, asked of the leader): a test that
        kills the member its clients talk to then also kills the leader."""
        deadline = time.monotonic() + timeout_s
        while (now := self.leader()) != i:
            target = (self._post(i, "maintenance/status", {}) or {}).get("header", {}).get("member_id")
            if now is not None and target:
                self._post(now, "maintenance/transfer-leadership", {"targetID": target})
            if time.monotonic() > deadline:
                raise EtcdError(f"member {i} did not become the leader in {timeout_s:.0f} s (leader: {now})")
            time.sleep(0.2)

    def log_tail(self, i: int, n: int = 3) -> str:
        try:
            return " | ".join((self.base / f"m{i}.log").read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        p = self.procs.get(i)
        if p is not None and p.poll() is None:
            p.send_signal(sig)
            p.wait(timeout=30)

    def stop(self) -> None:
        for i in list(self.procs):
            self.kill(i, signal.SIGTERM if self.procs[i].poll() is None else signal.SIGKILL)

    def __enter__(self) -> "EtcdCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--members", type=int, default=3)
    args = ap.parse_args(argv)
    with EtcdCluster(args.dir, args.members) as etcd:
        print(",".join(etcd.endpoints), flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
