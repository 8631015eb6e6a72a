# SPDX-License-Identifier: Apache-2.0
"""Python side of ``bpf/migrations.bpf.c``: page migrations per reason, from migrate:mm_migrate_pages.

Lets the daemon tell its own moves (``syscall_or_cpuset``: move_pages/mbind) from the kernel's
(``numa_misplaced``: NUMA-balancing promotion; ``demotion``: reclaim-time demotion; ``damon``) and
compare them with /proc/vmstat (pgmigrate_success, pgpromote_success, pgdemote_*).
"""
from __future__ import annotations

import ctypes
import re

import numpy as np

from tieringd.kernel import sysfs

from .base import BpfSampler, empty_deltas

MIGRATE_REASONS_MAX = 16
# enum migrate_reason (include/linux/migrate_mode.h) as of 6.18; values are appended, never
# renumbered. The running kernel's own list is read from the tracepoint format when tracefs is up.
DEFAULT_REASONS = ["compaction", "memory_failure", "memory_hotplug", "syscall_or_cpuset",
                   "mempolicy_mbind", "numa_misplaced", "contig_range", "longterm_pin", "demotion",
                   "damon"]
FORMAT = "/sys/kernel/tracing/events/migrate/mm_migrate_pages/format"


class MigrateStat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("calls", "succeeded", "failed", "thp_succeeded",
                                               "thp_failed", "tracked_calls", "tracked_succeeded",
                                               "pad")]


def reason_names() -> list[str]:
    """Reason number → name on the running kernel (from the tracepoint's print format)."""
    text = sysfs.read_text(FORMAT, "")
    m = re.search(r"__print_symbolic\(REC->reason,(.*?)\)\s*$", text, re.S)
    if not m:
        return list(DEFAULT_REASONS)
    pairs = re.findall(r"\{\s*(\d+),\s*\"([^\"]+)\"\s*\}", m.group(1))
    names = list(DEFAULT_REASONS)
    for num, name in pairs:
        num = int(num)
        while len(names) <= num:
            names.append(f"reason{len(names)}")
        names[num] = name
    return names


class MigrationCounter(BpfSampler):
    """Cumulative migration counters since start, per reason name (:meth:`read`)."""

    tool = "migrations"
    programs = ("mm_migrate_pages",)
    source = None

    def check_layout(self) -> None:
        super().check_layout()
        self.obj.map("migrations").check_sizes(ctypes.c_uint32, MigrateStat)

    def read(self) -> dict[str, dict[str, int]]:
        names = reason_names()
        out = {}
        for i in range(MIGRATE_REASONS_MAX):
            v = self.obj.map("migrations").lookup(ctypes.c_uint32(i), MigrateStat)
            if v is None or not v.calls:
                continue
            name = names[i] if i < len(names) else f"reason{i}"
            out[name] = {f: int(getattr(v, f)) for f, _ in MigrateStat._fields_ if f != "pad"}
        return out

    def stats(self) -> dict[str, int]:
        """The program's own counters, and the migrations per reason as ``REASON.FIELD``
        (``numa_misplaced.succeeded``: pages the kernel's NUMA balancing promoted): what the daemon's
        metrics export beside the samplers' counters, its own moves (``syscall_or_cpuset``) apart
        from the kernel's."""
        if self.obj is None or not self.obj.loaded:
            return {}
        return {**super().stats(), **{f"{reason}.{field}": n for reason, fields in self.read().items()
                                      for field, n in fields.items()}}

    def read_deltas(self) -> np.ndarray:
        return empty_deltas()
