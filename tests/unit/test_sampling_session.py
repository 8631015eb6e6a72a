# SPDX-License-Identifier: Apache-2.0
"""``tieringctl sample``'s ranking (tieringd/sampling/session.py): blocks rank as the daemon ranks them —
touches per read interval into the heat model — not by raw fault counts, which depend on page size and
on where the scan stood; the raw counts per source are kept beside."""
import time

import numpy as np

from tieringd.contracts import ACCESS_DELTA_DTYPE, SampleSource
from tieringd.placement.heat import HeatConfig
from tieringd.sampling.session import Ranking, accumulate, hottest

MiB = 1 << 20
BASE = 0x7f0000000000


def rows(t_ns: int, counts: dict[int, int], source=SampleSource.FAULT) -> np.ndarray:
    out = np.zeros(len(counts), ACCESS_DELTA_DTYPE)
    for i, (block, count) in enumerate(sorted(counts.items())):
        out[i] = (7, BASE + block * 2 * MiB, 2 * MiB, count, t_ns, int(source))
    return out


def test_a_block_read_in_every_interval_ranks_above_blocks_with_more_faults():
    """Block 0 is a shared prefix on a THP: one hint fault (512 base pages) in each of ten intervals.
    Blocks 1-4 sit on 4 KiB pages and are read in three bursts: 6144 faults each burst. Raw counts put
    the bursty blocks first (the lab's sample did); the daemon's heat and touches put block 0 first."""
    r, total = Ranking(HeatConfig(), interval_ms=500), {}
    t0 = time.monotonic_ns()
    for i in range(10):
        counts = {0: 512}
        if i in (2, 5, 9):
            counts.update({b: 6144 for b in range(1, 5)})
        batch = rows(t0 + i * 500_000_000, counts)
        r.add(batch)
        accumulate(total, batch)
    raw = hottest(total, 5)["fault"]
    assert [x["block_start"] for x in raw[:4]] == [BASE + b * 2 * MiB for b in range(1, 5)]
    ranked = r.ranked(5)
    assert ranked[0]["block_start"] == BASE and ranked[0]["rank"] == 1
    assert ranked[0]["intervals"] == 10 and ranked[0]["samples"] == {"fault": 5120}
    assert [x["intervals"] for x in ranked[1:]] == [3, 3, 3, 3] and {x["rank"] for x in ranked[1:]} == {2}


def test_a_block_not_read_lately_ranks_below_one_read_now():
    """Heat first: a block read in every interval until half-way and never since ranks below a block
    read once at the end."""
    r = Ranking(HeatConfig(half_life_s=1.0), interval_ms=500)
    t0 = time.monotonic_ns()
    for i in range(20):
        counts = {0: 1} if i < 10 else {}
        if i == 19:
            counts[1] = 1
        if counts:
            r.add(rows(t0 + i * 500_000_000, counts))
    ranked = r.ranked(2, now_ns=t0 + 20 * 500_000_000)
    assert [x["block_start"] for x in ranked] == [BASE + 2 * MiB, BASE]
    assert ranked[0]["heat"] > ranked[1]["heat"]


def test_sources_are_counted_apart_and_ranked_together():
    r = Ranking(HeatConfig(), interval_ms=500)
    r.add(np.concatenate([rows(time.monotonic_ns(), {0: 3}, SampleSource.PMU), rows(time.monotonic_ns(), {0: 512})]))
    (only,) = r.ranked(5)
    assert only["samples"] == {"pmu": 3, "fault": 512} and only["intervals"] == 1
