# SPDX-License-Identifier: Apache-2.0
"""DAX devices as system RAM, the parts that are logic: which memory blocks a device becomes, where
an offlined node's pages go, what ``tieringctl dax list`` shows — against the pmem lab capture plus
the memory blocks kmem made of it. Binding and onlining run in tests/lab/test_hotplug_lab.py."""
from __future__ import annotations

import os
import shutil

import pytest
from click.testing import CliRunner

from tieringd.kernel import sysfs
from tieringd.memory import dax, topology
from tieringd.cli import main

MEM = "sys/devices/system/memory"


@pytest.fixture
def pmem_tree(repo, tmp_path):
    """tests/fixtures/sysfs/pmem-6.12 with memory blocks 49-55 (kmem's blocks of dax0.0) on node 2."""
    root = tmp_path / "root"
    shutil.copytree(repo / "tests/fixtures/sysfs/pmem-6.12", root, symlinks=True)
    for i in range(49, 56):
        d = root / MEM / f"memory{i}"
        d.mkdir(parents=True)
        (d / "state").write_text("online" if i < 54 else "offline")
        (d / "valid_zones").write_text("Movable" if i < 53 else "Normal" if i == 53 else "Movable Normal")
        (d / "node2").symlink_to("../../node/node2")
    with sysfs.root(root):
        yield root


def test_kmem_makes_whole_blocks_of_the_device(pmem_tree):
    # dax0.0 is 0x181200000-0x1bfffffff; 128 MiB blocks: the first whole one is 49, the last 55.
    assert dax.block_size_bytes() == 128 << 20
    assert dax.device_ranges("dax0.0") == [(0x181200000, 0x1C0000000)]
    assert dax.device_block_ids("dax0.0") == list(range(49, 56))


def test_device_state_and_blocks(pmem_tree):
    d = dax.device("dax0.0")
    assert (d.mode, d.origin, d.target_node) == ("system-ram", "pmem", 2)
    assert [b.state for b in d.blocks] == ["online"] * 5 + ["offline"] * 2
    assert [b.zone for b in d.blocks[:5]] == ["Movable"] * 4 + ["Normal"]
    assert d.blocks[-1].zone is None and d.blocks[0].node == 2
    assert d.online_bytes == 5 * (128 << 20)
    with pytest.raises(dax.DaxError, match=r"no dax device dax9.9 \(dax devices: dax0.0\)"):
        dax.device("dax9.9")


def test_offlined_pages_go_to_the_nearest_tier_first(repo):
    with sysfs.root(repo / "tests/fixtures/sysfs/pmem-6.12"):
        topo = topology.discover({})
    assert dax.target_nodes(topo, 2) == [1, 0]     # pmem → cxl-dram, then dram
    assert dax.target_nodes(topo, 1) == [2, 0]     # cxl-dram → pmem (slower first at one step), dram


def test_offline_refuses_a_device_that_is_not_online(pmem_tree):
    (pmem_tree / MEM / "memory49/state").write_text("offline")
    for i in range(50, 54):
        (pmem_tree / MEM / f"memory{i}/state").write_text("offline")
    with pytest.raises(dax.DaxError, match="not online as system RAM"):
        dax.offline("dax0.0")


def test_offline_refuses_when_the_other_nodes_have_no_room(pmem_tree):
    for n in (0, 1, 2):
        info = pmem_tree / f"sys/devices/system/node/node{n}/meminfo"
        lines = [line if "MemFree" not in line else f"Node {n} MemFree:        1024 kB"
                 for line in info.read_text().splitlines()]
        info.write_text("\n".join(lines) + "\n")
    with pytest.raises(dax.DaxError, match=r"not enough room elsewhere: 895 MiB in use on node 2, 2 MiB free "
                                           r"on nodes 0-1 \(keeping 64 MiB\)"):
        dax.offline("dax0.0")


def test_auto_online_is_borrowed_and_put_back(pmem_tree):
    path = pmem_tree / MEM / "auto_online_blocks"
    assert path.read_text().strip() == "online"
    with dax.borrowed_auto_online("offline"):
        assert path.read_text() == "offline"
    assert path.read_text().strip() == "online"
    with pytest.raises(RuntimeError):
        with dax.borrowed_auto_online("offline"):
            raise RuntimeError("bind failed")
    assert path.read_text().strip() == "online"


def test_dax_list_shows_blocks_and_zones(pmem_tree):
    out = CliRunner().invoke(main, ["dax", "list"], env={"TIERINGD_CONFIG": os.devnull})
    assert out.exit_code == 0, out.output
    assert "dax0.0" in out.output and "5/7" in out.output and "Movable,Normal" in out.output
    out = CliRunner().invoke(main, ["dax", "online", "dax0.0", "--zone", "sideways"])
    assert out.exit_code == 2 and "sideways" in out.output


@pytest.mark.parametrize("verb", ["online", "offline"])
def test_only_root_may_online_or_offline_memory_and_others_are_told_in_one_line(pmem_tree, monkeypatch, verb):
    """Checked before any sysfs file is touched (the block states stay as they were)."""
    states = {p: p.read_text() for p in (pmem_tree / MEM).glob("memory*/state")}
    monkeypatch.setattr(os, "geteuid", lambda: 65534)
    out = CliRunner().invoke(main, ["dax", verb, "dax0.0"])
    assert out.exit_code == 1
    assert out.output == (f"tieringctl: dax {verb} needs root: it changes which memory the whole machine "
                          f"uses (this is uid 65534)\n")
    assert {p: p.read_text() for p in states} == states
