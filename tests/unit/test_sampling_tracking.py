# SPDX-License-Identifier: Apache-2.0
"""The tracked set and the Python side of bpf/tracking.h's range trie (tieringd/sampling/tracking.py):
LPM prefixes cover a range exactly (hypothesis), keys are big-endian bytes, and what the shim reports
is validated."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tieringd.sampling import tracking as tr


@settings(max_examples=300, deadline=None)
@given(st.integers(0, (1 << 56) - 1), st.integers(1, 1 << 40))
def test_range_prefixes_cover_exactly(start, length):
    end = min(start + length, 1 << 56)
    prefixes = tr.range_prefixes(start, end)
    assert len(prefixes) <= 2 * 64
    pos = start
    for addr, bits in prefixes:
        size = 1 << (64 - bits)
        assert addr == pos and addr % size == 0
        pos += size
    assert pos == end


def test_range_prefixes_page_aligned_is_small():
    assert tr.range_prefixes(0x7f0000000000, 0x7f0000000000 + (1 << 30)) == [(0x7f0000000000, 34)]
    assert tr.range_prefixes(0x1000, 0x6000) == [(0x1000, 52), (0x2000, 51), (0x4000, 51)]


def test_range_key_is_big_endian_bytes():
    k = tr.range_key(0x01020304, 0x1122334455667788, 48)
    raw = bytes(k)
    assert raw[:4] == (32 + 48).to_bytes(4, "little")
    assert raw[4:8] == bytes([1, 2, 3, 4])
    assert raw[8:] == bytes.fromhex("1122334455667788")


def test_tracked_set_validates_and_finds():
    t = tr.TrackedSet()
    with pytest.raises(tr.TrackingError, match="positive integer"):
        t.add_process(0)
    with pytest.raises(tr.TrackingError, match="power of two"):
        t.add_process(10, default_block_len=3000)
    with pytest.raises(tr.TrackingError, match="not tracked"):
        t.add_range(10, 0x1000, 0x1000, 0x1000)
    t.add_process(10)
    r = t.add_range(10, 0x100000, 0x40000, 0x10000)
    with pytest.raises(tr.TrackingError, match="overlaps"):
        t.add_range(10, 0x130000, 0x20000, 0x10000)
    with pytest.raises(tr.TrackingError, match="not a user address"):
        t.add_range(10, (1 << 56) - 0x1000, 0x2000, 0x1000)
    with pytest.raises(tr.TrackingError, match="does not fit"):
        t.add_range(10, 0x200000, 0x1000, 0x2000)
    with pytest.raises(tr.TrackingError, match="non-negative integer"):
        t.add_range(10, -1, 0x1000, 0x1000)
    t.add_range(10, 0x140000, 0x1000, 0x1000)        # adjacent is fine
    assert t.find_range(10, 0x13ffff) == r
    assert t.find_range(10, 0x140000).start == 0x140000
    assert t.find_range(10, 0x141000) is None
    gen = t.generation
    assert t.remove_range(10, 0x100000) and t.generation > gen
    assert t.find_range(10, 0x100000) is None
    t.remove_process(10)
    assert 10 not in t and t.pids() == []
