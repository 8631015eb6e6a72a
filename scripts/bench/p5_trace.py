#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""P5-trace: the Mooncake trace replayed live in the lab, beside ``tieringctl simulate``'s prediction.

The first requests of the shared Mooncake trace whose blocks fit the 1.2 GiB pool (one 2 MiB pool
block per 512-token trace block, the i-th by first access; scripts/lab/trace_replay.py) are expanded
by the simulator's own expansion and replayed as page reads, one trace tick (250 ms) per --window-s
of wall time, in one guest (cxl, DRAM nodes 1 GiB, kernel --kernel): with no tiering, the kernel's
tiering and tieringd. Then the simulator runs the same requests, block size and tick, at the fast
capacity the guest showed (the blocks first touch left on node 0: the simulator's first fit fills
its whole capacity, so it then holds as many blocks there as first touch did), for first-fit (= no
tiering), tieringd and transparent LRU, with its mover at its default and at the rate the live
daemon's mover measured, in trace time (× --window-s ÷ the trace tick; --mover-gb-s sets it). The
gap between live and simulated fast-served shares is the simulator's fidelity.

    python scripts/bench/p5_trace.py --json build/bench/p5_trace.json [--kernel 6.12] [--window-s 2]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lab"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _figure import write_figure  # noqa: E402
from loop_report import NODE_MIB, REPO, lab_module  # noqa: E402

TRACE = Path("/work/shared/data/mooncake-synthetic.jsonl")
KEEP = REPO / "build" / "bench" / "p5_trace"
SIM_OF = {"none": "first-fit", "kernel": None, "tieringd": "tieringd"}
COLUMNS = ["condition", "live fast-served", "simulated (default mover)", "gap (points)",
           "simulated (lab mover)", "gap (points)", "windows late", "intact"]


def trace_path() -> Path:
    for p in (REPO / "data" / "traces" / "mooncake-synthetic.jsonl", TRACE):
        if p.exists():
            return p
    raise SystemExit("p5_trace: no Mooncake trace (data/traces/mooncake-synthetic.jsonl)")


def simulate(slice_path: Path, kv: int, tick_ms: float, capacity_bytes: int, mover_gb_s: float | None) -> dict:
    cmd = [str(REPO / ".venv" / "bin" / "tieringctl"), "simulate", str(slice_path), "--format", "mooncake",
           "--kv-bytes-per-token", str(kv), "--tick-ms", str(tick_ms), "--fast-capacity", str(capacity_bytes),
           "--policy", "tieringd", "--policy", "first-fit", "--policy", "lru", "--json", "--no-progress"]
    if mover_gb_s:
        cmd += ["--mover-gb-s", str(mover_gb_s)]
    doc = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO).stdout)
    return {r["policy"]: r["fast_served"] for r in doc["results"]}


def live_share(c: dict) -> float | None:
    ws = c.get("windows") or []
    n = sum(w["accesses"] for w in ws)
    return round(sum(w["fast"] for w in ws) / n, 4) if n else None


def lab_mover_gb_s(c: dict, window_s: float, tick_ms: float) -> float:
    """The live daemon's measured mover rate, in the trace's time: a trace tick of ``tick_ms`` is
    replayed in ``window_s`` of wall time, so the mover looks that many times faster to the trace.
    0.1 GB/s where the run has no measured rate."""
    rate_mb_s = ((c.get("moves") or {}).get("mover_rate_mb_s")) or 0
    return round(rate_mb_s * 1e6 / 1e9 * window_s / (tick_ms / 1000), 3) if rate_mb_s else 0.1


