# SPDX-License-Identifier: Apache-2.0
"""[control], [metrics] and [lifecycle]: the service around the daemon (``Service(daemon, cfg,
settings)``, as ``tieringd`` builds it) — who its control socket lets in and how it bounds clients,
its metrics endpoint, and how its lifecycle watcher learns of exits."""
from __future__ import annotations

import contextlib
import grp
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

from tieringd.contracts import Tier
from tieringd.service.control import Client, Deferred, Peer, socket_path
from tieringd.service.lifecycle import ProcessWatcher, wait_readable
from tieringd.service.metrics import Exporter, take as take_snapshot
from tieringd.service.service import Service
from tieringd.shim.registry import Registry

from keyprobe import Ctx, probe

MiB = 1 << 20


def with_registry(ctx: Ctx, text: str):
    """A daemon built from ``text`` with its shim registry (not listening: no shim here)."""
    d = ctx.daemon(text)
    d.registry = Registry(d.run_dir)
    return d


@contextlib.contextmanager
def serving(ctx: Ctx, text: str = "", parts: bool = False):
    """The service of a daemon built from ``text`` with its control socket listening, and a thread in
    the loop's place dispatching what the loop's selector reports (readers, ``call_soon``).
    ``parts``: the lifecycle watcher and the metrics endpoint started too."""
    d = with_registry(ctx, text)
    svc = Service(d, d.settings.source, d.settings, run_dir=d.run_dir)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            for key, _ in d._sel.select(0.02):
                key.data()
    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        if parts:
            svc.start()
        else:
            svc.control.start()
        yield svc
    finally:
        stop.set()
        t.join(5)
        svc.stop() if parts else svc.control.close()


def connect(svc: Service) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(socket_path(svc.run_dir))
    return s


def reply(s: socket.socket, line: bytes) -> dict:
    """The answer to ``line``; a server that answered at once and closed (busy) may have closed
    before the request went out: its answer is read all the same."""
    try:
        s.sendall(line)
    except BrokenPipeError:
        pass
    return json.loads(s.makefile("rb").readline())


# ---- [control] ------------------------------------------------------------------------------------

@probe("control", "group")
def _(ctx):
    """Members of the group named may use the control socket; others are refused, and told why."""
    group = grp.getgrgid(os.getgid())
    member = Peer(pid=1, uid=54321, gid=group.gr_gid, groups=())
    with serving(ctx) as svc:
        assert "may not use the tieringd control socket" in svc.control.access.refusal(member)
    with serving(ctx, f'[control]\ngroup = "{group.gr_name}"\n') as svc:
        assert svc.control.access.refusal(member) is None


@probe("control", "max_clients")
def _(ctx):
    """One client at a time: the next connection is told the daemon is busy (root, as this test
    usually runs, first takes its one reserved slot)."""
    status = b'{"id": 1, "request": "tiers"}\n'
    held = 2 if os.geteuid() == 0 else 1
    for text, answer in (("[control]\nroot_reserved_clients = 1\n", True),
                         ("[control]\nmax_clients = 1\nroot_reserved_clients = 1\n", False)):
        with serving(ctx, text) as svc:
            holders = [connect(svc) for _ in range(held)]
            last = connect(svc)
            got = reply(last, status)
            assert got["ok"] is answer and (answer or got["error"]["code"] == "busy"), got
            for s in holders + [last]:
                s.close()


@probe("control", "root_reserved_clients")
def _(ctx):
    """Root's connections beyond max_clients: with one slot and two reserved, root's third connection
    is answered; with one reserved, it is told the daemon is busy. (Only a root peer, as SO_PEERCRED
    says, has the reserve: run as another user, the probe reads the limit each peer gets.)"""
    status = b'{"id": 1, "request": "tiers"}\n'
    for reserved, answer in ((2, True), (1, False)):
        with serving(ctx, f"[control]\nmax_clients = 1\nroot_reserved_clients = {reserved}\n") as svc:
            if os.geteuid() != 0:
                root, member = Peer(1, 0, 0, ()), Peer(1, os.getuid(), os.getgid(), ())
                assert (svc.control.client_limit(root), svc.control.client_limit(member)) == (1 + reserved, 1)
                continue
            holders = [connect(svc), connect(svc)]
            last = connect(svc)
            got = reply(last, status)
            assert got["ok"] is answer and (answer or got["error"]["code"] == "busy"), got
            for s in holders + [last]:
                s.close()


@probe("control", "max_line_bytes")
def _(ctx):
    """A 4 KiB bound: 5 KiB of a request line without its end are refused as too long (1 MiB: the
    daemon waits for the rest)."""
    start = b'{"id": 1, "request": "tiers", "x": "' + b"a" * 5000
    for text, code in (("", "bad-request"), ('[control]\nmax_line_bytes = "4K"\n', "too-long")):
        with serving(ctx, text) as svc:
            s = connect(svc)
            s.sendall(start)
            s.settimeout(0.5)
            with contextlib.suppress(TimeoutError):
                got = json.loads(s.makefile("rb").readline())
                assert got["error"]["code"] == code == "too-long"
                s.close()
                continue
            assert reply(s, b'"}\n')["error"]["code"] == code        # the rest: a whole line, judged
            s.close()


