#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Guest side of the access-signal experiments and the no-daemon baselines (docs/loop.md).

    kv_signal.py --out DIR [--seconds S] [--layout scattered|front] RECIPE... [-- WORKLOAD OPTIONS]

For each recipe, in one guest: borrow its kernel settings (tieringd.kernel.knobs), start
build/tests/kv_workload, track its pool in 2 MiB blocks, run the recipe's sampler (if any), and per
workload report period (4 s) count the samples each block got; then restore the settings. Writes
DIR/RECIPE-LAYOUT.json (every window) and prints one summary line per recipe. Also writes
DIR/facts.json (tieringd.sampling.access_signal.Facts of this kernel) when --facts is given.

Recipes:
  none            NUMA balancing off: what a daemon sees today on populated memory (fault sampler)
  none-noticker   the same without the workload's TLB ticker (its cost)
  hint-bind       mode 3 (1 without tiering), promote rate limit 0, the pool bound to the node each
                  block is on with MPOL_BIND|MPOL_F_NUMA_BALANCING (the workload's --bind-local)
  hint-bind-brisk hint-bind with the scan settings of the lab sampling test
  hint-bind-brisker hint-bind with 100 ms scan periods (the pool every ~0.5 s)
  hint-nobind-brisker  hint-nobind with those scan periods
  hint-bind-fast  hint-bind scanning the whole pool at 1-4 passes a second (scan_size_mb 2048)
  hint-nobind     mode 3, rate limit 0, no binding
  tiering-rl0     mode 2, rate limit 0, no binding
  damon           NUMA balancing off, DAMON (f)vaddr on the pool (5 ms samples, 100 ms aggregation)
  damon-light     the same with 20 ms samples, 400 ms aggregation
  base-none       baseline: no tiering at all (NUMA balancing off, demotion off), no sampler
  base-kernel     baseline: the kernel's own tiering (numa_balancing=2, demotion_enabled=1)
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from tieringd.kernel import sysfs, knobs, numa  # noqa: E402

VMSTAT = ("numa_hint_faults", "numa_hint_faults_local", "numa_pte_updates", "numa_huge_pte_updates",
          "numa_pages_migrated", "pgpromote_success", "pgmigrate_success", "pgdemote_kswapd",
          "pgdemote_direct", "thp_migration_success", "compact_migrate_scanned")
BRISK = {"numa_balancing.scan_delay_ms": 100, "numa_balancing.scan_period_min_ms": 500,
         "numa_balancing.scan_period_max_ms": 2000}
# scan windows of 256 MB (the default size) every 100 ms: the pool every ~0.5 s
BRISKER = {"numa_balancing.scan_delay_ms": 100, "numa_balancing.scan_period_min_ms": 100,
           "numa_balancing.scan_period_max_ms": 500}
# one scan covers a 1.2 GiB pool (but task_scan_min() floors the period at 1 s for 2560 MB / size
# < 2 windows)
FAST = {"numa_balancing.scan_delay_ms": 100, "numa_balancing.scan_period_min_ms": 250,
        "numa_balancing.scan_period_max_ms": 1000, "numa_balancing.scan_size_mb": 2048}


def tiering_mode() -> int:
    # mode 2 (memory tiering) exists since v5.18; 3 = normal + tiering
    return 3 if sysfs.exists("/proc/sys/kernel/numa_balancing_promote_rate_limit_MBps") else 1


RECIPES = {
    "none": dict(settings={"kernel.numa_balancing": 0}, sampler="fault"),
    "none-noticker": dict(settings={"kernel.numa_balancing": 0}, sampler="fault",
                          args=["--ticker-us", "0"]),
    "hint-bind": dict(settings={"kernel.numa_balancing": "TIER",
                                "kernel.numa_balancing_promote_rate_limit_MBps": 0,
                                "mm.numa.demotion_enabled": 0},
                      sampler="fault", args=["--bind-local"]),
    "hint-bind-brisk": dict(settings={"kernel.numa_balancing": "TIER",
                                      "kernel.numa_balancing_promote_rate_limit_MBps": 0,
                                      "mm.numa.demotion_enabled": 0, **BRISK},
                            sampler="fault", args=["--bind-local"]),
    "hint-nobind": dict(settings={"kernel.numa_balancing": "TIER",
                                  "kernel.numa_balancing_promote_rate_limit_MBps": 0,
                                  "mm.numa.demotion_enabled": 0}, sampler="fault"),
    "tiering-rl0": dict(settings={"kernel.numa_balancing": 2,
                                  "kernel.numa_balancing_promote_rate_limit_MBps": 0,
                                  "mm.numa.demotion_enabled": 0}, sampler="fault"),
    "hint-bind-brisker": dict(settings={"kernel.numa_balancing": "TIER",
                                        "kernel.numa_balancing_promote_rate_limit_MBps": 0,
                                        "mm.numa.demotion_enabled": 0, **BRISKER},
                              sampler="fault", args=["--bind-local"]),
    "hint-nobind-brisker": dict(settings={"kernel.numa_balancing": "TIER",
                                          "kernel.numa_balancing_promote_rate_limit_MBps": 0,
                                          "mm.numa.demotion_enabled": 0, **BRISKER}, sampler="fault"),
    "hint-bind-fast": dict(settings={"kernel.numa_balancing": "TIER",
                                     "kernel.numa_balancing_promote_rate_limit_MBps": 0,
                                     "mm.numa.demotion_enabled": 0, **FAST},
                           sampler="fault", args=["--bind-local"]),
    "damon": dict(settings={"kernel.numa_balancing": 0, "mm.numa.demotion_enabled": 0,
                            "damon_stat.enabled": "N"}, sampler="damon"),
    "damon-light": dict(settings={"kernel.numa_balancing": 0, "mm.numa.demotion_enabled": 0,
                                  "damon_stat.enabled": "N"},
                        sampler="damon", sampler_args={"sample_us": 20_000, "aggr_us": 400_000}),
    "base-none": dict(settings={"kernel.numa_balancing": 0, "mm.numa.demotion_enabled": 0},
                      sampler=None),
    "base-kernel": dict(settings={"kernel.numa_balancing": 2, "mm.numa.demotion_enabled": 1},
                        sampler=None),
}


def vmstat() -> dict[str, int]:
    vm = sysfs.read_keyed("/proc/vmstat")
    return {k: int(vm.get(k, 0)) for k in VMSTAT}


_BLOCK_NODE: dict[int, int] = {}


def node_by_pfn(pfn: np.ndarray) -> np.ndarray:
    """Node of each PFN (memory block → node from sysfs), -1 unknown."""
    if not _BLOCK_NODE:
        import re
        for d in sysfs.glob("/sys/devices/system/node/node*/memory*"):
            m = re.search(r"/node(\d+)/memory(\d+)$", d)      # not memory_failure (7.x)
            if m:
                _BLOCK_NODE[int(m.group(2))] = int(m.group(1))
    size = int(sysfs.read_text("/sys/devices/system/memory/block_size_bytes"), 16)
    blk = (pfn.astype(np.int64) * 4096) // size
    return np.array([_BLOCK_NODE.get(int(b), -1) if p else -1 for b, p in zip(blk, pfn)], np.int64)


def nodes_of(pid: int, addrs: np.ndarray) -> tuple[np.ndarray, int]:
    """Each page's node: move_pages(2), and for -ENOENT (before v6.5 NUMA-protected pages are
    invisible to it) the PFN from pagemap. Returns (nodes, how many came from pagemap)."""
    try:
        nodes = numa.query_pages_array(pid, addrs).astype(np.int64)
    except OSError as e:    # the workload has exited (its last report read late)
        print(f"kv_signal: move_pages query of pid {pid}: {e}", file=sys.stderr, flush=True)
        return np.full(len(addrs), -1, np.int64), 0
    blind = (nodes == -2) | (nodes == -14)      # -ENOENT (base page), -EFAULT (THP) before 6.5
    if blind.any():
        from tieringd.kernel import procfs
        try:
            pfn = procfs.pfns(procfs.read_pagemap_at(pid, addrs[blind]))
        except OSError:
            return np.where(blind, -1, nodes), 0
        nodes[blind] = node_by_pfn(pfn)
    return nodes, int(blind.sum())


def block_nodes(pid: int, start: dict) -> np.ndarray:
    addrs = np.arange(start["blocks"], dtype=np.uint64) * start["block_bytes"] + start["pool_addr"]
    return nodes_of(pid, addrs)[0]


def protnone_probe(out_dir: str) -> dict:
    """Can move_pages(2) see and move pages NUMA balancing has protected, and can mbind(2)?"""
    import mmap
    k = knobs.Knobs(os.path.join(out_dir, "knobs-probe.json"))
    k.recover()
    stop = threading.Event()
    threading.Thread(target=stop.wait, daemon=True).start()    # multi-threaded: local pages scanned
    try:
        k.borrow("kernel.numa_balancing", tiering_mode())
        k.borrow("kernel.numa_balancing_promote_rate_limit_MBps", 0)
        for name, v in FAST.items():
            k.borrow(name, v)
        size = 32 << 20
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        arr = np.frombuffer(buf, np.uint8)
        arr[:] = 7
        base = arr.ctypes.data
        addrs = numa.page_addresses(base, size)
        first = numa.query_pages_array(0, addrs)
        t0, blind = time.monotonic(), 0
        while time.monotonic() - t0 < 20:          # run (ticks drive task_numa_work), never touch buf
            x = 0
            for i in range(200_000):
                x += i
            q = numa.query_pages_array(0, addrs)
            blind = int((q == -2).sum())
            if blind > len(addrs) // 2:
                break
        waited = time.monotonic() - t0
        before_move, pm = nodes_of(0, addrs)
        moved = numa.move_pages(0, addrs, 1)
        mp = {str(v): int(c) for v, c in zip(*np.unique(np.array(moved), return_counts=True))}
        after_move, _ = nodes_of(0, addrs)
        numa.mbind(base, size, numa.MPOL_BIND, [1], numa.MPOL_MF_MOVE)
        after_mbind, _ = nodes_of(0, addrs)
        hist = lambda a: {str(v): int(c) for v, c in zip(*np.unique(a, return_counts=True))}
        res = {"release": os.uname().release, "pages": len(addrs), "first_query": hist(first),
               "blind_after_s": round(waited, 1), "blind_pages": blind,
               "nodes_before_move": hist(before_move), "resolved_by_pagemap": pm,
               "move_pages_status": mp, "nodes_after_move_pages": hist(after_move),
               "nodes_after_mbind_move": hist(after_mbind)}
        del arr
        buf.close()
        return res
    finally:
        stop.set()
        k.restore()


def make_sampler(kind: str | None, tracked, **kw):
    if kind is None:
        return None
    from tieringd.sampling import DamonSampler, PageFaultSampler
    s = PageFaultSampler(tracked, **kw) if kind == "fault" else DamonSampler(tracked, **kw)
    s.start()
    return s


def count_rows(rows, pid: int, start: dict, counts: np.ndarray) -> None:
    rows = rows[rows["pid"] == pid]
    off = (rows["block_start"].astype(np.int64) - start["pool_addr"]) // start["block_bytes"]
    ok = (off >= 0) & (off < start["blocks"])
    np.add.at(counts, off[ok], rows["count"][ok].astype(np.int64))


def summarise_window(counts, touched, nodes, prefix, period_s):
    n = len(counts)
    hot = np.zeros(n, bool)
    hot[touched] = True
    out = {"samples": int(counts.sum())}
    for name, sel in (("hot_node0", hot & (nodes == 0)), ("hot_node1", hot & (nodes == 1)),
                      ("cold_node0", ~hot & (nodes == 0)), ("cold_node1", ~hot & (nodes == 1))):
        out[name] = {"blocks": int(sel.sum()),
                     "per_block_s": float(counts[sel].mean() / period_s) if sel.any() else None,
                     "with_samples": int((counts[sel] > 0).sum())}
    # P(a hot block has more samples than a cold one), ties half: 1.0 = perfectly separated
    h, c = counts[hot], counts[~hot]
    if len(h) and len(c):
        ch = np.sort(c)
        less = np.searchsorted(ch, h, "left")
        leq = np.searchsorted(ch, h, "right")
        out["auc"] = float((less + 0.5 * (leq - less)).sum() / (len(h) * len(c)))
    order = np.argsort(-counts, kind="stable")
    fifth = counts[order[4]] if n >= 5 else 0
    out["prefix_in_top5"] = int(np.isin(order[:5], prefix).sum())
    out["prefix_tied_top5"] = int(((counts[prefix] >= fifth) & (counts[prefix] > 0)).sum())
    out["prefix_per_block_s"] = float(counts[prefix].mean() / period_s) if len(prefix) else None
    return out


def run_recipe(name: str, layout: str, seconds: float, report_s: float, workload_args: list[str],
               state_dir: str) -> dict:
    k = knobs.Knobs(os.path.join(state_dir, f"knobs-{name}.json"))
    k.recover()
    try:
        return _run_recipe(k, name, layout, seconds, report_s, workload_args)
    finally:
        k.restore()     # also when the recipe failed: the next one starts from the boot's settings


def _run_recipe(k: knobs.Knobs, name: str, layout: str, seconds: float, report_s: float,
                workload_args: list[str]) -> dict:
    recipe = RECIPES[name]
    borrowed = []
    for setting, value in recipe["settings"].items():
        if value == "TIER":
            value = tiering_mode()
        c = k.borrow(setting, value)
        if c:
            borrowed.append(str(c))
    settings_now = {s: sysfs.read_text(knobs.resolve(s)[0], None) if knobs.resolve(s)[0] else None
                    for s in ("kernel.numa_balancing", "kernel.numa_balancing_promote_rate_limit_MBps",
                              "mm.numa.demotion_enabled", *FAST)}
    cmd = ["build/tests/kv_workload", "--wait", "--report-blocks", "--seconds", str(seconds),
           "--report", str(report_s), "--layout", layout, *recipe.get("args", []), *workload_args]
    t_start = time.monotonic()
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        return _measure(k, name, recipe, p, layout, seconds, settings_now, borrowed, t_start)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _measure(k, name, recipe, p, layout, seconds, settings_now, borrowed, t_start) -> dict:
    from tieringd.sampling import TrackedSet
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in p.stdout] + [lines.put(None)],
                     daemon=True).start()
    start = json.loads(lines.get(timeout=600))
    pid, nb = start["pid"], start["blocks"]
    prefix = np.array(start["prefix"], np.int64)
    tracked = TrackedSet()
    tracked.add_process(pid)
    tracked.add_range(pid, start["pool_addr"], start["pool_bytes"], start["block_bytes"])
    sampler = make_sampler(recipe["sampler"], tracked, **recipe.get("sampler_args", {}))
    if sampler:
        sampler.read_deltas()
    nodes0 = block_nodes(pid, start)
    every_page = numa.page_addresses(start["pool_addr"], start["pool_bytes"])
    pages0, _ = nodes_of(pid, every_page)
    pages1 = pages0
    v0 = vmstat()
    p.stdin.write("go\n")
    p.stdin.flush()
    windows, reports, end = [], [], None
    counts = np.zeros(nb, np.int64)
    total = np.zeros(nb, np.int64)
    nodes = nodes0
    while True:
        try:
            line = lines.get(timeout=1 if recipe["sampler"] == "damon" else 30)
        except queue.Empty:
            if sampler is not None and recipe["sampler"] == "damon":
                count_rows(sampler.read_deltas(), pid, start, counts)
            continue
        if line is None:
            break
        msg = json.loads(line)
        if msg["event"] == "end":
            end = msg
            continue
        if sampler is not None:
            count_rows(sampler.read_deltas(), pid, start, counts)
        nodes = block_nodes(pid, start)
        if msg["t_s"] >= seconds - 1:       # the last report: every page, before the workload exits
            pages1, _ = nodes_of(pid, every_page)
        touched = np.array(msg.pop("touched"), np.int64)
        reports.append(msg)
        if sampler is not None:
            w = summarise_window(counts, touched, nodes, prefix, msg["period_s"])
            w["t_s"] = msg["t_s"]
            windows.append(w)
        total += counts
        counts[:] = 0
    rc = p.wait()
    v1 = vmstat()
    stats = sampler.stats() if sampler is not None and hasattr(sampler, "stats") else None
    if sampler is not None:
        sampler.close()
    tracked.close()
    restored = [str(c) for c in k.changes]     # what the caller's restore() puts back
    half = [r for r in reports if r["t_s"] > seconds / 2]
    steps_s = [r["steps"] / r["period_s"] for r in reports if r["period_s"] > 0]
    wu = sum(r.get("worker_user_s", 0) for r in reports)
    wsys = sum(r.get("worker_sys_s", 0) for r in reports)
    moved = int(((nodes0 >= 0) & (nodes >= 0) & (nodes0 != nodes)).sum())
    req_blocks = np.array([b for r in start["requests"] for b in r], np.int64)
    cold = np.setdiff1d(np.arange(nb), np.concatenate([prefix, req_blocks]))
    out = {
        "recipe": name, "layout": layout, "release": os.uname().release, "seconds": seconds,
        "borrowed": borrowed, "restored": restored, "settings": settings_now, "missing": k.missing,
        "workload_rc": rc, "end": end, "fill_s": start["fill_s"], "bound_runs": start["bound_runs"],
        "pool_pages_start": start["pool_pages"], "wall_s": time.monotonic() - t_start,
        "node0_share_second_half": float(np.mean([r["node0_share"] for r in half])) if half else None,
        "node0_share_min_second_half": min((r["node0_share"] for r in half), default=None),
        "steps_per_s": float(np.median(steps_s)) if steps_s else None,
        "vmstat_delta": {x: v1[x] - v0[x] for x in VMSTAT},
        "worker_cpu": {"user_s": round(wu, 2), "sys_s": round(wsys, 2),
                       "sys_share": round(wsys / (wu + wsys), 4) if wu + wsys else None,
                       "steps_per_cpu_s": round(sum(r["steps"] for r in reports) / (wu + wsys), 2)
                       if wu + wsys else None},
        "blocks_changed_node": moved,
        "pool_pages_changed_node": int(((pages0 >= 0) & (pages1 >= 0) & (pages0 != pages1)).sum()),
        "pool_pages_known": [int((pages0 >= 0).sum()), int((pages1 >= 0).sum())],
        "total_per_block_s": {
            "prefix": float(total[prefix].mean() / seconds) if len(prefix) else None,
            "requests": float(total[req_blocks].mean() / seconds),
            "cold": float(total[cold].mean() / seconds) if len(cold) else None},
        "sampler_stats": stats, "windows": windows, "reports": reports,
    }
    return out


