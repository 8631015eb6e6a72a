# SPDX-License-Identifier: Apache-2.0
"""The shim's placement on real tiers (issue 5), in one boot of the cxl profile (node0 = CPUs + DRAM,
node1 = CPU-less CXL DRAM): a registry runs in the guest; an unmodified numpy program allocates and
touches a 32 MiB buffer under each policy; the region it registers is checked page by page with a
move_pages query (tieringd.kernel.numa.query_pages): slow-first → node1, fast → node0, interleave and
weighted interleave → both nodes."""
from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.lab, pytest.mark.shim]
# Seconds one boot of this module takes here: sets the order of make test's work (tests/lab_workers.py).
LAB_GROUP_S = 45


POLICIES = ("slow-first", "fast", "interleave", "weighted")

_GUEST_PY = r'''
import json, os, subprocess, sys, time
import numpy as np
from tieringd.kernel import numa

import tempfile
run_dir = tempfile.mkdtemp(prefix="tieringd-run-")   # a guest-local fs: 9p ($LAB_OUT) has no sockets
events_path = os.path.join(os.environ["LAB_OUT"], "events.jsonl")
events = open(events_path, "w")
registry = subprocess.Popen([sys.executable, "-m", "tieringd.shim.registry", "--run-dir", run_dir, "--events"],
                            stdout=events)
deadline = time.time() + 60
while not os.path.exists(os.path.join(run_dir, "registry.sock")):
    if registry.poll() is not None or time.time() > deadline:
        sys.exit(f"registry did not start (exit {registry.poll()})")
    time.sleep(0.1)

APP = """
import sys, numpy as np
a = np.ones(32 * 1024 * 1024 // 8)
print("ready", a.sum(), flush=True)
sys.stdin.readline()
"""

def registered(pid, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        with open(events_path) as f:
            for line in f:
                e = json.loads(line)
                # numpy's array (malloc); OpenBLAS's own 32 MiB mmap()ed buffer is never touched
                if e["event"] == "register" and e["pid"] == pid and e["length"] >= 32 << 20 \
                        and e["source"] in ("malloc", "calloc"):
                    return e
        time.sleep(0.2)
    return None

out = {}
for policy in sys.argv[1:]:
    env = dict(os.environ, LD_PRELOAD=os.path.abspath("build/libtieringd-shim.so"),
               TIERINGD_RUN_DIR=run_dir, TIERINGD_POLICY=policy, TIERINGD_LOG="2")
    app = subprocess.Popen([sys.executable, "-c", APP], env=env, stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready = app.stdout.readline()
    region = registered(app.pid)
    nodes = []
    if region:
        nodes = numa.query_pages(app.pid, numa.page_addresses(region["start"], 32 << 20))
    app.stdin.write("go\n")
    app.stdin.flush()
    app.wait(30)
    hist = {str(n): nodes.count(n) for n in sorted(set(nodes))}
    out[policy] = {"ready": ready.startswith("ready"), "rc": app.returncode, "region": region,
                   "nodes": hist, "log": app.stderr.read()[-2000:]}
registry.terminate()
registry.wait(10)
weights = {}
wdir = "/sys/kernel/mm/mempolicy/weighted_interleave"
if os.path.isdir(wdir):
    for f in sorted(os.listdir(wdir)):
        weights[f] = open(os.path.join(wdir, f)).read().strip()
out["weights"] = weights
out["refusals"] = [l for l in open(events_path) if '"refuse"' in l]
json.dump(out, sys.stdout)
'''


@pytest.fixture(scope="module")
def placed(lab):
    script = (f"set -e\n.venv/bin/python - {' '.join(POLICIES)} <<'PYEOF'\n{_GUEST_PY}\nPYEOF\n")
    r = lab.run(script, profile="cxl", kernel="6.12", timeout_s=400)
    assert r.rc == 0, f"guest script failed ({r.rc}):\n{r.stderr[-3000:]}"
    return json.loads(r.stdout)


def _pages(result: dict, node: int) -> int:
    return result["nodes"].get(str(node), 0)


def test_every_policy_registered_its_region(placed):
    for policy in POLICIES:
        res = placed[policy]
        assert res["ready"] and res["rc"] == 0, res
        assert res["region"] is not None, res["log"]
        assert res["region"]["policy"] == policy and res["region"]["start"] % (2 << 20) == 0
    assert placed["refusals"] == []


def test_slow_first_lands_on_the_cpu_less_node(placed):
    res = placed["slow-first"]
    assert _pages(res, 1) == 8192 and res["region"]["node"] == 1, res


def test_fast_lands_on_node0(placed):
    res = placed["fast"]
    assert _pages(res, 0) == 8192 and res["region"]["node"] == 0, res


def test_interleave_policies_use_both_nodes(placed):
    for policy in ("interleave", "weighted"):
        res = placed[policy]
        assert _pages(res, 0) > 0 and _pages(res, 1) > 0, (policy, res)
        assert _pages(res, 0) + _pages(res, 1) == 8192
    # 6.12 has weighted interleave but no "auto" weights: the (root) shim wrote bandwidth-derived
    # weights, 400 GB/s : 150 GB/s -> 10 : 4, and the pool follows them.
    w = placed["weights"]
    assert w.get("node0") == "10" and w.get("node1") == "4", w
    res = placed["weighted"]
    assert _pages(res, 0) > _pages(res, 1)
