# SPDX-License-Identifier: Apache-2.0
"""How make test splits the suite between its workers (tests/lab_workers.py): a lab module's boot of
one kernel stays on one worker, the host's tests stay together, and every lab module says how long its
groups take so that the longest go first."""
from __future__ import annotations

from pathlib import Path

import lab_workers
from paths import REPO

KERNELS = ("6.1", "6.12", "7.3")


def group(nodeid: str) -> str:
    return lab_workers.work_group(nodeid, KERNELS)


def test_a_lab_modules_tests_of_one_kernel_form_one_group():
    assert group("tests/lab/test_signal_lab.py::test_a[6.12]") == "test_signal_lab[6.12]"
    assert group("tests/lab/test_signal_lab.py::test_b[6.12]") == "test_signal_lab[6.12]"
    assert group("tests/lab/test_signal_lab.py::test_a[6.1]") == "test_signal_lab[6.1]"
    assert group("tests/lab/test_signal_lab.py::test_a[7.3-thp]") == "test_signal_lab[7.3]"


def test_a_parameter_that_is_not_a_kernel_keeps_the_module_together():
    # test_dax_lab's function-scoped `guest` picks one of two module-scoped boots: split by it, the
    # pmem boot would run once per group.
    assert group("tests/lab/test_dax_lab.py::test_x[pmem]") == "test_dax_lab"
    assert group("tests/lab/test_dax_lab.py::test_x[cxl-type3]") == "test_dax_lab"
    assert group("tests/lab/test_dax_lab.py::test_pmem_only") == "test_dax_lab"
    assert group("tests/lab/test_lab.py::test_pmem_fsdax_mapped") == "test_lab"


def test_host_tests_share_one_group_whatever_their_parameters():
    assert group("tests/unit/test_heat.py::test_a") == "host"
    assert group("tests/host/test_shim.py::test_b[6.1]") == "host"


def test_the_scheduler_groups_node_ids_the_same_way():
    sched = lab_workers.GroupScheduling.__new__(lab_workers.GroupScheduling)  # no workers to set up
    sched._kernels = KERNELS
    assert sched._split_scope("tests/lab/test_loop_lab.py::test_a[7.3]") == "test_loop_lab[7.3]"
    assert sched._split_scope("tests/unit/test_heat.py::test_a") == "host"


def test_every_lab_module_says_how_long_its_groups_take():
    # The order only works if every module states its cost: a new one without LAB_GROUP_S would be
    # queued as a 60 s group wherever that falls.
    for path in sorted(Path(REPO / "tests" / "lab").glob("test_*.py")):
        assert "\nLAB_GROUP_S = " in path.read_text(), f"{path.name} has no LAB_GROUP_S"
