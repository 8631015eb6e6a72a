#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Load: 1,000 registered processes and 100,000 regions against a real tieringd.

    python scripts/reliability/load.py [--json OUT] [--quick] [--seed S] [--processes N] [--regions M]

The part forks N processes (``--quick``: 50). Each maps M × 2 MiB of anonymous memory (100 by
default; not touched: the registry verifies mappings, not pages, and 200 GB would not fit) and
speaks the registry protocol the shim speaks over its own connection: HELLO with its own pid, then
one REGISTER per 2 MiB region — the daemon checks each against the process's ``/proc/PID/maps``.
They stay connected until the part lets them go, and count every ERROR the registry sends them.

The daemon starts with the soft open-files limit systemd gives a service that does not set one
(1024), as the shipped unit does not: every shim holds a connection and a pidfd, so 1,000 shims are
2,000 descriptors (the daemon raises its soft limit to the hard one at start).

Figures: registrations per second (from the first fork to the registry holding every region) and
until the block table holds their blocks; the tick at that block count (mean over a window of
ticks, by phase, from the daemon's own accounting) beside P4's policy tick on a table of the same
block count (``scripts/bench/p4_policy_tick.py``, run afterwards on its own); the daemon's CPU
share over the window; ``status`` latency at that region count; RSS growth per region; how long
the daemon takes to let every region go once the processes exit. Nothing here is asserted as a
time: the part holds when every region was accepted, every one released, and the daemon lived
through it without a traceback.
"""
from __future__ import annotations

import gc
import json
import mmap
import os
import select
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, HostDaemon, arguments, result, seed_of, skip_unless_root, write  # noqa: E402

from tieringd.kernel import procfs  # noqa: E402
from tieringd.shim import protocol as P  # noqa: E402

MiB = 1 << 20
REGION_BYTES = 2 * MiB
SERVICE_NOFILE = 1024        # systemd's DefaultLimitNOFILE soft limit (since v240) for a unit without LimitNOFILE
TITLE = "load: registered processes and regions against a real daemon"


def connect(path: str) -> socket.socket:
    """As the shim connects: non-blocking, and again a little later while the daemon's listen
    backlog is full (EAGAIN: a thousand processes starting at once overflow it)."""
    deadline = time.monotonic() + 300
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK)
        try:
            s.connect(path)
            s.settimeout(120)
            return s
        except BlockingIOError:
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def child(path: str, regions: int, release_r: int, results_w: int) -> None:
    """One registered process (never returns). Reports ``pid errors first-error`` on ``results_w``
    once ``release_r`` reads end-of-file."""
    errors, first = 0, ""
    try:
        area = mmap.mmap(-1, (regions + 1) * REGION_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        import ctypes
        base = (ctypes.addressof(ctypes.c_char.from_buffer(area)) + REGION_BYTES - 1) & ~(REGION_BYTES - 1)
        s = connect(path)
        s.send(P.Hello(pid=os.getpid(), min_bytes=REGION_BYTES, agent="load", seq=1).encode())
        for i in range(regions):
            s.send(P.Register(region_id=i + 1, start=base + i * REGION_BYTES, length=REGION_BYTES,
                              source=P.Source.MMAP, seq=i + 2).encode())
        while True:             # replies (CONFIG, ERROR) until the part lets this process go
            ready, _, _ = select.select([s, release_r], [], [])
            if release_r in ready:
                break
            msg = P.decode(s.recv(P.MAX_RECORD + 1))
            if isinstance(msg, P.Error):
                errors += 1
                first = first or msg.message
    except Exception as e:      # noqa: BLE001 — said to the part, which counts it as an error
        errors += 1
        first = first or f"{type(e).__name__}: {e}"
    os.write(results_w, f"{os.getpid()} {errors} {first[:200]}\n".encode())
    os._exit(0)


def spawn(path: str, processes: int, regions: int) -> tuple[list[int], int, int]:
    """Fork the processes; (pids, the write end whose closing releases them, the results' read end)."""
    release_r, release_w = os.pipe()
    results_r, results_w = os.pipe()
    gc.collect()
    gc.freeze()                 # the children's collector leaves the parent's objects (and pages) alone
    pids = []
    for _ in range(processes):
        pid = os.fork()
        if pid == 0:
            gc.disable()
            os.close(release_w)
            os.close(results_r)
            child(path, regions, release_r, results_w)
        pids.append(pid)
    os.close(release_r)
    os.close(results_w)
    return pids, release_w, results_r


def held(d: HostDaemon) -> tuple[int, int, int]:
    """(processes, regions, blocks) the daemon holds for this part's processes (agent ``load``)."""
    procs = [p for p in d.ask("processes", timeout_s=300)["processes"] if p.get("agent") == "load"]
    return len(procs), sum(p["regions"] for p in procs), sum(p["blocks"] for p in procs)


def cpu_s(pid: int) -> float:
    f = procfs.read_stat(pid) or []
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK") if len(f) > 12 else 0.0


def timed_status(d: HostDaemon) -> tuple[dict, float]:
    t0 = time.monotonic()
    doc = d.ask("status", timeout_s=600)
    return doc, time.monotonic() - t0


def tick_window(d: HostDaemon, seconds: float) -> dict:
    """The daemon's ticks over ``seconds`` at the present load: mean per phase from its own totals."""
    a, status_a_s = timed_status(d)
    cpu_a, t_a = cpu_s(d.pid), time.monotonic()
    time.sleep(seconds)
    b, status_b_s = timed_status(d)
    cpu_b, t_b = cpu_s(d.pid), time.monotonic()
    ta, tb = a["ticks"], b["ticks"]
    n = tb["count"] - ta["count"]
    phases = {p: round((tb["phase_total_ms"][p] - ta["phase_total_ms"].get(p, 0.0)) / n, 2) if n else None
              for p in tb["phase_total_ms"]}
    return {"ticks": n, "tick_mean_ms": round(sum(v for v in phases.values() if v), 2) if n else None,
            "phases_mean_ms": phases, "overruns": tb["overruns"] - ta["overruns"],
            "interval_ms": tb.get("interval_ms"), "daemon_cpu_share": round((cpu_b - cpu_a) / (t_b - t_a), 3),
            "status_s": [round(status_a_s, 3), round(status_b_s, 3)],
            "status_region_count": b.get("region_count")}


def p4_tick(blocks: int) -> dict:
    """P4's steady policy tick (CPU ms, median) on a table of ``blocks`` blocks, run on its own."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "p4.json"
        p = subprocess.run([sys.executable, str(REPO / "scripts" / "bench" / "p4_policy_tick.py"), "--json",
                            str(out), "--blocks", str(max(blocks, 4096)), "--repeat", "3"], cwd=REPO,
                           capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
        if p.returncode != 0:
            return {"error": (p.stderr or p.stdout)[-300:]}
        summary = json.loads(out.read_text())["summary"]
    # P4 builds its table in regions of 4096 blocks: the block count it names is its own
    tick = {k: v for k, v in summary.items() if k.startswith("steady_") and k.endswith("_cpu_ms")
            and "sharing" not in k}
    scan = [v for k, v in summary.items() if k.endswith("_sharing_scan_ms")]
    return {"blocks": int(next(iter(tick)).split("_")[1]) if tick else None,
            "steady_cpu_ms": next(iter(tick.values()), None), "sharing_scan_ms": scan[0] if scan else None}


def wait_until(what, predicate, limit_s: float, every_s: float = 0.5) -> tuple[float | None, object]:
    """Seconds until ``predicate(what())`` (None past the safety limit) and the last value seen."""
    t0 = time.monotonic()
    while True:
        value = what()
        if predicate(value):
            return time.monotonic() - t0, value
        if time.monotonic() - t0 > limit_s:
            return None, value
        time.sleep(every_s)


def measure(d: HostDaemon, nproc: int, per: int, window_s: float, figures: dict) -> list[str]:
    """Register, measure, release: fills ``figures``; what went wrong."""
    regions = nproc * per
    figures["daemon_ready_s"] = round(d.wait_ready(), 2)
    time.sleep(1.0)
    rss0 = d.rss_bytes() or 0
    figures["idle"] = tick_window(d, min(window_s, 5.0))
    t0 = time.monotonic()
    pids, release_w, results_r = spawn(str(d.run_dir / P.SOCKET_NAME), nproc, per)
    figures["fork_s"] = round(time.monotonic() - t0, 2)
    # safety limits only: the figures are the seconds it took
    reg_s, last = wait_until(lambda: held(d), lambda v: v[1] >= regions or not d.alive(), 1800)
    figures["registered_s"] = None if reg_s is None else round(time.monotonic() - t0, 2)
    table_s, last = wait_until(lambda: held(d), lambda v: v[2] >= v[1] >= regions or not d.alive(), 600)
    figures["in_table_s"] = None if table_s is None else round(time.monotonic() - t0, 2)
    figures.update(held_processes=last[0], held_regions=last[1], held_blocks=last[2])
    if figures["registered_s"]:
        figures["registrations_per_s"] = round(last[1] / figures["registered_s"])
        figures["processes_per_s"] = round(last[0] / figures["registered_s"], 1)
    figures["loaded"] = tick_window(d, window_s)
    rss1 = d.rss_bytes() or 0
    figures.update(rss_before_mb=round(rss0 / MiB, 1), rss_loaded_mb=round(rss1 / MiB, 1),
                   rss_per_region_bytes=round((rss1 - rss0) / max(last[1], 1)))
    t1 = time.monotonic()
    os.close(release_w)
    with os.fdopen(results_r) as f:
        reports = f.read().splitlines()
    for pid in pids:
        os.waitpid(pid, 0)
    gone_s, after = wait_until(lambda: held(d), lambda v: v[1] == 0 or not d.alive(), 600)
    figures["released_s"] = None if gone_s is None else round(time.monotonic() - t1, 2)
    figures["held_after_exit"] = after[1]
    bad = [r for r in reports if r.split(" ", 2)[1:2] != ["0"]]
    figures.update(reports=len(reports), processes_with_errors=len(bad))
    errors = [f"process {r}" for r in bad[:5]]
    if len(reports) != nproc:
        errors.append(f"{len(reports)} of {nproc} processes reported")
    if last[1] != regions:
        errors.append(f"the daemon held {last[1]} of {regions} regions")
    if after[1]:
        errors.append(f"{after[1]} regions held after their processes exited")
    return errors


def main() -> int:
    ap = arguments(__doc__)
    ap.add_argument("--processes", type=int, default=None, help="registered processes (default 1000; quick 50)")
    ap.add_argument("--regions", type=int, default=100, help="2 MiB regions per process")
    ap.add_argument("--window-s", type=float, default=None, help="seconds of ticks measured (30; quick 5)")
    args = ap.parse_args()
    skipped = skip_unless_root(args, "load", TITLE, "regions")
    if skipped is not None:
        return skipped
    seed = seed_of(args, "load")      # nothing random here: printed so that every part's record has one
    nproc = args.processes or (50 if args.quick else 1000)
    window_s = args.window_s or (5.0 if args.quick else 30.0)
    d = HostDaemon(tag="load", nofile=SERVICE_NOFILE)
    figures: dict = {"processes": nproc, "regions_per_process": args.regions, "region_bytes": REGION_BYTES,
                     "daemon_nofile_soft": SERVICE_NOFILE}
    try:
        try:
            errors = measure(d, nproc, args.regions, window_s, figures)
        except (OSError, ConnectionError, RuntimeError) as e:   # a daemon that stops answering
            errors = [f"the part stopped: {type(e).__name__}: {e}"]
        alive, tracebacks = d.alive(), d.tracebacks()
        rc = d.stop() if alive else d.proc.returncode
    finally:
        d.cleanup(keep_log=REPO / "build" / "reliability" / "load-daemon.log")
    figures["p4"] = p4_tick(figures.get("held_blocks", 0))
    figures["daemon_rc"] = rc
    crashes = (0 if alive else 1) + len(tracebacks)
    loaded, p4 = figures.get("loaded") or {}, figures["p4"]
    print(f"load: {nproc} processes, {figures.get('held_regions')} regions ({figures.get('held_blocks')} blocks) "
          f"registered in {figures.get('registered_s')} s ({figures.get('registrations_per_s')}/s); tick "
          f"{loaded.get('tick_mean_ms')} ms mean over {loaded.get('ticks')} ticks (P4 at {p4.get('blocks')} blocks: "
          f"{p4.get('steady_cpu_ms')} ms), daemon CPU {loaded.get('daemon_cpu_share')}, status {loaded.get('status_s')} s; "
          f"RSS {figures.get('rss_before_mb')} → {figures.get('rss_loaded_mb')} MB "
          f"({figures.get('rss_per_region_bytes')} B/region); released in {figures.get('released_s')} s", flush=True)
    for e in errors + tracebacks[:5]:
        print(f"load: {e}", flush=True)
    return write(args, result("load", TITLE, tried=figures.get("held_regions") or 0, unit="regions",
                              ok=not errors and not crashes and rc == 0, crashes=crashes, seed=seed,
                              figures=figures, cases=errors + tracebacks[:20]))


if __name__ == "__main__":
    sys.exit(main())
