# SPDX-License-Identifier: Apache-2.0
"""``tieringctl pool``, the pool's line in ``tieringctl status`` and the pool's metrics, end to end:
two pool agents against a real etcd cluster (tests/etcd_support.py), one of them the daemon's — the
service (control socket, metrics endpoint) around the stand-in loop of the service tests
(tests/unit/daemon_standin.py: real registry, table, mover) — and the real ``tieringctl`` asking it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest

from paths import REPO
from pool_support import EXT, Demand, claims_in_etcd, config, held, hosts, of, pool_file, serving_pool, settle

pytestmark = pytest.mark.etcd


def tieringctl(run_dir: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TIERINGD_RUN_DIR": run_dir, "PYTHONPATH": str(REPO), "COLUMNS": "100"}
    return subprocess.run([sys.executable, "-c", "from tieringd.cli import main; main()", *args],
                          capture_output=True, text=True, env=env, timeout=120)


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """/metrics, parsed by prometheus-client's own parser: (name, labels) → value."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_tieringctl_pool_status_and_metrics_show_the_pool_as_this_host_sees_it(etcd, tmp_path):
    dev = pool_file(tmp_path, 16)
    with hosts(config(etcd, dev, "host-a"), config(etcd, dev, "host-b")) as (a, b):
        settle([a, b], lambda: a.member.state == b.member.state == "member" and held(a) and held(b))
        Demand(a).press([a, b], 2 * EXT)
        for x in (b, a):
            x.beat()                              # a's map has b's latest entry
        run = str(tmp_path / "run")
        os.makedirs(run)
        with serving_pool(a, run, metrics_listen="127.0.0.1:0") as svc:
            doc = json.loads(tieringctl(run, "pool", "--json").stdout)
            claims = claims_in_etcd(a.etcd)
            rows = {r["host"]: r for r in doc["hosts"]}
            assert doc["schema"] == "tieringd.pool-map/1" and doc["pool"]["uuid"] == a.member.pool.uuid
            assert set(rows) == {"host-a", "host-b"} and rows["host-a"]["this"] and not rows["host-b"]["this"]
            assert rows["host-a"]["extents"] == len(held(a)) and rows["host-b"]["extents"] == len(of(claims, "host-b"))
            assert rows["host-b"]["claimed_bytes"] == len(held(b)) * EXT
            assert rows["host-a"]["used_bytes"] == a.tier.log.live_bytes > 0
            assert doc["extents_free"] == 15 - len(held(a)) - len(held(b))
            assert 0 < rows["host-b"]["lease_left_s"] <= a.cfg.lease_ttl_s and doc["etcd"] == "ok"

            text = tieringctl(run, "pool").stdout
            assert f"pool {a.member.pool.uuid} under /t/pool/" in text
            assert f"extents: 15 of 2.0 MiB, {doc['extents_free']} free" in text
            assert "* host-a" in text and "  host-b" in text and "lease left" in text

            status = tieringctl(run, "status").stdout
            assert f"pool {a.member.pool.uuid[:8]}: host-a member, {len(held(a))} of 15 extents" in status

            port = svc.metrics.address[1]
            metrics = scrape(port)
            assert metrics[("tieringd_pool_host_claimed_bytes", (("host", "host-b"),))] == len(held(b)) * EXT
            assert metrics[("tieringd_pool_extents", (("state", "held"),))] == len(held(a))
            assert metrics[("tieringd_pool_extents", (("state", "free"),))] == doc["extents_free"]
            assert metrics[("tieringd_pool_etcd_up", ())] == 1

            for i in range(3):                    # etcd away: the reports say so, and answer at once
                etcd.kill(i)
            a.beat()
            text = tieringctl(run, "pool").stdout
            assert "etcd unreachable for" in text and "serving what this host holds, claiming nothing new" in text
            assert "etcd unreachable for" in tieringctl(run, "status").stdout
            assert scrape(port)[("tieringd_pool_etcd_up", ())] == 0
