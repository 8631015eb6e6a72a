# SPDX-License-Identifier: Apache-2.0
"""Hot-plug logic: what the policy does with a device that appears (decisions only; the bind and
onlining run in the lab), what a refresh reports when a node appears (the cxl capture, then the pmem
capture of the same guest after kmem onlined node 2), the tier capacities, the [hotplug] table."""
from __future__ import annotations

import shutil

import pytest

from tieringd.kernel import sysfs
from tieringd.memory import hotplug, topology
from tieringd.config import ConfigError
from tieringd.contracts import Tier

FIX = "tests/fixtures/sysfs"


@pytest.fixture
def pmem_tree(repo, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(repo / FIX / "pmem-6.12", root, symlinks=True)
    mem = root / "sys/devices/system/memory"
    for i, node in ((60, 2), (3, 0)):
        d = mem / f"memory{i}"
        d.mkdir()
        (d / "state").write_text("online")
        (d / "valid_zones").write_text("Movable")
        (d / f"node{node}").symlink_to(f"../../node/node{node}")
    with sysfs.root(root):
        yield root


def test_config_defaults_and_errors():
    c = hotplug.HotplugConfig.from_config({})
    assert c.online == ("cxl-ram", "hmem") and c.zone == "movable" and c.act == "always"
    assert hotplug.HotplugConfig.from_config({"online": ["all"]}).wants("pmem")
    with pytest.raises(ConfigError, match=r"\[hotplug\] online: expected origins among .*, got \"nvdimm\""):
        hotplug.HotplugConfig.from_config({"online": ["nvdimm"]})
    with pytest.raises(ConfigError, match=r"\[hotplug\] zone: expected movable \| normal \| auto"):
        hotplug.HotplugConfig.from_config({"zone": "dma32"})
    with pytest.raises(ConfigError, match=r"\[hotplug\] acts: unknown key"):
        hotplug.HotplugConfig.from_config({"acts": "always"})


def test_policy_decides_without_touching_what_it_must_not(pmem_tree, monkeypatch):
    monkeypatch.setattr(hotplug, "LOCK_PATH", str(pmem_tree / "hotplug.lock"))
    default = hotplug.HotplugConfig()
    r = hotplug.handle("dax", "dax0.0", default, {})
    assert r["action"] == "none" and "origin pmem not in [hotplug] online" in r["why"]
    keep = hotplug.HotplugConfig(online=("all",), keep_devdax=("dax0.0",))
    assert "kept as devdax" in hotplug.handle("dax", "dax0.0", keep, {})["why"]
    remap = hotplug.handle("dax", "dax0.0", hotplug.HotplugConfig(online=("pmem",)), {"dax": {"path": "/dev/dax0.0"}})
    assert "kept as devdax" in remap["why"]
    already = hotplug.handle("dax", "dax0.0", hotplug.HotplugConfig(online=("pmem",)), {})
    assert already["why"] == "already system RAM"          # kmem-bound, every block online
    assert hotplug.handle("dax", "dax7.0", default, {})["action"] == "none"
    assert "not offline" in hotplug.handle("memory", "memory60", default, {})["why"]
    (pmem_tree / "sys/devices/system/memory/memory3/state").write_text("offline")
    assert "has CPUs" in hotplug.handle("memory", "memory3", default, {})["why"]
    off = hotplug.HotplugConfig(memory_blocks=False)
    assert hotplug.handle("memory", "memory60", off, {})["why"] == "[hotplug] memory_blocks = false"
    assert hotplug.handle("cxl", "region9", default, {})["why"] == "no such CXL region"
    with pytest.raises(ValueError):
        hotplug.handle("usb", "1-1", default, {})


def test_a_node_that_appears_is_reported_with_its_tier_and_evidence(repo):
    with sysfs.root(repo / FIX / "cxl-6.12"):
        before = topology.discover({})
    with sysfs.root(repo / FIX / "pmem-6.12"):
        after = topology.discover({})
    added, removed, resized = hotplug.diff(before, after)
    assert [(n.id, n.tier) for n in added] == [(2, Tier.PMEM)] and not removed
    assert any("kmem from dax0.0" in e for e in added[0].evidence)
    assert hotplug.diff(after, before)[1] == [2]
    caps = hotplug.tier_capacities(after)
    assert [(c.tier, c.nodes) for c in caps] == [(Tier.DRAM, (0,)), (Tier.CXL_DRAM, (1,)), (Tier.PMEM, (2,))]
    assert caps[2].capacity_bytes == 896 << 20
