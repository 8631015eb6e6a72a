# SPDX-License-Identifier: Apache-2.0
"""[topology], [hotplug] and [dax]: the tier the daemon gives a node, what the hot-plug listener does
with a device or a memory block that arrives (on a copy of a captured guest's tree, so that its
writes land there), and the DAX-remap tier the loop opens (``DaxTier(registry, settings.dax,
topology=...).open(settings.source)``, as ``Daemon._open_dax`` does)."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import threading
import time

from tieringd.contracts import Tier
from tieringd.kernel import sysfs
from tieringd.memory import hotplug, topology
from tieringd.shim import protocol as P
from tieringd.shim.registry import Registry
from tieringd.shim.remap import DaxTier

from keyprobe import Ctx, probe

MiB = 1 << 20
GiB = 1 << 30


def tiers(d) -> list[str]:
    return [t["tier"] for t in d.status()["tiers"]]


# ---- [topology] -----------------------------------------------------------------------------------

@probe("topology", "nodes")
def _(ctx):
    """Node 1 (CXL memory by its evidence) is the daemon's PMem tier."""
    assert tiers(ctx.daemon()) == ["dram", "cxl-dram"]
    d = ctx.daemon('[topology.nodes.1]\ntier = "pmem"\n')
    assert tiers(d) == ["dram", "pmem"] and int(d._tier_of[1]) == int(Tier.PMEM)


@probe("topology", "probe_file")
def _(ctx):
    """Latencies measured in this boot (7× DRAM's) make a node without HMAT figures PMem, not CXL DRAM."""
    root = ctx.dir() / "root"
    shutil.copytree(ctx.machine("cxl-6.12"), root, symlinks=True)
    for access in ("access0", "access1"):                     # no firmware figures for node 1
        shutil.rmtree(root / "sys/devices/system/node/node1" / access)
    (root / "proc/sys/kernel/random").mkdir(parents=True)
    (root / "proc/sys/kernel/random/boot_id").write_text("boot-of-the-capture\n")
    saved = ctx.dir() / "probe.json"
    saved.write_text(json.dumps({"schema": "tieringd.probe/1", "boot_id": "boot-of-the-capture", "results": [
        {"node": 0, "read_latency_ns": 100.0, "read_bandwidth_mb_s": 40000.0},
        {"node": 1, "read_latency_ns": 700.0, "read_bandwidth_mb_s": 10000.0}]}))
    with sysfs.root(root):
        plain = topology.discover(ctx.file('[topology]\nprobe_file = ""\n'))
        measured = topology.discover(ctx.file(f'[topology]\nprobe_file = "{saved}"\n'))
    assert plain.node(1).tier == Tier.CXL_DRAM and measured.node(1).tier == Tier.PMEM
    assert any("7.0x DRAM" in e for e in measured.node(1).evidence)


# ---- [hotplug]: what the listener does with a uevent -------------------------------------------------

@contextlib.contextmanager
def pmem_guest(ctx: Ctx, state: str):
    """A writable copy of the pmem-6.12 guest's tree with two memory blocks: memory60 (dax0.0's, on
    CPU-less node 2) in ``state``, and memory3 online on node 0; the hot-plug lock and mark in it too."""
    root = ctx.dir() / "root"
    shutil.copytree(ctx.machine("pmem-6.12"), root, symlinks=True)
    mem = root / "sys/devices/system/memory"
    for i, node, now in ((60, 2, state), (3, 0, "online")):
        d = mem / f"memory{i}"
        d.mkdir()
        (d / "state").write_text(now)
        (d / "valid_zones").write_text("Movable")
        (d / f"node{node}").symlink_to(f"../../node/node{node}")
    saved = hotplug.LOCK_PATH, hotplug.ONLINING_MARK
    hotplug.LOCK_PATH, hotplug.ONLINING_MARK = str(root / "hotplug.lock"), str(root / "onlining")
    try:
        with sysfs.root(root):
            yield root
    finally:
        hotplug.LOCK_PATH, hotplug.ONLINING_MARK = saved


DAX_BOUND = {"SUBSYSTEM": "dax", "ACTION": "bind", "DRIVER": "device_dax",
             "DEVPATH": "/devices/platform/e820_pmem/ndbus0/region0/dax0.0/dax0.0"}
BLOCK_ADDED = {"SUBSYSTEM": "memory", "ACTION": "add", "DEVPATH": "/devices/system/memory/memory60"}


def heard(ctx: Ctx, text: str, uevent: dict) -> tuple[list[dict], str]:
    """What the daemon's listener (its [hotplug] and the whole file, as ``_open_hotplug`` hands them)
    did when it heard ``uevent``, and memory60's state after."""
    s = ctx.settings(text)
    with pmem_guest(ctx, "offline" if uevent is BLOCK_ADDED else "online") as root:
        listener = hotplug.HotplugListener(s.hotplug, s.source)
        listener._on_uevent(dict(uevent))                 # as parsed off the netlink socket
        actions = listener.refresh().actions
        return actions, (root / "sys/devices/system/memory/memory60/state").read_text()