def summary(o: dict) -> str:
    w = o["windows"]
    s = {"recipe": o["recipe"], "layout": o["layout"], "ok": (o["end"] or {}).get("ok"),
         "share_2nd_half": o["node0_share_second_half"], "steps_per_s": o["steps_per_s"],
         "vmstat": o["vmstat_delta"], "changed_node": o["blocks_changed_node"],
         "pages_changed": o["pool_pages_changed_node"],
         "cpu": o["worker_cpu"],
         "borrowed": o["borrowed"], "missing": list(o["missing"])}
    if w:
        def mean(key, sub="per_block_s"):
            v = [x[key][sub] for x in w if x[key][sub] is not None]
            return round(float(np.mean(v)), 3) if v else None
        s.update({"hot0": mean("hot_node0"), "hot1": mean("hot_node1"), "cold0": mean("cold_node0"),
                  "cold1": mean("cold_node1"),
                  "win_hot0_seen": sum(1 for x in w if x["hot_node0"]["with_samples"]),
                  "win_hot1_seen": sum(1 for x in w if x["hot_node1"]["with_samples"]),
                  "windows": len(w), "auc": round(float(np.mean([x.get("auc", 0) for x in w])), 3),
                  "prefix_top5": [x["prefix_in_top5"] for x in w],
                  "prefix_tied_top5": [x["prefix_tied_top5"] for x in w],
                  "prefix_s": round(float(np.mean([x["prefix_per_block_s"] for x in w])), 3),
                  "total_per_block_s": o["total_per_block_s"]})
    return json.dumps(s)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipes", nargs="*", metavar="RECIPE", help=", ".join(RECIPES))
    ap.add_argument("--probe", action="store_true",
                    help="first: can move_pages/mbind see and move NUMA-protected pages?")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=32)
    ap.add_argument("--report", type=float, default=4)
    ap.add_argument("--layout", action="append", choices=("scattered", "front"))
    ap.add_argument("--facts", action="store_true", help="also write DIR/facts.json")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []     # after --: kv_workload options
    a = ap.parse_args(argv[:len(argv) - len(extra) - (1 if "--" in argv else 0)])
    for r in a.recipes:
        if r not in RECIPES:
            ap.error(f"unknown recipe {r!r}; known: {', '.join(RECIPES)}")
    os.makedirs(a.out, exist_ok=True)
    os.sched_setaffinity(0, {0})    # the workload pins itself to the last CPU
    if not os.path.isdir("/sys/kernel/debug/sched"):
        subprocess.run(["mount", "-t", "debugfs", "none", "/sys/kernel/debug"], capture_output=True)
    if a.probe:
        r = protnone_probe(a.out)
        with open(os.path.join(a.out, "protnone.json"), "w") as f:
            json.dump(r, f, indent=1)
        print(json.dumps({"probe": r}), flush=True)
    if a.facts:
        from tieringd.sampling.access_signal import Facts
        with open(os.path.join(a.out, "facts.json"), "w") as f:
            json.dump(Facts.probe().as_dict(), f, indent=1)
    rc = 0
    for recipe in a.recipes:
        for layout in a.layout or ["scattered"]:
            try:
                o = run_recipe(recipe, layout, a.seconds, a.report, extra, a.out)
            except Exception as e:  # keep going: one recipe's failure must not lose the others
                import traceback
                traceback.print_exc()
                print(json.dumps({"recipe": recipe, "layout": layout, "error": repr(e)}), flush=True)
                rc = 1
                continue
            with open(os.path.join(a.out, f"{recipe}-{layout}.json"), "w") as f:
                json.dump(o, f, indent=1)
            print(summary(o), flush=True)
            if o["workload_rc"] != 0:
                rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
