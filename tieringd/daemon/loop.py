# SPDX-License-Identifier: Apache-2.0
"""The closed loop: registry → samplers → heat → policy → mover, every ``[policy] interval_ms``.

One thread runs one event loop (:mod:`selectors`, epoll) over

- the registry — its own epoll descriptor (``Registry.fileno()``), polled with timeout 0 when ready;
- a wake-up eventfd, written by mover threads (verified placement), by :meth:`Daemon.call_soon` and by
  :meth:`Daemon.request_stop` (a signal handler);
- sampler descriptors that have one (ring buffers of raw samples), and any reader added with
  :meth:`Daemon.add_reader` (the service's control socket);
- the tick timer (the select timeout).

A tick, each phase timed (debug log; ``ticks``):

1. **apply** — registry events since the last tick fanned out (:mod:`.regions`), regions a RESET left
   stale swept, verified placement applied, finished moves collected, unpopulated blocks re-queried,
   tier capacities refreshed every few seconds (:mod:`.capacity`);
2. **sample** — sampler deltas read and ingested into the block table (hint faults as touches:
   :func:`tieringd.sampling.touches`);
3. **plan** — heat and the plan (``Policy.tick``), the budget less what is still in flight;
4. **move** — the plan's moves handed to the mover (its worker threads, beside the loop), except
   those still in flight; before v6.5 through the shim (:class:`.moves.ShimMover`).

A tick that overruns its interval is counted, and the next starts one interval after it ended (no
queue of missed ticks). The mover's verified placement is the one flow back upstream: worker threads
put ``LANDED_DTYPE`` rows on a queue and wake the loop, which applies them to the table and rebinds
the moved blocks where they landed.

The access signal (:mod:`tieringd.sampling.access_signal`) is started before the samplers and stopped on every
exit path; the kernel settings it borrowed are put back (after a crash, by the next start).

Memory hot-plug (:mod:`tieringd.memory.hotplug`, ``[hotplug] listen``): the loop owns the uevent listener —
its netlink socket is one more reader, polled again each tick (a burst is reported once it has been
quiet for ``debounce_ms``, which no descriptor signals) — and a change replaces the topology, the
tier lookup, the tier capacities and the mover's fallbacks (:meth:`Daemon._topology_changed`).
"""
from __future__ import annotations

import collections
import dataclasses
import inspect
import json
import logging
import os
import queue
import resource
import selectors
import tempfile
import time
from typing import Callable

import numpy as np

from tieringd.kernel import procfs
from tieringd.memory import hotplug as _hotplug
from tieringd.shim import protocol as P
from tieringd.memory import topology as _topology
from tieringd.sampling.access_signal import AccessSignal, Bind
from tieringd.config import ConfigFile
from tieringd.contracts import DAX_NODE, NODE_SLOTS, Move, Priority, Tier
from tieringd.daemon import capacity
from tieringd.daemon.admission import Admission
from tieringd.daemon.daxmover import Carriers, DaxMover
from tieringd.daemon.moves import ShimMover
from tieringd.daemon.position import Positions
from tieringd.daemon.regions import Book
from tieringd.daemon.sharing import SharingScanner
from tieringd.settings import Settings
from tieringd.daemon.ticks import PhaseTimer, TickClock, TickStats
from tieringd.placement.heat import BlockTable
from tieringd.mover import MigrationEngine, MoveRequest, Ticket
from tieringd.placement.policy import Policy
from tieringd.placement.prefetch import Prefetcher
from tieringd.shim.registry import Registry
from tieringd.shim.remap import DaxTier
from tieringd.sampling import TrackedSet, open_samplers, touches

log = logging.getLogger("tieringd.daemon")

STATUS_NAME = "status.json"
STATUS_EVERY_S = 1.0
# A tick plans when regions were added or removed, when the table changed otherwise (samples
# ingested, placement verified, capacities refreshed, moves finished) and PLAN_MIN_S passed since the
# last plan, or PLAN_EVERY_S after the last plan (heat decays with time, minimum residencies run
# out): an unchanged table gives the same plan. Samples change the table every tick; planning each
# time cost the lab guest (TCG) a third of the daemon's CPU, which the mover thread needs, while the
# mover takes seconds for what one plan hands it.
PLAN_EVERY_S = 1.0
PLAN_MIN_S = 0.5
MIN_FREE_RESERVE = 0.02      # of a node: free memory a move into it never takes


