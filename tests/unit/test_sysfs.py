# SPDX-License-Identifier: Apache-2.0
import pytest

from tieringd.kernel import sysfs


def test_parse_and_format_list_round_trip():
    assert sysfs.parse_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert sysfs.parse_list("") == []
    assert sysfs.format_list([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    with pytest.raises(ValueError, match="not a kernel list"):
        sysfs.parse_list("0-x")


def test_root_override_reads_the_fixture_tree(tmp_path):
    node = tmp_path / "sys/devices/system/node"
    node.mkdir(parents=True)
    (node / "online").write_text("0-1\n")
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/vmstat").write_text("pgmigrate_success 12\nnuma_hint_faults 3\n")
    with sysfs.root(tmp_path):
        assert sysfs.read_text("/sys/devices/system/node/online") == "0-1"
        assert sysfs.read_keyed("/proc/vmstat")["pgmigrate_success"] == "12"
        assert sysfs.glob("/sys/devices/system/node/*") == ["/sys/devices/system/node/online"]
        assert sysfs.read_int("/sys/nothing", -1) == -1
        with pytest.raises(sysfs.SysfsError, match="cannot read /sys/nothing"):
            sysfs.read_text("/sys/nothing")
    assert sysfs.get_root() == ""
