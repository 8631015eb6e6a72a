# SPDX-License-Identifier: Apache-2.0
"""Memory that arrives at run time: the policy for new DAX devices and memory blocks (what the udev
rules run, ``udev/60-tieringd.rules``), and a kernel-uevent listener (pyroute2) that the daemon owns
to refresh the topology and the tier capacities live.

The listener hears the kernel's own uevents (netlink group 1, before udev has run any rule) for the
``memory``, ``dax``, ``cxl``, ``nd`` and ``node`` subsystems, waits ``debounce_ms`` for a burst to end
(a 1 GiB device is 8 memory blocks, each an ``add`` and an ``online``), then runs
``topology.discover()`` — the same classification, with evidence, as ``tieringctl numa`` — and hands
the loop a :class:`TopologyChange` (nodes added, removed or resized, the new tier capacities). It
also applies the policy itself (``[hotplug] act``, by default ``always``: whichever of it and the udev
rule comes first acts), so a device comes online the same way with or without udev (containers,
minimal guests, rules not installed); a lock file keeps the two from racing.

    listener = HotplugListener(HotplugConfig.from_config(section(cfg, HotplugConfig.NAME))).open()
    selector.register(listener.fileno(), EVENT_READ)     # the loop's event loop
    ...
    change = listener.poll(0)        # after the fd was readable, or each tick: None or a change
    if change: policy.set_tiers(...change.tiers...); mover.set_fallbacks(change.topology...)

``python -m tieringd.memory.hotplug`` runs it alone, one JSON line per change (tests, the lab).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno as _errno
import fcntl
import json
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, Iterable, Iterator

from tieringd.kernel import sysfs
from tieringd.memory import dax, topology as _topology
from tieringd.config import ConfigError, Table, ranged, section
from tieringd.contracts import Tier

log = logging.getLogger("tieringd.hotplug")

SUBSYSTEMS = frozenset({"memory", "dax", "cxl", "nd", "node"})
UDEV_CONTROL = "/run/udev/control"          # systemd-udevd's control socket: udev runs
LOCK_PATH = "/run/tieringd/hotplug.lock"
# Present while a dax device is being onlined: the udev rule for memory blocks then skips the helper
# (the device's own online does its blocks), instead of starting one process per block for nothing.
ONLINING_MARK = "/run/tieringd/hotplug.onlining"

ORIGINS = ("pmem", "cxl-pmem", "cxl-ram", "hmem", "unknown")


@dataclasses.dataclass(frozen=True)
class HotplugConfig(Table):
    """The ``[hotplug]`` table (docs/dax.md)."""
    NAME = "hotplug"
    listen: bool = dataclasses.field(default=True, metadata={
        "doc": "the daemon's loop listens to kernel uevents and refreshes its tiers live"})
    online: tuple[str, ...] = dataclasses.field(default=("cxl-ram", "hmem"), metadata={
        "doc": 'origins of new devdax devices bound to kmem (pmem, cxl-pmem, cxl-ram, hmem, or "all")'})
    zone: str = dataclasses.field(default="movable", metadata={
        "doc": "where their memory goes: movable (can be offlined again), normal, auto"})
    keep_devdax: tuple[str, ...] = dataclasses.field(default=(), metadata={
        "doc": "devices never onlined (used as devdax, e.g. by the DAX-remap tier)"})
    memory_blocks: bool = dataclasses.field(default=True, metadata={
        "doc": "online memory blocks that arrive offline on CPU-less nodes"})
    act: str = dataclasses.field(default="always", metadata={
        "doc": "the listener applies this policy itself: always (whoever of it and udev comes first "
               "acts, the other finds it done), auto (only when no udevd runs), never"})
    debounce_ms: float = ranged(200.0, 0, 60_000, unit="milliseconds")  # a refresh this long after the last event of a burst, at most four debounces after its first

    def validate(self) -> None:
        super().validate()
        for o in self.online:
            if o not in ORIGINS + ("all",):
                raise ConfigError.bad_value("hotplug", "online", "origins among " + ", ".join(ORIGINS + ("all",)), o)
        if self.zone not in dax.ZONES:
            raise ConfigError.bad_value("hotplug", "zone", " | ".join(dax.ZONES), self.zone)
        if self.act not in ("auto", "always", "never"):
            raise ConfigError.bad_value("hotplug", "act", "auto | always | never", self.act)

    def wants(self, origin: str) -> bool:
        return "all" in self.online or origin in self.online


# ---- the policy: what udev and the listener do with a new device -----------------------------------

@contextlib.contextmanager
def _hotplug_lock() -> Iterator[None]:
    """One hot-plug action at a time on this machine (udev helpers and the listener)."""
    try:
        os.makedirs(os.path.dirname(LOCK_PATH), mode=0o755, exist_ok=True)
        fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        yield                               # no /run (tests, read-only roots): nothing to race with
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def _marked(path: str) -> Iterator[None]:
    try:
        open(path, "w").close()
    except OSError:
        pass
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _remap_devices(cfg: dict[str, Any] | None) -> set[str]:
    """A devdax device the DAX-remap tier uses ([dax] path = /dev/daxX.Y), or the pool every host
    maps ([pool] device), is never onlined."""
    paths = (section(cfg or {}, "dax").get("path") or "", section(cfg or {}, "pool").get("device") or "")
    return {os.path.basename(p) for p in paths if isinstance(p, str) and p.startswith("/dev/dax")}


def handle(kind: str, name: str, config: HotplugConfig, cfg: dict[str, Any] | None = None) -> dict[str, Any]:
    """Apply the policy to a device that appeared: ``kind`` dax (a device bound to device_dax), memory
    (a memory block added offline) or cxl (a region: its dax devices). Returns what was done."""
    with _hotplug_lock():
        if kind == "dax":
            return _handle_dax(name, config, cfg)
        if kind == "memory":
            return _handle_block(name, config)
        if kind == "cxl":
            topo = _topology.discover(cfg or {})
            region = next((r for r in topo.cxl_regions if r.name == name), None)
            if region is None:
                return {"kind": kind, "name": name, "action": "none", "why": "no such CXL region"}
            return {"kind": kind, "name": name, "mode": region.mode, "action": "dax devices",
                    "dax": [_handle_dax(d, config, cfg, topo) for d in region.dax_devices]}
    raise ValueError(f"unknown hot-plug kind {kind!r}: expected dax, memory or cxl")


def _handle_dax(name: str, config: HotplugConfig, cfg: dict[str, Any] | None,
                topo: _topology.Topology | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": "dax", "name": name}
    try:
        dev = dax.device(name, topo or _topology.discover(cfg or {}))
    except dax.DaxError as e:
        return {**out, "action": "none", "why": str(e)}
    out.update(origin=dev.origin, mode=dev.mode)
    if name in config.keep_devdax or name in _remap_devices(cfg):
        return {**out, "action": "none", "why": "kept as devdax ([hotplug] keep_devdax / [dax] path / [pool] device)"}
    if dax.released(name):
        return {**out, "action": "none", "why": "released to devdax (tieringctl dax offline --release)"}
    if not config.wants(dev.origin):
        return {**out, "action": "none", "why": f"origin {dev.origin} not in [hotplug] online"}
    if dev.mode == "system-ram" and all(b.state == "online" for b in dev.blocks):
        return {**out, "action": "none", "why": "already system RAM"}
    with _marked(ONLINING_MARK):
        rep = dax.online(name, config.zone)
    return {**out, "action": "online", "node": rep.node, "onlined": len(rep.onlined),
            "failed": {f"memory{k}": v for k, v in rep.failed.items()}, "seconds": round(rep.seconds, 3)}


def _handle_block(name: str, config: HotplugConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": "memory", "name": name}
    if not config.memory_blocks or not name.startswith("memory") or not name[6:].isdigit():
        return {**out, "action": "none", "why": "[hotplug] memory_blocks = false" if not config.memory_blocks
                else "not a memory block"}
    block = dax.memory_block(int(name[6:]))
    if block is None or block.state != "offline":
        return {**out, "action": "none", "why": "not offline (onlined meanwhile)"}
    cpus = sysfs.read_text(f"{_topology.NODE_DIR}/node{block.node}/cpulist", "") if block.node is not None else ""
    if cpus:
        return {**out, "action": "none", "why": f"node {block.node} has CPUs: left to the system's policy"}
    why = dax.set_block_state(block.id, dax.ZONES[config.zone])
    return {**out, "action": "online" if why is None else "failed", "node": block.node, "why": why}


# ---- the listener ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TierCapacity:
    """A NUMA tier as the policy sees it (``plan.TierSpec`` style)."""
    tier: Tier
    nodes: tuple[int, ...]
    capacity_bytes: int
    free_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"tier": self.tier.label, "nodes": list(self.nodes), "capacity_bytes": self.capacity_bytes,
                "free_bytes": self.free_bytes}


def tier_capacities(topo: _topology.Topology) -> list[TierCapacity]:
    """Per tier with memory (GPU HBM is the engine's, never here), fastest first. The DAX-remap tier
    has no node: its capacity is ``remap.DaxTier.capacity()``."""
    out = []
    for tier in Tier:
        nodes = [n for n in topo.nodes if n.tier == tier and n.has_memory]
        if tier != Tier.GPU_HBM and nodes:
            out.append(TierCapacity(tier, tuple(n.id for n in nodes), sum(n.mem_total_bytes for n in nodes),
                                    sum(n.mem_free_bytes for n in nodes)))
    return out


@dataclasses.dataclass
class NodeChange:
    id: int
    tier: Tier
    mem_total_bytes: int
    evidence: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "tier": self.tier.label, "mem_total_bytes": self.mem_total_bytes,
                "evidence": self.evidence}


@dataclasses.dataclass
class TopologyChange:
    """What one refresh found, against the refresh before."""
    topology: _topology.Topology
    tiers: list[TierCapacity]
    added: list[NodeChange]
    removed: list[int]
    resized: list[NodeChange]               # memory onlined or offlined on a node that stays
    events: list[dict[str, Any]]            # the uevents that led to it (action, subsystem, name, t)
    actions: list[dict[str, Any]]           # what the listener did itself (act)
    at: float                               # CLOCK_MONOTONIC of the refresh
    first_event_at: float | None = None     # CLOCK_MONOTONIC when the first of those events was read

    @property
    def nodes_changed(self) -> bool:
        return bool(self.added or self.removed or self.resized)

    def to_dict(self) -> dict[str, Any]:
        return {"tiers": [t.to_dict() for t in self.tiers], "added": [n.to_dict() for n in self.added],
                "removed": self.removed, "resized": [n.to_dict() for n in self.resized],
                "events": self.events, "actions": self.actions, "at": round(self.at, 3),
                "first_event_at": None if self.first_event_at is None else round(self.first_event_at, 3)}


def _node_view(topo: _topology.Topology) -> dict[int, tuple[Tier, int]]:
    return {n.id: (n.tier, n.mem_total_bytes) for n in topo.nodes if n.has_memory}


def diff(before: _topology.Topology | None, after: _topology.Topology) -> tuple[list, list, list]:
    old = _node_view(before) if before is not None else {}
    new = _node_view(after)
    by_id = {n.id: n for n in after.nodes}

    def change(i: int) -> NodeChange:
        n = by_id[i]
        return NodeChange(i, n.tier, n.mem_total_bytes, list(n.evidence))

    added = [change(i) for i in sorted(set(new) - set(old))]
    removed = sorted(set(old) - set(new))
    resized = [change(i) for i in sorted(set(new) & set(old)) if new[i] != old[i]]
    return added, removed, resized


def udev_running() -> bool:
    return os.path.exists(UDEV_CONTROL)


class HotplugListener:
    """Kernel uevents → debounced topology refreshes. Not thread-safe: one owner (the loop)."""

    def __init__(self, config: HotplugConfig | None = None, cfg: dict[str, Any] | None = None, *,
                 on_change: Callable[[TopologyChange], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config or HotplugConfig()
        self.cfg = cfg if cfg is not None else {}
        self.on_change = on_change
        self._clock = clock
        self._sock = None
        self._due: float | None = None       # when the burst being heard is over
        self._first = 0.0
        self._events: list[dict[str, str]] = []
        self._actions: list[dict[str, Any]] = []
        self.topology: _topology.Topology | None = None

    def open(self) -> "HotplugListener":
        from pyroute2 import UeventSocket
        from pyroute2.netlink.uevent import MONITOR_GROUP_KERNEL, MarshalUevent
        sock = UeventSocket()
        sock.bind(MONITOR_GROUP_KERNEL)
        # A memory device arriving is a burst of uevents (two per block): room for them all.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self._sock = sock
        # Datagrams are read here, one recv each, and parsed by pyroute2: its get() reads through an
        # event loop of its own, which leaves select() on the descriptor blind to what it queued.
        self._marshal = MarshalUevent()
        self.topology = _topology.discover(self.cfg)
        return self

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> "HotplugListener":
        return self.open() if self._sock is None else self

    def __exit__(self, *exc) -> None:
        self.close()

    def fileno(self) -> int:
        return self._sock.fileno()

    def acting(self) -> bool:
        return self.config.act == "always" or (self.config.act == "auto" and not udev_running())

    def _read(self) -> None:
        """Every datagram the socket holds now."""
        while select.select([self._sock.fileno()], [], [], 0)[0]:
            try:
                data = self._sock.recv(1 << 16)
            except OSError as e:
                if e.errno != _errno.ENOBUFS:
                    raise
                # The kernel dropped uevents (the buffer overflowed): what happened is unknown, so
                # refresh as if something did.
                log.warning("uevents lost (ENOBUFS): refreshing the topology")
                self._on_uevent({"SUBSYSTEM": "memory", "ACTION": "lost", "DEVPATH": "?"})
                continue
            for msg in self._marshal.parse(data):
                self._on_uevent(dict(msg))

    def _on_uevent(self, msg: dict[str, Any]) -> None:
        subsystem, action = msg.get("SUBSYSTEM"), msg.get("ACTION")
        if subsystem not in SUBSYSTEMS:
            return
        heard = self._clock()
        name = os.path.basename(msg.get("DEVPATH", ""))
        self._events.append({"action": action, "subsystem": subsystem, "name": name, "t": round(heard, 3),
                             **({"driver": msg["DRIVER"]} if "DRIVER" in msg else {})})
        if self.acting():
            # What the udev rules would have run (udev/60-tieringd.rules), on the same events.
            kind = ("dax" if subsystem == "dax" and action == "bind" and msg.get("DRIVER") == "device_dax"
                    else "memory" if subsystem == "memory" and action == "add"
                    else "cxl" if subsystem == "cxl" and action == "add" and name.startswith("region") else None)
            if kind:
                try:
                    self._actions.append(handle(kind, name, self.config, self.cfg))
                except (OSError, dax.DaxError) as e:
                    self._actions.append({"kind": kind, "name": name, "action": "failed", "why": str(e)})
        # Debounce: a refresh once the burst has been quiet for debounce_ms, but never later than
        # four debounces after its first event (a device that keeps onlining blocks is shown growing).
        now, quiet = self._clock(), self.config.debounce_ms / 1000.0
        if self._due is None:
            self._first = heard
        self._due = min(now + quiet, self._first + 4 * quiet)

    def poll(self, timeout: float | None = 0.0) -> TopologyChange | None:
        """Read what arrived, waiting up to ``timeout`` s (None: until there is a change); returns a
        :class:`TopologyChange` when a burst of events is over, else None."""
        deadline = None if timeout is None else self._clock() + timeout
        while True:
            self._read()
            now = self._clock()
            if self._due is not None and now >= self._due:
                return self.refresh()
            if deadline is not None and now >= deadline:
                return None
            until = [t for t in (self._due, deadline) if t is not None]
            select.select([self._sock.fileno()], [], [], max(0.0, min(until) - now) if until else None)

    def refresh(self) -> TopologyChange:
        """Discover now and compare with the last refresh (also without any event: the loop may ask)."""
        topo = _topology.discover(self.cfg)
        added, removed, resized = diff(self.topology, topo)
        change = TopologyChange(topo, tier_capacities(topo), added, removed, resized, self._events,
                                self._actions, self._clock(), self._first if self._events else None)
        self.topology, self._events, self._actions, self._due = topo, [], [], None
        for n in added:
            log.info("node %d appeared: %s, %d MiB (%s)", n.id, n.tier.label, n.mem_total_bytes >> 20,
                     "; ".join(n.evidence))
        for i in removed:
            log.info("node %d has no memory any more", i)
        if self.on_change is not None:
            self.on_change(change)
        return change

    def serve(self, stop: threading.Event, tick_s: float = 0.5) -> None:
        """Poll until ``stop`` is set (``python -m tieringd.memory.hotplug``, or a thread of the loop)."""
        while not stop.is_set():
            self.poll(tick_s)


def udev_event(kind: str, name: str, cfg: dict[str, Any]) -> int:
    """What the udev rules run: the policy for one device, quietly unless it did something."""
    try:
        result = handle(kind, name, HotplugConfig.from_config(section(cfg, HotplugConfig.NAME)), cfg)
    except (ConfigError, dax.DaxError, OSError) as e:
        sys.stderr.write(f"tieringd hotplug {kind} {name}: {e}\n")
        return 1
    if result.get("action") not in (None, "none"):
        sys.stderr.write(f"tieringd hotplug {kind} {name}: {json.dumps(result)}\n")   # udev logs it
    return 1 if result.get("action") == "failed" or result.get("failed") else 0


def _listen(hp: HotplugConfig, cfg: dict[str, Any]) -> int:
    def emit(change: TopologyChange) -> None:
        sys.stdout.write(json.dumps({"event": "change", **change.to_dict()}) + "\n")
        sys.stdout.flush()

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with HotplugListener(hp, cfg, on_change=emit) as listener:
        sys.stdout.write(json.dumps({"event": "listening", "pid": os.getpid(), "acting": listener.acting(),
                                     "tiers": [t.to_dict() for t in tier_capacities(listener.topology)]}) + "\n")
        sys.stdout.flush()
        listener.serve(stop)
    return 0


def _main(argv: Iterable[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tieringd.memory.hotplug",
                                 description="Memory hot-plug: listen to uevents (one JSON line per change), "
                                             "or apply the [hotplug] policy to one device (what udev runs).")
    ap.add_argument("--config", help="config file (default /etc/tieringd/tieringd.toml)")
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="cmd")
    listen = sub.add_parser("listen", help="the listener, as the daemon runs it (the default)")
    listen.add_argument("--act", choices=("auto", "always", "never"), help="override [hotplug] act")
    udev = sub.add_parser("udev", help="the policy for one device: dax daxX.Y | memory memoryN | cxl regionN")
    udev.add_argument("kind", choices=("dax", "memory", "cxl"))
    udev.add_argument("name")
    args = ap.parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="tieringd.memory.hotplug: %(message)s")
    from tieringd import config as _config
    try:
        cfg = _config.load(args.config)
        hp = HotplugConfig.from_config(section(cfg, HotplugConfig.NAME))
    except ConfigError as e:
        sys.stderr.write(f"tieringd.memory.hotplug: {e}\n")
        return 1
    if args.cmd == "udev":
        return udev_event(args.kind, args.name, cfg)
    if getattr(args, "act", None):
        hp = dataclasses.replace(hp, act=args.act)
    return _listen(hp, cfg)


if __name__ == "__main__":
    sys.exit(_main())
