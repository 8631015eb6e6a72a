#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A real KV trace replayed as page accesses in the lab, beside the simulator (figure P5-trace).

    trace_replay.py plan --trace T.jsonl --out DIR [--pool-mib 1228] [--block-mib 2] [--tick-ms 250]
    trace_replay.py play --plan DIR/plan.npz [--window-s 1] [--reads-cap 4]
    trace_replay.py run  --plan DIR/plan.npz --out DIR [--condition none|kernel|tieringd]... [--window-s 1]

``plan`` (anywhere): the first requests of a Mooncake trace whose blocks fit the pool, expanded into
block accesses per tick window by the simulator's own expansion (tieringd.simulate.expand: chunked
prefill, decode steps, one access per block and window with its read count), with KV bytes per token
chosen so that one trace block (512 tokens) is one pool block (--block-mib). The mapping is fixed:
pool block i is the i-th trace block by first access (the expansion's numbering). Writes plan.npz
and slice.jsonl (those requests, unchanged: what ``tieringctl simulate`` reads).

``play`` (the replayer, an unmodified program under ``tieringctl run``): one allocation of the pool,
filled block by block in that order (first touch = the simulator's first fit: the early blocks on
node 0 until it is full), then window by window, each --window-s of wall time (the trace's tick,
time-stretched for a TCG guest): the nodes of the window's blocks are queried (move_pages(2), four
pages per block), then each block is read min(count, --reads-cap) times (one word per 64-byte line).
An access is fast-served when its block was on node 0 as the window began — the simulator's
definition. JSON lines on stdout: start, one per window, end (every word verified).

``run`` (the guest): per condition (scripts/lab/peers.py's ``none``/``kernel``, or tieringd as in
kv_loop.py) the replayer under ``tieringctl run``; writes DIR/replay.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
MIB = 2 ** 20
BLOCK_TOKENS = 512          # a Mooncake block


