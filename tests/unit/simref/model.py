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

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from tieringd.contracts import Tier
from tieringd.placement.prefetch import TierCost
from simref.expand import Accesses

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
class Observed:
    """The accesses as the transparent policies see them, ordered by the window they are seen in.
    ``access`` indexes the true stream (for positional weight and sharers)."""
    window: np.ndarray       # int64: the window at whose end the access is seen
    access: np.ndarray       # int64
    count: np.ndarray        # float64: reads seen (≥ 1)

    def bounds(self, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[lo, hi) into this stream of what is seen at the end of each given window."""
        return np.searchsorted(self.window, windows, "left"), np.searchsorted(self.window, windows, "right")


def observe(acc: Accesses, model: TransparentModel) -> Observed:
    """The view of ``acc`` under ``model`` (deterministic for a seed)."""
    prev, _ = acc.prev_next()
    first = prev < 0
    window = acc.window + np.where(first, 0, model.delay_windows)
    count = acc.count.astype(np.float64)
    if model.sample_fraction < 1:
        rng = np.random.default_rng(model.seed)
        seen = rng.binomial(np.maximum(count, 0).astype(np.int64), model.sample_fraction).astype(np.float64)
        count = np.where(first, np.maximum(seen, 1.0), seen)
    keep = count > 0
    idx = np.flatnonzero(keep)
    order = idx[np.argsort(window[idx], kind="stable")]
    return Observed(window[order], order, count[order])
