#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Guest side of the pool's two-host run (lab, ``pool`` profile, scripts/lab/pool/pair.py): each host
runs tieringd with ``[pool]`` on the shared devdax device and the KV workload under ``tieringctl run``,
and the pool's capacity moves from host a to host b, then host a dies twice.

    kv_pool.py --out DIR [--ttl 30] [--extent 32M] [--d-pool 0.9G] [--a-pool 0.9G] [--b-pool 0.9G]
               [--a2-pool 0.5G]

First both hosts run the same workload (same seed, same size; host b's starts once host a's is
filled, while a's decodes): the cold blocks b's daemon sends to the pool find a's copies there and
are kept once (docs/pool.md); both workloads end verified.

Then host a: its workload fills beyond its memory (the daemon demotes cold blocks into extents it claims),
decodes, and ends (verified): its daemon gives the extents back. It then starts a second workload,
its daemon is killed with SIGKILL while it holds extents, restarted (it claims what the workload
still maps), and the guest powers off (sysrq o) while it holds them.

Host b: once a's first workload is filled, its own larger workload fills: the pool runs short, and b
gets what a releases. It decodes until host a is gone and the lease had time to expire twice, then
its workload is stopped and verified.

The barriers are files in ``$LAB_SHARED`` (``<host>.<name>``); the lab host watches them and etcd's
claims (tests/lab/test_pool_lab.py), so the timings come from one clock. Writes DIR/pool.json.
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
sys.path.insert(0, os.path.dirname(HERE))

import kv_dax  # noqa: E402
import kv_loop  # noqa: E402
from kv_loop import DaemonProc, status  # noqa: E402

HOST = os.environ.get("LAB_HOST", "")
PEER = os.environ.get("LAB_PEER", "")
SHARED = os.environ.get("LAB_SHARED", "")
PREFIX = "/tieringd/lab/"


def mark(name: str, **info) -> None:
    with open(os.path.join(SHARED, f"{HOST}.{name}"), "w") as f:
        json.dump({"t": time.time(), **info}, f)


def wait_peer(name: str, limit_s: float = 1800) -> bool:
    """Until the peer reached ``name``; False when it ended (or failed) first."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if os.path.exists(os.path.join(SHARED, f"{PEER}.{name}")):
            return True
        if os.path.exists(os.path.join(SHARED, f"ended-{PEER}")) or \
                os.path.exists(os.path.join(SHARED, f"{PEER}.failed")):
            return False
        time.sleep(0.2)
    return False


def peer_gone() -> bool:
    return os.path.exists(os.path.join(SHARED, f"ended-{PEER}"))


def pool_state() -> dict:
    p = ((status() or {}).get("moves") or {}).get("pool") or {}
    return {k: p.get(k) for k in ("state", "why", "etcd", "extents_held", "claimed_bytes", "used_bytes",
                                  "capacity_bytes", "hosts", "claimed_total", "released_total",
                                  "shared_bytes", "saved_bytes", "shared_blocks", "dedup")}


def wait_member(limit_s: float = 300) -> dict:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        p = pool_state()
        if p["state"] == "member":
            return p
        time.sleep(0.2)
    raise RuntimeError(f"host {HOST} did not join the pool: {pool_state()}")


def write_config(a, dev: str) -> None:
    endpoints = [e for e in os.environ["TIERINGD_LAB_ETCD"].split(",") if e]
    with open(kv_dax.CONFIG, "w") as f:
        f.write(f'[pool]\nendpoints = {json.dumps(endpoints)}\nprefix = "{PREFIX}"\ndevice = "{dev}"\n'
                f'host = "{HOST}"\nlease_ttl_s = {a.ttl}\nextent_bytes = "{a.extent}"\n'
                '[dax]\nmax_write_amplification = 4\n'
                '[shim]\nbacking = "memfd"\nthp = false\n'
                '[policy]\nhigh_watermark = 0.75\nlow_watermark = 0.7\n')


class Sampler:
    """This host's pool state every second (what its daemon says), for the record."""

    def __init__(self):
        self.rows: list[dict] = []
        self.stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self.stop.wait(1.0):
            p = pool_state()
            self.rows.append({"t": round(time.monotonic() - t0, 1), "extents": len(p["extents_held"] or []),
                              "used_mib": (p["used_bytes"] or 0) >> 20, "state": p["state"]})


def workload(pool: str, seconds: float, seed: int = 1, layout: str = "scattered") -> kv_dax.Workload:
    """The KV workload; its bytes are a function of the seed and the position in the pool, so two
    hosts running the same seed and size hold the same cold blocks (a shared prefix, at scale)."""
    return kv_dax.Workload(["--pool", pool, "--fill-burst-mib", "150", "--fill-mib-s", "8",
                            "--fill-min-free-mib", "128", "--seconds", str(seconds), "--report", "5",
                            "--layout", layout, "--seed", str(seed)])


def wait_filled(w: kv_dax.Workload, limit_s: float = 900) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and w.p.poll() is None:
        if any(x["event"] == "start" for x in w.lines):
            return True
        time.sleep(0.2)
    return any(x["event"] == "start" for x in w.lines)


def summary(run: dict) -> dict:
    end = run.get("end") or {}
    return {"rc": run["rc"], "ok": end.get("ok"), "verified_bytes": end.get("verified_bytes"),
            "corrupt_bytes": end.get("corrupt_bytes"), "read_errors": end.get("read_errors"),
            "pool_bytes": (run.get("start") or {}).get("pool_bytes"), "stderr": run["stderr"][-1500:]}


def dedup_phase(a, out: dict) -> None:
    """The same workload on both hosts: host a's fills first and keeps decoding while host b's fills,
    so each cold block b sends to the pool finds a's copy there when a sent it too."""
    if not wait_peer("joined"):
        raise RuntimeError(f"host {PEER} never joined")
    if HOST == "b" and not wait_peer("d-filled"):
        raise RuntimeError("host a never filled its workload")
    # front: the requests' blocks first, the finished conversations after them, alike on both hosts
    w = workload(a.d_pool, 3600 if HOST == "a" else a.d_seconds, layout="front")
    out["d_filled"] = wait_filled(w)
    mark("d-filled", pool=pool_state())
    if HOST == "a":                 # decode until b's workload is filled and has decoded a while
        wait_peer("d-filled")
        time.sleep(a.d_seconds)
    best: dict = {}
    while w.p.poll() is None and (HOST == "b" or not os.path.exists(os.path.join(SHARED, "b.d-ended"))):
        p = pool_state()
        if (p.get("shared_bytes") or 0) >= (best.get("shared_bytes") or 0):
            best = p
        time.sleep(1.0)
    out["d_pool_most_shared"] = best
    if w.p.poll() is None:
        w.p.send_signal(signal.SIGINT)
    out["d"] = summary(w.wait(600))
    mark("d-ended", ok=out["d"]["ok"], pool=pool_state())
    wait_peer("d-ended")


def host_a(a, out: dict) -> None:
    daemon = DaemonProc(os.path.join(a.out, "daemon.log"), ["--config", kv_dax.CONFIG])
    out["joined"] = wait_member()
    mark("joined")
    dedup_phase(a, out)
    w = workload(a.a_pool, a.a_seconds)
    out["a1_filled"] = wait_filled(w)
    mark("filled", pool=pool_state())
    out["a1"] = summary(w.wait(1800))
    mark("w1-ended", ok=out["a1"]["ok"])
    # the daemon gives its extents back at its heartbeats; b takes them
    wait_peer("filled")
    w2 = workload(a.a2_pool, 3600)
    out["a2_filled"] = wait_filled(w2)
    held = pool_state()
    out["a2_held_before_kill"] = held
    daemon.p.send_signal(signal.SIGKILL)
    daemon.p.wait()
    mark("daemon-killed", extents=len(held["extents_held"] or []))
    # the lab host sees the claims go when the lease expires; wait two TTLs and some before restarting
    time.sleep(3 * a.ttl)
    daemon = DaemonProc(os.path.join(a.out, "daemon-restart.log"), ["--config", kv_dax.CONFIG])
    out["rejoined"] = wait_member()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not pool_state()["extents_held"]:
        time.sleep(0.5)
    out["held_before_poweroff"] = pool_state()
    out["a2_reports"] = len([x for x in w2.lines if x["event"] == "report"])
    # power off with the workload running and extents held: write what we have first
    with open(os.path.join(a.out, "pool.json"), "w") as f:
        json.dump(out, f, default=str)
        f.flush()
        os.fsync(f.fileno())
    mark("poweroff", extents=len(out["held_before_poweroff"]["extents_held"] or []))
    os.sync()
    with open("/proc/sys/kernel/sysrq", "w") as f:
        f.write("1")
    with open("/proc/sysrq-trigger", "w") as f:
        f.write("o")
    time.sleep(600)                 # the power-off takes the guest away here


def host_b(a, out: dict) -> None:
    daemon = DaemonProc(os.path.join(a.out, "daemon.log"), ["--config", kv_dax.CONFIG])
    out["joined"] = wait_member()
    mark("joined")
    dedup_phase(a, out)
    if not wait_peer("filled"):
        raise RuntimeError("host a never filled its first workload")
    w = workload(a.b_pool, 3600, seed=2)      # nothing in common with a's: the pool runs short
    out["b_filled"] = wait_filled(w)
    mark("filled", pool=pool_state())
    # decode while a dies; then the lease expires, twice over, before b's bytes are checked
    while not peer_gone():
        if w.p.poll() is not None:
            break
        time.sleep(0.5)
    time.sleep(3 * a.ttl)
    out["pool_after_a"] = pool_state()
    if w.p.poll() is None:
        w.p.send_signal(signal.SIGINT)
    out["b"] = summary(w.wait(600))
    out["b_reports"] = len([x for x in w.lines if x["event"] == "report"])
    mark("verified", ok=out["b"]["ok"])
    out["daemon_rc"] = daemon.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ttl", type=int, default=30)
    ap.add_argument("--extent", default="32M")
    ap.add_argument("--d-pool", default="0.9G", help="the dedup phase's workload, on both hosts")
    ap.add_argument("--d-seconds", type=float, default=30)
    ap.add_argument("--a-pool", default="0.9G")
    ap.add_argument("--a-seconds", type=float, default=20)
    ap.add_argument("--a2-pool", default="0.5G")
    ap.add_argument("--b-pool", default="0.9G", help="other bytes than a's (seed 2): the pool runs short")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    out: dict = {"host": HOST, "release": os.uname().release}
    dev = subprocess.run([os.path.join(HERE, "guest.sh"), "devdax"], capture_output=True, text=True,
                         check=True).stdout.strip()
    out["device"] = dev
    write_config(a, dev)
    sampler = Sampler()
    try:
        (host_a if HOST == "a" else host_b)(a, out)
    except BaseException as e:
        out["error"] = repr(e)
        mark("failed", error=repr(e))
        raise
    finally:
        sampler.stop.set()
        out["samples"] = sampler.rows
        out["nodes"] = kv_loop.node_meminfo()
        with open(os.path.join(a.out, "pool.json"), "w") as f:
            json.dump(out, f, default=str)
    print(json.dumps({"host": HOST, "ok": (out.get("b") or out.get("a1") or {}).get("ok")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