def why(actions: list[dict]) -> str:
    assert len(actions) == 1, actions
    return actions[0].get("why") or actions[0]["action"]


@probe("hotplug", "listen")
def _(ctx):
    """false: the daemon opens no uevent listener (it says so); by default it opens one, or says why not."""
    def opened(text: str) -> tuple[bool, str]:
        d = ctx.bare_daemon(text)
        d.topology = topology.Topology(nodes=[])
        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append
        logger = logging.getLogger("tieringd.daemon")
        level = logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            d._open_hotplug()
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
            listening = d.hotplug is not None
            d._close_hotplug()
        return listening, " ".join(r.getMessage() for r in records)
    listening, said = opened("")
    assert listening or "uevent listener" in said
    assert opened("[hotplug]\nlisten = false\n") == (False, "memory hot-plug not followed: [hotplug] listen = false")


@probe("hotplug", "online")
def _(ctx):
    """A pmem device bound to device_dax is the listener's to online once "pmem" is listed."""
    assert why(heard(ctx, "", DAX_BOUND)[0]) == "origin pmem not in [hotplug] online"
    assert why(heard(ctx, '[hotplug]\nonline = ["pmem"]\n', DAX_BOUND)[0]) == "already system RAM"


@probe("hotplug", "zone")
def _(ctx):
    """A memory block that arrives offline on a CPU-less node is onlined into ZONE_NORMAL, not movable."""
    assert heard(ctx, "", BLOCK_ADDED)[1] == "online_movable"
    assert heard(ctx, '[hotplug]\nzone = "normal"\n', BLOCK_ADDED)[1] == "online_kernel"


@probe("hotplug", "keep_devdax")
def _(ctx):
    """dax0.0 is kept as devdax whatever its origin."""
    online_all = '[hotplug]\nonline = ["all"]\n'
    assert why(heard(ctx, online_all, DAX_BOUND)[0]) == "already system RAM"
    assert "kept as devdax" in why(heard(ctx, online_all + 'keep_devdax = ["dax0.0"]\n', DAX_BOUND)[0])


@probe("hotplug", "memory_blocks")
def _(ctx):
    """false: a memory block that arrives offline stays offline."""
    actions, state = heard(ctx, "[hotplug]\nmemory_blocks = false\n", BLOCK_ADDED)
    assert why(actions) == "[hotplug] memory_blocks = false" and state == "offline"


@probe("hotplug", "act")
def _(ctx):
    """never: the listener only refreshes the tiers; the block is left to udev."""
    assert why(heard(ctx, "", BLOCK_ADDED)[0]) == "online"
    actions, state = heard(ctx, '[hotplug]\nact = "never"\n', BLOCK_ADDED)
    assert actions == [] and state == "offline"


@probe("hotplug", "debounce_ms")
def _(ctx):
    """A 50 ms debounce: the refresh comes 100 ms after an event, where 200 ms is still waiting."""
    def refreshed_after_100ms(text: str) -> bool:
        s = ctx.settings(text)
        now = [0.0]
        with pmem_guest(ctx, "online"):
            listener = hotplug.HotplugListener(s.hotplug, s.source, clock=lambda: now[0])
            mine, _peer = socket.socketpair()             # the netlink socket's stand-in: silent
            listener._sock = mine
            try:
                listener._on_uevent({"SUBSYSTEM": "node", "ACTION": "online", "DEVPATH": "/devices/node2"})
                now[0] = 0.1
                return listener.poll(0) is not None
            finally:
                listener.close()
                _peer.close()
    assert not refreshed_after_100ms("") and refreshed_after_100ms("[hotplug]\ndebounce_ms = 50\n")


# ---- [dax]: the DAX-remap tier the loop opens -----------------------------------------------------------

def dax_tier(ctx: Ctx, text: str, file_bytes: int = 256 * MiB, registry=None) -> DaxTier:
    """The tier ``_open_dax`` opens on the captured cxl-6.12 guest (no fsdax mount) with a log file
    of ``file_bytes`` (sparse) that [dax] path names."""
    log = ctx.dir() / "kv.log"
    with open(log, "wb") as f:
        f.truncate(file_bytes)
    d = ctx.daemon(f'[dax]\npath = "{log}"\n' + text)
    s = d.settings
    assert topology.remap_tier(d.topology, s.source) is not None        # _open_dax goes on
    return DaxTier(registry, s.dax, topology=d.topology).open(s.source)


@probe("dax", "path")
def _(ctx):
    """A log file named: the loop has a DAX-remap tier on it, where the guest (no fsdax mount) has none."""
    d = ctx.daemon()
    assert topology.remap_tier(d.topology, d.settings.source) is None
    tier = dax_tier(ctx, "")
    try:
        assert tier.kind == "file" and tier.path.endswith("kv.log") and tier.capacity().capacity_bytes > 0
    finally:
        tier.close()


