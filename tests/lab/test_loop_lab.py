# SPDX-License-Identifier: Apache-2.0
"""The closed loop in the sized lab (cxl profile, each DRAM node 1 GiB, a 1.2 GiB pool that cannot fit
in node0): ``tieringd`` and the unmodified ``kv_workload`` under ``tieringctl run``, one boot per
kernel, through the same guest script as the benchmark (scripts/lab/kv_loop.py). Outcomes only:

- the hot blocks end up on node 0: over the run's last quarter the share of touched blocks on node 0
  is well above where first touch left them (the workload's first report, which is what no tiering
  keeps: docs/loop.md), and high in absolute terms;
- every byte of the pool is intact at exit, and no word read during the run was wrong;
- the daemon really moved memory both ways, and few of the pages it asked to move failed;
- the workload exits → its regions leave the daemon's tables (the daemon's own status);
- the kernel settings the daemon borrowed are back once it stops, and it left no state file.

``tieringctl sample`` ranking the shared prefix on the populated workload is test_signal_lab.py's.
"""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.lab
# Seconds one boot of this module takes here: sets the order of make test's work (tests/lab_workers.py).
LAB_GROUP_S = 140


NODE_MIB = 1024
# The acceptance runs' length (make bench). 40 s was enough with one guest and a thread per vCPU; with
# two guests on one host thread each the second half's share was still rising (0.886 on 6.12 and 0.826
# on 7.3, make test 2026-12-02): the window is the daemon's time to converge, not a timeout.
SECONDS = 80
KERNELS = ("6.12", "7.3")


@pytest.fixture(scope="module", params=KERNELS)
def loop(lab, request):
    script = (f".venv/bin/python scripts/lab/kv_loop.py --out $LAB_OUT --seconds {SECONDS} "
              f"--layout scattered > $LAB_OUT/kv_loop.out 2>&1")
    r = lab.run(script, profile="cxl", kernel=request.param, timeout_s=1200, node_mib=NODE_MIB)
    try:
        out = json.loads((r.out_dir / "loop.json").read_text())
    except (OSError, ValueError):
        out = None
    if r.rc != 0 or out is None or not out.get("runs"):
        log = "\n".join((r.out_dir / n).read_text()[-3000:] for n in ("kv_loop.out", "daemon.log")
                        if (r.out_dir / n).exists())
        pytest.fail(f"{request.param}: kv_loop rc {r.rc}\n{log}\n{r.stderr[-2000:]}", pytrace=False)
    out["kernel"] = request.param
    return out


def _run(loop) -> dict:
    return loop["runs"][0]


def test_hot_blocks_are_on_node0(loop):
    r = _run(loop)
    first = r["reports"][0]["node0_share"]             # where first touch left the hot set
    assert first < 0.9, f"{loop['kernel']}: the scattered start already had {first} on node 0"
    # The last quarter of the run, not its second half: how soon the daemon converges follows the
    # guest's speed (a TCG guest beside another on a loaded host: the second half's mean 0.897 while
    # the last five reports were 0.91, 1, 1, 1, 1; make test 2026-12-03), where it ends does not.
    shares = [x["node0_share"] for x in r["reports"]]
    last = shares[-max(len(shares) // 4, 1):]
    share = sum(last) / len(last)
    assert share >= 0.9 and share >= first + 0.15, \
        f"{loop['kernel']}: node0 share over the last quarter {share} (first report {first}): {shares}"


def test_every_byte_is_intact(loop):
    r = _run(loop)
    assert r["rc"] == 0, r["stderr"]
    end = r["end"]
    assert end["ok"] and end["corrupt_bytes"] == 0 and end["read_errors"] == 0
    assert end["verified_bytes"] == r["start"]["pool_bytes"]


def test_the_daemon_moved_both_ways_and_few_moves_failed(loop):
    moves = _run(loop)["daemon_after"]["moves"]
    assert moves["promoted_bytes"] > 0 and moves["demoted_bytes"] > 0, moves
    # pages of a move in flight when the workload exits are lost with it, not failures of the mover
    failed = sum(n for why, n in moves["failed_pages"].items()
                 if why not in ("process-exited", "vanished"))
    moved_pages = (moves["promoted_bytes"] + moves["demoted_bytes"]) // 4096
    assert failed <= 0.05 * moved_pages, moves["failed_pages"]


def test_an_exited_workload_leaves_the_tables(loop):
    r = _run(loop)
    pid = r["start"]["pid"]
    assert r["exit_to_removed_s"] is not None, "the region was still in the daemon's status 120 s on"
    final = loop["daemon_status_final"]
    assert not [x for x in final["regions"] if x["pid"] == pid]
    assert any(e["pid"] == pid for e in final["exits"])


def test_kernel_settings_are_back_after_the_daemon_stops(loop):
    assert loop["daemon_rc"] == 0
    assert loop["settings_during"] != loop["settings_before"]   # it did borrow some
    assert loop["settings_after"] == loop["settings_before"]
    assert not loop["knobs_state_file_left"]
