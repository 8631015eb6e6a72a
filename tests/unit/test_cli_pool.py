# SPDX-License-Identifier: Apache-2.0
"""``tieringctl pool`` and the pool's line of ``tieringctl status`` where no etcd is needed: a daemon
without ``[pool]``, and the words for an etcd that does not answer. The pool's map against a real
etcd is tests/host/test_pool_cli.py."""
from tieringd.cli import pool as cli_pool
from tieringd.pool import poolmap


def test_a_daemon_without_a_pool_says_so_in_one_line():
    assert cli_pool.render(poolmap.disabled()) == "no pool: [pool] endpoints are not set"
    assert cli_pool.summary(None) == "pool: off ([pool] endpoints not set)"


def test_a_host_that_lost_etcd_says_since_when_why_and_what_it_does():
    status = {"host": "infer-a", "state": "member", "why": "", "etcd": "unreachable",
              "etcd_error": "no etcd member answered (10.0.0.3:2379: ConnectionFailedError)", "etcd_lost_s": 75.0,
              "pool": {"uuid": "0123456789abcdef" * 2, "extents": 24, "extent_bytes": 64 << 20,
                       "device_bytes": 24 * (64 << 20)},
              "extents_held": [1, 2, 3], "extents_free": 9, "hosts": 2, "used_bytes": 96 << 20}
    assert cli_pool.summary(status) == (
        "pool 01234567: infer-a member, 3 of 23 extents of 64.0 MiB (96.0 MiB used), 9 free, 2 hosts; "
        "etcd unreachable for 1m15s (no etcd member answered (10.0.0.3:2379: ConnectionFailedError)): "
        "serving what this host holds, claiming nothing new")
