# SPDX-License-Identifier: Apache-2.0
"""Sharing, live: how many users each registered KV block has, learnt from what the host shows, a
bounded amount per tick, and written into the block table (``BlockTable.set_sharers``, which keeps
the heat's sharing factor and a shared block's longer recency half-life right; docs/heat-policy.md).

A block's sharers are the larger of two counts:

- **mappings**: the most times one of its pages is mapped. ``/proc/PID/pagemap`` says which pages
  are mapped once (the exclusive bit); for the others ``/proc/kpagecount`` gives the count. Pages a
  forked process inherited, a memfd several processes map, and pages KSM merged
  (``/proc/kpageflags`` KPF_KSM: one copy standing for every page it replaced) all show here. A
  page frame met twice among one block's samples is filler (KSM merges a block of zeros into one
  page), and the shared zero page is no one's data: neither counts.
- **copies**: registered blocks holding the same bytes (two processes that each computed the same
  prefix). A content hash (BLAKE2b) of *cold* blocks finds candidates; a candidate counts once its
  bytes and its group's are read back and found equal, never on the hash alone.

Rows of different regions that map the same memory (a block several registered processes map is a
row in each one's region) are made one in heat and place (:mod:`.aliases`): the scan names each
block's anchor, the smallest of its page frames that others map too.

The cost per tick is bounded, whatever the table's size: ``pages_per_tick`` pagemap entries (plus at
most SAMPLES_PER_BLOCK kpagecount and kpageflags entries per block, for its non-exclusive pages
only), round-robin over the regions in (pid, start) order and on from where the last tick stopped
(a region not yet scanned first); and ``hash_pages_per_tick`` pages of block contents read from ``/proc/PID/mem`` (a block larger than
that is hashed, or compared, over several ticks). Only cold blocks are hashed — fully populated and
without a sampled access for ``cold_after_s``: a block being written (a KV block fills token by
token) changes under its hash, and reading a block costs a copy of it each time. Reading marks the
pages accessed (the kernel clears their idle flag), which an accessed-bit fallback (DAMON, idle
pages) takes for a read, so the daemon turns the content half off when it samples that way.

A read that fails means the process left (its exit reaches the region book soon): the region is
passed over, the loop never stops for it. Everything here runs in the loop thread.
"""
from __future__ import annotations

import bisect
import dataclasses
import hashlib
import logging
import time
from typing import Callable

import numpy as np

from tieringd.config import Table, ranged
from tieringd.contracts import RegionKey
from tieringd.daemon.aliases import Aliases
from tieringd.kernel import procfs, sysfs
from tieringd.kernel.procfs import PAGE_SHIFT, PAGE_SIZE
from tieringd.placement.blocktable import FLAG_ABSENT, FLAG_VALID
from tieringd.placement.heat import BlockTable

log = logging.getLogger("tieringd.daemon")

SAMPLES_PER_BLOCK = 4       # non-exclusive pages per block whose mapcount (and flags) are read
CANDIDATE_ROWS = 4096       # rows looked at per tick for the next cold block to hash
REGIONS_PER_TICK = 256      # regions the page scan moves through per tick, at most
SINGLETONS_MAX = 65536      # hashed blocks without a twin kept to be matched (the oldest go first)
WINDOW = 256                # ticks the scan's cost is averaged over (status)
_MAX_SHARERS = np.iinfo(np.uint16).max


@dataclasses.dataclass(frozen=True)
class SharingConfig(Table):
    """The ``[sharing]`` table: how the daemon learns each KV block's sharers (docs/heat-policy.md)."""
    NAME = "sharing"
    enabled: bool = True  # learn sharers from the host: pages mapped by several processes, KSM merges, identical cold blocks
    pages_per_tick: int = ranged(8192, 1, 1 << 24)  # pagemap entries examined per tick, round-robin over the registered blocks (32 MiB of 4 KiB pages)
    hash_pages_per_tick: int = ranged(128, 0, 1 << 20)  # pages of cold blocks read and hashed or compared per tick; 0: no content comparison
    cold_after_s: float = ranged(30.0, 0, 86400, unit="seconds")  # a block is hashed once populated and without a sampled access this long


