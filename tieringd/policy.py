# SPDX-License-Identifier: Apache-2.0
"""The placement plan, once per tick: which blocks go to which tier, and the moves that get there.

One tick, all vectorised over the block table (docs/heat-policy.md walks through an example):

1. **Heat** of every block (``BlockTable.compute_heat``).
2. **Deserved tier** from the brief's thresholds (heat > 0.8 → tier 0, > 0.5 → tier 1, > 0.2 → tier 2,
   else tier 3), clamped to the tiers this policy manages (GPU HBM is the engine's: never a target).
   Hysteresis: to rise above a threshold a block needs ``threshold + hysteresis``; to fall below it,
   ``threshold − hysteresis``.
3. **Capacity.** Tiers fill fastest first with the hottest blocks that deserve them, up to each
   tier's budget: ``high_watermark × capacity`` normally, ``low_watermark × capacity`` once usage is
   above the high watermark (TPP's two watermarks: the gap is headroom for new allocations). Blocks
   that do not fit spill to the next tier. Heat is ranked in ``bins`` buckets with a weighted
   histogram, and the one bucket that straddles a budget is split block by block, so budgets hold to
   the byte. Blocks already in a tier rank ``hysteresis`` hotter there.
4. **No demotion without pressure** (``demote_only_under_pressure``): a block planned to leave a
   tier that is below its high watermark stays, hottest first, while the tier's budget has room.
5. **Moves**, within ``migration_budget_bytes`` per tick: promotions first (hottest first), then
   prefetches, then demotions (coldest first, from tiers under pressure first). A promotion into a
   tier above its high watermark is paired with demotions out of it; no tier's inflow ever exceeds
   its free capacity, whatever order the mover runs the moves in.

Pinned blocks, blocks moved less than ``min_residency_ms`` ago and blocks on unmanaged tiers are
never planned: they keep their place and count against their tier's budget. Per-tenant quotas cap
what a tenant (cgroup path or ``pid:N``) may hold in the fastest managed tier.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping, Sequence

import numpy as np

from tieringd.config import ConfigError, check_keys
from tieringd.contracts import Move, Priority, Tier
from tieringd.heat import FLAG_PINNED, FLAG_VALID, BlockTable
from tieringd.prefetch import Prefetcher
from tieringd.units import parse_size

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


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    """The ``[policy]`` table (quotas in ``[policy.quotas]``: tenant = size)."""
    interval_ms: float = 100.0
    thresholds: tuple[float, ...] = (0.8, 0.5, 0.2)
    hysteresis: float = 0.05
    min_residency_ms: float = 1000.0
    migration_budget_bytes: int = 256 << 20
    high_watermark: float = 0.95
    low_watermark: float = 0.90
    demote_only_under_pressure: bool = True
    demotion_reserve: float = 0.25     # share of the budget promotions leave to demotions under pressure
    bins: int = 4096
    quotas: Mapping[str, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_config(cls, section: Mapping[str, Any]) -> "PolicyConfig":
        check_keys("policy", section, {f.name for f in dataclasses.fields(cls)})
        kw = dict(section)
        try:
            if "thresholds" in kw:
                kw["thresholds"] = tuple(float(x) for x in kw["thresholds"])
            if "migration_budget_bytes" in kw:
                kw["migration_budget_bytes"] = parse_size(kw["migration_budget_bytes"], "[policy] migration_budget_bytes")
            if "quotas" in kw:
                if not isinstance(kw["quotas"], Mapping):
                    raise ConfigError("[policy.quotas] must be a table of tenant = size")
                kw["quotas"] = {str(k): parse_size(v, f"[policy.quotas] {k}") for k, v in kw["quotas"].items()}
            for k in ("interval_ms", "hysteresis", "min_residency_ms", "high_watermark", "low_watermark",
                      "demotion_reserve"):
                if k in kw:
                    kw[k] = float(kw[k])
            cfg = cls(**kw)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"[policy]: {e}") from None
        cfg.validate()
        return cfg

    def validate(self) -> None:
        th = self.thresholds
        if not th or any(not 0 <= t <= 1 for t in th) or any(a < b for a, b in zip(th, th[1:])):
            raise ConfigError("[policy]: thresholds must be in [0, 1], fastest tier first, non-increasing")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ConfigError("[policy]: need 0 < low_watermark ≤ high_watermark ≤ 1")
        if self.hysteresis < 0 or self.min_residency_ms < 0 or self.interval_ms <= 0:
            raise ConfigError("[policy]: hysteresis and min_residency_ms must be ≥ 0, interval_ms > 0")
        if not 0 <= self.demotion_reserve <= 1:
            raise ConfigError("[policy]: demotion_reserve must be in [0, 1]")
        if self.migration_budget_bytes <= 0 or not 16 <= self.bins <= 1 << 16:
            raise ConfigError("[policy]: migration_budget_bytes must be > 0 and bins in [16, 65536]")


@dataclasses.dataclass
class Plan:
    """One tick's output. ``blocks``/``to_tier``/``to_node``/``priority`` list the emitted block moves
    (what ``moves`` coalesces into address ranges); ``target`` holds every block's planned tier."""
    moves: list[Move]
    blocks: np.ndarray
    to_tier: np.ndarray
    to_node: np.ndarray
    priority: np.ndarray
    planned_bytes: dict[str, float]       # per tier label: bytes there if every planned move ran
    moved_bytes: dict[str, float]         # per priority name: bytes emitted this tick
    deferred_bytes: float                 # planned moves left for later ticks (budget, room)
    now_ms: int = 0

    @property
    def total_moved_bytes(self) -> float:
        return float(sum(self.moved_bytes.values()))


