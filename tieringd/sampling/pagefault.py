# SPDX-License-Identifier: Apache-2.0
"""Python side of ``bpf/pagefault.bpf.c``: user page faults per (pid, block), NUMA hint faults included.

In a VM there is no data-address PMU; the access signal is the page fault, above all the kernel's
NUMA-balancing *hint* fault: task_numa_work() periodically makes a process's PTEs PROT_NONE, and the
next access to an already-populated page faults again. The MMU sees a PROT_NONE PTE as not present,
so a hint fault's error code looks like a first touch: on populated memory every fault counts. How to
get hint faults without the kernel's own promotion racing the daemon, and how cold pages on the fast
tier are seen, is in docs/sampling.md ("Hint faults").

THP: one hint fault unprotects a whole 2 MiB huge page, so further accesses to any of its blocks go
unseen until the next scan. A fault row whose block is smaller than the huge page that backs it is
therefore reported for the huge page (block_start aligned down to 2 MiB, block_len 2 MiB), its
count kept: the fault counts once, and the heat model spreads it.
"""
from __future__ import annotations

import numpy as np

from tieringd import _procfs
from tieringd._procfs import HPAGE_PMD_SIZE, KPF_THP
from tieringd.contracts import SampleSource

from .base import BLOCK_ROWS_DTYPE, BpfSampler, to_deltas

# bpf/pagefault.h, every #define (tests/unit/test_sampling_headers.py compiles the header and compares)
PF_ERR_PROT = 0x1
PF_ERR_WRITE = 0x2
PF_ERR_USER = 0x4
PF_ERR_INSTR = 0x10


def thp_backed(pid: int, addrs: np.ndarray) -> np.ndarray:
    """For each address, whether a transparent huge page maps it now (/proc/PID/pagemap for the PFN,
    /proc/kpageflags KPF_THP). False where it cannot be told (page gone, no CAP_SYS_ADMIN → PFN 0)."""
    try:
        flags = _procfs.read_kpageflags(_procfs.pfns(_procfs.read_pagemap_at(pid, addrs)))
    except OSError:
        return np.zeros(len(addrs), bool)
    return (flags & np.uint64(KPF_THP)) != 0


def widen_thp_rows(rows: np.ndarray) -> tuple[np.ndarray, int]:
    """Rows (BLOCK_ROWS_DTYPE) on THP-backed memory with blocks smaller than 2 MiB become one row
    per huge page; returns (rows, how many rows were widened)."""
    small = rows["block_len"] < HPAGE_PMD_SIZE
    if not small.any():
        return rows, 0
    huge = np.zeros(len(rows), bool)
    for pid in np.unique(rows["pid"][small]):
        sel = np.flatnonzero(small & (rows["pid"] == pid))
        huge[sel] = thp_backed(int(pid), rows["block_start"][sel])
    if not huge.any():
        return rows, 0
    wide = rows[huge].copy()
    wide["block_start"] &= ~np.uint64(HPAGE_PMD_SIZE - 1)
    wide["block_len"] = HPAGE_PMD_SIZE
    # merge rows that fell into the same huge page
    keys = np.stack([wide["pid"].astype(np.uint64), wide["block_start"]], axis=1)
    uniq, inv = np.unique(keys, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    merged = np.zeros(len(uniq), BLOCK_ROWS_DTYPE)
    merged["pid"] = uniq[:, 0].astype(np.int32)
    merged["block_start"] = uniq[:, 1]
    merged["block_len"] = HPAGE_PMD_SIZE
    np.add.at(merged["count"], inv, wide["count"])
    np.add.at(merged["extra"], inv, wide["extra"])
    np.maximum.at(merged["last_seen_ns"], inv, wide["last_seen_ns"])
    return np.concatenate([rows[~huge], merged]), int(huge.sum())


class PageFaultSampler(BpfSampler):
    """Faults of tracked processes; ``extra`` counts protection faults (COW, write-protect).
    ``thp_accounting``: widen rows on huge pages (module docstring)."""

    tool = "pagefault"
    source = SampleSource.FAULT
    programs = ("page_fault_user", "page_fault_kernel")

    def __init__(self, tracked, *, thp_accounting: bool = True, **kw):
        super().__init__(tracked, **kw)
        self.thp_accounting = thp_accounting
        self.thp_rows_widened = 0

    def read_blocks(self) -> np.ndarray:
        rows = super().read_blocks()
        if self.thp_accounting and len(rows):
            rows, n = widen_thp_rows(rows)
            self.thp_rows_widened += n
        return rows

    def read_deltas(self) -> np.ndarray:
        return to_deltas(self.read_blocks(), self.source)
