# SPDX-License-Identifier: Apache-2.0
"""Heat on hand-computed cases, the block table's ingest path, and the [heat] config."""
import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tieringd.config import ConfigError, from_table
from tieringd.contracts import ACCESS_DELTA_DTYPE, SampleSource, Tier
from tieringd.placement.blocktable import FLAG_ABSENT
from tieringd.placement.heat import BlockTable, HeatConfig, frequency_reference, heat_of

MiB = 1 << 20
BASE = 0x7F00_0000_0000
# the reference weights' formula, which these tests work out by hand (the shipped defaults are tuned: HeatConfig)
REFERENCE = HeatConfig(weight_recency=0.30, weight_frequency=0.25, weight_position=0.25, weight_sharing=0.20,
                   half_life_s=1.0, frequency_half_life_s=10.0, sharing_half_life_gain=0.0)


def table_with(blocks: int, block_bytes: int = 2 * MiB, **kw) -> tuple[BlockTable, int]:
    t = BlockTable(kw.pop("heat", REFERENCE))
    rid = t.add_region(pid=42, start=BASE, length=blocks * block_bytes, block_bytes=block_bytes,
                       node=0, tier=Tier.DRAM, **kw)
    return t, rid


def deltas(rows) -> np.ndarray:
    out = np.zeros(len(rows), ACCESS_DELTA_DTYPE)
    for i, (pid, start, length, count, t_ns) in enumerate(rows):
        out[i] = (pid, start, length, count, t_ns, SampleSource.PMU)
    return out


def test_one_block_by_hand():
    # accessed 4 times at t=0, read at t=1 s; half-life 1 s, frequency half-life 10 s, 2 sharers:
    # recency 0.5; frequency 1 (it is the hottest block); positional 0 (unknown); sharing 1 − 1/2.
    t, _ = table_with(1)
    t.ingest_blocks([0], [4], 0)
    t.set_sharers([0], [2])
    h = t.compute_heat(1000)
    assert h[0] == pytest.approx(0.30 * 0.5 + 0.25 * 1.0 + 0.25 * 0.0 + 0.20 * 0.5, abs=1e-6)  # 0.5


def test_frequency_is_log_normalised_against_the_hottest_block():
    # both accessed now; A once, B 15 times: log(1+1)/log(1+15) = 0.25 for A, 1 for B
    t, _ = table_with(2)
    t.ingest_blocks([0, 1], [1, 15], 5000)
    h = t.compute_heat(5000)
    assert h[0] == pytest.approx(0.30 + 0.25 * 0.25, abs=1e-6)      # 0.3625
    assert h[1] == pytest.approx(0.30 + 0.25 * 1.0, abs=1e-6)       # 0.55


def test_frequency_decays_between_accesses():
    t, _ = table_with(1)
    t.ingest_blocks([0], [1], 0)
    t.ingest_blocks([0], [1], 10_000)          # one frequency half-life later: 1·0.5 + 1
    assert t.freq[0] == pytest.approx(1.5)
    t.ingest_blocks([0], [2], 5_000)           # late arrival: added without moving last_ms back
    assert t.last_ms[0] == 10_000
    assert t.freq[0] == pytest.approx(3.5)


def test_positional_factor_halves_every_half_life_behind_the_frontier():
    # 16-token blocks, half-life 2048 tokens = 128 blocks; frontier at block 128
    t, rid = table_with(200, block_tokens=16, sequential=True)
    t.set_frontier(rid, 128)
    assert t.positional[128] == pytest.approx(1.0)
    assert t.positional[0] == pytest.approx(0.5)
    assert t.positional[64] == pytest.approx(2 ** -0.5)
    assert t.positional[129] == 0.0            # not written yet
    h = t.compute_heat(100_000)                # long idle: recency and frequency ~0
    assert h[0] == pytest.approx(0.25 * 0.5, abs=1e-4)


def test_sharing_factor():
    t, _ = table_with(3)
    t.set_sharers([0, 1, 2], [1, 2, 4])
    h = t.compute_heat(10_000_000)
    assert list(np.round(h[:3] / 0.2, 4)) == [0.0, 0.5, 0.75]


