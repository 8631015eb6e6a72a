# SPDX-License-Identifier: Apache-2.0
"""What every transparent policy shares in a simulation: the mover, and the view of the accesses.

A *transparent* policy (tieringd's, and the kernel-side forms of LRU, ARC and LFU) does not sit in
the read path: it learns of accesses from a sampler, decides once per tick, and a mover copies the
blocks. So, for all of them alike:

- **Mover.** Moves made at the end of window ``w`` are in place for window ``w + 1``; one tick moves at
  most ``mover_bytes_s × tick`` bytes, promotions and demotions together. The default bandwidth is
  ``MOVER_SHARE`` of the slowest tier's read bandwidth (the mover may take that much of the link from
  the readers); ``--mover-gb-s`` sets a measured figure instead (P2 in docs/benchmarks.md).
- **Order.** The mover runs promotions before demotions (``contracts.Priority``), so a tier's inflow in
  one tick never exceeds the room it had before the tick: a full fast tier demotes first and takes
  promotions at the next tick — the rule ``Policy`` keeps, applied to every transparent policy.
- **View.** A block's allocation (its first access) is seen at once — the kernel or the shim places
  every new page. Later reads are seen at the end of their window plus ``delay_windows`` windows, each
  read with probability ``sample_fraction`` (1: every read; hint faults or PMU samples see a few).

Demand caches (``demand-lru`` …) and Belady's MIN are references outside this model: they move a block
at the access itself, without a budget.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Mapping, Sequence

import numpy as np

from tieringd.contracts import Tier
from tieringd.placement.prefetch import TierCost
from tieringd.simulate.stream import WindowAccesses

MOVER_SHARE = 0.10        # of the slowest tier's read bandwidth: 16 GB/s with the reference CXL DRAM


@dataclasses.dataclass(frozen=True)
class TransparentModel:
    mover_bytes_s: float
    delay_windows: int = 0
    sample_fraction: float = 1.0
    seed: int = 1

    def budget_bytes(self, tick_ms: float) -> float:
        """Bytes the mover moves in one tick."""
        return self.mover_bytes_s * tick_ms / 1000.0

    def describe(self) -> str:
        text = f"mover {self.mover_bytes_s / 1e9:.1f} GB/s"
        if self.delay_windows:
            text += f", reads seen {self.delay_windows} window(s) late"
        if self.sample_fraction < 1:
            text += f", {100 * self.sample_fraction:g}% of reads sampled"
        return text


def default_mover_bytes_s(costs: Mapping[Tier, TierCost], tiers: Sequence[Tier],
                          share: float = MOVER_SHARE) -> float:
    return share * min(costs[t].bandwidth_bytes_s for t in tiers)


@dataclasses.dataclass
class Delivery:
    """Accesses as a transparent policy sees them at one tick: ordered by the window they are seen in,
    then by their place in the stream. ``window``: the window each access happened in."""
    block: np.ndarray        # int64
    count: np.ndarray        # float64: reads seen (≥ 1)
    window: np.ndarray       # int64
    positional: np.ndarray   # float32
    sharers: np.ndarray      # int64

    def __len__(self) -> int:
        return len(self.block)


class View:
    """The accesses under ``model``, window by window (deterministic for a seed): a block's first access
    is seen at the end of its window, later ones ``delay_windows`` windows later, each read with
    probability ``sample_fraction`` (accesses with no read seen are dropped). Holds the reads still on
    their way: ``delay_windows`` windows of them."""

    def __init__(self, model: TransparentModel):
        self.model = model
        self.rng = np.random.default_rng(model.seed) if model.sample_fraction < 1 else None
        self.late: collections.deque[tuple[int, Delivery]] = collections.deque()   # (seen in window, reads)

    def deliver(self, acc: WindowAccesses, first: np.ndarray) -> Delivery:
        """What a policy sees at the end of ``acc``'s window: every earlier window's reads that have
        arrived by now, then this window's (reads seen at once interleaved as they happened)."""
        count = acc.count
        if self.rng is not None:
            seen = self.rng.binomial(np.maximum(count, 0).astype(np.int64), self.model.sample_fraction)
            count = np.where(first, np.maximum(seen, 1.0), seen.astype(np.float64))
        n = len(acc.block)
        w = acc.window
        if self.model.delay_windows == 0:
            now = np.flatnonzero(count > 0)
            late = None
        else:
            now = np.flatnonzero(first)
            late = np.flatnonzero(~first & (count > 0))
        parts = []
        while self.late and self.late[0][0] <= w:
            parts.append(self.late.popleft()[1])
        parts.append(_take(acc, count, now, w, n))
        if late is not None and len(late):
            self.late.append((w + self.model.delay_windows, _take(acc, count, late, w, n)))
        if len(parts) == 1:
            return parts[0]
        return Delivery(*(np.concatenate([getattr(p, f) for p in parts])
                          for f in ("block", "count", "window", "positional", "sharers")))


def _take(acc: WindowAccesses, count: np.ndarray, idx: np.ndarray, window: int, n: int) -> Delivery:
    if len(idx) == n:
        return Delivery(acc.block, count, np.full(n, window, np.int64), acc.positional, acc.sharers)
    return Delivery(acc.block[idx], count[idx], np.full(len(idx), window, np.int64), acc.positional[idx],
                    acc.sharers[idx])
