# SPDX-License-Identifier: Apache-2.0
"""The topology reports and the probe inside a lab guest with three tiers (profile ``pmem``, kernel
6.12: node0 DRAM with the vCPUs, node1 CPU-less DRAM with CXL-like HMAT figures, node2 an NVDIMM onlined
by kmem, plus an fsdax mount). One boot; the guest prints one JSON document, the host asserts.

What only a multi-node machine can show: ``tieringctl numa --json`` against the guest's
``numactl --hardware``, the probe's mbind-bound buffers really landing on CPU-less nodes, and the
capture script's tree (with dax/nd device links) reading exactly like the guest's /sys.
"""
from __future__ import annotations

import json
import re

import pytest

pytestmark = pytest.mark.lab
# Seconds one boot of this module takes here: sets the order of make test's work (tests/lab_workers.py).
LAB_GROUP_S = 95


# One Python process for every report: under TCG each interpreter start costs tens of seconds.
_GUEST = r"""
set -e
N=$(scripts/lab/pmem.sh kmem)
M=$(scripts/lab/pmem.sh fsdax)
numactl --hardware > $LAB_OUT/numactl.txt
python3 scripts/capture-sysfs.py $LAB_OUT/cap 2>/dev/null
printf '[topology]\nprobe_file = ""\n' > $LAB_OUT/tieringd.toml
TIERINGD_CONFIG=$LAB_OUT/tieringd.toml .venv/bin/python - "$N" "$M" <<'PYEOF'
import json, os, sys
from click.testing import CliRunner
from tieringd.kernel import sysfs
from tieringd.cli import main
out = os.environ["LAB_OUT"]
n, m = sys.argv[1], sys.argv[2]

def cli(*args):
    r = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.output

doc = {"kmem_node": int(n), "fsdax_mount": m,
       "numa": json.loads(cli("numa", "--json")), "tiers": json.loads(cli("tiers", "--json")),
       "numa_text": cli("numa"),
       "probe": json.loads(cli("probe", "--node", "0", "--node", "1", "--node", n, "--size-mib", "32",
                               "--steps", "50000", "--iterations", "1", "--json"))}
with sysfs.root(out + "/cap"):
    doc["numa-captured"] = json.loads(cli("numa", "--json"))
with open(out + "/numactl.txt") as f:
    doc["numactl_text"] = f.read()
json.dump(doc, sys.stdout)
PYEOF
"""


@pytest.fixture(scope="module")
def guest(lab):
    r = lab.run(_GUEST, profile="pmem", kernel="6.12", timeout_s=600)
    assert r.rc == 0, f"guest script failed ({r.rc}):\n{r.stderr[-3000:]}"
    return json.loads(r.stdout)


def _numactl(text: str) -> dict:
    out: dict = {"cpus": {}, "size_mb": {}, "distances": {}}
    for nid, cpus in re.findall(r"^node (\d+) cpus:(.*)$", text, re.M):
        out["cpus"][int(nid)] = [int(c) for c in cpus.split()]
    for nid, mb in re.findall(r"^node (\d+) size: (\d+) MB$", text, re.M):
        out["size_mb"][int(nid)] = int(mb)
    lines = text[text.index("node distances:"):].splitlines()
    cols = [int(c) for c in lines[1].split()[1:]]
    for line in lines[2:]:
        head, *vals = line.split()
        out["distances"][int(head.rstrip(":"))] = dict(zip(cols, map(int, vals)))
    return out


def test_three_tiers_classified_with_evidence(guest):
    nodes = {n["id"]: n for n in guest["numa"]["nodes"]}
    kmem = guest["kmem_node"]
    assert sorted(nodes) == [0, 1, kmem] and kmem == 2
    assert nodes[0]["tier"] == "dram" and nodes[0]["cpus"] == [0, 1]
    assert nodes[1]["tier"] == "cxl-dram" and nodes[1]["evidence"][0] == "CPU-less"
    assert nodes[2]["tier"] == "pmem" and nodes[2]["origin"] == "pmem"
    assert any(e.startswith("kmem from dax") and "(a pmem namespace)" in e for e in nodes[2]["evidence"])
    assert nodes[1]["hmat"]["access0"]["read_latency_ns"] == 400
    assert nodes[2]["hmat"]["access0"]["read_latency_ns"] == 2000
    (dax,) = [d for d in guest["numa"]["dax_devices"] if d["target_node"] == 2]
    assert dax["mode"] == "system-ram" and dax["origin"] == "pmem"
    (mnt,) = guest["numa"]["fsdax_mounts"]
    assert mnt["mountpoint"] == guest["fsdax_mount"] and mnt["namespace"]
    tiers = {t["tier"]: t for t in guest["tiers"]["tiers"]}
    assert tiers["dram"]["nodes"] == [0] and tiers["cxl-dram"]["nodes"] == [1]
    assert tiers["pmem"]["nodes"] == [2]
    # an fsdax mount is where the DAX-remap tier's file lives: it is listed on that tier's row
    assert tiers["dax"]["fsdax_mounts"] == [guest["fsdax_mount"]] and tiers["pmem"]["fsdax_mounts"] == []
    assert "node2 pmem: CPU-less; kmem from dax" in guest["numa_text"]


def test_numa_json_agrees_with_numactl_in_the_guest(guest):
    hw = _numactl(guest["numactl_text"])
    for n in guest["numa"]["nodes"]:
        assert n["cpus"] == hw["cpus"][n["id"]]
        assert n["mem_total_bytes"] >> 20 == hw["size_mb"][n["id"]]   # nothing hot-adds in the guest
        assert {int(k): v for k, v in n["distances"].items()} == hw["distances"][n["id"]]


def test_probe_buffers_land_on_cpuless_nodes(guest):
    results = {r["node"]: r for r in guest["probe"]["results"]}
    assert sorted(results) == [0, 1, 2]
    for nid, r in results.items():
        assert r["error"] is None, r
        assert r["on_node_fraction"] == 1.0, r      # move_pages: every sampled page on the node
        assert r["initiator_node"] == 0            # measured from the DRAM node's CPUs
        assert r["read_bandwidth_mb_s"] > 0 and r["read_latency_ns"] > 0
    assert results[2]["hmat"]["read_latency_ns"] == 2000


def test_capture_in_the_guest_reads_like_the_guest(guest):
    live, cap = guest["numa"], guest["numa-captured"]
    def steady(nodes):      # free memory moves between the two runs; everything else must not
        return [{k: v for k, v in n.items() if k != "mem_free_bytes"} for n in nodes]
    assert steady(cap["nodes"]) == steady(live["nodes"])
    assert [d["name"] for d in cap["dax_devices"]] == [d["name"] for d in live["dax_devices"]]
    assert cap["dax_devices"] == live["dax_devices"]
    assert cap["namespaces"] == live["namespaces"]
    assert cap["fsdax_mounts"] == live["fsdax_mounts"]