def test_sharing_lengthens_the_half_life():
    # g = 10: two sharers (sharing 0.5) → half-life 2 s · (1 + 10·0.5) = 12 s; one sharer → 2 s
    cfg = HeatConfig(half_life_s=2.0, sharing_half_life_gain=10.0, weight_sharing=0.0)
    t, _ = table_with(3, heat=cfg)
    t.ingest_blocks([0, 1, 2], [1, 1, 1], 0)
    t.set_sharers([0, 1, 2], [1, 2, 1000])
    h = t.compute_heat(12_000)
    assert h[0] == pytest.approx(2 ** -6, rel=1e-5)
    assert h[1] == pytest.approx(0.5, rel=1e-5)
    # ≥ 255 sharers share the rate of 255 (sharing 0.996 against 0.999): one table entry per count
    assert h[2] == pytest.approx(2 ** (-12 / (2 * (1 + 10 * (1 - 1 / 255)))), rel=1e-5)
    assert t.factors([1], 12_000)["recency"][0] == pytest.approx(0.5)
    with pytest.raises(ConfigError, match=r"\[heat\] sharing_half_life_gain: expected a number in \[0, 1000\]"):
        from_table(HeatConfig, "heat", {"sharing_half_life_gain": -1})


def test_with_the_defaults_a_block_read_now_outranks_a_shared_one_read_a_window_ago():
    # Issue 14: at weight_sharing 0.03 sharing was a bonus worth 0.4 s of a block with two sharers,
    # so such a block idle for one 250 ms window outranked a private block read in this one (the next
    # window's read). Now sharing mostly lengthens the half-life: it orders blocks read together and
    # shared ones idle as long as private ones, and the small bonus keeps long-idle shared blocks
    # above long-idle private ones.
    t, _ = table_with(6, heat=HeatConfig())
    t.ingest_blocks([0, 1, 2, 3, 4, 5], [1] * 6, [600_000, 599_750, 590_000, 590_000, 0, 0])
    t.set_sharers([0, 1, 2, 3, 4, 5], [1, 2, 1, 2, 1, 2])
    h = t.compute_heat(600_000)
    assert h[0] > h[1]                  # private, read now > two sharers, read a window ago
    assert h[3] > h[2]                  # both idle 10 s: the shared one is hotter
    assert h[5] > h[4] > 0              # both idle 10 minutes: still
    assert h[1] > h[3] > h[5]


def test_weights_come_from_config_and_are_normalised():
    cfg = from_table(HeatConfig, "heat", {"weight_recency": 1, "weight_frequency": 0, "weight_position": 0,
                                          "weight_sharing": 1, "half_life_s": 2, "sharing_half_life_gain": 0})
    t, _ = table_with(1, heat=cfg)
    t.ingest_blocks([0], [1], 0)
    t.set_sharers([0], [2])
    # recency 2^(−2/2) = 0.5, sharing 0.5, weights 1:1 → 0.5·0.5 + 0.5·0.5
    assert t.compute_heat(2000)[0] == pytest.approx(0.5)
    with pytest.raises(ConfigError, match=r"\[heat\] weight_recncy: unknown key"):
        from_table(HeatConfig, "heat", {"weight_recncy": 1})
    with pytest.raises(ConfigError, match=r"\[heat\] half_life_s: expected a number in \[0.001, 604800\] \(seconds\), got 0"):
        from_table(HeatConfig, "heat", {"half_life_s": 0})
    with pytest.raises(ConfigError, match=r"\[heat\] frequency_quantile: expected a number in \(0, 1\]"):
        from_table(HeatConfig, "heat", {"frequency_quantile": 1.5})


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60_000), st.integers(1, 1000), st.integers(1, 255),
                          st.integers(-1, 300)), min_size=1, max_size=20),
       st.integers(60_000, 200_000), st.sampled_from(["reference", "shipped", "reference with the gain"]),
       st.sampled_from([0, 700, 30_000]))
def test_vectorised_heat_matches_the_reference_formula(blocks, now_ms, weights, lag_ms):
    # the shipped defaults weigh frequency 0, which compute_heat computes in one pass without f_ref;
    # "reference with the gain" takes the per-block half-life through the pass that computes f_ref
    cfg = {"reference": REFERENCE, "shipped": HeatConfig(),
           "reference with the gain": dataclasses.replace(REFERENCE, sharing_half_life_gain=10.0)}[weights]
    t = BlockTable(cfg)
    t.signal_lag.note(lag_ms, np.array([0]), 0.9)  # one delivery: a block sampled again lag_ms late
    for i, (last, count, sharers, dist) in enumerate(blocks):
        rid = t.add_region(pid=1, start=BASE + i * (1 << 30), length=400 * MiB, block_bytes=MiB, node=0,
                           tier=Tier.DRAM, block_tokens=16, sequential=True)
        first = t.region_slice(rid).start
        t.ingest_blocks([first], [count], last)
        t.set_sharers([first], [sharers])
        if dist >= 0:
            t.set_frontier(rid, dist)              # block 0 sits `dist` blocks behind the frontier
    firsts = [t.region_slice(r).start for r in range(len(blocks))]
    h = t.compute_heat(now_ms)
    f_now = [c * 2 ** (-(now_ms - last) / 1000 / cfg.frequency_half_life_s) for last, c, _, _ in blocks]
    for i, (last, count, sharers, dist) in enumerate(blocks):
        want = heat_of(cfg, (now_ms - last) / 1000, f_now[i], frequency_reference(np.array(f_now),
                       cfg.frequency_quantile), None if dist < 0 else dist * 16, sharers, lag_s=lag_ms / 1000)
        assert h[firsts[i]] == pytest.approx(want, abs=2e-5)


