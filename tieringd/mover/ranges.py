# SPDX-License-Identifier: Apache-2.0
"""Range arithmetic of the engine: byte ranges → page-aligned intervals → page addresses → batches,
and the verified placement of a batch back into runs.

Pure numpy over sorted ``uint64`` address arrays; no system calls (tests/unit/test_mover_ranges.py).
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

import numpy as np

from tieringd.kernel.procfs import HPAGE_PMD_SIZE, PAGE_SIZE
from tieringd.contracts import LANDED_DTYPE


def coalesce(ranges: Iterable[tuple[int, int]], page_size: int = PAGE_SIZE) -> list[tuple[int, int]]:
    """(start, length) byte ranges → sorted, disjoint, page-aligned [start, end) intervals; ranges that
    overlap or touch (after alignment) become one."""
    spans = []
    for start, length in ranges:
        if length <= 0:
            continue
        lo = start - start % page_size
        hi = -(-(start + length) // page_size) * page_size
        spans.append((lo, hi))
    spans.sort()
    out: list[list[int]] = []
    for lo, hi in spans:
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def interval_pages(intervals: Sequence[tuple[int, int]], page_size: int = PAGE_SIZE) -> np.ndarray:
    """The page addresses of sorted [start, end) intervals, in order."""
    if not intervals:
        return np.zeros(0, dtype=np.uint64)
    return np.concatenate([np.arange(lo, hi, page_size, dtype=np.uint64) for lo, hi in intervals])


def interval_npages(intervals: Sequence[tuple[int, int]], page_size: int = PAGE_SIZE) -> int:
    return sum((hi - lo) // page_size for lo, hi in intervals)


def thp_heads(addrs: np.ndarray, thp: np.ndarray | None) -> np.ndarray:
    """Boolean mask of the addresses to send: every base page, but only the first page of each THP."""
    if thp is None or not thp.any():
        return np.ones(len(addrs), dtype=bool)
    huge = addrs // np.uint64(HPAGE_PMD_SIZE)
    first = np.ones(len(addrs), dtype=bool)
    first[1:] = huge[1:] != huge[:-1]
    return ~thp | first


def batch_end(pages: np.ndarray, pos: int, batch_pages: int,
              in_thp: Callable[[int], bool] = lambda addr: True) -> int:
    """End index of the batch starting at ``pos``: ``batch_pages`` pages, stretched to the next 2 MiB
    boundary when its last page is part of a THP (``in_thp``). A THP cut by a batch boundary would move
    whole with the first batch (the kernel migrates folios, not pages) and its other part would then be
    counted "already there" by the next — seen on 6.1, where large anonymous mappings are not yet
    THP-aligned (that came in 6.7)."""
    end = min(pos + batch_pages, len(pages))
    if end >= len(pages) or end <= pos or not in_thp(int(pages[end - 1])):
        return end
    hp = np.uint64(HPAGE_PMD_SIZE)
    boundary = (pages[end - 1] // hp + np.uint64(1)) * hp
    return int(np.searchsorted(pages, boundary, side="left"))


def contiguous_runs(addrs: np.ndarray, page_size: int = PAGE_SIZE) -> list[tuple[int, int]]:
    """(index, count) of runs of consecutive pages in a sorted address array."""
    if len(addrs) == 0:
        return []
    breaks = np.flatnonzero(np.diff(addrs.astype(np.int64)) != page_size) + 1
    starts = np.r_[0, breaks]
    ends = np.r_[breaks, len(addrs)]
    return list(zip(starts.tolist(), (ends - starts).tolist()))


def landed_runs(pid: int, addrs: np.ndarray, nodes: np.ndarray, page_size: int = PAGE_SIZE) -> np.ndarray:
    """Sorted page addresses and the node each one is on (negative: not present, no node) →
    ``LANDED_DTYPE`` rows, one per run of consecutive pages on the same node; absent pages are left out."""
    # Called once per batch: a handful of numpy calls, and one row at once for the usual batch (one
    # contiguous stretch, every page on one node).
    keep = nodes >= 0
    if not keep.all():
        addrs, nodes = addrs[keep], nodes[keep]
    out = np.empty(0 if len(addrs) == 0 else 1, LANDED_DTYPE)
    if len(addrs) == 0:
        return out
    if int(addrs[-1]) - int(addrs[0]) == (len(addrs) - 1) * page_size and (nodes == nodes[0]).all():
        out[0] = (pid, addrs[0], len(addrs), nodes[0])
        return out
    starts = np.empty(1, np.intp)
    starts[0] = 0
    breaks = np.flatnonzero((np.diff(addrs) != page_size) | (np.diff(nodes) != 0)) + 1
    starts = np.concatenate((starts, breaks))
    ends = np.empty_like(starts)
    ends[:-1] = starts[1:]
    ends[-1] = len(addrs)
    out = np.empty(len(starts), LANDED_DTYPE)
    out["pid"] = pid
    out["start"] = addrs[starts]
    out["npages"] = ends - starts
    out["node"] = nodes[starts]
    return out


def merge_landed(parts: Sequence[np.ndarray], page_size: int = PAGE_SIZE) -> np.ndarray:
    """Concatenated ``LANDED_DTYPE`` rows of one process, sorted by address, later rows winning where
    they overlap earlier ones (a retry that moved a page after all), adjacent runs on one node merged."""
    if not parts:
        return np.zeros(0, LANDED_DTYPE)
    rows = np.concatenate(parts)
    if len(rows) == 0:
        return rows
    pid = int(rows["pid"][0])
    npages = rows["npages"].astype(np.int64)
    addrs = np.repeat(rows["start"], npages) + (
        np.arange(int(npages.sum()), dtype=np.uint64)
        - np.repeat(np.cumsum(npages) - npages, npages).astype(np.uint64)) * np.uint64(page_size)
    nodes = np.repeat(rows["node"], npages)
    # the last report of each page wins: unique over the reversed order keeps the latest
    uniq, idx = np.unique(addrs[::-1], return_index=True)
    return landed_runs(pid, uniq, nodes[::-1][idx], page_size)
