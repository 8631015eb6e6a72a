#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Guest side of the sharing run: tieringd, and ``shared_prefix`` under ``tieringctl run`` with memfd
backing — a prefix that --processes processes map, and a private pool each, read alike.

    kv_sharing.py --out DIR [--seconds 100] [--prefix 64M] [--private 96M] [--processes 3]
                  [--daemon-config TOML]

Per boot: shared-memory huge pages are allowed where asked for (``shmem_enabled = advise``: the
shim's MADV_HUGEPAGE then gives the memfd pools 2 MiB pages, as anonymous pools get, so NUMA
balancing traps one hint fault per huge page, not 512), ``tieringd`` is started with the daemon
configuration given (pinned to CPU 0; the readers run on the last CPU), then the workload. Every
--sample seconds the daemon's own table is read over its control socket (``heat`` of each reader:
every block's heat, sharers and node) with its status (the sharing scan, the moves). Writes
DIR/sharing.json (everything) and DIR/daemon.log; prints one summary line. Used by
tests/lab/test_sharing_lab.py.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

from kv_loop import RUN_DIR, DaemonProc, kernel_settings, status  # noqa: E402
from tieringd.kernel import sysfs  # noqa: E402

SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
# Shared pages move only with MPOL_MF_MOVE_ALL: with it the daemon could demote the prefix, so
# where the prefix stays is the heat's doing, not the kernel's refusal.
DAEMON_CONFIG = "[mover]\nmove_shared = true\n"


def ask(name: str, **params) -> dict | None:
    from tieringd.service.control import Client
    try:
        with Client(RUN_DIR, timeout_s=120) as c:
            return c.request(name, **params)
    except Exception as e:           # the daemon busy or gone: this sample is missing, not the run
        print(f"kv_sharing: {name}: {e}", file=sys.stderr)
        return None


def blocks_of(pid: int, start: dict) -> dict | None:
    """The daemon's rows of one process, split into its prefix and its private pool."""
    doc = ask("heat", pid=pid)
    if doc is None:
        return None
    b = doc["blocks"]
    out = {"prefix": [], "private": []}
    for a, h, k, n in zip(b["address"], b["heat"], b["sharers"], b["node"]):
        for part in ("prefix", "private"):
            lo = start[f"{part}_addr"]
            if lo <= a < lo + start[f"{part}_bytes"]:
                out[part].append({"heat": h, "sharers": k, "node": n})
    return out


class Sampler(threading.Thread):
    """The daemon's table and status every ``every_s`` while the workload runs."""

    def __init__(self, starts: dict[int, dict], every_s: float, t0: float):
        super().__init__(daemon=True)
        self.starts, self.every_s, self.t0 = starts, every_s, t0
        self.samples: list[dict] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.every_s):
            t = round(time.monotonic() - self.t0, 1)
            per_pid = {str(pid): blocks_of(pid, st) for pid, st in self.starts.items()}
            s = status() or {}
            self.samples.append({"t_s": t, "blocks": per_pid, "sharing": s.get("sharing"),
                                 "moves": {k: (s.get("moves") or {}).get(k)
                                           for k in ("promoted_bytes", "demoted_bytes", "failed_pages")},
                                 "ticks": s.get("ticks")})


def run_workload(a: argparse.Namespace) -> dict:
    cmd = [os.path.join(REPO, ".venv", "bin", "tieringctl"), "run", "--backing", "memfd", "--",
           os.path.join(REPO, "build", "tests", "shared_prefix"), "--prefix", a.prefix,
           "--private", a.private, "--processes", str(a.processes), "--seconds", str(a.seconds),
           "--report", str(a.report)]
    env = dict(os.environ, TIERINGD_RUN_DIR=RUN_DIR)
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(p.stderr), daemon=True).start()
    lines, starts, sampler = [], {}, None
    for line in p.stdout:
        msg = json.loads(line)
        msg["wall_s"] = round(time.monotonic() - t0, 1)
        lines.append(msg)
        if msg["event"] == "start":
            starts[msg["pid"]] = msg
            if len(starts) == a.processes:
                sampler = Sampler(starts, a.sample, t0)
                sampler.start()
    rc = p.wait()
    if sampler is not None:
        sampler.done.set()
        sampler.join(60)
    return {"rc": rc, "stderr": "".join(err)[-4000:], "starts": list(starts.values()),
            "reports": [x for x in lines if x["event"] == "report"],
            "ends": [x for x in lines if x["event"] == "end"],
            "samples": sampler.samples if sampler else [], "wall_s": round(time.monotonic() - t0, 1)}


def summary(out: dict) -> str:
    last = (out["run"]["samples"] or [{}])[-1]
    parts = {}
    for part in ("prefix", "private"):
        rows = [r for blocks in (last.get("blocks") or {}).values() if blocks for r in blocks[part]]
        if rows:
            heat = sorted(r["heat"] for r in rows)
            parts[part] = {"blocks": len(rows), "sharers": sorted({r["sharers"] for r in rows}),
                           "median_heat": heat[len(heat) // 2],
                           "node0": round(sum(r["node"] == 0 for r in rows) / len(rows), 3)}
    sh = last.get("sharing") or {}
    return json.dumps({"rc": out["run"]["rc"], "ok": all(e["ok"] for e in out["run"]["ends"]),
                       "last_sample": parts, "moves": last.get("moves"),
                       "sharing_ms_per_tick": sh.get("ms_per_tick"),
                       "sharing_pages_per_tick": sh.get("pages_examined_per_tick"),
                       "sharing_last_pass_s": sh.get("last_pass_s")})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=100)
    ap.add_argument("--report", type=float, default=4)
    ap.add_argument("--sample", type=float, default=5, help="seconds between reads of the daemon's table")
    ap.add_argument("--prefix", default="64M")
    ap.add_argument("--private", default="96M")
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--daemon-config", default=DAEMON_CONFIG)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    out = {"release": os.uname().release, "settings_before": kernel_settings(),
           "shmem_enabled_before": sysfs.read_text(SHMEM_ENABLED, None), "daemon_config": a.daemon_config}
    sysfs.write_text(SHMEM_ENABLED, "advise")
    config = os.path.join(a.out, "tieringd.toml")
    with open(config, "w") as f:
        f.write(a.daemon_config)
    daemon = DaemonProc(os.path.join(a.out, "daemon.log"), ["--config", config])
    out["daemon_ready_s"] = round(daemon.ready_s, 1)
    try:
        out["run"] = run_workload(a)
    finally:
        out["daemon_rc"] = daemon.stop()
        out["daemon_status_final"] = status()
        out["settings_after"] = kernel_settings()
        with open(os.path.join(a.out, "sharing.json"), "w") as f:
            json.dump(out, f)
    print(summary(out), flush=True)
    return out["run"]["rc"]


if __name__ == "__main__":
    sys.exit(main())
