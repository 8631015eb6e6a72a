# SPDX-License-Identifier: Apache-2.0
"""Tier capacities from node meminfo and /proc/zoneinfo (tieringd/daemon/capacity.py), on the trees
captured in the lab guests: capacity is the tier's MemTotal less the free memory its zones keep for
the kernel, "other" what its nodes hold beyond the table's blocks (page cache included: only free
pages are room a move gets without reclaim)."""
from pathlib import Path

import numpy as np

from tieringd.kernel import procfs, sysfs
from tieringd.memory import topology
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
    with sysfs.root(root):
        topo = topology.discover({})
        specs = capacity.tier_specs(topo, np.zeros(16))
        lookup = capacity.tier_lookup(topo)
    assert [(s.tier, s.nodes) for s in specs] == [(Tier.DRAM, (0,)), (Tier.CXL_DRAM, (1,))]
    m0 = meminfo(root, 0)
    # node 0's zoneinfo: DMA keeps promo 112 + protection 1933 pages (all but 1795 of its 3840),
    # DMA32 its promo 14589; Normal and Movable manage nothing there
    assert specs[0].capacity_bytes == m0["MemTotal"] - (2045 + 14589) * procfs.PAGE_SIZE
    assert specs[0].other_bytes == m0["MemTotal"] - m0["MemFree"]       # page cache counted too
    assert lookup[0] == int(Tier.DRAM) and lookup[1] == int(Tier.CXL_DRAM)
    assert lookup[7] == int(Tier.CXL_DRAM)        # an unknown node: the slowest tier present


def test_the_tables_own_bytes_are_not_counted_as_other_usage():
    root = SYSFS / "cxl-6.12"
    with sysfs.root(root):
        topo = topology.discover({})
        base = capacity.tier_specs(topo, np.zeros(16))
        ours = np.zeros(16)
        ours[0] = 40 << 20
        ours[1] = 1 << 40                       # more than the node uses: clamped at no other usage
        specs = capacity.tier_specs(topo, ours)
    assert specs[0].other_bytes == base[0].other_bytes - (40 << 20)
    assert specs[1].other_bytes == 0


def test_a_one_node_machine_has_one_managed_tier():
    with sysfs.root(SYSFS / "host-6.18"):
        topo = topology.discover({})
        specs = capacity.tier_specs(topo, np.zeros(16))
    assert len(specs) == 1 and specs[0].tier == Tier.DRAM and specs[0].capacity_bytes > 0


def test_zoneinfo_gives_each_zone_its_own_watermarks_not_the_pagesets_high():
    with sysfs.root(SYSFS / "cxl-6.12"):
        zones = procfs.read_zoneinfo()
    assert [(z.node, z.name) for z in zones][:3] == [(0, "DMA"), (0, "DMA32"), (0, "Normal")]
    dma32 = zones[1]
    # the pageset lines below the zone say "high:  5210"; the zone's own watermarks come first
    watermarks = (dma32.min, dma32.low, dma32.high, dma32.promo, dma32.managed)
    assert watermarks == (8337, 10421, 12505, 14589, 495403)
    assert zones[0].protection == (0, 1933, 1933, 1933, 1933)


def test_a_kernel_without_a_promotion_watermark_reserves_up_to_high():
    with sysfs.root(SYSFS / "cxl-6.1"):
        zones = procfs.read_zoneinfo()
    assert all(z.promo == z.high for z in zones)
    # node 1 is one Normal zone: high 12717 pages, no protection against itself
    assert capacity.kernel_reserve_bytes(zones, 1) == 12717 * procfs.PAGE_SIZE


def test_a_movable_zone_is_reserved_by_its_own_watermark():
    """pmem-6.12's node 2 is the DAX device onlined as ZONE_MOVABLE: its zone's promo watermark (3020
    pages) is all the kernel keeps there."""
    with sysfs.root(SYSFS / "pmem-6.12"):
        zones = procfs.read_zoneinfo()
        mem = capacity.node_memory(2, zones)
    assert mem.kernel_reserve_bytes == 3020 * procfs.PAGE_SIZE
    assert mem.capacity_bytes == mem.total_bytes - 3020 * procfs.PAGE_SIZE


def test_without_zoneinfo_the_capacity_is_memtotal(tmp_path):
    """A tree without /proc/zoneinfo (a kernel or container that hides it): nothing reserved, no error."""
    node = tmp_path / "sys/devices/system/node/node0"
    node.mkdir(parents=True)
    (node / "meminfo").write_text("Node 0 MemTotal:  1048576 kB\nNode 0 MemFree:  524288 kB\n")
    with sysfs.root(tmp_path):
        mem = capacity.node_memory(0)
    assert (mem.total_bytes, mem.used_bytes, mem.capacity_bytes) == (1 << 30, 1 << 29, 1 << 30)
