# SPDX-License-Identifier: Apache-2.0
"""Accessed-bit fallback samplers, for hosts where BPF cannot run (no CAP_BPF, old kernel): the same
interface as the BPF samplers, rows with ``source = ACCESSED``.

- :class:`DamonSampler`: DAMON through its sysfs interface (CONFIG_DAMON_SYSFS, 5.18+; the files and
  what the kernel does with them are :mod:`._damon_sysfs`'s), virtual address operations
  (CONFIG_DAMON_VADDR). One kdamond per tracked process, so that every region it
  reports belongs to one pid; ``fvaddr`` (fixed ranges, 6.0+) when the process has registered ranges,
  ``vaddr`` (DAMON picks the mapped areas) otherwise. Results come from a ``stat`` scheme's
  ``tried_regions`` (6.2+). The count of a block is its region's ``nr_accesses``: in how many sampling
  intervals of the last aggregation interval an access was seen.
  DAMON's sysfs recreates *every* kdamond directory when ``nr_kdamonds`` changes and refuses while any
  kdamond runs, so this sampler only uses DAMON when no kdamond is configured by anyone else.
- :class:`IdlePageSampler`: idle page tracking (CONFIG_IDLE_PAGE_TRACKING): mark the PFNs of tracked
  pages idle, and at the next interval count the pages whose idle bit the kernel cleared (accessed).
  Needs CAP_SYS_ADMIN to see PFNs in /proc/PID/pagemap. Count of a block: its pages accessed.
"""
from __future__ import annotations

import errno
import logging
import time

import numpy as np

from tieringd.kernel import procfs, sysfs
from tieringd.kernel.procfs import PAGE_SIZE
from tieringd.contracts import SampleSource

from . import _damon_sysfs as damon
from .base import BLOCK_ROWS_DTYPE, Sampler, SamplerUnavailable, to_deltas
from .features import kernel_config
from .tracking import TrackedSet

log = logging.getLogger(__name__)

PAGE_IDLE_BITMAP = "/sys/kernel/mm/page_idle/bitmap"
MAX_ROWS_PER_REGION = 4096


