#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Guest side of the DAX-remap tier in the loop (lab, ``pmem`` profile): a KV pool larger than the
DRAM and CXL nodes together, under the daemon with ``[dax] path`` set.

    kv_dax.py --out DIR [--pool 1.0G] [--fill-burst-mib 200] [--fill-mib-s 3] [--fill-min-free-mib 128]
              [--seconds 90] [--high-watermark 0.75] [--low-watermark 0.7] [--kill-after 3] [--skip-kill] [--dax namespace0.0]

1. The NVDIMM namespace becomes a devdax device, not onlined (the DAX-remap tier's file).
2. tieringd starts with ``[dax] path = "/dev/daxX.Y"``, ``[shim] backing = "memfd"`` and watermarks
   that keep a quarter of each node free: the guest has no swap, so the fill's page faults need room
   while demotions to the (slower) DAX tier catch up.
3. ``build/tests/kv_workload`` runs under ``tieringctl run``: it fills --fill-burst-mib at once, the
   rest of the pool at --fill-mib-s (the pool does not fit in memory: the daemon must demote cold
   blocks to the DAX tier while it fills), then decodes for --seconds.
4. While the pool still fills and a demotion to the DAX tier is in flight (after --kill-after of
   them), the daemon is killed with SIGKILL and started again: what lives on the tier must be learnt
   again from the processes' mappings, and the workload must end intact.

Writes DIR/dax.json and DIR/daemon*.log; prints one summary line.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import kv_loop  # noqa: E402
from kv_loop import REPO, RUN_DIR, DaemonProc, status  # noqa: E402

CONFIG = "/tmp/tieringd-dax.toml"


def devdax(namespace: str) -> str:
    out = subprocess.run([os.path.join(REPO, "scripts", "lab", "pmem.sh"), "devdax", namespace],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def tier_bytes(s: dict | None) -> dict[str, int]:
    return {t["tier"]: t.get("table_bytes", 0) for t in (s or {}).get("tiers", [])}


def dax_stats(s: dict | None) -> dict:
    return ((s or {}).get("moves") or {}).get("dax") or {}


class Workload:
    """kv_workload under tieringctl run; its JSON lines, with the daemon's status at each report."""

    def __init__(self, args: list[str]):
        cmd = [os.path.join(REPO, ".venv", "bin", "tieringctl"), "run", "--",
               os.path.join(REPO, "build", "tests", "kv_workload"), *args]
        # PYTHONPATH: tieringctl from this checkout, whatever checkout the venv was installed from
        env = dict(os.environ, TIERINGD_RUN_DIR=RUN_DIR, TIERINGD_CONFIG=CONFIG, PYTHONPATH=REPO)
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[dict] = []
        self.timeline: list[dict] = []
        self.err: list[str] = []
        threading.Thread(target=lambda: self.err.extend(self.p.stderr), daemon=True).start()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.p.stdout:
            msg = json.loads(line)
            self.lines.append(msg)
            if msg["event"] in ("start", "report"):
                s = status()
                self.timeline.append({"t_s": msg.get("t_s", 0.0), "event": msg["event"],
                                      "node0_share": msg.get("node0_share"),
                                      "tier_bytes": tier_bytes(s), "dax": dax_stats(s)})

    def wait(self, timeout: float) -> dict:
        rc = self.p.wait(timeout)
        self.reader.join(30)
        reports = [x for x in self.lines if x["event"] == "report"]
        end = next((x for x in self.lines if x["event"] == "end"), None)
        return {"rc": rc, "start": self.lines[0] if self.lines else None, "end": end,
                "reports": [{k: r.get(k) for k in ("t_s", "node0_share", "touched_blocks", "read_errors")}
                            for r in reports],
                "timeline": self.timeline, "stderr": "".join(self.err)[-4000:]}


def sample_dax(until: threading.Event, into: list) -> None:
    """The DAX tier's bytes and the daemon's moves every second while the pool fills."""
    t0 = time.monotonic()
    while not until.wait(1.0):
        s = status()
        if s:
            into.append({"t": round(time.monotonic() - t0, 1), "tier_bytes": tier_bytes(s),
                         "in_flight_bytes": (s.get("moves") or {}).get("in_flight_bytes"),
                         "dax_in_flight": dax_stats(s).get("in_flight"),
                         "free_mib": {n: m["MemFree"] >> 20 for n, m in kv_loop.node_meminfo().items()},
                         "dax_requests": (dax_stats(s).get("requests") or {})})


def kill_mid_demotion(daemon: DaemonProc, w: Workload, a) -> dict | None:
    """SIGKILL the daemon while the pool still fills and a demotion to the DAX tier is in flight
    (the tier's worker is carrying one out); None if the fill ended first."""
    while w.p.poll() is None and not any(x["event"] == "start" for x in w.lines):
        s = status() or {}
        dax = dax_stats(s)
        demotes = (dax.get("requests") or {}).get("demote") or {}
        if demotes.get("requests", 0) >= a.kill_after and dax.get("in_flight", 0) > 0:
            daemon.p.send_signal(signal.SIGKILL)
            daemon.p.wait()
            daemon.log.close()
            return {"tier_bytes": tier_bytes(s), "demote_requests": demotes, "dax_in_flight": dax["in_flight"]}
        time.sleep(0.05)
    return None


def relearn(w: Workload, t_restart: float) -> dict | None:
    """Wait for the restarted daemon to find the workload's blocks on the DAX tier again."""
    while w.p.poll() is None:
        s = status() or {}
        if s.get("regions") and tier_bytes(s).get("dax", 0) > 0:
            return {"after_s": round(time.monotonic() - t_restart, 1), "tier_bytes": tier_bytes(s),
                    "dax_log": (dax_stats(s).get("log") or {})}
        time.sleep(0.2)
    return None


def phase_run(a, out: dict) -> None:
    """One workload: the pool fills (a burst, then paced) beyond memory, the daemon is killed once
    mid-demotion and started again, then the decode runs on the restarted daemon."""
    daemon = DaemonProc(os.path.join(a.out, "daemon.log"), ["--config", CONFIG, *a.daemon_arg])
    out["daemon_ready_s"] = round(daemon.ready_s, 1)
    out["status_at_start"] = {"tiers": (status() or {}).get("tiers"), "signal": (status() or {}).get("signal_text")}
    stop, samples = threading.Event(), []
    threading.Thread(target=sample_dax, args=(stop, samples), daemon=True).start()
    w = Workload(["--pool", a.pool, "--fill-burst-mib", str(a.fill_burst_mib), "--fill-mib-s", str(a.fill_mib_s),
                  "--fill-min-free-mib", str(a.fill_min_free_mib),
                  "--seconds", str(a.seconds), "--report", "4", "--layout", "scattered"])
    out["kill"] = {"killed": None if a.skip_kill else kill_mid_demotion(daemon, w, a)}
    if out["kill"]["killed"] is not None:
        t_restart = time.monotonic()
        daemon = DaemonProc(os.path.join(a.out, "daemon-restart.log"), ["--config", CONFIG, *a.daemon_arg])
        out["kill"]["restart_ready_s"] = round(daemon.ready_s, 1)
        out["kill"]["relearnt"] = relearn(w, t_restart)
    try:
        out["decode"] = w.wait(a.seconds + 1800)
    finally:
        stop.set()
    out["decode"]["samples"] = samples
    out["decode"]["daemon_after"] = {k: (status() or {}).get(k) for k in ("tiers", "moves", "regions")}
    out["decode"]["daemon_rc"] = daemon.stop()
    print(json.dumps({"rc": out["decode"]["rc"], "ok": (out["decode"]["end"] or {}).get("ok"),
                      "killed": out["kill"]["killed"] is not None,
                      "relearnt": out["kill"].get("relearnt") is not None,
                      "max_dax_mib": max((x["tier_bytes"].get("dax", 0) for x in samples), default=0) >> 20}),
          flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--pool", default="1.0G")
    ap.add_argument("--fill-burst-mib", type=float, default=200, help="filled at once, before the pacing")
    ap.add_argument("--fill-mib-s", type=float, default=3)
    # and waits while the guest has less free: under TCG on a busy host the tier's demotions slow
    # down, the wall-clock pacing does not (the guest has no swap)
    ap.add_argument("--fill-min-free-mib", type=float, default=128)
    # the guest has no swap: a quarter of each node free leaves the fill's faults room while the
    # slower DAX demotions catch up (at 0.9 the page cache of the 9p checkout thrashes first)
    ap.add_argument("--high-watermark", type=float, default=0.75)
    ap.add_argument("--low-watermark", type=float, default=0.7)
    ap.add_argument("--seconds", type=float, default=90)
    ap.add_argument("--kill-after", type=int, default=3, help="demotions to the tier done before the kill")
    ap.add_argument("--dax", default="namespace0.0")
    ap.add_argument("--skip-kill", action="store_true")
    ap.add_argument("--daemon-arg", action="append", default=[], help="passed to tieringd (e.g. -v)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    out: dict = {"release": os.uname().release, "nodes_before": kv_loop.node_meminfo()}
    dev = devdax(a.dax)
    out["dax_device"] = dev
    with open(CONFIG, "w") as f:
        # write amplification 4: the log may hold three quarters of the device live (2: half)
        f.write(f'[dax]\npath = "/dev/{dev}"\nsegment_bytes = "32M"\nmax_write_amplification = 4\n'
                '[shim]\nbacking = "memfd"\nthp = false\n'
                f'[policy]\nhigh_watermark = {a.high_watermark}\nlow_watermark = {a.low_watermark}\n')
    try:
        phase_run(a, out)
    finally:
        out["settings_after"] = kv_loop.kernel_settings()
        with open(os.path.join(a.out, "dmesg.txt"), "w") as f:     # the OOM killer's account, if any
            subprocess.run(["dmesg"], stdout=f, stderr=subprocess.STDOUT)
        with open(os.path.join(a.out, "dax.json"), "w") as f:
            json.dump(out, f, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
