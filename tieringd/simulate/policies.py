# SPDX-License-Identifier: Apache-2.0
"""The policies the simulator compares, over one stream of block accesses.

Memory: a fast tier of ``capacity`` blocks and slower tiers behind it (first fit, the last one
unbounded). Classical policies (LRU, LFU, ARC, static first-fit, Belady) manage the fast tier only;
a block they evict goes to the first slower tier with room. tieringd's own policy (the real
``tieringd.policy.Policy`` on a real ``BlockTable``) places blocks over all tiers once per tick window.

Hit: an access is a *hit* when its block has stayed in the fast tier since the block's previous access
(the first access of a block is never a hit). That is the quantity Belady's MIN maximises over every
policy that keeps at most ``capacity`` blocks in the fast tier — including ones that move blocks ahead
of use — so MIN (with bypass: a block whose next use is further than every cached block's is not
admitted) is a true upper bound. Accesses served from the fast tier because a block was moved there
ahead of use show up in the per-tier shares, not as hits.
"""
from __future__ import annotations

import dataclasses
import heapq
from collections import OrderedDict
from typing import Callable

import numpy as np

from tieringd.contracts import Tier
from tieringd.heat import BlockTable, HeatConfig
from tieringd.policy import Policy, PolicyConfig, TierSpec, apply_plan
from tieringd.simulate.expand import Accesses

POLICIES = ("tieringd", "lru", "lfu", "arc", "first-fit", "belady")


@dataclasses.dataclass(frozen=True)
class Layout:
    tiers: tuple[Tier, ...]                 # fastest first
    capacity_blocks: tuple[float, ...]      # per tier; the last may be inf


@dataclasses.dataclass
class Outcome:
    served: np.ndarray          # int8 per access: index into Layout.tiers
    hit: np.ndarray             # bool per access
    migrated_bytes: float


class _Slow:
    """First fit over the slower tiers."""

    def __init__(self, layout: Layout):
        self.cap = list(layout.capacity_blocks[1:])
        self.used = [0] * len(self.cap)

    def place(self) -> int:
        for k, c in enumerate(self.cap):
            if self.used[k] < c:
                self.used[k] += 1
                return k + 1
        self.used[-1] += 1                    # over every capacity: the last tier takes it
        return len(self.cap)

    def release(self, tier: int) -> None:
        self.used[tier - 1] -= 1


