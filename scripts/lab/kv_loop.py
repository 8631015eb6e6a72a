#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Guest side of the closed-loop runs: tieringd and the KV workload under ``tieringctl run``.

    kv_loop.py --out DIR [--seconds 80] [--layout scattered|front]... [--runs N] [--no-daemon]
               [--peer none|kernel|kernel-tuned|damon [--promote-rate MB/s]] [-- WORKLOAD OPTIONS]

Per boot: the kernel settings are read, ``tieringd`` is started (pinned to CPU 0; the workload pins
itself to the last CPU) and waited for; then per layout and run, ``build/tests/kv_workload`` runs
under ``tieringctl run`` for --seconds while the daemon's status (``/run/tieringd/status.json``) is
sampled at every workload report; after the workload exits, how long its regions took to leave the
daemon's tables is read from the daemon's own exit record. Then the daemon gets SIGTERM and the
kernel settings are read again. With --peer, the named peer (scripts/lab/peers.py) runs instead of
the daemon, the workload runs bare (not under ``tieringctl run``) and the peer's counters are read
around every run. Writes DIR/loop.json (everything) and DIR/daemon.log; prints one
summary line per run. Used by tests/lab/test_loop_lab.py, scripts/bench/p5_loop.py and
scripts/demo.py.
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

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from tieringd.kernel import procfs, sysfs, knobs  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402

EXIT_WAIT_S = 120.0          # how long an exited workload's regions may take to leave the status
RUN_DIR = "/run/tieringd"
PY = os.path.join(REPO, ".venv", "bin", "python")
SETTINGS = ("kernel.numa_balancing", "kernel.numa_balancing_promote_rate_limit_MBps",
            "mm.numa.demotion_enabled", "numa_balancing.scan_delay_ms",
            "numa_balancing.scan_period_min_ms", "numa_balancing.scan_period_max_ms")
VMSTAT = ("pgmigrate_success", "pgmigrate_fail", "numa_pages_migrated", "pgpromote_success",
          "pgdemote_kswapd", "pgdemote_direct", "numa_hint_faults", "thp_migration_success",
          "thp_migration_split", "thp_migration_fail", "compact_stall", "compact_migrate_scanned",
          "pgscan_kswapd", "pgscan_direct", "allocstall_normal", "allocstall_movable",
          "kswapd_low_wmark_hit_quickly")
KTHREADS = ("kswapd0", "kswapd1", "kcompactd0", "kcompactd1")


def kthread_cpu_s() -> dict[str, float]:
    """CPU seconds of the memory-management kernel threads (reclaim, compaction) so far."""
    out = {}
    tck = os.sysconf("SC_CLK_TCK")
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        comm = sysfs.read_text(f"/proc/{pid}/comm", "")
        if comm in KTHREADS:
            f = procfs.read_stat(int(pid)) or []
            if len(f) > 12:
                out[comm] = (int(f[14 - 3]) + int(f[15 - 3])) / tck
    return out


def kernel_settings() -> dict[str, str | None]:
    out = {}
    for name in SETTINGS:
        path, _ = knobs.resolve(name)
        out[name] = sysfs.read_text(path, None) if path else None
    return out


