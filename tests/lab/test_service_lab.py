# SPDX-License-Identifier: Apache-2.0
"""The service in the sized lab (6.12, ``cxl``, each DRAM node 1 GiB), one boot: tieringd with the
metrics endpoint on, the closed loop's KV workload (a 1.2 GiB pool) under ``tieringctl run``.

- ``tieringctl top --json`` and ``stats --json``, the control socket's answers and ``/metrics`` report
  the same bytes per tier as ``move_pages`` queries of the workload's blocks, within what moved
  between the samples (the loop's verified moves and the bytes in flight; one tick is 100 ms);
- ``tieringctl heatmap --png`` draws the workload's hot set (checked here against the workload's own
  list of hot blocks; the picture is kept in the test's output folder to look at);
- ``kill -9`` of the daemon while moves are in flight, a restart: every region is back in
  ``tieringctl regions`` (waited for, with a generous limit as a safety net; how soon is a figure in the
  test's notes), and the workload finds every byte intact at exit; the kernel settings are back after
  the last stop.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.lab
# Seconds one boot of this module takes here: sets the order of make test's work (tests/lab_workers.py).
LAB_GROUP_S = 250


NODE_MIB = 1024
HEATMAP_S = 20

_GUEST_PY = r'''
import json, os, shutil, signal, subprocess, sys, threading, time, urllib.request
import numpy as np
REPO = os.getcwd()
sys.path.insert(0, REPO)
from tieringd.kernel import numa, knobs, sysfs
from tieringd.service.control import Client

OUT, HEATMAP_S = sys.argv[1], sys.argv[2]
FILL_AGE_S = 45
REGIONS_BACK_LIMIT_S = 180      # a safety net for a slow guest, not a figure: "regions back" notes how soon
RUN = "/run/tieringd"
PY, CTL = f"{REPO}/.venv/bin/python", f"{REPO}/.venv/bin/tieringctl"
ENV = dict(os.environ, TIERINGD_RUN_DIR=RUN)
CFG = f"{OUT}/tieringd.toml"
open(CFG, "w").write('[metrics]\nlisten = "127.0.0.1:9464"\n')
SETTINGS = ("kernel.numa_balancing", "kernel.numa_balancing_promote_rate_limit_MBps", "mm.numa.demotion_enabled")
out = {"events": []}
T0 = time.monotonic()

def note(what, **kw):
    out["events"].append({"t_s": round(time.monotonic() - T0, 2), "what": what, **kw})
    print(f"[{time.monotonic() - T0:7.1f}] {what} {kw if kw else ''}", file=sys.stderr, flush=True)

def settings():
    return {n: sysfs.read_text(knobs.resolve(n)[0], None) for n in SETTINGS}

def ask(name, **kw):
    with Client(RUN, timeout_s=60) as c:
        return c.request(name, **kw)

def spawn_daemon(tag):
    log = open(f"{OUT}/daemon-{tag}.log", "w")
    return subprocess.Popen([PY, "-m", "tieringd.daemon", "--run-dir", RUN, "--config", CFG], stdout=log,
                            stderr=subprocess.STDOUT, preexec_fn=lambda: os.sched_setaffinity(0, {0})), time.monotonic()

def start_daemon(tag, spawned=None, expect=None):
    """Wait for READY (what systemd waits for: the loop ticked, the lifecycle watcher and the metrics
    endpoint are up); returns the process and when its loop first answered (the control socket
    answers before READY). ``expect = (pid, regions)``: also when those regions were first all back
    (out["regions_back_at"])."""
    p, t = spawned or spawn_daemon(tag)
    first = None
    while True:
        if p.poll() is not None:
            raise SystemExit(f"tieringd ({tag}) exited with {p.returncode}")
        try:
            st = ask("status")
            if st["ticks"]["count"] >= 1:
                first = first or time.monotonic()
                if expect and "regions_back_at" not in out and \
                        sorted((r["start"], r["length"]) for r in ask("regions", pid=expect[0])["regions"]) == expect[1]:
                    out["regions_back_at"] = time.monotonic()
                if st["systemd"]["ready"] and (not expect or "regions_back_at" in out
                                               or time.monotonic() - first > REGIONS_BACK_LIMIT_S):
                    break
        except Exception:
            pass
        time.sleep(0.05)
    note(f"daemon {tag} ready", pid=p.pid, answered_s=round(first - t, 2), ready_s=round(time.monotonic() - t, 2),
         startup_s=st.get("startup_s"))
    return p, first

def ctl_json(*args):
    r = subprocess.run([CTL, *args, "--json"], env=ENV, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise SystemExit(f"tieringctl {' '.join(args)}: rc {r.returncode}: {r.stderr[-2000:]}")
    return json.loads(r.stdout.splitlines()[0]) if args[0] == "top" else json.loads(r.stdout)

def of_pid(doc, pid, what):
    mine = [p for p in doc["processes"] if p["pid"] == pid]
    if not mine:
        raise SystemExit(f"{what}: no pid {pid} in {json.dumps(doc)[:3000]}")
    return mine[0]

def metrics(pid):
    """The pid's bytes per tier from /metrics. A loop too busy to answer a scrape in time gets the
    previous snapshot served, and before the first one there is none: the scrape then holds no
    tieringd_ rows (fresh-check 2026-12-03: every tier 0 while the heatmap ran), and is asked again."""
    deadline = time.monotonic() + 60
    while True:
        text = urllib.request.urlopen("http://127.0.0.1:9464/metrics", timeout=60).read().decode()
        if "tieringd_snapshot_age_seconds" in text or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    got = {}
    for line in text.splitlines():
        if line.startswith("tieringd_process_tier_bytes{") and f'pid="{pid}"' in line:
            tier = line.split('tier="')[1].split('"')[0]
            got[tier] = float(line.rsplit(" ", 1)[1])
    return got

def query(pid, heat, per_block=32):
    """Bytes per node of the daemon's blocks, by move_pages queries of per_block pages each; and
    the share of blocks whose queried majority node is the node the daemon holds for them."""
    addrs = np.asarray(heat["blocks"]["address"], np.uint64)
    sizes = np.asarray(heat["blocks"]["size_bytes"], np.int64)
    held = np.asarray(heat["blocks"]["node"], np.int64)
    pages = [a + (np.arange(per_block, dtype=np.uint64) * np.uint64(max(s // per_block, 4096)) // 4096 * 4096)
             for a, s in zip(addrs, sizes)]
    st = np.asarray(numa.query_pages(pid, np.concatenate(pages).tolist()), np.int64).reshape(len(addrs), per_block)
    by_node, agree, known = {}, 0, 0
    for i in range(len(addrs)):
        row = st[i][st[i] >= 0]
        if len(row) == 0:
            continue
        known += 1
        nodes, counts = np.unique(row, return_counts=True)
        for n, c in zip(nodes.tolist(), counts.tolist()):
            by_node[str(n)] = by_node.get(str(n), 0.0) + sizes[i] * c / len(row)
        agree += int(nodes[np.argmax(counts)] == held[i])
    return by_node, agree, known

def sample(pid, label, cli=False):
    """One round, in-process and as fast as it goes: what the daemon reports, and the kernel's view."""
    s0 = ask("status")
    procs = ask("processes")
    stats = ask("stats")
    met = metrics(pid)
    heat, off = None, 0
    while True:
        part = ask("heat", pid=pid, offset=off)
        if heat is None:
            heat = part
        else:
            for k in heat["blocks"]:
                heat["blocks"][k] += part["blocks"][k]
        off += part["count"]
        if not part["truncated"]:
            break
    q_bytes, agree, known = query(pid, heat)
    s1 = ask("status")
    me = of_pid(procs, pid, "processes")
    held_by_node = {}
    for n, sz in zip(heat["blocks"]["node"], heat["blocks"]["size_bytes"]):
        held_by_node[str(n)] = held_by_node.get(str(n), 0) + sz
    moved = lambda s: s["moves"]["promoted_bytes"] + s["moves"]["demoted_bytes"]
    rec = {"label": label, "ticks": [s0["ticks"]["count"], s1["ticks"]["count"]],
           "moved_between_bytes": moved(s1) - moved(s0),
           "in_flight_bytes": max(s0["moves"]["in_flight_bytes"], s1["moves"]["in_flight_bytes"]),
           "processes_bytes_by_tier": me["bytes_by_tier"], "processes_bytes_by_node": me["bytes_by_node"],
           "stats_bytes_by_tier": stats["managed_bytes_by_tier"], "metrics_bytes_by_tier": met,
           "heat_bytes_by_node": held_by_node, "query_bytes_by_node": q_bytes,
           "blocks": len(heat["blocks"]["address"]), "blocks_agree": agree, "blocks_known": known,
           "block_bytes": max(heat["blocks"]["size_bytes"]) if heat["blocks"]["size_bytes"] else 0}
    out.setdefault("samples", []).append(rec)
    note(f"sample {label}", ticks=rec["ticks"], agree=f"{agree}/{known}", moved_mib=round(rec["moved_between_bytes"] / 2**20, 1))
    if not cli:
        return
    # the CLI itself (a process start each under TCG: tens of seconds), then what moved meanwhile
    rec["top_json"] = of_pid(ctl_json("top", "-n", "1"), pid, "tieringctl top --json")["bytes_by_tier"]
    rec["stats_json"] = ctl_json("stats")["managed_bytes_by_tier"]
    s2 = ask("status")
    rec["cli_moved_between_bytes"] = moved(s2) - moved(s0)
    rec["cli_in_flight_bytes"] = max(rec["in_flight_bytes"], s2["moves"]["in_flight_bytes"])
    note(f"tieringctl top and stats {label}", cli_moved_mib=round(rec["cli_moved_between_bytes"] / 2**20, 1))