@probe("control", "max_backlog_bytes")
def _(ctx):
    """A 64 KiB bound: a client that sends requests and reads no reply is cut off (64 MiB: kept)."""
    for text, kept in (("", True), ('[control]\nmax_backlog_bytes = "64K"\n', False)):
        with serving(ctx, text) as svc:
            hog = connect(svc)
            hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            hog.settimeout(0.2)
            with contextlib.suppress(OSError):
                for _ in range(2000):           # ~1 KiB replies: beyond the socket buffers and 64 KiB
                    hog.sendall(b'{"request": "tiers"}\n')
            deadline = time.monotonic() + 5
            while svc.control.status()["clients"] and time.monotonic() < deadline and not kept:
                time.sleep(0.05)
            time.sleep(0.2)
            assert (svc.control.status()["clients"] == 1) is kept
            hog.close()


@probe("control", "heat_max_blocks")
def _(ctx):
    """Three blocks per heat reply: a client asking for all ten gets three (and pages with offset)."""
    for text, count in (("", 10), ("[control]\nheat_max_blocks = 3\n", 3)):
        with serving(ctx, text) as svc:
            svc.d.call_soon(lambda: svc.d.table.add_region(4242, 0x7F00_0000_0000, 10 * MiB, MiB, node=0,
                                                           tier=Tier.DRAM))
            with Client(svc.run_dir) as c:
                assert c.request("heat", pid=4242, limit=1000)["count"] == count


@probe("control", "max_pending_migrations")
def _(ctx):
    """One migrate waiting at a time: a second while the first waits is told to try again."""
    for text, second_ok in (("", True), ("[control]\nmax_pending_migrations = 1\n", False)):
        release = threading.Event()
        with serving(ctx, text) as svc:
            svc.control.handlers["migrate"] = (lambda r: Deferred(lambda: (release.wait(5), {"done": True})[1]), ())
            s = connect(svc)
            s.sendall(b'{"id": 1, "request": "migrate"}\n{"id": 2, "request": "migrate"}\n')
            f = s.makefile("rb")
            if second_ok:
                release.set()
                got = {m["id"]: m for m in (json.loads(f.readline()), json.loads(f.readline()))}
                assert got[1]["ok"] and got[2]["ok"]
            else:
                busy = json.loads(f.readline())
                release.set()
                assert busy["id"] == 2 and busy["error"]["code"] == "busy"
            s.close()


# ---- [metrics] ------------------------------------------------------------------------------------

@probe("metrics", "listen")
def _(ctx):
    """An address: the service serves Prometheus metrics there (by default: no endpoint)."""
    lifecycle = '[lifecycle]\nsource = "poll"\n'
    with serving(ctx, lifecycle, parts=True) as svc:
        assert svc.metrics is None
    with serving(ctx, lifecycle + '[metrics]\nlisten = "127.0.0.1:0"\n', parts=True) as svc:
        host, port = svc.metrics.address
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
            assert b"tieringd_tier_capacity_bytes" in r.read()


@probe("metrics", "snapshot_timeout_ms")
def _(ctx):
    """50 ms: a scrape does not wait for a loop that answers 300 ms later (1 s: it gets the snapshot)."""
    def scraped(text: str) -> bool:
        d = with_registry(ctx, text)
        svc = Service(d, d.settings.source, d.settings, run_dir=d.run_dir)
        exporter = Exporter(d, d.settings.metrics, lambda: take_snapshot(d, svc._service_counts()))
        answer = threading.Timer(0.3, d._woken)                  # the loop, busy for 300 ms
        answer.start()
        try:
            return exporter.fresh() is not None
        finally:
            answer.join()
    assert scraped("") and not scraped("[metrics]\nsnapshot_timeout_ms = 50\n")


# ---- [lifecycle] ----------------------------------------------------------------------------------

@probe("lifecycle", "source")
def _(ctx):
    """poll: the watcher polls /proc, where auto subscribes to the kernel's process events (or says why not)."""
    for text in ("", '[lifecycle]\nsource = "poll"\n'):
        w = ProcessWatcher(ctx.settings(text).lifecycle)
        try:
            status = w.status()
        finally:
            w.close()
        if text:
            assert status["mechanism"] == "/proc polling" and status["why"] == '[lifecycle] source = "poll"'
        else:
            assert status["why"] != '[lifecycle] source = "poll"'


@probe("lifecycle", "poll_interval_ms")
def _(ctx):
    """Polling every 10 ms: a watched process's exit is heard at once (every second: not within 300 ms)."""
    def heard(text: str, within_s: float) -> bool:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        w = ProcessWatcher(ctx.settings('[lifecycle]\nsource = "poll"\n' + text).lifecycle)
        try:
            w.watch([child.pid])
            child.kill()
            child.wait()
            return wait_readable(w.fileno(), within_s) and [e.kind for e in w.handle()] == ["exit"]
        finally:
            w.close()
    assert not heard("", 0.3) and heard("poll_interval_ms = 10\n", 5.0)
