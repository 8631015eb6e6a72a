# SPDX-License-Identifier: Apache-2.0
"""Identical KV stored once across hosts: the pool's shared index (tieringd/pool/index.py) against a
real etcd cluster (tests/etcd_support.py), two or three pool agents on one file that stands for the
device (tests/host/pool_support.py). The block a host publishes is written and flushed through the
pool device, as the shim's copy would be; a host that references it compares the bytes first."""
from __future__ import annotations

import hashlib
import os

import pytest

from pool_support import EXT, claims_in_etcd, config, held, hosts, of, pool_file, settle
from tieringd.pool import etcd as E
from tieringd.pool import poolmap
from tieringd.pool import schema as S

pytestmark = pytest.mark.etcd

BLOCK = 256 << 10             # a cold KV block


def members(*agents) -> bool:
    return all(a.member.state == "member" and held(a) for a in agents)


def publish(agent, data: bytes, slot: int = 0) -> tuple[str, S.IndexEntry]:
    """What a host does with a cold block no host published yet: into an extent it claims shared,
    flushed, then into the index."""
    extent = agent.claim_shared_extent()
    assert extent is not None
    entry = S.IndexEntry(extent=extent, offset=extent * EXT + slot * BLOCK, length=len(data))
    agent.device.write_block(entry.offset, data)
    digest = hashlib.sha256(data).hexdigest()
    assert agent.index.publish(digest, entry, agent.member.lease)
    return digest, entry


def index_keys(client: E.Etcd, digest: str) -> set[str]:
    return {kv.key.rsplit("/", 1)[1] for kv in client.prefix(f"/t/pool/index/{digest}/")}


def test_a_block_two_hosts_hold_alike_is_stored_once_and_counted_once_per_holder(etcd, tmp_path):
    dev = pool_file(tmp_path, 16)
    prefix = os.urandom(BLOCK)
    with hosts(config(etcd, dev, "host-a"), config(etcd, dev, "host-b")) as (a, b):
        settle([a, b], lambda: members(a, b))
        digest, entry = publish(a, prefix)
        got = b.index.reference(digest, prefix, b.member.lease)
        assert got == entry                                   # b maps a's copy: no second one
        assert index_keys(a.etcd, digest) == {"host-a", "host-b"}
        assert of(claims_in_etcd(a.etcd), "host-b") >= {entry.extent}
        assert entry.extent not in held(a) and entry.extent not in held(b)    # in nobody's log
        assert b.device.read(entry.offset, entry.length) == prefix
        for x in (a, b):
            x.beat()
        assert b.status()["saved_bytes"] == BLOCK and a.status()["saved_bytes"] == 0
        assert b.status()["shared_bytes"] == a.status()["shared_bytes"] == BLOCK
        # a second publication of the same bytes is refused: the index holds one copy per digest
        assert not b.index.publish(digest, entry, b.member.lease)


def test_a_reference_is_taken_only_after_the_bytes_compare_equal(etcd, tmp_path):
    """Entries that name the digest but not its bytes, or point into another host's writable log,
    are refused and counted: a host never merges on a hash alone."""
    dev = pool_file(tmp_path, 16)
    block, other = os.urandom(BLOCK), os.urandom(BLOCK)
    digest = hashlib.sha256(block).hexdigest()
    client = E.Etcd(etcd.endpoints)
    with hosts(config(etcd, dev, "host-a"), config(etcd, dev, "host-b")) as (a, b):
        settle([a, b], lambda: members(a, b))
        _, decoy = publish(a, other)                          # a shared extent with other bytes
        forged = S.IndexEntry(extent=decoy.extent, offset=decoy.offset, length=BLOCK)
        client.put(f"/t/pool/index/{digest}/host-a", S.dump(forged))    # a's name, other bytes
        assert b.index.reference(digest, block, b.member.lease) is None
        assert b.index.mismatches == 1
        # the right bytes, but in a's log (an own extent, writable by a): refused though equal today
        own = held(a)[-1]
        a.device.write_block(own * EXT, block)
        client.put(f"/t/pool/index/{digest}/host-a",
                   S.dump(S.IndexEntry(extent=own, offset=own * EXT, length=BLOCK)))
        assert b.index.reference(digest, block, b.member.lease) is None
        client.put(f"/t/pool/index/{digest}/host-a", b'{"schema":"tieringd.pool/1","extent":0}')
        assert b.index.reference(digest, block, b.member.lease) is None
        assert index_keys(client, digest) == {"host-a"} and not b.index.refs
        assert b.status()["refused_entries"].get("index", 0) >= 2
    client.close()


