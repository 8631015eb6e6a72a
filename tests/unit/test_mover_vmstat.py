# SPDX-License-Identifier: Apache-2.0
"""The mover's /proc/vmstat snapshot (tieringd/mover/vmstat.py) on trees captured from lab guests."""
from pathlib import Path

import pytest

from tieringd.kernel import sysfs
from tieringd.mover import vmstat

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "sysfs"


def fixture_vmstat(root: Path) -> dict[str, int]:
    """The fixture's own file, parsed independently of the code under test."""
    return {k: int(v) for k, v in (line.split() for line in (root / "proc/vmstat").read_text().splitlines())}


@pytest.mark.parametrize("name", ["cxl-6.1", "cxl-7.3", "host-6.18"])
def test_snapshot_reads_the_migration_counters_the_kernel_has(name):
    root = FIXTURES / name
    with sysfs.root(root):
        snap = vmstat.vmstat_snapshot()
    raw = fixture_vmstat(root)
    assert snap == {k: raw[k] for k in vmstat.MIGRATION_COUNTERS if k in raw}
    assert "pgmigrate_success" in snap


def test_delta_counts_new_counters_from_zero():
    assert vmstat.vmstat_delta({"pgmigrate_success": 5}, {"pgmigrate_success": 12, "pgmigrate_fail": 1}) == \
        {"pgmigrate_success": 7, "pgmigrate_fail": 1}
