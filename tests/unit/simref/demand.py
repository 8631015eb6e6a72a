# SPDX-License-Identifier: Apache-2.0
"""The references: demand caches of the fast tier (LRU, LFU, ARC), static first-fit, and Belady's MIN.

A demand cache sits in the read path: a miss moves the block into the fast tier at the access itself,
with no budget and no delay, and the victim goes to the first slower tier with room. No tiering
daemon can do that (it learns of accesses from samples and moves at its tick: see transparent.py),
so these are labelled references; their *transparent* forms use the same cache classes as a shadow
that only decides what the fast tier should hold (``ShadowPlanner``).

Hit: an access is a *hit* when its block has stayed in the fast tier since the block's previous access
(the first access of a block is never a hit). That is the quantity Belady's MIN maximises over every
policy that keeps at most ``capacity`` blocks in the fast tier — including ones that move blocks ahead
of use — so MIN (with bypass: a block whose next use is further than every cached block's is not
admitted) is a true upper bound. Accesses served from the fast tier because a block was moved there
ahead of use show up in the per-tier shares, not as hits.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Callable

import numpy as np

from simref.expand import Accesses
from simref.layout import Layout, Outcome


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

    def __contains__(self, b):
        return b in self.d

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

    def __contains__(self, b):
        return b in self.freq

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

    def __contains__(self, b):
        return b in self.t1 or b in self.t2

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


CACHES = {"lru": _LRU, "lfu": _LFU, "arc": _ARC}
REFERENCES = {"demand-lru": _LRU, "demand-lfu": _LFU, "demand-arc": _ARC, "first-fit": _FirstFit,
              "belady": _Belady}


def run_reference(name: str, acc: Accesses, layout: Layout, progress=None) -> Outcome:
    return _demand(acc, layout, REFERENCES[name], progress)
