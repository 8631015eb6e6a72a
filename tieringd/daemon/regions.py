# SPDX-License-Identifier: Apache-2.0
"""The region book: one region's identity, fanned out once to everything that keys on it.

The registry (:mod:`tieringd.shim.registry`) owns a region: it verified it, and it names it by
``(pid, start)`` — the key of ``Process.regions``. Three other tables hold a copy, and each is derived
here and nowhere else, keyed by that identity:

- the samplers' :class:`~tieringd.sampling.TrackedSet` — a tracked range in blocks of the region's
  block size, so sampler rows line up with table blocks;
- the :class:`~tieringd.placement.heat.BlockTable` — a table region whose blocks are entered *where they are*:
  the node of each block's first page is queried (``nodes_of``: move_pages, or pagemap where
  move_pages cannot see, before 6.5), never assumed from the shim's placement;
- the access signal's binding state — every populated block bound to its node
  (:meth:`tieringd.sampling.access_signal.AccessSignal.blocks_placed`); the binds go to the shim as REBIND.

Registry event → fan-out (``Book.apply``):

====================  ========================================================================
``register``          tracked range + table region (queried nodes) + binds. A region that a
                      ``reset`` marked stale and that comes back unchanged is revived as it is
                      (its heat kept), so a shim's resync costs nothing.
``update``            pinned / unpinned → the table's pinned flag; rebound by someone else
                      (another policy than our bind) → nodes queried again, binds again.
``unregister``        all three dropped.
``reset``             the pid's regions marked stale; the REGISTERs that follow revive them; what
                      is still stale ``RESET_GRACE_S`` later is dropped (:meth:`Book.sweep`).
``exit``              everything of the pid dropped, its tracked process too.
daemon restart        an empty book; every live shim reconnects and sends RESET + its table.
====================  ========================================================================

Blocks not yet populated (their first page is nowhere) are entered on the node the shim placed the
region on — where first touch will put them — and re-queried every tick until they are populated;
until then the table marks them absent (``BlockTable.set_absent``), so the policy never plans a move
of memory that does not exist, and they are never bound (MPOL_BIND on a full node would make their
first touch fail). The book runs in the daemon's loop thread only.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Iterator, Mapping

import numpy as np

from tieringd.kernel import procfs, numa
from tieringd.shim import protocol as P
from tieringd.kernel.procfs import PAGE_SIZE
from tieringd.sampling.access_signal import Bind
from tieringd.placement.blocksize import BlockSizer
from tieringd.contracts import DAX_NODE, LANDED_DTYPE, RegionKey, SampleSource
from tieringd.placement.heat import BlockTable
from tieringd.sampling import TrackedSet, TrackingError

log = logging.getLogger("tieringd.daemon")

RESET_GRACE_S = 0.5        # after a RESET, the shim's REGISTERs have this long to revive a region
REQUERY_S = 0.5            # unpopulated blocks are asked again this often
REQUERY_BUDGET_S = 0.02    # of the tick's time a round of those questions may take,
REQUERY_MIN_REGIONS = 16   # once it has asked about this many regions (a slow machine still goes round)
# The access signal sees a block only once scanning has passed over it since its last touch (the
# pool every ~0.5 s with the daemon's scan settings, several times that on a loaded machine); until
# then "no samples" says nothing. Blocks populated less than this long ago are not demoted.
WARMUP_S = 4.0
# A fault on a block the book has not found populated, or found populated less than this before the
# fault, is the block's population (first touch), not an access: the fault sampler cannot tell the
# two apart (a PROT_NONE hint fault's error code is a not-present one, bpf/pagefault.bpf.c), and a
# query only bounds when population happened — the first page was present at the query, the rest of
# the block (511 more 4 KiB faults) may still be arriving. One requery period covers both sides.
# Counting fills as accesses made a pool filled once and never read again look hot, newest fill
# hottest: the lab's loop swapped ~500 MiB each way in its first 25 s (docs/loop.md).
POPULATION_GRACE_S = REQUERY_S


@dataclasses.dataclass
class BookRegion:
    """One registered region and what it was fanned out to."""
    pid: int
    start: int
    length: int
    region_id: int                  # the shim's own id (registry.Region.region_id)
    flags: P.Flag
    policy: P.Policy                # as registered now
    placed_policy: P.Policy         # the shim's placement before the daemon bound it (put back at exit)
    placed_node: int                # where first touch puts memory (the shim's node, or the fast tier)
    tag: str
    rid: int                        # BlockTable region id (re-derived when the table compacts)
    block_bytes: int
    block_tokens: int
    nblocks: int
    unpopulated: np.ndarray         # bool per block: its first page is nowhere yet
    registered_ns: int
    stale_since: float | None = None   # set by a RESET; cleared when the shim registers it again
    populated_at: float = 0.0          # the book's clock when blocks were last found newly populated
    found_populated_s: np.ndarray | None = None   # per block: the book's clock when a query first
                                                  # found it populated; NaN while unpopulated
    population_faults: int = 0         # fault rows dropped as population (first touch)

    def __post_init__(self):
        if self.found_populated_s is None:
            self.found_populated_s = np.full(self.nblocks, np.nan)

    @property
    def key(self) -> RegionKey:
        return RegionKey(self.pid, self.start)

    @property
    def pinned(self) -> bool:
        return bool(self.flags & P.Flag.PINNED)

    def first_pages(self) -> np.ndarray:
        return self.start + np.arange(self.nblocks, dtype=np.uint64) * np.uint64(self.block_bytes)

    def as_dict(self) -> dict:
        return {"pid": self.pid, "start": self.start, "length": self.length,
                "region_id": self.region_id, "table_region": self.rid,
                "tracked": {"start": self.start, "length": self.length,
                            "block_len": min(self.block_bytes, self.length)},
                "block_bytes": self.block_bytes, "blocks": self.nblocks,
                "unpopulated_blocks": int(self.unpopulated.sum()),
                "population_faults": self.population_faults,
                "flags": [f.name.lower() for f in P.Flag if self.flags & f],
                "policy": self.policy.label, "tag": self.tag}


def _flags(names) -> P.Flag:
    """Registry events carry flags as names ("pinned", …)."""
    out = P.Flag(0)
    for n in names or ():
        out |= P.Flag[n.upper()]
    return out


def tenant_of(pid: int, quotas: Mapping[str, int] = {}) -> str:
    """The tenant the policy's quotas name: ``pid:N`` when a quota names the pid, else the cgroup
    (``cgroup:/path`` from /proc/PID/cgroup, v2 line ``0::``), else ``pid:N``."""
    if f"pid:{pid}" in quotas:
        return f"pid:{pid}"
    for line in procfs.read_cgroup(pid):
        if line.startswith("0::"):
            return "cgroup:" + line[3:]
    return f"pid:{pid}"


class Book:
    """The fan-out. ``locate(pid, addrs) -> nodes`` (-1 unknown) is the access signal's
    ``nodes_of``; ``bind(binds)`` sends Bind requests to the shims; ``place(pid, start, block_len,
    nodes) -> binds`` is the signal's ``blocks_placed``; ``forget(pid, start | None)`` its
    ``region_removed``/``process_exited``; ``on_file(pid) -> [(start, length)]``, with a DAX-remap
    tier, the ranges of the process that map its file (their blocks are on ``DAX_NODE``)."""

    def __init__(self, table: BlockTable, tracked: TrackedSet, sizer: BlockSizer, *,
                 tier_of_node: Callable[[np.ndarray], np.ndarray],
                 fast_node: int,
                 locate: Callable[[int, np.ndarray], np.ndarray],
                 place: Callable[[int, int, int, np.ndarray], list[Bind]],
                 forget: Callable[[int, int | None], None],
                 bind: Callable[[list[Bind]], None],
                 quotas: Mapping[str, int] | None = None,
                 on_file: Callable[[int], list[tuple[int, int]]] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.table = table
        self.tracked = tracked
        self.sizer = sizer
        self.tier_of_node = tier_of_node
        self.fast_node = fast_node
        self.locate = locate
        self.place = place
        self.forget = forget
        self.bind = bind
        self.quotas = dict(quotas or {})
        self.on_file = on_file
        self.clock = clock
        self._regions: dict[tuple[int, int], BookRegion] = {}
        # per pid, and the stale ones: a tick's questions of 100,000 regions must not each walk all
        self._by_pid: dict[int, dict[RegionKey, BookRegion]] = {}
        self._stale: set[RegionKey] = set()
        self.exits: list[dict] = []          # the latest exits: pid, when (CLOCK_MONOTONIC ns), regions
        self.events = 0
        self._requeried_at = -REQUERY_S
        self._compactions_seen = table.compactions
        self._requery_cursor = 0       # where the last round of requery_unpopulated stopped
        self._rebind_due: set[tuple[int, int]] = set()

    # ---- queries ---------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[BookRegion]:
        return iter(sorted(self._regions.values(), key=lambda r: r.key))

    def __len__(self) -> int:
        return len(self._regions)

    def get(self, pid: int, start: int) -> BookRegion | None:
        return self._regions.get(RegionKey(pid, start))

    def of(self, pid: int) -> list[BookRegion]:
        # not through __iter__: sorting every region for each exit made 1,000 exits take 196 s
        return sorted(self._by_pid.get(pid, {}).values(), key=lambda r: r.key)

    # ---- registry events -------------------------------------------------------------------------
    def apply(self, kind: str, data: dict) -> None:
        """One registry event (``Registry(on_event=…)``'s ``kind, data``)."""
        self.events += 1
        pid = int(data.get("pid", 0))
        if kind == "register":
            self._register(data)
        elif kind == "update":
            self._update(data)
        elif kind == "unregister":
            self._remove(self._regions.get(RegionKey(pid, int(data["start"]))))
        elif kind == "reset":
            now = self.clock()
            for r in self.of(pid):
                r.stale_since = now
                self._stale.add(r.key)
        elif kind == "exit":
            self._exit(pid)
        # hello, refuse: nothing to fan out

    def sweep(self) -> int:
        """Drop regions a RESET left stale and no REGISTER revived within RESET_GRACE_S."""
        now = self.clock()
        gone = [self._regions[k] for k in self._stale if now - self._regions[k].stale_since >= RESET_GRACE_S]
        for r in gone:
            self._remove(r)
        return len(gone)

    def _register(self, d: dict) -> None:
        pid, start, length = int(d["pid"]), int(d["start"]), int(d["length"])
        old = self._regions.get(RegionKey(pid, start))
        if old is not None:
            if old.length == length and old.stale_since is not None:
                old.stale_since = None           # re-sent after a RESET: keep it as it is
                self._stale.discard(old.key)
                self._update(d)
                return
            self._remove(old)
        flags, policy = _flags(d.get("flags")), P.Policy.parse(d.get("policy", "none"))
        tokens, block_bytes = self.sizer.block_bytes(length)
        block_bytes = min(block_bytes, length)
        nblocks = -(-length // block_bytes)
        node = d.get("node")
        placed_node = int(node) if node is not None and int(node) >= 0 else self.fast_node
        try:
            if pid not in self.tracked:
                self.tracked.add_process(pid)
            self.tracked.add_range(pid, start, length, block_bytes)
        except TrackingError as e:
            log.warning("pid %d region %#x+%#x not tracked: %s", pid, start, length, e)
            return
        r = BookRegion(pid, start, length, int(d.get("region_id", 0)), flags, policy, policy,
                       placed_node, str(d.get("tag", "")), -1, block_bytes, tokens, nblocks,
                       np.zeros(nblocks, bool), time.monotonic_ns())
        r.rid = self.table.add_region(pid, start, length, block_bytes, node=placed_node,
                                      tier=int(self.tier_of_node(np.array([placed_node]))[0]),
                                      tenant=tenant_of(pid, self.quotas), block_tokens=tokens,
                                      pinned=r.pinned)
        self._regions[r.key] = r
        self._by_pid.setdefault(pid, {})[r.key] = r
        if self.table.compactions != self._compactions_seen:
            self._rederive_rids()       # only a compaction renumbers: every region's id, once
        self.requery(r)
        log.info("pid %d: region %#x+%s registered: %d blocks of %s, %d populated",
                 pid, start, _mib(length), nblocks, _mib(block_bytes),
                 nblocks - int(r.unpopulated.sum()))

    def _update(self, d: dict) -> None:
        r = self._regions.get(RegionKey(int(d["pid"]), int(d["start"])))
        if r is None:
            self._register(d)
            return
        flags, policy = _flags(d.get("flags")), P.Policy.parse(d.get("policy", "none"))
        if bool(flags & P.Flag.PINNED) != r.pinned:
            self.table.set_pinned(r.rid, bool(flags & P.Flag.PINNED))
        r.flags, r.tag = flags, str(d.get("tag", r.tag))
        rebound_elsewhere = policy != r.policy and policy != P.Policy.BIND
        r.policy = policy
        if rebound_elsewhere:
            # someone else placed it anew (cudaHostRegister's pinned policy moves pages): ask again
            r.placed_policy = policy
            self.forget(r.pid, r.start)
            self.requery(r)

    def _exit(self, pid: int) -> None:
        regions = self.of(pid)
        for r in regions:
            self._remove(r, quiet=True)
        self.tracked.remove_process(pid)
        self.forget(pid, None)
        self.exits.append({"pid": pid, "t_ns": time.monotonic_ns(), "regions": len(regions)})
        del self.exits[:-32]
        log.info("pid %d exited: %d region(s) dropped", pid, len(regions))

    def _remove(self, r: BookRegion | None, quiet: bool = False) -> None:
        if r is None:
            return
        self._regions.pop(r.key, None)
        self._stale.discard(r.key)
        mine = self._by_pid.get(r.pid, {})
        mine.pop(r.key, None)
        if not mine:
            self._by_pid.pop(r.pid, None)
        self.tracked.remove_range(r.pid, r.start)
        self.table.remove_region(r.rid)
        self.forget(r.pid, r.start)
        if not quiet:
            log.info("pid %d: region %#x+%s unregistered", r.pid, r.start, _mib(r.length))

    def _rederive_rids(self) -> None:
        """Table region ids are indices that compaction renumbers: take them from the table. (Not on
        every REGISTER: that made registering N regions O(N²), 46 regions/s at 5,000 of them.)"""
        self._compactions_seen = self.table.compactions
        for key, r in self._regions.items():
            rid = self.table.region_id(key)
            r.rid = -1 if rid is None else rid

    # ---- where blocks are --------------------------------------------------------------------------
    def requery(self, r: BookRegion, blocks: np.ndarray | None = None) -> None:
        """Ask where blocks of ``r`` are (all, or ``blocks``), enter that in the table, bind them."""
        idx = np.arange(r.nblocks) if blocks is None else np.asarray(blocks, np.int64)
        if len(idx) == 0:
            return
        try:
            nodes = np.asarray(self.locate(r.pid, r.first_pages()[idx]), np.int64)
        except numa.NumaError as e:       # the process is going: its exit event follows
            log.debug("pid %d: cannot query %#x: %s", r.pid, r.start, e)
            return
        if self.on_file is not None:
            nodes[self._on_file(r, idx)] = DAX_NODE
        absent = nodes < 0
        if blocks is not None and absent.all() and r.unpopulated[idx].all():
            return                          # still nowhere: nothing to enter (most of a large book)
        populated_now = bool((r.unpopulated[idx] & ~absent).any()) or \
            (blocks is None and not absent.all())
        now = self.clock()
        if populated_now:
            r.populated_at = now
        found = r.found_populated_s
        found[idx[~absent & np.isnan(found[idx])]] = now
        found[idx[absent]] = np.nan            # gone again (MADV_DONTNEED): its next fault populates
        r.unpopulated[idx] = absent
        nodes = np.where(absent, r.placed_node, nodes)
        rows = self.table.region_slice(r.rid).start + idx
        # where the blocks were found, not a move: no residency starts (it discounts a block's
        # return after a demotion, policy.Policy._returning); absent blocks are never planned
        self.table.set_location(rows, nodes, self.tier_of_node(nodes))
        self.table.set_absent(rows, absent)
        if blocks is None or populated_now:
            self.rebind(r)

    def ready_bytes(self, r: BookRegion, start: int, length: int, demote: bool) -> int:
        """How much of ``start``+``length`` (from its start, in whole blocks) may move now: its blocks
        populated, and for a demotion past their warm-up (:meth:`warming_up`). A move of a run of
        blocks that a pool is still filling goes in part instead of waiting for the whole run."""
        lo = max((start - r.start) // r.block_bytes, 0)
        hi = min(-(-(start + length - r.start) // r.block_bytes), r.nblocks)
        waiting = r.unpopulated[lo:hi].copy()
        if demote:
            found = r.found_populated_s[lo:hi]
            waiting |= ~np.isnan(found) & (self.clock() - found < WARMUP_S)
        first = int(np.argmax(waiting)) if waiting.any() else hi - lo
        return min(max(r.start + (lo + first) * r.block_bytes - start, 0), length)

    def moving(self, pid: int, start: int, length: int, to_node: int | None) -> None:
        """A move of ``start``+``length`` of pid to ``to_node`` is in flight, or (None) over: its
        blocks count where they go and stay out of the plan meanwhile (``BlockTable.set_moving``)."""
        r = self.region_of(pid, start)
        if r is None:
            return
        lo = max((start - r.start) // r.block_bytes, 0)
        hi = min(-(-(start + length - r.start) // r.block_bytes), r.nblocks)
        if hi > lo:
            to_tier = None if to_node is None else int(self.tier_of_node(np.array([to_node]))[0])
            self.table.set_moving(self.table.region_slice(r.rid).start + np.arange(lo, hi), to_tier)

    def _on_file(self, r: BookRegion, idx: np.ndarray) -> np.ndarray:
        """Which of blocks ``idx`` of ``r`` live on the DAX-remap tier (their first page maps its file:
        what ``move_pages`` says of such a page is the pmem device's node, not a tier's)."""
        first = r.first_pages()[idx]
        out = np.zeros(len(idx), bool)
        for start, length in self.on_file(r.pid):
            out |= (first >= np.uint64(start)) & (first < np.uint64(start + length))
        return out

    def requery_unpopulated(self) -> None:
        """Every REQUERY_S: where the blocks not yet populated are now (first touch happened?). At
        most REQUERY_BUDGET_S of work a round, going on next round where this one stopped: a query
        per region costs about 0.3 ms, and 2,000 untouched regions took the whole tick."""
        now = self.clock()
        if now - self._requeried_at < REQUERY_S:
            return
        self._requeried_at = now
        regions = list(self._regions.values())      # the budget bounds the looking, too
        if not regions:
            return
        first, seen, t0 = self._requery_cursor % len(regions), 0, time.monotonic()
        for r in regions[first:] + regions[:first]:
            seen += 1
            if r.unpopulated.any():
                self.requery(r, np.flatnonzero(r.unpopulated))
            if seen >= REQUERY_MIN_REGIONS and time.monotonic() - t0 >= REQUERY_BUDGET_S:
                break
        self._requery_cursor = first + seen

    def rebind(self, r: BookRegion) -> None:
        """Bind every populated block of ``r`` to the node the table has it on (only the changed
        ones produce REBINDs)."""
        nodes = self.table.node[self.table.region_slice(r.rid)].astype(np.int64)
        nodes[r.unpopulated | (nodes == DAX_NODE)] = -1        # nothing to bind on the DAX tier
        binds = self.place(r.pid, r.start, r.block_bytes, nodes)
        if binds:
            self.bind(binds)

    def warming_up(self, r: BookRegion, start: int | None = None, length: int | None = None) -> bool:
        """Blocks of ``r`` (of ``start``+``length`` when given) were populated too recently for the
        signal to have seen them (WARMUP_S): absence of samples does not yet mean cold. Per block,
        so that a pool that fills with its traffic can have its early, cold blocks demoted while
        its newest ones are still being written."""
        if start is None:
            return self.clock() - r.populated_at < WARMUP_S
        lo = max((start - r.start) // r.block_bytes, 0)
        hi = -(-(start + (length or 0) - r.start) // r.block_bytes)
        found = r.found_populated_s[lo:hi]
        found = found[~np.isnan(found)]
        return bool(len(found)) and self.clock() - float(found.max()) < WARMUP_S

    def population_faults(self, deltas: np.ndarray) -> np.ndarray:
        """Which fault rows (``ACCESS_DELTA_DTYPE``) are blocks being populated rather than
        accessed: bool per row (POPULATION_GRACE_S). Rows of other sources, and rows outside every
        region, are never population. Counted per region (status ``population_faults``)."""
        out = np.zeros(len(deltas), bool)
        if len(deltas) == 0 or not self._regions:
            return out
        fault = np.flatnonzero(deltas["source"] == int(SampleSource.FAULT))
        seen_s = deltas["last_seen_ns"].astype(np.float64) / 1e9
        pids = deltas["pid"][fault]
        for pid in np.unique(pids).tolist():
            mine = fault[pids == pid]            # only the regions of the pids that faulted
            starts = deltas["block_start"][mine]
            for r in self._by_pid.get(pid, {}).values():
                rows = mine[(starts >= r.start) & (starts < r.start + r.length)]
                if len(rows):
                    self._population_of(r, deltas, rows, seen_s, out)
        return out

    @staticmethod
    def _population_of(r: BookRegion, deltas: np.ndarray, rows: np.ndarray, seen_s: np.ndarray,
                       out: np.ndarray) -> None:
        """Marks in ``out`` which of ``rows`` (fault rows of ``deltas`` in ``r``) are its population."""
        block = ((deltas["block_start"][rows] - np.uint64(r.start)) //
                 np.uint64(r.block_bytes)).astype(np.int64)
        found = r.found_populated_s[block]
        # NaN (never found populated) compares False: population
        populating = ~(seen_s[rows] >= found + POPULATION_GRACE_S)
        out[rows[populating]] = True
        r.population_faults += int(populating.sum())

    def region_of(self, pid: int, addr: int) -> BookRegion | None:
        for r in self._by_pid.get(pid, {}).values():
            if r.start <= addr < r.start + r.length:
                return r
        return None

    # ---- what the mover verified --------------------------------------------------------------------
    def apply_landed(self, rows: np.ndarray) -> "Landed":
        """``LANDED_DTYPE`` rows → the table (facts, not plans: the only upstream flow); the moved
        blocks are rebound where they landed at the next :meth:`flush_binds`. Returns what
        changed tier."""
        out = Landed()
        if len(rows) == 0:
            return out
        assert rows.dtype == LANDED_DTYPE
        t = self.table
        row, block = t.locate(rows["pid"], rows["start"], rows["npages"].astype(np.uint64) * PAGE_SIZE)
        if len(block) == 0:
            return out
        # a block covered by several runs takes the last one (rows are in address order)
        last = len(block) - 1 - np.unique(block[::-1], return_index=True)[1]
        row, block = row[last], block[last]
        node = rows["node"][row].astype(np.int64)
        new_tier = self.tier_of_node(node)
        old_tier = t.tier[block].astype(np.int64)
        size = t.size[block]
        out.promoted_bytes = float(size[new_tier < old_tier].sum())
        out.demoted_bytes = float(size[new_tier > old_tier].sum())
        out.blocks = len(block)
        t.set_location(block, node, new_tier, now_ns=time.monotonic_ns())
        for rid in np.unique(t.region[block]).tolist():
            r = self._regions.get(t.region_key(rid))
            if r is not None:
                mine = block[t.region[block] == rid]
                r.unpopulated[mine - t.region_slice(rid).start] = False
                t.set_absent(mine, False)
                self._rebind_due.add(r.key)
        return out

    def flush_binds(self) -> None:
        """Rebind the regions whose blocks landed somewhere since the last call: once per tick, so
        the batches of one move become one mbind per run (each takes the process's mmap lock)."""
        due, self._rebind_due = self._rebind_due, set()
        for key in due:
            r = self._regions.get(key)
            if r is not None:
                self.rebind(r)


@dataclasses.dataclass
class Landed:
    blocks: int = 0
    promoted_bytes: float = 0.0
    demoted_bytes: float = 0.0


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n % (1 << 20) else f"{n >> 20} MiB"
