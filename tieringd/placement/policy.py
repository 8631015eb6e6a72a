# SPDX-License-Identifier: Apache-2.0
"""The placement plan, once per tick: which blocks go to which tier, and the moves that get there.

One tick, all vectorised over the block table (docs/heat-policy.md walks through an example). Each
numbered step is one method of :class:`Policy`; the arrays they share live in a :class:`TickState`.

1. **Heat** of every block (``BlockTable.compute_heat``) — :meth:`Policy._heat`.
2. **Rank** — :meth:`Policy._rank`. Each block's current tier (``tier_now``) and the tier the reference
   thresholds say it deserves (``tier_deserved``: heat > 0.8 → tier 0, > 0.5 → tier 1, > 0.2 → tier 2,
   else tier 3, clamped to the managed tiers; GPU HBM is the engine's: never a target). Hysteresis: to
   rise above a threshold a block needs ``threshold + hysteresis``; to fall below it,
   ``threshold − hysteresis``. The rank key orders blocks by deserved tier, then by heat in ``bins``
   buckets; a block ranks ``hysteresis`` hotter for every managed tier slower than the one it is on.
   **Residency** (:meth:`Policy._returning`): a block off the fastest tier that moved less than
   ``min_residency_ms`` ago (one the policy demoted) ranks with its heat discounted by what that long
   idle costs at the recency half-life, so it comes back only past blocks it beats by that much.
3. **Fixed blocks** keep their place and count against their tier — :meth:`Policy._fixed`: pinned,
   absent (not populated yet), or on a tier the policy does not manage. Per-tenant quotas push a
   tenant's blocks beyond its quota out of the fastest tier (:meth:`Policy._quotas`).
4. **Capacity fill** — :meth:`Policy._fill`. Tiers fill fastest first in rank order, up to each tier's
   fill budget. With ``fill = "rank"`` (the default) a tier with room left after every block that
   deserves it takes the hottest of the rest — a block with room above it rises, and the thresholds
   decide only where capacity does not — and the fill budget is ``low_watermark × capacity``. With
   ``fill = "thresholds"`` (thresholds alone decide) a tier takes only blocks that deserve it, up to
   ``high_watermark × capacity``, or ``low_watermark × capacity`` once usage is above the high
   watermark (TPP's two watermarks). The one heat bucket that straddles a budget is split block by
   block, so budgets hold to the byte.
5. **Keep** — :meth:`Policy._keep`. With ``fill = "rank"``, blocks already on a tier stay up to its high
   watermark (the band between the watermarks absorbs new allocations, and a demotion to the low
   watermark is not undone by the next fill); above it the tier is under pressure and empties to the
   low watermark. With ``fill = "thresholds"`` and ``demote_only_under_pressure``, a block planned to
   leave a tier below its high watermark stays, hottest first, while the tier's fill budget has room.
6. **Moves** within this tick's migration budget (the mover's rate × the interval) —
   :meth:`Policy._moves`: promotions first (hottest first), then prefetches, then demotions (coldest
   first, from tiers under pressure first). A promotion into a tier above its high watermark is paired
   with demotions out of it; no tier's inflow ever exceeds its free capacity, whatever order the mover
   runs the moves in. Demotions not paired with a promotion take a tier under pressure down to its low
   watermark once this tick's promotions have landed, and no further (:meth:`Policy._shed_bytes`).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Mapping, Sequence

import numpy as np

from tieringd.config import ConfigError, Table, ranged
from tieringd.contracts import Tier
from tieringd.placement.blocktable import FLAG_VALID
from tieringd.placement.heat import BlockTable
from tieringd.placement.plan import Plan, TickState, TierSpec, seen_first, split_bucket, ordered_prefix
from tieringd.placement.prefetch import Prefetcher
from tieringd.placement.selection import MoveSelection

FILLS = ("rank", "thresholds")
_RANK_CHUNK = 1 << 16       # rows per chunk in step 2 (~1.3 MiB of scratch and table columns: L2-sized)


@dataclasses.dataclass(frozen=True)
class PolicyConfig(Table):
    """The ``[policy]`` table, quotas in ``[policy.quotas]`` (tenant = size); built with
    ``config.from_table(PolicyConfig, "policy", table)``."""
    NAME = "policy"
    interval_ms: float = ranged(100.0, 1, 60_000, unit="milliseconds")  # the tick: heat, plan and moves once per interval
    fill: str = "rank"                       # "rank": room above rises; "thresholds": a tier takes only blocks that deserve it
    thresholds: tuple[float, ...] = ranged((0.8, 0.5, 0.2), 0, 1)  # the reference thresholds: heat above which a block deserves tier 0, 1, 2
    # just above HeatConfig's weight_sharing (0.002, 0.001996 normalised): the sharing term orders
    # blocks read in the same tick but never displaces an incumbent read then too — when one tick's
    # reads outgrow the fast tier, that swapped shared blocks in for private ones every tick (the
    # Mooncake arxiv trace at 5 % of DRAM: 0.5 point of hit rate). Larger margins delayed
    # promotions under tight capacity; ping-pong is held off by the watermark band and
    # min_residency_ms instead
    hysteresis: float = ranged(0.0025, 0, 1)  # heat margin around each threshold, and an incumbent's bonus per slower tier in the ranking
    # for this long after it left the fastest tier, a block's heat is discounted by what this much
    # idleness takes off it at the recency half-life (Policy._returning)
    min_residency_ms: float = ranged(1000.0, 0, 3_600_000, unit="milliseconds")  # a block that left the fastest tier this recently ranks as if idle this much longer; 0: off
    # the plan hands the mover at most rate × the time since the last plan; 0: no rate of its own,
    # the mover's measured rate paces it (daemon/admission.py; the simulator: Policy.note_mover_rate)
    migration_rate_mb_s: float = ranged(0.0, 0, 1e6, unit="MB/s")  # moves planned per second at most; 0: paced by the mover's measured rate
    # a cap on every plan, whatever the rate
    migration_budget_bytes: int = ranged(256 << 20, 1, 1 << 50, unit="bytes")  # the most one plan hands the mover
    # fractions of what the kernel leaves a tier (MemTotal less its zones' watermarks and lowmem
    # protection, daemon/capacity.py), so a narrow band costs the kernel none of its free memory. In
    # the simulator (a KV-only tier) the band is DRAM the fill leaves empty: 0.95 / 0.92 kept 7.1 % of
    # it empty and served 0.941 × Belady's fast share on the Mooncake arxiv slice at 5 %
    high_watermark: float = ranged(0.97, 0, 1, lo_open=True)  # of the tier's MemTotal less the kernel's reserve
    low_watermark: float = ranged(0.95, 0, 1, lo_open=True)  # the fill's target; under pressure, demotions go down to it
    demote_only_under_pressure: bool = True  # fill "thresholds": cold blocks stay on a tier below its high watermark
    demotion_reserve: float = ranged(0.25, 0, 1)  # share of the budget promotions leave to demotions under pressure
    bins: int = ranged(4096, 16, 1 << 16)  # heat buckets per deserved tier in the capacity fill
    quotas: Mapping[str, int] = ranged(None, 0, 1 << 50, unit="bytes", factory=dict)  # fastest-tier cap per tenant: "cgroup:/PATH" or "pid:N" = size

    def validate(self) -> None:
        super().validate()
        bad = ConfigError.bad_value
        th = self.thresholds
        if not th or any(a < b for a, b in zip(th, th[1:])):
            raise bad("policy", "thresholds", "heats in [0, 1], fastest tier first, non-increasing", list(th))
        if self.fill not in FILLS:
            raise bad("policy", "fill", " or ".join(f'"{f}"' for f in FILLS), self.fill)
        if not self.low_watermark <= self.high_watermark:
            raise bad("policy", "low_watermark", f"a fraction in (0, high_watermark = {self.high_watermark}]",
                      self.low_watermark)


class Policy(MoveSelection):
    def __init__(self, config: PolicyConfig, tiers: Sequence[TierSpec], prefetcher: Prefetcher | None = None):
        config.validate()
        self.cfg = config
        self.prefetcher = prefetcher
        self.set_tiers(tiers)
        self.mover_rate_bytes_s = 0.0                   # as measured by the mover (note_mover_rate)
        self._scratch: dict[str, np.ndarray] = {}
        self.timings_ms: dict[str, float] = {}          # the last tick, by phase
        self.last_plan: Plan | None = None

    def set_tiers(self, tiers: Sequence[TierSpec]) -> None:
        """The managed tiers and their capacities (the daemon refreshes ``other_bytes`` as node
        usage changes; GPU HBM is reported, never a target)."""
        specs = sorted((t for t in tiers if Tier(t.tier) != Tier.GPU_HBM), key=lambda t: int(t.tier))
        if not specs:
            raise ConfigError("policy: no managed tier (GPU HBM is reported, never a target)")
        if len({int(t.tier) for t in specs}) != len(specs):
            raise ConfigError("policy: each tier may be given once")
        self.tiers = specs
        self.tier_values = np.array([int(t.tier) for t in specs], np.int8)
        self._index = {int(t.tier): k for k, t in enumerate(specs)}     # tier value → managed index
        th = list(self.cfg.thresholds)
        # θ_j: the heat above which a block deserves managed tier j (or faster)
        self.theta = [th[int(t.tier)] if int(t.tier) < len(th) else -np.inf for t in specs]

    # ---- the migration budget ------------------------------------------------------------------
    def note_mover_rate(self, bytes_per_s: float) -> None:
        """The rate the mover sustains while busy (bytes/s), as it measured it; sets the budget per
        tick when ``migration_rate_mb_s`` is 0."""
        if bytes_per_s > 0:
            self.mover_rate_bytes_s = float(bytes_per_s)

    @property
    def budget_bytes(self) -> float:
        """Bytes one tick may move: the configured or measured mover rate × the interval, else
        ``migration_budget_bytes``."""
        rate = self.cfg.migration_rate_mb_s * 1e6 or self.mover_rate_bytes_s
        if rate > 0:
            return rate * self.cfg.interval_ms / 1000.0
        return float(self.cfg.migration_budget_bytes)

    # ---- scratch buffers, reused across ticks (the table's size changes rarely) ----------------
    def _buf(self, name: str, n: int, dtype, zeroed: bool = False) -> np.ndarray:
        """A reusable buffer; ``zeroed`` ones are all zero on allocation and must be left that way."""
        b = self._scratch.get(name)
        if b is None or len(b) < n:
            b = (np.zeros if zeroed else np.empty)(max(n, 16) + (n >> 3), dtype)
            self._scratch[name] = b
        return b[:n]

    @property
    def scratch_bytes(self) -> int:
        return sum(b.nbytes for b in self._scratch.values())

    # ---- the tick ------------------------------------------------------------------------------
    def tick(self, table: BlockTable, now_ns: int | None = None, now_ms: int | None = None,
             budget_bytes: float | None = None) -> Plan:
        """One tick: the plan for every block, and the moves of it that fit this tick's budget
        (``budget_bytes`` overrides :attr:`budget_bytes`)."""
        if now_ms is None:
            now_ms = table.now_ms(time.monotonic_ns() if now_ns is None else now_ns)
        st = self._plan(table, now_ms)
        t0 = time.process_time()
        plan = self._moves(table, st, self.budget_bytes if budget_bytes is None else float(budget_bytes))
        self.timings_ms["moves"] = (time.process_time() - t0) * 1e3
        self.last_plan = plan
        return plan

    def targets(self, table: BlockTable, now_ms: int) -> np.ndarray:
        """The tier (``Tier`` value) the plan wants each block on, ignoring this tick's budget."""
        st = self._plan(table, now_ms)
        return self.tier_values[np.minimum(st.tier_target, len(self.tiers) - 1)].copy()

    def _plan(self, table: BlockTable, now_ms: int) -> TickState:
        """Steps 1–5: every block's target tier."""
        laps = self.timings_ms = {}
        clock = [time.process_time()]

        def lap(name: str) -> None:
            now = time.process_time()
            laps[name] = (now - clock[0]) * 1e3
            clock[0] = now

        st = self._start(table, now_ms)
        self._heat(table, st)
        lap("heat")
        self._rank(table, st)
        self._returning(table, st)
        lap("rank")
        self._fixed(table, st)
        self._quotas(table, st)
        lap("fixed")
        self._fill(st)
        lap("fill")
        self._keep(st)
        lap("keep")
        return st

    def _start(self, table: BlockTable, now_ms: int) -> TickState:
        """Per-tier figures, and the key space: ``tier_deserved·bins + bucket`` for the movable
        blocks, then (fill "rank") one group of ``bins`` for blocks over a quota, then the fixed ones.

        Fill budgets (TPP's two watermarks): with fill "rank" a tier fills to the low watermark and
        blocks already on it stay up to the high one, so the band between them absorbs new
        allocations and a demotion to the low watermark is not undone by the next tick's fill; above
        the high watermark it is under pressure and empties to the low one. With fill "thresholds"
        (thresholds alone decide) a tier fills to the high watermark, or to the low one under pressure.
        """
        n = table.n
        cfg = self.cfg
        used = np.array([table.tier_bytes[int(t.tier)] + t.other_bytes for t in self.tiers])
        for row, to in table.moving_to.items():          # a move in flight counts where it goes
            size, k_from, k_to = table.size[row], self._index.get(int(table.tier[row])), self._index.get(to)
            if k_from is not None and k_to is not None:
                used[k_from] -= size
                used[k_to] += size
        cap = np.array([t.capacity_bytes for t in self.tiers], np.float64)
        other = np.array([t.other_bytes for t in self.tiers])
        pressure = used > cfg.high_watermark * cap
        high, low = cfg.high_watermark * cap - other, cfg.low_watermark * cap - other
        if cfg.fill == "rank":
            fill, keep, groups = low, np.where(pressure, 0.0, high), len(self.tiers) + 1
        else:
            fill = np.where(pressure, low, high)
            keep, groups = np.where(pressure, 0.0, fill), len(self.tiers)
        return TickState(
            now_ms=now_ms, n=n, sizes=table.size[:n], heat=table.heat[:n], last_ms=table.last_ms[:n],
            tier_now=self._buf("tier_now", n, np.uint8), tier_deserved=self._buf("tier_deserved", n, np.uint8),
            # intp: np.bincount would otherwise convert (and fault in) a copy of the keys every tick
            rank_key=self._buf("rank_key", n, np.intp), tier_target=self._buf("tier_target", n, np.uint8),
            barred_key=len(self.tiers) * cfg.bins, fixed_key=groups * cfg.bins, used_bytes=used,
            capacity_bytes=cap, fill_bytes=fill, keep_bytes=keep, pressure=pressure,
            size_profile=table.size_profile())

    # Step scratch: ``work`` (float32) and ``mask_a``/``mask_b`` (bool) hold nothing between steps;
    # each step names what it keeps in them while it runs.
    def _work(self, n: int) -> np.ndarray:
        return self._buf("work", n, np.float32)

    def _masks(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        return self._buf("mask_a", n, np.bool_), self._buf("mask_b", n, np.bool_)

    # 1.
    def _heat(self, table: BlockTable, st: TickState) -> None:
        # Sharing keeps a block, it does not fetch one: the sharing term counts above the slowest
        # managed tier only. Among blocks read in the same tick it then orders what to demote, and
        # promotions follow recency alone: on the Mooncake arxiv slice at 5 % of DRAM, promoting
        # shared blocks first cost 0.12 of the term's 0.16 point deficit to LRU, while the
        # conversation traces keep most of their lead (docs/simulator.md)
        slowest = int(self.tier_values[-1]) if len(self.tier_values) > 1 else None
        table.compute_heat(st.now_ms, scratch=self._work(st.n), sharing_above=slowest)

    # 2.
    def _rank(self, table: BlockTable, st: TickState) -> None:
        """tier_now, tier_deserved, prefetch candidates and the rank key, a cache-sized chunk of rows
        at a time: each step's passes then read the chunk from the CPU cache, not the table from
        memory, as compute_heat does (P4 at 10M blocks, steady: step 2 took 36 ms in one pass per
        operation, 17 in chunks)."""
        for lo in range(0, st.n, _RANK_CHUNK):
            rows = slice(lo, min(lo + _RANK_CHUNK, st.n))
            self._tiers(table, st, rows)
            self._rank_key(st, rows)
        if self.prefetcher is not None:
            st.prefetch = self.prefetcher.candidates(table, Tier(int(self.tier_values[0])))
            if len(st.prefetch):
                # a prefetch candidate deserves tier 0 and ranks as the hottest possible block: its
                # key is bucket 0 of group 0 (_rank_key's arithmetic gives 0.5 for it, truncated to 0)
                st.tier_deserved[st.prefetch] = 0
                st.rank_key[st.prefetch] = 0

    def _tiers(self, table: BlockTable, st: TickState, rows: slice) -> None:
        """Counted one threshold at a time: a block is on a tier slower than managed tier j when its
        tier value is larger; it deserves one when its heat is clearly below θ_j (θ_j − hysteresis),
        or it is already slower and does not clear θ_j + hysteresis. Boolean masks are added through
        a uint8 view: numpy's bool→int casts and ``where=`` loops are several times slower."""
        tier_now, tier_deserved, heat = st.tier_now[rows], st.tier_deserved[rows], st.heat[rows]
        if len(self.tiers) == 1:                  # no threshold: every block is on, and deserves, tier 0
            tier_now.fill(0)
            tier_deserved.fill(0)
            return
        slower_now, below = (mask[rows] for mask in self._masks(st.n))
        m = np.float32(self.cfg.hysteresis)
        tier = table.tier[rows]
        # threshold 0's masks are the counts' first values, written through bool views (a byte of
        # 0 or 1 either way): zeroing the counts and adding to them would be four more passes
        now_0, deserved_0 = tier_now.view(np.bool_), tier_deserved.view(np.bool_)
        for j in range(len(self.tiers) - 1):
            th = self.theta[j]
            slower = now_0 if j == 0 else slower_now
            np.greater(tier, self.tier_values[j], out=slower)
            if j:
                tier_now += slower_now.view(np.uint8)
            np.less_equal(heat, np.float32(th + m), out=below)          # does not clear θ_j + m …
            np.logical_and(slower, below, out=slower_now)                # … and is already slower
            np.less_equal(heat, np.float32(th - m), out=below)          # or clearly below θ_j
            if j == 0:
                np.logical_or(below, slower_now, out=deserved_0)
            else:
                below |= slower_now
                tier_deserved += below.view(np.uint8)

    def _rank_key(self, st: TickState, rows: slice) -> None:
        """key = tier_deserved·bins + bucket of (heat + incumbency bonus), bucket 0 = hottest.

        The bonus is ``hysteresis`` per managed tier slower than the block's own (fill "rank"), so at
        every tier boundary the block already there wins a tie by ``hysteresis``; with fill
        "thresholds" it is ``hysteresis`` for a block at least as fast as it deserves. Computed in float32 in place (float passes cost a quarter of an intp one) and cast
        once; the half bucket keeps float rounding of a heat of 1 inside bucket 0.
        """
        NB, M = self.cfg.bins, len(self.tiers)
        m = np.float32(self.cfg.hysteresis)
        tier_now, tier_deserved = st.tier_now[rows], st.tier_deserved[rows]
        work = self._work(st.n)[rows]      # the key as a float, in units of bins: deserved + bucket / bins
        if self.cfg.fill == "rank":
            np.multiply(tier_now, m, out=work)
            offset = -m * (M - 1)          # work − offset = −(heat + bonus)
        else:
            at_least_as_fast = self._masks(st.n)[0][rows]
            np.less_equal(tier_now, tier_deserved, out=at_least_as_fast)
            np.multiply(at_least_as_fast.view(np.uint8), -m, out=work)
            offset = 0.0
        work -= st.heat[rows]
        scale = self._buckets_per_heat()
        # bucket = (bins − 0.5) − scale·(heat + bonus) ∈ [0.5, bins − 0.5]: truncation gives 0 … bins − 1
        work *= np.float32(scale / NB)
        work += tier_deserved
        work += np.float32((NB - 0.5 + offset * scale) / NB)
        work *= np.float32(NB)
        np.copyto(st.rank_key[rows], work, casting="unsafe")

    def _buckets_per_heat(self) -> float:
        """The rank key's scale: heat buckets per unit of heat (the incumbency bonus included)."""
        m = np.float32(self.cfg.hysteresis)
        top = 1 + m * (len(self.tiers) - 1) if self.cfg.fill == "rank" else 1 + m
        return (self.cfg.bins - 1) / top

    def _returning(self, table: BlockTable, st: TickState) -> None:
        """Residency: a block off the fastest tier that moved less than ``min_residency_ms`` ago
        ranks with its heat discounted by what ``min_residency_ms`` of idleness takes off at the
        recency half-life (within its deserved group), so within its residency it comes back only
        past blocks it beats by that much.

        Residency guards demotions, not promotions. It keeps two blocks read in turn from swapping
        every tick (the one that just left must beat the other by a residency of idleness), while a
        block just promoted may leave again at once, as under LRU: holding every promoted block
        for a residency kept blocks read once in DRAM while newer ones waited (the Mooncake arxiv
        slice at 5 %: 0.024 point of hit rate behind transparent LRU; docs/simulator.md).
        The recency half-life is ``half_life_s`` (a shared block's longer one is not used: the
        discount errs toward keeping it out). Tested on the recently moved rows only."""
        cfg = self.cfg
        if not (cfg.min_residency_ms > 0 and table.moved_max_ms and
                st.now_ms - table.moved_max_ms < cfg.min_residency_ms):
            return
        recent, moved = self._masks(st.n)
        moved_ms = table.moved_ms[:st.n]                     # 0: never moved
        age_ms = self._work(st.n).view(np.uint32)
        np.subtract(np.uint32(st.now_ms), moved_ms, out=age_ms)
        np.less(age_ms, np.uint32(cfg.min_residency_ms), out=recent)
        np.not_equal(moved_ms, 0, out=moved)
        recent &= moved
        rows = np.flatnonzero(recent)
        rows = rows[st.tier_now[rows] != 0]
        if len(rows) == 0:
            return
        kept = 2.0 ** (-cfg.min_residency_ms / (1000.0 * table.heat_cfg.half_life_s))
        buckets = (st.heat[rows] * (1.0 - kept) * self._buckets_per_heat()).astype(np.intp)
        key = st.rank_key[rows]
        last = key - key % cfg.bins + (cfg.bins - 1)         # the last bucket of its deserved group
        st.rank_key[rows] = np.minimum(key + buckets, last)

    # 3.
    def _fixed(self, table: BlockTable, st: TickState) -> None:
        """Blocks that keep their place: invalid, pinned or absent, or on a tier this policy does
        not manage (each test runs only when the table says such blocks can exist)."""
        fixed = self._masks(st.n)[0]
        any_fixed = False
        if table.dead or table.pinned_blocks or table.absent_blocks or table.moving_blocks:
            # movable ⇔ flags == FLAG_VALID (blocktable.py): pinned, absent and moving blocks set another flag
            np.not_equal(table.flags[:st.n], FLAG_VALID, out=fixed)
            any_fixed = True
        managed = np.zeros(len(Tier), bool)
        managed[self.tier_values] = True
        if (table.tier_bytes[~managed] > 0).any():
            unmanaged = ~managed[table.tier[:st.n]]
            if any_fixed:
                fixed |= unmanaged
            else:
                np.copyto(fixed, unmanaged)
            any_fixed = True
        if table.moving_to:                               # kept where their move goes
            for row, to in table.moving_to.items():
                if row < st.n and to in self._index:
                    st.tier_now[row] = self._index[to]
        if any_fixed:
            st.fixed = np.flatnonzero(fixed)
            st.rank_key[st.fixed] = st.tier_now[st.fixed].astype(np.intp) + st.fixed_key

    def _quotas(self, table: BlockTable, st: TickState) -> None:
        """Only a tenant's hottest ``quota`` bytes may be planned into the fastest tier: the keys of
        the rest move to the barred group (fill "rank"; the fastest tier never takes it) or one group
        down (fill "thresholds": they rank as if they deserved the next tier)."""
        if not self.cfg.quotas or len(self.tiers) < 2:
            return
        NB = self.cfg.bins
        rank_fill = self.cfg.fill == "rank"
        pushed = []
        for tenant, quota in self.cfg.quotas.items():
            idx = table.tenant_blocks(tenant)
            if len(idx) == 0:
                continue
            key = st.rank_key[idx]
            fixed_fast = (key == st.fixed_key) & (st.tier_now[idx] == 0)
            room = quota - float(st.sizes[idx][fixed_fast].sum())
            eligible = idx[key < (st.barred_key if rank_fill else NB)]
            if len(eligible) == 0:
                continue
            order = eligible[np.argsort(st.rank_key[eligible], kind="stable")]
            cs = np.cumsum(st.sizes[order])
            over = order[int(np.searchsorted(cs, max(room, 0.0), side="right")):]
            if rank_fill:
                st.rank_key[over] = st.barred_key + st.rank_key[over] % NB
            else:
                st.rank_key[over] += NB
            pushed.append(over)
        if pushed:
            st.quota_pushed = np.concatenate(pushed)

    # 4.
    def _fill(self, st: TickState) -> None:
        """Tiers take keys in ascending order up to their fill budget, over a weighted histogram of
        the keys; the bucket that straddles a budget is split block by block: blocks already on the
        tier first (no move); within each, a block ever seen read before one never seen (a request
        idle long enough to tie with the never-read rest of a pool comes back; the rest may never).
        Among seen blocks the newer (higher index: allocated later, so a younger sequence, which has
        longer to live) first; among never-seen ones the lower first (``seen_first``). Ties are
        common: every block a decode batch read in the same tick has the same heat, and every block
        idle for a few half-lives has the heat of its static factors.

        When every block of a straddling bucket has the table's common size, how many of them a tier
        takes follows from the histogram; its members are then found after the lookup below, in a
        byte-wide pass over the targets instead of one over the 8-byte keys (P4 at 10M blocks: two
        splits a tick, about 3.5 ms saved on each)."""
        M, NB, FIXED = len(self.tiers), self.cfg.bins, st.fixed_key
        key, sizes = st.rank_key, st.sizes
        hist = st.size_profile.bytes_per_key(key, sizes, FIXED + M)
        fixed_bytes = hist[FIXED:FIXED + M].copy()
        room_bytes = np.maximum(st.fill_bytes - fixed_bytes, 0.0)         # fixed blocks count first
        cuts = np.full(M, FIXED, np.int64)     # tier k takes the keys before cuts[k] (after cuts[k−1])
        counted: dict[int, list[tuple[int, int]]] = {}         # bucket → (tier, blocks it takes), in tier order
        split_taken: list[tuple[np.ndarray, int]] = []         # the other buckets' splits, made here
        split_rest: dict[int, Callable[[], np.ndarray]] = {}   # bucket → what a split left of it
        assigned = np.zeros(M)
        p = 0
        for k in range(M):
            if self.cfg.fill == "rank":
                end = st.barred_key if k == 0 else FIXED        # a block with room above it rises
            else:
                end = FIXED if k == M - 1 else (k + 1) * NB     # only blocks that deserve the tier
            if p >= end:
                cuts[k] = p
                continue
            cs = np.cumsum(hist[p:end])
            nfull = int(np.searchsorted(cs, room_bytes[k], side="right"))
            if nfull == end - p:
                cuts[k], assigned[k], p = end, cs[-1], end
                continue
            split = p + nfull
            left_bytes = room_bytes[k] - (cs[nfull - 1] if nfull else 0.0)
            count = self._common_size_count(st, split, hist[split], left_bytes)
            if count is not None:
                counted.setdefault(split, []).append((k, count))
                taken = count * st.size_profile.common_bytes
            else:
                rest = split_rest.get(split)
                blocks = rest() if rest else seen_first(self._members(st.rank_key, split)[::-1], st.last_ms)
                took, taken, split_rest[split] = split_bucket(blocks, st.tier_now[blocks] == k, sizes, left_bytes)
                if len(took):
                    split_taken.append((took, k))
            hist[split] -= taken
            assigned[k] = (cs[nfull - 1] if nfull else 0.0) + taken
            cuts[k] = p = split
        st.placed_bytes = assigned + fixed_bytes
        self._targets(st, cuts, counted, split_taken)

    def _targets(self, st: TickState, cuts: np.ndarray, counted: dict[int, list[tuple[int, int]]],
                 split_taken: list[tuple[np.ndarray, int]]) -> None:
        """Every block's target tier from the fill's cuts (``tier_target``).

        Through a lookup table indexed by its key (one gather pass): tier k
        takes the keys between the previous cut and its own; fixed keys map to their current tier;
        keys past the last cut fit nowhere and stay (255, replaced by the current tier below); a
        counted bucket maps to a marker of its own (254, 253, …)."""
        M, FIXED, key = len(self.tiers), st.fixed_key, st.rank_key
        lut = np.full(FIXED + M, 255, np.uint8)
        start = 0
        for k in range(M):
            lut[start:cuts[k]] = k
            start = max(start, int(cuts[k]))
        lut[FIXED:] = np.arange(M, dtype=np.uint8)
        markers = {}
        for i, bucket in enumerate(counted):
            markers[bucket] = (254 - i, int(lut[bucket]))       # the marker, and the rest's target
            lut[bucket] = 254 - i
        np.take(lut, key, out=st.tier_target)
        for bucket, (marker, rest_target) in markers.items():
            self._split_counted(st, bucket, marker, rest_target, counted[bucket])
        if cuts[M - 1] < FIXED:
            # target −= (255 − tier_now) where it is 255, as three uint8 passes: a masked copyto
            # over the (often millions of) blocks past the last cut costs four times more
            nowhere, _ = self._masks(st.n)
            np.equal(st.tier_target, 255, out=nowhere)
            back = self._work(st.n).view(np.uint8)[:st.n]
            np.subtract(np.uint8(255), st.tier_now, out=back)
            back *= nowhere.view(np.uint8)
            st.tier_target -= back
        for blocks, k in split_taken:
            st.tier_target[blocks] = k

    @staticmethod
    def _common_size_count(st: TickState, bucket: int, bucket_bytes: float, budget: float) -> int | None:
        """How many blocks of ``bucket`` fit ``budget`` bytes when all of them have the table's common
        size (the count ``split_bucket`` takes, whatever their order); None when some may not."""
        profile = st.size_profile
        size = profile.common_bytes
        if not size or (len(profile.rows) and (st.rank_key[profile.rows] == bucket).any()):
            return None
        there = int(round(bucket_bytes / size))
        count = min(there, max(int(budget // size), 0))
        while count > 0 and count * size > budget:              # float rounding of the quotient
            count -= 1
        while count < there and (count + 1) * size <= budget:
            count += 1
        return count

    def _split_counted(self, st: TickState, bucket: int, marker: int, rest_target: int,
                       takes: list[tuple[int, int]]) -> None:
        """Targets for a counted bucket's blocks (marked ``marker`` by the lookup): each tier in
        ``takes`` takes its count, split as ``split_bucket`` splits; the rest go to ``rest_target``."""
        blocks = self._members(st.tier_target, marker)
        st.tier_target[blocks] = rest_target
        blocks = seen_first(blocks[::-1], st.last_ms)
        common_bytes = st.size_profile.common_bytes
        for i, (k, count) in enumerate(takes):
            # count × the common size takes exactly ``count`` blocks: every one of them has that size
            took, _, rest = split_bucket(blocks, st.tier_now[blocks] == k, st.sizes, count * common_bytes)
            st.tier_target[took] = k
            if i + 1 < len(takes):                               # what the next tier takes from
                blocks = rest()

    def _members(self, column: np.ndarray, value: int) -> np.ndarray:
        """The blocks whose ``column`` (the rank keys, or the targets) holds ``value``, ascending (the
        comparison goes to a scratch mask: a fresh 10M-entry one is faulted in each time)."""
        _, members = self._masks(len(column))
        np.equal(column, value, out=members)
        return np.flatnonzero(members)

    # 5.
    def _keep(self, st: TickState) -> None:
        if not self.cfg.demote_only_under_pressure:
            return
        leaving, _ = self._masks(st.n)
        np.greater(st.tier_target, st.tier_now, out=leaving)
        if len(st.quota_pushed):
            leaving[st.quota_pushed] = False
        idx = np.flatnonzero(leaving)
        if len(idx) == 0:
            return
        keep_bytes = st.keep_bytes - st.placed_bytes
        src = st.tier_now[idx]
        # A full band is ~10^5 blocks a tick: when they all have the table's common size (no
        # exception row among them), count them instead of gathering their sizes.
        profile = st.size_profile
        if profile.common_bytes is not None and not leaving[profile.rows].any():
            sizes = profile.common_bytes
            per_src = np.bincount(src, minlength=len(self.tiers)) * sizes
        else:
            sizes = st.sizes[idx]
            per_src = np.bincount(src, weights=sizes, minlength=len(self.tiers))
        all_fit = (per_src <= keep_bytes) & (per_src > 0)
        if all_fit.any():                           # the common case: no sorting
            stay = all_fit[src]
            st.tier_target[idx[stay]] = src[stay]
        for k in np.flatnonzero(~all_fit & (keep_bytes > 0) & (per_src > 0)):
            on_k = src == k
            cand = idx[on_k]
            cand_sizes = sizes[on_k] if isinstance(sizes, np.ndarray) else sizes
            if keep_bytes[k] < per_src[k] / 2:
                keep = ordered_prefix(cand, st.rank_key[cand], st.sizes[cand], keep_bytes[k])
                kc = np.cumsum(st.sizes[keep])
                st.tier_target[keep[:int(np.searchsorted(kc, keep_bytes[k], side="right"))]] = k
            else:
                self._keep_all_but_coldest(st, cand, cand_sizes, k, per_src[k] - keep_bytes[k])

    @staticmethod
    def _keep_all_but_coldest(st: TickState, cand: np.ndarray, cand_sizes: np.ndarray | float, k: int,
                              over_bytes: float) -> None:
        """The same choice as keeping the hottest prefix of ``cand`` that fits, made from the other
        end when most of them stay: the coldest blocks leave until ``over_bytes`` have (colder
        first, ties higher index first); the rest stay on tier ``k``. Which ones leave needs no
        sort: whole buckets colder than the one where ``over_bytes`` is reached, then that bucket's
        blocks in tie order. A tick on P4's 10M-block table keeps ~10^5 blocks of a full band.
        ``cand_sizes``: their sizes, or one size for all."""
        rev = cand[::-1]                                         # tie order: higher index first
        cold = (st.fixed_key - 1) - st.rank_key[rev]             # ascending: colder first
        if isinstance(cand_sizes, np.ndarray):
            rev_sizes = cand_sizes[::-1]
            cs = np.cumsum(np.bincount(cold, weights=rev_sizes))
        else:
            cs = np.cumsum(np.bincount(cold)) * cand_sizes
        cut = int(np.searchsorted(cs, over_bytes, side="left"))  # the bucket where over_bytes is reached
        leave = cold < cut
        if cut < len(cs):
            at = np.flatnonzero(cold == cut)
            need = over_bytes - (float(cs[cut - 1]) if cut else 0.0)
            at_bytes = np.cumsum(rev_sizes[at]) if isinstance(cand_sizes, np.ndarray) else \
                np.arange(1, len(at) + 1) * cand_sizes
            r = int(np.searchsorted(at_bytes, need, side="left")) + 1
            leave[at[:r]] = True
        st.tier_target[rev[~leave]] = k

    # 6.


