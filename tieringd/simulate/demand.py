# SPDX-License-Identifier: Apache-2.0
"""The references: demand caches of the fast tier (LRU, LFU, ARC: caches.py), static first-fit, and
Belady's MIN, each run over the stream a window at a time.

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

import numpy as np

from tieringd.simulate.caches import DEMAND
from tieringd.simulate.expand import Accesses
from tieringd.simulate.layout import Layout, Tally
from tieringd.simulate.stream import WindowAccesses


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


class DemandRun:
    """A demand cache (or first-fit) in the read path: ``cache`` decides admission and eviction."""

    def __init__(self, name: str, acc: Accesses, layout: Layout, record: bool = False):
        self.name = name
        self.cache = DEMAND[name](int(layout.capacity_blocks[0]))
        self.slow = _Slow(layout)
        self.where = [-1] * acc.nblocks      # −1: not allocated yet; 0: fast; k: slower tier k
        self.tally = Tally(len(layout.tiers), record)

    def window(self, acc: WindowAccesses, first: np.ndarray) -> None:
        cache, slow, wl = self.cache, self.slow, self.where
        served = bytearray(len(acc.block))
        moved = 0
        for i, b in enumerate(acc.block.tolist()):
            loc = wl[b]
            if loc == 0:
                cache.touch(b, 0)
                continue
            victims = cache.admit(b, 0, loc < 0)
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
        tier = np.frombuffer(served, np.int8)
        self.tally.add(tier, (tier == 0) & ~first, acc.count)    # in the fast tier since its last access
        self.tally.moved_blocks += moved


class BeladyRun:
    """MIN with bypass: keep the blocks used soonest; a block used later than all cached ones is not
    admitted. Optimal for the hit definition above (uniform block sizes).

    The cached blocks wait in a heap by next use, farthest first (ties: the lower block first); an
    entry whose block was used again since, or has left, is stale and skipped when it comes up, and
    the heap is rebuilt from its live entries when stale ones outnumber them, so it stays within a
    few times the capacity. A heap entry is one integer: (stream length − next use) · 2^32 + block."""

    def __init__(self, name: str, acc: Accesses, layout: Layout, record: bool = False):
        self.name = name
        self.cap = int(layout.capacity_blocks[0])
        self.slow = _Slow(layout)
        self.where = [-1] * acc.nblocks
        self.next_of = [-1] * acc.nblocks          # per cached block: its next use (−1: not cached)
        self.size = 0
        self.heap: list[int] = []
        self.far = len(acc)                         # "no next use"
        if acc.nblocks >= 1 << 32:
            raise ValueError("Belady's heap keys hold block numbers below 2^32")
        self.tally = Tally(len(layout.tiers), record)

    def _compact(self) -> None:
        far, next_of = self.far, self.next_of
        self.heap = [k for k in self.heap if next_of[k & 0xFFFFFFFF] == far - (k >> 32)]
        heapq.heapify(self.heap)

    def window(self, acc: WindowAccesses, first: np.ndarray) -> None:
        wl, next_of, slow, far, push, pop = self.where, self.next_of, self.slow, self.far, heapq.heappush, heapq.heappop
        heap, cap, size = self.heap, self.cap, self.size
        served = bytearray(len(acc.block))
        moved = 0
        for i, (b, nu) in enumerate(zip(acc.block.tolist(), acc.next_use.tolist())):
            loc = wl[b]
            if loc == 0:                                       # a hit
                next_of[b] = nu
                push(heap, ((far - nu) << 32) | b)
                continue
            if cap <= 0:
                if loc < 0:
                    loc = wl[b] = slow.place()
                served[i] = loc
                continue
            if size >= cap:
                key = heap[0]                                  # the cached block used last …
                v, v_nu = key & 0xFFFFFFFF, far - (key >> 32)
                while next_of[v] != v_nu:                     # … once stale entries are dropped
                    pop(heap)
                    key = heap[0]
                    v, v_nu = key & 0xFFFFFFFF, far - (key >> 32)
                if nu >= v_nu:                                 # used later than every cached block
                    if loc < 0:
                        loc = wl[b] = slow.place()
                    served[i] = loc
                    continue
                pop(heap)
                next_of[v] = -1
                wl[v] = slow.place()
                moved += 1
                size -= 1
            if loc > 0:
                slow.release(loc)
                served[i] = loc
                moved += 1
            wl[b] = 0
            next_of[b] = nu
            push(heap, ((far - nu) << 32) | b)
            size += 1
        self.size = size
        if len(heap) > 4 * self.size + 4096:
            self._compact()
        tier = np.frombuffer(served, np.int8)
        self.tally.add(tier, (tier == 0) & ~first, acc.count)
        self.tally.moved_blocks += moved
