# SPDX-License-Identifier: Apache-2.0
"""The position factor live, in the lab (cxl profile, kernel 6.12, one boot): ``tieringd`` with
``[heat] weight_position`` > 0 and ``token_kv`` — one sequence's KV in token order, cleared first as
llama.cpp clears its KV buffer, a 512-token prompt, then decoding while every token behind is read
every 2 s — under ``tieringctl run``, unmodified. Outcomes, from the daemon's own reports:

- the region reads as token order (``tieringctl regions --json``: ``position.state`` "on") and its
  frontier follows the decoder: the block of its newest token, up to one 2 MiB huge page ahead (the
  shim backs the region with THPs, and a write fault on a THP makes the whole huge page writable);
- blocks near the frontier rank above blocks far behind it that were read as rarely — last read at
  the same time, so their recency ties and only the position factor tells them apart;
- ``tieringctl status`` says it in its region line; every byte of the buffer is intact at the end.

Times are safety limits only: the guest waits for states, never for a duration.
"""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.lab
# Seconds one boot of this module takes here: sets the order of make test's work (tests/lab_workers.py).
LAB_GROUP_S = 220

KERNEL = "6.12"
TOKEN_BYTES = 32768
TOKENS_PER_BLOCK = 8            # [blocksize] small_tokens: 256 KiB blocks
HALF_LIFE_TOKENS = 64           # [heat] position_half_life_tokens: 8 blocks
HUGE_BLOCKS = (2 << 20) // (TOKEN_BYTES * TOKENS_PER_BLOCK)    # blocks per 2 MiB huge page
NEAR_BLOCKS = 16                # near: at most this many blocks behind the frontier (factor ≥ 0.25)
FAR_BLOCKS = 40                 # far: at least this many behind (factor ≤ 2^-5)

_GUEST_PY = r'''
import json, os, signal, subprocess, sys, threading, time
from tieringd.service.control import Client

OUT, TB, TPB, HL, NEAR, FAR = sys.argv[1], *map(int, sys.argv[2:7])
RUN = "/run/tieringd"
PY = ".venv/bin/python"
CTL = [PY, "-c", "from tieringd.cli import main; main()"]     # this checkout's, whatever .venv points at
env = dict(os.environ, TIERINGD_RUN_DIR=RUN)
if not os.path.isdir("/sys/kernel/debug/sched"):
    subprocess.run(["mount", "-t", "debugfs", "none", "/sys/kernel/debug"], capture_output=True)
cfg = os.path.join(OUT, "tieringd.toml")
with open(cfg, "w") as f:
    f.write(f"[heat]\nweight_recency = 0.5\nweight_position = 0.5\nposition_half_life_tokens = {HL}\n"
            f"[blocksize]\nkv_bytes_per_token = {TB}\nsmall_tokens = {TPB}\n")
out = {"release": os.uname().release, "snapshots": []}

def save():
    with open(os.path.join(OUT, "position.json"), "w") as f:
        json.dump(out, f)

def status():
    try:
        with open(os.path.join(RUN, "status.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None

log = open(os.path.join(OUT, "daemon.log"), "w")
daemon = subprocess.Popen([PY, "-m", "tieringd.daemon", "--run-dir", RUN, "--config", cfg],
                          stdout=log, stderr=subprocess.STDOUT,
                          preexec_fn=lambda: os.sched_setaffinity(0, {0}))
deadline = time.monotonic() + 600
while not ((status() or {}).get("pid") == daemon.pid and status()["ticks"]["count"] > 0):
    if daemon.poll() is not None or time.monotonic() > deadline:
        out["error"] = f"tieringd not ready (rc {daemon.poll()})"
        save()
        sys.exit(0)
    time.sleep(0.2)

cpu = str(max(os.sched_getaffinity(0)))
wl = subprocess.Popen([*CTL, "run", "--", "taskset", "-c", cpu, "build/tests/token_kv",
                       "--tokens", "2048", "--token-bytes", str(TB), "--prompt", "512", "--rate", "10",
                       "--seconds", "900", "--sweep", "2", "--clear", "--report", "1"],
                      stdout=subprocess.PIPE, stderr=open(os.path.join(OUT, "token_kv.err"), "w"),
                      text=True, env=env)
start = json.loads(wl.stdout.readline())
out["start"] = start
pid, base = start["pid"], start["base"]
latest = {"token": 0, "sequence": 0}
def read():
    for line in wl.stdout:
        msg = json.loads(line)
        if msg["event"] == "end":
            out["end"] = msg
        else:
            latest.update(msg)
threading.Thread(target=read, daemon=True).start()

def position(c):
    for r in c.request("regions", pid=pid)["regions"]:
        if r["start"] <= base < r["start"] + r["length"]:
            return r
    return None

def ties(snap):
    """Blocks read at the same time near and far behind the frontier: (near heats, far heats)."""
    f = snap["frontier"]
    groups = {}
    for b, (h, age) in enumerate(zip(snap["heat"], snap["age_ms"])):
        if age is not None and b <= f:
            groups.setdefault(age, []).append((b, h))
    best = ([], [])
    for members in groups.values():
        near = [h for b, h in members if f - b <= NEAR]
        far = [h for b, h in members if f - b >= FAR]
        if near and far and len(near) + len(far) > sum(map(len, best)):
            best = (near, far)
    return best

c = Client(RUN)
deadline = time.monotonic() + 900
on_since = None
while time.monotonic() < deadline and "end" not in out:
    token_before = latest["token"]
    r0 = position(c)
    time.sleep(1.5)               # a plan (at least once a second) computes heat with r0's frontier
    heat = c.request("heat", pid=pid)
    r1 = position(c)
    token_after = latest["token"]
    if r0 is None or r1 is None:
        continue
    p0, p1 = r0["position"], r1["position"]
    steady = (p0["state"], p0["frontier_block"]) == (p1["state"], p1["frontier_block"])
    snap = {"token_before": token_before, "token_after": token_after, "position": p1,
            "frontier": p1["frontier_block"], "steady": steady, "sequence": latest["sequence"]}
    if p1["state"] == "on" and steady:
        # the heat reply lists every region of the pid by address, their blocks one after another
        first = sum(x["blocks"] for x in heat["regions"] if x["start"] < r1["start"])
        n = r1["blocks"]
        snap["heat"] = heat["blocks"]["heat"][first:first + n]
        snap["age_ms"] = heat["blocks"]["last_access_ms_ago"][first:first + n]
        near, far = ties(snap)
        snap["near"], snap["far"] = near, far
        on_since = on_since or time.monotonic()
    out["snapshots"].append(snap)
    del out["snapshots"][:-40]
    save()
    tracked = [s for s in out["snapshots"] if s.get("heat") is not None]
    if len(tracked) >= 10 and any(s["near"] and s["far"] for s in tracked):
        break

out["status_text"] = subprocess.run([*CTL, "status"], capture_output=True, text=True,
                                    env=env).stdout
out["regions_json"] = json.loads(subprocess.run([*CTL, "regions", "--json", "--pid",
                                                 str(pid)], capture_output=True, text=True, env=env).stdout)
os.kill(pid, signal.SIGTERM)
try:
    wl.wait(300)
except subprocess.TimeoutExpired:
    wl.kill()
time.sleep(1)
daemon.send_signal(signal.SIGTERM)
try:
    out["daemon_rc"] = daemon.wait(120)
except subprocess.TimeoutExpired:
    daemon.kill()
    out["daemon_rc"] = None
save()
'''