def in_order(c: dict, n: int) -> int | None:
    """How many of the first ``n`` blocks by first access were wholly on node 0 at the start of ``c``."""
    on0 = (c.get("start") or {}).get("on_node0")
    return None if on0 is None else sum(1 for x in on0[:n] if x >= 1.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--kernel", default="6.12")
    ap.add_argument("--window-s", type=float, default=2.0)
    ap.add_argument("--mover-gb-s", type=float,
                    help="the mover rate of the second simulation (default: the live daemon's, in trace time)")
    ap.add_argument("--from", dest="from_", help="a replay.json from an earlier guest")
    a = ap.parse_args()
    KEEP.mkdir(parents=True, exist_ok=True)
    py = str(REPO / ".venv" / "bin" / "python")
    subprocess.run([py, "scripts/lab/trace_replay.py", "plan", "--trace", str(trace_path()), "--out", str(KEEP)],
                   check=True, cwd=REPO)
    if a.from_:
        replay = json.loads(Path(a.from_).read_text())
    else:
        with tempfile.TemporaryDirectory(prefix="p5trace-") as tmp:
            script = (f".venv/bin/python scripts/lab/trace_replay.py run --plan {KEEP}/plan.npz --out $LAB_OUT "
                      f"--window-s {a.window_s:g} > $LAB_OUT/replay.out 2>&1\n")
            r = lab_module().run(script, profile="cxl", kernel=a.kernel, timeout_s=3600, out_dir=Path(tmp),
                                 node_mib=NODE_MIB)
            path = Path(tmp) / "replay.json"
            if not path.exists():
                print(f"p5_trace: no replay.json (guest exit {r.rc}): {r.stderr[-2000:]}", file=sys.stderr)
                return 1
            replay = json.loads(path.read_text())
        (KEEP / f"replay-{a.kernel}.json").write_text(json.dumps(replay))
    import numpy as np
    plan = np.load(KEEP / "plan.npz")
    kv, tick, bb = int(plan["kv_bytes_per_token"]), float(plan["tick_ms"]), int(plan["block_bytes"])
    conds = {c["condition"]: c for c in replay["conditions"]}
    first_fit = (conds.get("none", {}).get("start") or {}).get("blocks_on_node0")
    if not first_fit:
        print("p5_trace: the no-tiering run did not start", file=sys.stderr)
        return 1
    # FirstFit admits until its capacity is full (tieringd/simulate/caches.py): at first_fit blocks
    # it holds what first touch left on node 0 (÷ 0.95 here gave it 22 blocks more, 3.6 points)
    capacity = int(first_fit * bb)
    mover_gb_s = a.mover_gb_s or lab_mover_gb_s(conds.get("tieringd", {}), a.window_s, tick)
    sims = [simulate(KEEP / "slice.jsonl", kv, tick, capacity, None),
            simulate(KEEP / "slice.jsonl", kv, tick, capacity, mover_gb_s)]
    rows = []
    for name, c in conds.items():
        live = live_share(c)
        sim = [s.get(SIM_OF.get(name)) if SIM_OF.get(name) else None for s in sims]
        gap = [round(100 * (live - x), 1) if live is not None and x is not None else None for x in sim]
        late = sum(1 for w in c.get("windows", []) if w["late_s"] > 0)
        rows.append([name, live, sim[0] and round(sim[0], 4), gap[0], sim[1] and round(sim[1], 4), gap[1],
                     f"{late}/{len(c.get('windows', []))}", bool((c.get("end") or {}).get("ok"))])
    write_figure({
        "figure": "P5-trace",
        "title": f"Mooncake trace, requests 1–{int(plan['requests'])} ({int(plan['nblocks'])} blocks of 2 MiB), "
                 f"replayed live (one {tick:g} ms tick per {a.window_s:g} s) and simulated at "
                 f"{capacity / 2**20:.0f} MiB of node 0",
        "columns": COLUMNS, "rows": rows,
        "summary": {"release": replay.get("release"), "fast_capacity_bytes": capacity,
                    "first_fit_blocks_on_node0": first_fit, "simulated_lru": [s.get("lru") for s in sims],
                    # of the blocks the simulator's first fit puts on node 0 (the first by first
                    # access), how many first touch left there in the run without tiering
                    "first_fit_blocks_in_order_on_node0": in_order(conds.get("none", {}), first_fit),
                    "lab_mover_gb_s": mover_gb_s},
        "notes": ("Fast-served: accesses (block × tick window) whose block was on node 0 as the window began, "
                  "unweighted — the simulator's definition. The simulator has no model of the kernel's "
                  f"tiering. Lab mover: {mover_gb_s:g} GB/s in trace time."),
    }, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