def blake2b64(data):
    """The content hash: BLAKE2b with an 8-byte digest (a collision only costs a comparison)."""
    return hashlib.blake2b(data, digest_size=8)


class _Group:
    """Registered blocks confirmed to hold the same bytes, under the digest they hashed to."""
    __slots__ = ("digest", "members")

    def __init__(self, digest: int):
        self.digest = digest
        self.members: list[tuple[RegionKey, int]] = []


class _Region:
    """What the scanner knows of one registered region, per block."""

    def __init__(self, key: RegionKey, length: int, block_bytes: int, nblocks: int):
        self.key, self.length, self.block_bytes, self.nblocks = key, length, block_bytes, nblocks
        self.first_page = key.start >> PAGE_SHIFT
        self.npages = ((key.start + length - 1) >> PAGE_SHIFT) - self.first_page + 1
        self.mapped = np.ones(nblocks, np.uint16)          # sharers from mappings, ≥ 1
        self.ksm = np.zeros(nblocks, bool)                  # a sample was a KSM page
        self.full_since_ms = np.zeros(nblocks, np.uint32)  # scanner ms since when all present; 0: not
        self.full_blocks = 0                                # blocks with full_since_ms set
        self.copies: np.ndarray | None = None               # identical blocks (itself included), once any
        self.groups: dict[int, _Group] = {}                 # hashed block → its group
        self.shared = 0                                     # blocks whose table sharers are > 1
        self.ksm_blocks = 0
        self.gone = False                                   # a read failed: the process left

    def matches(self, length: int, block_bytes: int) -> bool:
        return self.length == length and self.block_bytes == block_bytes

    def block_range(self, block: int) -> tuple[int, int]:
        """(address, bytes) of one block (the last may be shorter)."""
        off = block * self.block_bytes
        return self.key.start + off, min(self.block_bytes, self.length - off)


@dataclasses.dataclass
class _Job:
    """A cold block being hashed, then compared with a member of each group with its digest, a
    budget's worth of pages per tick."""
    region: _Region
    block: int
    hasher: object
    offset: int = 0                      # bytes of the block done in the current step
    nonzero: bool = False
    digest: int | None = None
    candidates: list[_Group] = dataclasses.field(default_factory=list)   # still to compare with


@dataclasses.dataclass
class _Straddle:
    """Samples of a block a page run ended inside, added to the next run's."""
    region: _Region
    block: int
    count: int
    ksm: bool
    absent: bool
    taken: int
    anchor: int


