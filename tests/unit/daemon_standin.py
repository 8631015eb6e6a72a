# SPDX-License-Identifier: Apache-2.0
"""A stand-in with the interface of ``tieringd.daemon.Daemon`` (the loop), built from real parts, for
testing the service layer (control socket, metrics, lifecycle, reload) on its own.

Real: a :class:`~tieringd.shim.registry.Registry` listening in a temporary run directory, a
:class:`~tieringd.placement.heat.BlockTable` whose regions come from it (their blocks' nodes queried with
``move_pages``), a :class:`~tieringd.mover.MigrationEngine` with its worker threads, a
:class:`~tieringd.placement.policy.Policy`, an :class:`~tieringd.sampling.access_signal.AccessSignal` chosen from a lab
kernel's captured facts (never started: no kernel setting is touched), the topology of a captured
sysfs tree. Its loop is a selector with the Daemon's ``add_reader``/``call_soon``/``on_ready``; its
tick only fans the registry out into the table and applies what the mover verified — no sampling,
no plan. Nothing here mocks behaviour: what the tests check is what these parts really do.
"""
from __future__ import annotations

import collections
import json
import os
import queue
import selectors
import threading
import time
from pathlib import Path

import numpy as np

from tieringd.kernel import sysfs, numa
from tieringd import settings
from tieringd.memory import topology
from tieringd.sampling.access_signal import AccessSignal, Facts, choose
from tieringd.config import ConfigFile
from tieringd.contracts import FallbackMap, Priority, Tier
from tieringd.placement.heat import BlockTable
from tieringd.kernel.knobs import Knobs
from tieringd.mover import MigrationEngine, MoveRequest
from tieringd.placement.plan import TierSpec
from tieringd.placement.policy import Policy
from tieringd.shim.registry import Registry

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
BLOCK_BYTES = 2 << 20


