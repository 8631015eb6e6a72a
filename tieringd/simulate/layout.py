# SPDX-License-Identifier: Apache-2.0
"""The simulated memory (tiers and their capacities) and what a policy's run counts as it goes."""
from __future__ import annotations

import dataclasses

import numpy as np

from tieringd.contracts import Tier


@dataclasses.dataclass(frozen=True)
class Layout:
    tiers: tuple[Tier, ...]                 # fastest first
    capacity_blocks: tuple[float, ...]      # per tier; the last may be inf


class Tally:
    """What a run counts, window by window: accesses, hits, and per tier the accesses it served and
    their reads; blocks moved. ``record``: keep every access's tier and hit too (tests, small traces)."""

    def __init__(self, ntiers: int, record: bool = False):
        self.accesses = 0
        self.hits = 0
        self.served = np.zeros(ntiers, np.int64)
        self.served_reads = np.zeros(ntiers, np.float64)
        self.moved_blocks = 0
        self.record: tuple[list[np.ndarray], list[np.ndarray]] | None = ([], []) if record else None

    def add(self, served: np.ndarray, hit: np.ndarray, reads: np.ndarray) -> None:
        """One window: each access's tier (index into the layout's tiers), whether it hit, its reads."""
        k = len(self.served)
        self.accesses += len(served)
        self.hits += int(np.count_nonzero(hit))
        self.served += np.bincount(served, minlength=k)[:k]
        self.served_reads += np.bincount(served, weights=reads, minlength=k)[:k]
        if self.record is not None:
            self.record[0].append(np.asarray(served, np.int8))
            self.record[1].append(np.asarray(hit, bool))

    @property
    def served_each(self) -> np.ndarray:
        """Every access's tier, in order (``record`` only)."""
        return np.concatenate(self.record[0]) if self.record and self.record[0] else np.zeros(0, np.int8)

    @property
    def hit_each(self) -> np.ndarray:
        return np.concatenate(self.record[1]) if self.record and self.record[1] else np.zeros(0, bool)
