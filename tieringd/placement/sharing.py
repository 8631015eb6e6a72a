# SPDX-License-Identifier: Apache-2.0
"""Sharing: how many processes map a block's pages (raises the heat's sharing factor), and what KSM
merging saves. This module measures and returns arrays (:func:`block_sharers`); the heat table
ingests them — it knows nothing of the table.

Mapcount. ``/proc/PID/pagemap`` holds one little-endian u64 per virtual page (Documentation/admin-
guide/mm/pagemap.rst): bit 63 present, 62 swapped, 61 file-page or shared-anon, 56 exclusively mapped
(since 4.2), bits 0–54 the page frame number. ``/proc/kpagecount`` holds one u64 per PFN: how many
times the page is mapped. Since 4.0 the PFN reads as 0 without CAP_SYS_ADMIN; then the exclusive bit
still tells "mapped once" from "mapped more than once", and a shared page counts as 2 (a lower bound).
Both files are read through :mod:`tieringd.kernel.procfs` (on :mod:`tieringd.kernel.sysfs`), so tests can point it
at a tree.

KSM. ``/sys/kernel/mm/ksm/pages_sharing`` counts the page-table entries that point at a merged page
beyond the first: the pages saved. Per process, ``/proc/PID/ksm_stat`` (6.1+: ksm_merging_pages,
ksm_process_profit) says the same for one process. The shim marks registered regions MADV_MERGEABLE
when ``TIERINGD_KSM=1``; ksmd must be running (``/sys/kernel/mm/ksm/run`` = 1) for anything to merge.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from tieringd.kernel import procfs, sysfs
from tieringd.kernel.procfs import PAGE_SIZE


def mapcounts(pid: int, addrs: np.ndarray) -> np.ndarray:
    """How many times each page at ``addrs`` is mapped: 0 not present; from kpagecount when the PFN
    is visible, else 1 for exclusive pages and 2 (at least) for the others."""
    entries = procfs.read_pagemap_at(pid, addrs)
    present, pfns = procfs.present(entries), procfs.pfns(entries)
    counts = np.zeros(len(entries), np.int64)
    visible = pfns != 0
    if visible.any():
        try:
            counts[visible] = procfs.read_kpagecount(pfns[visible])
        except sysfs.SysfsError:
            visible[:] = False                      # kpagecount needs CAP_SYS_ADMIN: fall back
    hidden = present & ~visible
    counts[hidden] = np.where(procfs.exclusive(entries[hidden]), 1, 2)
    return counts


def block_sharers(pid: int, start: int, length: int, block_bytes: int, pages_per_block: int = 1
                  ) -> np.ndarray | None:
    """Sharer count of each block of a region — ``length`` bytes at ``start`` in ``block_bytes`` steps,
    the last block possibly shorter, as the block table lays a region out: the largest mapcount of
    ``pages_per_block`` pages sampled in the block, at least 1. None when the process is gone (the
    registry notices). The caller hands the counts to the heat table (``BlockTable.set_sharers``)."""
    nb = -(-int(length) // int(block_bytes))
    if nb <= 0:
        return np.zeros(0, np.int64)
    k = max(1, min(pages_per_block, block_bytes // PAGE_SIZE))
    offs = (np.arange(k) * (block_bytes // k) // PAGE_SIZE) * PAGE_SIZE
    base = int(start) + np.arange(nb, dtype=np.uint64) * np.uint64(block_bytes)
    addrs = np.minimum((base[:, None] + offs[None, :].astype(np.uint64)).ravel(),
                       np.uint64(int(start) + int(length) - 1))
    try:
        counts = mapcounts(pid, addrs).reshape(nb, k).max(axis=1)
    except sysfs.SysfsError:
        return None
    return np.maximum(counts, 1)


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
    if not sysfs.is_dir(d):
        return None
    r = lambda name, default=0: sysfs.read_int(f"{d}/{name}", default)  # noqa: E731
    profit = sysfs.read_int(f"{d}/general_profit", None)
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
    stat = procfs.read_ksm_stat(pid)
    if stat is None:
        return None

    def num(key):
        try:
            return int(stat[key])
        except (KeyError, ValueError):
            return None
    mergeable = stat.get("ksm_mergeable")
    return ProcessKsm(merging_pages=num("ksm_merging_pages") or 0, profit_bytes=num("ksm_process_profit"),
                      mergeable=None if mergeable is None else mergeable == "yes")
