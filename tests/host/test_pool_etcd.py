# SPDX-License-Identifier: Apache-2.0
"""The pool across hosts against a real etcd: a three-member cluster of Debian's etcd-server on
loopback ports (tests/etcd_support.py), never a mock. Each "host" is a pool agent with its own etcd
client, its own DAX-remap tier and its own mapping of one file that stands for the shared device
(``[pool] device`` takes a file as well as /dev/daxX.Y), opened through ``pool.tier.open_tier`` as
the daemon opens it (tests/host/pool_support.py). The faults (etcd members killed, etcd away, a
host killed with SIGKILL) are in test_pool_faults.py."""
from __future__ import annotations

import shutil
import time

import pytest

from pool_support import EXT, MiB, TTL, ROUNDS, Demand, claims_in_etcd, config, held, hosts, of, pool_file, settle
from tieringd.pool import etcd as E
from tieringd.pool import schema as S

pytestmark = pytest.mark.etcd

# ---- joining and claiming --------------------------------------------------------------------------

def test_two_hosts_claim_disjoint_extents_of_one_pool(etcd, tmp_path):
    dev = pool_file(tmp_path, 16)
    with hosts(config(etcd, dev, "host-a"), config(etcd, dev, "host-b")) as (a, b):
        settle([a, b], lambda: a.member.state == b.member.state == "member" and held(a) and held(b))
        assert a.member.proved_by.startswith("alone")           # a created the pool
        assert b.member.proved_by == "member host-a read this host's nonce on its device"
        claims = claims_in_etcd(a.etcd)
        assert of(claims, "host-a") == set(held(a)) and of(claims, "host-b") == set(held(b))
        assert not set(held(a)) & set(held(b))
        assert all(len(names) == 1 for names in claims.values())
        assert 0 not in claims                                   # the header's extent is nobody's
        # the log writes only claimed extents: every extent a allocates lies in one it holds
        d = Demand(a)
        d.grow(4 * EXT)
        assert d.extents and {e.offset // EXT for e in d.extents} <= set(held(a))
        names = {k.key.split("/")[-1] for k in a.etcd.prefix("/t/pool/hosts/")}
        assert names == {"host-a", "host-b"}


def test_a_device_that_is_not_the_pools_memory_is_refused(etcd, tmp_path):
    dev = pool_file(tmp_path, 16)
    blank = pool_file(tmp_path, 16, "blank.dev")
    with hosts(config(etcd, dev, "host-a")) as (a,):
        settle([a], lambda: a.member.state == "member")
        copy = str(tmp_path / "copy.dev")
        shutil.copyfile(dev, copy)              # the pool's header and nonce, but other memory
        with hosts(config(etcd, blank, "host-b"), config(etcd, copy, "host-c")) as (b, c):
            settle([a, b, c], lambda: b.member.state == c.member.state == "refused")
            assert "holds no pool header" in b.member.why
            assert "host-a read another value where this host wrote its nonce" in c.member.why
            for _ in range(3):
                for x in (a, b, c):
                    x.beat()
            claims = claims_in_etcd(a.etcd)
            assert not of(claims, "host-b") and not of(claims, "host-c") and of(claims, "host-a")
            assert not held(b) and not held(c)


def test_two_prefixes_are_two_pools_in_one_etcd(etcd, tmp_path):
    d1, d2 = pool_file(tmp_path, 8, "one.dev"), pool_file(tmp_path, 8, "two.dev")
    with hosts(config(etcd, d1, "host-a", prefix="/tenant-1/pool/"),
               config(etcd, d2, "host-a", prefix="/tenant-2/pool/")) as (one, two):
        settle([one, two], lambda: held(one) and held(two))
        assert one.member.pool.uuid != two.member.pool.uuid
        assert of(claims_in_etcd(one.etcd, "/tenant-1/pool/"), "host-a") == set(held(one))
        assert of(claims_in_etcd(one.etcd, "/tenant-2/pool/"), "host-a") == set(held(two))
        assert not one.etcd.prefix("/t/")


def test_the_first_host_sets_the_extent_size(etcd, tmp_path):
    dev = pool_file(tmp_path, 16)
    with hosts(config(etcd, dev, "host-a", extent_bytes=4 * MiB)) as (a,):
        settle([a], lambda: a.member.state == "member")
        with hosts(config(etcd, dev, "host-b")) as (b,):       # configured with 2 MiB
            settle([a, b], lambda: b.member.state == "member" and held(b))
            assert a.member.pool.extent_bytes == b.member.pool.extent_bytes == 4 * MiB
            assert a.member.pool.extents == 8
            assert a.tier.log.geometry.segment_bytes == b.tier.log.geometry.segment_bytes == 4 * MiB


# ---- a dead host, and the share of each ------------------------------------------------------------

def test_a_killed_hosts_extents_return_after_its_lease_ttl(etcd, tmp_path):
    """A host that stops beating without leaving (its lease not revoked: as after SIGKILL) keeps its
    claims until the lease runs out; then they are free and the other host claims them."""
    dev = pool_file(tmp_path, 16)
    with hosts(config(etcd, dev, "host-a"), config(etcd, dev, "host-b")) as (a, b):
        settle([a, b], lambda: held(a) and held(b))
        gone = set(held(a))
        a.beat = lambda: None                # dead: no heartbeat, no revoke
        assert of(claims_in_etcd(b.etcd), "host-a") == gone          # nothing else cleans up
        for _ in range(ROUNDS):
            if not of(claims_in_etcd(b.etcd), "host-a"):
                break
            time.sleep(TTL / 4)
        assert not of(claims_in_etcd(b.etcd), "host-a")
        Demand(b).press([b], 12 * EXT)
        assert set(held(b)) & gone


def test_max_bytes_caps_a_growing_host(etcd, tmp_path):
    dev = pool_file(tmp_path, 32)
    with hosts(config(etcd, dev, "host-a", max_bytes=8 * EXT)) as (a,):
        settle([a], lambda: held(a))
        Demand(a).press([a], 30 * EXT)
        assert len(held(a)) == 8


def test_min_bytes_is_held_by_an_idle_host_and_kept_from_others(etcd, tmp_path):
    dev = pool_file(tmp_path, 16)
    with hosts(config(etcd, dev, "host-a", min_bytes=10 * EXT), config(etcd, dev, "host-b")) as (a, b):
        settle([a, b], lambda: len(held(a)) >= 10 and held(b))
        Demand(b).press([a, b], 30 * EXT)
        assert len(held(a)) == 10 and len(held(b)) <= 15 - 10


@pytest.mark.parametrize("weight_b, most", [(1.0, 2), (0.25, 1)])
def test_weight_sets_a_hosts_share_when_the_pool_runs_short(etcd, tmp_path, weight_b, most):
    dev = pool_file(tmp_path, 8)             # 7 extents: fewer than two idle hosts want
    with hosts(config(etcd, dev, "host-a")) as (a,):
        settle([a], lambda: len(held(a)) >= 5)
        with hosts(config(etcd, dev, "host-b", weight=weight_b)) as (b,):
            settle([a, b], lambda: b.member.state == "member" and held(b))
            for _ in range(3):
                for x in (a, b):
                    x.beat()
            assert len(held(b)) == most       # the 2 left, or floor(7 * w_b / (1 + w_b)) = 1


def test_bad_entries_in_etcd_are_refused_with_a_clear_error(etcd, tmp_path):
    """Garbage under the prefix is refused and counted, never trusted: a claim key that is not the
    pool's still keeps its extent from being claimed, and a pool definition that does not parse
    keeps a host out with one line saying why."""
    dev = pool_file(tmp_path, 16)
    client = E.Etcd(etcd.endpoints)
    client.put("/t/pool/claims/000003/intruder", b"not json")
    client.put("/t/pool/claims/000900/host-x", S.dump(S.ClaimEntry("own")))      # beyond the pool
    client.put("/t/pool/hosts/host-y", b'{"schema":"someone-else/9"}')
    client.put("/bad/pool/pool", b'{"schema":"tieringd.pool/1","uuid":"zz"}')
    with hosts(config(etcd, dev, "host-a"), config(etcd, pool_file(tmp_path, 16, "b.dev"), "host-b",
                                                   prefix="/bad/pool/")) as (a, b):
        settle([a, b], lambda: len(held(a)) >= 5 and b.member.state == "refused")
        assert 3 not in held(a)
        assert sum(a.status()["refused_entries"].values()) >= 3
        assert "the pool's definition in etcd is not usable" in b.member.why and not held(b)
    client.close()