def _now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def _block_rows(pid: int, start: int, end: int, count: int, tracked: TrackedSet, now: int) -> list:
    """Rows for an accessed extent [start, end) of ``pid``: the grid blocks of the tracked ranges it
    overlaps, or default-size blocks when the process is tracked at all addresses."""
    rows = []
    proc = tracked.process(pid)
    if proc is None:
        return rows
    covered = []
    for r in proc.ranges:
        lo, hi = max(start, r.start), min(end, r.end)
        if lo >= hi:
            continue
        covered.append((lo, hi))
        first, last = (lo - r.start) // r.block_len, (hi - 1 - r.start) // r.block_len
        for idx in range(first, min(last, first + MAX_ROWS_PER_REGION - 1) + 1):
            rows.append((pid, r.start + idx * r.block_len, r.block_len, count, now, 0))
    if proc.all_addresses and not covered:
        bl = proc.default_block_len
        first = start // bl
        for idx in range(first, min((end - 1) // bl, first + MAX_ROWS_PER_REGION - 1) + 1):
            rows.append((pid, idx * bl, bl, count, now, 0))
    return rows


# ---------------------------------------------------------------------------------------------
# DAMON

class DamonSampler(Sampler):
    name = "damon"
    source = SampleSource.ACCESSED

    def __init__(self, tracked: TrackedSet, *, sample_us: int = 5000, aggr_us: int = 100_000,
                 update_us: int = 1_000_000, max_pids: int = 8):
        self.tracked = tracked
        self.sample_us, self.aggr_us, self.update_us = sample_us, aggr_us, update_us
        self.max_pids = max_pids
        self._pids: list[int] = []
        self._generation = -1
        self._started = False
        self.ops: dict[int, str] = {}
        self._has_fvaddr = False
        self.last_regions: list[tuple[int, int, int, int]] = []

    def start(self) -> None:
        cfg = kernel_config()
        if cfg is not None and cfg.get("CONFIG_DAMON_VADDR", "n") == "n":
            raise SamplerUnavailable("damon: virtual address monitoring is not built in "
                                     "(CONFIG_DAMON_VADDR is not set)")
        ok, why = damon.status()
        if not ok:
            raise SamplerUnavailable(f"damon: {why}")
        try:
            ops = damon.operations()
        except OSError as e:
            raise SamplerUnavailable(f"damon: cannot probe operations: {e}") from e
        if "vaddr" not in ops:
            raise SamplerUnavailable("damon: virtual address monitoring is not built in "
                                     f"(CONFIG_DAMON_VADDR; this kernel offers: {', '.join(sorted(ops)) or 'none'})")
        self._has_fvaddr = "fvaddr" in ops
        self._started = True
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _stop_all(self) -> None:
        for k in range(len(self._pids)):
            damon.stop(k)

    def _build(self) -> None:
        """One kdamond per tracked process (the first ``max_pids``), rebuilt when the set changes."""
        self._stop_all()
        pids = self.tracked.pids()[:self.max_pids]
        if len(self.tracked) > self.max_pids:
            log.warning("damon: monitoring the first %d of %d tracked processes",
                        self.max_pids, len(self.tracked))
        try:
            damon.set_nr_kdamonds(len(pids))
        except OSError as e:
            raise SamplerUnavailable(f"damon: cannot create kdamonds: {e}") from e
        self._pids = pids
        self.ops.clear()
        for k, pid in enumerate(pids):
            self._configure(k, pid)
        for k, pid in enumerate(pids):
            try:
                damon.set_state(k, "on")
            except OSError as e:
                if e.errno == errno.ESRCH or not procfs.alive(pid):
                    log.info("damon: pid %d is gone", pid)
                    continue
                raise SamplerUnavailable(f"damon: cannot start monitoring pid {pid}: {e}") from e
        self._generation = self.tracked.generation

    def _configure(self, k: int, pid: int) -> None:
        """fvaddr over the registered ranges when the kernel has it, else vaddr (DAMON follows the
        mapped areas); about one DAMON region per block, within [10, 500] regions."""
        damon.add_context(k)
        ranges = self.tracked.ranges(pid)
        ops = "vaddr"
        if ranges and self._has_fvaddr:
            try:
                damon.set_operations(k, "fvaddr")
                ops = "fvaddr"
            except OSError:
                pass
        if ops == "vaddr":
            try:
                damon.set_operations(k, "vaddr")
            except OSError as e:
                raise SamplerUnavailable("damon: virtual address monitoring is not built in "
                                         f"(CONFIG_DAMON_VADDR): {e}") from e
        self.ops[pid] = ops
        nblocks = sum(max(1, r.length // r.block_len) for r in ranges) or 10
        lo = min(max(10, nblocks), 500)
        damon.set_monitoring_attrs(k, sample_us=self.sample_us, aggr_us=self.aggr_us,
                                   update_us=self.update_us, min_regions=lo, max_regions=max(1000, 2 * lo))
        damon.set_target(k, pid, [(r.start, r.end) for r in ranges])
        damon.add_stat_scheme(k)

    def regions(self, k: int) -> list[tuple[int, int, int]]:
        """(start, end, nr_accesses) of kdamond k's latest aggregation (tried_regions, 6.2+)."""
        if damon.state(k) != "on":
            return []
        try:
            return damon.tried_regions(k)
        except OSError as e:
            raise SamplerUnavailable(f"damon: this kernel cannot report regions "
                                     f"(update_schemes_tried_regions needs 6.2+): {e}") from e

    def read_blocks(self) -> np.ndarray:
        if not self._started:
            raise RuntimeError("damon: not started")
        if self._generation != self.tracked.generation:
            self._build()
        now = _now_ns()
        rows = []
        self.last_regions = []
        for k, pid in enumerate(self._pids):
            for start, end, nr in self.regions(k):
                self.last_regions.append((pid, start, end, nr))   # for diagnostics
                if nr:
                    rows += _block_rows(pid, start, end, nr, self.tracked, now)
        # DAMON's regions can be finer than blocks: a block takes the busiest region inside it
        merged: dict[tuple[int, int], tuple] = {}
        for r in rows:
            key = (r[0], r[1])
            if key not in merged or r[3] > merged[key][3]:
                merged[key] = r
        rows = list(merged.values())
        return np.array(rows, BLOCK_ROWS_DTYPE) if rows else np.zeros(0, BLOCK_ROWS_DTYPE)

    def read_deltas(self) -> np.ndarray:
        return to_deltas(self.read_blocks(), self.source)

    def close(self) -> None:
        if not self._started:
            return
        self._started = False
        try:
            self._stop_all()
            if self._pids:
                damon.set_nr_kdamonds(0)
        except OSError as e:
            log.warning("damon: cleanup failed: %s", e)
        self._pids = []


# ---------------------------------------------------------------------------------------------
# idle page tracking

def idle_page_status() -> tuple[bool, str]:
    if not sysfs.exists(PAGE_IDLE_BITMAP):
        return False, "idle page tracking is not built in (CONFIG_IDLE_PAGE_TRACKING)"
    try:
        sysfs.pread(PAGE_IDLE_BITMAP, 0, 8)
    except OSError as e:
        return False, f"cannot read {PAGE_IDLE_BITMAP}: {e.strerror} (needs root)"
    return True, "idle page tracking available"


def _word_runs(words: np.ndarray, gap: int = 512) -> list[tuple[int, int]]:
    """Sorted unique bitmap word indices → [lo, hi] runs, split where the gap exceeds ``gap``."""
    if not len(words):
        return []
    cuts = np.flatnonzero(np.diff(words) > gap)
    starts = np.concatenate([[0], cuts + 1])
    ends = np.concatenate([cuts, [len(words) - 1]])
    return [(int(words[s]), int(words[e])) for s, e in zip(starts, ends)]


class IdlePageSampler(Sampler):
    name = "idle-page"
    source = SampleSource.ACCESSED

    def __init__(self, tracked: TrackedSet, *, max_pages_per_pid: int = 1 << 20):
        self.tracked = tracked
        self.max_pages_per_pid = max_pages_per_pid
        self._marked: dict[int, np.ndarray] = {}    # pid → PFNs marked idle last interval
        self._started = False

    def start(self) -> None:
        ok, why = idle_page_status()
        if not ok:
            raise SamplerUnavailable(f"idle-page: {why}")
        # PFNs are zero in pagemap without CAP_SYS_ADMIN: look at one of our own pages
        probe = np.ones(PAGE_SIZE // 8, np.uint64)
        if not procfs.pfns(procfs.read_pagemap(0, probe.ctypes.data, 1))[0]:
            raise SamplerUnavailable("idle-page: /proc/PID/pagemap hides PFNs (needs CAP_SYS_ADMIN)")
        self._started = True

    def _spans(self, pid: int) -> list[tuple[int, int, int | None]]:
        """(start, end, block_len or None for default blocks) to scan for ``pid``."""
        proc = self.tracked.process(pid)
        if proc is None:
            return []
        spans = [(r.start, r.end, r.block_len) for r in proc.ranges]
        if proc.all_addresses and not spans:
            spans += [(vma.start, vma.end, None) for vma in procfs.read_maps(pid, []) if vma.writable]
        return spans

    def _pfns(self, pid: int, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """(page addresses, PFNs) of the present pages in [start, end)."""
        first, n = start // PAGE_SIZE, (end - start + PAGE_SIZE - 1) // PAGE_SIZE
        pfn = procfs.pfns(procfs.read_pagemap(pid, first * PAGE_SIZE, n))
        keep = pfn != 0
        addrs = (np.arange(n, dtype=np.uint64) + np.uint64(first)) * np.uint64(PAGE_SIZE)
        return addrs[keep], pfn[keep]

    @staticmethod
    def _read_idle(pfns: np.ndarray) -> np.ndarray:
        words = pfns >> np.uint64(6)
        idle = np.zeros(len(pfns), bool)
        for lo, hi in _word_runs(np.unique(words)):
            data = np.frombuffer(sysfs.pread(PAGE_IDLE_BITMAP, lo * 8, (hi - lo + 1) * 8), "<u8")
            sel = (words >= lo) & (words <= hi)
            w = data[(words[sel] - np.uint64(lo)).astype(np.int64)]
            idle[sel] = ((w >> (pfns[sel] & np.uint64(63))) & np.uint64(1)) == 1
        return idle

    @staticmethod
    def _mark_idle(pfns: np.ndarray) -> None:
        words = pfns >> np.uint64(6)
        for lo, hi in _word_runs(np.unique(words)):
            buf = np.zeros(hi - lo + 1, "<u8")
            sel = (words >= lo) & (words <= hi)
            np.bitwise_or.at(buf, (words[sel] - np.uint64(lo)).astype(np.int64),
                             np.left_shift(np.uint64(1), pfns[sel] & np.uint64(63)))
            sysfs.pwrite(PAGE_IDLE_BITMAP, lo * 8, buf.tobytes())

    def read_blocks(self) -> np.ndarray:
        if not self._started:
            raise RuntimeError("idle-page: not started")
        now = _now_ns()
        out = []
        for pid in self.tracked.pids():
            addrs_all, pfns_all, blocks_all = [], [], []
            budget = self.max_pages_per_pid
            try:
                for start, end, block_len in self._spans(pid):
                    if budget <= 0:
                        break
                    end = min(end, start + budget * PAGE_SIZE)
                    addrs, pfns = self._pfns(pid, start, end)
                    budget -= (end - start) // PAGE_SIZE
                    bl = block_len or self.tracked.process(pid).default_block_len
                    base = start if block_len else 0
                    blocks = (addrs - np.uint64(base)) // np.uint64(bl) * np.uint64(bl) + np.uint64(base)
                    addrs_all.append(addrs)
                    pfns_all.append(pfns)
                    blocks_all.append(np.stack([blocks, np.full(len(blocks), bl, np.uint64)], 1))
            except OSError as e:
                log.debug("idle-page: pid %d: %s", pid, e)
                self._marked.pop(pid, None)
                continue
            if not pfns_all:
                continue
            pfns = np.concatenate(pfns_all)
            blocks = np.concatenate(blocks_all)
            prev = self._marked.get(pid)
            if prev is not None and len(pfns):
                idle = self._read_idle(pfns)
                was_marked = np.isin(pfns, prev)
                hit = was_marked & ~idle
                if hit.any():
                    uniq, cnt = np.unique(blocks[hit], axis=0, return_counts=True)
                    for (b, bl), c in zip(uniq.tolist(), cnt.tolist()):
                        out.append((pid, b, bl, c, now, 0))
            self._mark_idle(pfns)
            self._marked[pid] = np.unique(pfns)
        for pid in list(self._marked):
            if pid not in self.tracked:
                del self._marked[pid]
        return np.array(out, BLOCK_ROWS_DTYPE) if out else np.zeros(0, BLOCK_ROWS_DTYPE)

    def read_deltas(self) -> np.ndarray:
        return to_deltas(self.read_blocks(), self.source)

    def close(self) -> None:
        self._started = False
        self._marked.clear()