if not os.path.isdir("/sys/kernel/debug/sched"):
    subprocess.run(["mount", "-t", "debugfs", "none", "/sys/kernel/debug"], capture_output=True)
out["settings_before"] = settings()
spawned = spawn_daemon("first")
# The workload starts beside the daemon (its shim registers once the registry socket appears) and
# runs until SIGTERM, then verifies every byte: under TCG a CLI start takes tens of seconds, and a
# fixed --seconds ran out before the checks did.
kv = subprocess.Popen([CTL, "run", "--", f"{REPO}/build/tests/kv_workload", "--pool", "1.2G", "--seconds",
                       "3600", "--report", "4", "--layout", "scattered"], env=ENV,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
daemon, _ = start_daemon("first", spawned)
out["settings_during"] = settings()
start = json.loads(kv.stdout.readline())
out["start"] = start
pid = start["pid"]
kv_lines, kv_err = [], []
threading.Thread(target=lambda: kv_lines.extend(json.loads(x) for x in kv.stdout), daemon=True).start()
threading.Thread(target=lambda: kv_err.extend(kv.stderr), daemon=True).start()
note("workload started", pid=pid)
T_STARTED = time.monotonic()
while not ask("regions", pid=pid)["regions"]:
    time.sleep(0.1)
regions = sorted((r["start"], r["length"]) for r in ask("regions", pid=pid)["regions"])
out["regions_first"] = regions
note("registered", regions=len(regions))
def main_part():
    global daemon
    # matplotlib's font cache, built on the host by the fixture: the guest's home is read-only, and
    # building it there takes minutes under TCG
    shutil.copytree(f"{REPO}/build/lab/mplconfig", f"{OUT}/mplconfig")
    # The pool's fill is the never-read blocks' one access: the picture is taken once it is
    # FILL_AGE_S old (over two of the heat's 19 s half-lives), so what it shows hot is what stays
    # read. Begun 7 s after the start (once CLI starts got quicker, lab.py's cached trees), the
    # never-read blocks still held 0.52 of heat from it and the second half read 0.88 against 0.32.
    time.sleep(max(0.0, T_STARTED + FILL_AGE_S - time.monotonic()))
    note("fill aged", age_s=round(time.monotonic() - T_STARTED, 1))
    heatmap = subprocess.Popen([CTL, "heatmap", "--pid", str(pid), "--seconds", HEATMAP_S, "--interval", "1",
                                "--png", f"{OUT}/heatmap.png", "--json"], env=dict(ENV, MPLCONFIGDIR=f"{OUT}/mplconfig"),
                               stdout=open(f"{OUT}/heatmap.json", "w"), stderr=open(f"{OUT}/heatmap.err", "w"))
    time.sleep(5)
    sample(pid, "first daemon, heatmap running")
    heatmap.wait()
    note("heatmap written", rc=heatmap.returncode)
    sample(pid, "first daemon", cli=True)
    # kill -9 during heavy migration: the whole process to node 1 through the daemon (minutes at the
    # lab mover's rate; the reply would come when it is done, the kill comes first)
    def migrate_all():
        try:
            ask("migrate", pid=pid, all=True, to=1, priority="demote")
        except Exception:
            pass
    threading.Thread(target=migrate_all, daemon=True).start()
    deadline = time.monotonic() + 60
    inflight = 0
    while time.monotonic() < deadline:
        s = ask("status")
        inflight = s["moves"]["in_flight_bytes"]
        if inflight > 0 and s["mover"]["pending_jobs"] > 0:
            break
        time.sleep(0.05)
    out["killed_with_in_flight_bytes"] = inflight
    out["killed_with_pending_jobs"] = s["mover"]["pending_jobs"]
    out["moves_before_kill"] = s["moves"]
    daemon.kill()
    daemon.wait()
    t_kill = time.monotonic()
    note("daemon killed", in_flight_mib=round(inflight / 2**20, 1))
    daemon, answered = start_daemon("restarted", expect=(pid, regions))
    while True:
        back = sorted((r["start"], r["length"]) for r in ask("regions", pid=pid)["regions"])
        if back == regions or time.monotonic() - answered > REGIONS_BACK_LIMIT_S:
            break
        time.sleep(0.02)
    out["regions_back"] = back == regions
    back_at = out.pop("regions_back_at", time.monotonic())     # seen while waiting for READY, or now
    out["regions_back_s_after_answer"] = round(back_at - answered, 3)
    out["regions_back_s_after_kill"] = round(back_at - t_kill, 3)
    note("regions back", after_answer_s=out["regions_back_s_after_answer"], after_kill_s=out["regions_back_s_after_kill"])
    out["restarted_signal"] = ask("status")["signal_text"]
    out["regions_cli"] = sorted((r["start"], r["length"]) for r in ctl_json("regions", "--pid", str(pid))["regions"])
    time.sleep(4)
    sample(pid, "restarted daemon")

try:
    main_part()
finally:
    if kv.poll() is not None:
        note("workload ended", rc=kv.returncode, stderr="".join(kv_err)[-2000:], last=kv_lines[-2:])
    out["dmesg_tail"] = subprocess.run(["dmesg"], capture_output=True, text=True).stdout[-4000:]
    json.dump(out, open(f"{OUT}/service.json", "w"))
kv.send_signal(signal.SIGTERM)
kv.wait(600)
time.sleep(0.5)
out["workload_rc"] = kv.returncode
out["workload_stderr"] = "".join(kv_err)[-3000:]
out["end"] = next((x for x in kv_lines if x.get("event") == "end"), None)
out["reports"] = [x for x in kv_lines if x.get("event") == "report"]
daemon.send_signal(signal.SIGTERM)
out["daemon_rc"] = daemon.wait(120)
out["settings_after"] = settings()
json.dump(out, open(f"{OUT}/service.json", "w"))
note("done")
'''


@pytest.fixture(scope="module")
def run(lab):
    mpl = lab.repo / "build" / "lab" / "mplconfig"
    subprocess.run([sys.executable, "-c", "import matplotlib.font_manager"], check=True,
                   env=dict(os.environ, MPLCONFIGDIR=str(mpl)))
    script = (f".venv/bin/python - $LAB_OUT {HEATMAP_S} > $LAB_OUT/guest.out 2> $LAB_OUT/guest.err "
              f"<<'PYEOF'\n{_GUEST_PY}\nPYEOF\n")
    r = lab.run(script, profile="cxl", kernel="6.12", timeout_s=1800, node_mib=NODE_MIB)
    keep = lab.repo / "build" / "lab" / "service"      # pytest's own temporary folders get pruned
    shutil.rmtree(keep, ignore_errors=True)
    shutil.copytree(r.out_dir, keep)
    err = (r.out_dir / "guest.err").read_text() if (r.out_dir / "guest.err").exists() else ""
    (keep / "dmesg").write_text(r.dmesg or "")
    assert r.rc == 0, err[-4000:] + r.stderr[-2000:]
    doc = json.loads((r.out_dir / "service.json").read_text())
    doc["out_dir"] = str(keep)
    print(f"\nservice lab output (heatmap.png, logs): {keep}")
    return doc


def tolerance(s: dict, cli: bool = False) -> float:
    """What may differ between samples taken one after the other: the bytes the loop verified as
    moved between them, the bytes in flight (moved by the kernel, not yet verified), two blocks."""
    if cli:
        return s["cli_moved_between_bytes"] + s["cli_in_flight_bytes"] + 2 * s["block_bytes"]
    return s["moved_between_bytes"] + s["in_flight_bytes"] + 2 * s["block_bytes"]


def tiers_of_nodes(by_node: dict) -> dict:
    # the cxl profile: node 0 DRAM with the CPUs, node 1 CPU-less CXL DRAM (docs/lab.md)
    return {"dram": by_node.get("0", 0.0), "cxl-dram": by_node.get("1", 0.0)}


def test_reports_metrics_and_move_pages_agree_on_bytes_per_tier(run):
    assert len(run["samples"]) == 3 and sum("top_json" in s for s in run["samples"]) == 1
    for s in run["samples"]:
        tol = tolerance(s)
        kernel = tiers_of_nodes(s["query_bytes_by_node"])
        for what in ("processes_bytes_by_tier", "stats_bytes_by_tier", "metrics_bytes_by_tier", "top_json",
                     "stats_json"):
            if what not in s:
                continue
            t = tolerance(s, cli=what.endswith("_json"))
            for tier in ("dram", "cxl-dram"):
                got = s[what].get(tier, 0.0)
                assert abs(got - kernel[tier]) <= t, (s["label"], what, tier, got, kernel[tier], t)
        # block by block: the node the daemon holds is where move_pages finds most of the block
        assert s["blocks_agree"] >= s["blocks_known"] - tol / s["block_bytes"], s
        assert s["blocks_known"] >= 0.95 * s["blocks"]


def test_heatmap_png_shows_the_hot_set(run):
    png = run["out_dir"] + "/heatmap.png"
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    hm = json.load(open(run["out_dir"] + "/heatmap.json"))
    start = run["start"]
    bb = start["block_bytes"]
    hot = set(start["prefix"]) | {b for r in start["requests"] for b in r}
    addr = hm["blocks"]["address"]
    size = hm["blocks"]["size_bytes"]

    def column(i: int) -> int | None:     # the daemon's block holding the middle of workload block i
        a = start["pool_addr"] + i * bb + bb // 2
        return next((c for c, (x, n) in enumerate(zip(addr, size)) if x <= a < x + n), None)

    heat = [[v for v in row] for row in hm["heat"][len(hm["heat"]) // 2:]]    # the second half
    mean = lambda cols: sum(row[c] or 0 for row in heat for c in cols) / max(1, len(heat) * len(cols))
    prefix = [c for c in (column(i) for i in start["prefix"]) if c is not None]
    cold = [c for c in (column(i) for i in range(start["blocks"]) if i not in hot) if c is not None]
    assert prefix and cold
    assert mean(prefix) > 0.3 and mean(prefix) > 3 * mean(cold), (mean(prefix), mean(cold))


def test_kill_9_during_migration_then_restart_loses_nothing(run):
    assert run["killed_with_in_flight_bytes"] > 0, "no move was in flight at the kill"
    assert run["regions_back"], "the restarted daemon did not re-learn every region"
    assert run["regions_cli"] == run["regions_first"]          # `tieringctl regions` says the same
    # How soon the regions are back is a figure (note "regions back": 0.25 s with one guest, 2.5 s with
    # two side by side, 5.8 s on a busy machine), not a check: the shim's inotify watch wakes it when the
    # socket appears, and the guest waits for the regions with REGIONS_BACK_LIMIT_S as a safety net.
    assert "restored after an earlier run" in run["restarted_signal"]
    end = run["end"]
    assert run["workload_rc"] == 0 and end and end["ok"] and end["corrupt_bytes"] == 0, run["workload_stderr"]
    assert all(r["read_errors"] == 0 for r in run["reports"])
    assert run["daemon_rc"] == 0
    assert run["settings_after"] == run["settings_before"]
