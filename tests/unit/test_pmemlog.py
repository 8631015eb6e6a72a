# SPDX-License-Identifier: Apache-2.0
"""The DAX tier's append-only log: sequential appends, partial extents, and cleaning that keeps its
write amplification under the bound while the live data stays under the advertised capacity."""
from __future__ import annotations

import random

import pytest

from tieringd.config import ConfigError
from tieringd.shim.pmemlog import LogFull, LogGeometry, PmemLog, SegmentState

MiB = 1 << 20


def geometry(segments=10, **kw):
    return LogGeometry(size_bytes=segments * 8 * MiB, segment_bytes=8 * MiB, **kw)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 1.0
        return self.t


def test_appends_are_sequential_and_pmd_aligned():
    log = PmemLog(geometry())
    offsets = [log.allocate(2 * MiB, 1, 0x1000_0000 + i * 2 * MiB).offset for i in range(6)]
    assert offsets == [0, 2 * MiB, 4 * MiB, 6 * MiB, 8 * MiB, 10 * MiB]
    small = log.allocate(8192, 1, 0)
    assert small.offset == 12 * MiB
    big = log.allocate(2 * MiB, 1, 0)
    assert big.offset == 14 * MiB          # next PMD boundary after the small one
    assert log.demoted_bytes == 6 * 2 * MiB + 8192 + 2 * MiB


def test_partial_allocation_fills_the_head_then_goes_on():
    log = PmemLog(geometry())
    log.allocate(6 * MiB, 1, 0)
    first = log.allocate(5 * MiB + 4096, 1, 0x4000_0000, partial=True)
    assert (first.offset, first.length) == (6 * MiB, 2 * MiB)
    rest = log.allocate(3 * MiB + 4096, 1, 0x4000_0000 + 2 * MiB, partial=True)
    assert rest.offset == 8 * MiB and rest.length == 3 * MiB + 4096
    with pytest.raises(ValueError):
        log.allocate(9 * MiB, 1, 0)        # more than a segment, not partial


def test_release_of_part_of_an_extent_keeps_the_rest():
    log = PmemLog(geometry())
    e = log.allocate(6 * MiB, 7, 0x7000_0000)
    log.release(e.offset + 2 * MiB, 2 * MiB)
    parts = sorted((x.offset, x.length, x.start) for x in log.extents())
    assert parts == [(0, 2 * MiB, 0x7000_0000), (4 * MiB, 2 * MiB, 0x7000_0000 + 4 * MiB)]
    assert log.live_bytes == 4 * MiB and log.freed_bytes == 2 * MiB
    with pytest.raises(KeyError):
        log.release(2 * MiB, 4096)         # already dead


def test_demotions_never_take_the_reserve():
    log = PmemLog(geometry(segments=4, reserve_segments=2))
    log.allocate(8 * MiB, 1, 0)
    log.allocate(8 * MiB, 1, 0)
    with pytest.raises(LogFull):
        log.allocate(8 * MiB, 1, 0)
    assert log.allocate(8 * MiB, 1, 0, relocation=True).offset == 16 * MiB


def test_a_fully_dead_segment_is_free_again():
    log = PmemLog(geometry(segments=4))
    exts = [log.allocate(2 * MiB, 1, i) for i in range(5)]   # segment 0 full, segment 1 head
    for e in exts[:4]:
        log.release(e.offset, e.length)
    assert log.segments[0].state == SegmentState.FREE
    assert log.segments[1].state == SegmentState.HEAD


def test_victims_only_within_the_bound_and_cold_first():
    clock = Clock()
    log = PmemLog(geometry(segments=6, max_write_amplification=2.0), clock=clock)
    exts = [log.allocate(2 * MiB, 1, i) for i in range(16)]  # segments 0-3 full, 4 is head
    log.release(exts[0].offset, 2 * MiB)                     # seg 0: u = 0.75
    for e in exts[4:6]:
        log.release(e.offset, 2 * MiB)                       # seg 1: u = 0.5
    for e in exts[8:10]:
        log.release(e.offset, 2 * MiB)                       # seg 2: u = 0.5, sealed later
    victim = log.pick_victim()
    assert victim.index == 1                                 # older than 2; 0 is above u_max
    assert victim.state == SegmentState.CLEANING
    assert log.pick_victim().index == 2
    assert log.pick_victim() is None                         # seg 0 and 3 are too full


def test_bad_geometry_is_a_config_error():
    with pytest.raises(ConfigError, match=r"\[dax\] max_write_amplification: expected a number above 1"):
        PmemLog(geometry(max_write_amplification=1.0))
    with pytest.raises(ConfigError, match=r"\[dax\] size_bytes"):
        PmemLog(LogGeometry(size_bytes=16 * MiB, segment_bytes=8 * MiB))


def clean(log: PmemLog) -> bool:
    """What DaxTier.clean does, without processes: move a victim's live extents to the head."""
    victim = log.pick_victim()
    if victim is None:
        return False
    for ext in list(victim.extents.values()):
        left, at = ext.length, 0
        while left:
            new = log.allocate(left, ext.pid, ext.start + at, relocation=True, partial=True)
            left, at = left - new.length, at + new.length
        log.release(ext.offset, ext.length, moved=True)
    assert victim.state == SegmentState.FREE
    return True


@pytest.mark.parametrize("bound", [1.5, 2.0, 3.0])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_churn_below_capacity_never_fills_and_keeps_the_bound(bound, seed):
    rng = random.Random(seed)
    log = PmemLog(geometry(segments=24, max_write_amplification=bound))
    live_bytes = 0
    for step in range(6000):
        if rng.random() < 0.55:
            length = rng.choice([4096, 64 << 10, 2 * MiB, 4 * MiB, 6 * MiB])
            if live_bytes + length > log.capacity_bytes:
                continue
            left = length
            while left:
                while log.needs_cleaning() and clean(log):
                    pass
                e = log.allocate(left, 1, step, partial=True)
                left -= e.length
            live_bytes += length
        elif live_bytes:
            # a freed range: whatever the cleaner made of it, it is some live extent now
            e = rng.choice(list(log.extents()))
            log.release(e.offset, e.length)
            live_bytes -= e.length
        assert log.write_amplification <= bound + 1e-9
    assert log.live_bytes == live_bytes
    assert log.cleaned_segments > 0 and log.write_amplification > 1.0