def _demand(acc: Accesses, layout: Layout, cache_factory: Callable, progress=None) -> Outcome:
    """The loop shared by the classical policies. ``cache`` decides admission and eviction."""
    n = len(acc)
    cap = int(layout.capacity_blocks[0])
    prev, nxt = acc.prev_next()
    cache = cache_factory(cap, nxt)
    slow = _Slow(layout)
    where = np.full(acc.nblocks, -1, np.int64)     # −1: not allocated yet; 0: fast; k: slower tier k
    served = np.zeros(n, np.int8)
    hit = np.zeros(n, bool)
    moved = 0
    blocks = acc.block.tolist()
    prevs = prev.tolist()
    wl = where.tolist()
    step = max(n // 100, 1)
    for i, b in enumerate(blocks):
        loc = wl[b]
        if loc == 0:
            hit[i] = prevs[i] >= 0
            cache.touch(b, i)
        else:
            victims = cache.admit(b, i, loc < 0)
            if victims is None:                      # not admitted: stays (or is allocated) slow
                if loc < 0:
                    loc = wl[b] = slow.place()
                served[i] = loc
            else:
                for v in victims:
                    wl[v] = slow.place()
                    moved += 1
                if loc > 0:
                    slow.release(loc)
                    served[i] = loc
                    moved += 1
                wl[b] = 0
        if progress is not None and i % step == 0:
            progress(min(step, n - i))
    return Outcome(served, hit, float(moved) * acc.block_bytes)


class _LRU:
    def __init__(self, cap, nxt):
        self.cap, self.d = cap, OrderedDict()

    def touch(self, b, i):
        self.d.move_to_end(b)

    def admit(self, b, i, new):
        if self.cap <= 0:
            return None
        out = [self.d.popitem(last=False)[0]] if len(self.d) >= self.cap else []
        self.d[b] = None
        return out


class _LFU:
    """In-cache frequency, least-recently-used among equals."""

    def __init__(self, cap, nxt):
        self.cap, self.freq, self.buckets, self.minf = cap, {}, {}, 0

    def _add(self, b, f):
        self.freq[b] = f
        self.buckets.setdefault(f, OrderedDict())[b] = None

    def touch(self, b, i):
        f = self.freq[b]
        bucket = self.buckets[f]
        del bucket[b]
        if not bucket:
            del self.buckets[f]
            if self.minf == f:
                self.minf = f + 1
        self._add(b, f + 1)

    def admit(self, b, i, new):
        if self.cap <= 0:
            return None
        out = []
        if len(self.freq) >= self.cap:
            bucket = self.buckets[self.minf]
            v, _ = bucket.popitem(last=False)
            if not bucket:
                del self.buckets[self.minf]
            del self.freq[v]
            out.append(v)
        self._add(b, 1)
        self.minf = 1
        return out


class _ARC:
    """Adaptive Replacement Cache (Megiddo & Modha, FAST'03): T1/T2 cached, B1/B2 ghosts."""

    def __init__(self, cap, nxt):
        self.c, self.p = cap, 0.0
        self.t1, self.t2, self.b1, self.b2 = OrderedDict(), OrderedDict(), OrderedDict(), OrderedDict()

    def touch(self, b, i):
        if b in self.t1:
            del self.t1[b]
        else:
            del self.t2[b]
        self.t2[b] = None

    def _replace(self, in_b2: bool) -> int:
        if self.t1 and ((in_b2 and len(self.t1) == self.p) or len(self.t1) > self.p):
            v, _ = self.t1.popitem(last=False)
            self.b1[v] = None
        else:
            v, _ = self.t2.popitem(last=False)
            self.b2[v] = None
        return v

    def admit(self, b, i, new):
        c = self.c
        if c <= 0:
            return None
        out = []
        if b in self.b1:
            self.p = min(c, self.p + max(len(self.b2) / len(self.b1), 1))
            out.append(self._replace(False))
            del self.b1[b]
            self.t2[b] = None
            return out
        if b in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1))
            out.append(self._replace(True))
            del self.b2[b]
            self.t2[b] = None
            return out
        l1 = len(self.t1) + len(self.b1)
        total = l1 + len(self.t2) + len(self.b2)
        if l1 >= c:
            if len(self.t1) < c:
                self.b1.popitem(last=False)
                out.append(self._replace(False))
            else:
                v, _ = self.t1.popitem(last=False)
                out.append(v)
        elif total >= c:
            if total >= 2 * c:
                self.b2.popitem(last=False)
            if len(self.t1) + len(self.t2) >= c:
                out.append(self._replace(False))
        self.t1[b] = None
        return out


class _FirstFit:
    """Static placement: a new block goes to the fast tier while it has room; nothing ever moves."""

    def __init__(self, cap, nxt):
        self.cap, self.n = cap, 0

    def touch(self, b, i):
        pass

    def admit(self, b, i, new):
        if new and self.n < self.cap:
            self.n += 1
            return []
        return None


class _Belady:
    """MIN with bypass: keep the blocks used soonest; a block used later than all cached ones is not
    admitted. Optimal for the hit definition above (uniform block sizes)."""

    def __init__(self, cap, nxt):
        self.cap, self.nxt = cap, nxt.tolist()
        self.heap: list[tuple[int, int]] = []       # (−next use, block), stale entries skipped
        self.next_of: dict[int, int] = {}

    def touch(self, b, i):
        nu = self.nxt[i]
        self.next_of[b] = nu
        heapq.heappush(self.heap, (-nu, b))

    def admit(self, b, i, new):
        if self.cap <= 0:
            return None
        nu = self.nxt[i]
        if len(self.next_of) < self.cap:
            self.touch(b, i)
            return []
        heap = self.heap
        while True:
            neg, v = heap[0]
            if self.next_of.get(v) == -neg:
                break
            heapq.heappop(heap)
        if nu >= -heap[0][0]:
            return None
        heapq.heappop(heap)
        del self.next_of[v]
        self.touch(b, i)
        return [v]


