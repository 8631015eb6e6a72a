# SPDX-License-Identifier: Apache-2.0
"""Position-aware prefetch: scan detection, the window from tier latency/bandwidth, and the plan."""
import math

import numpy as np
import pytest

from tieringd.config import ConfigError, from_table
from tieringd.contracts import ACCESS_DELTA_DTYPE, Priority, SampleSource, Tier
from tieringd.placement.heat import BlockTable
from tieringd.placement.plan import TierSpec
from tieringd.placement.policy import Policy, PolicyConfig
from tieringd.placement.prefetch import REFERENCE_TIER_COSTS, PrefetchConfig, Prefetcher, TierCost, window_bytes

MiB = 1 << 20
BASE = 0x7F00_0000_0000


def scan(t: BlockTable, first_block: int, nblocks: int, t_ms: int, pid: int = 9) -> None:
    rows = np.zeros(nblocks, ACCESS_DELTA_DTYPE)
    rows["pid"] = pid
    rows["block_start"] = BASE + (first_block + np.arange(nblocks)) * MiB
    rows["block_len"] = 4096
    rows["count"] = 1
    rows["last_seen_ns"] = t_ms * 1_000_000
    rows["source"] = SampleSource.PMU
    t.ingest(rows)


def test_window_is_the_bandwidth_delay_product_when_bandwidth_is_ample():
    # the brief: HBM reads at 1.9 TB/s, CXL latency ~300 ns → about 0.6 MB ahead ("~1 MB is reasonable")
    w = window_bytes(1.9e12, 0.0, TierCost(bandwidth_bytes_s=math.inf, latency_s=300e-9))
    assert w == pytest.approx(570_000)
    # a consumer at least as fast as the source tier cannot be hidden
    assert math.isinf(window_bytes(1.9e12, 0.0, REFERENCE_TIER_COSTS[Tier.CXL_DRAM]))
    # transfer time adds to the window: rate·(lead + latency)/(1 − rate/bandwidth)
    assert window_bytes(50e9, 0.1, TierCost(100e9, 0.0)) == pytest.approx(50e9 * 0.1 / 0.5)


def test_window_blocks_follows_the_source_tier_and_is_capped():
    p = Prefetcher(PrefetchConfig(max_window_blocks=16), interval_ms=100)
    # 40 blocks/s of 1 MiB with a 100 ms lead: ~4.2 MB in flight → 4 blocks (PMEM adds 2 µs)
    assert p.window_blocks(40, MiB, Tier.PMEM) == math.ceil(40 * MiB * (0.1 + 2e-6) / (1 - 40 * MiB / 60e9) / MiB)
    assert p.window_blocks(10_000, MiB, Tier.PMEM) == 16


def test_sequential_scan_is_detected_and_prefetched_into_dram():
    t = BlockTable()
    rid = t.add_region(pid=9, start=BASE, length=100 * MiB, block_bytes=MiB, node=2, tier=Tier.PMEM,
                       sequential=True)
    pf = Prefetcher(PrefetchConfig(min_runs=2), interval_ms=100)
    specs = [TierSpec(Tier.DRAM, (0,), 1 << 40), TierSpec(Tier.PMEM, (2,), 1 << 40)]
    pol = Policy(PolicyConfig(), specs, prefetcher=pf)
    for step in range(3):                         # blocks 0–3, 4–7, 8–11 at 100 ms intervals
        scan(t, 4 * step, 4, 100 * step)
        plan = pol.tick(t, now_ms=100 * step)
    assert pf.runs[rid] == 2 and pf.rate_blocks_s[rid] == pytest.approx(40.0)
    k = pf.window_blocks(40.0, MiB, Tier.PMEM)
    pref = plan.blocks[plan.priority == Priority.PREFETCH]
    assert sorted(pref.tolist()) == list(range(12, 12 + k))
    assert all(tier == Tier.DRAM for tier in plan.to_tier[plan.priority == Priority.PREFETCH])
    assert [m for m in plan.moves if m.priority == Priority.PREFETCH][0].start == BASE + 12 * MiB


def test_a_backward_jump_resets_detection():
    t = BlockTable()
    rid = t.add_region(pid=9, start=BASE, length=100 * MiB, block_bytes=MiB, node=2, tier=Tier.PMEM)
    pf = Prefetcher(PrefetchConfig(min_runs=2))
    for step, first in enumerate((0, 4, 8, 2)):
        scan(t, first, 4, 100 * step)
        pf.observe(t)
    assert pf.runs[rid] == 0
    assert len(pf.candidates(t, Tier.DRAM)) == 0


def test_random_access_is_not_a_scan():
    t = BlockTable()
    rid = t.add_region(pid=9, start=BASE, length=1000 * MiB, block_bytes=MiB, node=2, tier=Tier.PMEM)
    pf = Prefetcher()
    for step, first in enumerate((0, 500, 120, 900, 30)):
        scan(t, first, 1, 100 * step)
        pf.observe(t)
    assert pf.runs[rid] == 0


def test_config():
    assert from_table(PrefetchConfig, "prefetch", {"max_window_blocks": 8}).max_window_blocks == 8
    with pytest.raises(ConfigError):
        from_table(PrefetchConfig, "prefetch", {"min_runs": 0})
    with pytest.raises(ConfigError):
        from_table(PrefetchConfig, "prefetch", {"windw": 3})
