# SPDX-License-Identifier: Apache-2.0
"""The classical caches the simulator compares with: LRU, LFU and ARC (and static first-fit).

Each one decides, read by read, which blocks a cache of ``cap`` blocks holds: ``touch`` a block it
holds, ``admit`` one it does not (the victims it evicts, or None when it declines). demand.py runs them
in the read path (the demand caches); transparent.py runs them as *shadows* that say what the fast
tier should hold, fed a window's observed reads at a time (``feed``).

:class:`RecencyShadow` is LRU for the shadow, a window at a time: after a batch of reads an LRU cache
holds the ``cap`` most recently read blocks, whatever happened within the batch, so the batch is a few
vectorised passes instead of a Python step per read — the same blocks, and the shadow runs over every
observed read of a trace of a hundred million.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np


class _ReadByRead:
    """``feed`` for a cache that decides read by read."""

    def feed(self, blocks: np.ndarray) -> dict[int, bool]:
        """Reads in order; returns the blocks that were let in or evicted, each with whether it is in
        the cache after the batch (its last event)."""
        inside: dict[int, bool] = {}
        for b in blocks.tolist():
            if b in self:
                self.touch(b, 0)
                continue
            victims = self.admit(b, 0, False)
            if victims is not None:
                for v in victims:
                    inside[v] = False
                inside[b] = True
        return inside


class LRU(_ReadByRead):
    def __init__(self, cap, last=None):
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


class LFU(_ReadByRead):
    """In-cache frequency, least-recently-used among equals."""

    def __init__(self, cap, last=None):
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


class ARC(_ReadByRead):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST'03): T1/T2 cached, B1/B2 ghosts."""

    def __init__(self, cap, last=None):
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

    def feed(self, blocks: np.ndarray) -> dict[int, bool]:
        """As _ReadByRead.feed, with ``touch``, ``admit`` and ``_replace`` inlined: the shadow feeds
        ARC every observed read of a trace (over a hundred million in a coding agent's), most of them
        misses when the fast tier is small, and a Python call per read is most of their cost."""
        t1, t2, b1, b2 = self.t1, self.t2, self.b1, self.b2
        c, p = self.c, self.p
        inside: dict[int, bool] = {}             # block → whether its last admission or eviction let it in
        if c <= 0:
            return inside                     # admits nothing: holds nothing, so every read misses
        pop1, pop2, move2 = t1.popitem, t2.popitem, t2.move_to_end
        for b in blocks.tolist():
            if b in t2:
                move2(b)
                continue
            if b in t1:
                del t1[b]
                t2[b] = None
                continue
            if b in b1:
                p = min(c, p + max(len(b2) / len(b1), 1))
                if t1 and len(t1) > p:
                    v = pop1(last=False)[0]
                    b1[v] = None
                else:
                    v = pop2(last=False)[0]
                    b2[v] = None
                del b1[b]
                t2[b] = None
            elif b in b2:
                p = max(0.0, p - max(len(b1) / len(b2), 1))
                if t1 and (len(t1) == p or len(t1) > p):
                    v = pop1(last=False)[0]
                    b1[v] = None
                else:
                    v = pop2(last=False)[0]
                    b2[v] = None
                del b2[b]
                t2[b] = None
            else:
                n1 = len(t1)
                l1 = n1 + len(b1)
                v = -1
                if l1 >= c:
                    if n1 < c:
                        b1.popitem(last=False)
                        if t1 and n1 > p:
                            v = pop1(last=False)[0]
                            b1[v] = None
                        else:
                            v = pop2(last=False)[0]
                            b2[v] = None
                    else:
                        v = pop1(last=False)[0]
                elif l1 + len(t2) + len(b2) >= c:
                    if l1 + len(t2) + len(b2) >= 2 * c:
                        b2.popitem(last=False)
                    if n1 + len(t2) >= c:
                        if t1 and n1 > p:
                            v = pop1(last=False)[0]
                            b1[v] = None
                        else:
                            v = pop2(last=False)[0]
                            b2[v] = None
                t1[b] = None
                if v < 0:
                    inside[b] = True
                    continue
            inside[v] = False
            inside[b] = True
        self.p = p
        return inside

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


