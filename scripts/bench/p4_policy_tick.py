#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""P4: one policy tick (heat + plan + moves) on 1M and 10M blocks, on one core; beside it, one tick
of the sharing scan at its default budget.

Targets: ≤ 20 ms for 1M blocks, ≤ 200 ms for 10M, ≤ 64 bytes per block (the block table plus the
policy's reusable scratch buffers). Two states are timed:

- steady: blocks already sit where their heat puts them; each tick 0.1% of the blocks get new
  accesses (the daemon's normal tick);
- cold: placement unrelated to heat (the first tick after a start): the plan is large and only the
  migration budget's worth of it is emitted.

The sharing scan (tieringd/daemon/sharing.py, ``[sharing]`` defaults) runs in the daemon's tick
beside the policy. Its work per tick is its budget, not the table's size: it is timed on the same
table, to which this process adds 256 MiB of its own memory in 2 MiB blocks — a 128 MiB memfd a
forked child maps too (every examined page shared) and a 128 MiB private pool whose second half
repeats its first (every block hashed finds a twin to compare with byte for byte) — with every
block cold, so that both halves of the scan spend their whole budget each tick. The table's other
regions belong to pids no process can have (above the kernel's pid_max): the scan passes over them
as it passes over a process that left.

CPU time (process_time) is reported next to wall time: the build machine is shared.

    python scripts/bench/p4_policy_tick.py --json /tmp/p4.json [--blocks 1000000 --blocks 10000000]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tieringd.contracts import Tier  # noqa: E402
from tieringd.daemon.sharing import SharingConfig, SharingScanner  # noqa: E402
from tieringd.placement.heat import BlockTable  # noqa: E402
from tieringd.placement.plan import TierSpec  # noqa: E402
from tieringd.placement.policy import Policy, PolicyConfig  # noqa: E402

BLOCK_BYTES = 2 << 20
PER_REGION = 4096
NO_SUCH_PID = 1 << 22            # above any pid_max (PID_MAX_LIMIT): no process has these pids
REAL_BYTES = 128 << 20           # of each of the two pools of this process the sharing scan reads
TIERS = (Tier.DRAM, Tier.CXL_DRAM, Tier.PMEM)
SHARE = (0.2, 0.3, 0.5)              # of all block bytes placed on each tier


def build(n: int, rng: np.random.Generator, steady: bool) -> tuple[BlockTable, Policy]:
    t = BlockTable(capacity=n)
    for i in range(n // PER_REGION):
        t.add_region(pid=NO_SUCH_PID + i % 64, start=0x7F00_0000_0000 + i * PER_REGION * BLOCK_BYTES,
                     length=PER_REGION * BLOCK_BYTES, block_bytes=BLOCK_BYTES, node=2, tier=Tier.PMEM,
                     block_tokens=16, sequential=bool(i % 2))
    n = t.n
    t.last_ms[:n] = rng.integers(0, 600_000, n)
    t.freq[:n] = rng.exponential(4.0, n).astype(np.float32)
    t.positional[:n] = rng.random(n, dtype=np.float32)
    t.sharers[:n] = rng.integers(1, 4, n)
    t.refresh_static()
    total = n * BLOCK_BYTES
    specs = [TierSpec(tier, (k,), total * share / 0.9) for k, (tier, share) in enumerate(zip(TIERS, SHARE))]
    tiers = rng.integers(0, 3, n)
    t.set_location(np.arange(n), tiers.astype(np.int16), np.array(TIERS, np.int8)[tiers])
    pol = Policy(PolicyConfig(min_residency_ms=1000), specs)
    if steady:
        # put every block where the plan wants it; the plan ranks a block already on a tier
        # ``hysteresis`` hotter there, so where it wants blocks depends on where they are: repeat
        # until placement is a fixed point (two or three rounds)
        for _ in range(8):
            target = pol.targets(t, 600_000)
            if (target == t.tier[:n]).all():
                break
            t.set_location(np.arange(n), (target - 1).astype(np.int16), target)
    t.moved_ms[:n] = 0
    t.moved_max_ms = 0
    # a sampled signal's lag (heat.SignalLag): blocks re-sampled 1 s late, so every tick subtracts
    # it and clips, as the daemon's do under sparse sampling (0 with every read seen: a cheaper pass)
    t.signal_lag.note(1000, np.array([0]), 0.9)
    return t, pol


def pass_ms(n: int, repeat: int = 7) -> float:
    """CPU time of one streaming pass (``a += b`` over float32): the machine's speed right now, so a tick
    can be read as "about K passes over the table" on any machine, loaded or not."""
    a, b = np.ones(n, np.float32), np.ones(n, np.float32)
    ts = []
    for _ in range(repeat):
        c0 = time.process_time()
        a += b
        ts.append((time.process_time() - c0) * 1e3)
    return statistics.median(ts)


class RealPools:
    """This process's memory for the sharing scan: a memfd a forked child maps too, and a private
    pool whose second half repeats its first."""

    def __init__(self):
        fd = os.memfd_create("p4-shared")
        os.ftruncate(fd, REAL_BYTES)
        self.shared = mmap.mmap(fd, REAL_BYTES, flags=mmap.MAP_SHARED)
        os.close(fd)
        self.shared.write(np.random.default_rng(2).bytes(REAL_BYTES))
        ready, self.done = os.pipe(), os.pipe()
        self.child = os.fork()
        if self.child == 0:              # maps every page, then waits to be told to go
            sum(self.shared[i] for i in range(0, REAL_BYTES, mmap.PAGESIZE))
            os.write(ready[1], b"x")
            os.read(self.done[0], 1)
            os._exit(0)
        os.read(ready[0], 1)
        self.private = mmap.mmap(-1, REAL_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        half = np.random.default_rng(3).bytes(REAL_BYTES // 2)
        self.private.write(half + half)

    def add_to(self, t: BlockTable) -> list[int]:
        """The two pools as regions of ``t``; returns their region ids."""
        return [t.add_region(pid=os.getpid(), start=ctypes.addressof(ctypes.c_char.from_buffer(m)),
                             length=REAL_BYTES, block_bytes=BLOCK_BYTES, node=0, tier=Tier.DRAM)
                for m in (self.shared, self.private)]

    def close(self) -> None:
        os.write(self.done[1], b"x")
        os.waitpid(self.child, 0)


def sharing_scan(t: BlockTable, pools: RealPools, ticks: int) -> dict:
    """CPU ms of sharing-scan ticks at the default budget, once every real block has been seen and
    hashed: each tick then re-confirms blocks against their twins, the dearest path (a clock an hour
    ahead per tick makes every block cold; the work itself is real)."""
    real = pools.add_to(t)
    clock = [time.monotonic()]
    scan = SharingScanner(SharingConfig(), t, clock=lambda: clock[0])
    cfg = scan.cfg
    # every real block seen, then hashed and its twin found: the first content pass ends before
    # the page scan has seen a block (none is cold yet), the second hashes them all
    while scan.content_passes < 2 or scan.passes < 1:
        scan.tick()
        clock[0] += 3600
    cpus, walls, pages, read = [], [], [], []
    for _ in range(ticks):
        clock[0] += 3600
        before, was_read = scan.pages_examined, scan.pages_read
        w0, c0 = time.perf_counter(), time.process_time()
        scan.tick()
        walls.append((time.perf_counter() - w0) * 1e3)
        cpus.append((time.process_time() - c0) * 1e3)
        pages.append(scan.pages_examined - before)
        read.append(scan.pages_read - was_read)
    st = scan.status()
    return {"sharing_scan_ms": statistics.median(cpus), "sharing_scan_ms_max": max(cpus),
            "sharing_scan_wall_ms": statistics.median(walls),
            "sharing_pages_per_tick": statistics.median(pages), "sharing_pages_read_per_tick": statistics.median(read),
            "sharing_budget": {"pages_per_tick": cfg.pages_per_tick, "hash_pages_per_tick": cfg.hash_pages_per_tick},
            "sharing_found": {"real_blocks_shared": int(sum(np.count_nonzero(t.sharers[t.region_slice(r)] > 1)
                                                            for r in real)),
                              **{k: st[k] for k in ("identical_blocks", "regions_left", "passes",
                                                    "content_passes")}},
            "sharing_bytes_per_block": scan.nbytes / t.n}


def measure(n: int, state: str, repeat: int, seed: int, pools: RealPools | None = None) -> dict:
    rng = np.random.default_rng(seed)
    t, pol = build(n, rng, state == "steady")
    now = 600_000
    pol.tick(t, now_ms=now)                     # first tick: allocates the scratch buffers
    walls, cpus, phases, moves = [], [], [], []
    for _ in range(repeat):
        now += 100
        k = n // 1000
        t.ingest_blocks(rng.integers(0, n, k), np.ones(k), now)
        w0, c0 = time.perf_counter(), time.process_time()
        plan = pol.tick(t, now_ms=now)
        walls.append((time.perf_counter() - w0) * 1e3)
        cpus.append((time.process_time() - c0) * 1e3)
        phases.append(dict(pol.timings_ms))
        moves.append(plan.total_moved_bytes)
    tracemalloc.start()
    pol.tick(t, now_ms=now + 100)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    best = int(np.argmin(cpus))
    one_pass = pass_ms(t.n)
    sharing = sharing_scan(t, pools, max(repeat, 32)) if pools is not None else {}
    return {**sharing, "blocks": t.n, "state": state, "pass_ms": one_pass,
            "tick_in_passes": statistics.median(cpus) / one_pass, "wall_ms_median": statistics.median(walls),
            "cpu_ms_median": statistics.median(cpus), "cpu_ms_min": min(cpus),
            "table_bytes_per_block": t.nbytes / t.n, "scratch_bytes_per_block": pol.scratch_bytes / t.n,
            "tick_peak_temp_bytes_per_block": peak / t.n,
            "moved_mib_per_tick": statistics.median(moves) / (1 << 20),
            "phases_cpu_ms": {k: round(v, 2) for k, v in phases[best].items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", dest="json_out", required=True)
    ap.add_argument("--blocks", type=int, action="append", default=[])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cpu", type=int, default=None, help="CPU to pin to (default: the last one)")
    args = ap.parse_args()
    cpu = args.cpu if args.cpu is not None else max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    sizes = args.blocks or [1_000_000, 10_000_000]
    results = []
    pools = RealPools()
    try:
        for n in sizes:
            for state in ("steady", "cold"):
                r = measure(n, state, args.repeat, args.seed, pools if state == "steady" else None)
                results.append(r)
                print(f"p4: {n} blocks {state}: cpu {r['cpu_ms_median']:.1f} ms (min {r['cpu_ms_min']:.1f}) "
                      f"= {r['tick_in_passes']:.0f} float32 passes of {r['pass_ms']:.2f} ms, "
                      f"wall {r['wall_ms_median']:.1f} ms, {r['table_bytes_per_block'] + r['scratch_bytes_per_block']:.1f} "
                      f"B/block; phases {r['phases_cpu_ms']}", file=sys.stderr)
                if "sharing_scan_ms" in r:
                    print(f"p4: {n} blocks, sharing scan at its default budget: cpu {r['sharing_scan_ms']:.2f} ms "
                          f"(max {r['sharing_scan_ms_max']:.2f}), wall {r['sharing_scan_wall_ms']:.2f} ms, "
                          f"{r['sharing_pages_per_tick']:.0f} pages examined, {r['sharing_pages_read_per_tick']:.0f} "
                          f"read per tick; {r['sharing_bytes_per_block']:.1f} B/block; found {r['sharing_found']}",
                          file=sys.stderr)
    finally:
        pools.close()
    target = {1_000_000: 20.0, 10_000_000: 200.0}
    rows = [[r["blocks"], r["state"], round(r["cpu_ms_median"], 1), round(r["cpu_ms_min"], 1),
             round(r["wall_ms_median"], 1), target.get(round(r["blocks"], -6)),
             round(r["table_bytes_per_block"] + r["scratch_bytes_per_block"], 1),
             round(r["tick_peak_temp_bytes_per_block"], 1), round(r["moved_mib_per_tick"]),
             round(r["pass_ms"], 2), round(r["tick_in_passes"]),
             round(r["sharing_scan_ms"], 2) if "sharing_scan_ms" in r else None] for r in results]
    steady = {r["blocks"]: r for r in results if r["state"] == "steady"}
    summary = {f"steady_{n}_cpu_ms": round(r["cpu_ms_median"], 1) for n, r in steady.items()}
    summary.update({f"steady_{n}_sharing_scan_ms": round(r["sharing_scan_ms"], 2) for n, r in steady.items()})
    summary["bytes_per_block"] = round(max(r["table_bytes_per_block"] + r["scratch_bytes_per_block"]
                                           for r in results), 1)
    summary["targets"] = "1M ≤ 20 ms, 10M ≤ 200 ms, ≤ 64 B/block"
    summary["load_average_1m"] = round(os.getloadavg()[0], 1)
    doc = {"figure": "P4", "title": "One policy tick (heat, plan, moves) on one core",
           "columns": ["blocks", "state", "cpu ms (median)", "cpu ms (min)", "wall ms (median)", "target ms",
                       "bytes/block (table + scratch)", "tick temp bytes/block (peak)", "moved MiB",
                       "one float32 pass ms", "tick in passes", "sharing scan cpu ms (median)"],
           "rows": rows, "summary": summary,
           "notes": f"pinned to CPU {cpu}; {args.repeat} ticks each; 2 MiB blocks in 3 tiers "
                    "(20/30/50% of the bytes); migration budget 256 MiB/tick; phases per tick: "
                    + "; ".join(f"{r['blocks']} {r['state']}: {r['phases_cpu_ms']}" for r in results)
                    + ". Sharing scan ([sharing] defaults: "
                    + ", ".join(f"{k} {v}" for k, v in results[0].get("sharing_budget", {}).items())
                    + ") over 256 MiB of this process's memory in the steady table: per tick "
                    + "; ".join(f"{r['blocks']}: {r['sharing_pages_per_tick']:.0f} pages examined, "
                                f"{r['sharing_pages_read_per_tick']:.0f} read, max {r['sharing_scan_ms_max']:.2f} ms, "
                                f"{r['sharing_bytes_per_block']:.1f} B/block of its own"
                                for r in results if "sharing_scan_ms" in r),
           "sharing": {str(r["blocks"]): {k: v for k, v in r.items() if k.startswith("sharing")}
                       for r in results if "sharing_scan_ms" in r}}
    Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