_CLASSICAL = {"lru": _LRU, "lfu": _LFU, "arc": _ARC, "first-fit": _FirstFit, "belady": _Belady}


def run_tieringd(acc: Accesses, layout: Layout, heat: HeatConfig, cfg: PolicyConfig,
                 progress=None) -> Outcome:
    """The real policy on a real block table: serve a window's accesses, ingest them, tick, apply."""
    n = len(acc)
    bb = acc.block_bytes
    caps = [c * bb if np.isfinite(c) else 1e30 for c in layout.capacity_blocks]
    specs = [TierSpec(t, (k,), caps[k]) for k, t in enumerate(layout.tiers)]
    policy = Policy(cfg, specs)
    table = BlockTable(heat, capacity=max(acc.nblocks, 16), epoch_ns=0)
    lut = np.zeros(len(Tier), np.int8)
    for k, t in enumerate(layout.tiers):
        lut[int(t)] = k
    prev, _ = acc.prev_next()
    served = np.zeros(n, np.int8)
    hit = np.zeros(n, bool)
    fast_since = np.full(acc.nblocks, np.iinfo(np.int64).max, np.int64)
    allocated = 0
    moved = 0.0
    bounds = np.flatnonzero(np.diff(acc.window)) + 1
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [n]])
    for lo, hi in zip(starts.tolist(), ends.tolist()):
        idx = acc.block[lo:hi]
        top = int(idx.max()) + 1
        if top > allocated:                        # new blocks: first fit, fastest tier first
            k_new = top - allocated
            first = allocated
            for k, t in enumerate(layout.tiers):
                room = k_new if k == len(layout.tiers) - 1 else \
                    int(min(k_new, max(layout.capacity_blocks[k] - table.tier_bytes[int(t)] / bb, 0)))
                if room <= 0:
                    continue
                table.add_region(pid=0, start=first * bb, length=room * bb, block_bytes=bb, node=k, tier=t)
                first += room
                k_new -= room
                if k_new == 0:
                    break
            new_pos = np.flatnonzero(idx >= allocated)
            allocated = top
            fresh = idx[new_pos]
            in_fast = table.tier[fresh] == int(layout.tiers[0])
            fast_since[fresh[in_fast]] = lo + new_pos[in_fast]
        tiers = lut[table.tier[idx]]
        served[lo:hi] = tiers
        p = prev[lo:hi]
        hit[lo:hi] = (tiers == 0) & (p >= 0) & (fast_since[idx] <= p)
        now_ms = int((int(acc.window[lo]) + 1) * acc.tick_ms)
        table.ingest_blocks(idx, acc.count[lo:hi], now_ms, positional=acc.positional[lo:hi],
                            sharers=acc.sharers[lo:hi])
        plan = policy.tick(table, now_ms=now_ms)
        if len(plan.blocks):
            apply_plan(table, plan)
            moved += plan.total_moved_bytes
            up = plan.blocks[plan.to_tier == int(layout.tiers[0])]
            fast_since[up] = hi
        if progress is not None:
            progress(hi - lo)
    return Outcome(served, hit, moved)


def run_policy(name: str, acc: Accesses, layout: Layout, heat: HeatConfig | None = None,
               policy_cfg: PolicyConfig | None = None, progress=None) -> Outcome:
    if name == "tieringd":
        return run_tieringd(acc, layout, heat or HeatConfig(), policy_cfg or PolicyConfig(), progress)
    if name not in _CLASSICAL:
        raise ValueError(f"unknown policy {name!r}: one of {', '.join(POLICIES)}")
    return _demand(acc, layout, _CLASSICAL[name], progress)
