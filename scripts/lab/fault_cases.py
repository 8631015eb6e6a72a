# SPDX-License-Identifier: Apache-2.0
"""Faults under the mover, in the kill trials' guest (``scripts/lab/kill_trials.py --faults``).

Each case brings one fault about while the daemon moves the workload's memory, then says what the
daemon reported and has the workload verify every byte (SIGUSR1):

- ``target-full``: node 1 filled by a process bound there (all but 96 MiB of its free memory), then
  the whole workload is asked onto node 1: the move must fail in part, be reported, lose nothing;
- ``offline-under-mover``: while the workload moves to node 1, half of node 1's online memory
  blocks are offlined (the kernel migrates what they hold, or refuses with EBUSY), then onlined again;
- ``workload-exits``: a second workload (128 MiB) ends with SIGTERM — it verifies its own bytes and
  exits — while the daemon moves it; its regions must leave the daemon's tables;
- ``fork-exec``: while the workload moves, it forks three children (SIGUSR2: each inherits the pool
  copy-on-write and execs ``/bin/true`` 200 ms later);
- ``client-vanishes``: control clients killed while they wait for a ``migrate`` reply, and clients
  that close after reading 100 bytes of a ``heat`` reply; then ``status`` must answer.

Every case ends with a record (``ok`` when nothing was lost and the daemon is alive and answering),
whatever happened in it: a case that raised says so in its record, and the next case still runs.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

from tieringd.kernel import sysfs

NODE1 = "/sys/devices/system/node/node1"
HOG = ("import mmap, sys, time; n = int(sys.argv[1]); m = mmap.mmap(-1, n); "
       "[m.__setitem__(slice(i, i + 1), b'x') for i in range(0, n, 4096)]; print('filled', flush=True); time.sleep(1e6)")


class Ctx:
    """What the cases share: the control client, the main workload, the daemon process."""

    def __init__(self, ask, workload, daemon, start_workload, node_meminfo):
        self.ask, self.w, self.daemon = ask, workload, daemon
        self.start_workload, self.node_meminfo = start_workload, node_meminfo
        self.verifies = 0

    def migrate_async(self, pid: int, to: int) -> dict:
        """Ask for the move in a thread; the dict gets ``reply`` or ``error`` when it comes."""
        box: dict = {}

        def run() -> None:
            try:
                box["reply"] = self.ask("migrate", pid=pid, all=True, to=to, priority="demote")["report"]
            except Exception as e:       # noqa: BLE001 — a refusal or a cut connection is the record
                box["error"] = f"{type(e).__name__}: {e}"
        box["thread"] = threading.Thread(target=run, daemon=True)
        box["thread"].start()
        return box

    def in_flight(self, limit_s: float = 20) -> int:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            s = self.ask("status")
            if s["moves"]["in_flight_bytes"] > 0 or s["mover"]["pending_jobs"] > 0:
                return s["moves"]["in_flight_bytes"]
            time.sleep(0.02)
        return 0

    def verify(self) -> dict | None:
        self.verifies += 1
        return self.w.verify(self.verifies)


def _report(box: dict, limit_s: float = 600) -> dict:
    box["thread"].join(limit_s)
    if "reply" in box:
        r = box["reply"]
        return {k: r.get(k) for k in ("target", "requested_pages", "by_reason", "process_exited", "dropped",
                                      "error", "elapsed_s")}
    return {"error": box.get("error", "no reply within the limit")}


def target_full(c: Ctx) -> dict:
    c.ask("migrate", pid=c.w.pid, all=True, to=0, priority="demote")
    free = c.node_meminfo()["1"]["MemFree"]
    size = max(free - (96 << 20), 1 << 20)       # below the watermarks a bound process meets the OOM killer
    hog = subprocess.Popen(["numactl", "--membind=1", sys.executable, "-c", HOG, str(size)],
                           stdout=subprocess.PIPE, text=True)
    filled = hog.stdout.readline().strip() == "filled"
    rec = {"hog_bytes": size, "hog_filled": filled, "node1_free_after_hog": c.node_meminfo()["1"]["MemFree"]}
    box = c.migrate_async(c.w.pid, 1)
    rec["report"] = _report(box)
    hog.kill()
    hog.wait()
    return rec


def offline_under_mover(c: Ctx) -> dict:
    blocks = sorted(n for n in os.listdir(NODE1) if n.startswith("memory") and n[6:].isdigit())
    online = [b for b in blocks if sysfs.read_text(f"{NODE1}/{b}/state", "").strip() == "online"]
    box = c.migrate_async(c.w.pid, 1)
    rec = {"in_flight_bytes": c.in_flight(), "blocks_online": len(online)}
    offlined, refused = [], {}
    for b in online[len(online) // 2:]:
        try:
            sysfs.write_text(f"{NODE1}/{b}/state", "offline")
            offlined.append(b)
        except OSError as e:
            refused[b] = e.strerror or str(e)
    rec.update(offlined=len(offlined), refused=len(refused), refusal_examples=dict(list(refused.items())[:3]))
    rec["report"] = _report(box)
    back = 0
    for b in offlined:
        try:
            sysfs.write_text(f"{NODE1}/{b}/state", "online")
            back += 1
        except OSError as e:
            rec.setdefault("online_again_failed", {})[b] = e.strerror or str(e)
    rec["onlined_again"] = back
    return rec


def workload_exits(c: Ctx) -> dict:
    w2 = c.start_workload("128M", 7)
    start = w2.wait_event("start", 1)
    if start is None:
        return {"error": f"the second workload did not start: {''.join(w2.err)[-500:]}"}
    deadline = time.monotonic() + 600
    while not c.ask("regions", pid=w2.pid)["regions"] and time.monotonic() < deadline:
        time.sleep(0.1)
    box = c.migrate_async(w2.pid, 1)
    rec = {"in_flight_bytes": c.in_flight()}
    os.kill(w2.pid, signal.SIGTERM)
    rc = w2.p.wait(600)
    end = w2.wait_event("end", 1) or {}
    rec.update(workload_rc=rc, end={k: end.get(k) for k in ("verified_bytes", "corrupt_bytes", "read_errors", "ok")})
    rec["report"] = _report(box)
    deadline = time.monotonic() + 600
    while c.ask("regions", pid=w2.pid)["regions"] and time.monotonic() < deadline:
        time.sleep(0.1)
    rec["regions_left"] = len(c.ask("regions", pid=w2.pid)["regions"])
    if rc != 0 or not end.get("ok"):
        rec["error"] = f"the second workload ended with rc {rc}: {end} {''.join(w2.err)[-300:]}"
    rec["lost_bytes"] = end.get("corrupt_bytes") or 0
    return rec


def fork_exec(c: Ctx) -> dict:
    where = c.ask("status")
    to = 1 if (where.get("nodes") or {}).get("1", {}).get("table_bytes", 0) == 0 else 0
    box = c.migrate_async(c.w.pid, to)
    rec = {"to": to, "in_flight_bytes": c.in_flight()}
    forks_before = sum(1 for x in c.w.lines if x.get("event") == "fork")
    for _ in range(3):
        os.kill(c.w.pid, signal.SIGUSR2)
        time.sleep(0.1)
    rec["report"] = _report(box)
    time.sleep(1.0)         # the children exec'd 200 ms after their fork
    rec["forks"] = sum(1 for x in c.w.lines if x.get("event") == "fork") - forks_before
    return rec


CLIENT = r'''
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1] + "/control.sock")
s.sendall(sys.argv[2].encode() + b"\n")
if sys.argv[3] == "read-some":
    s.recv(100)
    s.close()
else:
    print("sent", flush=True)
    s.recv(1)               # waits for the reply: killed before it comes
'''


def client_vanishes(c: Ctx, run_dir: str) -> dict:
    killed = cut = 0
    for i in range(6):
        to = i % 2
        req = json.dumps({"v": 1, "id": 1, "request": "migrate", "pid": c.w.pid, "all": True, "to": to})
        p = subprocess.Popen([sys.executable, "-c", CLIENT, run_dir, req, "wait"], stdout=subprocess.PIPE, text=True)
        p.stdout.readline()
        c.in_flight(5)
        p.kill()
        p.wait()
        killed += 1
        req = json.dumps({"v": 1, "id": 2, "request": "heat", "pid": c.w.pid})
        cut += subprocess.run([sys.executable, "-c", CLIENT, run_dir, req, "read-some"], timeout=600).returncode == 0
    t0 = time.monotonic()
    s = c.ask("status")
    return {"migrate_clients_killed": killed, "heat_clients_cut": cut, "status_after_s": round(time.monotonic() - t0, 3),
            "pending_migrations": (s.get("control") or {}).get("pending_migrations")}


CASES = (("target-full", target_full), ("offline-under-mover", offline_under_mover),
         ("workload-exits", workload_exits), ("fork-exec", fork_exec), ("client-vanishes", client_vanishes))


def run_all(c: Ctx, run_dir: str) -> list[dict]:
    out = []
    for name, fn in CASES:
        t0 = time.monotonic()
        try:
            rec = fn(c, run_dir) if fn is client_vanishes else fn(c)
        except Exception as e:       # noqa: BLE001 — the case's record says what broke; the next one runs
            rec = {"error": f"{type(e).__name__}: {e}"}
        v = c.verify()
        alive = c.daemon().p.poll() is None
        try:
            c.ask("status")
            answering = True
        except Exception:            # noqa: BLE001
            answering = False
        lost = (v or {}).get("corrupt_bytes") if v else None
        rec.update(case=name, seconds=round(time.monotonic() - t0, 1), daemon_alive=alive, answering=answering,
                   verify=None if v is None else {k: v.get(k) for k in ("verified_bytes", "corrupt_bytes", "read_errors", "ok")})
        rec["ok"] = bool(v and v.get("ok") and alive and answering and "error" not in rec
                         and rec.get("lost_bytes") in (None, 0) and not rec.get("regions_left"))
        rec["bytes_lost"] = (lost or 0) + (rec.get("lost_bytes") or 0)
        print(json.dumps({"fault": rec}, default=str), flush=True)
        out.append(rec)
    return out
