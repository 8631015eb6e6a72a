# SPDX-License-Identifier: Apache-2.0
"""Topology discovery and tier classification against sysfs trees captured by
scripts/capture-sysfs.py: this machine (host-6.18) and, as they land, the lab guests."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tieringd.kernel import sysfs
from tieringd.memory import topology
from tieringd.config import ConfigError
from tieringd.contracts import Tier

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "sysfs"
HOST = FIXTURES / "host-6.18"


def discover(root, config=None) -> topology.Topology:
    with sysfs.root(root):
        return topology.discover(config if config is not None else {})


def fixture_meminfo_bytes(root: Path, node: int, key: str) -> int:
    """The fixture's own file, parsed independently of the code under test."""
    text = (root / f"sys/devices/system/node/node{node}/meminfo").read_text()
    for line in text.splitlines():
        if line.split()[2] == key + ":":
            return int(line.split()[3]) * 1024
    raise AssertionError(key)


def test_host_fixture_is_one_dram_node():
    topo = discover(HOST)
    assert [n.id for n in topo.nodes] == [0]
    n = topo.node(0)
    assert n.tier == Tier.DRAM
    assert n.cpus == [0, 1]
    assert n.mem_total_bytes == fixture_meminfo_bytes(HOST, 0, "MemTotal")
    assert n.mem_free_bytes == fixture_meminfo_bytes(HOST, 0, "MemFree")
    assert n.distances == {0: 10}
    assert n.memory_tier == 4            # the kernel's default DRAM tier (MEMTIER_ADISTANCE_DRAM)
    assert n.hmat is None                # no HMAT table in this VM's firmware
    assert n.evidence[:2] == ["2 CPUs (0-1)", "no HMAT figures"]
    assert topo.kernel["release"].startswith("6.18")
    assert topo.dax_devices == [] and topo.namespaces == [] and topo.cxl_memdevs == []
    assert topo.notes == []


def test_host_fixture_tier_queries():
    topo = discover(HOST)
    assert topo.nodes_in_tier(Tier.DRAM) == [0]
    assert topo.nodes_in_tier(Tier.CXL_DRAM) == []
    assert topo.fallback_nodes(0) == []
    with pytest.raises(KeyError, match=r"no NUMA node 7 \(nodes: 0\)"):
        topo.node(7)


def test_config_override_shows_in_evidence():
    topo = discover(HOST, {"topology": {"nodes": {"0": {"tier": "cxl-dram"}}}})
    n = topo.node(0)
    assert n.tier == Tier.CXL_DRAM and n.overridden
    assert n.evidence[-1] == "config override: tier = cxl-dram (evidence said dram)"
    assert topo.nodes_in_tier(Tier.CXL_DRAM) == [0]


def test_override_of_absent_node_is_a_note():
    topo = discover(HOST, {"topology": {"nodes": {"3": {"tier": "pmem"}}}})
    assert topo.node(0).tier == Tier.DRAM
    assert "config [topology.nodes.3] names a node that is not online" in topo.notes


@pytest.mark.parametrize("cfg, message", [
    ({"topology": {"nodes": {"0": {"tier": "ssd"}}}}, "unknown tier 'ssd'"),
    ({"topology": {"nodes": {"zero": {"tier": "pmem"}}}}, "'zero' is not a node id"),
    ({"topology": {"nodes": {"0": {"tier": "pmem", "speed": 1}}}}, "takes one key"),
    ({"topology": {"nodes": 1}}, "must be a table"),
    ({"topology": {"nodez": {}}}, "unknown key"),
    ({"topology": 5}, "must be a table"),
])
def test_bad_override_is_a_clear_config_error(cfg, message):
    with pytest.raises(ConfigError, match=message):
        discover(HOST, cfg)


