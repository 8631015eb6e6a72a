# SPDX-License-Identifier: Apache-2.0
"""A real etcd cluster for the pool's tests: Debian's etcd-server, three members on loopback ports,
started per test by the ``etcd`` fixture and stopped after it (scripts/lab/pool/etcdcluster.py).
Tests that use it carry ``@pytest.mark.etcd``: they skip (fail under TIERINGD_REQUIRE_ALL=1) where
etcd or the etcd3gw client is missing. No test mocks etcd."""
from __future__ import annotations

import importlib.util
import shutil
import sys

import pytest

from paths import LAB_SCRIPTS

if str(LAB_SCRIPTS / "pool") not in sys.path:
    sys.path.insert(0, str(LAB_SCRIPTS / "pool"))
import etcdcluster  # noqa: E402

EtcdCluster = etcdcluster.EtcdCluster


def etcd_missing() -> str | None:
    if shutil.which("etcd") is None:
        return "etcd is not installed (Debian's etcd-server: make setup)"
    if importlib.util.find_spec("etcd3gw") is None:
        return "the etcd3gw client is not installed (make setup)"
    return None


@pytest.fixture
def etcd(tmp_path):
    """A fresh three-member cluster on loopback ports; ``etcd.endpoints``, ``kill(i)``, ``start_member(i)``."""
    cluster = EtcdCluster(tmp_path / "etcd").start()
    try:
        yield cluster
    finally:
        cluster.stop()