class TickStats:
    def __init__(self) -> None:
        self.count = 0
        self.overruns = 0
        self.last_duration_ms = 0.0
        self.p50_ms = 0.0
        self.p99_ms = 0.0
        self.last_tick_ns = 0
        self._recent: collections.deque[float] = collections.deque(maxlen=1000)
        self._all: list[float] = []

    def durations_since(self, count: int) -> np.ndarray:
        return np.asarray(self._all[count:], np.float64)

    def record(self, ms: float) -> None:
        self._all.append(ms)
        self.count += 1
        self.last_duration_ms = ms
        self.last_tick_ns = time.monotonic_ns()
        self._recent.append(ms)
        s = sorted(self._recent)
        self.p50_ms, self.p99_ms = s[len(s) // 2], s[min(len(s) - 1, int(len(s) * 0.99))]


class _Counters:
    """Where the daemon has its SamplerSet: only its counters (no sampler runs in the stand-in)."""

    def __init__(self, stats: dict):
        self._stats = stats

    def stats(self) -> dict:
        return self._stats


class StandInDaemon:
    def __init__(self, config: ConfigFile, *, run_dir: str, sysfs_tree: str = "cxl-6.12",
                 facts: str = "cxl-6.12", interval_s: float = 0.05):
        self.config = config
        built = settings.check(config)
        with sysfs.root(FIXTURES / "sysfs" / sysfs_tree):
            self.topology = topology.discover({})
        by_tier: dict[Tier, list] = collections.defaultdict(list)
        for n in self.topology.nodes:
            if n.has_memory:
                by_tier[n.tier].append(n)
        self.tiers = [TierSpec(t, tuple(n.id for n in ns), float(sum(n.mem_total_bytes for n in ns)))
                      for t, ns in sorted(by_tier.items())]
        self.policy = Policy(built.policy, self.tiers)
        self.table = BlockTable(built.heat)
        self.registry = Registry(run_dir)
        self._landed: queue.Queue = queue.Queue()
        self.engine = MigrationEngine(built.mover, FallbackMap(), on_landed=self._landed.put)
        f = Facts.from_dict(json.loads((FIXTURES / "access_signal" / f"{facts}.json").read_text()))
        self.signal = AccessSignal(choose(f), Knobs(os.path.join(run_dir, "knobs.json")))
        self.ticks = TickStats()
        self.moves_by_pid: dict[int, dict] = {}
        self.samplers = _Counters({"fault": {"events": 0, "counted": 0}})
        self.started_ns = time.monotonic_ns()
        self.on_ready: list = []
        self.applied: list[ConfigFile] = []
        self.interval_s = interval_s
        self._tier_of = {n.id: n.tier for n in self.topology.nodes}
        self._rid: dict[tuple[int, int], int] = {}
        self._sel = selectors.DefaultSelector()
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._sel.register(self._wake_fd, selectors.EVENT_READ, None)
        self._soon: collections.deque = collections.deque()
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None

    # ---- the Daemon's loop interface ---------------------------------------------------------
    def add_reader(self, fd: int, callback) -> None:
        self._sel.register(fd, selectors.EVENT_READ, callback)

    def remove_reader(self, fd: int) -> None:
        self._sel.unregister(fd)

    def call_soon(self, fn) -> None:
        self._soon.append(fn)
        os.eventfd_write(self._wake_fd, 1)

    def request_stop(self) -> None:
        self._stop.set()
        os.eventfd_write(self._wake_fd, 1)

    def run(self) -> None:
        self.registry.start()
        self.engine.start()
        try:
            first = True
            next_tick = time.monotonic()
            while not self._stop.is_set():
                for key, _ in self._sel.select(max(0.0, next_tick - time.monotonic())):
                    if key.data is None:
                        try:
                            os.eventfd_read(self._wake_fd)
                        except BlockingIOError:
                            pass
                    else:
                        key.data()
                while self._soon:
                    self._soon.popleft()()
                self.registry.poll(0)
                if time.monotonic() >= next_tick:
                    self.tick()
                    next_tick = time.monotonic() + self.interval_s
                    if first:
                        first = False
                        for fn in self.on_ready:
                            fn()
        finally:
            self.engine.stop()
            self.registry.close()

    def start_thread(self) -> "StandInDaemon":
        self.thread = threading.Thread(target=self.run, name="standin-loop", daemon=True)
        self.thread.start()
        return self

    def stop_thread(self) -> None:
        self.request_stop()
        if self.thread is not None:
            self.thread.join(10)

    def in_loop(self, fn, timeout: float = 5.0):
        """Tests: run ``fn`` in the loop thread and return its result."""
        box, done = [], threading.Event()
        self.call_soon(lambda: (box.append(fn()), done.set()))
        assert done.wait(timeout), "the loop did not run the call"
        return box[0]

    # ---- the tick: registry → table, mover → table ---------------------------------------------
    def tick(self) -> None:
        t0 = time.monotonic()
        live = {(r.pid, r.start): r for r in self.registry.regions()}
        for key in set(self._rid) - set(live):
            self.table.remove_region(self._rid.pop(key))
        for key, r in live.items():
            if key not in self._rid:
                self._rid[key] = self._add(r)
        while not self._landed.empty():
            self._apply_landed(self._landed.get())
        ms = (time.monotonic() - t0) * 1000
        self.ticks.record(ms)

    def _add(self, r) -> int:
        nblocks = -(-r.length // BLOCK_BYTES)
        addrs = [r.start + i * BLOCK_BYTES for i in range(nblocks)]
        try:
            nodes = numa.query_pages(r.pid, addrs)
        except OSError:
            nodes = [-1] * nblocks
        nodes = np.asarray(nodes, np.int64)
        placed = nodes >= 0
        # the table has no "nowhere" tier: a block with no page yet is counted where the first
        # populated one is (node 0 when none is)
        first = int(nodes[placed][0]) if placed.any() else 0
        rid = self.table.add_region(r.pid, r.start, r.length, BLOCK_BYTES, node=first,
                                    tier=self._tier_of.get(first, Tier.DRAM))
        idx = np.arange(self.table.r_first[rid], self.table.r_first[rid] + nblocks)
        tiers = np.array([int(self._tier_of.get(int(n), Tier.DRAM)) for n in nodes[placed]], np.int64)
        self.table.set_location(idx[placed], nodes[placed], tiers)
        return rid

    def _apply_landed(self, rows) -> None:
        if len(rows) == 0:
            return
        ps = numa.PAGE_SIZE
        row, block = self.table.locate(rows["pid"], rows["start"], rows["npages"].astype(np.uint64) * ps)
        if len(block) == 0:
            return
        node = rows["node"][row].astype(np.int64)
        old_tier = self.table.tier[block].astype(np.int64)
        tiers = np.array([int(self._tier_of.get(int(n), Tier.DRAM)) for n in node], np.int64)
        size = self.table.size[block]
        pids = rows["pid"][row]
        self.table.set_location(block, node, tiers)
        for pid, was, now, b in zip(pids.tolist(), old_tier.tolist(), tiers.tolist(), size.tolist()):
            if was != now:
                m = self.moves_by_pid.setdefault(int(pid), {"promoted_bytes": 0.0, "demoted_bytes": 0.0})
                m["promoted_bytes" if now < was else "demoted_bytes"] += b

    # ---- what the service calls ----------------------------------------------------------------
    def apply_config(self, cfg: ConfigFile) -> None:
        built = settings.check(cfg)             # raises ConfigError; nothing changed then
        self.policy = Policy(built.policy, self.tiers)
        self.config = cfg
        self.applied.append(cfg)

    def submit_move(self, pid: int, ranges, target, priority: Priority):
        return self.engine.submit(MoveRequest(pid, list(ranges), target, priority))
