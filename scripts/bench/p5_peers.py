#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""P5 peers: the closed loop's workload under what a user would run instead of tieringd, side by side.

The same sized lab and workload as P5 (scripts/bench/p5_loop.py: profile cxl, DRAM nodes 1 GiB,
``kv_workload`` with a 1.2 GiB pool under ``tieringctl run``, scattered and front first touch), one
guest per kernel and peer (scripts/lab/peers.py):

    none           no tiering (NUMA balancing off, reclaim-time demotion off)
    kernel         NUMA balancing mode 2 + demotion_enabled, promotion rate limit at its default
    kernel-tuned   the same, promotion rate limit --promote-rate MB/s
    damon          DAMOS migrate_hot / migrate_cold, the kernel's tiering recipe (samples/damon/mtier.c)
    memtierd       intel/memtierd's heat policy, when it can be built and run; else the reason
    tieringd       the daemon, as in P5

One table: per kernel, layout and peer, the node-0 share of the touched blocks over the second half
(mean over the runs and the lowest run), MiB promoted to node 0 and demoted from it (the kernel's
counters: vmstat ``pgpromote_success`` / ``pgdemote_*``, DAMOS ``sz_applied``; tieringd's mover), CPU
seconds of the tiering agent per run (tieringd; kdamonds + kswapd/kcompactd; kswapd/kcompactd for
the kernel — its hint faults and scans are charged to the workload, whose system time is a column
of its own), and whether every byte was intact. Default: 1 run per layout on 6.12 and 7.3 (about
an hour); ``--runs 3`` is the full table.

    python scripts/bench/p5_peers.py --json build/bench/p5_peers.json [--kernel 6.12 --kernel 7.3]
        [--runs 1] [--seconds 80] [--peer NAME ...] [--promote-rate 16] [--keep DIR] [--from DIR]

``--keep DIR`` (default build/bench/p5_peers/) keeps each guest's loop.json as KERNEL-PEER.json;
``--from DIR`` re-renders the table from such a folder instead of booting.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lab"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _figure import write_figure  # noqa: E402
from loop_report import REPO, boot_loop, lab_module, run_row  # noqa: E402

PEERS = ("none", "kernel", "kernel-tuned", "damon", "memtierd", "tieringd")
MIB = 2 ** 20
COLUMNS = ["kernel", "layout", "peer", "runs", "share 2nd half (mean)", "lowest run", "promoted MiB",
           "demoted MiB", "agent CPU s", "workload sys s", "intact"]
RUN_COLUMNS = ["kernel", "layout", "peer", "run", "share 2nd half", "min report", "promoted MiB",
               "demoted MiB", "agent CPU s", "workload sys s", "decode steps", "intact"]
MEMTIERD_MODULE = "github.com/intel/memtierd/cmd/memtierd@latest"


def memtierd_status(kernels: list[str]) -> tuple[str | None, str]:
    """(binary, "") when memtierd is built and can run its heat policy in these guests; else
    (None, why). Built with the Go toolchain the machine has, from its Go module, into .cache/peers."""
    gobin = REPO / ".cache" / "peers" / "bin"
    binary = gobin / "memtierd"
    if not binary.exists():
        go = shutil.which("go")
        if not go:
            return None, "no Go toolchain: `go` not found (Debian: golang-go)"
        env = dict(os.environ, GOBIN=str(gobin), GOPATH=str(REPO / ".cache" / "peers" / "go"),
                   GOFLAGS="-modcacherw")
        try:
            p = subprocess.run([go, "install", MEMTIERD_MODULE], env=env, capture_output=True,
                               text=True, timeout=600)
        except subprocess.TimeoutExpired:
            return None, f"`go install {MEMTIERD_MODULE}` still running after 600 s"
        if p.returncode != 0 or not binary.exists():
            last = (p.stderr.strip().splitlines() or ["no output"])[-1]
            return None, f"`go install {MEMTIERD_MODULE}` failed: {last}"
    # memtierd's heat policy reads accesses through a tracker: idlepage (page_idle bitmap), damon
    # (through bpftrace) or softdirty (writes only: a KV cache is mostly read)
    lacking = [k for k in kernels if "CONFIG_IDLE_PAGE_TRACKING=y" not in _kernel_config(k)]
    if lacking:
        return None, (f"built, but its heat policy's idlepage tracker needs CONFIG_IDLE_PAGE_TRACKING, "
                      f"which the lab's Debian kernels {', '.join(lacking)} leave unset (the softdirty "
                      "tracker sees writes only; a decode step reads the KV cache)")
    return str(binary), ""


def _kernel_config(kernel: str) -> str:
    base = lab_module().cache_dir() / "kernels" / kernel
    for pattern in ("*/boot/config-*", "*/usr/lib/modules/*/config", "*/lib/modules/*/config"):
        for p in base.glob(pattern):
            return p.read_text(errors="replace")
    return ""


def guest_args(peer: str, promote_rate_mb_s: int) -> tuple[str, ...]:
    if peer == "tieringd":
        return ()
    return ("--peer", peer, "--promote-rate", str(promote_rate_mb_s))


def run_figures(kernel: str, peer: str, loop: dict) -> list[list]:
    """One row per run: the share, bytes moved each way, the agent's and the workload's CPU."""
    rows = []
    for run in loop.get("runs", []):
        r = run_row(run)
        if run.get("peer_before") is not None:
            b, a = run["peer_before"], run["peer_after"] or run["peer_before"]
            promoted = round((a["promoted_bytes"] - b["promoted_bytes"]) / MIB, 1)
            demoted = round((a["demoted_bytes"] - b["demoted_bytes"]) / MIB, 1)
            cpu = round(a["agent_cpu_s"] - b["agent_cpu_s"], 2)
        else:
            promoted, demoted, cpu = r["promoted_mib"], r["demoted_mib"], r["daemon_cpu_s"]
        sys_s = round(sum(x.get("worker_sys_s", 0) for x in run.get("reports") or []), 1)
        rows.append([kernel, r["layout"], peer, r["run"], r["share_mean_2nd_half"], r["share_min_2nd_half"],
                     promoted, demoted, cpu, sys_s, r["decode_steps"], r["bytes_intact"]])
    return rows


def summarise(run_rows: list[list], unavailable: dict[str, str]) -> tuple[list[list], dict]:
    """The table (one row per kernel, layout and peer) and, per kernel and layout, tieringd against
    the best peer."""
    table, verdict = [], {}
    keys = list(dict.fromkeys((r[0], r[1]) for r in run_rows))
    for kernel, layout in keys:
        means = {}
        for peer in PEERS:
            sel = [r for r in run_rows if (r[0], r[1], r[2]) == (kernel, layout, peer)]
            if peer in unavailable and not sel:
                table.append([kernel, layout, peer, 0, None, None, None, None, None, None, "not run"])
                continue
            shares = [r[4] for r in sel if r[4] is not None]
            if not sel:
                continue
            mean = lambda i: round(statistics.mean(r[i] for r in sel if r[i] is not None), 2) \
                if any(r[i] is not None for r in sel) else None
            means[peer] = round(statistics.mean(shares), 3) if shares else None
            table.append([kernel, layout, peer, len(sel), means[peer],
                          round(min(shares), 3) if shares else None, mean(6), mean(7), mean(8), mean(9),
                          all(r[11] for r in sel)])
        others = {p: m for p, m in means.items() if p != "tieringd" and m is not None}
        if "tieringd" in means and others:
            best = max(others, key=others.get)
            verdict[f"{kernel}/{layout}"] = {
                "tieringd": means["tieringd"], "best_peer": best, "best_peer_share": others[best],
                "ahead_of_every_peer": means["tieringd"] >= others[best],
                "not_below_no_tiering": means["tieringd"] >= others.get("none", 0)}
    return table, verdict


def boot_all(args, keep: Path) -> list[tuple[str, str, dict]]:
    loops = []
    for kernel in args.kernel:
        for peer in args.peer:
            if peer == "memtierd":
                continue
            with tempfile.TemporaryDirectory(prefix=f"p5peers-{kernel}-{peer}-") as tmp:
                try:
                    loop = boot_loop(kernel, seconds=args.seconds, runs=args.runs,
                                     layouts=("scattered", "front"), out_dir=Path(tmp),
                                     extra_args=guest_args(peer, args.promote_rate))
                except RuntimeError as e:
                    print(f"p5_peers: {kernel} {peer}: {e}", file=sys.stderr)
                    loop = {"runs": [], "error": str(e)[-2000:]}
            loop["peer_name"] = peer
            (keep / f"{kernel}-{peer}.json").write_text(json.dumps(loop))
            loops.append((kernel, peer, loop))
            print(f"p5_peers: {kernel} {peer}: " + "; ".join(
                f"{r[1]} {r[4]}" for r in run_figures(kernel, peer, loop)), file=sys.stderr, flush=True)
    return loops


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figure here")
    ap.add_argument("--kernel", action="append", help="lab kernels (default 6.12, 7.3)")
    ap.add_argument("--peer", action="append", choices=PEERS, help="peers to run (default: all)")
    ap.add_argument("--runs", type=int, default=1, help="runs per layout (default 1; 3 for the full table)")
    ap.add_argument("--seconds", type=float, default=80)
    ap.add_argument("--promote-rate", type=int, default=16, help="kernel-tuned's promotion rate limit, MB/s")
    ap.add_argument("--keep", default=str(REPO / "build" / "bench" / "p5_peers"))
    ap.add_argument("--from", dest="from_", metavar="DIR", help="re-render from kept loop.json files")
    args = ap.parse_args()
    args.kernel = args.kernel or ["6.12", "7.3"]
    args.peer = args.peer or list(PEERS)
    if args.from_:
        loops = []
        for p in sorted(Path(args.from_).glob("*.json")):
            d = json.loads(p.read_text())
            kernel = p.stem.split("-")[0]
            loops.append((kernel, d.get("peer_name") or p.stem[len(kernel) + 1:], d))
    else:
        keep = Path(args.keep)
        keep.mkdir(parents=True, exist_ok=True)
        loops = boot_all(args, keep)
    unavailable = {}
    if "memtierd" in args.peer:
        _, why = memtierd_status(args.kernel)
        if why:
            unavailable["memtierd"] = why
    run_rows = [row for kernel, peer, loop in loops for row in run_figures(kernel, peer, loop)]
    table, verdict = summarise(run_rows, unavailable)
    errors = {f"{k}/{p}": loop.get("peer_error") or loop.get("error") for k, p, loop in loops
              if loop.get("peer_error") or loop.get("error")}
    notes = {f"{k}/{p}": loop["peer"]["notes"] for k, p, loop in loops
             if (loop.get("peer") or {}).get("notes")}
    fig = {
        "figure": "P5-peers",
        "title": f"Closed loop against its peers: node-0 share of the KV workload's touched blocks, "
                 f"{args.seconds:g} s runs (lab cxl, DRAM nodes 1 GiB, 1.2 GiB pool)",
        "columns": COLUMNS, "rows": table, "run_columns": RUN_COLUMNS, "runs": run_rows,
        "summary": {"verdict": verdict, "unavailable": unavailable, "errors": errors,
                    "peer_notes": notes, "promote_rate_mb_s": args.promote_rate, "runs_per_layout": args.runs},
        "notes": ("QEMU/TCG guests: shares and bytes are meaningful, CPU seconds only against each other "
                  "(docs/lab.md). Agent CPU: tieringd's process; the kdamonds and kswapd/kcompactd for "
                  "DAMON; kswapd/kcompactd for the kernel, whose hint faults and scanning are charged to "
                  "the workload (its system time, next column). Kernels: " + ", ".join(
                      sorted({loop.get("release", "?") for _, _, loop in loops}))),
    }
    write_figure(fig, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
