# SPDX-License-Identifier: Apache-2.0
"""Tier capacities from the real nodes, for the policy's watermarks.

Each managed tier's ``capacity_bytes`` is what its nodes can give to memory the kernel does not keep
for itself: MemTotal less each zone's **kernel reserve** — the free pages below its promotion
watermark (``promo``; ``high`` where zoneinfo lists none) plus the lowmem protection other zones
keep against user allocations (``protection`` at ZONE_MOVABLE), from ``/proc/zoneinfo``. Above that
reserve an allocation neither wakes kswapd nor reclaims directly; the policy's watermarks are
fractions of what is left, so a fill to ``low_watermark`` never takes a node into the kernel's own
free memory, whatever the node's size (the reserve is 6 % of the lab's 1 GiB nodes, 0.1–0.5 % of a
large one: ``min_free_kbytes`` grows with √memory and ``watermark_scale_factor`` is 0.1 %).
``other_bytes`` is what the nodes hold that the block table does not — the kernel, page cache,
other processes, the daemon itself — read from node meminfo as ``MemTotal − MemFree`` less the
table's own bytes on those nodes. Page cache is counted as used on purpose: a move finds room only in
free pages without reclaim, and reclaim on the target node is what made moves crawl in the lab
(direct reclaim in the mover's allocations — 302 allocation stalls in one 40 s run, the guest's CPU 0
busy for half a minute — when the table was filled up to what ``MemFree + file pages`` suggested).
The gap between the watermarks stays free: that is where the shim's placement of new allocations
(``fast``: the allocating CPU's node) lands without the kernel having to reclaim, and it is the same
room promotions need. Refreshed every ``REFRESH_S`` by the loop.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from tieringd.kernel import procfs
from tieringd.contracts import DAX_NODE, NODE_SLOTS, Tier
from tieringd.placement.plan import TierSpec
from tieringd.memory.topology import Topology, node_meminfo

REFRESH_S = 2.0


@dataclasses.dataclass(frozen=True)
class NodeMemory:
    """One node's memory, in bytes."""
    total_bytes: int             # MemTotal
    used_bytes: int              # MemTotal − MemFree
    kernel_reserve_bytes: int    # free memory the kernel keeps on the node (see the module doc)

    @property
    def capacity_bytes(self) -> int:
        """What the policy's watermarks are fractions of."""
        return max(self.total_bytes - self.kernel_reserve_bytes, 0)


def kernel_reserve_bytes(zones: list[procfs.Zone], node: int) -> int:
    """Free pages a node's zones keep for the kernel, as ``zone_watermark_ok`` sees a user
    (movable) allocation: the watermark plus ``lowmem_reserve[ZONE_MOVABLE]``, capped at what the
    zone manages. The promotion watermark, where listed, is above ``high``: kswapd reclaims up to it
    when the kernel's own NUMA-balancing promotion wants room (numa_balancing = 2)."""
    mine = [z for z in zones if z.node == node]
    names = [z.name for z in mine]
    movable = names.index("Movable") if "Movable" in names else len(names) - 1
    pages = 0
    for z in mine:
        protect = z.protection[movable] if movable < len(z.protection) else 0
        pages += min(z.managed, z.promo + protect)          # promo: ``high`` where not listed
    return pages * procfs.PAGE_SIZE


def node_memory(node: int, zones: list[procfs.Zone] | None = None) -> NodeMemory:
    """A node's MemTotal, use and kernel reserve, from its meminfo and ``/proc/zoneinfo``."""
    m = node_meminfo(node)
    total = m.get("MemTotal", 0)
    zones = procfs.read_zoneinfo([]) if zones is None else zones
    return NodeMemory(total, max(total - m.get("MemFree", 0), 0), kernel_reserve_bytes(zones, node))


def tier_specs(topo: Topology, table_node_bytes: np.ndarray,
               zones: list[procfs.Zone] | None = None) -> list[TierSpec]:
    """One :class:`TierSpec` per tier that has memory (GPU HBM is the engine's: never managed)."""
    zones = procfs.read_zoneinfo([]) if zones is None else zones
    specs = []
    for tier in Tier:
        if tier == Tier.GPU_HBM or not tier.numa:
            continue
        nodes = tuple(topo.nodes_in_tier(tier))
        if not nodes:
            continue
        capacity = other = 0.0
        for n in nodes:
            mem = node_memory(n, zones)
            capacity += mem.capacity_bytes
            ours = float(table_node_bytes[n]) if n < len(table_node_bytes) else 0.0
            other += max(mem.used_bytes - ours, 0.0)
        specs.append(TierSpec(tier, nodes, capacity, other))
    return specs


def tier_lookup(topo: Topology, size: int = NODE_SLOTS) -> np.ndarray:
    """node id → Tier value (int8) for numpy lookups; nodes the topology does not know map to the
    slowest tier present (a node hot-plugged since discovery is most likely slow memory)."""
    present = [n.tier for n in topo.nodes if n.has_memory and n.tier != Tier.GPU_HBM]
    slowest = max(present, default=Tier.DRAM)
    out = np.full(size, int(slowest), np.int8)
    for n in topo.nodes:
        if n.id < size:
            out[n.id] = int(n.tier)
    if DAX_NODE < size:
        out[DAX_NODE] = int(Tier.DAX)
    return out