class SharingScanner:
    """Learns each registered block's sharers (module docstring), a budget per :meth:`tick`.

    ``settings``: the ``[sharing]`` table, or a callable returning the current one (a reload then
    applies at the next tick). ``content``: whether blocks may be read and hashed (off where the
    access signal reads accessed bits). ``digest``: the content hash (tests force collisions)."""

    def __init__(self, settings: SharingConfig | Callable[[], SharingConfig], table: BlockTable, *,
                 content: bool = True, clock: Callable[[], float] = time.monotonic,
                 digest: Callable = blake2b64):
        self._settings = settings if callable(settings) else (lambda: settings)
        self.table = table
        self.content = content
        self.clock = clock
        self.digest = digest
        self.t0 = clock()
        self.aliases = Aliases(table, clock=clock)
        self._regions: dict[RegionKey, _Region] = {}
        self._new: list[RegionKey] = []      # regions the page scan has not been over, oldest first
        self._resume: tuple[RegionKey, int] | None = None     # where new regions interrupted a pass
        self._order: list[RegionKey] = []
        self._rows = 0                       # blocks of the regions in _order
        self._generation = -1
        self._page_cursor = (0, 0)           # (index in _order, page within the region)
        self._straddle: _Straddle | None = None
        self._hash_cursor = (0, 0)           # (index in _order, block)
        self._job: _Job | None = None
        self._content_pass_ms = 0            # scanner ms when the current content pass began
        self._content_pass_due_ms = 0        # the next content pass starts no sooner
        self._index: dict[int, list[_Group]] = {}
        self._singletons: dict[tuple[RegionKey, int], None] = {}     # insertion order: oldest first
        self._ms = np.zeros(WINDOW)
        self._pages = np.zeros(WINDOW)
        self.ticks = 0
        self.pages_examined = 0
        self.pages_read = 0                  # pages of block contents read (hashing, comparing)
        self.passes = 0
        self.content_passes = 0
        self.pass_started_s = self.t0
        self.last_pass_s: float | None = None
        self.identical_blocks = 0            # blocks in a group of two or more
        self.mismatches = 0                  # digests equal, bytes not (a collision, or a change)
        self.regions_left = 0                # regions passed over because a read failed
        self._was_enabled = False

    @property
    def cfg(self) -> SharingConfig:
        return self._settings()

    # ---- the tick ---------------------------------------------------------------------------------
    def tick(self) -> None:
        """One tick's share of the scan: pages, then block contents. A process that left is passed
        over; anything unexpected is logged and the rest of the tick's scan skipped."""
        cfg = self.cfg
        if not cfg.enabled:
            if self._was_enabled:
                self.reset()
            return
        self._was_enabled = True
        started = time.perf_counter()
        examined = 0
        try:
            self._sync()
            if self._order:
                examined = self._scan_pages(cfg.pages_per_tick)
                if self.content and cfg.hash_pages_per_tick:
                    self._scan_contents(cfg.hash_pages_per_tick, cfg.cold_after_s)
            self.aliases.apply()
        except Exception:           # the scan feeds the heat; it never ends the loop
            log.exception("sharing scan failed (it goes on at the next tick)")
        i = self.ticks % WINDOW
        self._ms[i] = (time.perf_counter() - started) * 1e3
        self._pages[i] = examined
        self.ticks += 1

    def reset(self) -> None:
        """Forget what was learnt; every block the scan raised goes back to one sharer."""
        for st in self._regions.values():
            rid = self.table.region_id(st.key)
            if rid is not None and st.shared:
                sl = self.table.region_slice(rid)
                self.table.set_sharers(np.arange(sl.start, sl.stop), np.ones(sl.stop - sl.start, np.int64))
        self._regions.clear()
        self._new.clear()
        self._resume = None
        self.aliases.clear()
        self._order, self._generation = [], -1
        self._index.clear()
        self._singletons.clear()
        self._job = self._straddle = None
        self.identical_blocks = 0
        self._was_enabled = False

    def _sync(self) -> None:
        """The region list, re-read when the table's regions changed: a new region gets a state,
        a region gone takes its state (and its blocks' places in groups) with it."""
        t = self.table
        if t.generation == self._generation:
            return
        self._generation = t.generation
        live = {}
        for rid in np.flatnonzero(t.r_live[:t.nregions]).tolist():
            live[t.region_key(rid)] = (rid, int(t.r_length[rid]), int(t.r_block_bytes[rid]),
                                       int(t.r_count[rid]))
        for key in [k for k, st in self._regions.items()
                    if k not in live or not st.matches(*live[k][1:3])]:
            self._drop(self._regions.pop(key))
        for key, (rid, length, block_bytes, count) in live.items():
            st = self._regions.get(key)
            if st is None:
                st = self._regions[key] = _Region(key, length, block_bytes, count)
                self._new.append(key)
            # the rows may be new (a region removed and added again), or raised before: count them
            st.shared = int(np.count_nonzero(t.sharers[t.region_slice(rid)] > 1))
        old, self._order = self._order, sorted(k for k, st in self._regions.items() if not st.gone)
        self._rows = sum(st.nblocks for st in self._regions.values())
        self._page_cursor = self._remap(self._page_cursor, old)
        self._hash_cursor = self._remap(self._hash_cursor, old)
        if self._new and self._order and self._order[self._page_cursor[0]] not in self._new:
            self._straddle = None            # a region that has not been scanned yet goes first
            if self._resume is None:
                self._resume = (self._order[self._page_cursor[0]], self._page_cursor[1])
            self._page_cursor = (bisect.bisect_left(self._order, self._new[0]), 0)

    def _remap(self, cursor: tuple[int, int], old: list[RegionKey]) -> tuple[int, int]:
        """A cursor into the old order, moved to its region in the new one (or the next region)."""
        i, within = cursor
        if i >= len(old) or not self._order:
            return 0, 0
        j = bisect.bisect_left(self._order, old[i])
        if j < len(self._order) and self._order[j] == old[i]:
            return j, within
        return j % len(self._order), 0

    def _drop(self, st: _Region) -> None:
        for block in list(st.groups):
            self._leave(st, block)
        self.aliases.drop(st.key)
        if st.key in self._new:
            self._new.remove(st.key)
        if self._job is not None and self._job.region is st:
            self._job = None
        if self._straddle is not None and self._straddle.region is st:
            self._straddle = None

    # ---- pages: mappings and KSM ------------------------------------------------------------------
    def _scan_pages(self, budget: int) -> int:
        """Read ``budget`` pagemap entries on from the cursor (REGIONS_PER_TICK regions at most);
        returns the entries read."""
        examined = visited = 0
        while examined < budget and visited < min(len(self._order), REGIONS_PER_TICK):
            i, page = self._page_cursor
            st = self._regions[self._order[i]]
            rid = self.table.region_id(st.key)
            take = min(budget - examined, st.npages - page)
            if rid is not None and take > 0:
                try:
                    entries = procfs.read_pagemap(st.key.pid, (st.first_page + page) << PAGE_SHIFT, take)
                except sysfs.SysfsError:
                    self._left(i)
                    if not self._order:
                        break
                    self._page_cursor = (i % len(self._order), 0)
                    visited += 1
                    continue
                else:
                    self._pages_run(st, rid, st.first_page + page, entries)
                    examined += take
                    if page + take < st.npages:
                        self._page_cursor = (i, page + take)
                        continue
            visited += 1
            self._straddle = None
            if st.key in self._new:
                self._new.remove(st.key)
            self._next_region(i)
        self.pages_examined += examined
        return examined

    def _left(self, i: int) -> None:
        """Region ``i`` of the order cannot be read: its process left. It is out of the order until
        the registry's exit takes it out of the table, and its state with it."""
        st = self._regions[self._order.pop(i)]
        st.gone = True
        self.regions_left += 1
        self._straddle = None
        if st.key in self._new:
            self._new.remove(st.key)
        hi, block = self._hash_cursor
        self._hash_cursor = (hi - 1, block) if hi > i else (i, 0) if hi == i else (hi, block)

    def _next_region(self, i: int) -> None:
        """On to the next region in order; a region not yet scanned goes first (a process that
        registered memory others map, or forked, shows it soon), without ending the pass."""
        if self._new:
            self._page_cursor = (bisect.bisect_left(self._order, self._new[0]), 0)
            return
        if self._resume is not None:         # the pass the new regions interrupted goes on
            key, page = self._resume
            self._resume = None
            j = bisect.bisect_left(self._order, key)
            if j < len(self._order):
                self._page_cursor = (j, page if self._order[j] == key else 0)
                return
            i = len(self._order) - 1
        i += 1
        if i >= len(self._order):
            i = 0
            now = self.clock()
            self.passes += 1
            self.last_pass_s = now - self.pass_started_s
            self.pass_started_s = now
        self._page_cursor = (i, 0)

    def _pages_run(self, st: _Region, rid: int, first_page: int, entries: np.ndarray) -> None:
        """One run of a region's pagemap entries: each block it covers gets its mappings count,
        whether a sample was a KSM page, and whether every page is present; the block the run ends
        inside is carried to the next run."""
        pages = first_page + np.arange(len(entries), dtype=np.int64)
        block = np.clip(((pages << PAGE_SHIFT) - st.key.start) // st.block_bytes, 0, st.nblocks - 1)
        lo, hi = int(block[0]), int(block[-1])
        nb = hi - lo + 1
        rel = block - lo
        carry = self._straddle if self._straddle is not None and self._straddle.region is st \
            and self._straddle.block == lo else None
        count, ksm, taken, anchor = self._mapcounts(rel, nb, entries, carry.taken if carry else 0)
        absent = np.bincount(rel, weights=~procfs.present(entries), minlength=nb) > 0
        if carry is not None:
            count[0] = max(int(count[0]), carry.count)
            ksm[0] |= carry.ksm
            absent[0] |= carry.absent
            taken[0] += carry.taken
            anchor[0] = min(int(anchor[0]) or carry.anchor, carry.anchor or int(anchor[0]))
        hi_end_page = (st.key.start + min((hi + 1) * st.block_bytes, st.length) - 1) >> PAGE_SHIFT
        done = nb if int(pages[-1]) >= hi_end_page else nb - 1
        self._straddle = None if done == nb else \
            _Straddle(st, hi, int(count[-1]), bool(ksm[-1]), bool(absent[-1]), int(taken[-1]), int(anchor[-1]))
        if done:
            blocks = np.arange(lo, lo + done)
            self._record(st, rid, blocks, count[:done], ksm[:done], ~absent[:done])
            self.aliases.note(st.key, st.nblocks, blocks, anchor[:done])

    def _mapcounts(self, rel: np.ndarray, nb: int, entries: np.ndarray, carried: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per block of a run: the largest mapcount among its first SAMPLES_PER_BLOCK non-exclusive
        pages (1 when it has none), whether one is a KSM page, how many were sampled (``carried``:
        samples the first block had in the run before), and the smallest of their page frames that
        others map too (its anchor, 0 for none: :mod:`.aliases`)."""
        count = np.ones(nb, np.int64)
        ksm = np.zeros(nb, bool)
        anchor = np.zeros(nb, np.uint64)
        shared = np.flatnonzero(procfs.present(entries) & ~procfs.exclusive(entries))
        if len(shared) == 0:
            return count, ksm, np.zeros(nb, np.int64), anchor
        b = rel[shared]
        starts = np.flatnonzero(np.concatenate([[True], b[1:] != b[:-1]]))
        rank = np.arange(len(b)) - np.repeat(starts, np.diff(np.concatenate([starts, [len(b)]])))
        keep = rank < SAMPLES_PER_BLOCK - np.where(b == 0, carried, 0)
        shared, b = shared[keep], b[keep]
        taken = np.bincount(b, minlength=nb).astype(np.int64)
        pfn = procfs.pfns(entries[shared])
        n = np.full(len(shared), 2, np.int64)        # PFNs hidden (no CAP_SYS_ADMIN): 2, a lower bound
        seen = np.flatnonzero(pfn != 0)
        if len(seen):
            flags = np.zeros(len(seen), np.uint64)
            try:
                n[seen] = procfs.read_kpagecount(pfn[seen])
                many = np.flatnonzero(n[seen] > 1)     # a frame mapped once is no one's to share
                flags[many] = procfs.read_kpageflags(pfn[seen[many]])
            except sysfs.SysfsError:         # the files need CAP_SYS_ADMIN: keep the lower bound
                pass
            zero = (flags & np.uint64(procfs.KPF_ZERO_PAGE)) != 0
            # a frame met twice among one block's samples is filler (zeros merged into one page)
            key = b[seen].astype(np.int64) * (1 << 44) + pfn[seen].astype(np.int64)
            _, inv, per = np.unique(key, return_inverse=True, return_counts=True)
            filler = per[inv] > 1
            n[seen[zero | filler]] = 1
            merged = ((flags & np.uint64(procfs.KPF_KSM)) != 0) & ~filler
            ksm[b[seen[merged]]] = True
            mine = seen[n[seen] > 1]             # frames others map too: the block's anchor
            lowest = np.full(nb, np.iinfo(np.uint64).max, np.uint64)
            np.minimum.at(lowest, b[mine], pfn[mine])
            anchor = np.where(lowest == np.iinfo(np.uint64).max, np.uint64(0), lowest)
        np.maximum.at(count, b, np.maximum(n, 1))
        return count, ksm, taken, anchor

    def _record(self, st: _Region, rid: int, blocks: np.ndarray, count: np.ndarray, ksm: np.ndarray,
                full: np.ndarray) -> None:
        now_ms = self._now_ms()
        st.mapped[blocks] = np.minimum(count, _MAX_SHARERS)
        st.ksm_blocks += int(np.count_nonzero(ksm)) - int(np.count_nonzero(st.ksm[blocks]))
        st.ksm[blocks] = ksm
        since = st.full_since_ms[blocks]
        st.full_blocks += int(np.count_nonzero(full)) - int(np.count_nonzero(since))
        st.full_since_ms[blocks] = np.where(full, np.where(since == 0, now_ms, since), 0)
        self._push(st, rid, blocks)

    def _now_ms(self) -> int:
        return max(int((self.clock() - self.t0) * 1000), 1)

    def _push(self, st: _Region, rid: int, blocks: np.ndarray) -> None:
        """Sharers = max(mappings, identical copies) into the table, for the blocks that changed."""
        want = st.mapped[blocks].astype(np.int64)
        if st.copies is not None:
            np.maximum(want, st.copies[blocks], out=want)
        rows = self.table.region_slice(rid).start + blocks
        old = self.table.sharers[rows].astype(np.int64)
        changed = want != old
        if changed.any():
            self.table.set_sharers(rows[changed], want[changed])
            st.shared += int(np.count_nonzero(want[changed] > 1)) - int(np.count_nonzero(old[changed] > 1))

    # ---- contents: identical cold blocks ------------------------------------------------------------
    def _scan_contents(self, budget: int, cold_after_s: float) -> None:
        """Hash or compare ``budget`` pages of cold blocks, on from the hash cursor: CANDIDATE_ROWS
        rows looked at in all, and no block twice in one tick."""
        rows = [min(CANDIDATE_ROWS, self._rows)]
        while budget > 0:
            if self._job is None:
                self._job = self._next_cold_block(cold_after_s, rows)
                if self._job is None:
                    return
            budget -= self._step(self._job, budget)

    def _next_cold_block(self, cold_after_s: float, rows_left: list[int]) -> _Job | None:
        """The next block on from the cursor that has had every page present for ``cold_after_s``
        (as the page scan saw it) and no sampled access for as long; the rows looked at are taken
        from ``rows_left``."""
        t = self.table
        now_ms, cold_ms = self._now_ms(), int(cold_after_s * 1000)
        table_now = int(t.ms(time.monotonic_ns()))
        while rows_left[0] > 0 and self._order and now_ms >= self._content_pass_due_ms:
            i, block = self._hash_cursor
            i = i if i < len(self._order) else 0
            st = self._regions[self._order[i]]
            n = min(st.nblocks - block, rows_left[0])
            rows_left[0] -= max(n, 1)
            # a region none of whose blocks the page scan found whole has no cold block: passed over
            # without the table (100,000 untouched regions made this most of the daemon's tick)
            rid = t.region_id(st.key) if st.full_blocks else None
            if rid is None or n <= 0:
                self._advance_hash_cursor(i, st.nblocks, st.nblocks, cold_ms)
                continue
            rows = t.region_slice(rid).start + block + np.arange(n)
            since = st.full_since_ms[block:block + n].astype(np.int64)
            last = t.last_ms[rows].astype(np.int64)
            cold = (since > 0) & (now_ms - since >= cold_ms) & ((last == 0) | (table_now - last >= cold_ms)) \
                & ((t.flags[rows] & (FLAG_VALID | FLAG_ABSENT)) == FLAG_VALID)
            hit = np.flatnonzero(cold)
            if len(hit):
                rows_left[0] += n - int(hit[0]) - 1            # the rows after the hit: not looked at
            self._advance_hash_cursor(i, block + (int(hit[0]) + 1 if len(hit) else n), st.nblocks, cold_ms)
            if len(hit):
                return _Job(st, block + int(hit[0]), self.digest(b""))
        return None

    def _advance_hash_cursor(self, i: int, block: int, nblocks: int, cold_ms: int) -> None:
        """On to ``block`` of region ``i``, or the next region. Past the last region a pass over
        every block is done, and the next starts ``cold_after_s`` (at least a second) after this
        one began: a cold block's bytes do not change faster, and a small table is not read over
        and over."""
        if block < nblocks:
            self._hash_cursor = (i, block)
            return
        self._hash_cursor = ((i + 1) % len(self._order), 0)
        if i + 1 >= len(self._order):
            self._content_pass_due_ms = self._content_pass_ms + max(cold_ms, 1000)
            self._content_pass_ms = max(self._now_ms(), self._content_pass_due_ms)
            self.content_passes += 1

    def _read(self, st: _Region, block: int, offset: int, length: int) -> bytes | None:
        """Bytes of a block where every page is present (a read would fault a missing one in);
        None when one is not, or the process left."""
        addr = st.block_range(block)[0] + offset
        first = addr >> PAGE_SHIFT
        npages = ((addr + length - 1) >> PAGE_SHIFT) - first + 1
        try:
            if not procfs.present(procfs.read_pagemap(st.key.pid, first << PAGE_SHIFT, npages)).all():
                return None
            data = procfs.read_mem(st.key.pid, addr, length)
        except sysfs.SysfsError:
            return None
        self.pages_read += npages
        return data if len(data) == length else None

    def _step(self, job: _Job, budget: int) -> int:
        """Up to ``budget`` pages of the job: hashing the block, then comparing it with the next
        candidate group. Returns the pages used (at least 1)."""
        st = job.region
        size = st.block_range(job.block)[1]
        if job.digest is not None:          # a comparison reads both blocks: half the budget each
            length = min(max(budget // 2, 1) * PAGE_SIZE, size - job.offset)
            return self._compare_step(job, length, size, max(-(-length // PAGE_SIZE), 1))
        length = min(budget * PAGE_SIZE, size - job.offset)
        pages = max(-(-length // PAGE_SIZE), 1)
        data = self._read(st, job.block, job.offset, length)
        if data is None:
            self._job = None                 # not all present: a later pass comes back to it
            return pages
        job.hasher.update(data)
        job.nonzero = job.nonzero or bool(np.frombuffer(data, np.uint8).any())
        job.offset += length
        if job.offset >= size:
            self._hashed(job)
        return pages

    def _hashed(self, job: _Job) -> None:
        """The digest is known. A block of zeros holds no KV: it leaves any group. Otherwise the
        candidates are the groups with its digest, its own first when it is still there with others."""
        st, block = job.region, job.block
        if not job.nonzero:
            self._leave(st, block)
            self._job = None
            return
        job.digest = int.from_bytes(job.hasher.digest()[:8], "little")
        mine = st.groups.get(block)
        job.candidates = [g for g in self._index.get(job.digest, ()) if g is not mine]
        if mine is not None and mine.digest == job.digest:
            if len(mine.members) == 1:
                self._job = None             # alone with this digest still: nothing changes
                return
            job.candidates.insert(0, mine)
        job.offset = 0
        if not job.candidates:
            self._settle(job, None)

    def _compare_step(self, job: _Job, length: int, size: int, pages: int) -> int:
        st, block = job.region, job.block
        group = job.candidates[0]
        other = next(((self._regions.get(k), b) for k, b in group.members if (k, b) != (st.key, block)),
                     (None, 0))
        mine = self._read(st, block, job.offset, length)
        if mine is None:
            self._job = None
            return 2 * pages
        theirs = None if other[0] is None or other[0].gone else self._read(other[0], other[1], job.offset, length)
        if theirs is not None and mine == theirs:
            job.offset += length
            if job.offset >= size:
                self._settle(job, group)
            return 2 * pages
        self.mismatches += theirs is not None
        job.candidates.pop(0)
        job.offset = 0
        if not job.candidates:
            self._settle(job, None)
        return 2 * pages

    def _settle(self, job: _Job, group: _Group | None) -> None:
        """The outcome: the block joins ``group`` (its bytes found equal), or one of its own."""
        st, block = job.region, job.block
        self._job = None
        mine = st.groups.get(block)
        if group is not None and group is mine:
            return
        self._leave(st, block)
        if group is None:
            group = _Group(job.digest)
            self._index.setdefault(job.digest, []).append(group)
        self._join(st, block, group)

    def _join(self, st: _Region, block: int, group: _Group) -> None:
        me = (st.key, block)
        group.members.append(me)
        st.groups[block] = group
        if len(group.members) == 1:
            self._singletons[me] = None
            self._evict()
            return
        if len(group.members) == 2:
            self._singletons.pop(group.members[0], None)
        self.identical_blocks += 2 if len(group.members) == 2 else 1
        self._set_copies(group.members, len(group.members))

    def _leave(self, st: _Region, block: int) -> None:
        """The block leaves its group (it changed, turned to zeros, or its region went)."""
        group = st.groups.pop(block, None)
        if group is None:
            return
        me = (st.key, block)
        self._singletons.pop(me, None)
        group.members.remove(me)
        left = len(group.members)
        if left == 0:
            rest = [g for g in self._index.get(group.digest, ()) if g is not group]
            if rest:
                self._index[group.digest] = rest
            else:
                self._index.pop(group.digest, None)
            return
        self.identical_blocks -= 2 if left == 1 else 1
        if left == 1:
            self._singletons[group.members[0]] = None
        self._set_copies([me], 1)
        self._set_copies(group.members, left)

    def _evict(self) -> None:
        """Keep SINGLETONS_MAX blocks without a twin, the latest hashed."""
        while len(self._singletons) > SINGLETONS_MAX:
            key, block = next(iter(self._singletons))
            st = self._regions.get(key)
            if st is not None and block in st.groups:
                self._leave(st, block)
            else:
                self._singletons.pop((key, block))

    def _set_copies(self, members: list[tuple[RegionKey, int]], copies: int) -> None:
        by_region: dict[RegionKey, list[int]] = {}
        for key, b in members:
            by_region.setdefault(key, []).append(b)
        for key, blocks in by_region.items():
            st = self._regions.get(key)
            if st is None or (st.copies is None and copies <= 1):
                continue
            if st.copies is None:
                st.copies = np.ones(st.nblocks, np.uint16)
            idx = np.array(blocks, np.int64)
            st.copies[idx] = min(copies, _MAX_SHARERS)
            rid = self.table.region_id(key)
            if rid is not None:
                self._push(st, rid, idx)

    # ---- reports ----------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of the per-block arrays the scan keeps (7 a block, 2 more in a region with copies)."""
        return sum(st.mapped.nbytes + st.ksm.nbytes + st.full_since_ms.nbytes +
                   (st.copies.nbytes if st.copies is not None else 0) for st in self._regions.values())

    def status(self) -> dict:
        """What the scan costs per tick and what it found (the daemon's status)."""
        cfg = self.cfg
        n = min(self.ticks, WINDOW)
        ms, pages = self._ms[:n], self._pages[:n]
        return {"enabled": cfg.enabled, "content": bool(self.content and cfg.hash_pages_per_tick),
                "pages_per_tick": cfg.pages_per_tick, "hash_pages_per_tick": cfg.hash_pages_per_tick,
                "ticks": self.ticks,
                "pages_examined_per_tick": round(float(pages.mean()), 1) if n else 0.0,
                "ms_per_tick": round(float(ms.mean()), 3) if n else 0.0,
                "ms_per_tick_max": round(float(ms.max()), 3) if n else 0.0,
                "pages_examined": self.pages_examined, "pages_read": self.pages_read,
                "passes": self.passes, "content_passes": self.content_passes,
                "last_pass_s": None if self.last_pass_s is None else round(self.last_pass_s, 2),
                "shared_blocks": sum(st.shared for st in self._regions.values()),
                "ksm_blocks": sum(st.ksm_blocks for st in self._regions.values()),
                "identical_blocks": self.identical_blocks, "mismatches": self.mismatches,
                "alias_groups": self.aliases.groups, "alias_rows": len(self.aliases.rows),
                "alias_rows_placed": self.aliases.synced_rows, "regions_left": self.regions_left}
