# SPDX-License-Identifier: Apache-2.0
"""What a policy tick works with and hands out: the managed tiers (:class:`TierSpec`), the arrays its
steps share (:class:`TickState`), its output (:class:`Plan`), and the few order-and-budget helpers the
fill and the move selection both use (a prefix of blocks that fits a budget, a bucket split block by
block). :func:`apply_plan` records a plan as carried out in full (the simulator)."""
from __future__ import annotations

import dataclasses

import numpy as np

from tieringd.contracts import Move, Tier
from tieringd.placement.blocktable import SizeProfile
from tieringd.placement.heat import BlockTable


@dataclasses.dataclass(frozen=True)
class TierSpec:
    """A managed tier: its NUMA nodes and how many bytes of managed blocks it may hold."""
    tier: Tier
    nodes: tuple[int, ...]
    capacity_bytes: float
    other_bytes: float = 0.0      # used by memory the table does not track (counted against capacity)

    @property
    def usable_bytes(self) -> float:
        return max(self.capacity_bytes - self.other_bytes, 0.0)


@dataclasses.dataclass
class Plan:
    """One tick's output. ``blocks``/``to_tier``/``to_node``/``priority`` list the emitted block moves
    (what ``moves`` coalesces into address ranges; promotions first); ``planned_bytes`` is where every
    planned move would leave each tier."""
    moves: list[Move]
    blocks: np.ndarray
    to_tier: np.ndarray
    to_node: np.ndarray
    priority: np.ndarray
    planned_bytes: dict[str, float]       # per tier label: bytes there if every planned move ran
    moved_bytes: dict[str, float]         # per priority name: bytes emitted this tick
    deferred_bytes: float                 # planned moves left for later ticks (budget, room)
    now_ms: int = 0
    budget_bytes: float = 0.0             # this tick's migration budget

    @property
    def total_moved_bytes(self) -> float:
        return float(sum(self.moved_bytes.values()))


@dataclasses.dataclass
class TickState:
    """What the steps of one tick hand each other. Arrays are views of the policy's reusable buffers
    (valid until the next tick); per-tier arrays are indexed by managed tier, 0 = fastest."""
    now_ms: int
    n: int
    sizes: np.ndarray                 # bytes per block (the table's)
    heat: np.ndarray                  # float32 (the table's)
    last_ms: np.ndarray               # uint32 (the table's): when each block was last seen read, 0 never
    tier_now: np.ndarray              # uint8: managed tier index each block is on
    tier_deserved: np.ndarray         # uint8: managed tier index the thresholds give it
    rank_key: np.ndarray              # intp: fill order (ascending = hotter); ≥ fixed_key: keeps its place
    tier_target: np.ndarray           # uint8: where the plan puts each block
    barred_key: int                   # keys from here: over a quota, never planned into the fastest tier
    fixed_key: int                    # keys from here: blocks that keep their place (fixed_key + tier)
    used_bytes: np.ndarray            # per tier, with memory the table does not track
    capacity_bytes: np.ndarray
    fill_bytes: np.ndarray            # what the fill may place in each tier (watermark × capacity − other)
    keep_bytes: np.ndarray            # up to where blocks planned out of a tier without pressure stay
    pressure: np.ndarray              # bool per tier: used above the high watermark
    prefetch: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    fixed: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    quota_pushed: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    placed_bytes: np.ndarray | None = None     # per tier: bytes the fill placed there (fixed ones included)
    size_profile: SizeProfile | None = None    # the table's (bytes per key without weighing every row)


def ordered_prefix(idx: np.ndarray, rank: np.ndarray, sizes: np.ndarray, budget: float) -> np.ndarray:
    """``idx`` in ascending ``rank`` (non-negative integers: a heat bucket, 0 = hottest), cut once the
    running size reaches ``budget``, plus one block. Large candidate sets are first narrowed with a
    histogram of ``rank`` (one pass), so only the affordable head is sorted."""
    if len(idx) == 0 or budget <= 0:
        return idx[:0]
    if len(idx) > 2048:
        cs = np.cumsum(np.bincount(rank, weights=sizes))
        cut = int(np.searchsorted(cs, budget, side="left"))      # bucket where the budget runs out
        head = rank <= cut
        idx, rank, sizes = idx[head], rank[head], sizes[head]
    order = np.argsort(rank, kind="stable")
    cs = np.cumsum(sizes[order])
    n = int(np.searchsorted(cs, budget, side="right")) + 1
    return idx[order[:n]]


def fitting_prefix(blocks: np.ndarray, sizes: np.ndarray, budget: float) -> tuple[int, float]:
    """How many of ``blocks``, in order, fit in ``budget`` bytes, and their bytes. Looks at a window
    that grows from the fewest blocks that could fill the budget, so a bucket of millions of tied
    idle blocks costs what the fill takes from it, not its size."""
    if len(blocks) == 0 or budget <= 0:
        return 0, 0.0
    window = min(len(blocks), int(budget // max(float(sizes[blocks[0]]), 1.0)) + 64)
    while True:
        cs = np.cumsum(sizes[blocks[:window]])
        r = int(np.searchsorted(cs, budget, side="right"))
        if r < window or window == len(blocks):
            return r, float(cs[r - 1]) if r else 0.0
        window = min(2 * window, len(blocks))


def seen_first(blocks: np.ndarray, last_ms: np.ndarray) -> np.ndarray:
    """``blocks`` (newest, i.e. highest index, first) reordered: those ever seen read (``last_ms``
    > 0) in the given order, then the never-seen ones lowest index first. A pool the server
    allocated up front hands its blocks out from the bottom (vLLM's free-block queue starts at
    block 0; kv_workload's front layout), so of two never-read blocks the lower one is read sooner."""
    seen = last_ms[blocks] > 0
    if seen.all():
        return blocks
    return np.concatenate([blocks[seen], blocks[~seen][::-1]])


def split_bucket(blocks: np.ndarray, here: np.ndarray, sizes: np.ndarray, budget: float):
    """The blocks of one heat bucket that a tier takes: those already on it (``here``) first, then
    the others, each in the given order, while they fit ``budget`` bytes. Returns (taken, their
    bytes, a function that gives the rest in the same order). The rest is built only if a slower
    tier's budget ends in the same bucket: a bucket of idle blocks can hold millions."""
    inc = blocks[here]
    r, taken = fitting_prefix(inc, sizes, budget)
    if r < len(inc):
        return inc[:r], taken, lambda: np.concatenate([inc[r:], blocks[~here]])
    others = blocks[~here]
    r2, more = fitting_prefix(others, sizes, budget - taken)
    return np.concatenate([inc, others[:r2]]), taken + more, lambda: others[r2:]


class Marks:
    """Membership tests against a reusable all-False mask (set, read, clear: no allocation per test)."""

    def __init__(self, mask: np.ndarray):
        self.mask = mask

    def isin(self, of: np.ndarray, items: np.ndarray) -> np.ndarray:
        self.mask[items] = True
        out = self.mask[of]
        self.mask[items] = False
        return out


def apply_plan(table: BlockTable, plan: Plan) -> None:
    """Record a plan as carried out in full (the simulator; the daemon records what the mover verified)."""
    table.set_location(plan.blocks, plan.to_node, plan.to_tier, now_ms=plan.now_ms)
