# SPDX-License-Identifier: Apache-2.0
"""The closed loop's workload (tests/progs/kv_workload.c) in the sized lab: cxl profile, each DRAM
node 1 GiB, a 1.2 GiB pool that cannot fit in node0. One boot; outcomes only — the JSON reports
arrive with their fields, every byte is intact at exit, and a byte changed behind the workload's back
is found (exit 3, the offset named). Shares of blocks on node 0 are the loop's test to assert.
"""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.lab
# Seconds one boot of this module takes here: sets the order of make test's work (tests/lab_workers.py).
LAB_GROUP_S = 70


NODE_MIB = 1024
SECONDS = 16
REPORT_S = 4

_GUEST_PY = r'''
import json, subprocess, sys
SECONDS, REPORT_S = sys.argv[1], sys.argv[2]
out = {}

def run(layout, corrupt=False):
    p = subprocess.Popen(["build/tests/kv_workload", "--pool", "1.2G", "--seconds", SECONDS,
                          "--report", REPORT_S, "--layout", layout, "--wait"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    start = json.loads(p.stdout.readline())
    flipped = None
    if corrupt:    # one byte of a block nothing reads (cold): only the final verification can see it
        hot = set(start["prefix"]) | {b for r in start["requests"] for b in r}
        cold = next(b for b in range(start["blocks"]) if b not in hot)
        off = cold * start["block_bytes"] + 4097
        with open(f"/proc/{start['pid']}/mem", "r+b") as m:
            m.seek(start["pool_addr"] + off)
            b = m.read(1)
            m.seek(start["pool_addr"] + off)
            m.write(bytes([b[0] ^ 0x5a]))
        flipped = off
    p.stdin.write("go\n"); p.stdin.flush()
    lines = [json.loads(x) for x in p.stdout]
    return {"start": start, "lines": lines, "rc": p.wait(), "flipped": flipped}

out["scattered"] = run("scattered")
out["front"] = run("front", corrupt=True)
out["nodes"] = open("/sys/devices/system/node/online").read().strip()
json.dump(out, sys.stdout)
'''


@pytest.fixture(scope="module")
def runs(lab):
    script = (f"echo 0 > /proc/sys/kernel/numa_balancing\n"
              f".venv/bin/python - {SECONDS} {REPORT_S} > $LAB_OUT/kv.json 2> $LAB_OUT/kv.err "
              f"<<'PYEOF'\n{_GUEST_PY}\nPYEOF\n")
    r = lab.run(script, profile="cxl", kernel="6.12", timeout_s=900, node_mib=NODE_MIB)
    assert r.rc == 0, r.stderr[-3000:]
    try:
        return json.loads((r.out_dir / "kv.json").read_text())
    except (OSError, ValueError):
        pytest.fail("no JSON from the guest:\n" + (r.out_dir / "kv.err").read_text()[-3000:],
                    pytrace=False)


def test_the_pool_does_not_fit_in_node0(runs):
    start = runs["scattered"]["start"]
    assert runs["nodes"] == "0-1"
    assert start["pool_bytes"] >= 1.2 * (1 << 30) - start["block_bytes"]
    assert set(start["pool_pages"]) == {"0", "1"}          # first touch spilled to node1


def test_reports_arrive_every_period_with_their_fields(runs):
    for layout in ("scattered", "front"):
        lines = runs[layout]["lines"]
        reports = [x for x in lines if x["event"] == "report"]
        assert len(reports) == SECONDS // REPORT_S, lines
        for r in reports:
            assert r["touched_blocks"] > 0 and 0.0 <= r["node0_share"] <= 1.0
            assert r["pages_per_block"] == 16
            assert sum(r["touched_pages"].values()) == r["touched_blocks"] * 16
            assert r["steps"] > 0 and r["prefix_block_reads"] > 0 and r["read_errors"] == 0
        assert reports[-1]["t_s"] >= SECONDS - 0.5
        assert max(r["rotations"] for r in reports) >= 1    # the hot set moved


def test_every_byte_is_intact_at_exit(runs):
    r = runs["scattered"]
    end = r["lines"][-1]
    assert end["event"] == "end" and end["ok"] is True and r["rc"] == 0
    assert end["verified_bytes"] == r["start"]["pool_bytes"] and end["corrupt_bytes"] == 0


def test_a_changed_byte_is_found(runs):
    r = runs["front"]
    end = r["lines"][-1]
    assert r["rc"] == 3 and end["ok"] is False
    assert end["corrupt_bytes"] == 1 and end["first_corrupt_offset"] == r["flipped"]