def test_missing_files_degrade_to_notes(tmp_path):
    """A container or an old kernel: pieces of the captured tree are absent."""
    root = tmp_path / "t"
    shutil.copytree(HOST, root, symlinks=True)
    shutil.rmtree(root / "sys/devices/virtual/memory_tiering")
    (root / "sys/devices/system/node/node0/meminfo").unlink()
    (root / "sys/devices/system/node/node0/cpulist").unlink()
    (root / "proc/self/mountinfo").unlink()
    shutil.rmtree(root / "sys/bus")
    topo = discover(root)
    n = topo.node(0)
    assert n.memory_tier is None and n.mem_total_bytes == 0 and n.cpus == []
    joined = "\n".join(topo.notes)
    assert "memory_tiering is absent" in joined
    assert "node0/meminfo is unreadable" in joined
    assert "node0/cpulist is unreadable" in joined
    assert "mountinfo is unreadable" in joined


def test_no_numa_sysfs_falls_back_to_one_node(tmp_path):
    """No /sys/devices/system/node at all (CONFIG_NUMA=n, or /sys not mounted)."""
    root = tmp_path / "t"
    (root / "proc").mkdir(parents=True)
    shutil.copy(HOST / "proc/meminfo", root / "proc/meminfo")
    topo = discover(root)
    assert [n.id for n in topo.nodes] == [0]
    n = topo.node(0)
    assert n.tier == Tier.DRAM and n.mem_total_bytes > 0
    assert "no NUMA information" in n.evidence[-1]
    assert any("CONFIG_NUMA" in x for x in topo.notes)


def test_empty_root_never_raises(tmp_path):
    topo = discover(tmp_path)
    assert len(topo.nodes) == 1 and topo.notes


def expected_fallback(topo, me):
    """Same tier nearest first, then each slower tier nearest first (written out the long way)."""
    out = []
    for tier in Tier:
        if tier < me.tier or tier == Tier.GPU_HBM:
            continue
        ids = [n.id for n in topo.nodes if n.tier == tier and n.has_memory and n.id != me.id]
        out += sorted(ids, key=lambda i: (me.distances[i], i))
    return out


# ---- lab fixtures (tests/fixtures/sysfs/<profile>-<kernel>/, captured in the QEMU guests) ----------

LAB = sorted(p for p in FIXTURES.glob("*-*") if p.is_dir() and not p.name.startswith("host-"))


def lab_fixtures(prefix: str):
    found = [p for p in LAB if p.name.rsplit("-", 1)[0] == prefix]
    return found or [pytest.param(None, marks=pytest.mark.skip(
        reason=f"no {prefix}-<kernel> fixture captured yet (scripts/lab.py capture)"))]


@pytest.mark.parametrize("root", lab_fixtures("cxl"), ids=lambda p: getattr(p, "name", "none"))
def test_lab_cxl_cpuless_node_is_cxl_dram(root):
    topo = discover(root)
    cpu = [n for n in topo.nodes if n.cpus]
    cpuless = [n for n in topo.nodes if not n.cpus and n.has_memory]
    assert cpu and cpuless, "the cxl profile has a CPU node and a CPU-less memory node"
    for n in cpu:
        assert n.tier == Tier.DRAM
    for n in cpuless:
        assert n.tier == Tier.CXL_DRAM, n.evidence
        assert n.evidence[0] == "CPU-less"
        if n.memory_tier is not None and n.memory_tier == cpu[0].memory_tier:
            # v6.1 puts every node in memory_tier4: the classification must not follow it blindly
            assert any("the same as DRAM" in e for e in n.evidence)
        elif n.memory_tier is not None:
            assert any("slower than DRAM" in e for e in n.evidence)
    for n in topo.nodes:
        if n.has_memory:
            assert topo.fallback_nodes(n.id) == expected_fallback(topo, n)


@pytest.mark.parametrize("root", lab_fixtures("cxl-type3"), ids=lambda p: getattr(p, "name", "none"))
def test_lab_cxl_type3_pmem_region_is_pmem(root):
    # QEMU's type-3 device here backs a *persistent* CXL region: the brief's tier 3 (CXL PMem),
    # while the HMAT-described CPU-less node stays CXL DRAM.
    topo = discover(root)
    by_origin = {n.origin: n for n in topo.nodes if not n.cpus and n.has_memory}
    region = by_origin["cxl-pmem"]
    assert region.tier == Tier.PMEM
    assert any("on region0 (a CXL pmem region)" in e for e in region.evidence), region.evidence
    assert [n.tier for n in topo.nodes if not n.cpus and n.origin != "cxl-pmem"] == [Tier.CXL_DRAM]


