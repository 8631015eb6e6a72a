# SPDX-License-Identifier: Apache-2.0
"""Tier capacities from the real nodes, for the policy's watermarks.

Each managed tier's ``capacity_bytes`` is its nodes' MemTotal; ``other_bytes`` is what the nodes hold
that the block table does not — the kernel, page cache, other processes, the daemon itself — read
from node meminfo as ``MemTotal − MemFree`` less the table's own bytes on those nodes. Page cache is
counted as used on purpose: a move finds room only in free pages without reclaim, and reclaim on the
target node is what made moves crawl in the lab (direct reclaim in the mover's allocations — 302
allocation stalls in one 40 s run, the guest's CPU 0 busy for half a minute — when the table was
filled up to what ``MemFree + file pages`` suggested). The policy fills a tier up to a watermark of
the capacity minus the others' share, so the gap between the watermarks stays free: that is where
the shim's placement of new allocations (``fast``: the allocating CPU's node) lands without the
kernel having to reclaim, and it is the same room promotions need. Refreshed every ``REFRESH_S`` by
the loop.
"""
from __future__ import annotations

import numpy as np

from tieringd.contracts import Tier
from tieringd.policy import TierSpec
from tieringd.topology import Topology, _node_meminfo

REFRESH_S = 2.0


def node_used_bytes(node: int) -> tuple[int, int]:
    """(MemTotal, MemTotal − MemFree) of one node, from its meminfo."""
    m = _node_meminfo(node)
    total = m.get("MemTotal", 0)
    return total, max(total - m.get("MemFree", 0), 0)


def tier_specs(topo: Topology, table_node_bytes: np.ndarray, read=node_used_bytes) -> list[TierSpec]:
    """One :class:`TierSpec` per tier that has memory (GPU HBM is the engine's: never managed)."""
    specs = []
    for tier in Tier:
        if tier == Tier.GPU_HBM:
            continue
        nodes = tuple(topo.nodes_in_tier(tier))
        if not nodes:
            continue
        capacity = other = 0.0
        for n in nodes:
            total, used = read(n)
            capacity += total
            ours = float(table_node_bytes[n]) if n < len(table_node_bytes) else 0.0
            other += max(used - ours, 0.0)
        specs.append(TierSpec(tier, nodes, capacity, other))
    return specs


def tier_lookup(topo: Topology, size: int = 1024) -> np.ndarray:
    """node id → Tier value (int8) for numpy lookups; nodes the topology does not know map to the
    slowest tier present (a node hot-plugged since discovery is most likely slow memory)."""
    present = [n.tier for n in topo.nodes if n.has_memory and n.tier != Tier.GPU_HBM]
    slowest = max(present, default=Tier.DRAM)
    out = np.full(size, int(slowest), np.int8)
    for n in topo.nodes:
        if n.id < size:
            out[n.id] = int(n.tier)
    return out
