# SPDX-License-Identifier: Apache-2.0
"""What the running daemon reports: status, tiers, processes, regions, heat, stats.

Every function reads the daemon's parts (``tieringd.daemon.Daemon``: ``registry``, ``table``,
``policy``, ``engine``, ``signal``, ``topology``, ``tiers``, ``ticks``) and returns plain JSON-able
values. They run **in the loop thread** — the control socket's requests are answered there, and the
metrics thread gets a :class:`tieringd.service.metrics.Snapshot` the loop built with these — so they may read
the block table's numpy arrays, which only the loop writes. Each is one vectorised pass over the table
(``np.bincount`` per process and tier), cheap enough to answer between ticks.

Bytes per tier and node are summed from the blocks themselves (live rows: ``FLAG_VALID``), so a
report, the metrics and a ``move_pages`` query of the same blocks agree as of the last verified
placement; blocks not yet populated (node -1) are counted as ``not_present``.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Iterable

import numpy as np

from tieringd import __version__
from tieringd.kernel import procfs
from tieringd.contracts import DAX_NODE, RegionKey, Tier
from tieringd.placement.blocktable import FLAG_PINNED, FLAG_VALID
from tieringd.mover import Counters
from tieringd.mover.vmstat import vmstat_delta, vmstat_snapshot

NOT_PRESENT = "not_present"        # the bytes-by-node key of blocks with no page yet (node -1)
DAX = "dax"                        # the bytes-by-node key of blocks on the DAX-remap tier (DAX_NODE)


def node_key(node: int) -> str:
    """A node id as reports key it: the id, ``not_present``, or ``dax`` for the DAX-remap tier."""
    return NOT_PRESENT if node < 0 else DAX if node == DAX_NODE else str(node)
TIER_LABELS = [t.label for t in Tier]


# ---- small readers ----------------------------------------------------------------------------------

def node_tiers(d) -> dict[int, Tier]:
    """node id → its tier, from the daemon's topology."""
    return {n.id: n.tier for n in d.topology.nodes}


def engine_counters(engine) -> Counters:
    """A copy of the mover's counters. The engine updates them in its worker threads under its
    condition variable (tieringd/mover/engine.py ``_count``): copy them under it."""
    with engine._cond:
        return engine.counters.copy()


def comm(pid: int) -> str | None:
    return procfs.read_comm(pid)


def _live(table) -> np.ndarray:
    """Indices of the table's live rows."""
    return np.flatnonzero(table.view("flags") & FLAG_VALID)


@dataclasses.dataclass
class _PerPid:
    """Per-process sums over live blocks: one row per pid in ``pids``."""
    pids: np.ndarray              # sorted
    tier_bytes: np.ndarray        # (pids, tiers)
    node_bytes: dict[int, dict]   # pid → {node or NOT_PRESENT: bytes}
    blocks: np.ndarray
    heat_bands: np.ndarray        # (pids, bands): blocks per heat band, hottest first
    heat_band_bytes: np.ndarray
    heat_max: np.ndarray
    heat_mean: np.ndarray         # weighted by bytes
    shared_blocks: np.ndarray     # blocks with more than one sharer
    max_sharers: np.ndarray


def heat_band_edges(policy_cfg) -> list[float]:
    """The policy's thresholds (0.8, 0.5, 0.2): bands "≥ 0.8", "≥ 0.5", "≥ 0.2", "< 0.2"."""
    return sorted((float(t) for t in policy_cfg.thresholds), reverse=True)


