# SPDX-License-Identifier: Apache-2.0
"""The pool as this host sees it: the document of ``tieringctl pool`` (``tieringd.pool-map/1``) and
the numbers of the pool's Prometheus metrics, both built from what the agent read at its last
heartbeat (``PoolAgent.members``, ``claims``, ``lease_left_s``) — never a request to etcd of their
own, so a report answers at once when etcd does not, and says how old the map is.

Each host's figures are what it wrote into its entry (``P hosts/<host>``) at its last heartbeat,
this host's are its own of now; a host's extents are counted from the claims, the source of truth.
"""
from __future__ import annotations

import time
from typing import Any

DISABLED_WHY = "no pool: [pool] endpoints are not set"


def disabled() -> dict[str, Any]:
    return {"enabled": False, "why": DISABLED_WHY}


def _host_row(agent, name: str, entry, extents: int, extent_bytes: int) -> dict[str, Any]:
    left = agent.lease_left_s.get(name)
    return {"host": name, "this": name == agent.host, "state": entry.state if entry else "?",
            "why": entry.why if entry else "", "extents": extents, "claimed_bytes": extents * extent_bytes,
            "used_bytes": entry.used_bytes if entry else 0,
            "shared_bytes": entry.shared_bytes if entry else 0, "saved_bytes": entry.saved_bytes if entry else 0,
            "weight": entry.weight if entry else None, "min_bytes": entry.min_bytes if entry else None,
            "max_bytes": entry.max_bytes if entry else None,
            "lease_left_s": left if left is not None and left >= 0 else None}


def pool_map(agent) -> dict[str, Any]:
    """``tieringd.pool-map/1`` without its schema (the service adds it)."""
    st = agent.status()
    pool = agent.member.pool
    doc: dict[str, Any] = {
        "enabled": True, "host": agent.host, "prefix": agent.cfg.prefix, "device": agent.cfg.device,
        "state": st["state"], "why": st["why"], "etcd": st["etcd"], "etcd_error": st["etcd_error"],
        "etcd_lost_s": st["etcd_lost_s"], "lease_ttl_s": agent.cfg.lease_ttl_s,
        "map_age_s": None if agent.map_read_at is None else round(time.monotonic() - agent.map_read_at, 1),
        "pool": st["pool"], "refused_entries": st["refused_entries"], "hosts": []}
    if pool is None:
        return doc
    ext = pool.extent_bytes
    held = agent.claims.holders
    counts: dict[str, int] = {}
    for holders in held.values():
        for h in holders:
            counts[h] = counts.get(h, 0) + 1
    # this host's: what its log owns now, and the extents of shared blocks it references
    counts[agent.host] = len(st["extents_held"]) + len(agent.claims.of(agent.host, "shared"))
    members = dict(agent.members)
    rows = [_host_row(agent, h, members.get(h), counts.get(h, 0), ext)
            for h in sorted(set(members) | set(counts))]
    for r in rows:
        if r["this"]:
            r.update(state=st["state"], why=st["why"], used_bytes=st["used_bytes"],
                     shared_bytes=st["shared_bytes"], saved_bytes=st["saved_bytes"])
    doc.update({
        "hosts": rows,
        "extents_total": pool.extents - 1, "extents_free": len(agent.claims.free(pool.extents)),
        "extents_refused_claims": agent.claims.bad,
        "shared_bytes": sum(r["shared_bytes"] for r in rows), "saved_bytes": sum(r["saved_bytes"] for r in rows)})
    return doc


def metrics(agent) -> dict[str, Any]:
    """Plain numbers for a metrics snapshot (the loop thread builds it; the scrape thread reads it)."""
    m = pool_map(agent)
    return {
        "state": m["state"], "etcd_up": m["etcd"] == "ok",
        "extents": {"total": m.get("extents_total", 0), "free": m.get("extents_free", 0),
                    "held": len(agent.extents_held)},
        "hosts": [(r["host"], r["claimed_bytes"], r["used_bytes"], r["saved_bytes"]) for r in m["hosts"]],
        "claimed_extents_total": agent.claimed_total, "released_extents_total": agent.released_total,
        "etcd_failovers": agent.etcd.failovers, "refused_entries": dict(m["refused_entries"]),
    }