@pytest.mark.parametrize("root", lab_fixtures("pmem"), ids=lambda p: getattr(p, "name", "none"))
def test_lab_pmem_kmem_node_is_pmem(root):
    topo = discover(root)
    pmem = [n for n in topo.nodes if n.tier == Tier.PMEM]
    assert pmem, [(n.id, n.tier.label, n.evidence) for n in topo.nodes]
    for n in pmem:
        assert not n.cpus
        assert n.origin in ("pmem", "cxl-pmem")
        assert any(e.startswith("kmem from dax") for e in n.evidence)
        kmem = [d for d in topo.dax_devices if d.target_node == n.id and d.driver == "kmem"]
        assert kmem and kmem[0].mode == "system-ram"
    # PMem is the last resort for every other node
    for n in topo.nodes:
        if n.has_memory and n.tier < Tier.PMEM:
            fb = topo.fallback_nodes(n.id)
            assert set(p.id for p in pmem) <= set(fb)
            assert fb[-len(pmem):] == [x for x in fb if topo.node(x).tier == Tier.PMEM]


@pytest.mark.parametrize("root", LAB or [pytest.param(None, marks=pytest.mark.skip(
    reason="no lab fixture captured yet"))], ids=lambda p: getattr(p, "name", "none"))
def test_every_lab_fixture_reads_without_notes_about_parse_errors(root):
    topo = discover(root)
    assert not [x for x in topo.notes if "cannot parse" in x or "entries for" in x]
    for n in topo.nodes:
        assert set(n.distances) == {m.id for m in topo.nodes}
        assert n.distances[n.id] == 10


# ---- GPUs through NVML -----------------------------------------------------------------------------
# No NVIDIA driver on the machines these tests run on, so NVML itself cannot run: a stand-in module
# with NVML's call names checks the two promises — absent or failing NVML is silent, a present one
# gives a report-only gpu-hbm row.

class _FakeNvml:
    class Mem:
        total, free = 80 << 30, 70 << 30

    class Pci:
        busId = b"00000000:17:00.0"

    def __init__(self, fail_init=False):
        self.fail_init = fail_init

    def nvmlInit(self):
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return 1

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetUUID(self, h):
        return "GPU-0"

    def nvmlDeviceGetMemoryInfo(self, h):
        return self.Mem()

    def nvmlDeviceGetPciInfo(self, h):
        return self.Pci()

    def nvmlDeviceGetNumaNodeId(self, h):
        return 0


def test_gpus_absent_or_without_driver_are_silent(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "pynvml", None)            # not installed
    topo = discover(HOST)
    assert topo.gpus == [] and topo.notes == []
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml(fail_init=True))
    topo = discover(HOST)
    assert topo.gpus == [] and topo.notes == []


def test_gpu_with_driver_is_a_report_only_row(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml())
    topo = discover(HOST)
    (g,) = topo.gpus
    assert (g.name, g.memory_total_bytes, g.pci_bus_id, g.numa_node) == \
        ("NVIDIA H100 80GB HBM3", 80 << 30, "00000000:17:00.0", 0)
    assert topo.nodes_in_tier(Tier.GPU_HBM) == []               # never a placement target
    assert g.to_dict()["tier"] == "gpu-hbm"


# ---- classification without firmware data (derived from the captured pmem-6.12 tree) ---------------

def _without(tmp_path, *, hmat=False, tiers=False, dax=False) -> Path:
    """The captured pmem-6.12 tree with HMAT, kernel memory tiers or the dax bus removed: what the
    same machine looks like without an HMAT table, on a pre-6.1 kernel, or with the dax links gone."""
    src = FIXTURES / "pmem-6.12"
    if not src.is_dir():
        pytest.skip("pmem-6.12 fixture not captured yet")
    root = tmp_path / "t"
    shutil.copytree(src, root, symlinks=True)
    if hmat:
        for d in root.glob("sys/devices/system/node/node*/access[01]"):
            shutil.rmtree(d)
    if tiers:
        shutil.rmtree(root / "sys/devices/virtual/memory_tiering")
    if dax:
        shutil.rmtree(root / "sys/bus/dax")
    return root


