# SPDX-License-Identifier: Apache-2.0
"""The pool across hosts in the lab: two guests (hosts a and b) at once, one shared memory device, etcd
on the lab host's loopback reached through user-mode networking only (scripts/lab/pool/, docs/pool.md)."""
from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.lab, pytest.mark.etcd]
LAB_GROUP_S = 1250


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_two_hosts_see_one_device_and_reach_etcd_only_through_the_forward(lab, etcd):
    port = etcd.client_ports[0]
    script = f"""set -e
dev=$(scripts/lab/pool/guest.sh devdax)
if [ "$LAB_HOST" = a ]; then
    .venv/bin/python scripts/lab/pool/device_check.py write $dev 64 4
    scripts/lab/pool/guest.sh mark written
else
    scripts/lab/pool/guest.sh wait written
    .venv/bin/python scripts/lab/pool/device_check.py read $dev 64 4
fi
.venv/bin/python scripts/lab/pool/device_check.py net {port}
"""
    r = lab.run_pair({"a": script, "b": script}, etcd, timeout_s=600)
    out = {}
    for h, res in r.items():
        assert res.rc == 0, f"host {h}: {res.stdout}\n{res.stderr}"
        out[h] = _json_lines(res.stdout)
    # 4 MiB of random bytes written by a, read back identical by b: one memory, two hosts
    assert out["a"][0]["md5"] == out["b"][0]["md5"]
    for h in "ab":
        assert out[h][1]["etcd"] == [h]
        assert out[h][1]["host_loopback"].startswith("refused"), out[h][1]


# ---- the daemons with [pool]: blocks kept once, capacity that follows demand, a host that dies ----

# a live host that misses its lease loses the extents it uses (docs/pool.md); the lab's guests lost
# theirs at 4, 12 and 30 s while the heartbeat dropped an exited workload's references (fixed): margin
TTL_S = 30
EXTENT_MIB = 32


@pytest.fixture(scope="module")
def pooled(lab, tmp_path_factory):
    """One boot of both hosts running tieringd with [pool] and the KV workload (kv_pool.py)."""
    from etcd_support import EtcdCluster, etcd_missing
    why = etcd_missing()
    if why:
        pytest.skip(why)
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd")).start()
    from watch import ClaimWatcher
    watch = ClaimWatcher(cluster.endpoints)
    script = (f".venv/bin/python scripts/lab/pool/kv_pool.py --out $LAB_OUT --ttl {TTL_S} "
              f"--extent {EXTENT_MIB}M > $LAB_OUT/kv_pool.out 2>&1")
    try:
        r = lab.run_pair({"a": script, "b": script}, cluster, timeout_s=2400, on_start=watch.start)
    finally:
        watch.stop()
        cluster.stop()
    out = {}
    for h, res in r.items():
        try:
            out[h] = json.loads((res.out_dir / "pool.json").read_text())
        except (OSError, ValueError):
            out[h] = None
        if out[h] is None or out[h].get("error"):
            logs = "\n".join((res.out_dir / n).read_text()[-3000:] for n in ("kv_pool.out", "daemon.log")
                             if (res.out_dir / n).exists())
            pytest.fail(f"host {h}: rc {res.rc}\n{logs}\n{res.stderr[-2000:]}", pytrace=False)
    return {"results": r, "out": out, "watch": watch}


def test_the_same_workload_on_both_hosts_keeps_its_cold_blocks_in_the_pool_once(pooled, record_property):
    w = pooled["watch"]
    d = w.most_shared(0.0, max(w.marks["a.d-ended"], w.marks["b.d-ended"]))    # the first phase
    record_property("dedup", d)
    record_property("saved_mib", d["saved_references"] * 2)
    assert set(d["references"]) == {"a", "b"}, d                        # both sent blocks to the pool
    # a reference beyond a block's first is a second copy the pool did not store. Not all of b's
    # blocks can find a's: a keeps some of the same blocks in its memory, and the pool's share runs
    # out for it (0.887 measured; the target, 0.9, is P9's figure, not an assertion)
    assert d["second_copy_saved"] >= 0.7, d
    for h in "ab":
        run = pooled["out"][h]["d"]
        assert run["ok"] and run["corrupt_bytes"] == 0 and run["read_errors"] == 0, run
        assert run["verified_bytes"] == run["pool_bytes"]


def test_capacity_moves_from_the_host_that_shrinks_to_the_host_that_grows(pooled, record_property):
    w = pooled["watch"]
    ended = w.marks["a.w1-ended"]
    a_before = w.held("a", ended)[0][1]
    a_low = min(n for _, n in w.held("a", ended, w.marks["a.daemon-killed"]))
    assert a_before > 0 and a_low < a_before, w.rows        # a's workload ended: it gave extents back
    released = a_before - a_low
    b_at = w.held("b", ended)[0][1]
    b_rows = w.held("b", ended, w.marks["a.daemon-killed"])
    b_high = max(n for _, n in b_rows)
    # b's fill was waiting for room: it takes what a released (or all it still needed)
    assert b_high >= b_at + min(released, 1), w.rows
    # from a's first extent given back to b's next claim: how long room waits for the host that needs it
    t_rel = next(t for t, n in w.held("a", ended) if n < a_before)
    b_then = w.held("b", t_rel)[0][1]
    b_took = next((t for t, n in w.held("b", t_rel, w.marks["a.daemon-killed"]) if n > b_then), None)
    record_property("released_extents", released)
    record_property("b_grew_extents", b_high - b_at)
    record_property("handover_s", None if b_took is None else round(b_took - t_rel, 2))
    for h in "ab":
        assert pooled["out"][h]["joined"]["state"] == "member"
    assert pooled["out"]["a"]["a1"]["ok"] and pooled["out"]["a"]["a1"]["corrupt_bytes"] == 0


def _gone_after(w, host: str, t_mark: float, t_to: float = float("inf")) -> float | None:
    rows = w.held(host, t_mark, t_to)
    return next((round(t - t_mark, 2) for t, n in rows if n == 0), None)


def test_a_daemon_killed_with_sigkill_frees_its_extents_after_the_lease(pooled, record_property):
    w = pooled["watch"]
    killed = w.marks["a.daemon-killed"]
    assert w.held("a", killed)[0][1] > 0, w.rows            # it held extents when it died
    gone = _gone_after(w, "a", killed, w.marks.get("a.poweroff", float("inf")))
    assert gone is not None, f"a's claims outlived its lease: {w.rows}"
    record_property("extents_free_after_sigkill_s", gone)


def test_a_host_powered_off_frees_its_extents_and_the_other_host_loses_nothing(pooled, record_property):
    w = pooled["watch"]
    from pair import POWERED_OFF
    assert pooled["results"]["a"].rc == POWERED_OFF
    off = w.marks["a.poweroff"]
    assert w.held("a", off)[0][1] > 0, w.rows               # the restarted daemon held extents again
    gone = _gone_after(w, "a", off)
    assert gone is not None, f"a's claims outlived the power-off: {w.rows}"
    record_property("extents_free_after_poweroff_s", gone)
    b = pooled["out"]["b"]["b"]
    assert b["ok"] and b["corrupt_bytes"] == 0 and b["read_errors"] == 0, b
    assert b["verified_bytes"] == b["pool_bytes"]
