# SPDX-License-Identifier: Apache-2.0
"""The streaming simulator is the whole-trace one, access by access.

Every policy, at several capacities, on several traces — generated chat and agent traces, a Bailian
trace with a PMem tier, a native sampler trace, the real Mooncake slice and the shared synthetic
trace, in the full and the sampled view, with chunked prefill and without — is run twice: by the
simulator (expanded window by window into a spool and replayed) and by the whole-trace simulator as it
stood before (tests/unit/simref/: every access in memory). Every access must be served by the same
tier, hit or miss alike, and every run must move as many bytes.

The traces of docs/simulator.md too large for a unit test (the conversation parts, the whole synthetic
trace) were held together the same way when the streaming simulator came in (docs/dev/simulator-history.md).
"""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import simref
from tieringd import simulate
from tieringd.contracts import ACCESS_DELTA_DTYPE, Tier
from tieringd.placement.heat import HeatConfig
from tieringd.placement.policy import PolicyConfig
from tieringd.simulate import policies
from tieringd.simulate.expand import spool_rows
from tieringd.simulate.layout import Layout
from tieringd.simulate.model import TransparentModel

REPO = Path(__file__).resolve().parents[2]
ALL = simulate.POLICIES
KV = 131072                     # Llama-3.1-8B: bytes of KV per token


def generated(tmp_path_factory, *args) -> str:
    out = tmp_path_factory.mktemp("traces") / ("-".join(args).replace("--", "") + ".jsonl")
    subprocess.run([sys.executable, str(REPO / "scripts" / "gen-trace.py"), *args, "-o", str(out)], check=True)
    return str(out)


def assert_same(path: str, capacities, names=ALL, *, limit=None, tick_ms=250.0, chunk=2048, delay=0, sample=1.0,
                cxl_bytes=math.inf, block_tokens=None, fmt="auto", jobs=1):
    rm = simulate.RequestModel(kv_bytes_per_token=KV, tick_ms=tick_ms, prefill_chunk_tokens=chunk)
    acc = simulate.load_accesses(path, fmt, rm, limit, block_tokens)
    setup = simulate.Setup(fast_capacities=capacities, policies=names, delay_windows=delay, sample_fraction=sample,
                           cxl_capacity_bytes=cxl_bytes)
    results = simulate.run(acc, setup, record=True, jobs=jobs)
    cxl_blocks = cxl_bytes // acc.block_bytes if math.isfinite(cxl_bytes) else math.inf
    ref, racc = simref.outcomes(path, KV, capacities, names, fmt=fmt, limit=limit, tick_ms=tick_ms,
                                prefill_chunk_tokens=chunk, mover_bytes_s=setup.model().mover_bytes_s,
                                delay_windows=delay, sample_fraction=sample, cxl_blocks=cxl_blocks,
                                tiers=setup.tiers(), block_tokens=block_tokens)
    assert (len(acc), acc.nblocks, acc.block_bytes) == (len(racc), racc.nblocks, racc.block_bytes)
    for r in results:
        o = ref[(r.policy, r.fast_capacity_bytes)]
        where = (path, r.policy, r.fast_capacity_fraction)
        assert np.array_equal(r.tally.served_each, o.served), where
        assert np.array_equal(r.tally.hit_each, o.hit), where
        assert r.migrated_bytes == o.migrated_bytes, where
        assert r.hit_rate == float(o.hit.mean()), where
    acc.close()
    return results


def test_generated_chat_trace_every_policy_in_three_processes(tmp_path_factory):
    path = generated(tmp_path_factory, "--format", "mooncake", "--requests", "150", "--seed", "4")
    assert_same(path, [0.05, 0.1, 0.3], jobs=3)


def test_generated_agent_trace_grouped_into_larger_blocks(tmp_path_factory):
    """Coding-agent sessions (100k-token contexts), ids grouped eight to a 4096-token block."""
    path = generated(tmp_path_factory, "--shape", "agent", "--requests", "40", "--seed", "5", "--rate", "0.5")
    res = assert_same(path, [0.05, 0.1], block_tokens=4096)
    assert "4096-token blocks (--block-tokens: 8 ids of 512 tokens each" in simulate.load_accesses(
        path, "auto", simulate.RequestModel(kv_bytes_per_token=KV), None, 4096).description
    assert len(res) == 2 * len(ALL)


