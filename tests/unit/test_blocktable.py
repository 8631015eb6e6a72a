# SPDX-License-Identifier: Apache-2.0
"""The block table's storage alone (tieringd/placement/blocktable.py): regions as runs of rows, one
lookup from a region's identity to its rows that survives removal and compaction, sampled spans to
blocks, and bytes per tier and node kept as rows come and go."""
import numpy as np

from tieringd.contracts import RegionKey, Tier
from tieringd.placement.blocktable import FLAG_VALID, BlockStore

MiB = 1 << 20


def test_a_region_is_found_by_its_identity_after_removals_and_compaction():
    t = BlockStore(capacity=16)
    a = t.add_region(7, 0x10000000, 10 * MiB, 2 * MiB, node=0, tier=Tier.DRAM)
    b = t.add_region(7, 0x20000000, 5 * MiB, 2 * MiB, node=1, tier=Tier.CXL_DRAM)
    c = t.add_region(9, 0x10000000, 4 * MiB, 2 * MiB, node=1, tier=Tier.CXL_DRAM)
    assert [t.region_id(RegionKey(7, 0x10000000)), t.region_id((7, 0x20000000)), t.region_id((9, 0x10000000))] == [a, b, c]
    assert t.region_id((7, 0x10000000 + 4096)) is None and t.region_id((8, 0x10000000)) is None
    assert t.region_key(b) == RegionKey(7, 0x20000000)
    assert list(t.size[t.region_slice(b)]) == [2 * MiB, 2 * MiB, MiB]             # the last block is short
    assert t.tier_bytes[Tier.DRAM] == 10 * MiB and t.node_bytes[1] == 9 * MiB
    t.remove_region(a)
    assert t.region_id((7, 0x10000000)) is None and t.tier_bytes[Tier.DRAM] == 0
    t.compact()
    b2, c2 = t.region_id((7, 0x20000000)), t.region_id((9, 0x10000000))
    assert t.region_key(b2) == (7, 0x20000000) and t.region_key(c2) == (9, 0x10000000)
    assert t.n == 5 and (t.flags[:t.n] == FLAG_VALID).all() and list(t.region[:t.n]) == [b2] * 3 + [c2] * 2


def test_sampled_spans_map_to_every_block_they_cover_and_nothing_outside():
    t = BlockStore()
    rid = t.add_region(7, 0x10000000, 8 * MiB, MiB, node=0, tier=Tier.DRAM)
    first = t.region_slice(rid).start
    pid = np.array([7, 7, 7, 8])
    addr = np.array([0x10000000 + 2 * MiB, 0x10000000 + 5 * MiB + 4096, 0x10000000 + 8 * MiB, 0x10000000],
                    np.uint64)
    length = np.array([2 * MiB, 4096, 4096, 4096], np.uint64)          # a THP over two 1 MiB blocks
    rows, blocks = t.locate(pid, addr, length)
    assert list(rows) == [0, 0, 1] and list(blocks - first) == [2, 3, 5]
    p, a = t.block_address(blocks)
    assert list(p) == [7, 7, 7] and list(a) == [0x10000000 + 2 * MiB, 0x10000000 + 3 * MiB, 0x10000000 + 5 * MiB]


def test_locations_move_the_bytes_per_tier_and_node():
    t = BlockStore()
    rid = t.add_region(7, 0x10000000, 4 * MiB, MiB, node=1, tier=Tier.CXL_DRAM)
    rows = np.arange(t.region_slice(rid).start, t.region_slice(rid).start + 2)
    t.set_location(rows, 0, int(Tier.DRAM), now_ms=1234)
    assert t.tier_bytes[Tier.DRAM] == 2 * MiB and t.node_bytes[1] == 2 * MiB
    assert list(t.moved_ms[rows]) == [1234, 1234] and t.moved_max_ms == 1234


def test_blocks_marked_moving_are_counted_and_cleared_once():
    from tieringd.placement.blocktable import FLAG_MOVING
    t = BlockStore()
    rid = t.add_region(7, 0x10000000, 8 * MiB, MiB, node=0, tier=Tier.DRAM)
    rows = np.arange(t.region_slice(rid).start, t.region_slice(rid).start + 3)
    t.set_moving(rows, Tier.CXL_DRAM)
    t.set_moving(rows[:1], Tier.CXL_DRAM)                  # already moving: counted once
    assert t.moving_blocks == 3 and ((t.flags[rows] & FLAG_MOVING) != 0).all()
    assert t.moving_to == dict.fromkeys(rows.tolist(), int(Tier.CXL_DRAM))
    t.set_moving(rows, None)
    assert t.moving_blocks == 0 and (t.flags[rows] == FLAG_VALID).all() and t.moving_to == {}
    t.set_moving(rows[:2], Tier.CXL_DRAM)
    t.remove_region(rid)
    assert t.moving_blocks == 0 and t.moving_to == {}


def test_moves_in_flight_follow_their_rows_through_compaction():
    t = BlockStore()
    a = t.add_region(7, 0x10000000, 4 * MiB, MiB, node=0, tier=Tier.DRAM)
    b = t.add_region(8, 0x10000000, 4 * MiB, MiB, node=0, tier=Tier.DRAM)
    t.set_moving(np.array([t.region_slice(b).start + 1]), Tier.CXL_DRAM)
    t.remove_region(a)
    t.compact()
    assert t.moving_to == {t.region_slice(t.region_id((8, 0x10000000))).start + 1: int(Tier.CXL_DRAM)}
