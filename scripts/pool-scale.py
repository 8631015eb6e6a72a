#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The pool's etcd at a scale beyond the tests: many hosts, a multi-TB pool, a shared prefix every
host references. A real etcd cluster (Debian's etcd-server, three members on loopback) is filled with
the keys that pool would hold — one claim per extent, one entry per host, one index key per host
per shared block, each value as tieringd writes it (tieringd/pool/schema.py) — and the reads one
heartbeat of one host makes are timed and sized.

    python scripts/pool-scale.py [--hosts 16] [--pool-bytes 2T] [--extent-bytes 64M] \\
        [--shared-bytes 16G] [--block-bytes 2M] [--lease-ttl-s 10] [--json]

What one heartbeat reads (tieringd/pool/agent.py): the hosts' entries, the join entries, the whole
claims range once, one lease TTL per host; it writes its entry and keeps its lease alive. The index is read per digest, when a block is stored, never whole.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts" / "lab" / "pool")]

from etcdcluster import EtcdCluster  # noqa: E402
from tieringd.pool import etcd as E  # noqa: E402
from tieringd.pool import schema as S  # noqa: E402
from tieringd.units import parse_size  # noqa: E402

OPS_PER_TXN = 128          # etcd's --max-txn-ops default


def fill(client: E.Etcd, items: list[tuple[str, bytes]]) -> None:
    for i in range(0, len(items), OPS_PER_TXN):
        client.txn([], [E.op_put(k, v) for k, v in items[i:i + OPS_PER_TXN]])


def timed_range(client: E.Etcd, prefix: str, rounds: int = 5) -> tuple[int, int, float]:
    """(keys, bytes of keys and values, median seconds) of one range read of ``prefix``."""
    times, kvs = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        kvs = client.prefix(prefix)
        times.append(time.perf_counter() - t0)
    return len(kvs), sum(len(kv.key) + len(kv.value) for kv in kvs), statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=16)
    ap.add_argument("--pool-bytes", default="2T")
    ap.add_argument("--extent-bytes", default="64M")
    ap.add_argument("--shared-bytes", default="16G", help="the prefix KV every host references")
    ap.add_argument("--block-bytes", default="2M")
    ap.add_argument("--lease-ttl-s", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    pool, ext = parse_size(a.pool_bytes), parse_size(a.extent_bytes)
    shared, block = parse_size(a.shared_bytes), parse_size(a.block_bytes)
    extents, blocks = pool // ext, shared // block
    hosts = [f"infer-{i:02d}" for i in range(a.hosts)]
    keys = S.Keys("/tieringd/pool-a/")
    with tempfile.TemporaryDirectory(prefix="pool-scale-") as tmp, EtcdCluster(Path(tmp)) as etcd:
        client = E.Etcd(etcd.endpoints, timeout_s=30)
        t0 = time.monotonic()
        fill(client, [(keys.host(h), S.dump(S.HostEntry(host=h, lease=1, weight=1.0, min_bytes=0, max_bytes=0,
                                                      claimed_bytes=extents // a.hosts * ext, state="member")))
                      for h in hosts])
        fill(client, [(keys.claims(i, hosts[i % a.hosts]), S.dump(S.ClaimEntry("own"))) for i in range(1, extents)])
        digests = [f"{i:064x}" for i in range(blocks)]
        fill(client, [(keys.index(d, h), S.dump(S.IndexEntry(extent=1 + i * block // ext, offset=ext + i * block,
                                                             length=block)))
                      for i, d in enumerate(digests) for h in hosts])
        fill_s = time.monotonic() - t0
        n_claims, claims_b, claims_s = timed_range(client, keys.claims())
        n_hosts, hosts_b, hosts_s = timed_range(client, keys.host())
        _, one_b, one_s = timed_range(client, keys.index(digests[len(digests) // 2]))
        n_index = client.count(keys.index())
        status = client.post("maintenance/status", {})
        client.close()
    beat_s = a.lease_ttl_s / 3
    per_beat_b = claims_b + hosts_b + 200 * (a.hosts + 3)     # the TTL asks, keepalive, put: small
    per_beat_s = claims_s + hosts_s
    doc = {"schema": "tieringd.pool-scale/1", "hosts": a.hosts, "pool_bytes": pool, "extent_bytes": ext,
           "extents": extents, "shared_bytes": shared, "block_bytes": block, "shared_blocks": blocks,
           "keys": {"claims": n_claims, "hosts": n_hosts, "index": n_index},
           "db_size_bytes": int(status.get("dbSize", 0)), "fill_s": round(fill_s, 1),
           "claims_range_bytes": claims_b, "claims_range_s": round(claims_s, 4),
           "hosts_range_bytes": hosts_b, "index_digest_read_bytes": one_b, "index_digest_read_s": round(one_s, 4),
           "heartbeat_s": round(beat_s, 2), "per_host_beat_bytes": per_beat_b,
           "per_host_beat_read_s": round(per_beat_s, 4),
           "cluster_read_bytes_per_s": round(per_beat_b * a.hosts / beat_s)}
    if a.json:
        print(json.dumps(doc, indent=2))
        return 0
    mib = 1 << 20
    print(f"{a.hosts} hosts, pool {pool / (1 << 40):g} TiB in {extents} extents of {ext // mib} MiB; "
          f"shared prefix {shared / (1 << 30):g} GiB in {blocks} blocks of {block // mib} MiB, referenced by every host")
    print(f"keys: {n_claims} claims, {n_hosts} hosts, {n_index} index; etcd db {doc['db_size_bytes'] / mib:.0f} MiB "
          f"(filled in {fill_s:.0f} s)")
    print(f"one claims read: {claims_b / mib:.1f} MiB in {claims_s * 1000:.0f} ms; hosts read {hosts_b} B; "
          f"one digest's references: {one_b} B in {one_s * 1000:.1f} ms")
    print(f"one heartbeat of one host (every {beat_s:.1f} s): {per_beat_b / mib:.1f} MiB read, "
          f"{per_beat_s * 1000:.0f} ms of reads; the whole pool: {doc['cluster_read_bytes_per_s'] / mib:.1f} MiB/s "
          f"out of etcd")
    return 0


if __name__ == "__main__":
    sys.exit(main())
