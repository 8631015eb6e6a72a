#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Figure P9: the pool across two hosts — bytes kept once, capacity handed over, a dead host's space back.

One boot of the lab's ``pool`` profile (two guests, one shared devdax pool, etcd on this machine's
loopback: scripts/lab/pool/pair.py), each guest running tieringd with ``[pool]`` and the KV workload
(scripts/lab/pool/kv_pool.py):

- **dedup**: both hosts run the same workload at once; the cold blocks their daemons send to the pool
  are kept once. From etcd's index at its fullest: copies in the pool, references per host, and the
  second copy saved (references beyond a block's first, over the smaller host's references);
- **hand-over**: host a's workload ends while host b's (other bytes) waits for room: the extents a
  gives back, how many b takes, and the seconds from a's first one given back to b's next claim;
- **failure**: host a's daemon killed with SIGKILL, later the guest powered off, each while holding
  extents: seconds until etcd shows none of a's claims (the lease TTL is the floor);
- every workload's bytes verified at its end ("intact").

Timings come from this machine's clock (a watcher on etcd and the guests' barrier files); under TCG
the guests are slow but etcd's lease clock is this machine's.

    python scripts/bench/p9_pool.py --json build/bench/p9_pool.json [--kernel 6.12] [--ttl 30]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "scripts" / "lab" / "pool"))

import lab as labmod  # noqa: E402
import pair  # noqa: E402
from etcdcluster import EtcdCluster  # noqa: E402
from watch import ClaimWatcher  # noqa: E402

BLOCK_MIB = 2                   # tieringd.pool.dedup.BLOCK_BYTES


def first_at(rows, pred, t_from: float) -> float | None:
    return next((round(t - t_from, 2) for t, n in rows if t >= t_from and pred(n)), None)


def measure(w: ClaimWatcher, out: dict, ttl: int) -> dict:
    m = w.marks
    d = w.most_shared(0.0, max(m["a.d-ended"], m["b.d-ended"]))
    ended, killed, off = m["a.w1-ended"], m["a.daemon-killed"], m["a.poweroff"]
    a_before = w.held("a", ended)[0][1]
    a_rows = w.held("a", ended, killed)
    a_low = min(n for _, n in a_rows)
    b_rows = w.held("b", ended, killed)
    b_at = b_rows[0][1]
    # from a's first extent given back to b's next claim
    t_rel = next(t for t, n in a_rows if n < a_before)
    b_then = w.held("b", t_rel)[0][1]
    b_took = next((t for t, n in w.held("b", t_rel, killed) if n > b_then), None)
    runs = {"a/dedup": out["a"]["d"], "b/dedup": out["b"]["d"], "a/first": out["a"]["a1"], "b/grown": out["b"]["b"]}
    intact = all(r["ok"] and r["corrupt_bytes"] == 0 and r["verified_bytes"] == r["pool_bytes"] for r in runs.values())
    return {
        "dedup": d, "saved_mib": d["saved_references"] * BLOCK_MIB,
        "released_extents": a_before - a_low, "b_grew_extents": max(n for _, n in b_rows) - b_at,
        "handover_s": None if b_took is None else round(b_took - t_rel, 2),
        "free_after_sigkill_s": first_at(w.held("a", killed, off), lambda n: n == 0, killed),
        "free_after_poweroff_s": first_at(w.held("a", off), lambda n: n == 0, off),
        "lease_ttl_s": ttl, "intact": intact,
        "verified_mib": {k: (r["verified_bytes"] or 0) >> 20 for k, r in runs.items()},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--kernel", default="6.12")
    ap.add_argument("--ttl", type=int, default=30)
    ap.add_argument("--extent", default="32M")
    args = ap.parse_args()
    script = (f".venv/bin/python scripts/lab/pool/kv_pool.py --out $LAB_OUT --ttl {args.ttl} "
              f"--extent {args.extent} > $LAB_OUT/kv_pool.out 2>&1")
    base = Path(tempfile.mkdtemp(prefix="p9-"))
    cluster = EtcdCluster(base / "etcd").start()
    watch = ClaimWatcher(cluster.endpoints)
    outs = {h: base / h for h in pair.HOSTS}
    try:
        pair.run_pair(labmod, {"a": script, "b": script}, endpoints=cluster.endpoints, kernel=args.kernel,
                      timeout_s=2400, out_dirs=outs, on_start=watch.start)
    finally:
        watch.stop()
        cluster.stop()
    out = {h: json.loads((outs[h] / "pool.json").read_text()) for h in pair.HOSTS}
    r = measure(watch, out, args.ttl)
    d = r["dedup"]
    fig = {
        "figure": "P9", "title": f"the pool across two hosts (lab pool profile, kernel {args.kernel}, "
                                 f"lease TTL {args.ttl} s, extents {args.extent})",
        "columns": ["measure", "value"],
        "rows": [["copies kept in the pool (2 MiB blocks)", d["copies"]],
                 ["references, host a / b", f"{d['references'].get('a', 0)} / {d['references'].get('b', 0)}"],
                 ["bytes saved (MiB)", r["saved_mib"]],
                 ["second copy saved", d["second_copy_saved"]],
                 ["extents a gave back / b took", f"{r['released_extents']} / {r['b_grew_extents']}"],
                 ["hand-over (s)", r["handover_s"]],
                 ["a's extents free after SIGKILL (s)", r["free_after_sigkill_s"]],
                 ["a's extents free after power-off (s)", r["free_after_poweroff_s"]],
                 ["every workload intact", r["intact"]]],
        "summary": {k: r[k] for k in ("saved_mib", "handover_s", "free_after_sigkill_s", "free_after_poweroff_s",
                                      "intact")} | {"second_copy_saved": d["second_copy_saved"]},
        "result": r,
        "notes": "Timings from the lab host's clock (etcd watched every 0.25 s); the guests run under TCG.",
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(fig, indent=2))
    print(json.dumps(fig, indent=1))
    return 0 if r["intact"] else 1


if __name__ == "__main__":
    sys.exit(main())