def test_a_dead_publishers_block_stays_while_another_host_references_it(etcd, tmp_path):
    """The publisher's keys go with its lease; the block's extent stays claimed by the host that
    references it, so nobody's log takes it, and comes free with the last reference."""
    dev = pool_file(tmp_path, 16)
    prefix = os.urandom(BLOCK)
    with hosts(config(etcd, dev, "host-a"), config(etcd, dev, "host-b")) as (a, b):
        settle([a, b], lambda: members(a, b))
        digest, entry = publish(a, prefix)
        assert b.index.reference(digest, prefix, b.member.lease) == entry
        a.stop()                                              # its lease revoked: as when it expires
        assert index_keys(b.etcd, digest) == {"host-b"}
        assert claims_in_etcd(b.etcd)[entry.extent] == ["host-b"]
        with hosts(config(etcd, dev, "host-c")) as (c,):
            settle([b, c], lambda: c.member.state == "member" and held(c))
            for _ in range(3):
                for x in (b, c):
                    x.beat()
            assert entry.extent not in held(c) and entry.extent not in held(b)
            assert b.device.read(entry.offset, entry.length) == prefix
            b.index.release(digest)
            assert not index_keys(b.etcd, digest)
            assert entry.extent not in claims_in_etcd(b.etcd)   # free again: the last reference went


def test_two_hosts_publishing_the_same_bytes_at_once_keep_one_copy(etcd, tmp_path):
    dev = pool_file(tmp_path, 16)
    block = os.urandom(BLOCK)
    digest = hashlib.sha256(block).hexdigest()
    with hosts(config(etcd, dev, "host-a"), config(etcd, dev, "host-b")) as (a, b):
        settle([a, b], lambda: members(a, b))
        entries = {}
        for x in (a, b):                                      # both wrote their copy before either published
            ext = x.claim_shared_extent()
            entries[x.host] = S.IndexEntry(extent=ext, offset=ext * EXT, length=BLOCK)
            x.device.write_block(entries[x.host].offset, block)
        won = [x.index.publish(digest, entries[x.host], x.member.lease) for x in (a, b)]
        assert won == [True, False]
        assert b.index.reference(digest, block, b.member.lease) == entries["host-a"]
        assert index_keys(a.etcd, digest) == {"host-a", "host-b"}


def test_two_hosts_with_a_shared_prefix_keep_it_once_and_a_write_on_one_is_not_seen_on_the_other(
        etcd, tmp_path, record_property):
    """Each host keeps its cold KV in the pool through ``store_block``: 32 blocks of a prefix both
    hold alike, 16 of its own. The pool holds the prefix once; the second host's copy of it is all
    saved; every byte reads back as each host stored it; a write coming to a shared block on one host
    gives it its own bytes and leaves the pool's copy, and the other host's view, as they were."""
    dev = pool_file(tmp_path, 32)
    prefix = [os.urandom(BLOCK) for _ in range(32)]
    own = {name: [os.urandom(BLOCK) for _ in range(16)] for name in ("host-a", "host-b")}
    with hosts(config(etcd, dev, "host-a"), config(etcd, dev, "host-b")) as (a, b):
        settle([a, b], lambda: members(a, b))
        stored = {}
        for x in (a, b):
            blocks = prefix + own[x.host]
            stored[x.host] = [(data, x.store_block(data)) for data in blocks]
            assert all(ref is not None for _, ref in stored[x.host])
        copies = {(r.entry.offset, r.entry.length) for x in (a, b) for _, r in stored[x.host]}
        pool_bytes = sum(n for _, n in copies)
        assert pool_bytes == (32 + 16 + 16) * BLOCK                  # the prefix once
        saved = b.status()["saved_bytes"]
        assert saved / (32 * BLOCK) >= 0.9 and a.status()["saved_bytes"] == 0
        record_property("prefix_second_copy_saved_fraction", round(saved / (32 * BLOCK), 3))
        b.beat(), a.beat()                                           # a's map has b's entry of now
        rows = {r["host"]: r for r in poolmap.pool_map(a)["hosts"]}  # what tieringctl pool shows on a
        assert rows["host-b"]["saved_bytes"] == saved and rows["host-a"]["shared_bytes"] == 48 * BLOCK
        assert rows["host-a"]["extents"] == len(held(a)) + len(of(claims_in_etcd(a.etcd), "host-a") - set(held(a)))
        for x in (a, b):                                              # every byte, on each host's device
            for data, ref in stored[x.host]:
                assert x.device.read(ref.entry.offset, ref.entry.length) == data
        digest = hashlib.sha256(prefix[0]).hexdigest()
        mine = bytearray(a.unshare_block(digest))                     # a write is coming on host a
        mine[:8] = b"written!"
        assert digest not in a.index.refs and index_keys(a.etcd, digest) == {"host-a", "host-b"} - {"host-a"}
        entry = b.index.refs[digest].entry
        assert b.device.read(entry.offset, entry.length) == prefix[0] != bytes(mine)