def test_sampled_view_with_pmem_on_a_bailian_trace(tmp_path_factory):
    path = generated(tmp_path_factory, "--format", "bailian", "--requests", "25", "--seed", "3")
    assert_same(path, [0.05, 0.2], delay=2, sample=0.1, cxl_bytes=float(1 << 30))


def test_the_real_slice_and_the_synthetic_trace(tmp_path_factory):
    assert_same(str(REPO / "tests/fixtures/traces/mooncake-arxiv-slice-1000.jsonl"), [0.05, 0.1],
                ("tieringd", "lru", "arc", "belady"), limit=250)
    assert_same(str(REPO / "data/traces/mooncake-synthetic.jsonl"), [0.05, 0.1], ("tieringd", "lru", "belady"),
                limit=250, tick_ms=100.0, chunk=0, delay=1, sample=0.3)


def test_a_native_trace(tmp_path):
    rng = np.random.default_rng(2)
    n = 3000
    rows = np.zeros(n, ACCESS_DELTA_DTYPE)
    rows["pid"] = rng.integers(1, 3, n)
    rows["block_start"] = rng.zipf(1.3, n) % 400 * 4096
    rows["block_len"] = 4096
    rows["count"] = rng.integers(1, 9, n)
    rows["last_seen_ns"] = np.sort(rng.integers(0, 60 * 10**9, n))
    np.save(tmp_path / "n.npy", rows)
    assert_same(str(tmp_path / "n.npy"), [0.05, 0.2], tick_ms=500.0)


@settings(max_examples=40, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(0, 1), st.integers(0, 9)), min_size=1, max_size=80),
       counts=st.lists(st.integers(1, 30), min_size=80, max_size=80),
       cap=st.integers(0, 6), pmem=st.booleans(), hysteresis=st.sampled_from([0.0, 0.05]))
def test_hand_made_streams_run_as_the_whole_trace_ones(pairs, counts, cap, pmem, hysteresis):
    """Random small streams (and capacities down to none) in both simulators; Belady bounds them all."""
    n = len(pairs)
    window = np.cumsum([p[0] for p in pairs])
    block = np.array([p[1] for p in pairs])
    count = np.array(counts[:n], float)
    acc = spool_rows(window, block, count, 1 << 20, 1000.0)
    ref = simref.expand._finish(window, block, count, np.zeros(n), np.ones(n), np.arange(n), 1 << 20, 1000.0, "")
    tiers = simref.Layout((Tier.DRAM, Tier.CXL_DRAM, Tier.PMEM), (cap, 2, math.inf)) \
        if pmem else simref.Layout((Tier.DRAM, Tier.CXL_DRAM), (cap, math.inf))
    layout = Layout(tiers.tiers, tiers.capacity_blocks)
    cfg = PolicyConfig(hysteresis=hysteresis, min_residency_ms=0)
    model = TransparentModel(mover_bytes_s=64 * (1 << 20))            # 64 MiB per 1 s tick
    runs = [policies.make_run(name, acc, layout, model, HeatConfig(), cfg, record=True) for name in ALL]
    policies.replay(acc, runs, model)
    rmodel = simref.model.TransparentModel(64 * (1 << 20))
    hits = {}
    for name, run in zip(ALL, runs):
        o = simref.policies.run_policy(name, ref, tiers, rmodel, HeatConfig(), cfg)
        assert np.array_equal(run.tally.served_each, o.served), name
        assert np.array_equal(run.tally.hit_each, o.hit), name
        hits[name] = run.tally.hits
    assert all(hits["belady"] >= h for h in hits.values()), hits
    acc.close()


@pytest.mark.parametrize("block_tokens, message", [(256, "cannot be split"), (768, "whole number")])
def test_blocks_finer_than_the_trace_s_ids_are_refused(tmp_path_factory, block_tokens, message):
    path = generated(tmp_path_factory, "--format", "mooncake", "--requests", "5", "--seed", "1")
    with pytest.raises(simulate.traces.TraceError, match=message):
        simulate.load_accesses(path, "auto", simulate.RequestModel(kv_bytes_per_token=KV), None, block_tokens)
