# SPDX-License-Identifier: Apache-2.0
"""The small set of types that cross module boundaries along the pipeline
topology → registry → samplers → heat → policy → mover.

Kept in one place so that parallel parts agree on them; each is documented where it is produced.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Mapping, NamedTuple

import numpy as np


# The node id the block table gives blocks that live on the DAX-remap tier: no NUMA node has it
# (MAX_NUMNODES is at most 1024, CONFIG_NODES_SHIFT ≤ 10), and per-node arrays are NODE_SLOTS long.
DAX_NODE = 1024
NODE_SLOTS = DAX_NODE + 1


class RegionKey(NamedTuple):
    """A KV region's one identity: the process that registered it and the address of its first
    byte (the registry verified both). The region book, the block table, the samplers' tracked set
    and the access signal's binds all key on it."""
    pid: int
    start: int


class Tier(enum.IntEnum):
    """The memory tiers, fastest first. Lower value = faster."""
    GPU_HBM = 0    # owned by the inference engine: reported, never moved
    DRAM = 1       # local DRAM (a node with CPUs)
    CXL_DRAM = 2   # CXL-attached DRAM: a CPU-less NUMA node
    PMEM = 3       # persistent memory: dax/kmem node from an NVDIMM/pmem region
    DAX = 4        # the DAX-remap tier: KV remapped onto a file on fsdax or a devdax device (no node)

    @property
    def label(self) -> str:
        return {0: "gpu-hbm", 1: "dram", 2: "cxl-dram", 3: "pmem", 4: "dax"}[int(self)]

    @property
    def numa(self) -> bool:
        """Whether memory of this tier is a NUMA node's (the DAX-remap tier's is a file's)."""
        return self is not Tier.DAX

    @classmethod
    def parse(cls, text: str) -> "Tier":
        """Accepts a label ("cxl-dram"), a name ("CXL_DRAM") or a number ("2")."""
        t = text.strip().lower().replace("_", "-")
        for tier in cls:
            if t in (tier.label, str(int(tier))):
                return tier
        raise ValueError(f"unknown tier {text!r}: expected one of "
                         + ", ".join(x.label for x in cls))


# Sampler output, one row per (pid, block) per interval: the access counts seen *since the last
# interval* (deltas), so consumers can add them up. ``source`` is a SampleSource value.
ACCESS_DELTA_DTYPE = np.dtype([
    ("pid", np.int32),
    ("block_start", np.uint64),   # virtual address of the block in that process
    ("block_len", np.uint32),     # bytes
    # samples in the interval. FAULT: base pages (4 KiB) seen accessed — a fault on a 4 KiB page
    # counts 1, one on a PMD-mapped THP the huge page's 512 pages, shared among the blocks it
    # overlaps — so THP- and 4 KiB-backed blocks read alike count alike (docs/sampling.md "Page
    # size"). PMU/DMA: samples; ACCESSED: DAMON nr_accesses or pages found accessed.
    ("count", np.uint32),
    ("last_seen_ns", np.uint64),  # CLOCK_MONOTONIC of the latest sample
    ("source", np.uint8),
])


class SampleSource(enum.IntEnum):
    FAULT = 1      # page faults, including NUMA-balancing hint faults
    PMU = 2        # perf_event data-address samples (PEBS/IBS; software events in tests)
    DMA = 3        # uprobes on DMA copy APIs (cudaMemcpy*, cuMemcpy*)
    ACCESSED = 4   # accessed-bit fallback (DAMON, idle page tracking)


class Priority(enum.IntEnum):
    """Promotions run before demotions: a block needed now is worth more than room made for later."""
    PROMOTE = 0
    PREFETCH = 1
    DEMOTE = 2


@dataclasses.dataclass(frozen=True)
class Move:
    """Policy output, mover input: move ``length`` bytes at ``start`` in ``pid`` to ``to_node``.

    The mover never decides *what* to move; it only carries moves out and reports where pages landed.
    """
    pid: int
    start: int
    length: int
    from_node: int | None
    to_node: int
    priority: Priority = Priority.DEMOTE


# Mover output, block-table input: pages the mover verified on a node (move_pages queried after the
# move), one row per run of consecutive pages on one node. The only upstream flow: facts, not plans.
LANDED_DTYPE = np.dtype([
    ("pid", np.int32),
    ("start", np.uint64),         # virtual address of the run's first page
    ("npages", np.uint32),        # base pages in the run
    ("node", np.int32),           # where every page of the run is now
])


@dataclasses.dataclass(frozen=True)
class FallbackMap:
    """Topology output, mover input, computed once by the caller (``Topology.fallback_map()``):
    ``chains[node]``, the nodes to try in order when ``node`` is full; ``tiers[tier]``, the tier's nodes
    with memory, lowest id first (for moves that name a tier)."""
    chains: Mapping[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    tiers: Mapping[Tier, tuple[int, ...]] = dataclasses.field(default_factory=dict)
