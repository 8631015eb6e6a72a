#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Figure P3: what the samplers cost. A workload's throughput with all samplers off vs on, side by side
in one run (runs interleaved off/on so drift hits both), plus the samplers' event rate and CPU share.

    python scripts/bench/p3_sampling.py --json build/bench/p3_sampling.json [--seconds 3] [--reps 3]

Workloads (tests/progs, built by make):
- ``stream``: tests/progs/stream_sum — a 256 MiB buffer summed over and over: memory-bound, no faults
  once populated (the KV-cache read pattern). Target: on/off ≥ 0.99.
- ``faults``: tests/progs/skewed_touch --repeat — one page fault per touch (MADV_DONTNEED + write),
  the worst case for the fault and PMU (software page-fault event) samplers. Reported, no target.

"On" = the fault sampler, the PMU sampler (software page-fault event: this machine has no PMU) and the
DMA-copy sampler loaded (for the fault workload also fault + DMA only, what a VM runs), the workload's pid tracked at all addresses (2 MiB blocks), and this process
reading deltas every 100 ms as the daemon would. CPU share: this process's CPU time (user + system)
over wall time, and the BPF programs' own run time (kernel.bpf_stats_enabled, from bpftool) over
wall time; events/s: program invocations (all processes) and samples counted for the workload.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tieringd.sampling import TrackedSet, open_samplers  # noqa: E402

PROGS = REPO / "build" / "tests"
INTERVAL_S = 0.1
PROG_NAMES = {"page_fault_user", "page_fault_kernel", "pmu_sample", "cuda_memcpy", "cu_memcpy_htod",
              "cu_memcpy_dtoh"}


def workload_cmd(name: str, seconds: float) -> list[str]:
    if name == "stream":
        return [str(PROGS / "stream_sum"), "--wait", "--mib", "256", "--seconds", str(seconds)]
    return [str(PROGS / "skewed_touch"), "--wait", "--repeat", "--seconds", str(seconds),
            "--touches", "256", "--blocks", "16"]


def throughput(name: str, last: dict) -> float:
    if name == "stream":
        return last["gb_s"]
    return last["rounds"] / last["seconds_run"]


def bpf_run_time_ns() -> int:
    """Sum of run_time_ns of our programs (needs kernel.bpf_stats_enabled=1)."""
    try:
        out = subprocess.run(["bpftool", "-j", "prog", "show"], capture_output=True, text=True,
                             timeout=10).stdout
        return sum(p.get("run_time_ns", 0) for p in json.loads(out) if p.get("name") in PROG_NAMES)
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0


ALL = ("fault", "pmu", "dma")


def run_once(name: str, seconds: float, sampling: bool, sources: tuple = ALL) -> dict:
    p = subprocess.Popen(workload_cmd(name, seconds), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    info = json.loads(p.stdout.readline())
    tracked, sset = TrackedSet(), None
    counted = events = 0
    if sampling:
        tracked.add_process(info["pid"], all_addresses=True)
        sset = open_samplers(tracked, sources=sources, fallback="none",
                             pmu_event="software-page-faults", migrations=False)
        if len(sset.samplers) != len(sources):
            raise SystemExit(f"p3: samplers unavailable: {sset.unavailable}")
    ru0, bpf0, t0 = resource.getrusage(resource.RUSAGE_SELF), bpf_run_time_ns(), time.monotonic()
    p.stdin.write("go\n")
    p.stdin.flush()
    t_start = time.monotonic()
    done = threading.Event()
    lines: list[str] = []

    def reader():
        for line in p.stdout:
            lines.append(line)
            if '"done"' in line:
                done.set()
                return
        done.set()

    threading.Thread(target=reader, daemon=True).start()
    while not done.wait(INTERVAL_S):
        if sset:
            counted += int(sset.read_deltas()["count"].sum())
    wall = time.monotonic() - t0
    ru1, bpf1 = resource.getrusage(resource.RUSAGE_SELF), bpf_run_time_ns()
    last = json.loads(lines[-1])
    last["seconds_run"] = last.get("seconds", time.monotonic() - t_start)
    try:                                   # skewed_touch --wait waits for a last line before exiting
        p.stdin.write("bye\n")
        p.stdin.flush()
    except BrokenPipeError:
        pass
    p.wait(10)
    if sset:
        counted += int(sset.read_deltas()["count"].sum())
        events = sum(s.get("events", 0) for s in sset.stats().values())
        sset.close()
    tracked.close()
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    return {"throughput": throughput(name, last), "wall_s": wall, "events": events,
            "counted": counted, "daemon_cpu_s": cpu if sampling else 0.0,
            "bpf_cpu_s": (bpf1 - bpf0) / 1e9 if sampling else 0.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("p3: needs root (BPF)", file=sys.stderr)
        return 2
    for prog in ("stream_sum", "skewed_touch"):
        if not (PROGS / prog).exists():
            print(f"p3: build/tests/{prog} is not built (make)", file=sys.stderr)
            return 2
    stats_path = "/proc/sys/kernel/bpf_stats_enabled"
    old_stats = Path(stats_path).read_text().strip()
    Path(stats_path).write_text("1")
    rows, summary = [], {}
    try:
        for name, unit, sources in (("stream", "GB/s", ALL), ("faults", "rounds/s", ALL),
                                    ("faults", "rounds/s", ("fault", "dma"))):
            off, on = [], []
            for _ in range(args.reps):           # interleaved: off, on, off, on, …
                off.append(run_once(name, args.seconds, False))
                on.append(run_once(name, args.seconds, True, sources))
            t_off = statistics.median(r["throughput"] for r in off)
            t_on = statistics.median(r["throughput"] for r in on)
            wall = sum(r["wall_s"] for r in on)
            ev_s = sum(r["events"] for r in on) / wall
            counted_s = sum(r["counted"] for r in on) / wall
            daemon = sum(r["daemon_cpu_s"] for r in on) / wall
            bpf = sum(r["bpf_cpu_s"] for r in on) / wall
            ratio = t_on / t_off
            rows.append([name, "+".join(sources), unit, round(t_off, 3), round(t_on, 3), round(ratio, 4), round(ev_s),
                         round(counted_s), round(100 * daemon, 2), round(100 * bpf, 3)])
            summary[f"{name}_{'_'.join(sources)}_on_off_ratio"] = round(ratio, 4)
        summary["stream_target"] = ">= 0.99"
        summary["stream_meets_target"] = summary["stream_fault_pmu_dma_on_off_ratio"] >= 0.99
    finally:
        Path(stats_path).write_text(old_stats)
    fig = {"figure": "P3", "title": "Sampler overhead: throughput with samplers off vs on",
           "columns": ["workload", "samplers on", "unit", "off", "on", "on/off", "events/s", "counted/s",
                       "daemon CPU %", "BPF CPU %"],
           "rows": rows, "summary": summary,
           "notes": (f"Median of {args.reps} interleaved {args.seconds:.0f}-s runs each. pmu = the "
                     "software page-fault event (no PMU here), so with fault+pmu every fault runs two "
                     "programs; fault+dma is what a VM runs. Workload tracked at all addresses "
                     "in 2 MiB blocks, deltas read every 100 ms. events/s = BPF program invocations "
                     "(every process's faults); counted/s = samples kept for the workload. Daemon CPU "
                     "= this process's CPU time / wall; BPF CPU = programs' run_time_ns / wall "
                     "(kernel.bpf_stats_enabled). Kernel " + os.uname().release + f", load average "
                     f"{os.getloadavg()[0]:.1f} at the end (shared machine: figures are noisy).")}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(fig, indent=2) + "\n")
    print(json.dumps(fig, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