@pytest.mark.parametrize("cfg", [HeatConfig(weight_sharing=0.02),                  # derived from the rate
                                 HeatConfig(weight_sharing=0.02, weight_position=0.1),   # from static
                                 REFERENCE])                                               # with frequency
def test_the_sharing_term_counts_only_above_the_given_tier(cfg):
    t = BlockTable(cfg)
    t.add_region(pid=42, start=BASE, length=4 * MiB, block_bytes=MiB, node=0, tier=Tier.DRAM)
    t.add_region(pid=42, start=BASE + 4 * MiB, length=4 * MiB, block_bytes=MiB, node=1, tier=Tier.CXL_DRAM)
    t.ingest_blocks(np.arange(8), np.full(8, 3), 1000, sharers=[1, 4, 9, 2] * 2)
    everywhere = t.compute_heat(4000).copy()
    above = t.compute_heat(4000, sharing_above=int(Tier.CXL_DRAM)).copy()
    _, _, _, ws = cfg.normalised_weights
    sharing = ws * (1 - 1 / np.array([1, 4, 9, 2], np.float32))
    assert above[:4] == pytest.approx(everywhere[:4], abs=1e-6)             # DRAM: unchanged
    assert above[4:] == pytest.approx(everywhere[4:] - sharing, abs=1e-6)   # CXL: without the term


def test_ingest_maps_sampler_rows_to_blocks():
    t, _ = table_with(8, block_bytes=MiB)
    t.add_region(pid=7, start=BASE, length=4 * MiB, block_bytes=MiB, node=1, tier=Tier.CXL_DRAM)
    rows = deltas([
        (42, BASE + 3 * MiB + 100, 64, 5, 2_000_000_000),        # inside block 3
        (42, BASE + 6 * MiB, 2 * MiB, 1, 2_000_000_000),          # a THP fault over blocks 6 and 7
        (42, BASE + 7 * MiB, 4 * MiB, 1, 2_000_000_000),          # runs past the region's end: block 7
        (42, BASE + 9 * MiB, 4096, 9, 2_000_000_000),             # past the region: dropped
        (43, BASE, 4096, 9, 2_000_000_000),                        # unknown pid: dropped
        (7, BASE + MiB, 4096, 2, 3_000_000_000),                   # pid 7's own region, block 1
    ])
    assert t.ingest(rows) == 4
    assert t.freq[3] == 5 and t.freq[6] == 1 and t.freq[7] == 2
    assert t.freq[[0, 1, 2, 4, 5]].sum() == 0
    assert t.freq[8 + 1] == 2 and t.last_ms[8 + 1] == 3000
    assert t.last_ms[3] == 2000
    with pytest.raises(TypeError):
        t.ingest(np.zeros(1, [("pid", "i4")]))


def test_ingest_floors_sample_times_to_the_quantum_so_one_ticks_samples_tie():
    # three blocks sampled 10, 90 and 110 ms into second 2; the shipped heat; a 100 ms tick
    rows = deltas([(42, BASE, 4096, 1, 2_010_000_000), (42, BASE + MiB, 4096, 1, 2_090_000_000),
                   (42, BASE + 2 * MiB, 4096, 1, 2_110_000_000)])
    t, _ = table_with(4, block_bytes=MiB, heat=HeatConfig())
    t.ingest(rows, quantum_ms=100)
    assert t.last_ms[:3].tolist() == [2000, 2000, 2100]
    h = t.compute_heat(2500)
    assert h[0] == h[1] < h[2]                  # the same tick ties; the next one is hotter
    raw, _ = table_with(4, block_bytes=MiB, heat=HeatConfig())
    raw.ingest(rows)                            # no quantum: the sampler's times as they come
    assert raw.last_ms[:3].tolist() == [2010, 2090, 2110]
    h = raw.compute_heat(2500)
    assert h[0] < h[1] < h[2]


