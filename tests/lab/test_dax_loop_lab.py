# SPDX-License-Identifier: Apache-2.0
"""The DAX-remap tier in the loop (lab: pmem profile, kernel 6.12, DRAM nodes of 512 MiB each, the
1 GiB NVDIMM as a devdax device that stays offline): a 1 GiB KV pool — more than the DRAM and CXL
nodes hold together — runs under ``tieringd`` with ``[dax] path`` set, through the guest script
scripts/lab/kv_dax.py (one boot: the pool fills, the daemon is killed once mid-demotion and
restarted, the decode runs on the restarted daemon). Outcomes only:

- the pool fills while the daemon demotes its cold blocks onto the DAX tier (it could not fit
  otherwise), and the tier holds a real part of it;
- the hot blocks come back to node 0: blocks are promoted from the tier while the decode runs, and
  the share of the blocks it touches that are on node 0 stays high on average (0.82 and 0.88 in two
  runs; it falls towards the end, 0.74–0.75 over the last quarter, as node 0 keeps a quarter free and
  its usable room is about the touched set: docs/dax.md, "In the lab");
- every byte of the pool is intact at exit, and no word read during the run was wrong;
- kill -9 of the daemon while a demotion to the tier is in flight, and a restart: the restarted
  daemon learns what lives on the tier from the processes' mappings, and nothing is lost.
"""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.lab
# Seconds one boot of this module takes here: sets the order of make test's work (tests/lab_workers.py).
LAB_GROUP_S = 480

NODE_MIB = 512
POOL = "1.0G"
SECONDS = 90


@pytest.fixture(scope="module")
def dax(lab):
    script = (f".venv/bin/python scripts/lab/kv_dax.py --out $LAB_OUT --pool {POOL} --seconds {SECONDS} "
              f"> $LAB_OUT/kv_dax.out 2>&1")
    r = lab.run(script, profile="pmem", kernel="6.12", timeout_s=2400, node_mib=NODE_MIB)
    try:
        out = json.loads((r.out_dir / "dax.json").read_text())
    except (OSError, ValueError):
        out = None
    if r.rc != 0 or out is None or "decode" not in out:
        log = "\n".join((r.out_dir / n).read_text()[-4000:] for n in ("kv_dax.out", "daemon.log")
                        if (r.out_dir / n).exists())
        pytest.fail(f"kv_dax rc {r.rc}\n{log}\n{r.stderr[-2000:]}", pytrace=False)
    return out


def test_the_pool_fills_beyond_memory_with_its_cold_blocks_on_the_dax_tier(dax):
    d = dax["decode"]
    ram = sum(n["MemTotal"] for n in dax["nodes_before"].values())
    assert d["start"]["pool_bytes"] > ram, (d["start"]["pool_bytes"], ram)
    most = max((s["tier_bytes"].get("dax", 0) for s in d["samples"]), default=0)
    assert most >= d["start"]["pool_bytes"] - ram, \
        f"the DAX tier held at most {most >> 20} MiB: {d['samples'][-5:]}"
    tiers = {t["tier"]: t for t in dax["status_at_start"]["tiers"]}
    assert tiers["dax"]["capacity_bytes"] > 0 and tiers["dax"]["nodes"] == [1024]


def test_hot_blocks_come_back_to_node0(dax):
    promoted = dax["decode"]["samples"][-1]["dax_requests"]["promote"]
    assert promoted["requests"] > 0 and promoted["bytes"] > 0, promoted
    shares = [r["node0_share"] for r in dax["decode"]["reports"]]
    assert sum(shares) / len(shares) >= 0.75, shares


def test_every_byte_is_intact(dax):
    run = dax["decode"]
    assert run["rc"] == 0, run["stderr"]
    end = run["end"]
    assert end["ok"] and end["corrupt_bytes"] == 0 and end["read_errors"] == 0, end
    assert end["verified_bytes"] == run["start"]["pool_bytes"]


def test_a_daemon_killed_mid_demotion_relearns_the_tier_and_loses_nothing(dax):
    k = dax["kill"]
    assert k["killed"] is not None, "the pool filled before a demotion to the DAX tier was in flight"
    assert k["killed"]["dax_in_flight"] > 0
    assert k["relearnt"] is not None, "the restarted daemon never found blocks on the DAX tier"
    assert k["relearnt"]["tier_bytes"]["dax"] > 0