def plan(a) -> int:
    from tieringd.simulate import expand, traces

    block_bytes = a.block_mib * MIB
    pool_blocks = a.pool_mib * MIB // block_bytes
    model = expand.RequestModel(kv_bytes_per_token=block_bytes // BLOCK_TOKENS, tick_ms=a.tick_ms)
    best = None
    for limit in range(1, 400):
        acc = expand.spool_trace(traces.read_requests(a.trace, "mooncake", limit=limit), model)
        if acc.nblocks > pool_blocks:
            acc.close()
            break
        if best is not None:
            best[1].close()
        best = (limit, acc)
    if best is None:
        print(f"trace_replay: the trace's first request needs more than {pool_blocks} blocks", file=sys.stderr)
        return 1
    limit, acc = best
    wins = list(acc.windows())
    window = np.concatenate([np.full(len(w.block), w.window, np.int64) for w in wins])
    block = np.concatenate([w.block for w in wins])
    count = np.concatenate([w.count for w in wins])
    nblocks, accesses = acc.nblocks, len(acc)
    acc.close()
    os.makedirs(a.out, exist_ok=True)
    np.savez(os.path.join(a.out, "plan.npz"), window=window, block=block, count=count,
             nblocks=nblocks, block_bytes=block_bytes, tick_ms=a.tick_ms, requests=limit,
             kv_bytes_per_token=block_bytes // BLOCK_TOKENS)
    with open(a.trace) as src, open(os.path.join(a.out, "slice.jsonl"), "w") as dst:
        for _, line in zip(range(limit), src):
            dst.write(line)
    print(json.dumps({"requests": limit, "blocks": nblocks, "pool_blocks": pool_blocks,
                      "accesses": accesses, "windows": int(window.max()) + 1}))
    return 0


def _fill_word(block: int) -> np.uint64:
    return np.uint64(0x9E3779B97F4A7C15 * (block + 1) % 2 ** 64)


def play(a) -> int:
    from tieringd.kernel import numa

    p = np.load(a.plan)
    nblocks, bb = int(p["nblocks"]), int(p["block_bytes"])
    wpb = bb // 8
    pool = np.empty(nblocks * wpb, np.uint64)       # one malloc: what an allocator shim sees
    t_fill = time.monotonic()
    idx = np.arange(wpb, dtype=np.uint64)
    for b in range(nblocks):                          # first touch in first-access order
        pool[b * wpb:(b + 1) * wpb] = idx ^ _fill_word(b)
    base = pool.ctypes.data
    # NUMA balancing scans the local pages of multi-threaded processes only
    threading.Thread(target=threading.Event().wait, daemon=True).start()
    probe = np.array([0, bb // 4, bb // 2, 3 * bb // 4], np.int64)
    placed = numa.query_pages_array(0, base + (np.arange(nblocks)[:, None] * bb + probe[None, :]).ravel())
    print(json.dumps({"event": "start", "pid": os.getpid(), "pool_addr": base, "blocks": nblocks,
                      "block_bytes": bb, "fill_s": round(time.monotonic() - t_fill, 1),
                      "blocks_on_node0": int((placed.reshape(nblocks, 4) == 0).all(1).sum()),
                      # per block, the share of its probes on node 0: which blocks first touch left there
                      "on_node0": (placed.reshape(nblocks, 4) == 0).mean(1).round(2).tolist()}), flush=True)
    window, block, count = p["window"], p["block"], p["count"]
    bounds = np.searchsorted(window, np.arange(int(window.max()) + 2))
    t0, sink = time.monotonic(), np.uint64(0)
    for w in range(len(bounds) - 1):
        sel = slice(bounds[w], bounds[w + 1])
        blocks, counts = block[sel], count[sel]
        nodes = numa.query_pages_array(0, base + (blocks[:, None] * bb + probe[None, :]).ravel())
        on0 = (nodes.reshape(len(blocks), 4) == 0).mean(1) if len(blocks) else np.zeros(0)
        for b, c in zip(blocks.tolist(), counts.tolist()):
            for _ in range(min(int(c), a.reads_cap)):
                sink ^= np.bitwise_xor.reduce(pool[b * wpb:(b + 1) * wpb:8])
        late = time.monotonic() - (t0 + (w + 1) * a.window_s)
        print(json.dumps({"event": "window", "w": w, "t_s": round(time.monotonic() - t0, 2),
                          "accesses": len(blocks), "fast": round(float(on0.sum()), 2),
                          "reads": float(counts.sum()), "fast_reads": round(float((on0 * counts).sum()), 1),
                          "late_s": round(max(late, 0), 2)}), flush=True)
        if late < 0:
            time.sleep(-late)
    bad = sum(int((pool[b * wpb:(b + 1) * wpb] != (idx ^ _fill_word(b))).sum()) for b in range(nblocks))
    print(json.dumps({"event": "end", "ok": bad == 0, "corrupt_words": bad, "sink": int(sink)}), flush=True)
    return 0 if bad == 0 else 3


def run_condition(cond: str, a) -> dict:
    import peers
    from kv_loop import DaemonProc, RUN_DIR, status

    res: dict = {"condition": cond}
    daemon = peer = None
    if cond == "tieringd":
        daemon = DaemonProc(os.path.join(a.out, "daemon.log"), [])
    else:
        peer = peers.make(cond, a.out, 16)
        peer.start()
    cmd = [os.path.join(REPO, ".venv", "bin", "tieringctl"), "run", "--", sys.executable, os.path.abspath(__file__),
           "play", "--plan", a.plan, "--window-s", str(a.window_s)]
    cpu = max(os.sched_getaffinity(0))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, TIERINGD_RUN_DIR=RUN_DIR),
                           preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
        lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
        res.update(rc=p.returncode, stderr=p.stderr[-3000:], start=lines[0] if lines else None,
                   windows=[x for x in lines if x["event"] == "window"],
                   end=next((x for x in lines if x["event"] == "end"), None))
        if daemon:
            s = status() or {}
            res["moves"], res["tiers"] = s.get("moves"), s.get("tiers")
    finally:
        if daemon:
            res["daemon_rc"] = daemon.stop()
        if peer:
            peer.stop()
    return res


def run(a) -> int:
    os.makedirs(a.out, exist_ok=True)
    out = {"release": os.uname().release, "conditions": []}
    for cond in a.condition or ["none", "kernel", "tieringd"]:
        out["conditions"].append(run_condition(cond, a))
        with open(os.path.join(a.out, "replay.json"), "w") as f:
            json.dump(out, f)
        c = out["conditions"][-1]
        print(json.dumps({"condition": cond, "rc": c.get("rc"), "start": c.get("start"), "end": c.get("end")}),
              flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--trace", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--pool-mib", type=int, default=1228)
    p.add_argument("--block-mib", type=int, default=2)
    p.add_argument("--tick-ms", type=float, default=250)
    for name in ("play", "run"):
        q = sub.add_parser(name)
        q.add_argument("--plan", required=True)
        q.add_argument("--window-s", type=float, default=1.0)
        q.add_argument("--reads-cap", type=int, default=4)
        if name == "run":
            q.add_argument("--out", required=True)
            q.add_argument("--condition", action="append", choices=("none", "kernel", "kernel-tuned", "tieringd"))
    a = ap.parse_args()
    return {"plan": plan, "play": play, "run": run}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
