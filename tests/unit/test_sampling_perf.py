# SPDX-License-Identifier: Apache-2.0
"""Perf event choice and encoding (tieringd/sampling/_perf.py) from PMU sysfs trees built in tmp_path
from the documented formats (no PMU on any machine here to capture them from)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tieringd.kernel import sysfs
from tieringd.sampling import _perf


def _pmu_tree(root: Path, pmus: dict[str, dict]) -> None:
    for name, spec in pmus.items():
        d = root / "sys/bus/event_source/devices" / name
        (d / "format").mkdir(parents=True)
        (d / "events").mkdir()
        (d / "type").write_text(f"{spec['type']}\n")
        for k, v in spec.get("format", {}).items():
            (d / "format" / k).write_text(v + "\n")
        for k, v in spec.get("events", {}).items():
            (d / "events" / k).write_text(v + "\n")


def test_perf_event_choice_from_sysfs(tmp_path):
    intel = {"cpu": {"type": 4, "format": {"event": "config:0-7", "umask": "config:8-15",
                                           "ldlat": "config1:0-15"},
                     "events": {"mem-loads": "event=0xcd,umask=0x1,ldlat=3"}}}
    _pmu_tree(tmp_path / "intel", intel)
    with sysfs.root(tmp_path / "intel"):
        ev = _perf.resolve_event("auto")
        assert ev.name == "intel-mem-loads" and ev.hardware
        assert ev.attr.type == 4 and ev.attr.config == 0x1cd and ev.attr.config1 == 30
        assert ev.attr.sample_type & _perf.PERF_SAMPLE_ADDR
        assert (ev.attr.flags >> _perf.ATTR_PRECISE_SHIFT) & 3 == 2
    _pmu_tree(tmp_path / "amd", {"ibs_op": {"type": 11, "format": {"cnt_ctl": "config:19"}}})
    with sysfs.root(tmp_path / "amd"):
        assert _perf.resolve_event("auto").name == "amd-ibs-op"
        assert _perf.resolve_event("auto").attr.type == 11
    _pmu_tree(tmp_path / "vm", {"software": {"type": 1}})
    with sysfs.root(tmp_path / "vm"):
        with pytest.raises(OSError, match="no data-address PMU.*VM without vPMU"):
            _perf.resolve_event("auto")
        sw = _perf.resolve_event("software-page-faults")
        assert sw.attr.type == _perf.PERF_TYPE_SOFTWARE and sw.attr.sample_period == 1
    with pytest.raises(ValueError, match="unknown PMU event"):
        _perf.resolve_event("nonsense")


def test_encode_split_bitfields(tmp_path):
    _pmu_tree(tmp_path, {"x": {"type": 9, "format": {"ev": "config:0-7,32-35", "f": "config2:3"}}})
    with sysfs.root(tmp_path):
        enc = _perf.encode_sysfs_event("x", "ev=0x1ab,f")
    assert enc["config"] == 0xab | (0x1 << 32) and enc["config2"] == 1 << 3