def test_ingest_advances_the_frontier_of_sequential_regions_and_records_cursors():
    t, rid = table_with(64, block_bytes=MiB, block_tokens=16, sequential=True)
    t.ingest(deltas([(42, BASE + 10 * MiB, 4096, 1, 1_000_000_000)]))
    assert t.r_frontier[rid] == 10 and t.positional[10] == 1.0 and t.positional[11] == 0
    assert t.r_cursor[rid] == 10 and t.r_cursor_ms[rid] == 1000
    t.ingest(deltas([(42, BASE + 4 * MiB, 4096, 1, 2_000_000_000)]))
    assert t.r_frontier[rid] == 10              # the frontier does not move back
    assert t.r_cursor[rid] == 4


def test_regions_accounting_pinning_and_compaction():
    t = BlockTable()
    a = t.add_region(pid=1, start=BASE, length=5 * MiB + 4096, block_bytes=MiB, node=0, tier=Tier.DRAM)
    b = t.add_region(pid=1, start=BASE + (1 << 30), length=2 * MiB, block_bytes=MiB, node=2, tier=Tier.PMEM,
                     pinned=True)
    assert t.n == 8 and t.size[5] == 4096                       # the last block is short
    assert t.tier_bytes[Tier.DRAM] == 5 * MiB + 4096 and t.node_bytes[2] == 2 * MiB
    assert t.pinned_blocks == 2
    t.set_location([0, 1], 1, Tier.CXL_DRAM, now_ms=500)
    assert t.tier_bytes[Tier.CXL_DRAM] == 2 * MiB and t.moved_max_ms == 500
    t.set_location([2], 1, Tier.CXL_DRAM)                        # found there: no move time
    assert t.moved_ms[2] == 0 and t.tier_bytes[Tier.CXL_DRAM] == 3 * MiB
    t.set_absent(np.array([3, 4, 6]), True)
    t.set_absent(np.array([4, 6]), np.array([False, True]))
    assert t.absent_blocks == 2 and list(t.flags[[3, 4, 6]] & FLAG_ABSENT > 0) == [True, False, True]
    t.remove_region(a)
    assert t.absent_blocks == 1                                  # block 6 is region b's
    assert t.tier_bytes[Tier.DRAM] == 0 and t.tier_bytes[Tier.CXL_DRAM] == 0 and t.dead == 6
    t.compact()
    assert t.n == 2 and t.r_first[0] == 0 and list(t.region[:2]) == [0, 0]
    pid, addr = t.block_address([1])
    assert pid[0] == 1 and addr[0] == BASE + (1 << 30) + MiB
    t.set_pinned(0, False)
    assert t.pinned_blocks == 0
    del b


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.sampled_from([MiB, 2 * MiB, 64 * 1024]),
                          st.integers(0, MiB - 1), st.booleans()), min_size=1, max_size=12),
       st.booleans(), st.data())
def test_bytes_per_key_from_the_size_profile_equals_weighing_every_row(regions, compact, data):
    """Short last blocks, regions of another block size and removed regions' rows are the
    exceptions; the histogram the fill reads must not change by a byte."""
    t = BlockTable()
    for i, (blocks, block_bytes, short_by, remove) in enumerate(regions):
        length = max(blocks * block_bytes - short_by, 1)
        rid = t.add_region(pid=1, start=BASE + i * (1 << 32), length=length, block_bytes=block_bytes,
                           node=0, tier=Tier.DRAM)
        t.size_profile()                 # asked between changes: each change must renew it
        if remove:
            t.remove_region(rid)
            t.size_profile()
    if compact:
        t.compact()
    key = np.array(data.draw(st.lists(st.integers(0, 9), min_size=t.n, max_size=t.n)), np.intp)
    sizes = t.size[:t.n]
    profile = t.size_profile()
    assert np.array_equal(profile.bytes_per_key(key, sizes, 10), np.bincount(key, weights=sizes, minlength=10))
    if profile.common_bytes is not None:
        exceptions = np.zeros(t.n, bool)
        exceptions[profile.rows] = True
        assert (sizes[~exceptions] == profile.common_bytes).all()


def test_table_stays_within_budget_per_block():
    t = BlockTable(REFERENCE)
    assert t.bytes_per_block <= 42
    assert math.isclose(sum(HeatConfig().normalised_weights), 1.0)