def test_no_hmat_no_memory_tiers_still_three_tiers(tmp_path):
    topo = discover(_without(tmp_path, hmat=True, tiers=True))
    assert [(n.id, n.tier) for n in topo.nodes] == [(0, Tier.DRAM), (1, Tier.CXL_DRAM), (2, Tier.PMEM)]
    n2 = topo.node(2)
    assert n2.hmat is None and n2.memory_tier is None
    assert n2.evidence[:3] == ["CPU-less", "kmem from dax0.0 on region0 (a pmem namespace)", "no HMAT figures"]
    assert any("no HMAT figures on any node" in x for x in topo.notes)
    assert topo.fallback_nodes(0) == [1, 2] and topo.fallback_nodes(1) == [2]


def test_hmat_alone_marks_a_slow_cpuless_node_pmem_like(tmp_path):
    """No dax links: node2's only distinguishing facts are CPU-less + 2000 ns HMAT latency."""
    topo = discover(_without(tmp_path, dax=True))
    n2 = topo.node(2)
    assert n2.tier == Tier.PMEM and n2.origin is None
    assert n2.evidence[-1] == "read latency >= 1000 ns: persistent-memory-like"
    assert topo.node(1).tier == Tier.CXL_DRAM


def test_nothing_but_cpu_less_is_cxl_dram(tmp_path):
    topo = discover(_without(tmp_path, hmat=True, tiers=True, dax=True))
    assert [n.tier for n in topo.nodes] == [Tier.DRAM, Tier.CXL_DRAM, Tier.CXL_DRAM]
    assert topo.node(2).evidence[-1] == "no device origin: a CPU-less memory node is taken as CXL DRAM"


def test_relative_root_still_gives_kernel_paths(monkeypatch):
    if not (FIXTURES / "pmem-6.12").is_dir():
        pytest.skip("pmem-6.12 fixture not captured yet")
    monkeypatch.chdir(FIXTURES)
    topo = discover("pmem-6.12")
    (d,) = topo.dax_devices
    assert d.path == "/sys/devices/LNXSYSTM:00/LNXSYBUS:00/ACPI0012:00/ndbus0/region0/dax0.0/dax0.0"


@pytest.mark.parametrize("root", LAB or [pytest.param(None, marks=pytest.mark.skip(
    reason="no lab fixture captured yet"))], ids=lambda p: getattr(p, "name", "none"))
def test_the_fallback_map_handed_to_the_mover_is_the_topologys_own(root):
    topo = discover(root)
    fmap = topo.fallback_map()
    assert fmap.chains == {n.id: tuple(topo.fallback_nodes(n.id)) for n in topo.nodes}
    assert fmap.tiers == {t: tuple(topo.nodes_in_tier(t)) for t in Tier if topo.nodes_in_tier(t)}
    assert all(fmap.tiers.values()) and Tier.GPU_HBM not in fmap.tiers


def test_the_fallback_map_of_three_tiers():
    fmap = discover(FIXTURES / "pmem-6.12").fallback_map()
    assert fmap.chains == {0: (1, 2), 1: (2,), 2: ()}
    assert fmap.tiers == {Tier.DRAM: (0,), Tier.CXL_DRAM: (1,), Tier.PMEM: (2,)}


def test_a_node_cannot_be_put_in_the_dax_tier():
    """The DAX-remap tier is a file, not a node: [topology.nodes.N] refuses it."""
    from tieringd.config import ConfigError
    with pytest.raises(ConfigError, match=r"\[topology.nodes.2\] tier: dax is not a NUMA node's tier"):
        topology.tier_overrides({"topology": {"nodes": {"2": {"tier": "dax"}}}})
