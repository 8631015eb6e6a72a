# SPDX-License-Identifier: Apache-2.0
"""Borrowed kernel settings against a fake /proc and /sys tree."""
import json
import logging
import os

import pytest

from tieringd.kernel import sysfs, knobs

NB = "/proc/sys/kernel/numa_balancing"
RATE = "/proc/sys/kernel/numa_balancing_promote_rate_limit_MBps"
DEMOTION = "/sys/kernel/mm/numa/demotion_enabled"
SCAN_DELAY = "/sys/kernel/debug/sched/numa_balancing/scan_delay_ms"


@pytest.fixture
def tree(tmp_path):
    """A 6.12-like tree: NUMA balancing on (Debian's default on NUMA machines), debugfs mounted."""
    root = tmp_path / "root"
    for path, value in ((NB, "1"), (RATE, "65536"), (DEMOTION, "false"), (SCAN_DELAY, "1000")):
        f = root / path.lstrip("/")
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(value + "\n")
    (root / "proc/self").mkdir(parents=True)
    with sysfs.root(root):
        yield tmp_path


def read(path):
    return sysfs.read_text(path)


def test_borrow_records_before_changing_and_restore_puts_back(tree, caplog):
    state = tree / "run/knobs.json"
    k = knobs.Knobs(state)
    caplog.set_level(logging.INFO, "tieringd.kernel.knobs")
    c = k.borrow("kernel.numa_balancing", 3)
    assert (c.original, c.value) == ("1", "3") and read(NB) == "3"
    assert "borrowed kernel.numa_balancing: 1 → 3" in caplog.text
    k.borrow("kernel.numa_balancing_promote_rate_limit_MBps", 0)
    k.borrow("mm.numa.demotion_enabled", 0)      # "false" already means 0: nothing to borrow
    saved = json.loads(state.read_text())
    assert saved["schema"] == knobs.SCHEMA and saved["pid"] == os.getpid()
    assert [(x["path"], x["original"], x["value"]) for x in saved["changes"]] == \
        [(NB, "1", "3"), (RATE, "65536", "0")]
    assert k.describe() == ("kernel.numa_balancing 1→3, "
                            "kernel.numa_balancing_promote_rate_limit_MBps 65536→0")
    restored = k.restore()
    assert [c.name for c in restored] == ["kernel.numa_balancing_promote_rate_limit_MBps",
                                          "kernel.numa_balancing"]     # last borrowed, first back
    assert (read(NB), read(RATE), read(DEMOTION)) == ("1", "65536", "false")
    assert not state.exists() and k.describe() == "none"
    assert k.restore() == []                                             # idempotent


def test_the_state_file_names_the_original_even_when_the_write_fails(tree, monkeypatch):
    k = knobs.Knobs(tree / "knobs.json")
    seen = []

    def failing_write(path, value):
        seen.append(json.loads((tree / "knobs.json").read_text())["changes"])
        raise sysfs.SysfsError(22, f"cannot write {value!r} to {path}: Invalid argument")

    monkeypatch.setattr(sysfs, "write_text", failing_write)
    with pytest.raises(sysfs.SysfsError, match="Invalid argument"):
        k.borrow("kernel.numa_balancing", 7)
    assert seen == [[{"name": "kernel.numa_balancing", "path": NB, "original": "1", "value": "7",
                      "earlier": []}]]
    assert k.changes == [] and json.loads((tree / "knobs.json").read_text())["changes"] == []


def test_a_new_start_restores_what_a_crashed_run_left(tree, caplog):
    state = tree / "knobs.json"
    crashed = knobs.Knobs(state)
    crashed.borrow("kernel.numa_balancing", 3)
    crashed.borrow("numa_balancing.scan_delay_ms", 100)
    # the daemon dies here (kill -9): no restore(); its pid is gone
    saved = json.loads(state.read_text())
    saved["pid"] = 999_999_999
    state.write_text(json.dumps(saved))
    caplog.set_level(logging.INFO, "tieringd.kernel.knobs")
    with knobs.Knobs(state) as k:
        assert [c.name for c in k.recovered] == ["numa_balancing.scan_delay_ms",
                                                 "kernel.numa_balancing"]
        assert (read(NB), read(SCAN_DELAY)) == ("1", "1000")
        assert "left borrowed by a previous run (pid 999999999" in caplog.text
        assert not state.exists()
        k.borrow("kernel.numa_balancing", 3)
        assert state.exists()
    assert read(NB) == "1" and not state.exists()