def test_a_sample_stamped_after_the_ticks_clock_counts_as_now():
    # the sampler may read its maps between the tick's clock reading and the heat pass
    t, _ = table_with(1)
    t.ingest_blocks([0], [1], 1500)
    assert t.compute_heat(1000)[0] == pytest.approx(0.30 + 0.25)


def test_one_shared_block_does_not_flatten_the_others():
    # 200 active blocks read 10 times each and one shared block read 10^6 times: normalised by the
    # maximum (frequency_quantile = 1, the old rule) the active blocks' frequency is log 11 / log 10^6
    # ≈ 0.17; against the 99th percentile they are as busy as the reference, 1
    for quantile, want in ((1.0, np.log(11) / np.log(1e6 + 1)), (0.99, 1.0)):
        t, _ = table_with(201, heat=dataclasses.replace(REFERENCE, frequency_quantile=quantile))
        t.ingest_blocks(np.arange(201), np.r_[np.full(200, 10.0), 1e6], 1000)
        assert t.factors([0], 1000)["frequency"][0] == pytest.approx(want, rel=1e-4)
        assert t.compute_heat(1000)[0] == pytest.approx(0.30 + 0.25 * want, abs=1e-4)
        assert t.freq_ref == pytest.approx(1e6 if quantile == 1 else 10.0)


def _deliveries(t: BlockTable, blocks: int, periods: int, delay_ms: int, sampled, seed: int = 0) -> None:
    """Blocks read in every 250 ms period, their samples delivered ``delay_ms`` late; each period's
    read of a block sampled when ``sampled(rng)`` says so."""
    rng = np.random.default_rng(seed)
    for p in range(1, periods + 1):
        read_ms = p * 250
        idx = np.flatnonzero([sampled(rng) for _ in range(blocks)])
        t.ingest_blocks(idx, np.ones(len(idx)), read_ms, seen_ms=read_ms + delay_ms)


def test_the_signal_lag_is_zero_when_every_read_is_seen_at_once():
    t, _ = table_with(50, block_bytes=MiB, heat=HeatConfig())
    _deliveries(t, 50, 80, 0, lambda rng: True)
    assert t.signal_lag.lag_ms == 0


def test_the_signal_lag_covers_late_and_sparse_samples_of_blocks_in_use():
    # delivered two periods late, each read sampled with p = 0.57 (a tenth of 8 reads per period):
    # a block in use has been seen at most 500 ms + a few gaps ago
    t, _ = table_with(200, block_bytes=MiB, heat=HeatConfig())
    _deliveries(t, 200, 120, 500, lambda rng: rng.random() < 0.57)
    assert 750 <= t.signal_lag.lag_ms <= 1250
    # most blocks in use then tie with one read this period (the lag is their 90th percentile); a
    # block idle for 10 s ranks below every one of them
    now = 120 * 250 + 500
    t.last_ms[0] = now - 10_000
    h = t.compute_heat(now)
    fresh = heat_of(HeatConfig(), 0.0, 0, 0, None, 1)
    assert np.mean(h[1:200] == np.float32(fresh)) >= 0.8
    assert h[0] < 0.7 * fresh < h[1:200].min()


def test_long_idle_blocks_coming_back_do_not_move_the_signal_lag():
    t, _ = table_with(100, block_bytes=MiB, heat=HeatConfig())
    _deliveries(t, 100, 60, 0, lambda rng: True)
    # most of the 64-delivery window: each delivery also brings back 10 blocks idle for a minute (a
    # median of plain 90th percentiles would read ~6 s here)
    for p in range(61, 110):
        t.last_ms[:10] = 1
        t.ingest_blocks(np.arange(100), np.ones(100), p * 250, seen_ms=p * 250)
    assert t.signal_lag.lag_ms == 0


def test_lag_quantile_zero_turns_the_compensation_off():
    t, _ = table_with(4, block_bytes=MiB, heat=HeatConfig(lag_quantile=0.0))
    t.ingest_blocks([0], [1], 1000, seen_ms=1000)
    t.ingest_blocks([0], [1], 2000, seen_ms=4000)
    assert t.signal_lag.lag_ms == 0
    assert t.compute_heat(4000)[0] == pytest.approx(heat_of(HeatConfig(), 2.0, 0, 0, None, 1), rel=1e-5)
    with pytest.raises(ConfigError, match=r"\[heat\] lag_quantile"):
        from_table(HeatConfig, "heat", {"lag_quantile": 1})