class FirstFit:
    """Static placement: a new block goes to the fast tier while it has room; nothing ever moves."""

    def __init__(self, cap, last=None):
        self.cap, self.n = cap, 0

    def touch(self, b, i):
        pass

    def admit(self, b, i, new):
        if new and self.n < self.cap:
            self.n += 1
            return []
        return None


class RecencyShadow:
    """LRU of ``cap`` blocks fed a batch of reads at a time. ``last``: every block's latest read (a
    clock, unique per read; the caller stamps a batch before feeding it). After a batch the cache holds
    the ``cap`` blocks read last: the batch's own blocks and, for the room they leave, the previous
    holders read most recently. The blocks in the order they were stamped wait in a queue; a queue
    entry whose block was read again since, or has left, is skipped when the oldest are evicted."""

    def __init__(self, cap: int, last: np.ndarray):
        self.cap = cap
        self.last = last
        self.inside = np.zeros(len(last), bool)
        self.size = 0
        self.queue = np.zeros(1024, np.int64)     # blocks, oldest stamp first, from ``head`` to ``tail``
        self.stamps = np.zeros(1024, np.int64)
        self.head = self.tail = 0

    def _append(self, blocks: np.ndarray) -> None:
        n = len(blocks)
        if self.tail + n > len(self.queue):
            live = slice(self.head, self.tail)
            valid = self.inside[self.queue[live]] & (self.last[self.queue[live]] == self.stamps[live])
            keep_b, keep_s = self.queue[live][valid], self.stamps[live][valid]
            size = max(2 * (len(keep_b) + n), 1024)
            self.queue, self.stamps = np.zeros(size, np.int64), np.zeros(size, np.int64)
            self.queue[:len(keep_b)], self.stamps[:len(keep_b)] = keep_b, keep_s
            self.head, self.tail = 0, len(keep_b)
        self.queue[self.tail:self.tail + n] = blocks
        self.stamps[self.tail:self.tail + n] = self.last[blocks]
        self.tail += n

    def _evict_oldest(self, k: int) -> np.ndarray:
        out = []
        while k > 0:
            m = min(max(2 * k, 256), self.tail - self.head)
            b = self.queue[self.head:self.head + m]
            valid = np.flatnonzero(self.inside[b] & (self.last[b] == self.stamps[self.head:self.head + m]))
            if len(valid) >= k:
                out.append(b[valid[:k]])
                self.head += int(valid[k - 1]) + 1
                break
            out.append(b[valid])
            self.head += m
            k -= len(valid)
        gone = np.concatenate(out)
        self.inside[gone] = False
        return gone

    def feed(self, blocks: np.ndarray, unique: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """A batch of reads (``unique``: no block twice); returns the blocks let in or evicted, and
        whether each is in the cache after the batch."""
        if self.cap <= 0 or len(blocks) == 0:
            return np.zeros(0, np.int64), np.zeros(0, bool)
        if unique:
            batch = blocks
        else:
            once, at = np.unique(blocks[::-1], return_index=True)
            batch = once[np.argsort(-at)]                   # each block once, in the order of its last read
        entering = batch[~self.inside[batch]]
        self.inside[entering] = True
        self.size += len(entering)
        self._append(batch)
        excess = self.size - self.cap
        if excess <= 0:
            return entering, np.ones(len(entering), bool)
        gone = self._evict_oldest(excess)
        self.size -= excess
        changed = np.concatenate([entering, gone])
        return changed, self.inside[changed]


SHADOWS = {"lru": RecencyShadow, "arc": ARC, "lfu": LFU}
DEMAND = {"demand-lru": LRU, "demand-arc": ARC, "demand-lfu": LFU, "first-fit": FirstFit}
