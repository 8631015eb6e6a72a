# SPDX-License-Identifier: Apache-2.0
"""Two lab guests side by side: how ``make test`` splits the suite between pytest-xdist workers, and
the lab time summary gathered from them.

Why: the lab is nine tenths of ``make test`` and most of a boot is a fixed observation window (a
sampling phase, a daemon's run, a ``tieringctl sample`` window) in which one TCG guest keeps 1.3 of
the host's 2 cores busy on average (make test on 8f7c037: 57 CPU-minutes in 43 minutes). Run one
after the other, the boots took 33-40 minutes; two at a time share the cores and overlap the windows.

How: ``make test`` runs ``pytest -n 2 --dist loadgroup --no-loadscope-reorder``. Every test gets an
``xdist_group``, and a worker runs a whole group:
- a lab module's tests of one kernel form one group (they share that kernel's module-scoped boot;
  split, each worker would boot it again), the module's other tests another;
- every test outside tests/lab/ is in one group, "host", run by one worker in file order as before:
  host tests borrow global kernel state (sysctls, tracepoints, the BPF samplers), so two of them never
  run at once. Lab guests touch nothing of the host's but its CPUs.
Groups are queued longest first (a module's ``LAB_GROUP_S``: about how long one of its groups takes
here), so the short ones fill the end and neither worker waits long for the other.

Without xdist (``pytest tests/lab/...`` by hand) none of this applies and the summary is the same.
"""
from __future__ import annotations

import json
import os
import sys
import threading

import pytest

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


def _kernel_of(item: pytest.Item, kernels: tuple[str, ...]) -> str | None:
    """The lab kernel an item is parametrized with (its module-scoped boot), if any."""
    callspec = getattr(item, "callspec", None)
    for value in (callspec.params.values() if callspec else ()):
        if isinstance(value, str) and value in kernels:
            return value
    return None


def work_group(item: pytest.Item, kernels: tuple[str, ...]) -> tuple[str, float]:
    """(group name, expected seconds) of one test."""
    path = item.path
    if path.parent.name != "lab":
        return HOST_GROUP, HOST_GROUP_S
    kernel = _kernel_of(item, kernels)
    name = path.stem + (f"[{kernel}]" if kernel else "")
    return name, float(getattr(item.module, "LAB_GROUP_S", DEFAULT_GROUP_S))


def _lab_kernels() -> tuple[str, ...]:
    # tests/lab/conftest.py has loaded scripts/lab.py under this name by the time collection ends;
    # without it a lab module stays one group (one worker boots all its kernels, as before).
    lab = sys.modules.get("tieringd_lab")
    return tuple(lab.KERNELS) if lab else ()


@pytest.hookimpl(tryfirst=True)  # before xdist's worker appends "@group" to each node id
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):
        return
    kernels = _lab_kernels()
    cost_s: dict[pytest.Item, float] = {}
    for item in items:
        name, cost_s[item] = work_group(item, kernels)
        item.add_marker(pytest.mark.xdist_group(name))
    # Longest first; a stable sort keeps each group's tests in their order (and together).
    items.sort(key=lambda it: -cost_s[it])


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
