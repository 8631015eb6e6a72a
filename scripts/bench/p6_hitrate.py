#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""P6: fast-tier hit rate and fast-served share of tieringd's policy against transparent LRU and
ARC (the same mover and view: docs/simulator.md), the demand caches and Belady's MIN (the bound), at
several DRAM capacities, on a generated Mooncake-format trace — and on a real trace when one is given
(``--trace PATH`` or ``TIERINGD_P6_TRACE``; Mooncake FAST'25 or Bailian JSONL; the public synthetic
one ships with the repository as ``data/traces/mooncake-synthetic.jsonl``, data/traces/README.md).

    python scripts/bench/p6_hitrate.py --json /tmp/p6.json [--requests 1500] [--trace conversation_trace.jsonl]

Writes the hit-rate-vs-capacity PNG next to the JSON (``<json stem>.png``, ``<json stem>-real.png``).
"""
from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import tempfile
import time
from pathlib import Path

import click

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tieringd import simulate  # noqa: E402
from tieringd.placement.blocksize import load_model  # noqa: E402
from tieringd.simulate.report import plot  # noqa: E402

CAPACITIES = (0.05, 0.10, 0.25, 0.50)
POLICIES = ("tieringd", "lru", "arc", "demand-lru", "demand-arc", "first-fit", "belady")


def run_one(path: str, label: str, model: str, limit: int | None, png: Path) -> tuple[list, dict]:
    rm = simulate.RequestModel(kv_bytes_per_token=load_model(model).kv_bytes_per_token)
    t0 = time.monotonic()
    acc = simulate.load_accesses(path, "auto", rm, limit)
    setup = simulate.Setup(fast_capacities=CAPACITIES, policies=POLICIES)
    if sys.stderr.isatty():                 # minutes on a real trace: show where it is
        with click.progressbar(length=len(acc) * len(POLICIES) * len(CAPACITIES), label=f"P6 {label}",
                               file=sys.stderr) as bar:
            results = simulate.run(acc, setup, bar.update)
    else:
        results = simulate.run(acc, setup)
    wall = time.monotonic() - t0
    plot(results, str(png), f"{label}: {acc.description}; {len(acc)} accesses")
    by = {(r.fast_capacity_fraction, r.policy): r for r in results}
    rows = [[label, f"{100 * r.fast_capacity_fraction:.0f}%", r.policy, round(100 * r.hit_rate, 1),
             round(100 * r.fast_served, 1), round(r.migrated_bytes / 2**30, 1), round(r.stall_s, 2)]
            for r in results]
    summary = {}
    for frac in sorted({r.fast_capacity_fraction for r in results}):
        tie, bel = by[(frac, "tieringd")], by[(frac, "belady")]
        lru, arc = by[(frac, "lru")], by[(frac, "arc")]
        key = f"{label}_{100 * frac:.0f}pct"
        summary[f"{key}_hit_over_belady"] = round(tie.hit_rate / bel.hit_rate, 3) if bel.hit_rate else None
        summary[f"{key}_served_over_belady"] = round(tie.fast_served / bel.fast_served, 3) if bel.fast_served else None
        summary[f"{key}_hit_minus_lru_pts"] = round(100 * (tie.hit_rate - lru.hit_rate), 1)
        summary[f"{key}_hit_minus_arc_pts"] = round(100 * (tie.hit_rate - arc.hit_rate), 1)
    summary[f"{label}_accesses"] = len(acc)
    summary[f"{label}_wall_s"] = round(wall, 1)
    return rows, summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", dest="json_out", required=True)
    ap.add_argument("--requests", type=int, default=1500, help="requests in the generated trace")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--trace", default=os.environ.get("TIERINGD_P6_TRACE"), help="a real trace to add")
    ap.add_argument("--limit", type=int, default=None, help="records of the real trace to read")
    args = ap.parse_args()
    out = Path(args.json_out)
    with tempfile.TemporaryDirectory() as tmp:
        gen = Path(tmp) / "mooncake.jsonl"
        sys.argv = ["gen-trace.py", "--format", "mooncake", "--requests", str(args.requests), "--seed",
                    str(args.seed), "-o", str(gen)]
        try:
            runpy.run_path(str(REPO / "scripts" / "gen-trace.py"), run_name="__main__")
        except SystemExit as e:
            if e.code:
                raise
        rows, summary = run_one(str(gen), "generated", args.model, None, out.with_suffix(".png"))
    notes = (f"generated: scripts/gen-trace.py --format mooncake --requests {args.requests} --seed {args.seed}; "
             f"model {args.model}; the simulator's default 250 ms windows; "
             "capacities are fractions of the trace's distinct KV bytes; "
             "hit = the block stayed in DRAM since its previous access (Belady's MIN is the bound); "
             "transparent policies share a 16 GB/s mover and see reads at the end of their window; "
             f"PNG: {out.with_suffix('.png').name}")
    if args.trace:
        r2, s2 = run_one(args.trace, "real", args.model, args.limit, out.with_name(out.stem + "-real.png"))
        rows += r2
        summary.update(s2)
        notes += f"; real trace: {os.path.basename(args.trace)}" + (f" (first {args.limit})" if args.limit else "")
    doc = {"figure": "P6", "title": "Fast-tier hit rate and fast-served share vs Belady and LRU/ARC",
           "columns": ["trace", "DRAM capacity", "policy", "hit rate %", "fast-served %", "migrated GiB",
                       "stall s"],
           "rows": rows, "summary": summary, "notes": notes}
    out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
