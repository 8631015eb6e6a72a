# SPDX-License-Identifier: Apache-2.0
"""The topology reports and the probe on this machine, cross-checked with the kernel's own files and
with ``numactl --hardware`` (psutil's way: compare with the system's tools)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tieringd.kernel import sysfs
from tieringd.memory import topology

from paths import REPO
TIERINGCTL = Path(sys.executable).with_name("tieringctl")
MEMBENCH = REPO / "build" / "libtieringd-membench.so"
REQUIRE_ALL = os.environ.get("TIERINGD_REQUIRE_ALL") == "1"


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    cfg = tmp_path / "tieringd.toml"
    cfg.write_text(f'[topology]\nprobe_file = "{tmp_path / "probe.json"}"\n')
    e = {k: v for k, v in os.environ.items() if k != "TIERINGD_FS_ROOT"}
    e["TIERINGD_CONFIG"] = str(cfg)
    return e


def tieringctl(env, *args, check=True) -> subprocess.CompletedProcess:
    p = subprocess.run([str(TIERINGCTL), *args], env=env, capture_output=True, text=True, timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"tieringctl {' '.join(args)} exited {p.returncode}: {p.stderr}")
    return p


def node_meminfo_kb(node: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/sys/devices/system/node/node{node}/meminfo").read_text().splitlines():
        parts = line.split()
        out[parts[2].rstrip(":")] = int(parts[3])
    return out


def test_numa_json_agrees_with_node0_meminfo(env):
    before = node_meminfo_kb(0)
    doc = json.loads(tieringctl(env, "numa", "--json").stdout)
    after = node_meminfo_kb(0)
    n0 = next(n for n in doc["nodes"] if n["id"] == 0)
    # MemTotal moves on this VM (memory is initialised lazily after boot): bracket it
    lo, hi = sorted((before["MemTotal"], after["MemTotal"]))
    assert lo * 1024 <= n0["mem_total_bytes"] <= hi * 1024
    lo, hi = sorted((before["MemFree"], after["MemFree"]))
    slack = 64 << 20          # other processes allocate meanwhile
    assert lo * 1024 - slack <= n0["mem_free_bytes"] <= hi * 1024 + slack
    cpulist = Path("/sys/devices/system/node/node0/cpulist").read_text().strip()
    assert sysfs.format_list(n0["cpus"]) == cpulist


def parse_numactl_hardware(text: str) -> dict:
    out: dict = {"cpus": {}, "size_mb": {}, "distances": {}}
    m = re.search(r"^available: (\d+) nodes \(([^)]*)\)", text, re.M)
    out["count"], out["nodes"] = int(m.group(1)), sysfs.parse_list(m.group(2))
    for nid, cpus in re.findall(r"^node (\d+) cpus:(.*)$", text, re.M):
        out["cpus"][int(nid)] = [int(c) for c in cpus.split()]
    for nid, mb in re.findall(r"^node (\d+) size: (\d+) MB$", text, re.M):
        out["size_mb"][int(nid)] = int(mb)
    lines = text[text.index("node distances:"):].splitlines()
    cols = [int(x) for x in lines[1].split()[1:]]
    for line in lines[2:]:
        head, *vals = line.split()
        out["distances"][int(head.rstrip(":"))] = dict(zip(cols, map(int, vals)))
    return out


@pytest.mark.skipif(shutil.which("numactl") is None and not REQUIRE_ALL, reason="numactl is not installed")
def test_numa_json_agrees_with_numactl_hardware(env):
    hw = parse_numactl_hardware(subprocess.run(["numactl", "--hardware"], capture_output=True, text=True,
                                               check=True).stdout)
    doc = json.loads(tieringctl(env, "numa", "--json").stdout)
    hw2 = parse_numactl_hardware(subprocess.run(["numactl", "--hardware"], capture_output=True, text=True,
                                                check=True).stdout)
    assert [n["id"] for n in doc["nodes"]] == hw["nodes"] and hw["count"] == len(doc["nodes"])
    for n in doc["nodes"]:
        assert n["cpus"] == hw["cpus"][n["id"]]
        # numactl prints MemTotal >> 20; bracket by the two runs around ours (MemTotal can move)
        mb = n["mem_total_bytes"] >> 20
        assert min(hw["size_mb"][n["id"]], hw2["size_mb"][n["id"]]) <= mb <= \
            max(hw["size_mb"][n["id"]], hw2["size_mb"][n["id"]])
        assert {int(k): v for k, v in n["distances"].items()} == hw["distances"][n["id"]]


def test_table_report_on_this_machine(env):
    out = tieringctl(env, "numa").stdout
    assert out.splitlines()[0].split()[:2] == ["node", "tier"]
    assert re.search(r"^\s+0\s+dram\s", out, re.M)
    assert "node0 dram: " in out
    tiers = tieringctl(env, "tiers").stdout
    assert re.search(r"^dram\s+1\s+0\s", tiers, re.M)


def test_capture_of_this_machine_reads_like_the_machine(tmp_path):
    """scripts/capture-sysfs.py → a tree that discover() reads exactly as it reads the live system."""
    out = tmp_path / "cap"
    subprocess.run([sys.executable, str(REPO / "scripts/capture-sysfs.py"), str(out)], check=True,
                   capture_output=True, timeout=120)
    cfg = {"topology": {"probe_file": ""}}      # measured figures are this machine's, not the tree's
    live = topology.discover(cfg)
    with sysfs.root(out):
        captured = topology.discover(cfg)
    assert [(n.id, n.cpus, n.tier, n.distances, n.memory_tier, n.hmat) for n in captured.nodes] == \
           [(n.id, n.cpus, n.tier, n.distances, n.memory_tier, n.hmat) for n in live.nodes]
    assert [n.evidence for n in captured.nodes] == [n.evidence for n in live.nodes]
    assert [d.name for d in captured.dax_devices] == [d.name for d in live.dax_devices]
    # every link stays relative, and every directory survives in git (.keep in empty ones)
    for dirpath, dirnames, filenames in os.walk(out):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                assert not os.path.isabs(os.readlink(p)), p
        if not dirnames and not filenames:
            raise AssertionError(f"empty directory {dirpath}")
    manifest = json.loads((out / "capture.json").read_text())
    assert manifest["schema"] == "tieringd.sysfs-capture/1" and manifest["files"] > 10
    # only the mounts the topology reads are kept
    for line in (out / "proc/self/mountinfo").read_text().splitlines():
        fstype = line.split(" - ")[1].split()[0]
        mountpoint = line.split()[4]
        assert mountpoint == "/" or fstype in {"proc", "sysfs", "tracefs", "debugfs", "bpf", "cgroup2",
                                               "hugetlbfs", "devtmpfs", "tmpfs"} or "dax" in line


@pytest.fixture
def membench():
    if not MEMBENCH.exists():
        if REQUIRE_ALL:
            pytest.fail(f"{MEMBENCH.relative_to(REPO)} is not built (make)")
        pytest.skip(f"{MEMBENCH.relative_to(REPO)} is not built (make)")
    return MEMBENCH


def test_probe_measures_node0_with_a_bound_buffer(env, membench, tmp_path):
    p = tieringctl(env, "probe", "--node", "0", "--size-mib", "32", "--steps", "100000",
                   "--iterations", "2", "--json", "--save")
    doc = json.loads(p.stdout)
    assert doc["schema"] == "tieringd.probe/1"
    (r,) = doc["results"]
    assert r["node"] == 0 and r["error"] is None
    assert r["on_node_fraction"] == 1.0                 # move_pages says every sampled page is on node 0
    assert r["read_bandwidth_mb_s"] > 100               # > 100 MB/s: it streamed, whatever the machine
    assert 1 < r["read_latency_ns"] < 100_000
    saved = json.loads((tmp_path / "probe.json").read_text())
    assert saved["boot_id"] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    # the saved figures become evidence in the topology
    doc = json.loads(tieringctl(env, "numa", "--json").stdout)
    ev = next(n for n in doc["nodes"] if n["id"] == 0)["evidence"]
    assert any(e.startswith("probe: read latency ") for e in ev), ev


def test_probe_bad_node_is_a_clear_error(env, membench):
    p = tieringctl(env, "probe", "--node", "99", check=False)
    assert p.returncode == 1
    assert "no NUMA node 99" in p.stderr and "Traceback" not in p.stderr
