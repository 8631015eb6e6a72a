#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""P6-scale: what the simulator costs on long coding-agent traces — peak resident memory and wall time
of ``tieringctl simulate`` for tieringd, transparent LRU and ARC and Belady's MIN at 5 % and 10 % of
DRAM, on a generated agent trace the size of a real one (``scripts/gen-trace.py --shape agent
--requests 8621``: about 2.1 M block references, 3.7 M output tokens, 100 M accesses) and on the same
workload run 2× and 4× as long (more sessions at the same rate).

Targets: time grows linearly with the trace's length, memory does not (it holds the blocks and a window
of accesses; the accesses wait on disk, in the spool: about 28 bytes each); the 1× trace within 4 GiB of
resident memory and 10 minutes on the 2-core build machine. Each size runs in a fresh ``tieringctl
simulate --jobs 2`` (the runs shared out between two processes), one size after another; its peak RSS
is that of the process and its workers together, sampled every 0.2 s; CPU time (all of them) is
reported beside wall time: the build machine is shared.

    python scripts/bench/p6_scale.py --json /tmp/p6_scale.json [--scales 1 2 4] [--seed 1]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _figure import write_figure  # noqa: E402

REQUESTS = 8621                      # the real coding-agent trace's
POLICIES = ("tieringd", "lru", "arc", "belady")
CAPACITIES = ("5%", "10%")
RSS_LIMIT_MIB = 4096
WALL_LIMIT_S = 600


def tree_rss(proc: psutil.Process) -> int:
    """Resident bytes of a process and its children (the simulation's worker processes)."""
    total = 0
    for p in [proc] + proc.children(recursive=True):
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def simulate(trace: Path, spool_dir: str, jobs: int) -> tuple[dict, float, float, float]:
    """One ``tieringctl simulate`` in a fresh process: (its JSON, wall s, CPU s of it and its workers,
    peak resident MiB of it and its workers together, sampled every 0.2 s)."""
    cmd = [sys.executable, "-c", "from tieringd.cli import main; main()", "simulate", str(trace), "--json",
           "--no-progress", "--spool-dir", spool_dir, "--jobs", str(jobs)]
    for p in POLICIES:
        cmd += ["--policy", p]
    for c in CAPACITIES:
        cmd += ["--fast-capacity", c]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t0 = time.monotonic()
    cpu0 = os.times()
    peak = 0
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, stdout=out, env=env, cwd=REPO)
        watched = psutil.Process(proc.pid)
        while proc.poll() is None:
            peak = max(peak, tree_rss(watched))
            time.sleep(0.2)
        wall = time.monotonic() - t0
        if proc.returncode != 0:
            raise SystemExit(f"p6_scale: {' '.join(cmd)} failed")
        out.seek(0)
        doc = json.loads(out.read())
    cpu1 = os.times()
    return doc, wall, (cpu1.children_user - cpu0.children_user) + (cpu1.children_system - cpu0.children_system), \
        peak / 2**20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", dest="json_out", default=None)
    ap.add_argument("--scales", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=2, help="simulation processes (the build machine has 2 cores)")
    args = ap.parse_args()
    rows, by_scale = [], {}
    with tempfile.TemporaryDirectory(prefix="p6-scale-") as tmp:
        for scale in args.scales:
            trace = Path(tmp) / f"agent-{scale}x.jsonl"
            subprocess.run([sys.executable, str(REPO / "scripts" / "gen-trace.py"), "--shape", "agent", "--requests",
                            str(REQUESTS * scale), "--seed", str(args.seed), "-o", str(trace)], check=True)
            doc, wall, cpu, rss = simulate(trace, tmp, args.jobs)
            hits = {(r["policy"], round(100 * r["fast_capacity_fraction"])): r["hit_rate"] for r in doc["results"]}
            by_scale[scale] = (doc["accesses"], wall, cpu, rss)
            rows.append([f"{scale}×", REQUESTS * scale, doc["accesses"], doc["blocks"], round(wall, 1), round(cpu, 1),
                         round(rss), round(rss * 2**20 / doc["blocks"])] +
                        [round(100 * hits[(p, c)], 2) for c in (5, 10) for p in POLICIES])
            trace.unlink()
    summary = {}
    if 1 in by_scale:
        acc1, wall1, cpu1, rss1 = by_scale[1]
        summary.update({"1x_wall_s": round(wall1, 1), "1x_peak_rss_mib": round(rss1),
                        "1x_within_limits": wall1 <= WALL_LIMIT_S and rss1 <= RSS_LIMIT_MIB})
        for scale, (acc, wall, cpu, rss) in by_scale.items():
            if scale != 1:
                summary[f"{scale}x_over_1x_cpu_per_access"] = round((cpu / acc) / (cpu1 / acc1), 2)
                summary[f"{scale}x_over_1x_peak_rss"] = round(rss / rss1, 2)
    fig = {"figure": "P6-scale", "title": "Simulator cost on coding-agent traces: peak RSS and time against length",
           "columns": ["length", "requests", "accesses", "blocks", "wall s", "CPU s", "peak RSS MiB", "RSS B/block"] +
                      [f"{p} {c}% hit %" for c in (5, 10) for p in POLICIES],
           "rows": rows, "summary": summary,
           "notes": (f"scripts/gen-trace.py --shape agent --requests {REQUESTS}×N --seed {args.seed}; tieringctl "
                     f"simulate with {', '.join(POLICIES)} at {' and '.join(CAPACITIES)} of DRAM, side by side in "
                     f"one pass, {args.jobs} processes per size; targets: 1× within {RSS_LIMIT_MIB} MiB and "
                     f"{WALL_LIMIT_S} s, CPU per access flat, peak RSS flat but for the blocks (RSS B/block)")}
    write_figure(fig, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
