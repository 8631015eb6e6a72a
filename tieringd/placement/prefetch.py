# SPDX-License-Identifier: Apache-2.0
"""Position-aware prefetch: regions read in block order get their next blocks promoted ahead of use.

Detection. After each ingest the block table records, per region, the highest block index touched
(``r_cursor``) and when. A region whose cursor moved forward by at most ``max_jump_blocks`` in
``min_runs`` consecutive observations is *sequential*; its consumption rate (blocks/s) is an
exponentially weighted mean of those advances. A backward jump or a pause resets it.

Window. A prefetch issued at a tick lands after the next tick starts the move (``lead``), plus the
source tier's latency, plus the transfer itself; meanwhile the consumer keeps reading at ``rate``::

    window_bytes = rate · (lead + latency + window_bytes / bandwidth)
                 = rate · (lead + latency) / (1 − rate / bandwidth)

With lead = 0 this is the bandwidth-delay product (1.9 TB/s HBM reads × ~300 ns CXL latency
≈ 0.6 MB ahead); for the daemon the tick interval dominates the lead. When ``rate`` reaches the source
bandwidth no window can hide the stall, and the window is capped at ``max_window_blocks``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import numpy as np

from tieringd.config import ConfigError, Table, ranged
from tieringd.contracts import Tier
from tieringd.placement.blocktable import FLAG_VALID
from tieringd.placement.heat import BlockTable


@dataclasses.dataclass(frozen=True)
class TierCost:
    """What reading from a tier costs: sustained bandwidth (bytes/s) and load latency (s)."""
    bandwidth_bytes_s: float
    latency_s: float

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_s


# The reference cost table (2026 hardware): the middle of each published range; CXL DRAM is one switch hop.
REFERENCE_TIER_COSTS: dict[Tier, TierCost] = {
    Tier.GPU_HBM: TierCost(1.9e12, 0.0),          # H100 HBM3, the reader prefetch is sized for
    Tier.DRAM: TierCost(400e9, 85e-9),            # 400 GB/s, 70–100 ns
    Tier.CXL_DRAM: TierCost(160e9, 350e-9),       # 120–200 GB/s, 200–500 ns
    Tier.PMEM: TierCost(60e9, 2e-6),              # 40–80 GB/s, 1–3 µs
}


def window_bytes(rate_bytes_s: float, lead_s: float, cost: TierCost) -> float:
    """Bytes that must be in flight ahead of a consumer reading at ``rate_bytes_s`` (see module doc);
    ``inf`` when the consumer is at least as fast as the source tier."""
    if rate_bytes_s <= 0:
        return 0.0
    headroom = 1.0 - rate_bytes_s / cost.bandwidth_bytes_s
    if headroom <= 0:
        return math.inf
    return rate_bytes_s * (lead_s + cost.latency_s) / headroom


@dataclasses.dataclass(frozen=True)
class PrefetchConfig(Table):
    """The ``[prefetch]`` table (``config.from_table(PrefetchConfig, "prefetch", table)``)."""
    NAME = "prefetch"
    enabled: bool = True  # promote the next blocks of regions read in order ahead of use
    min_runs: int = ranged(2, 1, 1000)  # forward advances in a row before a region counts as sequential
    max_jump_blocks: int = ranged(64, 1, 1 << 20)  # a larger forward jump is a seek, not a scan
    max_window_blocks: int = ranged(64, 0, 1 << 20)  # most blocks prefetched ahead of a region's reads
    min_window_blocks: int = ranged(1, 0, 1 << 20)  # fewest blocks prefetched ahead of a sequential region's reads
    lead_ms: float = ranged(0.0, 0, 60_000, unit="milliseconds")  # 0: one policy interval
    rate_smoothing: float = ranged(0.5, 0, 1, lo_open=True)  # weight of the newest advance in the rate's running mean

    def validate(self) -> None:
        super().validate()
        if self.max_window_blocks < self.min_window_blocks:
            raise ConfigError.bad_value("prefetch", "max_window_blocks",
                                        f"an integer ≥ min_window_blocks = {self.min_window_blocks}",
                                        self.max_window_blocks)


class Prefetcher:
    """Per-region scan detection and prefetch candidates; state is a few small arrays per region."""

    def __init__(self, config: PrefetchConfig | None = None, costs: Mapping[Tier, TierCost] | None = None,
                 interval_ms: float = 100.0):
        self.cfg = config or PrefetchConfig()
        self.costs = dict(costs or REFERENCE_TIER_COSTS)
        self.lead_s = (self.cfg.lead_ms or interval_ms) / 1000.0
        self._seen_ms = np.zeros(0, np.int64)   # cursor time last observed, per region
        self._cursor = np.zeros(0, np.int64)
        self.runs = np.zeros(0, np.int32)
        self.rate_blocks_s = np.zeros(0, np.float64)

    def _fit(self, nregions: int) -> None:
        if len(self.runs) < nregions:
            extra = nregions - len(self.runs)
            self._seen_ms = np.concatenate([self._seen_ms, np.full(extra, -1, np.int64)])
            self._cursor = np.concatenate([self._cursor, np.full(extra, -1, np.int64)])
            self.runs = np.concatenate([self.runs, np.zeros(extra, np.int32)])
            self.rate_blocks_s = np.concatenate([self.rate_blocks_s, np.zeros(extra)])

    def observe(self, table: BlockTable) -> None:
        """Fold in the cursors the table recorded since the last call."""
        nr = table.nregions
        self._fit(nr)
        when = table.r_cursor_ms[:nr]
        fresh = np.flatnonzero(when != self._seen_ms[:nr])
        if len(fresh) == 0:
            return
        cur = table.r_cursor[fresh]
        prev = self._cursor[fresh]
        dt_s = (when[fresh] - self._seen_ms[fresh]) / 1000.0
        adv = cur - prev
        forward = (prev >= 0) & (adv > 0) & (adv <= self.cfg.max_jump_blocks) & (dt_s > 0)
        inst = np.where(forward, adv / np.where(dt_s > 0, dt_s, 1.0), 0.0)
        old = self.rate_blocks_s[fresh]
        a = self.cfg.rate_smoothing
        self.rate_blocks_s[fresh] = np.where(forward, np.where(old > 0, a * inst + (1 - a) * old, inst), 0.0)
        self.runs[fresh] = np.where(forward, self.runs[fresh] + 1, 0)
        self._cursor[fresh] = cur
        self._seen_ms[fresh] = when[fresh]

    def window_blocks(self, rate_blocks_s: float, block_bytes: float, source: Tier) -> int:
        cost = self.costs.get(Tier(source), REFERENCE_TIER_COSTS[Tier.PMEM])
        w = window_bytes(rate_blocks_s * block_bytes, self.lead_s, cost)
        blocks = self.cfg.max_window_blocks if math.isinf(w) else math.ceil(w / block_bytes)
        return int(min(max(blocks, self.cfg.min_window_blocks), self.cfg.max_window_blocks))

    def candidates(self, table: BlockTable, fastest: Tier) -> np.ndarray:
        """Blocks just ahead of each sequential region's cursor that are not yet in ``fastest``."""
        if not self.cfg.enabled:
            return np.zeros(0, np.int64)
        self.observe(table)
        nr = table.nregions
        seq = np.flatnonzero((self.runs[:nr] >= self.cfg.min_runs) & table.r_live[:nr])
        out = []
        for r in seq:
            first, count = int(table.r_first[r]), int(table.r_count[r])
            nxt = int(self._cursor[r]) + 1
            if nxt >= count:
                continue
            k = self.window_blocks(float(self.rate_blocks_s[r]), float(table.r_block_bytes[r]),
                                   Tier(int(table.tier[first + nxt])))
            idx = np.arange(first + nxt, first + min(nxt + k, count))
            # movable ones only: not pinned, and populated (an absent block has no memory to move)
            keep = (table.tier[idx] > int(fastest)) & (table.flags[idx] == FLAG_VALID)
            out.append(idx[keep])
        return np.concatenate(out) if out else np.zeros(0, np.int64)
