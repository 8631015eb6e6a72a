# SPDX-License-Identifier: Apache-2.0
"""The probe's file and its choice of initiator (tieringd/memory/probe.py); the measurement itself runs on
real memory in tests/host/test_topology_live.py and tests/lab/test_topology_lab.py."""
import json
from pathlib import Path

import pytest

from tieringd.kernel import sysfs
from tieringd.memory import probe, topology
from tieringd.config import ConfigError

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "sysfs"
RESULTS = [{"node": 0, "tier": "dram", "read_bandwidth_mb_s": 10900, "read_latency_ns": 579.4, "error": None},
           {"node": 1, "tier": "cxl-dram", "read_bandwidth_mb_s": None, "read_latency_ns": None,
            "error": "the node has no memory"}]


def test_saved_figures_are_read_back_in_the_same_boot_only(tmp_path):
    path = str(tmp_path / "state" / "probe.json")
    probe.save(path, {"boot_id": probe.boot_id(), "measured_at": "now", "results": RESULTS})
    doc = json.loads(Path(path).read_text())
    assert doc["schema"] == probe.SCHEMA and not (tmp_path / "state" / "probe.json.tmp").exists()
    notes = []
    assert probe.read_saved(path, notes) == {0: {"read_latency_ns": 579.4, "read_bandwidth_mb_s": 10900.0,
                                                 "measured_at": "now"}}      # the failed node is left out
    assert notes == []
    probe.save(path, {"boot_id": "another-boot", "results": RESULTS})
    assert probe.read_saved(path, notes) == {} and "from another boot" in notes[-1]
    Path(path).write_text("{not json")
    assert probe.read_saved(path, notes) == {} and "unreadable" in notes[-1]
    assert probe.read_saved(str(tmp_path / "none.json"), notes) == {} and len(notes) == 2
    assert probe.read_saved("", notes) == {}


def test_a_captured_tree_never_takes_this_machines_figures(tmp_path):
    path = str(tmp_path / "probe.json")
    probe.save(path, {"boot_id": probe.boot_id(), "results": RESULTS})
    with sysfs.root(FIXTURES / "host-6.18"):
        assert probe.read_saved(path, []) == {}


def test_where_the_file_is_kept():
    assert probe.saved_path({}) == probe.DEFAULT_FILE
    assert probe.saved_path({"topology": {"probe_file": ""}}) == ""
    with pytest.raises(ConfigError, match=r"\[topology\] probe_file: expected a path, got 5"):
        probe.saved_path({"topology": {"probe_file": 5}})
    with pytest.raises(probe.ProbeError, match="cannot save the results to /proc/probe.json"):
        probe.save("/proc/probe.json", {"results": []})


def test_the_initiator_is_the_nearest_dram_node_with_cpus():
    with sysfs.root(FIXTURES / "pmem-6.12"):
        topo = topology.discover({})
    assert probe.pick_initiator(topo, 2, None).id == 0
    assert probe.pick_initiator(topo, 2, 0).id == 0
    with pytest.raises(probe.ProbeError, match="node 1 has no CPUs"):
        probe.pick_initiator(topo, 2, 1)
    with pytest.raises(probe.ProbeError, match="no NUMA node 9"):
        probe.pick_initiator(topo, 2, 9)


def test_a_missing_library_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("TIERINGD_MEMBENCH", str(tmp_path / "libnone.so"))
    with pytest.raises(probe.ProbeError, match="is not built: run make"):
        probe.load_library()