def test_a_crash_between_recording_and_writing_restores_nothing(tree, caplog):
    state = tree / "knobs.json"
    state.write_text(json.dumps({"schema": knobs.SCHEMA, "pid": 999_999_999, "changes": [
        {"name": "kernel.numa_balancing", "path": NB, "original": "1", "value": "3"}]}))
    caplog.set_level(logging.WARNING, "tieringd.kernel.knobs")
    assert knobs.Knobs(state).recover() == []
    assert read(NB) == "1" and not state.exists()
    assert "someone else" not in caplog.text


def test_a_state_file_of_a_live_process_is_refused(tree):
    state = tree / "knobs.json"
    state.write_text(json.dumps({"schema": knobs.SCHEMA, "pid": 4242, "changes": []}))
    os.makedirs(sysfs.path("/proc/4242"))      # that pid is alive
    with pytest.raises(knobs.KnobError, match="borrowed by pid 4242, which still runs"):
        knobs.Knobs(state).recover()
    state.write_text("{not json")
    with pytest.raises(knobs.KnobError, match="unreadable state file"):
        knobs.Knobs(state).recover()


def test_a_setting_changed_by_someone_else_is_left_alone(tree, caplog):
    k = knobs.Knobs(tree / "knobs.json")
    k.borrow("kernel.numa_balancing", 3)
    sysfs.write_text(NB, "2")                    # an administrator, while we run
    caplog.set_level(logging.WARNING, "tieringd.kernel.knobs")
    assert k.restore() == []
    assert read(NB) == "2"
    assert "was changed to 2 by someone else while borrowed (we set 3)" in caplog.text


def test_borrowing_again_keeps_the_first_original(tree):
    state = tree / "knobs.json"
    k = knobs.Knobs(state)
    k.borrow("kernel.numa_balancing", 3)
    c = k.borrow("kernel.numa_balancing", 2)
    assert (c.original, c.value, c.earlier) == ("1", "2", ("3",)) and len(k.changes) == 1
    # a crash right after the state file was written but before "2" reached the kernel: still ours
    sysfs.write_text(NB, "3")
    saved = json.loads(state.read_text())
    saved["pid"] = 999_999_999
    state.write_text(json.dumps(saved))
    assert [c.name for c in knobs.Knobs(state).recover()] == ["kernel.numa_balancing"]
    assert read(NB) == "1"


def test_a_setting_the_kernel_lacks_is_reported_not_raised(tree):
    k = knobs.Knobs(tree / "knobs.json")
    os.unlink(sysfs.path(RATE))                   # a 5.x kernel: no promotion rate limit
    assert k.borrow("kernel.numa_balancing_promote_rate_limit_MBps", 0) is None
    assert "this kernel has no /proc/sys/kernel/numa_balancing_promote_rate_limit_MBps" in \
        k.missing["kernel.numa_balancing_promote_rate_limit_MBps"]
    assert k.borrow("numa_balancing.hot_threshold_ms", 10) is None          # debugfs, but absent
    assert "numa_balancing.hot_threshold_ms" in k.missing
    assert k.changes == [] and not (tree / "knobs.json").exists()
    with pytest.raises(ValueError, match="unknown kernel setting"):
        k.borrow("kernel.no_such_thing", 1)


def test_scan_settings_fall_back_to_the_sysctl_of_older_kernels(tree):
    # before v5.13 the scan settings were sysctls; without debugfs mounted they are reported so
    os.unlink(sysfs.path(SCAN_DELAY))
    os.rmdir(sysfs.path("/sys/kernel/debug/sched/numa_balancing"))
    os.rmdir(sysfs.path("/sys/kernel/debug/sched"))
    path, why = knobs.resolve("numa_balancing.scan_delay_ms")
    assert path is None and "is debugfs mounted" in why
    old = sysfs.path("/proc/sys/kernel/numa_balancing_scan_delay_ms")
    with open(old, "w") as f:
        f.write("1000\n")
    assert knobs.resolve("numa_balancing.scan_delay_ms") == (
        "/proc/sys/kernel/numa_balancing_scan_delay_ms", "")