class Daemon:
    """The loop and everything it owns. ``run()`` blocks until :meth:`request_stop`; see
    docs/loop.md and docs/service.md for the contract the service builds on."""

    def __init__(self, config: ConfigFile, *, run_dir: str):
        self.settings = Settings.from_config(config)      # ConfigError before anything starts
        self.run_dir = run_dir
        self.on_ready: list[Callable[[], None]] = []
        self.registry: Registry | None = None
        self.book: Book | None = None
        self.table: BlockTable | None = None
        self.policy: Policy | None = None
        self.engine: MigrationEngine | None = None
        self.signal: AccessSignal | None = None
        self.topology: _topology.Topology | None = None
        self.tiers: list = []
        self.hotplug: _hotplug.HotplugListener | None = None
        self.ticks = TickStats()
        self.started_ns = 0
        # seconds per start-up step: the interpreter and imports (exec → Daemon), then _start's
        self.startup_s: dict[str, float] = {"exec+imports": _since_exec_s()}
        self.tracked: TrackedSet | None = None
        self.sharing: SharingScanner | None = None
        self.samplers = None
        self.shim_mover: ShimMover | None = None
        self.dax: DaxMover | None = None          # the DAX-remap tier, when [dax] or an fsdax mount gives one
        self.pool = None                          # tieringd.pool.agent.PoolAgent, when [pool] is set
        self._dax_reconcile = False               # a process exited: release what it left on the tier
        self.admission = Admission()
        self.positions = Positions()              # which regions are in token order, their frontier
        self.moves = self.admission.stats        # what the moves came to (reports, metrics)
        self.inflight = self.admission.inflight
        self.last_plan = None
        self._stopping = False
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._wake, selectors.EVENT_READ, self._woken)
        self._soon: collections.deque[Callable[[], None]] = collections.deque()
        self._landed: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        self._events: list[tuple[str, dict]] = []
        self._tier_of = np.zeros(NODE_SLOTS, np.int8)
        self._clock: TickClock | None = None
        self._capacity_at = 0.0
        self._zones: list[procfs.Zone] = []     # /proc/zoneinfo as of the last capacity refresh
        self._status_at = 0.0
        self._status_every_s = STATUS_EVERY_S
        self._changed = True                 # the table changed since the last plan
        self._regions_changed = True         # regions added or removed since the last plan
        self._planned_at = 0.0
        self._sampled_at = 0.0
        self._cpu0 = 0.0

    # ---- the contract: called from other threads or signal handlers ------------------------------
    def request_stop(self) -> None:
        """Ask the loop to stop (safe from a signal handler: a flag and an eventfd write)."""
        self._stopping = True
        self._poke()

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` in the loop thread, soon (thread-safe)."""
        self._soon.append(fn)
        self._poke()

    def add_reader(self, fd: int, callback: Callable[[], None]) -> None:
        """Watch ``fd`` in the loop; ``callback()`` runs in the loop thread when it is readable.
        Call from the loop thread (or through :meth:`call_soon`)."""
        self._sel.register(fd, selectors.EVENT_READ, callback)

    def remove_reader(self, fd: int) -> None:
        try:
            self._sel.unregister(fd)
        except (KeyError, ValueError):
            pass

    def _poke(self) -> None:
        try:
            os.eventfd_write(self._wake, 1)
        except OSError:          # closed at shutdown, or the counter is saturated: awake anyway
            pass

    # ---- life -------------------------------------------------------------------------------------
    def run(self) -> None:
        """Start everything, loop until stopped; every exit path stops the mover, closes the samplers
        and the registry, and puts the kernel settings back."""
        try:
            self._start()
            self._serve()
        finally:
            self._shutdown()

    def _start(self) -> None:
        s = self.settings
        os.makedirs(self.run_dir, mode=0o755, exist_ok=True)
        self.started_ns = time.monotonic_ns()
        self._cpu0 = _cpu_s()
        lap = _Laps(self.startup_s)
        self.signal = AccessSignal.for_this_machine(os.path.join(self.run_dir, "knobs.json"))
        lap("probe")
        self.topology = _topology.discover(s.source)
        self._tier_of = capacity.tier_lookup(self.topology)
        self.table = BlockTable(s.heat, epoch_ns=self.started_ns)
        self._zones = procfs.read_zoneinfo([])
        self.tiers = capacity.tier_specs(self.topology, self.table.node_bytes, self._zones)
        self._follow_tiers()                     # before the samplers; restores a crashed run first
        lap("signal")
        self.policy = Policy(s.policy, self.tiers, self._prefetcher(s))
        self._capacity_at = time.monotonic()
        self.tracked = TrackedSet()
        self.samplers = open_samplers(self.tracked, s.sampling, **self._sampler_options())
        lap("samplers")
        log.info("%s", self.samplers.describe())
        # reading a block's bytes marks it accessed: no content comparison under an accessed-bit fallback
        self.sharing = SharingScanner(lambda: self.settings.sharing, self.table,
                                      content=not self.samplers.mode.startswith("fallback"))
        self.engine = MigrationEngine(s.mover, self.topology.fallback_map(),
                                      on_landed=self._landed_from_worker).start()
        self.registry = Registry(self.run_dir, shim_config=s.shim.to_message(),
                                 on_event=lambda kind, data: self._events.append((kind, data)))
        self.dax = self._open_dax(s)
        self.book = Book(self.table, self.tracked, s.blocksize, tier_of_node=self._tiers_of,
                         fast_node=self._fast_node(), locate=self.signal.nodes_of,
                         place=self.signal.blocks_placed, forget=self._forget, bind=self._send_binds,
                         quotas=s.policy.quotas, on_file=self.dax.ranges_of if self.dax else None)
        if self.signal.choice.query_via_pagemap:
            self.shim_mover = ShimMover(self.registry.send_request, self.signal.nodes_of,
                                        self._landed.put, self.moves)
            log.info("Linux %s: move_pages(2) cannot move pages NUMA-balancing scanning protected "
                     "(before 6.5): moves go through the shims' mbind (REBIND with move)",
                     os.uname().release)
        self.registry.start()
        # the loop polls the registry; the DAX tier's worker thread only waits for its replies
        self.registry.polled_elsewhere = True
        self._sel.register(self.registry.fileno(), selectors.EVENT_READ, self._poll_registry)
        self._open_hotplug()
        for sampler in self.samplers.samplers:
            fd = sampler.fileno()
            if fd is not None:
                self._sel.register(fd, selectors.EVENT_READ, lambda s=sampler: s.poll_raw(0))
        lap("rest")
        log.info("pid %d, run directory %s, tick %g ms, tiers: %s", os.getpid(),
                 self.run_dir, s.policy.interval_ms, _describe_tiers(self.tiers))
        log.info("started in %.1f s after exec: %s", sum(self.startup_s.values()),
                 ", ".join(f"{k} {v:.1f} s" for k, v in self.startup_s.items()))

    def _open_dax(self, s: Settings) -> DaxMover | None:
        """The DAX-remap tier (docs/dax.md): ``[dax] path``, or the first fsdax mount; None when the
        machine has neither, or it cannot be opened (logged: the NUMA tiers run without it). What
        already lives on it is learnt from the processes' mappings (``DaxTier.recover``)."""
        if not s.pool.enabled and _topology.remap_tier(self.topology, s.source) is None:
            return None
        try:
            if s.pool.enabled:      # the pool's device instead (docs/pool.md)
                from tieringd.pool.tier import open_tier
                tier, self.pool = open_tier(s.pool, s.dax, self.registry, self.topology, s.source)
            else:
                tier = DaxTier(self.registry, s.dax, topology=self.topology).open(s.source).start()
        except (OSError, ValueError) as e:
            log.warning("%s tier not used: %s", "pool" if s.pool.enabled else "DAX-remap", e)
            return None
        self.tiers = self._with_dax(self.tiers, tier)
        self.policy.set_tiers(self.tiers)
        self.registry.remap_file = (tier.path, tier.inode)
        shared = self.pool.share_blocks(tier) if self.pool is not None else None   # docs/pool.md
        return DaxMover(tier, self.signal.nodes_of, self._landed_from_worker, self.moves, shared=shared)

    @staticmethod
    def _with_dax(tiers: list, tier) -> list:
        return [t for t in tiers if t.tier != Tier.DAX] + ([tier.tier_spec()] if tier is not None else [])

    def _sampler_options(self) -> dict:
        """What open_samplers gets beside [sampling]: the signal's sources the table allows, and the
        fallback ("auto": the access signal's choice for this kernel)."""
        s = self.settings.sampling
        return {"sources": self._sources(),
                "fallback": self.signal.choice.fallback if s.fallback == "auto" else s.fallback}

    def _sources(self) -> tuple[str, ...]:
        """The signal's sources the configuration allows. DMA copies are watched only once a process
        registers CUDA memory (:meth:`_watch_dma`): attaching the uprobes scans every library a
        tracked process maps, which takes seconds on slow filesystems (30 s on the lab's 9p root),
        and runs in the loop thread."""
        wanted = self.settings.sampling.sources
        return tuple(x for x in self.signal.choice.sources if x in wanted and x != "dma")

    def _watch_dma(self) -> None:
        if "dma" not in self.settings.sampling.sources or \
                any(s.name == "dmacopy" for s in self.samplers.samplers):
            return
        from tieringd.sampling import SamplerUnavailable, access_sampler
        sampler = access_sampler("dma").make(self.tracked, self.settings.sampling)
        try:
            sampler.start()
        except SamplerUnavailable as e:
            log.info("DMA copies not watched: %s", e)
            return
        self.samplers.samplers.append(sampler)
        log.info("a process registered CUDA memory: DMA copies watched (%s)", sampler.name)

    def _prefetcher(self, s: Settings) -> Prefetcher:
        return Prefetcher(s.prefetch, interval_ms=s.policy.interval_ms)

    def _fast_node(self) -> int:
        """Where first touch puts memory the shim did not name a node for: the fastest tier."""
        for spec in sorted(self.tiers, key=lambda t: int(t.tier)):
            if spec.nodes:
                return spec.nodes[0]
        return 0

    def _tiers_of(self, nodes: np.ndarray) -> np.ndarray:
        return self._tier_of[np.clip(np.asarray(nodes, np.int64), 0, len(self._tier_of) - 1)]

    def _serve(self) -> None:
        self._clock = TickClock(self.settings.policy.interval_ms / 1000.0)
        ready = False
        while not self._stopping:
            for key, _ in self._sel.select(self._clock.due_in()):
                self._ready(key.data)
                if self._stopping:
                    return
            if self._clock.due_in() <= 0:
                self._tick()
                if not ready:
                    ready = True
                    for fn in self.on_ready:
                        fn()

    @staticmethod
    def _ready(callback: Callable[[], None]) -> None:
        """One reader's callback. Each answers for its own input (a bad request is an error reply,
        a bad record a refusal); should one raise all the same, the bug is logged with its traceback
        and the loop goes on — a client's input must never stop the daemon that holds every
        process's placement."""
        try:
            callback()
        except Exception:
            log.exception("a reader's callback failed (the loop goes on)")

    def _shutdown(self) -> None:
        log.info("tieringd stopping")
        steps = [("hotplug", self._close_hotplug),
                 ("placements", self._restore_placements), ("mover", self._stop_engine),
                 ("samplers", self._close_samplers), ("dax", self._close_dax),
                 ("registry", self._close_registry)]
        try:
            for name, step in steps:
                try:
                    step()
                except Exception:
                    log.exception("stopping the %s failed", name)
        finally:
            if self.signal is not None:
                restored = self.signal.stop()
                log.info("kernel settings put back: %s",
                         ", ".join(f"{c.name} {c.value}→{c.original}" for c in restored) or "none")
            self._write_status(final=True)
            self._sel.close()
            os.close(self._wake)
            self._wake = -1

    def _restore_placements(self) -> None:
        """The binds were borrowed too: every region the daemon bound gets its placement policy
        back (no page moves), so memory the process allocates there later is not held to one node."""
        if self.book is None or self.registry is None or self.signal is None:
            return
        n = 0
        for r in self.book:
            if not self.signal.choice.bind_regions or r.placed_policy == P.Policy.BIND:
                continue
            msg = P.Rebind(start=r.start, length=r.length, nodemask=0, policy=int(r.placed_policy))
            n += self.registry.send_request(r.pid, msg, lambda reply: None)
        if n:
            log.info("placement policies put back on %d region(s)", n)

    def _stop_engine(self) -> None:
        if self.engine is not None:
            self.engine.stop()

    def _close_samplers(self) -> None:
        if self.samplers is not None:
            self.samplers.close()
        if self.tracked is not None:
            self.tracked.close()

    def _open_hotplug(self) -> None:
        """The uevent listener, as one more reader. Without it the daemon still runs: its tiers are
        then those of the start (a restart sees new memory), which is what it logs."""
        if not self.settings.hotplug.listen:
            log.info("memory hot-plug not followed: [hotplug] listen = false")
            return
        listener = _hotplug.HotplugListener(self.settings.hotplug, self.settings.source,
                                            on_change=self._topology_changed)
        try:
            listener.open()
        except (ImportError, OSError) as e:       # no pyroute2, no netlink (containers), no root
            listener.close()
            log.warning("memory hot-plug not followed (tiers stay as at start): uevent listener: %s", e)
            return
        # Changes are diffed against what the loop planned with, not the listener's own discovery.
        listener.topology = self.topology
        self.hotplug = listener
        self.add_reader(listener.fileno(), self._poll_hotplug)

    def _close_hotplug(self) -> None:
        if self.hotplug is not None:
            self.remove_reader(self.hotplug.fileno())
            self.hotplug.close()
            self.hotplug = None

    def _close_dax(self) -> None:
        """Requests already queued finish; what lives on the tier stays there (the processes map it,
        and the next start learns it from their mappings)."""
        if self.pool is not None:
            self.pool.stop()
        if self.dax is not None:
            self.dax.tier.close()

    def _close_registry(self) -> None:
        if self.registry is not None:
            self.remove_reader(self.registry.fileno())
            self.registry.close()

    # ---- readiness callbacks (loop thread) -----------------------------------------------------------
    def _poll_registry(self) -> None:
        self.registry.poll(0)
        # fanned out at once, in order: an exit leaves the tables now, not at the next tick
        self._apply_events()

    def _poll_hotplug(self) -> None:
        """Readable, or a tick: a change reaches :meth:`_topology_changed` through on_change."""
        if self.hotplug is None:
            return
        try:
            self.hotplug.poll(0)
        except Exception:           # sysfs read mid-hot-plug, a netlink error: never the loop's end
            log.exception("hot-plug refresh failed (retried at the next event)")

    def _follow_tiers(self) -> None:
        """Borrow the access signal's kernel settings only while there is something to tier: with one
        tier the daemon changes nothing machine-wide (NUMA balancing, the promotion rate limit), says
        why, and keeps serving the registry and the control socket until memory arrives."""
        filled = [t for t in self.tiers if t.nodes and t.capacity_bytes > 0]     # the DAX tier counts
        if len(filled) > 1:
            if not self.signal.started:
                self.signal.start()
                self._changed = self._regions_changed = True
                for r in self.book or ():
                    self.book.rebind(r)          # what the signal needs bound, now it runs
            return
        why = ("one tier (" + (", ".join(f"{Tier(t.tier).label}: node {','.join(map(str, t.nodes))}"
                                         for t in filled) or "no memory node") +
               "): nothing to tier until memory of another tier arrives")
        if self.signal.started or self.signal.standing_by != why:
            self.signal.stand_by(why)

    def _topology_changed(self, change: _hotplug.TopologyChange) -> None:
        """What depends on the node set, rebuilt the way :meth:`_start` built it."""
        self.topology = change.topology
        self._tier_of = capacity.tier_lookup(self.topology)
        self._refresh_capacity()
        if self.signal is not None:
            self._follow_tiers()
        if self.engine is not None:
            self.engine.set_fallbacks(self.topology.fallback_map())
        if change.nodes_changed:
            log.info("topology changed (%s): tiers: %s", ", ".join(
                [f"node {n.id} added ({n.tier.label})" for n in change.added] +
                [f"node {i} removed" for i in change.removed] +
                [f"node {n.id} resized" for n in change.resized]), _describe_tiers(self.tiers))

    def _woken(self) -> None:
        try:
            os.eventfd_read(self._wake)
        except BlockingIOError:
            pass
        while self._soon:
            fn = self._soon.popleft()
            try:
                fn()
            except Exception:
                log.exception("call_soon callback failed")
        self._apply_landed()

    def _landed_from_worker(self, rows: np.ndarray) -> None:
        """The engine's on_landed, in a worker thread: hand the facts to the loop and wake it."""
        self._landed.put(rows)
        self._poke()

    def _apply_landed(self) -> None:
        parts = []
        while True:
            try:
                parts.append(self._landed.get_nowait())
            except queue.Empty:
                break
        if not parts or self.book is None:
            return
        got = self.book.apply_landed(np.concatenate(parts))
        self._changed = True
        self.moves.promoted_bytes += got.promoted_bytes
        self.moves.demoted_bytes += got.demoted_bytes

    # ---- one tick --------------------------------------------------------------------------------
    def _tick(self) -> None:
        started = time.monotonic()
        started_ns = time.monotonic_ns()
        timer = PhaseTimer()
        with timer("apply"):
            self._apply_events()
            if self.book.sweep():
                self._changed = True
            self._apply_landed()
            self.book.flush_binds()          # the moved blocks, rebound where they landed
            self._changed |= self.admission.collect(started, self.book)
            self.book.requery_unpopulated()
            self._poll_hotplug()             # a debounced burst ends without the fd readable
            if started - self._capacity_at >= capacity.REFRESH_S:
                self._refresh_capacity()
            if self.shim_mover is not None:
                self.shim_mover.expire()
            self._reconcile_dax()
            self.sharing.tick()              # a budget of pages: who else maps or holds each block
        with timer("sample"):
            rows = self._sample(started, started_ns)
        plan = None
        with timer("plan"):
            since = started - self._planned_at
            if self._regions_changed or since >= PLAN_EVERY_S or \
                    (self._changed and since >= PLAN_MIN_S):
                plan = self._plan(started_ns)
                self._planned_at, self._changed, self._regions_changed = started, False, False
        with timer("move"):
            if plan is not None:
                self._submit(plan.moves)
        duration_ms = (time.monotonic() - started) * 1e3
        overran = self._clock.finished(started)
        self.ticks.record(started_ns, duration_ms, timer.phases, overran)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("tick %d: %.1f ms (%s)%s; %d rows; %s; %.1f MiB in flight",
                      self.ticks.count, duration_ms,
                      ", ".join(f"{k} {v:.1f}" for k, v in timer.phases.items()),
                      " OVERRAN" if overran else "", rows,
                      "no plan (nothing changed)" if plan is None else
                      f"{len(plan.moves)} moves (" +
                      "/".join(f"{v / 2**20:.0f}" for v in plan.moved_bytes.values()) +
                      f" MiB), {plan.deferred_bytes / 2**20:.1f} MiB deferred",
                      self.inflight.bytes / 2**20)
        if started - self._status_at >= self._status_every_s:
            self._status_at = started
            self._write_status()
            # every region is in the file: at 5,000 regions one write took 0.35 s, so the loop
            # spends at most a twentieth of its time writing it, however large the table
            self._status_every_s = max(STATUS_EVERY_S, 20 * (time.monotonic() - self._status_at))

    def _sample(self, started: float, started_ns: int) -> int:
        """Read the samplers (every ``[sampling] interval_ms``, at most once a tick) and ingest what
        they saw; returns the rows read."""
        if started - self._sampled_at < self.settings.sampling.interval_ms / 1000.0:
            return 0
        self._sampled_at = started
        deltas = self.samplers.read_deltas()
        self.positions.observe(deltas, self.samplers, self.book)   # first touches are writes too
        n = len(deltas)
        if n:
            # first-touch faults populate memory, they say nothing about reuse (regions.py)
            deltas = deltas[~self.book.population_faults(deltas)]
        if len(deltas):
            self.table.ingest(touches(deltas), seen_ns=started_ns,
                              quantum_ms=max(self.settings.policy.interval_ms,
                                             self.settings.sampling.interval_ms))
            self._changed = True
        return n

    def process_event(self, ev) -> None:
        """A watched process exited or exec'd (the service's lifecycle watcher): what the daemon holds
        for its old address space goes, as when its shim's connection closes."""
        if self.book is not None and self.book.of(ev.pid):
            self._events.append(("exit", {"pid": ev.pid}))

    def _reconcile_dax(self) -> None:
        """After an exit, once no remap is queued: release the extents nobody maps any more."""
        if self.dax is not None and self._dax_reconcile and not self.dax.tier.pending():
            self._dax_reconcile = False
            freed = self.dax.tier.reconcile()
            if freed:
                log.info("DAX tier: %d MiB released by processes that left", freed >> 20)
                self._changed = True

    def _apply_events(self) -> None:
        events, self._events = self._events, []
        self._changed |= bool(events)
        self._regions_changed |= bool(events)
        for kind, data in events:
            if kind == "exit":
                self.inflight.drop_pid(int(data["pid"]))
                self._dax_reconcile = True
            elif kind in ("register", "update") and str(data.get("source", "")).startswith("cuda"):
                self._watch_dma()
            self.book.apply(kind, data)

    def _refresh_capacity(self) -> None:
        self._capacity_at = time.monotonic()
        self._changed = True
        # zoneinfo is re-read here only: watermarks move with min_free_kbytes and hotplug, not per tick
        self._zones = procfs.read_zoneinfo([])
        self.tiers = self._with_dax(capacity.tier_specs(self.topology, self.table.node_bytes, self._zones),
                                    self.dax)
        if hasattr(self.policy, "set_tiers"):
            self.policy.set_tiers(self.tiers)
        else:
            self.policy.tiers = sorted(self.tiers, key=lambda t: int(t.tier))

    def _plan(self, now_ns: int):
        p = self.settings.policy
        elapsed = min(time.monotonic() - self._planned_at, PLAN_EVERY_S)
        budget = self.admission.budget_bytes(p.migration_budget_bytes, p.migration_rate_mb_s * 1e6, elapsed)
        if "budget_bytes" in inspect.signature(self.policy.tick).parameters:
            plan = self.policy.tick(self.table, now_ns=now_ns, budget_bytes=budget)
        else:   # a policy without a per-tick budget reads it from its configuration
            self.policy.cfg = dataclasses.replace(self.policy.cfg,
                                                  migration_budget_bytes=max(int(budget), 1))
            plan = self.policy.tick(self.table, now_ns=now_ns)
        self.last_plan = plan
        return plan

    def _submit(self, moves: list[Move]) -> None:
        """Hand the plan's moves to the mover (the engine, or the shims before 6.5) through
        admission, which holds back what must wait (:class:`tieringd.daemon.admission.Admission`)."""
        carrier = Carriers(self.shim_mover if self.shim_mover is not None else self.engine, self.dax)
        self.admission.submit(moves, self.book, carrier, self._headroom, self._slower)

    def _slower(self, node: int) -> int | None:
        """The first node of the next slower managed tier than ``node``'s (None: none slower)."""
        tier = int(self._tier_of[min(node, len(self._tier_of) - 1)])
        nxt = [t for t in sorted(self.tiers, key=lambda t: int(t.tier)) if int(t.tier) > tier and t.nodes]
        return nxt[0].nodes[0] if nxt else None

    def _headroom(self, node: int) -> int:
        """Free bytes on ``node`` above its reserve: the kernel's own (daemon/capacity.py) and the
        gap the policy's high watermark leaves above it, at least MIN_FREE_RESERVE of the rest."""
        if node == DAX_NODE:
            return self.dax.free_bytes() if self.dax is not None else 0
        mem = capacity.node_memory(node, self._zones)
        gap = max(1.0 - self.settings.policy.high_watermark, MIN_FREE_RESERVE) * mem.capacity_bytes
        return mem.total_bytes - mem.used_bytes - mem.kernel_reserve_bytes - int(gap)

    def submit_move(self, pid: int, ranges: list[tuple[int, int]], target: int | Tier,
                    priority: Priority = Priority.PROMOTE) -> Ticket:
        """A move asked for from outside the plan (``tieringctl migrate`` through the daemon): the
        engine carries it out, its verified placement flows into the table like the plan's, and the
        plan holds back from its ranges until it is done. Loop thread only (else :meth:`call_soon`)."""
        ticket = self.engine.submit(MoveRequest(pid, list(ranges), target, Priority(priority)))
        self.admission.add_outside(pid, ranges, ticket)
        return ticket

    def _forget(self, pid: int, start: int | None) -> None:
        if start is None:
            self.signal.process_exited(pid)
        else:
            self.signal.region_removed(pid, start)

    def _send_binds(self, binds: list[Bind]) -> None:
        for b in binds:
            msg = P.Rebind(start=b.start, length=b.length, nodemask=1 << b.node,
                           policy=int(P.Policy.BIND), flags=int(P.RebindFlag.NUMA_BALANCING))
            if not self.registry.send_request(b.pid, msg, lambda reply, b=b: self._bound(b, reply)):
                # the process left (its exit is applied next tick) or its socket is full
                log.debug("bind of pid %d %#x+%#x not sent", b.pid, b.start, b.length)
                self.signal.bind_failed(b, "not sent", refused=False)

    def _bound(self, b: Bind, reply: P.Message | None) -> None:
        if isinstance(reply, P.Error):
            self.signal.bind_failed(b, str(reply))

    # ---- configuration ---------------------------------------------------------------------------
    def apply_config(self, cfg: ConfigFile) -> None:
        """Validate the whole new configuration first (ConfigError: nothing changes), then apply
        what can change while running: heat weights, the policy, mover rates, the tick interval, the
        samplers' read interval, the shims' settings (sent at their next HELLO), quotas and block
        sizes for regions registered from now on, the hot-plug policy. The samplers, the mover's
        workers, the topology and the DAX tier keep their settings until a restart (logged)."""
        new = Settings.from_config(cfg)
        old, self.settings = self.settings, new
        if self.table is not None:
            self.table.heat_cfg = new.heat
            self.table.refresh_static()
        if self.policy is not None:
            self.policy = Policy(new.policy, self.tiers, self._prefetcher(new))
        if self.engine is not None:
            self.engine.set_rates(new.mover.promote_rate_mb_s, new.mover.demote_rate_mb_s)
        if self._clock is not None:
            self._clock.interval_s = new.policy.interval_ms / 1000.0
        if self.registry is not None:
            self.registry.shim_config = new.shim.to_message()
        if self.book is not None:
            self.book.quotas, self.book.sizer = dict(new.policy.quotas), new.blocksize
        if self.hotplug is not None:
            self.hotplug.config, self.hotplug.cfg = new.hotplug, new.source
        # read once at start: the samplers (but their read interval), the mover's workers, the tiers
        later = [name for name in ("topology", "dax") if getattr(old, name) != getattr(new, name)]
        if dataclasses.replace(old.sampling, interval_ms=0) != dataclasses.replace(new.sampling, interval_ms=0):
            later.append("sampling")
        if dataclasses.replace(old.mover, promote_rate_mb_s=0, demote_rate_mb_s=0) != \
                dataclasses.replace(new.mover, promote_rate_mb_s=0, demote_rate_mb_s=0):
            later.append("mover")
        log.info("configuration applied%s", f"; [{'], ['.join(later)}] take effect at restart"
                 if later else "")

    # ---- status ---------------------------------------------------------------------------------
    def status(self) -> dict:
        """Everything a person or a test wants to know, JSON-able (also written to
        ``RUN_DIR/status.json`` every STATUS_EVERY_S)."""
        t = self.table
        nodes = {}
        if t is not None and self.topology is not None:
            for n in self.topology.nodes:
                mem = capacity.node_memory(n.id, self._zones)
                nodes[str(n.id)] = {"tier": n.tier.label, "table_bytes": int(t.node_bytes[n.id]),
                                    "mem_total_bytes": mem.total_bytes, "used_bytes": mem.used_bytes,
                                    "kernel_reserve_bytes": mem.kernel_reserve_bytes}
        plan = self.last_plan
        return {
            "schema": "tieringd.status/1", "pid": os.getpid(), "running": not self._stopping,
            "started_ns": self.started_ns, "now_ns": time.monotonic_ns(),
            "startup_s": {k: round(v, 2) for k, v in self.startup_s.items()},
            "cpu_s": round(_cpu_s() - self._cpu0, 3),
            "signal": self.signal.status() if self.signal else None,
            "signal_text": self.signal.describe() if self.signal else None,
            "samplers": self.samplers.describe() if self.samplers else None,
            "tiers": [{"tier": Tier(x.tier).label, "nodes": list(x.nodes),
                       "capacity_bytes": int(x.capacity_bytes), "other_bytes": int(x.other_bytes),
                       "table_bytes": int(t.tier_bytes[int(x.tier)]) if t is not None else 0}
                      for x in self.tiers],
            "nodes": nodes,
            "regions": [r.as_dict() for r in self.book] if self.book is not None else [],
            "exits": list(self.book.exits) if self.book is not None else [],
            "ticks": self.ticks.to_dict(),
            "sharing": self.sharing.status() if self.sharing is not None else None,
            "moves": {**self.admission.status(),
                      "via": "shim" if self.shim_mover else "engine",
                      "dax": self.dax.tier.stats() if self.dax else None,
                      "pool": self.pool.status() if self.pool else None,
                      "engine_moved_pages": self.engine.counters.moved_pages if self.engine else 0},
            "plan": None if plan is None else {"moves": len(plan.moves),
                                               "planned_bytes": plan.planned_bytes,
                                               "deferred_bytes": plan.deferred_bytes},
        }

    def _write_status(self, final: bool = False) -> None:
        try:
            doc = self.status()
        except Exception:               # a status must never take the loop down
            log.exception("status failed")
            return
        if final:
            doc["running"] = False
        path = os.path.join(self.run_dir, STATUS_NAME)
        try:
            fd, tmp = tempfile.mkstemp(prefix=".status.", dir=self.run_dir)
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f)
            os.replace(tmp, path)
        except OSError as e:
            log.debug("cannot write %s: %s", path, e)


class _Laps:
    """Seconds between calls, recorded under each call's name."""

    def __init__(self, into: dict[str, float]):
        self.into, self.t = into, time.monotonic()

    def __call__(self, name: str) -> None:
        now = time.monotonic()
        self.into[name] = now - self.t
        self.t = now


def _since_exec_s() -> float:
    """Seconds since this process was exec'd (its start time in /proc/self/stat, in clock ticks
    since boot, against CLOCK_BOOTTIME): the interpreter's start and every import before the
    daemon was built — on a slow root filesystem (the lab's 9p under TCG) most of the start."""
    fields = procfs.read_stat(os.getpid())
    if not fields:
        return 0.0
    started = int(fields[22 - 3]) / os.sysconf("SC_CLK_TCK")          # proc(5) field 22, starttime
    return max(time.clock_gettime(time.CLOCK_BOOTTIME) - started, 0.0)


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _describe_tiers(tiers) -> str:
    return "; ".join(f"{Tier(t.tier).label} nodes {','.join(map(str, t.nodes))} "
                     f"{t.capacity_bytes / 2**30:.2f} GiB ({t.other_bytes / 2**30:.2f} GiB not ours)"
                     for t in tiers) or "none"

