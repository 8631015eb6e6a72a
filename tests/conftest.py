# SPDX-License-Identifier: Apache-2.0
"""Markers that need a facility (root, BPF, the shim, the lab) skip with a stated reason when it is
missing — except under ``TIERINGD_REQUIRE_ALL=1`` (set by ``make test``), where a missing facility is a
failure: on the machines the project is built for, everything is there, and a skip would hide a broken
install."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from paths import BUILD, REPO, SHIM_SO

# make test runs two workers, two lab guests at a time: how the suite is split, and the lab summary.
pytest_plugins = ["lab_workers", "etcd_support"]   # etcd_support: the `etcd` fixture (a real cluster)
REQUIRE_ALL = os.environ.get("TIERINGD_REQUIRE_ALL") == "1"


def _root_missing() -> str | None:
    return None if os.geteuid() == 0 else "needs root"


def _bpf_missing() -> str | None:
    if os.geteuid() != 0:
        return "BPF needs root"
    if not os.path.exists("/sys/kernel/btf/vmlinux"):
        return "kernel has no BTF (/sys/kernel/btf/vmlinux)"
    if not os.path.exists("/sys/kernel/tracing/events"):
        return "tracefs is not mounted (mount -t tracefs nodev /sys/kernel/tracing)"
    if not list((BUILD / "bpf").glob("*.bpf.o")):
        return "BPF objects are not built (make)"
    return None


def _shim_missing() -> str | None:
    return None if SHIM_SO.exists() else f"{SHIM_SO.relative_to(REPO)} is not built (make)"


def _lab_missing() -> str | None:
    if shutil.which("qemu-system-x86_64") is None:
        return "qemu-system-x86_64 is not installed (make setup)"
    return None


def _etcd_missing() -> str | None:
    from etcd_support import etcd_missing
    return etcd_missing()


FACILITIES = {"root": _root_missing, "bpf": _bpf_missing, "shim": _shim_missing, "lab": _lab_missing,
              "etcd": _etcd_missing}


def pytest_runtest_setup(item: pytest.Item) -> None:
    for name, check in FACILITIES.items():
        if item.get_closest_marker(name) is None:
            continue
        reason = check()
        if reason is None:
            continue
        if REQUIRE_ALL:
            pytest.fail(f"[{name}] {reason} (TIERINGD_REQUIRE_ALL=1: facilities must be present)")
        pytest.skip(f"[{name}] {reason}")


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return REPO / "tests" / "fixtures"
