# SPDX-License-Identifier: Apache-2.0
"""DAX devices as system RAM: bind a devdax device to kmem and online its memory, or move its pages
away and offline it again — the kernel knowledge behind ``tieringctl dax``, the udev rules and the
uevent listener (docs/dax.md).

The kernel interfaces (all through :mod:`tieringd.kernel.sysfs`):

- ``/sys/bus/dax/devices/daxX.Y/{resource,size,target_node,mappingN/{start,end}}``: the device's
  physical ranges; ``/sys/bus/dax/drivers/{device_dax,kmem}/{bind,unbind,new_id}`` (the dax bus takes a
  device *name* in ``new_id`` and attaches at once, drivers/dax/bus.c ``do_id_store``);
- ``/sys/devices/system/memory/{block_size_bytes,auto_online_blocks,memoryN/{state,valid_zones}}``.
  kmem adds only whole memory blocks of its range (drivers/dax/kmem.c aligns the start up and the end
  down to ``memory_block_size_bytes()``).

**Auto-online.** With ``auto_online_blocks`` = ``online`` (Debian's 6.12+ kernels:
``CONFIG_MHP_DEFAULT_ONLINE_TYPE_ONLINE_AUTO``) the kernel onlines kmem's blocks the moment they are
added, into a zone chosen by the kernel (ZONE_NORMAL here), where unmovable kernel allocations can
later pin them, and ``daxctl reconfigure-device`` refuses ("kernel policy will auto-online memory").
:func:`online` *borrows* the setting: ``offline`` for the bind, then onlines every block itself in
the zone asked for (ZONE_MOVABLE by default, so that :func:`offline` can take it back) and puts the
setting back — on every path.
"""
from __future__ import annotations

import dataclasses
import errno as _errno
import logging
import os
import subprocess
import time
from typing import Any, Callable, Iterator

import numpy as np

from tieringd.kernel import procfs, sysfs, numa
from tieringd.memory import topology as _topology
from tieringd.contracts import Priority, Tier
from tieringd.mover import MigrationEngine, MoveRequest

log = logging.getLogger("tieringd.dax")

MEMORY_DIR = "/sys/devices/system/memory"
DAX_BUS = "/sys/bus/dax"
ZONES = {"movable": "online_movable", "normal": "online_kernel", "auto": "online"}
# Devices handed back to devdax on purpose (``offline(release=True)``): the hot-plug policy leaves
# them alone, though handing back binds device_dax, which is what the udev rule acts on.
RELEASED_DIR = "/run/tieringd/released"


class DaxError(Exception):
    """An operation that cannot be done, with the reason a person can act on."""

    def __init__(self, message: str, code: int = _errno.EINVAL):
        super().__init__(message)
        self.code = code


@dataclasses.dataclass
class MemoryBlock:
    id: int
    state: str                      # online | offline | going-offline
    zone: str | None                # the zone it is online in (Movable, Normal), None when offline
    node: int | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class DaxDeviceState:
    """A dax device and the memory blocks of its range."""
    name: str
    mode: str                       # devdax | system-ram | unbound
    size_bytes: int | None
    origin: str
    parent: str | None
    target_node: int | None
    blocks: list[MemoryBlock]
    block_size_bytes: int

    @property
    def online_bytes(self) -> int:
        return sum(self.block_size_bytes for b in self.blocks if b.state == "online")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "mode": self.mode, "size_bytes": self.size_bytes, "origin": self.origin,
                "parent": self.parent, "target_node": self.target_node, "online_bytes": self.online_bytes,
                "blocks": [b.to_dict() for b in self.blocks]}


# ---- reading -------------------------------------------------------------------------------------

def block_size_bytes() -> int:
    return int(sysfs.read_text(f"{MEMORY_DIR}/block_size_bytes"), 16)


def memory_block(block_id: int) -> MemoryBlock | None:
    base = f"{MEMORY_DIR}/memory{block_id}"
    state = sysfs.read_text(f"{base}/state", None)
    if state is None:
        return None
    zones = sysfs.read_text(f"{base}/valid_zones", "") or ""
    nodes = [int(os.path.basename(p)[4:]) for p in sysfs.glob(f"{base}/node[0-9]*")]
    # An online block's valid_zones is the zone it is in; an offline block's lists the candidates.
    return MemoryBlock(block_id, state, zones.split()[0] if state == "online" and zones else None,
                       nodes[0] if nodes else None)


