# SPDX-License-Identifier: Apache-2.0
"""Python side of ``bpf/pagefault.bpf.c``: user page faults per (pid, block), NUMA hint faults included.

In a VM there is no data-address PMU; the access signal is the page fault, above all the kernel's
NUMA-balancing *hint* fault: task_numa_work() periodically makes a process's PTEs PROT_NONE, and the
next access to an already-populated page faults again. The MMU sees a PROT_NONE PTE as not present,
so a hint fault's error code looks like a first touch: on populated memory every fault counts. How to
get hint faults without the kernel's own promotion racing the daemon, and how cold pages on the fast
tier are seen, is in docs/sampling.md ("Hint faults").

The unit of ``count`` (``thp_accounting``, the default): **base pages seen accessed**. One hint fault
on a 4 KiB page unprotects that page; one on a PMD-mapped THP unprotects all 512 (HPAGE_PMD_NR) and
no further access to the huge page faults until the next scan. Counting faults would rank a hot
4 KiB-backed block (up to 512 faults per scan pass) far above an equally hot THP-backed one (one):
measured in the lab, 262 against 0.54 per block per second (docs/loop.md). So a fault on a THP counts
HPAGE_PMD_NR, shared among the blocks the huge page overlaps by their pages in it (all 512 to a block
of 2 MiB or more; 16 to each of 32 blocks of 64 KiB), and a fault on a 4 KiB page counts 1.

The tracepoint does not tell the page size (docs/sampling.md), so the BPF program counts each block
per piece — its part within one 2 MiB-aligned chunk — and :func:`pmd_thp_at` tells, when the rows are
read, whether a THP maps each piece's chunk (one PAGEMAP_SCAN walk, or pagemap PFNs and kpageflags
before 6.7). Rows come back one per block.

Writes: the x86 error code of every fault says whether a write took it (PF_ERR_WRITE: a first touch
by a write, a hint fault a write took, COW), and the BPF program counts those per piece in the high
half of ``extra``. A write fault on a PMD-mapped THP makes the whole huge page writable, so later
writes anywhere in it go unseen until the next scan pass: it counts for every block the huge page
overlaps, as its base pages do. ``last_writes`` holds, per row of the last read, the write faults
seen in the block — the daemon's decode frontier (tieringd/daemon/position.py).
"""
from __future__ import annotations

import numpy as np

from tieringd.kernel import procfs
from tieringd.kernel.procfs import HPAGE_PMD_NR, HPAGE_PMD_SIZE, KPF_COMPOUND_HEAD, KPF_THP, PAGE_SIZE
from tieringd.contracts import SampleSource

from .base import BLOCK_ROWS_DTYPE, BpfSampler, to_deltas
from .tracking import TrackedSet

# bpf/pagefault.h, every #define (tests/unit/test_sampling_headers.py compiles the header and compares)
PF_ERR_PROT = 0x1
PF_ERR_WRITE = 0x2
PF_ERR_USER = 0x4
PF_ERR_INSTR = 0x10
PF_EXTRA_PROT_MASK = 0xffffffff
PF_EXTRA_WRITE_SHIFT = 32

_HUGE_MASK = ~np.uint64(HPAGE_PMD_SIZE - 1)
SCAN_GAP_BYTES = 64 << 20     # chunks farther apart than this are asked in walks of their own


