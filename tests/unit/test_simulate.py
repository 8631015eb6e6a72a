# SPDX-License-Identifier: Apache-2.0
"""The simulator: trace readers, the request expansion model, costs, and `tieringctl simulate`."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from tieringd import simulate
from tieringd.cli import main
from tieringd.contracts import ACCESS_DELTA_DTYPE, Tier
from tieringd.simulate import traces
from tieringd.simulate.cost import CostError, load_costs
from tieringd.simulate.expand import RequestModel, spool_trace

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def gen_trace(repo, tmp_path_factory):
    def make(fmt: str, requests: int = 120, seed: int = 3):
        out = tmp_path_factory.mktemp("traces") / f"{fmt}-{requests}-{seed}.jsonl"
        subprocess.run([sys.executable, str(repo / "scripts" / "gen-trace.py"), "--format", fmt, "--requests",
                        str(requests), "--seed", str(seed), "-o", str(out)], check=True)
        return out
    return make


def expand(trace, model):
    """The spooled stream as whole arrays: (window, block, count, sharers) per access, and the stream."""
    acc = spool_trace(trace, model)
    ws = list(acc.windows())
    cols = [np.concatenate([np.full(len(w.block), w.window) for w in ws])] + \
        [np.concatenate([getattr(w, k) for w in ws]) for k in ("block", "count", "sharers")]
    return (*cols, acc)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_generated_traces_are_deterministic_and_well_formed(gen_trace):
    a, b = gen_trace("mooncake", seed=5), gen_trace("mooncake", seed=5)
    assert a.read_text() == b.read_text()
    rows = [json.loads(line) for line in a.read_text().splitlines()]
    assert len(rows) == 120 and {"timestamp", "input_length", "output_length", "hash_ids"} <= set(rows[0])
    assert all(len(r["hash_ids"]) == -(-r["input_length"] // 512) for r in rows)
    seen = sorted({h for r in rows for h in r["hash_ids"]})
    assert seen == list(range(len(seen)))               # renumbered by first appearance, like the real one
    tr = traces.read(str(gen_trace("bailian")))
    assert tr.format == "bailian" and tr.block_tokens == 16
    assert len({r.session for r in tr.requests}) < len(tr.requests)   # multi-turn sessions


def test_expansion_by_hand(tmp_path):
    # input 1024 tokens = 2 blocks, 3 output tokens; prefill at t=0 (8000 tok/s: 128 ms), decode steps at
    # 128, 158, 188 ms, all in window 0; the first output token opens block 2. Each step reads all blocks.
    path = write_jsonl(tmp_path / "t.jsonl", [{"timestamp": 0, "input_length": 1024, "output_length": 3,
                                               "hash_ids": [7, 9]}])
    window, block, count, _, acc = expand(traces.read(path), RequestModel(kv_bytes_per_token=1000, tick_ms=1000))
    assert block.tolist() == [0, 1, 2] and window.tolist() == [0, 0, 0]
    assert count.tolist() == [1 + 3, 1 + 3, 3]
    assert acc.block_bytes == 512 * 1000 and acc.nblocks == 3
    # decode spanning windows: 100 steps of 30 ms from 128 ms → windows 0..3
    path = write_jsonl(tmp_path / "u.jsonl", [{"timestamp": 0, "input_length": 1024, "output_length": 100,
                                               "hash_ids": [7, 9]}])
    window, _, count, _, _ = expand(traces.read(path), RequestModel(kv_bytes_per_token=1000, tick_ms=1000))
    per_window = np.bincount(window, weights=count)
    assert per_window.tolist() == [2 + 3 * 30, 3 * 33, 3 * 33, 3 * 4]


def test_shared_prefix_blocks_gain_sharers(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 1024, "output_length": 0, "hash_ids": [1, 2]},
        {"timestamp": 2000, "input_length": 1024, "output_length": 0, "hash_ids": [1, 3]},
    ])
    _, block, _, sharers, _ = expand(traces.read(path), RequestModel(kv_bytes_per_token=1))
    assert block.tolist() == [0, 1, 0, 2] and sharers.tolist() == [1, 1, 2, 1]


def test_bailian_sessions_follow_parent_chains(tmp_path):
    rows = [{"chat_id": 0, "parent_chat_id": -1, "timestamp": 0.5, "input_length": 20, "output_length": 2,
             "type": "text", "turn": 1, "hash_ids": [0, 1]},
            {"chat_id": 5, "parent_chat_id": 0, "timestamp": 9.0, "input_length": 40, "output_length": 2,
             "type": "text", "turn": 2, "hash_ids": [0, 2, 3]},
            {"chat_id": 6, "parent_chat_id": 5, "timestamp": 19.0, "input_length": 60, "output_length": 2,
             "type": "text", "turn": 3, "hash_ids": [0, 2, 4, 5]}]
    tr = traces.read(write_jsonl(tmp_path / "b.jsonl", rows))
    assert [r.session for r in tr.requests] == [0, 0, 0]
    assert tr.requests[1].arrival_ms == 9000.0


def test_native_trace(tmp_path):
    rows = np.zeros(4, ACCESS_DELTA_DTYPE)
    rows["pid"] = [1, 1, 2, 1]
    rows["block_start"] = [0x1000, 0x2000, 0x1000, 0x1000]
    rows["block_len"] = 4096
    rows["count"] = [3, 1, 1, 2]
    rows["last_seen_ns"] = [0, 10**9, 2 * 10**9, 3 * 10**9]
    np.save(tmp_path / "n.npy", rows)
    window, block, _, _, acc = expand(traces.read(str(tmp_path / "n.npy")), RequestModel(1, tick_ms=1000))
    assert acc.nblocks == 3 and window.tolist() == [0, 1, 2, 3] and block.tolist() == [0, 1, 2, 0]
    assert "4096-byte blocks (as recorded)" in acc.description
    jl = write_jsonl(tmp_path / "n.jsonl", [{k: int(r[k]) for k in ACCESS_DELTA_DTYPE.names} for r in rows])
    assert traces.detect_format(jl) == "native"
    assert len(spool_trace(traces.read(jl), RequestModel(1, tick_ms=1000))) == 4
    with pytest.raises(traces.TraceError, match="records its block size"):
        traces.read(jl, block_tokens=512)


@pytest.mark.parametrize("rows, message", [
    (["not json"], "not JSON"),
    ([{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [0]}], "timestamp"),
    ([{"timestamp": 0, "input_length": "5", "output_length": 1, "hash_ids": [0]}], "input_length"),
    ([{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0, -3]}], "hash_ids"),
    ([{"what": 1}], "cannot tell the trace format"),
])
def test_bad_traces_get_clear_errors(tmp_path, rows, message):
    p = tmp_path / "bad.jsonl"
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    with pytest.raises(traces.TraceError, match=message):
        traces.read(str(p))
    res = CliRunner().invoke(main, ["simulate", str(p), "--no-progress"])
    assert res.exit_code == 1 and "tieringctl:" in res.output and "Traceback" not in res.output


def test_costs_from_numa_json(tmp_path):
    doc = {"schema": "tieringd.numa/1", "nodes": [
        {"id": 0, "tier": "dram", "hmat": None},
        {"id": 1, "tier": "cxl-dram", "hmat": {"access0": {"read_bandwidth_mb_s": 40000, "read_latency_ns": 250}}},
        {"id": 2, "tier": "cxl-dram", "hmat": {"access0": {"read_bandwidth_mb_s": 20000, "read_latency_ns": 350}}}]}
    (tmp_path / "numa.json").write_text(json.dumps(doc))
    costs = load_costs(str(tmp_path / "numa.json"))
    assert costs[Tier.CXL_DRAM].bandwidth_bytes_s == pytest.approx(30e9)
    assert costs[Tier.CXL_DRAM].latency_s == pytest.approx(300e-9)
    assert costs[Tier.DRAM].bandwidth_bytes_s == 400e9          # no HMAT: the brief's figure
    (tmp_path / "t.json").write_text(json.dumps({"pmem": {"bandwidth_gb_s": 30}}))
    with pytest.raises(CostError, match="latency_ns"):
        load_costs(str(tmp_path / "t.json"))


def test_cli_prints_the_comparison_and_writes_the_png(gen_trace, tmp_path):
    trace = gen_trace("mooncake")
    png = tmp_path / "hit.png"
    res = CliRunner().invoke(main, ["simulate", str(trace), "--fast-capacity", "10%", "--fast-capacity", "30%",
                                    "--plot", str(png), "--no-progress"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[1].split()[:5] == ["fast", "capacity", "policy", "hit", "rate"]
    for name in simulate.DEFAULT_POLICIES:
        assert sum(1 for line in lines if f" {name} " in line) == 2, name
    assert sum(1 for line in lines if " demand-lru (ref) " in line) == 2
    assert sum(1 for line in lines if " belady (bound) " in line) == 2
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_cli_json(gen_trace, tmp_path):
    trace = gen_trace("bailian", requests=40)
    res = CliRunner().invoke(main, ["simulate", str(trace), "--json", "--policy", "lru", "--policy", "belady",
                                    "--fast-capacity", "1GiB", "--cxl-capacity", "2GiB", "--no-progress"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["schema"] == "tieringd.simulate/2" and [r["policy"] for r in doc["results"]] == ["lru", "belady"]
    assert [r["kind"] for r in doc["results"]] == ["transparent", "bound"]
    r = doc["results"][1]
    assert set(r["tier_share"]) == {"dram", "cxl-dram", "pmem"}
    assert sum(r["tier_share"].values()) == pytest.approx(1.0)
    assert r["fast_served"] == r["tier_share"]["dram"]
    assert doc["mover_bytes_s"] == pytest.approx(0.1 * 60e9)      # 10% of PMem's bandwidth, the slowest tier
    assert r["fast_capacity_bytes"] <= 1 << 30
    assert doc["results"][1]["hit_rate"] >= doc["results"][0]["hit_rate"]


def test_cli_rejects_bad_options(gen_trace):
    trace = gen_trace("mooncake", requests=10)
    res = CliRunner().invoke(main, ["simulate", str(trace), "--fast-capacity", "150%"])
    assert res.exit_code == 2 and "percentage" in res.output
    res = CliRunner().invoke(main, ["simulate", str(trace) + ".missing"])
    assert res.exit_code == 1 and "does not exist" in res.output


# The public trace ships with the repository (data/traces/README.md), so a fresh clone runs this test;
# TIERINGD_SHARED_DATA=DIR replays DIR/mooncake-synthetic.jsonl instead.
SHARED_TRACE = (Path(os.environ["TIERINGD_SHARED_DATA"]) / "mooncake-synthetic.jsonl"
                if os.environ.get("TIERINGD_SHARED_DATA")
                else Path(__file__).resolve().parents[2] / "data" / "traces" / "mooncake-synthetic.jsonl")


def test_the_shared_synthetic_trace_end_to_end_keeps_belady_above_tieringd_above_lru():
    """The public Mooncake FAST'25 synthetic trace, first 600 requests, defaults.

    Belady bounds tieringd; tieringd keeps up with transparent LRU. On this trace the two are within
    0.3 points of each other at every prefix tried (600: −0.3 at 5%, 1000: −0.1, 2000: +0.1, all
    3,993: +0.1; docs/simulator.md), so "≥ LRU" is asserted to half a point: a policy that falls
    behind — as the brief's thresholds did, by 50 points — fails."""
    if not SHARED_TRACE.exists():
        why = f"{SHARED_TRACE} is missing (data/traces/ ships it; TIERINGD_SHARED_DATA=DIR overrides)"
        pytest.fail(why) if os.environ.get("TIERINGD_REQUIRE_ALL") == "1" else pytest.skip(why)
    res = CliRunner().invoke(main, ["simulate", str(SHARED_TRACE), "--limit", "600", "--fast-capacity", "5%",
                                    "--fast-capacity", "10%", "--policy", "tieringd", "--policy", "lru",
                                    "--policy", "belady", "--json", "--no-progress"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["description"].startswith("mooncake trace: 600 requests")
    by = {(r["fast_capacity_fraction"], r["policy"]): r for r in doc["results"]}
    for frac in {f for f, _ in by}:
        belady, tieringd, lru = (by[(frac, p)] for p in ("belady", "tieringd", "lru"))
        assert belady["hit_rate"] >= tieringd["hit_rate"] >= lru["hit_rate"] - 0.005, (frac, tieringd, lru)
        assert tieringd["hit_rate"] >= 0.90 * belady["hit_rate"]
        assert tieringd["fast_served"] >= 0.95 * belady["fast_served"]


ARXIV_SLICE = Path(__file__).resolve().parents[1] / "fixtures" / "traces" / "mooncake-arxiv-slice-1000.jsonl"


def test_a_real_production_slice_keeps_tieringd_near_the_bound_and_level_with_lru():
    """1,000 real requests of the Mooncake paper's trace (tests/fixtures/traces/README.md), the
    acceptance model, defaults. One tick's decode reads outgrow DRAM at 5% here (the hardest part
    tried: Belady itself serves 55%), where tieringd trails transparent LRU by 0.16 point
    (docs/simulator.md) and ARC collapses; at 10% it leads. Asserted: the bound holds, tieringd
    stays within 0.9 of Belady's hit rate and serves at least 0.95 of Belady's fast share at both
    capacities (0.941 at 5% with the 0.95 / 0.92 band: the fill left 7% of DRAM empty), ahead of LRU
    at 10% and within 0.3 point of it at 5% — a policy that churns shared blocks in for private ones
    (0.8 point behind before the hysteresis default) or loses the lag-free full view fails."""
    res = CliRunner().invoke(main, ["simulate", str(ARXIV_SLICE), "--fast-capacity", "5%", "--fast-capacity",
                                    "10%", "--policy", "tieringd", "--policy", "lru", "--policy", "belady",
                                    "--json", "--no-progress"])
    assert res.exit_code == 0, res.output
    by = {(r["fast_capacity_fraction"], r["policy"]): r for r in json.loads(res.output)["results"]}
    fracs = sorted({f for f, _ in by})
    for frac in fracs:
        belady, tieringd, lru = (by[(frac, p)] for p in ("belady", "tieringd", "lru"))
        assert belady["hit_rate"] >= tieringd["hit_rate"] >= 0.90 * belady["hit_rate"], (frac, tieringd)
        assert tieringd["fast_served"] >= 0.95 * belady["fast_served"], (frac, tieringd, belady)
    small, large = fracs
    assert by[(large, "tieringd")]["hit_rate"] >= by[(large, "lru")]["hit_rate"]
    assert by[(small, "tieringd")]["hit_rate"] >= by[(small, "lru")]["hit_rate"] - 0.003


def test_generated_agent_traces_have_the_coding_agent_shape(repo, tmp_path):
    """Long contexts (70k–160k tokens) that grow a few thousand tokens a step and keep their prefix,
    steps seconds apart, many sessions interleaved; deterministic for a seed."""
    out = tmp_path / "agent.jsonl"
    args = [sys.executable, str(repo / "scripts" / "gen-trace.py"), "--shape", "agent", "--requests", "600",
            "--seed", "2", "-o", str(out)]
    subprocess.run(args, check=True)
    text = out.read_text()
    subprocess.run(args, check=True)
    assert out.read_text() == text
    rows = [json.loads(line) for line in text.splitlines()]
    ctx = np.array([r["input_length"] for r in rows])
    assert len(rows) == 600 and ctx.min() >= 70_000 and ctx.max() <= 170_000 and np.median(ctx) > 100_000
    assert all(len(r["hash_ids"]) == -(-r["input_length"] // 512) for r in rows)
    # a step's context holds the previous step's (same prefix ids): most steps share ≥ 90 % of an earlier
    # step's ids, and the 16k-token shared prompt (31 blocks) opens every one of them
    seen = {}
    grown = 0
    for r in rows:
        ids = r["hash_ids"]
        prev = seen.get(tuple(ids[31:33]))
        grown += prev is not None and len(prev) < len(ids) and ids[:len(prev) - 1] == prev[:-1]
        seen[tuple(ids[31:33])] = ids
    assert grown > 0.5 * len(rows)
    gaps = np.diff([r["timestamp"] for r in rows])
    assert np.median(gaps) < 2000                                    # interleaved sessions, ms apart
