# SPDX-License-Identifier: Apache-2.0
"""The kernel's migration counters in /proc/vmstat, read before and after a move to cross-check the
engine's own counters.

``pgmigrate_success`` counts every base page ``move_pages`` migrated (mm/migrate.c counts base pages,
a THP as 512): the engine's total ``moved_pages`` must equal its delta (checked in the lab).
``pgpromote_success`` and ``pgdemote_*`` count only the kernel's own NUMA-balancing promotions and
reclaim demotions, never ``move_pages``; they are read too, so reports can show both side by side.
"""
from __future__ import annotations

from tieringd.kernel import procfs

# Page-migration counters of /proc/vmstat. Not every kernel has every one (pgdemote_proactive is in
# 6.18's and 7.3's vmstat, not in 6.12's — tests/fixtures/sysfs): what the kernel lacks is left out.
MIGRATION_COUNTERS = ("pgmigrate_success", "pgmigrate_fail", "pgpromote_success", "pgdemote_kswapd",
                      "pgdemote_direct", "pgdemote_khugepaged", "pgdemote_proactive",
                      "numa_pages_migrated", "thp_migration_success", "thp_migration_fail",
                      "thp_migration_split")


def vmstat_snapshot() -> dict[str, int]:
    """The migration counters of /proc/vmstat (keys the kernel lacks are left out)."""
    return procfs.read_vmstat(MIGRATION_COUNTERS)


def vmstat_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """``after - before`` per counter of ``after`` (a counter new in ``after`` counts from 0)."""
    return {k: after[k] - before.get(k, 0) for k in after}
