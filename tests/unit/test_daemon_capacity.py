# SPDX-License-Identifier: Apache-2.0
"""Tier capacities from node meminfo (tieringd/daemon/capacity.py), on the sysfs trees captured in the
lab guests: capacity is the tier's MemTotal, "other" what its nodes hold beyond the table's blocks
(page cache included: only free pages are room a move gets without reclaim)."""
from pathlib import Path

import numpy as np

from tieringd import _sysfs, topology
from tieringd.contracts import Tier
from tieringd.daemon import capacity

SYSFS = Path(__file__).resolve().parents[1] / "fixtures" / "sysfs"
KiB = 1024


def meminfo(root: Path, node: int) -> dict[str, int]:
    out = {}
    for line in (root / f"sys/devices/system/node/node{node}/meminfo").read_text().splitlines():
        p = line.split()
        out[p[2].rstrip(":")] = int(p[3]) * KiB
    return out


def test_cxl_guest_has_a_dram_and_a_cxl_tier_sized_by_meminfo():
    root = SYSFS / "cxl-6.12"
    with _sysfs.root(root):
        topo = topology.discover({})
        specs = capacity.tier_specs(topo, np.zeros(16))
        lookup = capacity.tier_lookup(topo)
    assert [(s.tier, s.nodes) for s in specs] == [(Tier.DRAM, (0,)), (Tier.CXL_DRAM, (1,))]
    m0 = meminfo(root, 0)
    assert specs[0].capacity_bytes == m0["MemTotal"]
    assert specs[0].other_bytes == m0["MemTotal"] - m0["MemFree"]       # page cache counted too
    assert lookup[0] == int(Tier.DRAM) and lookup[1] == int(Tier.CXL_DRAM)
    assert lookup[7] == int(Tier.CXL_DRAM)        # an unknown node: the slowest tier present


def test_the_tables_own_bytes_are_not_counted_as_other_usage():
    root = SYSFS / "cxl-6.12"
    with _sysfs.root(root):
        topo = topology.discover({})
        base = capacity.tier_specs(topo, np.zeros(16))
        ours = np.zeros(16)
        ours[0] = 40 << 20
        ours[1] = 1 << 40                       # more than the node uses: clamped at no other usage
        specs = capacity.tier_specs(topo, ours)
    assert specs[0].other_bytes == base[0].other_bytes - (40 << 20)
    assert specs[1].other_bytes == 0


def test_a_one_node_machine_has_one_managed_tier():
    with _sysfs.root(SYSFS / "host-6.18"):
        topo = topology.discover({})
        specs = capacity.tier_specs(topo, np.zeros(16))
    assert len(specs) == 1 and specs[0].tier == Tier.DRAM and specs[0].capacity_bytes > 0