def _ordered_prefix(idx: np.ndarray, rank: np.ndarray, sizes: np.ndarray, budget: float) -> np.ndarray:
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


class Policy:
    def __init__(self, config: PolicyConfig, tiers: Sequence[TierSpec], prefetcher: Prefetcher | None = None):
        config.validate()
        specs = sorted((t for t in tiers if Tier(t.tier) != Tier.GPU_HBM), key=lambda t: int(t.tier))
        if not specs:
            raise ConfigError("policy: no managed tier (GPU HBM is reported, never a target)")
        if len({int(t.tier) for t in specs}) != len(specs):
            raise ConfigError("policy: each tier may be given once")
        self.cfg = config
        self.tiers = specs
        self.tier_values = np.array([int(t.tier) for t in specs], np.int8)
        self.prefetcher = prefetcher
        th = list(config.thresholds)
        # θ_j: the heat above which a block deserves managed tier j (or faster)
        self.theta = [th[int(t.tier)] if int(t.tier) < len(th) else -np.inf for t in specs]
        self._scratch: dict[str, np.ndarray] = {}
        self.timings_ms: dict[str, float] = {}          # the last tick, by phase
        self.last_plan: Plan | None = None

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

    def _budgets(self, table: BlockTable) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per managed tier: current usage (with other_bytes), capacity, end-state budget, pressure."""
        used = np.array([table.tier_bytes[int(t.tier)] + t.other_bytes for t in self.tiers])
        cap = np.array([t.capacity_bytes for t in self.tiers], np.float64)
        hi = self.cfg.high_watermark * cap
        pressure = used > hi
        budget = np.where(pressure, self.cfg.low_watermark * cap, hi) - \
            np.array([t.other_bytes for t in self.tiers])
        return used, cap, budget, pressure

    # ---- the tick ------------------------------------------------------------------------------
    def _plan(self, table: BlockTable, now_ms: int):
        """Steps 1–4 (module doc): every block's target tier index ``t`` next to its current one ``c``."""
        n = table.n
        M = len(self.tiers)
        NB = self.cfg.bins
        m = np.float32(self.cfg.hysteresis)
        FIXED = M * NB                     # keys ≥ FIXED: blocks that keep their place (+ their tier index)

        laps = self.timings_ms = {}
        t0 = [time.process_time()]

        def lap(name: str) -> None:
            now = time.process_time()
            laps[name] = (now - t0[0]) * 1e3
            t0[0] = now

        a = self._buf("a", n, np.float32)
        key = self._buf("key", n, np.intp)    # intp: np.bincount would otherwise convert (and fault in) a copy
        d = self._buf("d", n, np.uint8)    # deserved tier index
        c = self._buf("c", n, np.uint8)    # current tier index
        b1 = self._buf("b1", n, np.bool_)
        b2 = self._buf("b2", n, np.bool_)
        b3 = self._buf("b3", n, np.bool_)

        h = table.compute_heat(now_ms, scratch=a)
        tier = table.tier[:n]
        lap("heat")

        # 2. deserved (d) and current (c) tier indices. (Boolean masks are added through a uint8
        # view: numpy's bool→int casts and ``where=`` loops are several times slower.)
        d.fill(0)
        c.fill(0)
        for j in range(M - 1):
            th = self.theta[j]
            np.greater(tier, self.tier_values[j], out=b2)          # currently slower than tier j
            c += b2.view(np.uint8)
            np.less_equal(h, np.float32(th - m), out=b1)            # clearly below: deserves slower
            np.less_equal(h, np.float32(th + m), out=b3)            # not clearly above, and already slower
            b2 &= b3
            b1 |= b2
            d += b1.view(np.uint8)

        prefetch = np.zeros(0, np.int64)
        if self.prefetcher is not None:
            prefetch = self.prefetcher.candidates(table, Tier(int(self.tier_values[0])))
            if len(prefetch):
                d[prefetch] = 0

        # key = d·NB + bucket, bucket 0 = hottest; rank = heat + hysteresis for blocks already at least
        # as fast as they deserve. Computed in float32 (exact: keys < 2^24), then cast once.
        scale = np.float32((NB - 1) / (1 + m))
        kf = key.view(np.float32)[:n]
        np.less_equal(c, d, out=b1)
        np.multiply(b1.view(np.uint8), np.float32(m), out=kf)
        kf += h
        if len(prefetch):
            kf[prefetch] = 1 + m
        kf *= scale
        np.multiply(d, np.float32(NB), out=a)
        a += np.float32(NB - 1)
        a -= kf
        np.copyto(key, a, casting="unsafe")

        lap("rank")
        # fixed blocks: invalid, pinned, recently moved, or on a tier this policy does not manage
        # (each test runs only when the table says such blocks can exist)
        fixed = b3
        any_fixed = False
        if table.dead or table.pinned_blocks:
            np.bitwise_and(table.flags[:n], FLAG_VALID | FLAG_PINNED, out=d)
            np.not_equal(d, FLAG_VALID, out=fixed)
            any_fixed = True
        if self.cfg.min_residency_ms > 0 and table.moved_max_ms and \
                now_ms - table.moved_max_ms < self.cfg.min_residency_ms:
            moved = table.moved_ms[:n]                      # 0: never moved
            age = a.view(np.uint32)                         # a is free again
            np.subtract(np.uint32(now_ms), moved, out=age)
            np.less(age, np.uint32(self.cfg.min_residency_ms), out=b1)
            np.not_equal(moved, 0, out=b2)
            b1 &= b2
            if any_fixed:
                fixed |= b1
            else:
                np.copyto(fixed, b1)
            any_fixed = True
        managed_mask = np.zeros(len(Tier), bool)
        managed_mask[self.tier_values] = True
        if (table.tier_bytes[~managed_mask] > 0).any():
            if any_fixed:
                fixed |= ~managed_mask[tier]
            else:
                np.copyto(fixed, ~managed_mask[tier])
            any_fixed = True
        fidx = np.flatnonzero(fixed) if any_fixed else np.zeros(0, np.int64)
        key[fidx] = c[fidx].astype(np.intp) + FIXED

        # quotas: a tenant's blocks beyond its quota cannot be planned into the fastest tier
        quota_pushed = self._apply_quotas(table, key, c, fidx, NB) if self.cfg.quotas and M > 1 else None

        lap("fixed")
        # 3. capacity fill over the key histogram
        sizes = table.size[:n]
        hist = np.bincount(key, weights=sizes, minlength=FIXED + M)
        used, cap, budget, pressure = self._budgets(table)
        budget = np.maximum(budget - hist[FIXED:FIXED + M], 0.0)
        cuts = np.full(M, FIXED, np.int64)
        overrides: list[tuple[np.ndarray, int]] = []
        split_cache: dict[int, np.ndarray] = {}
        assigned = np.zeros(M)
        p = 0
        for k in range(M):
            end = FIXED if k == M - 1 else (k + 1) * NB
            if p >= end:
                cuts[k] = p
                continue
            cs = np.cumsum(hist[p:end])
            nfull = int(np.searchsorted(cs, budget[k], side="right"))
            if nfull == end - p:
                cuts[k], assigned[k], p = end, cs[-1], end
                continue
            sb = p + nfull
            room = budget[k] - (cs[nfull - 1] if nfull else 0.0)
            blocks = split_cache.get(sb)
            if blocks is None:
                blocks = np.flatnonzero(key == sb)
            # inside one bucket prefer blocks already on this tier (no move), then lower index
            blocks = blocks[np.argsort(c[blocks] != k, kind="stable")]
            bc = np.cumsum(sizes[blocks])
            r = int(np.searchsorted(bc, room, side="right"))
            if r:
                overrides.append((blocks[:r], k))
                hist[sb] -= bc[r - 1]
            split_cache[sb] = blocks[r:]
            assigned[k] = (cs[nfull - 1] if nfull else 0.0) + (bc[r - 1] if r else 0.0)
            cuts[k] = sb
            p = sb

        # every block's target through a lookup table indexed by its key (one gather pass): tier k
        # takes the keys between the previous cut and its own; fixed keys map to their current tier;
        # keys past the last cut fit nowhere and stay (255, replaced by the current tier below)
        lut = np.full(FIXED + M, 255, np.uint8)
        start = 0
        for k in range(M):
            lut[start:cuts[k]] = k
            start = max(start, int(cuts[k]))
        lut[FIXED:] = np.arange(M, dtype=np.uint8)
        t = d                                   # reuse: target tier index
        np.take(lut, key, out=t)
        if cuts[M - 1] < FIXED:
            np.equal(t, 255, out=b1)
            np.copyto(t, c, where=b1)
        for blocks, k in overrides:             # the split buckets' blocks that did fit
            t[blocks] = k
        lap("fill")
        # 4. no demotion without pressure
        if self.cfg.demote_only_under_pressure:
            np.greater(t, c, out=b1)
            if quota_pushed is not None and len(quota_pushed):
                b1[quota_pushed] = False
            didx = np.flatnonzero(b1)
            if len(didx):
                leftover = np.where(pressure, 0.0, budget - assigned)
                src = c[didx]
                dsz = sizes[didx]
                per_src = np.bincount(src, weights=dsz, minlength=M)
                all_fit = (per_src <= leftover) & (per_src > 0)
                if all_fit.any():                           # the common case: no sorting
                    sel = all_fit[src]
                    t[didx[sel]] = src[sel]
                for k in np.flatnonzero(~all_fit & (leftover > 0) & (per_src > 0)):
                    cand = didx[src == k]
                    keep = _ordered_prefix(cand, key[cand], sizes[cand], leftover[k])
                    kc = np.cumsum(sizes[keep])
                    t[keep[:int(np.searchsorted(kc, leftover[k], side="right"))]] = k
        lap("keep")
        return t, c, key, sizes, prefetch, used, cap, pressure

    def tick(self, table: BlockTable, now_ns: int | None = None, now_ms: int | None = None) -> Plan:
        """One tick: the plan for every block, and the moves of it that fit this tick's budget."""
        if now_ms is None:
            now_ms = table.now_ms(time.monotonic_ns() if now_ns is None else now_ns)
        t, c, key, sizes, prefetch, used, cap, pressure = self._plan(table, now_ms)
        t0 = time.process_time()
        plan = self._emit(table, t, c, key, sizes, prefetch, used, cap, pressure, now_ms)
        self.timings_ms["moves"] = (time.process_time() - t0) * 1e3
        self.last_plan = plan
        return plan

    def targets(self, table: BlockTable, now_ms: int) -> np.ndarray:
        """The tier (``Tier`` value) the plan wants each block on, ignoring this tick's budget."""
        t, *_ = self._plan(table, now_ms)
        return self.tier_values[np.minimum(t, len(self.tiers) - 1)].copy()

    def _apply_quotas(self, table: BlockTable, key: np.ndarray, c: np.ndarray, fidx: np.ndarray,
                      NB: int) -> np.ndarray:
        pushed = []
        nr = table.nregions
        for tenant, quota in self.cfg.quotas.items():
            tid = table._tenant_ids.get(tenant)
            if tid is None:
                continue
            rids = np.flatnonzero(table.r_live[:nr] & (table.r_tenant[:nr] == tid))
            if len(rids) == 0:
                continue
            idx = np.concatenate([np.arange(table.r_first[r], table.r_first[r] + table.r_count[r]) for r in rids])
            k = key[idx]
            fixed_fast = (k == NB * len(self.tiers)) & (c[idx] == 0)
            room = quota - float(table.size[idx][fixed_fast].sum())
            elig = idx[k < NB]
            if len(elig) == 0:
                continue
            order = elig[np.argsort(key[elig], kind="stable")]
            cs = np.cumsum(table.size[order])
            over = order[int(np.searchsorted(cs, max(room, 0.0), side="right")):]
            key[over] += NB
            pushed.append(over)
        return np.concatenate(pushed) if pushed else np.zeros(0, np.int64)

    # ---- 5. moves within the budget ------------------------------------------------------------
    def _emit(self, table: BlockTable, t: np.ndarray, c: np.ndarray, key: np.ndarray, sizes: np.ndarray,
              prefetch: np.ndarray, used: np.ndarray, cap: np.ndarray, pressure: np.ndarray,
              now_ms: int) -> Plan:
        """``key``: each block's heat bucket from the fill (ascending = hotter)."""
        M = len(self.tiers)
        top = int(self.cfg.bins * M)          # cold-first ranks: top − 1 − key
        mark = self._buf("mark", table.n, np.bool_, zeroed=True)   # membership tests; all False between uses

        def member(of: np.ndarray, items: np.ndarray) -> np.ndarray:
            mark[items] = True
            out = mark[of]
            mark[items] = False
            return out

        left = float(self.cfg.migration_budget_bytes)
        room = cap - used                                   # hard: inflow never exceeds this
        free = np.maximum(self.cfg.high_watermark * cap - used, 0.0)
        moving = np.flatnonzero(t != c)
        tm, cm = t[moving], c[moving]
        msz = sizes[moving]
        moved_matrix = np.bincount(tm * np.uint8(M) + cm, weights=msz, minlength=M * M).reshape(M, M)
        total_planned = float(moved_matrix.sum())
        planned = used + moved_matrix.sum(axis=1) - moved_matrix.sum(axis=0)   # rows: to, columns: from

        # Only a budget's worth can move this tick: narrow the candidates first, in one histogram
        # over (group, rank): promotions grouped by destination tier, hottest first; demotions by
        # source tier, coldest first. Prefetches (a few per sequential region) are taken as they come.
        if len(prefetch):
            prefs = prefetch[t[prefetch] < c[prefetch]]
            pref_mask = member(moving, prefs)
        else:
            prefs = prefetch
            pref_mask = None
        km = key[moving]
        upm = tm < cm
        group = np.where(upm, tm, cm + np.uint8(M)).astype(np.int64)
        rank = np.where(upm, km, (top - 1) - km) + top * group
        if pref_mask is not None:
            rank[pref_mask] = 2 * M * top                 # outside every group: never a head
        hist = np.bincount(rank, weights=msz, minlength=2 * M * top + 1)[:2 * M * top]
        cs = hist.reshape(2 * M, top).cumsum(axis=1)
        cut = np.array([g * top + np.searchsorted(cs[g], left, side="left") for g in range(2 * M)] + [-1])
        head = np.flatnonzero(rank <= cut[np.minimum(rank // top, 2 * M)])
        head = head[np.argsort(rank[head], kind="stable")]
        is_up = upm[head]
        promos = moving[head[is_up]]
        down, c_down = moving[head[~is_up]], cm[head[~is_up]]

        chosen: list[tuple[np.ndarray, int]] = []          # (blocks, priority)
        paired: list[np.ndarray] = []                       # demotions that make room for promotions
        # under pressure, promotions leave a share of the budget to demotions
        reserve = self.cfg.demotion_reserve * left if pressure.any() and len(down) else 0.0
        left -= reserve

        # promotions, then prefetches, per destination tier (fastest first)
        for prio, ups in ((Priority.PROMOTE, promos), (Priority.PREFETCH, prefs)):
            t_ups = t[ups]
            for k in range(M):
                if left <= 0:
                    break
                # promotions are hottest first; prefetches keep candidate order (nearest the cursor first)
                cand = ups[t_ups == k]
                if len(cand) == 0:
                    continue
                s = np.cumsum(sizes[cand])
                out_k = down[c_down == k]                   # coldest first
                if paired:
                    out_k = out_k[~member(out_k, np.concatenate(paired))]
                dcs = np.cumsum(sizes[out_k])
                extra = np.maximum(s - free[k], 0.0)        # bytes that need a demotion out of k
                j = np.searchsorted(dcs, extra, side="left")
                if len(dcs):
                    pay = np.where(extra > 0, dcs[np.minimum(j, len(dcs) - 1)], 0.0)
                else:
                    pay = np.where(extra > 0, np.inf, 0.0)
                ok = (s + pay <= left) & (s <= room[k]) & ((extra <= 0) | (j < len(dcs)))
                nacc = len(ok) if ok.all() else int(np.argmin(ok))
                if nacc == 0:
                    continue
                chosen.append((cand[:nacc], int(prio)))
                took = float(s[nacc - 1])
                room[k] -= took
                free[k] = max(free[k] - took, 0.0)
                left -= took
                if extra[nacc - 1] > 0:
                    pair = out_k[:int(j[nacc - 1]) + 1]
                    paired.append(pair)
                    left -= float(sizes[pair].sum())
                    free[k] += float(sizes[pair].sum())

        # demotions: the paired ones first (already paid for), then coldest first with tiers under
        # pressure ahead of the others
        left += reserve
        pairs = np.concatenate(paired) if paired else np.zeros(0, np.int64)
        rest = down[~member(down, pairs)] if len(pairs) else down
        if left > 0 and len(rest):
            cold_rank = top - 1 - key[rest] + np.where(pressure[c[rest]], 0, top)
            rest = _ordered_prefix(rest, cold_rank, sizes[rest], left)
        else:
            rest = rest[:0]
        order = np.concatenate([pairs, rest]).astype(np.int64)
        if len(order):
            dest = t[order]
            ok = np.ones(len(order), bool)
            for k in range(M):
                sel = dest == k
                if sel.any():
                    ok[sel] = np.cumsum(sizes[order[sel]]) <= room[k]
            npairs = int(ok[:len(pairs)].sum())
            order = order[ok]
            keep = np.ones(len(order), bool)
            keep[npairs:] = np.cumsum(sizes[order[npairs:]]) <= left
            order = order[keep]
            if len(order):
                chosen.append((order, int(Priority.DEMOTE)))

        blocks = np.concatenate([b for b, _ in chosen]).astype(np.int64) if chosen else np.zeros(0, np.int64)
        prio = np.concatenate([np.full(len(b), p, np.int8) for b, p in chosen]) if chosen else np.zeros(0, np.int8)
        to_idx = t[blocks].astype(np.int64)
        to_tier = self.tier_values[to_idx]
        nodes = np.array([self._node_for(table, k) for k in range(M)], np.int16)
        to_node = nodes[to_idx]
        moved = {p.name: float(sizes[blocks[prio == int(p)]].sum()) for p in Priority}
        return Plan(moves=self._coalesce(table, blocks, to_node, prio), blocks=blocks, to_tier=to_tier,
                    to_node=to_node, priority=prio,
                    planned_bytes={Tier(int(tv)).label: float(b) for tv, b in zip(self.tier_values, planned)},
                    moved_bytes=moved,
                    deferred_bytes=max(total_planned - sum(moved.values()), 0.0), now_ms=now_ms)

    def _node_for(self, table: BlockTable, k: int) -> int:
        """The tier's node with the fewest managed bytes (all moves into a tier this tick go there)."""
        nodes = self.tiers[k].nodes
        if not nodes:
            return -1
        return min(nodes, key=lambda nd: table.node_bytes[nd])

    @staticmethod
    def _coalesce(table: BlockTable, blocks: np.ndarray, to_node: np.ndarray, prio: np.ndarray) -> list[Move]:
        """Adjacent blocks of one region with the same source, destination and priority → one Move."""
        if len(blocks) == 0:
            return []
        order = np.lexsort((blocks, prio))
        b, tn, pr = blocks[order], to_node[order], prio[order]
        rid = table.region[b]
        fn = table.node[b]
        brk = np.ones(len(b), bool)
        brk[1:] = (np.diff(b) != 1) | (rid[1:] != rid[:-1]) | (fn[1:] != fn[:-1]) | \
            (tn[1:] != tn[:-1]) | (pr[1:] != pr[:-1])
        starts = np.flatnonzero(brk)
        ends = np.append(starts[1:], len(b))
        pid, addr = table.block_address(b[starts])
        lens = np.add.reduceat(table.size[b], starts)
        return [Move(pid=int(pid[i]), start=int(addr[i]), length=int(lens[i]), from_node=int(fn[s]),
                     to_node=int(tn[s]), priority=Priority(int(pr[s])))
                for i, (s, _e) in enumerate(zip(starts, ends))]


def apply_plan(table: BlockTable, plan: Plan) -> None:
    """Record a plan as carried out in full (the simulator; the daemon records what the mover verified)."""
    table.set_location(plan.blocks, plan.to_node, plan.to_tier, now_ms=plan.now_ms)
