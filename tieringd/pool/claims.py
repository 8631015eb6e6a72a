# SPDX-License-Identifier: Apache-2.0
"""Which extents of the pool each host holds, and how many this host should hold.

An extent is held by the hosts with a key under ``P claims/<extent>/``, each under its holder's lease:
``own`` (the host writes there: its DAX log's segments) or ``shared`` (it maps immutable published
blocks there, tieringd/pool/index.py). A claim is one transaction: *no key under that extent's
prefix* → put this host's; two hosts asking at once, one gets it. Releasing deletes the host's key;
a dead host's keys go with its lease.

How many: :func:`target_extents` is the decision, a pure function of what the host uses, its
``[pool]`` share and what the others hold (docs/pool.md, "Capacity").
"""
from __future__ import annotations

import dataclasses
import logging
import math

from tieringd.pool import etcd as E
from tieringd.pool import schema as S

log = logging.getLogger("tieringd.pool")


@dataclasses.dataclass
class ClaimMap:
    """The pool's claims as read: extent → {host: kind}; ``bad``: keys refused."""
    holders: dict[int, dict[str, str]] = dataclasses.field(default_factory=dict)
    bad: int = 0

    def of(self, host: str, kind: str | None = None) -> list[int]:
        return sorted(i for i, h in self.holders.items() if host in h and (kind is None or h[host] == kind))

    def changed(self, host: str, claimed: list[int], released: list[int]) -> "ClaimMap":
        """This map after ``host`` claimed and released those extents itself: a new map (readers in
        other threads keep the one they hold), without reading the whole range from etcd again — at a
        multi-TB pool that range is megabytes (docs/pool.md, "Beyond two hosts")."""
        holders = {i: dict(h) for i, h in self.holders.items()}
        for i in claimed:
            holders.setdefault(i, {})[host] = "own"
        for i in released:
            holders.get(i, {}).pop(host, None)
        return ClaimMap({i: h for i, h in holders.items() if h}, self.bad)

    def free(self, extents: int) -> list[int]:
        """Extents nobody holds (extent 0 is the header's)."""
        return [i for i in range(1, extents) if not self.holders.get(i)]


@dataclasses.dataclass(frozen=True)
class Share:
    """What the decision needs to know of one other live host."""
    weight: float
    min_bytes: int
    claimed_bytes: int


def target_extents(*, used_bytes: int, headroom_bytes: int, extent_bytes: int, working_extents: int,
                   capacity_of, max_bytes: int, min_bytes: int) -> int:
    """How many own extents this host wants: the fewest whose capacity (``capacity_of(n)``, the DAX
    log's for n segments) holds what it uses plus ``headroom_bytes`` (room to go on demoting while
    the next claim comes), never fewer than ``working_extents`` (the log's head and reserve) or
    ``min_bytes``' worth, never more than ``max_bytes``' worth (0: no cap)."""
    want = max(working_extents, math.ceil(min_bytes / extent_bytes))
    need = used_bytes + headroom_bytes
    while capacity_of(want) < need:
        want += 1
    if max_bytes:
        want = min(want, max(max_bytes // extent_bytes, working_extents))
    return want


def grantable(*, want_more: int, free_extents: int, extents: int, extent_bytes: int, weight: float,
              claimed: int, others: list[Share]) -> int:
    """How many of ``want_more`` extents this host may claim now: not those that keep another live
    host below its ``min_bytes``, and when the pool runs short (fewer free than this host wants) not
    beyond its weighted share of the pool: what is left stays free for the hosts below theirs."""
    reserved = sum(max(0, math.ceil(o.min_bytes / extent_bytes) - o.claimed_bytes // extent_bytes)
                   for o in others)
    room = max(free_extents - reserved, 0)
    if room < want_more and others:             # short: each host to its share
        total_w = weight + sum(o.weight for o in others)
        fair = math.floor((extents - 1) * weight / total_w)
        room = min(room, max(fair - claimed, 0))
    return max(min(want_more, room), 0)


class Claims:
    """This host's claims in etcd."""

    def __init__(self, etcd: E.Etcd, keys: S.Keys, host: str, refused=None):
        self.etcd, self.keys, self.host = etcd, keys, host
        self.refused = refused or (lambda key, why: log.warning("etcd %s refused: %s", key, why))

    def read(self, extents: int) -> ClaimMap:
        out = ClaimMap()
        for kv in self.etcd.prefix(self.keys.claims()):
            try:
                ext, host = self.keys.split(kv.key, "claims")
                entry = S.parse("claims", kv.value)
                idx = int(ext)
                if not 1 <= idx < extents:
                    raise S.BadEntry(f"extent {idx} is not one of the pool's 1..{extents - 1}")
            except S.BadEntry as e:
                self.refused(kv.key, str(e))
                out.bad += 1
                continue
            out.holders.setdefault(idx, {})[host] = entry.kind
        return out

    def claim(self, extent: int, lease: int, kind: str = "own") -> bool:
        """The extent for this host if nobody holds it."""
        key = self.keys.claims(extent, self.host)
        if self.etcd.txn([E.cmp_none_under(self.keys.claims(extent))],
                         [E.op_put(key, S.dump(S.ClaimEntry(kind)), lease)]):
            return True
        # a retried request whose first try went through finds its own key: it is ours
        kv = self.etcd.get(key)
        return kv is not None and kv.lease == lease

    def hold(self, extent: int, lease: int) -> bool:
        """Keep (or take again, under a new lease) an extent this host writes: its own key may be
        there already (then only the lease changes); otherwise it is claimed afresh, and lost when
        another host claimed it meanwhile."""
        key = self.keys.claims(extent, self.host)
        if self.etcd.txn([E.cmp_present(key)], [E.op_put(key, S.dump(S.ClaimEntry("own")), lease)]):
            return True
        return self.claim(extent, lease)

    def release(self, extent: int) -> None:
        self.etcd.delete(self.keys.claims(extent, self.host))