def status() -> dict | None:
    try:
        with open(os.path.join(RUN_DIR, "status.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def node_meminfo() -> dict[str, dict[str, int]]:
    from tieringd.memory.topology import node_meminfo
    nodes = sysfs.parse_list(sysfs.read_text("/sys/devices/system/node/online", "0"))
    return {str(n): {k: node_meminfo(n).get(k, 0) for k in ("MemTotal", "MemFree")} for n in nodes}


class DaemonProc:
    def __init__(self, log_path: str, args: list[str]):
        self.log = open(log_path, "w")
        self.t0 = time.monotonic()
        self.p = subprocess.Popen([PY, "-m", "tieringd.daemon", "--run-dir", RUN_DIR, *args],
                                  stdout=self.log, stderr=subprocess.STDOUT,
                                  preexec_fn=lambda: os.sched_setaffinity(0, {0}))
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            s = status()
            if s and s.get("pid") == self.p.pid and s["ticks"]["count"] > 0:
                self.ready_s = time.monotonic() - self.t0
                return
            if self.p.poll() is not None:
                raise RuntimeError(f"tieringd exited with {self.p.returncode} before it was ready")
            time.sleep(0.2)
        raise RuntimeError("tieringd not ready after 600 s")

    def stop(self) -> int:
        self.p.send_signal(signal.SIGTERM)
        try:
            rc = self.p.wait(120)
        except subprocess.TimeoutExpired:
            self.p.kill()
            rc = self.p.wait()
        self.log.close()
        return rc

    def cpu_s(self) -> float | None:
        fields = procfs.read_stat(self.p.pid)
        if not fields:
            return None
        tck = os.sysconf("SC_CLK_TCK")
        return (int(fields[14 - 3]) + int(fields[15 - 3])) / tck     # utime + stime (proc(5))


class Heartbeat:
    """One thread per CPU sleeping 10 ms at a time, pinned: the longest gaps between its wake-ups
    say when a whole CPU of the guest stalled (a loaded host starving the QEMU vCPU threads, or the
    kernel busy there) as against the daemon alone being slow."""

    def __init__(self):
        self.gaps: dict[int, list[tuple[float, float]]] = {}
        self.stop = threading.Event()
        for cpu in sorted(os.sched_getaffinity(0)):
            self.gaps[cpu] = []
            threading.Thread(target=self._beat, args=(cpu,), daemon=True).start()

    def _beat(self, cpu: int) -> None:
        os.sched_setaffinity(threading.get_native_id(), {cpu})
        last = time.monotonic()
        while not self.stop.is_set():
            time.sleep(0.01)
            now = time.monotonic()
            if now - last > 0.5:
                self.gaps[cpu].append((round(last, 2), round(now - last, 2)))
            last = now

    def report(self, t0: float) -> dict:
        self.stop.set()
        return {str(c): {"stalls_over_0_5_s": len(g), "stalled_s": round(sum(x[1] for x in g), 1),
                         "longest": sorted(((round(a - t0, 1), d) for a, d in g), key=lambda x: -x[1])[:5]}
                for c, g in self.gaps.items()}


def run_workload(layout: str, seconds: float, report_s: float, extra: list[str],
                 daemon: DaemonProc | None, peer=None) -> dict:
    cmd = [os.path.join(REPO, "build", "tests", "kv_workload"), "--pool", "1.2G",
           "--seconds", str(seconds), "--report", str(report_s), "--layout", layout, *extra]
    if peer is None:
        cmd = [os.path.join(REPO, ".venv", "bin", "tieringctl"), "run", "--", *cmd]
    # else bare, as a user of that peer runs it: the shim binds the pool to where it is (mbind
    # without MPOL_F_MOF), and NUMA balancing never scans a VMA whose policy lacks that flag
    env = dict(os.environ, TIERINGD_RUN_DIR=RUN_DIR)
    vm0 = procfs.read_vmstat(VMSTAT)
    kt0 = kthread_cpu_s()
    s0 = status()
    cpu0 = daemon.cpu_s() if daemon else None
    peer0 = peer.counters() if peer else None
    t0 = time.monotonic()
    beat = Heartbeat()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(p.stderr), daemon=True).start()
    lines, timeline = [], []
    for line in p.stdout:
        msg = json.loads(line)
        lines.append(msg)
        if msg["event"] in ("start", "report"):
            s = status()
            timeline.append({"t_s": msg.get("t_s", 0.0), "daemon": _slim(s)})
    rc = p.wait()
    exited_ns = time.monotonic_ns()
    pid = lines[0]["pid"] if lines else None
    removed_ns = None
    # a safety net, not a figure's limit: exit_to_removed_s is the figure; a busy host's guest
    # took more than 10 s (the proc connector's event, then a tick of a loop that shares its vCPU)
    deadline = time.monotonic() + EXIT_WAIT_S
    while daemon and time.monotonic() < deadline:
        s = status()
        hit = [e for e in (s or {}).get("exits", []) if e["pid"] == pid]
        if hit and not any(r["pid"] == pid for r in s["regions"]):
            removed_ns = hit[-1]["t_ns"]
            break
        time.sleep(0.05)
    s1 = status()
    vm1 = procfs.read_vmstat(VMSTAT)
    kt1 = kthread_cpu_s()
    cpu1 = daemon.cpu_s() if daemon else None
    peer1 = peer.counters() if peer else None
    reports = [x for x in lines if x["event"] == "report"]
    half = [r for r in reports if r["t_s"] > seconds / 2]
    return {
        "layout": layout, "rc": rc, "wall_s": round(time.monotonic() - t0, 1),
        "stderr": "".join(err)[-4000:], "start": lines[0] if lines else None,
        "end": next((x for x in lines if x["event"] == "end"), None), "reports": reports,
        "share_mean_second_half": sum(r["node0_share"] for r in half) / len(half) if half else None,
        "share_min_second_half": min((r["node0_share"] for r in half), default=None),
        "exit_to_removed_s": None if removed_ns is None else round((removed_ns - exited_ns) / 1e9, 3),
        "daemon_before": _slim(s0), "daemon_after": _slim(s1), "timeline": timeline,
        "daemon_cpu_s": None if cpu0 is None or cpu1 is None else round(cpu1 - cpu0, 2),
        "vmstat_delta": {k: vm1.get(k, 0) - vm0.get(k, 0) for k in VMSTAT},
        "kthread_cpu_s": {k: round(kt1.get(k, 0) - kt0.get(k, 0), 2) for k in kt1},
        "cpu_stalls": beat.report(t0), "peer_before": peer0, "peer_after": peer1,
    }


def _slim(s: dict | None) -> dict | None:
    """The parts of a daemon status a run report keeps."""
    if s is None:
        return None
    return {k: s.get(k) for k in ("now_ns", "cpu_s", "nodes", "tiers", "ticks", "moves", "regions",
                                  "exits", "signal_text", "plan")}


def summary(r: dict) -> str:
    m0 = (r["daemon_before"] or {}).get("moves") or {}
    m1 = (r["daemon_after"] or {}).get("moves") or {}
    t1 = (r["daemon_after"] or {}).get("ticks") or {}
    delta = lambda k: (m1.get(k) or 0) - (m0.get(k) or 0)
    failed = {k: v - (m0.get("failed_pages") or {}).get(k, 0)
              for k, v in (m1.get("failed_pages") or {}).items()}
    return json.dumps({"layout": r["layout"], "rc": r["rc"], "ok": (r["end"] or {}).get("ok"),
                       "share": r["share_mean_second_half"], "min": r["share_min_second_half"],
                       "promoted_mib": round(delta("promoted_bytes") / 2**20, 1),
                       "demoted_mib": round(delta("demoted_bytes") / 2**20, 1),
                       "failed_pages": {k: v for k, v in failed.items() if v},
                       "ticks_p50_ms": t1.get("p50_ms"), "ticks_p99_ms": t1.get("p99_ms"),
                       "overruns": t1.get("overruns"), "daemon_cpu_s": r["daemon_cpu_s"],
                       "exit_to_removed_s": r["exit_to_removed_s"]})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=80)
    ap.add_argument("--report", type=float, default=4)
    ap.add_argument("--layout", action="append", choices=("scattered", "front"))
    ap.add_argument("--runs", type=int, default=1, help="runs per layout")
    ap.add_argument("--no-daemon", action="store_true", help="the workload alone (a baseline)")
    ap.add_argument("--daemon-arg", action="append", default=[], help="passed to tieringd")
    ap.add_argument("--peer", choices=peers.NAMES, help="run this peer instead of tieringd (a baseline)")
    ap.add_argument("--promote-rate", type=int, default=16, help="kernel-tuned: promotion rate limit, MB/s")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    a = ap.parse_args(argv[:len(argv) - len(extra) - (1 if "--" in argv else 0)])
    os.makedirs(a.out, exist_ok=True)
    if not os.path.isdir("/sys/kernel/debug/sched"):
        subprocess.run(["mount", "-t", "debugfs", "none", "/sys/kernel/debug"], capture_output=True)
    out = {"release": os.uname().release, "settings_before": kernel_settings(),
           "nodes_before": node_meminfo(), "runs": []}
    daemon = peer = None
    rc = 0
    try:
        if a.peer:
            peer = peers.make(a.peer, a.out, a.promote_rate)
            out["peer"] = peer.describe()
            peer.start()
            out["peer"] = peer.describe()
            out["settings_during"] = kernel_settings()
        elif not a.no_daemon:
            daemon = DaemonProc(os.path.join(a.out, "daemon.log"), a.daemon_arg)
            out["daemon_ready_s"] = round(daemon.ready_s, 1)
            out["daemon_startup_s"] = (status() or {}).get("startup_s")
            out["settings_during"] = kernel_settings()
        for i in range(a.runs):
            for layout in a.layout or ["scattered"]:
                r = run_workload(layout, a.seconds, a.report, extra, daemon, peer)
                r["run"] = i
                out["runs"].append(r)
                print(summary(r), flush=True)
                rc |= int(r["rc"] != 0)
                with open(os.path.join(a.out, "loop.json"), "w") as f:
                    json.dump(out, f)
    except peers.PeerError as e:
        out["peer_error"] = str(e)
        print(f"kv_loop: peer {a.peer}: {e}", file=sys.stderr)
        rc = 1
    finally:
        if peer is not None:
            peer.stop()
        if daemon is not None:
            out["daemon_rc"] = daemon.stop()
            out["daemon_status_final"] = status()
        out["settings_after"] = kernel_settings()
        out["nodes_after"] = node_meminfo()
        out["knobs_state_file_left"] = os.path.exists(os.path.join(RUN_DIR, "knobs.json"))
        with open(os.path.join(a.out, "loop.json"), "w") as f:
            json.dump(out, f)
    return rc


if __name__ == "__main__":
    sys.exit(main())
