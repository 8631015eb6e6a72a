#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""P5: the closed loop — tieringd keeps the unmodified KV workload's hot blocks on node 0.

In the sized lab (scripts/lab.py, profile cxl, DRAM nodes 1 GiB: node0 with the CPUs, node1 CPU-less),
one guest per kernel: tieringd, then ``build/tests/kv_workload`` (1.2 GiB pool, more than node0
holds) under ``tieringctl run`` for --seconds, --runs times per layout (scattered: the hot set starts
spread over the pool as first touch left it; front: it starts on node 0). Per run: the mean share of
touched blocks on node 0 over the second half (and its minimum over the reports), bytes intact,
bytes promoted/demoted, failed pages by reason, ticks, overruns and their p50/p99, the daemon's CPU
seconds. With --baseline, one more guest per kernel runs the workload without the daemon (no
tiering), side by side in the same invocation. Targets (issue 13): mean ≥ 0.98, minimum over the runs
≥ 0.95 on 6.12 and 7.3, every run intact, never below no tiering.

    python scripts/bench/p5_loop.py --json build/bench/p5_loop.json [--kernel 6.12 --kernel 7.3]
        [--runs 3] [--seconds 80] [--baseline] [--from DIR/loop.json ...]

``--from`` re-renders figures from loop.json files of earlier guests instead of booting.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lab"))
sys.path.insert(0, str(Path(__file__).resolve().parent))       # imported by tests, not only run

from _figure import write_figure  # noqa: E402
from loop_report import boot_loop, run_row  # noqa: E402

COLUMNS = ["kernel", "daemon", "layout", "run", "share 2nd half", "min", "intact", "promoted MiB",
           "demoted MiB", "failed pages", "ticks", "overruns", "tick p50 ms", "tick p99 ms", "daemon CPU s",
           "exit→removed s"]


def rows_of(loop: dict, kernel: str) -> list[list]:
    daemon = "none" if loop.get("daemon_ready_s") is None else "tieringd"
    out = []
    for run in loop["runs"]:
        r = run_row(run)
        out.append([kernel, daemon, r["layout"], r["run"], r["share_mean_2nd_half"], r["share_min_2nd_half"],
                    r["bytes_intact"], r["promoted_mib"], r["demoted_mib"],
                    ", ".join(f"{k} {v}" for k, v in r["failed_pages"].items()) or "0",
                    r["ticks"], r["overruns"], r["tick_p50_ms"], r["tick_p99_ms"], r["daemon_cpu_s"],
                    r["exit_to_removed_s"]])
    return out


def summarise(rows: list[list]) -> dict:
    """Per kernel, daemon and layout: the mean over runs of the second-half share, the minimum of the
    runs' means, and whether every run was intact."""
    out = {}
    for key in dict.fromkeys((r[0], r[1], r[2]) for r in rows):
        sel = [r for r in rows if (r[0], r[1], r[2]) == key]
        shares = [r[4] for r in sel if r[4] is not None]
        out["/".join(key)] = {"runs": len(sel), "mean": round(statistics.mean(shares), 3) if shares else None,
                              "min_run": round(min(shares), 3) if shares else None,
                              "intact": all(r[6] for r in sel)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figure here")
    ap.add_argument("--kernel", action="append", help="lab kernels (default 6.12, 7.3, 6.1)")
    ap.add_argument("--runs", type=int, default=3, help="runs per layout (6.1: one)")
    ap.add_argument("--seconds", type=float, default=80)
    ap.add_argument("--baseline", action="store_true", help="also one guest per kernel without the daemon")
    ap.add_argument("--from", dest="from_", action="append", default=[], metavar="LOOP_JSON")
    args = ap.parse_args()
    loops: list[tuple[str, dict]] = []
    if args.from_:
        for p in args.from_:
            d = json.loads(Path(p).read_text())
            loops.append((d.get("lab", {}).get("kernel") or d["release"], d))
    else:
        for kernel in args.kernel or ["6.12", "7.3", "6.1"]:
            runs = 1 if kernel == "6.1" else args.runs
            for no_daemon in ((False, True) if args.baseline else (False,)):
                with tempfile.TemporaryDirectory(prefix=f"p5-{kernel}-") as tmp:
                    loops.append((kernel, boot_loop(kernel, seconds=args.seconds, runs=runs,
                                                    layouts=("scattered", "front"), out_dir=Path(tmp),
                                                    no_daemon=no_daemon)))
    rows = [row for kernel, loop in loops for row in rows_of(loop, kernel)]
    releases = sorted({loop["release"] for _, loop in loops})
    fig = {
        "figure": "P5",
        "title": f"Closed loop: node-0 share of the KV workload's touched blocks, {args.seconds:g} s runs "
                 "(lab cxl, DRAM nodes 1 GiB, 1.2 GiB pool)",
        "columns": COLUMNS, "rows": rows, "summary": summarise(rows),
        "notes": ("Measured in QEMU/TCG guests (scripts/lab.py): shares, bytes and ratios are meaningful, "
                  "absolute times and CPU seconds are not (docs/lab.md). Kernels: " + ", ".join(releases) +
                  ". Ticks and overruns are those during the run; tick p50/p99 are over the daemon's "
                  "recent ticks (ticks.WINDOW) at the run's end. Targets: mean ≥ 0.98, min ≥ 0.95."),
    }
    write_figure(fig, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
