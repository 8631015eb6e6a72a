# SPDX-License-Identifier: Apache-2.0
"""The peer, engine and trace benchmarks' host-side parts (scripts/lab/peers.py, kv_engine.py,
tiny_gguf.py, trace_replay.py; scripts/bench/p5_peers.py): what the DAMON peer writes on a fake
sysfs tree, which KV pages the engine reads, the model's vocabulary, the trace's plan and the peer
table's verdict. What the peers do to placement is measured in the lab (make bench)."""
import importlib.util
import json
import sys

import numpy as np
import pytest

from tieringd.kernel import sysfs


@pytest.fixture(scope="module")
def lab_scripts(repo):
    sys.path.insert(0, str(repo / "scripts" / "lab"))
    yield
    sys.path.remove(str(repo / "scripts" / "lab"))


def _load(repo, rel: str, name: str):
    spec = importlib.util.spec_from_file_location(name, repo / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fake_damon_tree(root, kdamonds: int, new_kernel: bool) -> None:
    """What the kernel creates under admin/kdamonds once nr_kdamonds, nr_contexts, nr_targets,
    nr_regions, nr_schemes, nr_goals and nr_filters are written (regular files here)."""
    def touch(rel: str, value: str = "0") -> None:
        p = root / rel.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(value + "\n")

    base = "sys/kernel/mm/damon/admin/kdamonds"
    touch(f"{base}/nr_kdamonds")
    for k in range(kdamonds):
        c = f"{base}/{k}/contexts/0"
        for f in ("state", "contexts/nr_contexts"):
            touch(f"{base}/{k}/{f}", "off")
        touch(f"{c}/operations", "vaddr")
        for f in ("sample_us", "aggr_us", "update_us"):
            touch(f"{c}/monitoring_attrs/intervals/{f}")
        if new_kernel:
            for f in ("access_bp", "aggrs", "min_sample_us", "max_sample_us"):
                touch(f"{c}/monitoring_attrs/intervals/intervals_goal/{f}")
        for f in ("nr_targets", "0/regions/nr_regions", "0/regions/0/start", "0/regions/0/end"):
            touch(f"{c}/targets/{f}")
        s = f"{c}/schemes/0"
        touch(f"{c}/schemes/nr_schemes")
        for f in ("action", "target_nid", "apply_interval_us", "quotas/ms", "quotas/bytes",
                  "quotas/reset_interval_ms", "quotas/weights/sz_permil", "quotas/weights/nr_accesses_permil",
                  "quotas/weights/age_permil", "quotas/goals/nr_goals", "quotas/goals/0/target_metric",
                  "quotas/goals/0/target_value", "quotas/goals/0/nid"):
            touch(f"{s}/{f}")
        for rng in ("sz", "nr_accesses", "age"):
            touch(f"{s}/access_pattern/{rng}/min")
            touch(f"{s}/access_pattern/{rng}/max")
        filters = "ops_filters" if new_kernel else "filters"
        for f in ("nr_filters", "0/type", "0/matching") + (("0/allow",) if new_kernel else ()):
            touch(f"{s}/{filters}/{f}")
    touch("sys/devices/system/memory/block_size_bytes", "8000000")
    for node, blocks in ((0, range(0, 9)), (1, range(10, 18))):
        for b in blocks:
            (root / f"sys/devices/system/node/node{node}/memory{b}").mkdir(parents=True)


@pytest.mark.parametrize("new_kernel", [True, False], ids=["7.3-like", "6.12-like"])
def test_the_damon_peer_writes_the_kernels_tiering_recipe(repo, lab_scripts, tmp_path, new_kernel):
    import peers
    _fake_damon_tree(tmp_path, 2, new_kernel)
    peer = peers.DamonTiering(str(tmp_path))
    with sysfs.root(tmp_path):
        for k, scheme in enumerate(peer.SCHEMES):
            peer._kdamond(k, *scheme)
        read = lambda rel: sysfs.read_text(f"{peers.DAMON}/{rel}")
        # node 0's kdamond demotes the cold, node 1's promotes the hot, on physical addresses
        assert [read(f"{k}/contexts/0/schemes/0/action") for k in (0, 1)] == ["migrate_cold", "migrate_hot"]
        assert [read(f"{k}/contexts/0/schemes/0/target_nid") for k in (0, 1)] == ["1", "0"]
        assert read("0/contexts/0/operations") == "paddr"
        # each monitors its own node: 128 MiB memory blocks 0-8 and 10-17
        assert (read("0/contexts/0/targets/0/regions/0/start"), read("0/contexts/0/targets/0/regions/0/end")) \
            == ("0", str(9 * 0x8000000))
        assert read("1/contexts/0/targets/0/regions/0/start") == str(10 * 0x8000000)
        assert read("0/contexts/0/schemes/0/access_pattern/nr_accesses/max") == "0"
        assert read("1/contexts/0/schemes/0/access_pattern/nr_accesses/min") == "1"
        assert read("1/contexts/0/schemes/0/quotas/bytes") == str(200 * 2 ** 20)
        # the goals: 0.5 % of node 0 free (demotion), 99.7 % used (promotion)
        assert [read(f"{k}/contexts/0/schemes/0/quotas/goals/0/target_value") for k in (0, 1)] == ["50", "9970"]
        if new_kernel:
            assert read("1/contexts/0/monitoring_attrs/intervals/intervals_goal/access_bp") == "400"
            f = "contexts/0/schemes/0/ops_filters/0"
            assert [read(f"{k}/{f}/allow") for k in (0, 1)] == ["N", "Y"]       # reject / allow young
        else:
            # no "allow" before 6.14: allowing the young is rejecting what is not young
            f = "contexts/0/schemes/0/filters/0"
            assert [read(f"{k}/{f}/matching") for k in (0, 1)] == ["Y", "N"]
            assert any("intervals" in n for n in peer.notes)


def test_the_engine_reads_the_front_cells_of_every_kv_tensor(repo, lab_scripts):
    kv_engine = _load(repo, "scripts/lab/kv_engine.py", "kv_engine")
    layout = kv_engine.Layout(layers=4, embd_kv=256, ctx=307200)
    assert layout.total_bytes == 4 * 2 * 307200 * 512          # f16 K and V, 1.17 GiB
    base = 1 << 30
    pages = layout.hot_pages(base, cells=300)       # padded to 512 cells: 512 × 512 B = 64 pages each
    assert len(pages) == 8 * 64
    per = pages.reshape(8, 64)
    assert (per[:, 0] == base + np.arange(8) * layout.tensor_bytes).all()
    assert (np.diff(per, axis=1) == 4096).all()


def test_the_tiny_models_tokens_are_ascii_and_its_weights_seeded(repo):
    tiny = _load(repo, "scripts/lab/tiny_gguf.py", "tiny_gguf")
    tokens, scores, types = tiny.vocabulary()
    assert len(tokens) == len(scores) == len(types) == 99
    assert all(t.isascii() for t, ty in zip(tokens, types) if ty == tiny.NORMAL and t != "\u2581")
    a = type("A", (), dict(layers=2, embd=64, heads=4, kv_heads=4, ff=128))()
    w1 = tiny.weights(np.random.default_rng(1), len(tokens), a)
    w2 = tiny.weights(np.random.default_rng(1), len(tokens), a)
    assert all((w1[k] == w2[k]).all() for k in w1)
    assert w1["blk.1.attn_k.weight"].shape == (64, 64) and w1["token_embd.weight"].shape == (99, 64)


def test_the_trace_plan_maps_one_pool_block_per_trace_block(repo, lab_scripts, tmp_path):
    trace = repo / "data" / "traces" / "mooncake-synthetic.jsonl"
    if not trace.exists():
        pytest.skip("no shipped Mooncake trace")
    replay = _load(repo, "scripts/lab/trace_replay.py", "trace_replay")
    args = type("A", (), dict(trace=str(trace), out=str(tmp_path), pool_mib=256, block_mib=2, tick_ms=250.0))()
    assert replay.plan(args) == 0
    p = np.load(tmp_path / "plan.npz")
    assert int(p["nblocks"]) <= 128 and int(p["kv_bytes_per_token"]) * 512 == 2 * 2 ** 20
    assert set(np.unique(p["block"])) == set(range(int(p["nblocks"])))    # numbered by first access
    assert (np.diff(p["window"]) >= 0).all()
    lines = (tmp_path / "slice.jsonl").read_text().splitlines()
    assert len(lines) == int(p["requests"]) and json.loads(lines[0])["hash_ids"]


def test_the_peer_table_says_when_a_peer_wins(repo, lab_scripts):
    p5 = _load(repo, "scripts/bench/p5_peers.py", "p5_peers")
    row = lambda peer, share, run=0: ["7.3", "front", peer, run, share, share, 1.0, 2.0, 0.5, 1.0, 10, True]
    runs = [row("none", 1.0), row("kernel", 0.58), row("damon", 0.99), row("tieringd", 0.998),
            row("tieringd", 0.96, 1)]
    table, verdict = p5.summarise(runs, {"memtierd": "no Go toolchain"})
    v = verdict["7.3/front"]
    assert v["best_peer"] == "none" and v["ahead_of_every_peer"] is False and v["tieringd"] == 0.979
    by_peer = {r[2]: r for r in table}
    assert by_peer["tieringd"][3] == 2 and by_peer["tieringd"][5] == 0.96          # runs, lowest run
    assert by_peer["memtierd"][-1] == "not run"