def device_ranges(name: str) -> list[tuple[int, int]]:
    """Physical [start, end) ranges of a dax device: ``mappingN`` (Linux 5.10, several ranges), else
    ``resource`` + ``size``."""
    base = f"{DAX_BUS}/devices/{name}"
    out = []
    for m in sorted(sysfs.glob(f"{base}/mapping[0-9]*"), key=lambda p: int(p.rsplit("mapping", 1)[1])):
        start, end = int(sysfs.read_text(f"{m}/start"), 16), int(sysfs.read_text(f"{m}/end"), 16)
        out.append((start, end + 1))
    if not out:
        start = int(sysfs.read_text(f"{base}/resource"), 16)
        out.append((start, start + int(sysfs.read_text(f"{base}/size"))))
    return out


def device_block_ids(name: str, block_bytes: int | None = None) -> list[int]:
    """The memory blocks kmem makes of the device: whole blocks inside each range."""
    bs = block_bytes or block_size_bytes()
    ids: list[int] = []
    for start, end in device_ranges(name):
        ids += range(-(-start // bs), end // bs)
    return ids


def devices(topo: _topology.Topology | None = None) -> list[DaxDeviceState]:
    """Every dax device with the state of its memory blocks."""
    topo = topo or _topology.discover({})
    bs = block_size_bytes() if sysfs.exists(f"{MEMORY_DIR}/block_size_bytes") else 0
    out = []
    for d in topo.dax_devices:
        ids = device_block_ids(d.name, bs) if bs else []
        blocks = [b for b in (memory_block(i) for i in ids) if b is not None]
        out.append(DaxDeviceState(d.name, d.mode, d.size_bytes, d.origin, d.parent, d.target_node, blocks, bs))
    return out


def device(name: str, topo: _topology.Topology | None = None) -> DaxDeviceState:
    for d in devices(topo):
        if d.name == name:
            return d
    known = ", ".join(d.name for d in devices(topo)) or "none"
    raise DaxError(f"no dax device {name} (dax devices: {known})", _errno.ENODEV)


def released(name: str) -> bool:
    return os.path.exists(os.path.join(RELEASED_DIR, name))


def _mark_released(name: str, on: bool) -> None:
    marker = os.path.join(RELEASED_DIR, name)
    try:
        if on:
            os.makedirs(RELEASED_DIR, mode=0o755, exist_ok=True)
            open(marker, "w").close()
        elif os.path.exists(marker):
            os.unlink(marker)
    except OSError as e:
        log.warning("cannot %s %s: %s", "write" if on else "remove", marker, e.strerror)


# ---- borrowed setting ----------------------------------------------------------------------------

class borrowed_auto_online:
    """``auto_online_blocks`` set to ``value`` for a ``with`` block and put back on every exit (global
    kernel state: docs/dax.md says so). A kernel without the file (no memory hot-plug) is left alone."""

    PATH = f"{MEMORY_DIR}/auto_online_blocks"

    def __init__(self, value: str = "offline"):
        self.value = value
        self.original: str | None = None

    def __enter__(self) -> "borrowed_auto_online":
        self.original = sysfs.read_text(self.PATH, None)
        if self.original is not None and self.original != self.value:
            sysfs.write_text(self.PATH, self.value)
            log.info("borrowed %s: %s -> %s", self.PATH, self.original, self.value)
        return self

    def __exit__(self, *exc) -> None:
        if self.original is not None and self.original != self.value:
            sysfs.write_text(self.PATH, self.original)
            log.info("restored %s: %s", self.PATH, self.original)


# ---- online --------------------------------------------------------------------------------------

@dataclasses.dataclass
class OnlineReport:
    device: str
    node: int | None
    zone: str
    bound: bool = False                     # kmem was bound now (else it already was)
    onlined: list[int] = dataclasses.field(default_factory=list)
    already: list[int] = dataclasses.field(default_factory=list)
    failed: dict[int, str] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _ensure_kmem() -> None:
    if not sysfs.is_dir(f"{DAX_BUS}/drivers/kmem"):
        # The module is the dax bus's system-RAM driver (CONFIG_DEV_DAX_KMEM); lab guests load it.
        subprocess.run(["modprobe", "-q", "kmem"], check=False)
    if not sysfs.is_dir(f"{DAX_BUS}/drivers/kmem"):
        raise DaxError("the kmem driver is not available (modprobe kmem failed: CONFIG_DEV_DAX_KMEM?)",
                       _errno.ENODEV)


def _bind_kmem(name: str) -> None:
    drv = sysfs.readlink(f"{DAX_BUS}/devices/{name}/driver", None)
    if drv and os.path.basename(drv) != "kmem":
        sysfs.write_text(f"{DAX_BUS}/drivers/{os.path.basename(drv)}/unbind", name)
    sysfs.write_text(f"{DAX_BUS}/drivers/kmem/new_id", name)   # adds the id and attaches
    drv = sysfs.readlink(f"{DAX_BUS}/devices/{name}/driver", None)
    if not drv or os.path.basename(drv) != "kmem":
        raise DaxError(f"{name}: kmem did not bind (see dmesg)", _errno.EIO)


def set_block_state(block_id: int, state: str) -> str | None:
    """Writes memoryN/state; None on success, else the reason."""
    try:
        sysfs.write_text(f"{MEMORY_DIR}/memory{block_id}/state", state)
        return None
    except sysfs.SysfsError as e:
        return e.strerror


def online(name: str, zone: str = "movable", topo: _topology.Topology | None = None) -> OnlineReport:
    """Make ``name`` system RAM: bind it to kmem (unless it is) and online every block of its range in
    ``zone`` (movable | normal | auto). Idempotent."""
    if zone not in ZONES:
        raise DaxError(f"zone {zone!r}: expected one of {', '.join(ZONES)}")
    t0 = time.monotonic()
    dev = device(name, topo)
    rep = OnlineReport(name, dev.target_node, zone)
    _mark_released(name, False)
    if dev.mode != "system-ram":
        _ensure_kmem()
        with borrowed_auto_online("offline"):
            _bind_kmem(name)
        rep.bound = True
    for block_id in device_block_ids(name):
        b = memory_block(block_id)
        if b is None:
            rep.failed[block_id] = "no such memory block (kmem did not add it)"
        elif b.state == "online":
            rep.already.append(block_id)
        else:
            why = set_block_state(block_id, ZONES[zone])
            if why is None:
                rep.onlined.append(block_id)
            else:
                rep.failed[block_id] = why
    rep.node = memory_node(device_block_ids(name)) if rep.node is None else rep.node
    rep.seconds = time.monotonic() - t0
    if rep.failed:
        log.warning("%s: %d memory blocks did not come online: %s", name, len(rep.failed),
                    "; ".join(f"memory{k}: {v}" for k, v in sorted(rep.failed.items())[:4]))
    return rep


def memory_node(block_ids: list[int]) -> int | None:
    for i in block_ids:
        b = memory_block(i)
        if b is not None and b.node is not None:
            return b.node
    return None


# ---- offline -------------------------------------------------------------------------------------

@dataclasses.dataclass
class OfflineReport:
    device: str
    node: int | None
    targets: list[int] = dataclasses.field(default_factory=list)
    moved_pages: int = 0
    left_pages: dict[str, int] = dataclasses.field(default_factory=dict)   # mover outcomes not moved
    processes: int = 0
    offlined: list[int] = dataclasses.field(default_factory=list)
    released: bool = False
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def target_nodes(topo: _topology.Topology, node: int) -> list[int]:
    """Where the pages of ``node`` go: the nodes of its own tier first, then the tiers nearest to it
    (slower before faster at the same step), nearest first within a tier; never GPU memory."""
    me = topo.node(node)

    def key(n: _topology.Node):
        step = int(n.tier) - int(me.tier)
        return (abs(step), step < 0, me.distances.get(n.id, 1 << 16), n.id)

    return [n.id for n in sorted((n for n in topo.nodes if n.id != node and n.has_memory
                                  and n.tier != Tier.GPU_HBM), key=key)]


def _runs_on_node(pid: int, start: int, npages: int, node: int) -> list[tuple[int, int]]:
    """(start, length) runs of the pages of [start, start + npages pages) that are on ``node`` now."""
    out: list[tuple[int, int]] = []
    step = 1 << 18                              # 1 GiB of 4 KiB pages per query
    for first in range(0, npages, step):
        addrs = np.arange(start + first * numa.PAGE_SIZE, start + min(npages, first + step) * numa.PAGE_SIZE,
                          numa.PAGE_SIZE, dtype=np.uint64)
        try:
            where = numa.query_pages_array(pid, addrs)
        except OSError:
            return out                          # gone meanwhile
        on = addrs[where == node]
        if len(on):
            brk = np.flatnonzero(np.diff(on.astype(np.int64)) != numa.PAGE_SIZE) + 1
            for run in np.split(on, brk):
                out.append((int(run[0]), len(run) * numa.PAGE_SIZE))
    return out


def pages_on_node(node: int) -> Iterator[tuple[int, list[tuple[int, int]]]]:
    """(pid, runs) for every process with pages on ``node`` (numa_maps says which VMAs; a move_pages
    query says which pages)."""
    for pid in procfs.pids():
        rows = [r for r in procfs.read_numa_maps(pid) if r.pages_by_node.get(node)]
        if not rows:
            continue
        vmas = {v.start: v for v in procfs.read_maps(pid, [])}
        runs: list[tuple[int, int]] = []
        for r in rows:
            v = vmas.get(r.start)
            if v is not None and r.page_kb * 1024 == numa.PAGE_SIZE and not v.no_struct_pages:
                runs += _runs_on_node(pid, v.start, v.length // numa.PAGE_SIZE, node)
        if runs:
            yield pid, runs


def _node_bytes(topo: _topology.Topology, node: int) -> tuple[int, int]:
    n = topo.node(node)
    return n.mem_total_bytes - n.mem_free_bytes, n.mem_free_bytes


def _write_with_timeout(path: str, value: str, timeout_s: float) -> str | None:
    """Write a sysfs file in a child process, so that a write the kernel keeps retrying (offlining
    memory with a page pinned for I/O) can be given up on: the kernel stops at a signal (mm/
    memory_hotplug.c offline_pages: "signal backoff") and leaves the block as it was. None on success."""
    try:
        r = subprocess.run(["/bin/sh", "-c", 'printf %s "$1" > "$2"', "sh", value, sysfs.path(path)],
                           capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"still busy after {timeout_s:g} s (pages that cannot migrate: pinned?)"
    return None if r.returncode == 0 else (r.stderr.strip().rsplit(":", 1)[-1].strip() or "failed")


def offline(name: str, *, timeout_s: float = 60.0, release: bool = False,
            topo: _topology.Topology | None = None,
            engine_factory: Callable[[], Any] | None = None) -> OfflineReport:
    """Move the pages of ``name``'s node to other nodes through the mover, then offline its memory
    blocks (and with ``release``, hand the device back to device_dax). Refuses (DaxError) before
    touching anything when the other nodes have no room; rolls back the blocks it offlined when one
    cannot go (unmovable pages)."""
    t0 = time.monotonic()
    topo = topo or _topology.discover({})
    dev = device(name, topo)
    if dev.mode != "system-ram" or not dev.online_bytes:
        why = "kmem holds it, every memory block offline" if dev.mode == "system-ram" else f"mode {dev.mode}"
        raise DaxError(f"{name} is not online as system RAM ({why}): nothing to offline", _errno.EALREADY)
    node = dev.target_node if dev.target_node is not None else memory_node([b.id for b in dev.blocks])
    rep = OfflineReport(name, node)
    rep.targets = target_nodes(topo, node)
    used, _ = _node_bytes(topo, node)
    room = sum(_node_bytes(topo, t)[1] for t in rep.targets)
    margin = max(64 << 20, room // 50)
    if used > room - margin:
        raise DaxError(f"not enough room elsewhere: {used >> 20} MiB in use on node {node}, "
                       f"{room >> 20} MiB free on nodes {sysfs.format_list(rep.targets) or 'none'} "
                       f"(keeping {margin >> 20} MiB)", _errno.ENOMEM)
    kernel_zone = [b.id for b in dev.blocks if b.state == "online" and b.zone not in (None, "Movable")]
    if kernel_zone:
        log.warning("%s: blocks %s are online in a kernel zone: unmovable kernel pages may keep them",
                    name, sysfs.format_list(kernel_zone))

    # No fallbacks in the engine: this loop is the fallback chain (rep.targets, nearest tier first).
    engine = (engine_factory or MigrationEngine)()
    for pid, runs in pages_on_node(node):
        rep.processes += 1
        report = None
        for target in rep.targets:
            ticket = engine.submit(MoveRequest(pid, runs, target, Priority.PROMOTE))
            engine.run_until_idle()
            report = ticket.wait(0)
            rep.moved_pages += report.moved_pages
            # What is still on the node (the target was full, or a page was busy): the next target.
            runs = [r for s, n in runs for r in _runs_on_node(pid, s, n // numa.PAGE_SIZE, node)]
            if not runs:
                break
        if runs and report is not None:
            for reason, n in report.by_reason().items():
                if str(reason) not in ("moved", "already-there", "fallback") and n:
                    rep.left_pages[str(reason)] = rep.left_pages.get(str(reason), 0) + n

    # The mover's pass leaves what it may not move (shared, pinned, page cache of other users): the
    # kernel's own offlining migrates the movable rest, block by block.
    done: list[int] = []
    for b in sorted(dev.blocks, key=lambda b: b.id, reverse=True):
        if b.state != "online":
            continue
        why = _write_with_timeout(f"{MEMORY_DIR}/memory{b.id}/state", "offline", timeout_s)
        if why is not None:
            for back in done:
                set_block_state(back, "online_movable")
            hint = " (online in a kernel zone: it holds unmovable pages)" if b.id in kernel_zone else ""
            raise DaxError(f"memory{b.id} of {name} cannot go offline: {why}{hint}; "
                           f"the {len(done)} blocks offlined before it are online again", _errno.EBUSY)
        done.append(b.id)
    rep.offlined = sorted(done)
    if release:
        _mark_released(name, True)      # before device_dax binds: the udev rule must not online it
        sysfs.write_text(f"{DAX_BUS}/drivers/kmem/unbind", name)
        sysfs.write_text(f"{DAX_BUS}/drivers/device_dax/bind", name)
        rep.released = True
    rep.seconds = time.monotonic() - t0
    return rep
