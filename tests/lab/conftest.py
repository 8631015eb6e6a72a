# SPDX-License-Identifier: Apache-2.0
"""The ``lab`` fixture: run a bash script as root in a fresh QEMU guest of a lab profile.

    @pytest.mark.lab
    def test_something(lab):
        r = lab.run("cat /sys/devices/system/node/online", profile="cxl", kernel="6.12")
        assert r.rc == 0, r.stderr
        assert r.stdout.strip() == "0-1"

The guest's cwd is the repository root (the host root is shared read-only, so ``.venv/bin/python`` and
``build/`` work inside); ``$LAB_OUT`` is a writable folder that ``r.out_dir`` names on the host. A boot
costs 15-20 s under TCG: batch many checks into one script. Profiles, kernels and the runner:
``scripts/lab.py`` and docs/lab.md. The total lab time is printed at the end of the session (tests/lab_workers.py, which
also says how ``make test`` runs two guests at a time).
"""
from __future__ import annotations

import os
import time

import pytest

import lab_workers
from paths import REPO

labmod = lab_workers.load_lab_module()
LabResult = labmod.LabResult
LabError = labmod.LabError
KERNELS = tuple(labmod.KERNELS)
PROFILES = tuple(labmod.PROFILES)


class Lab:
    """What the ``lab`` fixture hands to tests."""

    kernels = KERNELS
    profiles = PROFILES
    repo = REPO

    def __init__(self, tmp_factory: pytest.TempPathFactory):
        self._tmp = tmp_factory

    def kernel_release(self, kernel: str = labmod.DEFAULT_KERNEL) -> str:
        return labmod.get_kernel(kernel).release

    def run(self, script: str, profile: str = labmod.DEFAULT_PROFILE,
            kernel: str = labmod.DEFAULT_KERNEL, timeout_s: float = 300,
            node_mib: int | None = None) -> LabResult:
        """Boot a fresh ``profile`` guest on ``kernel``, run ``script`` (bash, as root, cwd = repo root,
        ``$LAB_OUT`` writable) and return ``LabResult(rc, stdout, stderr, wall_s, out_dir, dmesg, ...)``.
        ``node_mib`` sizes each boot-time DRAM node (node0 with the CPUs, node1 CPU-less; default: the
        profile's 2 GiB). A guest that does not finish in ``timeout_s`` is killed and the test fails
        with its log."""
        if labmod.Kernel.load(kernel) is None:
            msg = f"lab kernel {kernel} is not in {labmod.cache_dir()} (make lab-kernels)"
            if os.environ.get("TIERINGD_REQUIRE_ALL") == "1":
                pytest.fail(msg, pytrace=False)
            pytest.skip(msg)
        out = self._tmp.mktemp(f"lab-{profile}-{kernel}-")
        label = f"{profile} (nodes {node_mib} MiB)" if node_mib else profile
        t0 = time.monotonic()
        try:
            r = labmod.run(script, profile=profile, kernel=kernel, timeout_s=timeout_s, out_dir=out,
                           node_mib=node_mib)
        except LabError as e:
            _count(label, kernel, time.monotonic() - t0, None)
            pytest.fail(f"lab {profile}/{kernel}: {e}", pytrace=False)
        _count(label, kernel, r.wall_s, r.boot_s)
        return r


    def run_pair(self, scripts: dict[str, str], etcd, profile: str = "pool",
                 kernel: str = labmod.DEFAULT_KERNEL, timeout_s: float = 600,
                 node_mib: int | None = None, on_start=None) -> dict[str, LabResult]:
        """Boot hosts ``a`` and ``b`` of a two-host profile at once, ``scripts[h]`` in each, with
        ``etcd`` (an ``EtcdCluster`` on the host's loopback, tests/etcd_support.py) reachable from
        both through user-mode networking only; returns ``{"a": LabResult, "b": LabResult}``
        (scripts/lab/pool/pair.py; in each guest ``$LAB_HOST``, ``$LAB_SHARED``, ``$TIERINGD_LAB_ETCD``)."""
        if labmod.Kernel.load(kernel) is None:
            msg = f"lab kernel {kernel} is not in {labmod.cache_dir()} (make lab-kernels)"
            if os.environ.get("TIERINGD_REQUIRE_ALL") == "1":
                pytest.fail(msg, pytrace=False)
            pytest.skip(msg)
        import pair
        outs = {h: self._tmp.mktemp(f"lab-{profile}-{h}-{kernel}-") for h in pair.HOSTS}
        t0 = time.monotonic()
        try:
            results = pair.run_pair(labmod, scripts, endpoints=etcd.endpoints, profile=profile,
                                    kernel=kernel, timeout_s=timeout_s, out_dirs=outs, node_mib=node_mib,
                                    on_start=on_start)
        except LabError as e:
            _count(f"{profile} (pair)", kernel, time.monotonic() - t0, None)
            pytest.fail(f"lab {profile}/{kernel}: {e}", pytrace=False)
        for h, r in results.items():
            _count(f"{profile} host {h}", kernel, r.wall_s, r.boot_s)
        return results


def _count(profile: str, kernel: str, wall_s: float, boot_s: float | None) -> None:
    lab_workers.count_boot(profile, kernel, wall_s, boot_s, "KVM" if labmod.kvm_wanted() else "TCG")


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Lab:
    labmod.prune_runs()
    return Lab(tmp_path_factory)