def per_pid(d) -> _PerPid:
    table = d.table
    rows = _live(table)
    edges = heat_band_edges(d.policy.cfg)
    nb = len(edges) + 1
    pid_of_row = table.r_pid[table.region[rows].astype(np.int64)]
    pids, inv = np.unique(pid_of_row, return_inverse=True)
    size = table.size[rows]
    tier = table.tier[rows].astype(np.int64)
    node = table.node[rows].astype(np.int64)
    heat = table.heat[rows].astype(np.float64)
    nt = len(Tier)
    placed = tier >= 0
    tier_bytes = np.bincount(inv[placed] * nt + tier[placed], weights=size[placed],
                             minlength=len(pids) * nt).reshape(len(pids), nt)
    # band 0 = hottest: heat ≥ edges[0]; digitize over the ascending edges, then flipped
    band = nb - 1 - np.digitize(heat, sorted(edges))
    bands = np.bincount(inv * nb + band, minlength=len(pids) * nb).reshape(len(pids), nb)
    band_bytes = np.bincount(inv * nb + band, weights=size, minlength=len(pids) * nb).reshape(len(pids), nb)
    blocks = np.bincount(inv, minlength=len(pids))
    total = np.bincount(inv, weights=size, minlength=len(pids))
    hmax = np.full(len(pids), 0.0)
    if len(rows):
        np.maximum.at(hmax, inv, heat)
    hmean = np.bincount(inv, weights=heat * size, minlength=len(pids)) / np.maximum(total, 1)
    sharers = table.sharers[rows].astype(np.int64)
    shared = np.bincount(inv, weights=sharers > 1, minlength=len(pids)).astype(np.int64)
    smax = np.ones(len(pids), np.int64)
    if len(rows):
        np.maximum.at(smax, inv, sharers)
    node_bytes: dict[int, dict] = {int(p): {} for p in pids}
    if len(rows):
        keys, sums = _group_sum(inv * 4096 + np.where(node >= 0, node, 4095), size)
        for k, s in zip(keys.tolist(), sums.tolist()):
            p, n = int(pids[k // 4096]), k % 4096
            node_bytes[p][node_key(-1 if n == 4095 else n)] = s
    return _PerPid(pids, tier_bytes, node_bytes, blocks, bands, band_bytes, hmax, hmean, shared, smax)


def _group_sum(keys: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    uniq, inv = np.unique(keys, return_inverse=True)
    return uniq, np.bincount(inv, weights=weights, minlength=len(uniq))


def bytes_by_tier(d) -> dict[str, float]:
    """Live block bytes per tier label (placed blocks only)."""
    table = d.table
    rows = _live(table)
    tier = table.tier[rows].astype(np.int64)
    ok = tier >= 0
    sums = np.bincount(tier[ok], weights=table.size[rows][ok], minlength=len(Tier))
    return {label: float(sums[i]) for i, label in enumerate(TIER_LABELS)}


def bytes_by_node(d) -> dict[str, float]:
    """Live block bytes per node id (strings, JSON keys), ``not_present`` for unpopulated blocks."""
    table = d.table
    rows = _live(table)
    node = table.node[rows].astype(np.int64)
    out: dict[str, float] = {}
    if len(rows):
        keys, sums = _group_sum(np.where(node >= 0, node, -1), table.size[rows])
        for k, s in zip(keys.tolist(), sums.tolist()):
            out[node_key(k)] = s
    return out


# ---- the reports ------------------------------------------------------------------------------------

def ticks(d) -> dict[str, Any]:
    t = d.ticks
    last = getattr(t, "last_tick_ns", 0) or 0
    return {"count": t.count, "overruns": t.overruns, "last_duration_ms": t.last_duration_ms,
            "p50_ms": t.p50_ms, "p99_ms": t.p99_ms,
            "last_tick_age_s": round((time.monotonic_ns() - last) / 1e9, 3) if last else None,
            "interval_ms": d.policy.cfg.interval_ms}


def tiers(d) -> dict[str, Any]:
    """The managed tiers (the policy's TierSpecs) with what the table holds on each."""
    by_tier = bytes_by_tier(d)
    by_node = bytes_by_node(d)
    out = []
    for spec in d.tiers:
        out.append({"tier": spec.tier.label, "rank": int(spec.tier), "nodes": list(spec.nodes),
                    "capacity_bytes": float(spec.capacity_bytes), "other_bytes": float(spec.other_bytes),
                    "managed_bytes": by_tier.get(spec.tier.label, 0.0),
                    "managed_bytes_by_node": {str(n): by_node.get(str(n), 0.0) for n in spec.nodes}})
    return {"tiers": out, "managed_bytes_by_tier": by_tier, "managed_bytes_by_node": by_node}


def _band_names(edges: list[float]) -> list[str]:
    return [f">={e:g}" for e in edges] + [f"<{edges[-1]:g}" if edges else "all"]


def processes(d) -> dict[str, Any]:
    """One entry per registered process (and per pid the table holds blocks of)."""
    agg = per_pid(d)
    index = {int(p): i for i, p in enumerate(agg.pids.tolist())}
    edges = heat_band_edges(d.policy.cfg)
    names = _band_names(edges)
    moves = getattr(d, "moves_by_pid", None) or {}
    procs = {p.pid: p for p in d.registry.processes()}
    out = []
    for pid in sorted(set(procs) | set(index)):
        p, i = procs.get(pid), index.get(pid)
        entry = {"pid": pid, "comm": comm(pid), "uid": p.uid if p else None,
                 "agent": p.agent if p else None, "regions": len(p.regions) if p else 0,
                 "registered_bytes": p.total_bytes if p else 0,
                 "blocks": int(agg.blocks[i]) if i is not None else 0,
                 "bytes_by_tier": {label: float(agg.tier_bytes[i, t]) if i is not None else 0.0
                                   for t, label in enumerate(TIER_LABELS)},
                 "bytes_by_node": {str(k): v for k, v in (agg.node_bytes.get(pid, {}) if i is not None
                                                          else {}).items()},
                 "heat": {"bands": names,
                          "blocks": [int(x) for x in agg.heat_bands[i]] if i is not None else [0] * len(names),
                          "bytes": [float(x) for x in agg.heat_band_bytes[i]] if i is not None
                          else [0.0] * len(names),
                          "max": round(float(agg.heat_max[i]), 4) if i is not None else None,
                          "mean": round(float(agg.heat_mean[i]), 4) if i is not None else None},
                 "shared_blocks": int(agg.shared_blocks[i]) if i is not None else 0,
                 "max_sharers": int(agg.max_sharers[i]) if i is not None else 0,
                 "moves": dict(moves.get(pid, {}))}
        out.append(entry)
    return {"processes": out, "heat_bands": names, "now_ns": time.monotonic_ns()}


def regions(d, pid: int | None = None) -> dict[str, Any]:
    table = d.table
    out = []
    for r in d.registry.regions(pid):
        entry = r.as_dict()
        entry["age_s"] = round((time.monotonic_ns() - r.registered_ns) / 1e9, 3)
        rid = table.region_id(RegionKey(r.pid, r.start))
        if rid is not None:
            sl = table.region_slice(rid)
            node = table.node[sl].astype(np.int64)
            size = table.size[sl]
            keys, sums = _group_sum(np.where(node >= 0, node, -1), size)
            sharers = table.sharers[sl]
            entry.update({"blocks": sl.stop - sl.start, "block_bytes": int(table.r_block_bytes[rid]),
                          "bytes_by_node": {node_key(k): s for k, s in zip(keys.tolist(), sums.tolist())},
                          "pinned_blocks": int(np.count_nonzero(table.flags[sl] & FLAG_PINNED)),
                          "shared_blocks": int(np.count_nonzero(sharers > 1)),
                          "max_sharers": int(sharers.max()) if len(sharers) else 0})
        else:
            entry.update({"blocks": 0, "block_bytes": None, "bytes_by_node": {}, "pinned_blocks": 0,
                          "shared_blocks": 0, "max_sharers": 0})
        _add_position(d, entry)
        out.append(entry)
    return {"regions": out, "pid": pid}


def _add_position(d, entry: dict) -> None:
    """The region's position factor: on with its frontier, or why not (``daemon/position.py``);
    None from a daemon that does not track it."""
    positions = getattr(d, "positions", None)
    entry["position"] = positions.describe((entry["pid"], entry["start"])) if positions is not None else None


def heat(d, pid: int, *, offset: int = 0, limit: int = 65536) -> dict[str, Any]:
    """Per block of ``pid``'s regions, by address: heat (as of the last tick), node, tier, size, its
    sharers, the time since its last sampled access. At most ``limit`` blocks from ``offset`` (the caller bounds it)."""
    table = d.table
    n = table.nregions
    rids = [int(r) for r in np.flatnonzero(table.r_live[:n] & (table.r_pid[:n] == pid))]
    rids.sort(key=lambda r: int(table.r_start[r]))
    rows = np.concatenate([np.arange(table.r_first[r], table.r_first[r] + table.r_count[r])
                           for r in rids]) if rids else np.zeros(0, np.int64)
    total = len(rows)
    rows = rows[offset:offset + limit]
    now_ms = table.now_ms(time.monotonic_ns())
    _, addr = table.block_address(rows) if len(rows) else (None, np.zeros(0, np.uint64))
    age = np.maximum(now_ms - table.last_ms[rows].astype(np.int64), 0)
    never = table.last_ms[rows] == 0
    tier = table.tier[rows].astype(np.int64)
    return {"pid": pid, "blocks_total": total, "offset": offset, "count": len(rows),
            "truncated": offset + len(rows) < total,
            "regions": [{"start": int(table.r_start[r]), "length": int(table.r_length[r]),
                         "block_bytes": int(table.r_block_bytes[r]), "blocks": int(table.r_count[r])}
                        for r in rids],
            "blocks": {"address": [int(a) for a in addr.tolist()],
                       "size_bytes": [int(s) for s in table.size[rows].tolist()],
                       "node": [int(x) for x in table.node[rows].tolist()],
                       "tier": [TIER_LABELS[t] if t >= 0 else None for t in tier.tolist()],
                       "heat": [round(float(h), 4) for h in table.heat[rows].tolist()],
                       "sharers": [int(x) for x in table.sharers[rows].tolist()],
                       "last_access_ms_ago": [None if nv else int(a) for a, nv in
                                              zip(age.tolist(), never.tolist())]},
            "now_ns": time.monotonic_ns()}


# ---- stats ------------------------------------------------------------------------------------------

def migrated_pages(c) -> int:
    """Pages our move_pages calls migrated: to the target, to a fallback, or elsewhere."""
    return c.moved_pages + c.fallback_pages + c.landed_elsewhere_pages


def stats(d, vmstat_at_start: dict[str, int] | None) -> dict[str, Any]:
    """Per node: bytes moved in and out, asked for but placed on a fallback or elsewhere, failed by
    reason; then the kernel's own counters since the daemon started, side by side."""
    counters = engine_counters(d.engine)
    ps = counters_page_size()
    tiers_of = node_tiers(d)
    nodes = sorted({n for n, _ in tiers_of.items()} | {t for _, t in counters.pairs} |
                   {s for s, _ in counters.pairs if s >= 0})
    by_node = bytes_by_node(d)
    rows = []
    for node in nodes:
        into = [c for (s, t), c in counters.pairs.items() if t == node]
        out_of = [c for (s, t), c in counters.pairs.items() if s == node]
        failed: dict[str, int] = {}
        for c in into:
            for reason, pages in c.failed_pages.items():
                failed[str(reason)] = failed.get(str(reason), 0) + pages * ps
        tier = tiers_of.get(node)
        rows.append({"node": node, "tier": tier.label if tier is not None else None,
                     "managed_bytes": by_node.get(str(node), 0.0),
                     "requested_in_bytes": sum(c.requested_pages for c in into) * ps,
                     "moved_in_bytes": sum(c.moved_pages for c in into) * ps,
                     "moved_out_bytes": sum(migrated_pages(c) for c in out_of) * ps,
                     "already_bytes": sum(c.already_pages for c in into) * ps,
                     "fallback_bytes": sum(c.fallback_pages for c in into) * ps,
                     "landed_elsewhere_bytes": sum(c.landed_elsewhere_pages for c in into) * ps,
                     "failed_bytes": dict(sorted(failed.items()))})
    total = counters.total()
    now = vmstat_snapshot()
    kernel = {k: {"at_start": (vmstat_at_start or {}).get(k), "now": v,
                  "delta": vmstat_delta(vmstat_at_start, {k: v})[k] if vmstat_at_start is not None else None}
              for k, v in now.items()}
    return {"nodes": rows, "managed_bytes_by_tier": bytes_by_tier(d),
            "mover": {"migrated_pages": migrated_pages(total), "moved_pages": total.moved_pages,
                      "fallback_pages": total.fallback_pages,
                      "landed_elsewhere_pages": total.landed_elsewhere_pages,
                      "failed_pages": {str(k): v for k, v in sorted(total.failed_pages.items())},
                      "thp_pages_moved": counters.thp_pages_moved, "move_pages_calls": counters.move_pages_calls,
                      "dropped_jobs": counters.dropped_jobs, "pending_jobs": d.engine.pending(),
                      "page_size": ps},
            "vmstat": kernel,
            "verified": _daemon_moves(d),
            "note": "pgmigrate_success counts every migration on the machine (ours, NUMA balancing, "
                    "compaction); pgpromote_*/pgdemote_* only the kernel's own tiering, never move_pages"}


def _daemon_moves(d) -> dict | None:
    """The loop's own tally (``Daemon.moves``: blocks whose verified node changed tier, also the moves
    made through the shim before 6.5, which the engine's counters never see)."""
    moves = getattr(d, "moves", None)
    return moves.to_dict() if moves is not None and hasattr(moves, "to_dict") else None


def counters_page_size() -> int:
    from tieringd.kernel.procfs import PAGE_SIZE
    return PAGE_SIZE


def pool(d) -> dict[str, Any]:
    """The pool as this host sees it (``tieringctl pool``; tieringd/pool/poolmap.py)."""
    from tieringd.pool import poolmap
    agent = getattr(d, "pool", None)
    return poolmap.pool_map(agent) if agent is not None else poolmap.disabled()


# ---- status -----------------------------------------------------------------------------------------

def status(d, service: dict[str, Any] | None = None) -> dict[str, Any]:
    """The one-screen summary (``tieringctl status``): the loop's own document
    (``Daemon.status()``, also written to ``RUN_DIR/status.json``) with fields added — never one of
    its fields changed in meaning — plus what the service layer adds (``service``: control socket,
    metrics, lifecycle, systemd), already JSON-able."""
    own = getattr(d, "status", None)
    doc = dict(own()) if callable(own) else {}
    procs = d.registry.processes()
    started = getattr(d, "started_ns", None)
    t = tiers(d)
    by_tier = {x["tier"]: x for x in t["tiers"]}
    doc["tiers"] = [{**x, **by_tier.get(x["tier"], {})} for x in doc.get("tiers", [])] or t["tiers"]
    doc["ticks"] = {**doc.get("ticks", {}), **ticks(d)}
    if "signal" not in doc or doc["signal"] is None:
        try:
            doc["signal"] = d.signal.status()
        except Exception as e:      # a report must not fail because one part cannot describe itself
            doc["signal"] = {"error": str(e)}
    if "signal_text" not in doc:
        try:
            doc["signal_text"] = d.signal.describe()
        except Exception:
            doc["signal_text"] = None
    if "regions" not in doc:
        doc["regions"] = [r.as_dict() for r in d.registry.regions()]
    doc["regions"] = [dict(r) for r in doc["regions"]]
    for r in doc["regions"]:
        _add_position(d, r)
    doc.update({
        "schema": "tieringd.status/1", "pid": os.getpid(), "version": __version__,
        "uptime_s": round((time.monotonic_ns() - started) / 1e9, 3) if started else None,
        "processes": len(procs), "region_count": sum(len(p.regions) for p in procs),
        "registered_bytes": sum(p.total_bytes for p in procs),
        "mover": {"pending_jobs": d.engine.pending(),
                  "migrated_pages": migrated_pages(engine_counters(d.engine).total())},
        "managed_bytes_by_tier": t["managed_bytes_by_tier"], "managed_bytes_by_node": t["managed_bytes_by_node"],
        "pool": d.pool.status() if getattr(d, "pool", None) is not None else None,
        **(service or {})})
    return doc


def one_line(d) -> str:
    """systemd's STATUS= line: the signal, the regions, the last tick."""
    procs = d.registry.processes()
    t = d.ticks
    mech = "?"
    last, p99 = t.last_duration_ms or 0.0, t.p99_ms or 0.0
    try:
        mech = d.signal.choice.mechanism.value
    except Exception:
        pass
    return (f"signal {mech}; {sum(len(p.regions) for p in procs)} regions of {len(procs)} processes; "
            f"tick {t.count}: {last:.1f} ms (p99 {p99:.1f} ms, {t.overruns} overruns)")


def pids_held(d) -> Iterable[int]:
    """Every pid the daemon holds state for (what the lifecycle watcher watches): connected shims
    and blocks in the table."""
    pids = {p.pid for p in d.registry.processes()}
    table = d.table
    n = table.nregions
    pids.update(int(p) for p in np.unique(table.r_pid[:n][table.r_live[:n]]).tolist())
    return pids
