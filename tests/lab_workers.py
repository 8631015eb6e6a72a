# SPDX-License-Identifier: Apache-2.0
"""Two lab guests side by side: how ``make test`` splits the suite between pytest-xdist workers, and
the lab time summary gathered from them.

Why: the lab is nine tenths of ``make test`` and most of a boot is a fixed observation window (a
sampling phase, a daemon's run, a ``tieringctl sample`` window) in which one TCG guest keeps 1.3 of
the host's 2 cores busy on average (make test on 8f7c037: 57 CPU-minutes in 43 minutes). Run one
after the other, the boots took 33-40 minutes; two at a time share the cores and overlap the windows.

How: ``make test`` runs ``pytest -n 2`` (pytest-xdist), and this plugin hands xdist a scheduler that
sends whole groups of tests to a worker:
- a lab module's tests of one kernel form one group (they share that kernel's module-scoped boot;
  split, each worker would boot it again), the module's other tests another;
- every test outside tests/lab/ is in one group, "host", run by one worker in file order as before:
  host tests borrow global kernel state (sysctls, tracepoints, the BPF samplers), so two of them never
  run at once. Lab guests touch nothing of the host's but its CPUs.
The group comes from the test's node id alone, because xdist's controller never imports the tests
(and xdist 3.8's own ``xdist_group`` mark no longer reaches the node id under pytest 9.2, which keeps
it in ``Node._id``). Each worker sorts its collection longest group first (a lab module's
``LAB_GROUP_S``: about how long one of its groups takes here), and the scheduler keeps that order, so
the short groups fill the end and neither worker waits long for the other. Two guests side by side
need ``scripts/lab.py``'s single-threaded TCG (``TCG_OPTS`` says why).

Without xdist (``pytest tests/lab/...`` by hand) none of this applies and the summary is the same.
"""
from __future__ import annotations

import json
import os
import sys
import threading

import pytest

from paths import LAB_SCRIPTS

try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # pytest by hand without pytest-xdist: nothing to schedule
    LoadScopeScheduling = object

HOST_GROUP = "host"
HOST_GROUP_S = 160       # every test outside tests/lab/, one after the other (make test, 2026-12-02)
DEFAULT_GROUP_S = 60     # a lab module that does not say

_runs: list[dict] = []   # this process's boots: profile, kernel, wall_s, boot_s (None: failed)
_lock = threading.Lock()
_merged: list[dict] = []  # the controller's copy of every worker's boots


def count_boot(profile: str, kernel: str, wall_s: float, boot_s: float | None, accel: str) -> None:
    with _lock:
        _runs.append({"profile": profile, "kernel": kernel, "wall_s": wall_s, "boot_s": boot_s,
                      "accel": accel, "worker": os.environ.get("PYTEST_XDIST_WORKER", "")})


def work_group(nodeid: str, kernels: tuple[str, ...]) -> str:
    """The group of a test, from its node id: "host", "test_x_lab" or "test_x_lab[6.12]"."""
    path, _, name = nodeid.partition("::")
    if not path.startswith("tests/lab/"):
        return HOST_GROUP
    module = path.rsplit("/", 1)[-1].removesuffix(".py")
    ids = name.rpartition("[")[2].rstrip("]").split("-") if name.endswith("]") else []
    kernel = next((i for i in ids if i in kernels), None)
    return f"{module}[{kernel}]" if kernel else module


def group_cost_s(item: pytest.Item) -> float:
    """About how long an item's group takes (orders the queue; never a limit)."""
    if work_group(item.nodeid, ()) == HOST_GROUP:
        return HOST_GROUP_S
    return float(getattr(item.module, "LAB_GROUP_S", DEFAULT_GROUP_S))


def load_lab_module():
    """scripts/lab.py as a module, loaded once for tests/lab/conftest.py and for xdist's controller,
    which loads no conftest below tests/. The loader is scripts/lab/loop_report.py's, the one copy."""
    if str(LAB_SCRIPTS) not in sys.path:
        sys.path.insert(0, str(LAB_SCRIPTS))
    from loop_report import lab_module
    return lab_module()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if getattr(config, "workerinput", None) is None:  # not an xdist worker: file order, as always
        return
    # Longest first; a stable sort keeps each group's tests together and in their order.
    items.sort(key=lambda it: -group_cost_s(it))


class GroupScheduling(LoadScopeScheduling):
    """xdist's loadscope scheduling (a worker runs whole scopes), with work_group() as the scope, in
    the workers' collection order."""

    def __init__(self, config: pytest.Config, log=None) -> None:
        config.option.loadscopereorder = False  # keep the longest-first order of the collection
        super().__init__(config, log)
        self._kernels = tuple(load_lab_module().KERNELS)

    def _split_scope(self, nodeid: str) -> str:
        return work_group(nodeid, self._kernels)


@pytest.hookimpl(optionalhook=True)  # an xdist hook, called on the controller
def pytest_xdist_make_scheduler(config: pytest.Config, log) -> GroupScheduling:
    return GroupScheduling(config, log)


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = getattr(session.config, "workeroutput", None)  # set in xdist workers only
    if out is not None:
        out["lab_runs"] = json.dumps(_runs)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: the controller hears a worker has finished
def pytest_testnodedown(node, error) -> None:
    runs = getattr(node, "workeroutput", {}).get("lab_runs")
    if runs:
        _merged.extend(json.loads(runs))


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    runs = _merged or _runs
    if not runs:
        return
    tr = terminalreporter
    tr.section("lab")
    for r in runs:
        what = "FAILED" if r["boot_s"] is None else f"guest boot {r['boot_s']:.1f} s"
        worker = f" [{r['worker']}]" if r["worker"] else ""
        tr.write_line(f"  {r['profile']}/{r['kernel']}: {r['wall_s']:.1f} s ({what}){worker}")
    total_s = sum(r["wall_s"] for r in runs)
    per_worker = {}
    for r in runs:
        per_worker[r["worker"]] = per_worker.get(r["worker"], 0.0) + r["wall_s"]
    line = f"lab: {len(runs)} guest boots, {total_s:.1f} s of lab time"
    if len(per_worker) > 1 or "" not in per_worker:
        line += " (" + ", ".join(f"{w} {s:.1f} s" for w, s in sorted(per_worker.items())) + ")"
    tr.write_line(line + f" ({'/'.join(sorted({r['accel'] for r in runs}))})")
