# SPDX-License-Identifier: Apache-2.0
"""What an access costs on each tier: the reference cost table, or measured figures.

Measured topology, a JSON file (``--topology``): either a map from tier label to figures,
``{"dram": {"bandwidth_gb_s": 95, "latency_ns": 110}, "cxl-dram": {...}}``, or the output of
``tieringctl numa --json`` (schema tieringd.numa/1: each node's ``tier`` and its HMAT ``access0``
``read_bandwidth_mb_s``/``read_latency_ns``); nodes of one tier are averaged. Tiers the file leaves
out, or whose nodes publish no HMAT figures, keep the reference figures.
"""
from __future__ import annotations

import json
from typing import Mapping

from tieringd.contracts import Tier
from tieringd.placement.prefetch import REFERENCE_TIER_COSTS, TierCost


class CostError(ValueError):
    pass


def reference_costs() -> dict[Tier, TierCost]:
    return dict(REFERENCE_TIER_COSTS)


def _cost_from(d: Mapping, where: str) -> TierCost:
    try:
        if "bandwidth_gb_s" in d:
            bw = float(d["bandwidth_gb_s"]) * 1e9
        elif "read_bandwidth_mb_s" in d:
            bw = float(d["read_bandwidth_mb_s"]) * 1e6
        else:
            raise KeyError("bandwidth_gb_s")
        lat_ns = d.get("latency_ns", d.get("read_latency_ns"))
        if lat_ns is None:
            raise KeyError("latency_ns")
        lat = float(lat_ns) * 1e-9
    except (KeyError, TypeError, ValueError) as e:
        raise CostError(f"{where}: missing or bad figure {e}") from None
    if bw <= 0 or lat < 0:
        raise CostError(f"{where}: bandwidth must be > 0 and latency ≥ 0")
    return TierCost(bw, lat)


def load_costs(path: str) -> dict[Tier, TierCost]:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise CostError(f"cannot read topology {path}: {e}") from None
    costs = reference_costs()
    if not isinstance(doc, dict):
        raise CostError(f"{path}: expected a JSON object")
    if isinstance(doc.get("nodes"), list):
        per: dict[Tier, list[TierCost]] = {}
        for i, node in enumerate(doc["nodes"]):
            if not isinstance(node, dict) or "tier" not in node:
                continue
            hmat = node.get("hmat") if isinstance(node.get("hmat"), dict) else {}
            for access in ("access0", "access1"):
                figs = hmat.get(access) if isinstance(hmat.get(access), dict) else {}
                if figs.get("read_bandwidth_mb_s") and figs.get("read_latency_ns") is not None:
                    node = {**figs, "tier": node["tier"]}
                    break
            if not any(node.get(k) for k in ("bandwidth_gb_s", "read_bandwidth_mb_s")):
                continue
            try:
                tier = Tier.parse(str(node["tier"]))
            except ValueError as e:
                raise CostError(f"{path}: nodes[{i}]: {e}") from None
            per.setdefault(tier, []).append(_cost_from(node, f"{path}: nodes[{i}]"))
        for tier, cs in per.items():
            costs[tier] = TierCost(sum(c.bandwidth_bytes_s for c in cs) / len(cs),
                                   sum(c.latency_s for c in cs) / len(cs))
        return costs
    for label, figures in doc.items():
        try:
            tier = Tier.parse(label)
        except ValueError as e:
            raise CostError(f"{path}: {e}") from None
        if not isinstance(figures, dict):
            raise CostError(f"{path}: {label}: expected an object of figures")
        costs[tier] = _cost_from(figures, f"{path}: {label}")
    return costs
