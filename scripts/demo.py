#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""``make demo``: tieringd keeps an unmodified KV workload's hot blocks on the fast tier.

Boots the lab (scripts/lab.py: QEMU, profile cxl with DRAM nodes of 1 GiB — node0 with the CPUs,
node1 CPU-less like a CXL expander — kernel 6.12), starts ``tieringd`` in it, and runs the project's
KV workload (``build/tests/kv_workload``: a 1.2 GiB pool, more than node0 holds, whose hot set first
touch scattered over both nodes) unmodified under ``tieringctl run``. Prints the tiers, the share of
the blocks the workload touched that sat on node 0 every 4 s with what the daemon had moved by then,
bytes migrated each way, the daemon's CPU time, and where the PNG and the logs are.

    python scripts/demo.py [--kernel 6.12] [--seconds 60] [--layout scattered] [--out build/demo]
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "lab"))

from loop_report import NODE_MIB, REPO, ascii_timeline, boot_loop, plot, run_row  # noqa: E402

GIB = 2 ** 30


def tiers_table(status: dict | None) -> str:
    """The daemon's tiers: capacity, what the workload's blocks hold on each, what else is there."""
    if not status:
        return "  (no daemon status)"
    lines = [f"  {'tier':<9} {'nodes':<6} {'capacity':>9} {'KV blocks':>10} {'other':>8}"]
    nodes = status.get("nodes") or {}
    for t in status.get("tiers") or []:
        kv = sum((nodes.get(str(n)) or {}).get("table_bytes", 0) for n in t["nodes"])
        lines.append(f"  {t['tier']:<9} {','.join(map(str, t['nodes'])):<6} "
                     f"{t['capacity_bytes'] / GIB:7.2f} G {kv / GIB:8.2f} G {t['other_bytes'] / GIB:6.2f} G")
    return "\n".join(lines)


def pool_pages(msg: dict | None) -> str:
    pages = (msg or {}).get("pool_pages") or {}
    total = sum(pages.values()) or 1
    return ", ".join(f"node{n} {100 * v / total:.0f} %" for n, v in sorted(pages.items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", default="6.12")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--layout", default="scattered", choices=("scattered", "front"))
    ap.add_argument("--out", default=str(REPO / "build" / "demo"))
    args = ap.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    print(f"demo: booting the lab (QEMU/TCG, cxl profile, node0 {NODE_MIB} MiB DRAM + CPUs, node1 "
          f"{NODE_MIB} MiB CPU-less, Linux {args.kernel}); tieringd, then kv_workload --layout "
          f"{args.layout} for {args.seconds:g} s under `tieringctl run`. Under emulation this takes "
          f"a few minutes (2-3 on an idle 2-core host).", flush=True)
    t0 = time.monotonic()
    try:
        loop = boot_loop(args.kernel, seconds=args.seconds, runs=1, layouts=(args.layout,), out_dir=out,
                         before=".venv/bin/tieringctl tiers > $LAB_OUT/tiers.txt 2>&1\n")
    except RuntimeError as e:
        print(f"demo: {e}", file=sys.stderr)
        return 1
    run = loop["runs"][0]
    row = run_row(run)
    first = run["timeline"][1]["daemon"] if len(run.get("timeline", [])) > 1 else run.get("daemon_before")
    print(f"\nguest: Linux {loop['release']}; `tieringctl tiers` in it:")
    tiers = out / "tiers.txt"
    print("  " + (tiers.read_text().strip() if tiers.exists() else "(none)").replace("\n", "\n  "))
    print(f"\ntieringd answered {loop.get('daemon_ready_s')} s after it started; "
          f"{(run.get('daemon_after') or {}).get('signal_text', '')}")
    print(f"\nkv_workload (pid {run['start']['pid']}): {run['start']['pool_bytes'] / GIB:.2f} GiB pool of "
          f"{run['start']['blocks']} blocks of {run['start']['block_bytes'] >> 20} MiB; first touch put its "
          f"pages {pool_pages(run['start'])}")
    print("\ntiers as the daemon saw them at the first report:")
    print(tiers_table(first))
    print("\nshare of the blocks the workload touched in each 4 s period that were on node 0:")
    print(ascii_timeline(run))
    print("\ntiers at the end of the run:")
    print(tiers_table(run.get("timeline", [{}])[-1].get("daemon")))
    print(f"\nnode0 share: first period {row['share_first']:.3f} (where first touch left the hot set), "
          f"second half of the run {row['share_mean_2nd_half']:.3f} (min {row['share_min_2nd_half']:.3f})")
    failed = ", ".join(f"{k} {v}" for k, v in row["failed_pages"].items()) or "none"
    print(f"migrated: {row['promoted_mib']:.0f} MiB promoted to node 0, {row['demoted_mib']:.0f} MiB "
          f"demoted to node 1; failed pages: {failed}")
    print(f"daemon: {row['daemon_cpu_s']} CPU s during the run, {row['ticks']} ticks "
          f"(p50 {row['tick_p50_ms']} ms, p99 {row['tick_p99_ms']} ms under emulation), "
          f"the workload's regions left its tables {row['exit_to_removed_s']} s after it exited")
    intact = "every byte intact" if row["bytes_intact"] else "BYTES NOT INTACT"
    print(f"workload: {intact} ({(run.get('end') or {}).get('verified_bytes', 0) / GIB:.2f} GiB verified)")
    back = loop.get("settings_after") == loop.get("settings_before")
    print(f"kernel settings the daemon borrowed: {'put back' if back else 'NOT put back'} after it stopped")
    png = out / "node0_share.png"
    try:
        plot([(f"tieringd, {args.layout}", run)], png,
             f"kv_workload under tieringd, lab cxl {NODE_MIB} MiB nodes, Linux {loop['release']}")
        print(f"\nPNG: {png}")
    except ImportError:
        print("\n(no PNG: matplotlib is not installed)")
    print(f"logs: {out / 'daemon.log'}, {out / 'loop.json'} (everything measured), {out / 'kv_loop.out'}")
    print(f"demo: done in {time.monotonic() - t0:.0f} s")
    return 0 if row["bytes_intact"] and back else 1


if __name__ == "__main__":
    sys.exit(main())