def split_extra(extra: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """This tool's ``extra`` (bpf/pagefault.h) → (protection faults, write faults), uint64 each."""
    extra = np.asarray(extra, np.uint64)
    return extra & np.uint64(PF_EXTRA_PROT_MASK), extra >> np.uint64(PF_EXTRA_WRITE_SHIFT)


def thp_backed(pid: int, addrs: np.ndarray) -> np.ndarray:
    """For each address, whether a transparent huge page (of any size) maps it now (/proc/PID/pagemap
    for the PFN, /proc/kpageflags KPF_THP). False where it cannot be told (page gone, no
    CAP_SYS_ADMIN → PFN 0)."""
    try:
        flags = procfs.read_kpageflags(procfs.pfns(procfs.read_pagemap_at(pid, addrs)))
    except OSError:
        return np.zeros(len(addrs), bool)
    return (flags & np.uint64(KPF_THP)) != 0


def pmd_thp_at(pid: int, huge_starts: np.ndarray) -> np.ndarray:
    """For each 2 MiB-aligned address, whether one PMD-sized THP maps the chunk. From one
    PAGEMAP_SCAN walk of the span (6.7+: PAGE_IS_HUGE is a PMD mapping, so a THP whose PMD was split
    is not one), else per chunk from pagemap and kpageflags (:func:`_pmd_thp_by_flags`). False where
    it cannot be told."""
    huge_starts = np.asarray(huge_starts, np.uint64)
    if len(huge_starts) == 0:
        return np.zeros(0, bool)
    # one walk per cluster of chunks: a walk across the gap between two far-apart chunks would read
    # every page table of what lies there (model weights mapped between a heap and a KV pool)
    chunks = np.unique(huge_starts)
    cut = np.flatnonzero(np.diff(chunks) > np.uint64(SCAN_GAP_BYTES)) + 1
    parts = []
    try:
        for run in np.split(chunks, cut):
            got = procfs.pmd_mapped_ranges(pid, int(run[0]), int(run[-1]) + HPAGE_PMD_SIZE)
            if got is None:
                return _pmd_thp_by_flags(pid, huge_starts)
            parts.append(got)
    except OSError:
        return np.zeros(len(huge_starts), bool)
    ranges = np.concatenate(parts)
    # the range starting at or before each chunk must reach past its end
    i = np.searchsorted(ranges[:, 0], huge_starts, side="right") - 1
    ok = i >= 0
    out = np.zeros(len(huge_starts), bool)
    out[ok] = ranges[i[ok], 1] >= huge_starts[ok] + np.uint64(HPAGE_PMD_SIZE)
    return out


def _pmd_thp_by_flags(pid: int, huge_starts: np.ndarray) -> np.ndarray:
    """:func:`pmd_thp_at` before 6.7: a chunk's 512 pages present on physically contiguous, 2 MiB-
    aligned frames that form one compound page (a head at the first, none after; KPF_THP on all).
    KPF_THP alone would also take a chunk of smaller multi-size THPs (6.8+), whose faults do not
    unprotect 512 pages. A THP whose PMD was split (mprotect or mbind of part of it, until
    khugepaged collapses it) looks the same from here and is counted as one. Two reads of 4 KiB per
    chunk: most of a fault sampler's read where it is the way."""
    out = np.zeros(len(huge_starts), bool)
    for i in np.flatnonzero(thp_backed(pid, huge_starts)):
        try:
            pfn = procfs.pfns(procfs.read_pagemap(pid, int(huge_starts[i]), HPAGE_PMD_NR))
            if pfn[0] == 0 or pfn[0] % HPAGE_PMD_NR or \
                    (pfn != pfn[0] + np.arange(HPAGE_PMD_NR, dtype=np.uint64)).any():
                continue
            flags = procfs.read_kpageflags(pfn)
        except OSError:
            continue
        head = (flags & np.uint64(KPF_COMPOUND_HEAD)) != 0
        out[i] = bool(head[0] and not head[1:].any() and ((flags & np.uint64(KPF_THP)) != 0).all())
    return out


def _blocks_over(tracked: TrackedSet, pid: int, addr: int, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(block_start, block_len, bytes of [lo, hi) in it) for the blocks that tracked's accounting of
    ``addr`` puts over [lo, hi): the blocks of the range holding ``addr`` (clipped to it), or the
    process's default blocks; [] when pid is no longer tracked."""
    rng = tracked.find_range(pid, addr)
    if rng is not None:
        base, step = rng.start, rng.block_len
        lo, hi = max(lo, rng.start), min(hi, rng.end)
    else:
        proc = tracked.process(pid)
        if proc is None or not proc.all_addresses:
            return []
        base, step = 0, proc.default_block_len
    out = []
    b = base + (lo - base) // step * step
    while b < hi:
        out.append((b, step, min(b + step, hi) - max(b, lo)))
        b += step
    return out


def count_base_pages(rows: np.ndarray, tracked: TrackedSet, huge: np.ndarray) -> np.ndarray:
    """Piece rows (BLOCK_ROWS_DTYPE, each within one 2 MiB chunk; ``huge``: a PMD-mapped THP maps
    its chunk) → one row per block, ``count`` in base pages seen accessed (module docstring).
    ``extra`` stays as the kernel packs it (:func:`split_extra`): its protection faults are kept with
    the block holding the piece; its write faults too, or on a THP with every block the huge page
    overlaps (the write made all of it writable). A piece whose process left the tracked set is
    kept as it is."""
    acc: dict[tuple[int, int], list[int]] = {}      # (pid, block_start) → [block_len, count, last, extra]

    def add(pid, start, blen, count, last, extra):
        cur = acc.get((pid, start))
        if cur is None:
            acc[(pid, start)] = [blen, count, last, extra]
        else:
            cur[1] += count
            cur[2] = max(cur[2], last)
            cur[3] += extra

    for r, is_huge in zip(rows.tolist(), huge.tolist()):
        pid, start, blen, count, last, extra = r
        if not is_huge:
            own = _blocks_over(tracked, pid, start, start, start + 1)
            b, bl = (own[0][0], own[0][1]) if own else (start, blen)
            add(pid, b, bl, count, last, extra)
            continue
        lo = start & ~(HPAGE_PMD_SIZE - 1)
        covered = _blocks_over(tracked, pid, start, lo, lo + HPAGE_PMD_SIZE)
        if not covered:
            add(pid, lo, HPAGE_PMD_SIZE, count * HPAGE_PMD_NR, last, extra)
            continue
        writes = extra & ~PF_EXTRA_PROT_MASK
        for b, bl, nbytes in covered:
            mine = b <= start < b + bl
            add(pid, b, bl, count * (-(-nbytes // PAGE_SIZE)), last, extra if mine else writes)
    out = np.zeros(len(acc), BLOCK_ROWS_DTYPE)
    for i, ((pid, start), (blen, count, last, extra)) in enumerate(acc.items()):
        out[i] = (pid, start, blen, count, last, extra)
    return out


class PageFaultSampler(BpfSampler):
    """Faults of tracked processes, one row per block; ``extra`` counts protection faults (COW,
    write-protect), ``last_writes`` the write faults of each row of the last read. ``thp_accounting``
    (default): ``count`` is base pages seen accessed, a fault on a PMD-mapped THP counting for the
    huge page's 512 pages (module docstring); off: faults."""

    tool = "pagefault"
    source = SampleSource.FAULT
    programs = ("page_fault_user", "page_fault_kernel")
    tells_writes = True

    def __init__(self, tracked, *, thp_accounting: bool = True, **kw):
        super().__init__(tracked, **kw)
        self.thp_accounting = thp_accounting
        self.thp_rows = 0           # piece rows found on a PMD-mapped THP since start

    def read_blocks(self) -> np.ndarray:
        rows = super().read_blocks()
        if len(rows):
            huge = np.zeros(len(rows), bool)
            if self.thp_accounting:
                chunks = rows["block_start"] & _HUGE_MASK
                for pid in np.unique(rows["pid"]):
                    sel = np.flatnonzero(rows["pid"] == pid)
                    uniq, inv = np.unique(chunks[sel], return_inverse=True)
                    huge[sel] = pmd_thp_at(int(pid), uniq)[inv.reshape(-1)]
                self.thp_rows += int(huge.sum())
            rows = count_base_pages(rows, self.tracked, huge)
        rows["extra"], writes = split_extra(rows["extra"])
        self.last_writes = np.minimum(writes, np.iinfo(np.uint32).max).astype(np.uint32)
        return rows

    def read_deltas(self) -> np.ndarray:
        return to_deltas(self.read_blocks(), self.source)
