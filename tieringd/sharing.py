# SPDX-License-Identifier: Apache-2.0
"""Sharing: how many processes map a block's pages (raises the heat's sharing factor), and what KSM
merging saves.

Mapcount. ``/proc/PID/pagemap`` holds one little-endian u64 per virtual page (Documentation/admin-
guide/mm/pagemap.rst): bit 63 present, 62 swapped, 61 file-page or shared-anon, 56 exclusively mapped
(since 4.2), bits 0–54 the page frame number. ``/proc/kpagecount`` holds one u64 per PFN: how many
times the page is mapped. Since 4.0 the PFN reads as 0 without CAP_SYS_ADMIN; then the exclusive bit
still tells "mapped once" from "mapped more than once", and a shared page counts as 2 (a lower bound).
Both files are read only through :mod:`tieringd._sysfs` (``pread``), so tests can point it at a tree.

KSM. ``/sys/kernel/mm/ksm/pages_sharing`` counts the page-table entries that point at a merged page
beyond the first: the pages saved. Per process, ``/proc/PID/ksm_stat`` (6.1+: ksm_merging_pages,
ksm_process_profit) says the same for one process. The shim marks registered regions MADV_MERGEABLE
when ``TIERINGD_KSM=1``; ksmd must be running (``/sys/kernel/mm/ksm/run`` = 1) for anything to merge.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from tieringd import _sysfs
from tieringd.heat import BlockTable

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
PM_PRESENT = np.uint64(1 << 63)
PM_SWAPPED = np.uint64(1 << 62)
PM_FILE_OR_SHARED = np.uint64(1 << 61)
PM_EXCLUSIVE = np.uint64(1 << 56)
PM_PFN_MASK = np.uint64((1 << 55) - 1)
_PAGEMAP_GAP = 4096              # pages (32 KiB of pagemap)
_KPAGECOUNT_SPAN = 8192          # PFNs read with one pread when they are close together (64 KiB)


@dataclasses.dataclass(frozen=True)
class PageInfo:
    """Decoded pagemap entries, one per page."""
    present: np.ndarray     # bool
    pfn: np.ndarray         # uint64; 0 when hidden (no CAP_SYS_ADMIN) or not present
    exclusive: np.ndarray   # bool: mapped by exactly one process
    shared_flag: np.ndarray  # bool: file page or shared anonymous page


def decode_pagemap(raw: bytes | np.ndarray) -> PageInfo:
    e = np.frombuffer(raw, "<u8") if isinstance(raw, (bytes, bytearray)) else np.asarray(raw, np.uint64)
    present = (e & PM_PRESENT) != 0
    return PageInfo(present=present, pfn=np.where(present, e & PM_PFN_MASK, np.uint64(0)),
                    exclusive=(e & PM_EXCLUSIVE) != 0, shared_flag=(e & PM_FILE_OR_SHARED) != 0)


def read_pagemap(pid: int, addrs: np.ndarray) -> PageInfo:
    """Pagemap entries for the pages holding ``addrs`` (one pread per run of adjacent pages)."""
    pages = np.asarray(addrs, np.uint64) // np.uint64(PAGE_SIZE)
    out = np.zeros(len(pages), np.uint64)
    if len(pages):
        order = np.argsort(pages, kind="stable")
        sp = pages[order]
        # one pread per stretch of pages less than _PAGEMAP_GAP apart (sampling one page per block
        # leaves small gaps; reading through them is cheaper than a syscall per block)
        brk = np.flatnonzero(np.diff(sp.astype(np.int64)) > _PAGEMAP_GAP) + 1
        for run in np.split(np.arange(len(sp)), brk):
            first, last = int(sp[run[0]]), int(sp[run[-1]])
            raw = _sysfs.pread(f"/proc/{pid}/pagemap", first * 8, (last - first + 1) * 8)
            vals = np.frombuffer(raw, "<u8")
            got = sp[run].astype(np.int64) - first
            ok = got < len(vals)
            out[order[run[ok]]] = vals[got[ok]]
    return decode_pagemap(out)


def read_kpagecount(pfns: np.ndarray) -> np.ndarray:
    """Mapcounts for page frame numbers (PFN 0 → 0). Nearby PFNs share one pread."""
    pfns = np.asarray(pfns, np.uint64)
    out = np.zeros(len(pfns), np.int64)
    want = np.flatnonzero(pfns)
    if len(want) == 0:
        return out
    order = want[np.argsort(pfns[want], kind="stable")]
    sp = pfns[order].astype(np.int64)
    brk = np.flatnonzero(np.diff(sp) > _KPAGECOUNT_SPAN) + 1
    for run in np.split(np.arange(len(sp)), brk):
        first, last = int(sp[run[0]]), int(sp[run[-1]])
        vals = np.frombuffer(_sysfs.pread("/proc/kpagecount", first * 8, (last - first + 1) * 8), "<u8")
        got = sp[run] - first
        ok = got < len(vals)
        out[order[run[ok]]] = vals[got[ok]].astype(np.int64)
    return out


def mapcounts(pid: int, addrs: np.ndarray) -> np.ndarray:
    """How many times each page at ``addrs`` is mapped: 0 not present; from kpagecount when the PFN
    is visible, else 1 for exclusive pages and 2 (at least) for the others."""
    info = read_pagemap(pid, addrs)
    counts = np.zeros(len(info.present), np.int64)
    visible = info.present & (info.pfn != 0)
    if visible.any():
        try:
            counts[visible] = read_kpagecount(info.pfn[visible])
        except _sysfs.SysfsError:
            visible[:] = False                      # kpagecount needs CAP_SYS_ADMIN: fall back
    hidden = info.present & ~visible
    counts[hidden] = np.where(info.exclusive[hidden], 1, 2)
    return counts


def update_block_sharers(table: BlockTable, rids=None, pages_per_block: int = 1) -> int:
    """Sample ``pages_per_block`` pages of every block (of the given regions) and store the largest
    mapcount seen as the block's sharer count. Returns the number of blocks updated."""
    rids = np.flatnonzero(table.r_live[:table.nregions]) if rids is None else np.asarray(rids)
    done = 0
    for rid in rids:
        sl = table.region_slice(int(rid))
        nb = sl.stop - sl.start
        if nb <= 0:
            continue
        bb = int(table.r_block_bytes[rid])
        k = max(1, min(pages_per_block, bb // PAGE_SIZE))
        offs = (np.arange(k) * (bb // k) // PAGE_SIZE) * PAGE_SIZE
        base = int(table.r_start[rid]) + np.arange(nb, dtype=np.uint64) * np.uint64(bb)
        addrs = (base[:, None] + offs[None, :].astype(np.uint64)).ravel()
        ends = int(table.r_start[rid]) + int(table.r_length[rid])
        addrs = np.minimum(addrs, np.uint64(ends - 1))
        try:
            counts = mapcounts(int(table.r_pid[rid]), addrs).reshape(nb, k).max(axis=1)
        except _sysfs.SysfsError:
            continue                                 # the process is gone; the registry will notice
        table.set_sharers(np.arange(sl.start, sl.stop), np.maximum(counts, 1))
        done += nb
    return done


@dataclasses.dataclass(frozen=True)
class KsmStatus:
    """``/sys/kernel/mm/ksm``: whether ksmd runs and what it has merged."""
    run: int
    pages_shared: int       # merged pages kept (one copy each)
    pages_sharing: int      # further mappings of them: pages saved
    pages_unshared: int
    pages_volatile: int
    full_scans: int
    general_profit: int | None   # bytes, 6.1+: saved minus KSM's own metadata

    @property
    def saved_bytes(self) -> int:
        return self.pages_sharing * PAGE_SIZE


def ksm_status() -> KsmStatus | None:
    """None when the kernel has no KSM (CONFIG_KSM=n)."""
    d = "/sys/kernel/mm/ksm"
    if not _sysfs.is_dir(d):
        return None
    r = lambda name, default=0: _sysfs.read_int(f"{d}/{name}", default)  # noqa: E731
    profit = _sysfs.read_int(f"{d}/general_profit", None)
    return KsmStatus(run=r("run"), pages_shared=r("pages_shared"), pages_sharing=r("pages_sharing"),
                     pages_unshared=r("pages_unshared"), pages_volatile=r("pages_volatile"),
                     full_scans=r("full_scans"), general_profit=profit)


@dataclasses.dataclass(frozen=True)
class ProcessKsm:
    """``/proc/PID/ksm_stat`` (6.1+; older kernels: ``/proc/PID/ksm_merging_pages`` only, 5.19+)."""
    merging_pages: int
    profit_bytes: int | None
    mergeable: bool | None     # ksm_mergeable (6.8+): some VMA is MADV_MERGEABLE

    @property
    def saved_bytes(self) -> int:
        return self.merging_pages * PAGE_SIZE


def process_ksm(pid: int) -> ProcessKsm | None:
    stat = _sysfs.read_keyed(f"/proc/{pid}/ksm_stat", None)
    if stat is None:
        pages = _sysfs.read_int(f"/proc/{pid}/ksm_merging_pages", None)
        return None if pages is None else ProcessKsm(pages, None, None)

    def num(key):
        try:
            return int(stat[key])
        except (KeyError, ValueError):
            return None
    mergeable = stat.get("ksm_mergeable")
    return ProcessKsm(merging_pages=num("ksm_merging_pages") or 0, profit_bytes=num("ksm_process_profit"),
                      mergeable=None if mergeable is None else mergeable == "yes")