def geometry(ctx: Ctx, text: str, file_bytes: int = 256 * MiB) -> tuple[int, int, int]:
    """(segments, segment bytes, capacity the policy plans into) of the tier's log."""
    tier = dax_tier(ctx, text, file_bytes)
    try:
        g = tier.log.geometry
        return g.segments, g.segment_bytes, tier.tier_spec().capacity_bytes
    finally:
        tier.close()


@probe("dax", "size_bytes")
def _(ctx):
    """A 32 MiB log on a 16 MiB file: the file grows and the log has twice the segments."""
    seg = 'segment_bytes = "2M"\n'
    assert geometry(ctx, seg, 16 * MiB)[0] == 8
    assert geometry(ctx, seg + 'size_bytes = "32M"\n', 16 * MiB)[0] == 16


@probe("dax", "segment_bytes")
def _(ctx):
    """32 MiB segments: the 256 MiB log is cleaned in 8 units instead of 4."""
    assert geometry(ctx, "")[:2] == (4, 64 * MiB)
    assert geometry(ctx, 'segment_bytes = "32M"\n')[:2] == (8, 32 * MiB)


@probe("dax", "max_write_amplification")
def _(ctx):
    """A bound of 4: segments may be cleaned at 75 % live, so the policy may fill 3/4 of them, not half."""
    assert geometry(ctx, "")[2] == 32 * MiB                 # 0.5 × (4 − 2 reserve − 1 head) × 64 MiB
    assert geometry(ctx, "max_write_amplification = 4.0\n")[2] == 48 * MiB


@probe("dax", "reserve_segments")
def _(ctx):
    """One segment kept for cleaning instead of two: one more segment's worth for the policy."""
    assert geometry(ctx, "reserve_segments = 1\n")[2] == 64 * MiB


@contextlib.contextmanager
def silent_shim(ctx: Ctx, text: str):
    """A DAX tier with a registry and a shim (this process) that says HELLO and never answers; 1 GiB
    of the log adopted as this process's."""
    reg = Registry(str(ctx.dir() / "run")).start()
    shim = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    shim.connect(reg.path)
    shim.send(P.Hello(pid=os.getpid(), agent="probe", seq=1).encode())
    deadline = time.monotonic() + 5
    while not reg.processes() and time.monotonic() < deadline:
        reg.poll(0.05)
    tier = dax_tier(ctx, text, 4 * GiB, registry=reg)
    tier.log.adopt(0, GiB, os.getpid(), 0x7F00_0000_0000)
    try:
        yield tier, shim
    finally:
        shim.close()
        tier.close()
        reg.close()


def still_waiting_after(ctx: Ctx, text: str, seconds: float) -> bool:
    """Whether a promotion of the 1 GiB still waits for the shim's reply after ``seconds`` (then the
    shim hangs up and it ends)."""
    with silent_shim(ctx, text) as (tier, shim):
        t = threading.Thread(target=tier.promote, args=(os.getpid(), 0x7F00_0000_0000, GiB), daemon=True)
        t.start()
        t.join(seconds)
        waiting = t.is_alive()
        shim.close()
        t.join(10)
        assert not t.is_alive()
        return waiting


@probe("dax", "timeout_s")
def _(ctx):
    """50 ms: a remap the shim does not answer is given up at once (30 s: it is still awaited)."""
    assert still_waiting_after(ctx, "timeout_s_per_gib = 0\n", 0.5)
    assert not still_waiting_after(ctx, "timeout_s = 0.05\ntimeout_s_per_gib = 0\n", 0.5)


@probe("dax", "timeout_s_per_gib")
def _(ctx):
    """0 s per GiB: the remap of 1 GiB gets no more than timeout_s (120 s per GiB: two minutes more)."""
    assert still_waiting_after(ctx, "timeout_s = 0.05\n", 0.5)
    assert not still_waiting_after(ctx, "timeout_s = 0.05\ntimeout_s_per_gib = 0\n", 0.5)


@probe("dax", "userfaultfd")
def _(ctx):
    """Each remap request carries the named file as the shim's userfaultfd device."""
    device = ctx.dir() / "uffd"
    device.write_text("")

    def second_fd_is_it(text: str) -> bool:
        with silent_shim(ctx, "timeout_s = 0.05\ntimeout_s_per_gib = 0\n" + text) as (tier, shim):
            tier.promote(os.getpid(), 0x7F00_0000_0000, GiB)
            _, fds, _, _ = socket.recv_fds(shim, 256, 4, socket.MSG_DONTWAIT)
            try:
                return len(fds) == 2 and os.fstat(fds[1]).st_ino == device.stat().st_ino
            finally:
                for fd in fds:
                    os.close(fd)
    assert not second_fd_is_it("")
    assert second_fd_is_it(f'userfaultfd = "{device}"\n')
