#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Guest side of the kill trials (``make reliability``'s ``kill-trials``, lab ``cxl``): tieringd is
killed with SIGKILL again and again under a KV workload with checksummed buffers, restarted, and
every byte of the workload is verified after each trial.

    kill_trials.py --out DIR [--trials 100] [--pool 256M] [--seed S]

One boot: ``tieringd`` (``kv_loop.DaemonProc``, pinned to CPU 0) and ``build/tests/kv_workload``
under ``tieringctl run`` (its contents are a pure function of seed, position and write count; it
reads and checks every word it touches). Each trial is one of two kinds, in turn:

- ``migrate``: a ``migrate`` of the whole workload to node 1 (then back to node 0, trial after trial)
  is asked of the daemon; once its moves are in flight, the kill comes after a random part of a tick;
- ``tick``: the kill comes at a random time 0.2–3 s into the restarted daemon's life, whatever its
  ticks are doing then (promotions of what the last trial put on node 1, binds, the shim's moves).

Then: the daemon is started again; how long until it answers, and until it holds every region the
workload had registered (``regions`` of its pid, the same ranges) — the time to re-learn; then the
workload gets SIGUSR1 and verifies its whole pool (workers parked), and the trial's verify line
says how many bytes it checked and how many were wrong. At the end the workload verifies once more
at exit, the daemon stops with SIGTERM, and the kernel settings it borrowed must be back.

With ``--faults``, the fault cases of ``scripts/lab/fault_cases.py`` follow the trials in the same
boot, against the same workload (a full target node, memory blocks offlined under the mover, a
workload that exits, forks and execs mid-move, control clients that vanish mid-reply).

Safety limits only (a guest on a busy host is slow): 600 s for a restart, the regions or a verify.
Writes DIR/kill_trials.json and DIR/daemon-NNN.log; prints one line per trial.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import kv_loop  # noqa: E402  (first: it puts the checkout on sys.path)
import fault_cases  # noqa: E402
from kv_loop import REPO, RUN_DIR, DaemonProc  # noqa: E402

from tieringd.service.control import Client  # noqa: E402

LIMIT_S = 600                       # a safety net, never a figure
CONFIG = "/tmp/tieringd-kill.toml"


def ask(name: str, **kw):
    with Client(RUN_DIR, timeout_s=120) as c:
        return c.request(name, **kw)


def regions_of(pid: int) -> list[tuple[int, int]]:
    try:
        return sorted((r["start"], r["length"]) for r in ask("regions", pid=pid)["regions"])
    except Exception:       # the daemon is starting or gone: not yet
        return []


class Workload:
    """kv_workload under tieringctl run, its JSON lines read in a thread."""

    def __init__(self, pool: str, seed: int):
        cmd = [os.path.join(REPO, ".venv", "bin", "tieringctl"), "run", "--",
               os.path.join(REPO, "build", "tests", "kv_workload"), "--pool", pool, "--seconds", "1000000",
               "--report", "3600", "--layout", "scattered", "--seed", str(seed),
               "--ring", "4", "--context-blocks", "8"]     # prefix 16 + 32 blocks: a 128 MiB pool holds them
        env = dict(os.environ, TIERINGD_RUN_DIR=RUN_DIR, TIERINGD_CONFIG=CONFIG, PYTHONPATH=REPO)
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[dict] = []
        self.err: list[str] = []
        self.cond = threading.Condition()
        threading.Thread(target=lambda: self.err.extend(self.p.stderr), daemon=True).start()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            with self.cond:
                self.lines.append(json.loads(line))
                self.cond.notify_all()

    def wait_event(self, event: str, count: int) -> dict | None:
        """The ``count``-th line of ``event`` (1-based), once it is there; None past the limit."""
        deadline = time.monotonic() + LIMIT_S
        with self.cond:
            while True:
                got = [x for x in self.lines if x.get("event") == event]
                if len(got) >= count:
                    return got[count - 1]
                if self.p.poll() is not None or time.monotonic() > deadline:
                    return None
                self.cond.wait(1.0)

    def verify(self, n: int) -> dict | None:
        """SIGUSR1: the workload checks every byte now (the ``n``-th verify line)."""
        os.kill(self.pid, signal.SIGUSR1)
        return self.wait_event("verify", n)

    @property
    def pid(self) -> int:
        return self.lines[0]["pid"]


def wait_in_flight(limit_s: float) -> dict:
    """The daemon's status once moves are in flight (or pending), else the last one seen."""
    deadline = time.monotonic() + limit_s
    s: dict = {}
    while time.monotonic() < deadline:
        try:
            s = ask("status")
        except Exception:
            time.sleep(0.05)
            continue
        if s["moves"]["in_flight_bytes"] > 0 or s["mover"]["pending_jobs"] > 0:
            break
        time.sleep(0.02)
    return s


def kill_point(kind: str, trial: int, pid: int, r: random.Random) -> dict:
    """Bring the daemon to the trial's point of a tick; what was in flight just before the kill."""
    if kind == "migrate":
        to = 1 if trial % 4 == 0 else 0
        threading.Thread(target=lambda: _quietly(ask, "migrate", pid=pid, all=True, to=to, priority="demote"),
                         daemon=True).start()
        s = wait_in_flight(20)
        delay = r.uniform(0, (s.get("ticks") or {}).get("interval_ms", 100) / 1000)
        time.sleep(delay)
        return {"to": to, "delay_s": round(delay, 3), **_in_flight(s)}
    delay = r.uniform(0.2, 3.0)
    time.sleep(delay)
    try:
        s = ask("status")
    except Exception:
        s = {}
    return {"delay_s": round(delay, 3), **_in_flight(s)}


def _quietly(fn, *a, **kw) -> None:
    try:
        fn(*a, **kw)
    except Exception:       # the kill cuts the reply off: that is the point
        pass


def _in_flight(s: dict) -> dict:
    moves = s.get("moves") or {}
    return {"in_flight_bytes": moves.get("in_flight_bytes", 0),
            "pending_jobs": (s.get("mover") or {}).get("pending_jobs", 0),
            "tick": (s.get("ticks") or {}).get("count")}


def trial(i: int, kind: str, daemon: DaemonProc, w: Workload, regions: list, a, r: random.Random) -> tuple[dict, DaemonProc]:
    rec = {"trial": i, "kind": kind, **kill_point(kind, i, w.pid, r)}
    daemon.p.send_signal(signal.SIGKILL)
    daemon.p.wait()
    daemon.log.close()
    t_kill = time.monotonic()
    daemon = DaemonProc(os.path.join(a.out, f"daemon-{i + 1:03d}.log"), ["--config", CONFIG])
    rec["restart_ready_s"] = round(daemon.ready_s, 2)
    back: list = []
    while time.monotonic() - t_kill < LIMIT_S and w.p.poll() is None:
        back = regions_of(w.pid)
        if back == regions:
            break
        time.sleep(0.05)
    rec["regions_back"] = back == regions
    rec["regions_relearnt"] = len(back)
    rec["relearn_s_after_kill"] = round(time.monotonic() - t_kill, 2)
    v = w.verify(i + 1)
    rec["verify"] = None if v is None else {k: v.get(k) for k in ("verified_bytes", "corrupt_bytes", "read_errors",
                                                                  "verify_s", "ok")}
    return rec, daemon


def summary(trials: list[dict], end: dict | None) -> dict:
    verified = [t["verify"] for t in trials if t["verify"]]
    relearn = sorted(t["relearn_s_after_kill"] for t in trials if t["regions_back"])
    return {"trials": len(trials), "verified_trials": len(verified),
            "bytes_verified": sum(v["verified_bytes"] for v in verified) + ((end or {}).get("verified_bytes") or 0),
            "bytes_lost": sum(v["corrupt_bytes"] for v in verified) + ((end or {}).get("corrupt_bytes") or 0),
            "read_errors": sum(v["read_errors"] for v in verified),
            "kills_with_moves_in_flight": sum(1 for t in trials if t["in_flight_bytes"] > 0 or t["pending_jobs"] > 0),
            "regions_relearnt": sum(t["regions_relearnt"] for t in trials),
            "trials_all_regions_back": sum(1 for t in trials if t["regions_back"]),
            "relearn_s_median": relearn[len(relearn) // 2] if relearn else None,
            "relearn_s_max": relearn[-1] if relearn else None,
            "restart_ready_s_median": sorted(t["restart_ready_s"] for t in trials)[len(trials) // 2] if trials else None}


def save(out_dir: str, out: dict) -> None:
    out["summary"] = summary(out["trials"], out.get("end"))
    with open(os.path.join(out_dir, ".kill_trials.json"), "w") as f:
        json.dump(out, f, default=str)
    os.replace(os.path.join(out_dir, ".kill_trials.json"), os.path.join(out_dir, "kill_trials.json"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--pool", default="256M")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--faults", action="store_true", help="then the fault cases (scripts/lab/fault_cases.py)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    r = random.Random(a.seed)
    with open(CONFIG, "w") as f:
        f.write("")                 # the shipped defaults
    out: dict = {"release": os.uname().release, "seed": a.seed, "settings_before": kv_loop.kernel_settings(),
                 "trials": []}
    daemon = DaemonProc(os.path.join(a.out, "daemon-000.log"), ["--config", CONFIG])
    w = Workload(a.pool, a.seed)
    try:
        if w.wait_event("start", 1) is None:
            raise SystemExit(f"kv_workload did not start: {''.join(w.err)[-2000:]}")
        deadline = time.monotonic() + LIMIT_S
        while not regions_of(w.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        regions = regions_of(w.pid)
        out["regions"] = len(regions)
        for i in range(a.trials):
            rec, daemon = trial(i, ("migrate", "tick")[i % 2], daemon, w, regions, a, r)
            out["trials"].append(rec)
            print(json.dumps(rec), flush=True)
            save(a.out, out)        # what a guest cut short by its time limit leaves
        if a.faults:
            held = daemon
            c = fault_cases.Ctx(ask, w, lambda: held, lambda pool, seed: Workload(pool, seed), kv_loop.node_meminfo)
            c.verifies = sum(1 for x in w.lines if x.get("event") == "verify")
            out["faults"] = fault_cases.run_all(c, RUN_DIR)
    finally:
        if w.p.poll() is None:
            w.p.send_signal(signal.SIGTERM)
        out["workload_rc"] = w.p.wait(LIMIT_S)
        time.sleep(0.5)
        out["end"] = next((x for x in w.lines if x.get("event") == "end"), None)
        out["workload_stderr"] = "".join(w.err)[-3000:]
        out["daemon_rc"] = daemon.stop()
        out["settings_after"] = kv_loop.kernel_settings()
        out["summary"] = summary(out["trials"], out["end"])
        save(a.out, out)
    print(json.dumps(out["summary"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