@pytest.fixture(scope="module")
def run(lab):
    script = (f"cat > $LAB_OUT/guest.py <<'PYEOF'\n{_GUEST_PY}\nPYEOF\n"
              f".venv/bin/python $LAB_OUT/guest.py $LAB_OUT {TOKEN_BYTES} {TOKENS_PER_BLOCK} "
              f"{HALF_LIFE_TOKENS} {NEAR_BLOCKS} {FAR_BLOCKS} > $LAB_OUT/guest.out 2>&1\nexit 0\n")
    r = lab.run(script, profile="cxl", kernel=KERNEL, timeout_s=1800)
    try:
        out = json.loads((r.out_dir / "position.json").read_text())
    except (OSError, ValueError):
        out = None
    if r.rc != 0 or out is None or "error" in out or not out.get("snapshots"):
        logs = "\n".join((r.out_dir / n).read_text()[-3000:] for n in ("guest.out", "daemon.log", "token_kv.err")
                         if (r.out_dir / n).exists())
        pytest.fail(f"{KERNEL}: rc {r.rc}, {(out or {}).get('error')}\n{logs}\n{r.stderr[-2000:]}",
                    pytrace=False)
    return out


def block_of(token: int) -> int:
    return max(token - 1, 0) // TOKENS_PER_BLOCK


def on_snapshots(run) -> list[dict]:
    return [s for s in run["snapshots"] if s.get("heat") is not None]


def test_the_region_reads_as_token_order_and_its_frontier_follows_the_decoder(run):
    snaps = on_snapshots(run)
    assert len(snaps) >= 10, [s["position"] for s in run["snapshots"]]
    snaps = [s for s in snaps if s["sequence"] == snaps[-1]["sequence"]]    # a new one starts at 0
    assert len(snaps) >= 8
    for s in snaps[-8:]:
        # a report is up to 1 s (10 tokens) old; the newest write covers its huge page
        lo, hi = block_of(s["token_before"]) - 1, block_of(s["token_after"]) + 2 + HUGE_BLOCKS
        assert lo <= s["frontier"] <= hi, (s["token_before"], s["token_after"], s["position"])
    assert snaps[-1]["frontier"] > snaps[-8]["frontier"], "the frontier advances with the decoder"
    (region,) = [r for r in run["regions_json"]["regions"]
                 if r["start"] <= run["start"]["base"] < r["start"] + r["length"]]
    assert region["position"]["state"] == "on", region["position"]


def test_blocks_near_the_frontier_rank_above_blocks_read_as_rarely_far_behind(run):
    tied = [s for s in on_snapshots(run) if s["near"] and s["far"]]
    assert tied, "no snapshot with blocks near and far behind the frontier last read at the same time"
    s = tied[-1]
    # same last access, one sharer: recency and sharing are equal, only the position factor differs:
    # at least 0.5 × (2^-2 − 2^-5) ≈ 0.11 of heat
    assert min(s["near"]) > max(s["far"]) + 0.05, (s["frontier"], s["near"], s["far"])


def test_status_says_so_and_the_buffer_is_intact(run):
    assert "position: on, frontier block" in run["status_text"], run["status_text"]
    end = run.get("end")
    assert end is not None and end["ok"] and end["read_errors"] == 0, end
    assert run["daemon_rc"] == 0
