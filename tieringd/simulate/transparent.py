# SPDX-License-Identifier: Apache-2.0
"""Transparent policies: they learn of accesses from samples and move blocks at their tick, under the
same mover and the same view of the accesses (model.py) — tieringd's own policy and the kernel-side
forms of LRU, ARC and LFU. One harness (:class:`TransparentRun`) serves every access from where its
block is, counts hits, feeds each policy what it would have seen, and carries out the moves it plans,
one window of the stream at a time.

- :class:`TieringdPlanner`: the real ``tieringd.placement.policy.Policy`` on a real ``BlockTable``.
- :class:`ShadowPlanner`: a demand cache (demand.py's classes) run as a *shadow* on the observed
  accesses decides which blocks the fast tier should hold; at each tick the fast tier moves toward
  that set, most recently used first, within the mover's budget. It keeps the same headroom as
  tieringd (the fast tier fills to the low watermark; what is there stays up to the high one; above it
  the least recently used leave, down to the low one), so the two differ in their ranking only.

New blocks are allocated first fit, fastest tier first (the kernel places new pages on DRAM while it
has free memory), the same for every policy.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Protocol

import numpy as np

from tieringd.contracts import Tier
from tieringd.placement.heat import BlockTable, HeatConfig
from tieringd.placement.plan import TierSpec
from tieringd.placement.policy import Policy, PolicyConfig
from tieringd.simulate.caches import RecencyShadow
from tieringd.simulate.expand import Accesses
from tieringd.simulate.layout import Layout, Tally
from tieringd.simulate.model import Delivery, TransparentModel
from tieringd.simulate.stream import WindowAccesses

_NEVER = np.iinfo(np.int64).max


class Memory:
    """Where every block is (tier index; −1 before its allocation), blocks per tier, and since which
    access each block has been in the fast tier (for hits)."""

    def __init__(self, nblocks: int, layout: Layout):
        self.layout = layout
        self.cap = np.array(layout.capacity_blocks, np.float64)
        self.where = np.full(nblocks, -1, np.int8)
        self.fast_since = np.full(nblocks, _NEVER, np.int64)
        self.used = np.zeros(len(layout.tiers), np.int64)
        self.allocated = 0

    def allocate(self, count: int) -> np.ndarray:
        """Blocks allocated..allocated+count, first fit; returns their tier indices."""
        tiers = np.empty(count, np.int8)
        done = 0
        for k in range(len(self.cap)):
            room = count - done if k == len(self.cap) - 1 else \
                int(min(count - done, max(self.cap[k] - self.used[k], 0)))
            tiers[done:done + room] = k
            self.used[k] += room
            done += room
            if done == count:
                break
        self.where[self.allocated:self.allocated + count] = tiers
        self.allocated += count
        return tiers

    def move(self, blocks: np.ndarray, to: np.ndarray, at_access: int) -> None:
        """Carry out moves; blocks moved into the fast tier count as there from ``at_access`` on."""
        if len(blocks) == 0:
            return
        frm = self.where[blocks]
        self.used -= np.bincount(frm, minlength=len(self.cap))
        self.used += np.bincount(to, minlength=len(self.cap))
        self.where[blocks] = to
        self.fast_since[blocks[to == 0]] = at_access
        self.fast_since[blocks[(to != 0) & (frm == 0)]] = _NEVER
        if (self.used > self.cap).any():
            raise AssertionError(f"a policy overfilled a tier: {self.used} > {self.cap}")


class Planner(Protocol):
    def allocated(self, first: int, tiers: np.ndarray, now_ms: int) -> None: ...
    def observe(self, seen: Delivery, now_ms: int) -> None: ...
    def plan(self, budget_bytes: float, now_ms: int) -> tuple[np.ndarray, np.ndarray]: ...
    def moved(self, blocks: np.ndarray, to: np.ndarray, now_ms: int) -> None: ...


class TransparentRun:
    """One transparent policy over the stream, a window at a time: allocate the window's new blocks,
    serve its accesses, deliver what the policy sees, tick, move. Moves planned at the end of window w
    serve window w + 1."""

    def __init__(self, name: str, acc: Accesses, layout: Layout, planner_factory: Callable[[Memory], Planner],
                 model: TransparentModel, record: bool = False):
        self.name = name
        self.mem = Memory(acc.nblocks, layout)
        self.planner = planner_factory(self.mem)
        self.budget = model.budget_bytes(acc.tick_ms)
        self.tick_ms = acc.tick_ms
        self.tally = Tally(len(layout.tiers), record)

    def window(self, acc: WindowAccesses, prev: np.ndarray, seen: Delivery) -> None:
        mem, planner = self.mem, self.planner
        now_ms = int((acc.window + 1) * self.tick_ms)
        idx = acc.block
        top = int(idx.max()) + 1
        if top > mem.allocated:                    # new blocks, in order of their first access
            first = mem.allocated
            tiers = mem.allocate(top - first)
            fresh = np.flatnonzero(idx >= first)
            in_fast = fresh[tiers[idx[fresh] - first] == 0]
            mem.fast_since[idx[in_fast]] = acc.lo + in_fast
            planner.allocated(first, tiers, now_ms)
        where = mem.where[idx]
        self.tally.add(where, (where == 0) & (prev >= 0) & (mem.fast_since[idx] <= prev), acc.count)
        if len(seen):
            planner.observe(seen, now_ms)
        blocks, to = planner.plan(self.budget, now_ms)
        if len(blocks):
            mem.move(blocks, to, acc.hi)
            planner.moved(blocks, to, now_ms)
            self.tally.moved_blocks += len(blocks)


class TieringdPlanner:
    """The real policy on a real block table. Its interval is the simulator's tick; the mover's rate is
    the model's (as the daemon takes the rate its mover measured), and a configured
    ``migration_rate_mb_s`` may only ask for less."""

    def __init__(self, acc: Accesses, layout: Layout, heat: HeatConfig, cfg: PolicyConfig,
                 model: TransparentModel, mem: Memory):
        self.layout, self.mem = layout, mem
        self.block_bytes, self.tick_ms = acc.block_bytes, acc.tick_ms
        bb = acc.block_bytes
        cfg = dataclasses.replace(cfg, interval_ms=acc.tick_ms)         # one tick per window
        caps = [c * bb if math.isfinite(c) else 1e30 for c in layout.capacity_blocks]
        self.policy = Policy(cfg, [TierSpec(t, (k,), caps[k]) for k, t in enumerate(layout.tiers)])
        self.policy.note_mover_rate(model.mover_bytes_s)
        self.table = BlockTable(heat, capacity=max(acc.nblocks, 16), epoch_ns=0)
        self.lut = np.zeros(len(Tier), np.int8)
        for k, t in enumerate(layout.tiers):
            self.lut[int(t)] = k
        self.tier_values = np.array([int(t) for t in layout.tiers], np.int8)

    def allocated(self, first: int, tiers: np.ndarray, now_ms: int) -> None:
        """One region per run of blocks allocated on one tier (rows are block ids)."""
        bb = self.block_bytes
        runs = np.flatnonzero(np.diff(tiers)) + 1
        for a, b in zip(np.concatenate([[0], runs]), np.concatenate([runs, [len(tiers)]])):
            k = int(tiers[a])
            self.table.add_region(pid=0, start=(first + int(a)) * bb, length=int(b - a) * bb, block_bytes=bb,
                                  node=k, tier=self.layout.tiers[k])

    def observe(self, seen: Delivery, now_ms) -> None:
        # the window's end: the daemon floors sample times to its tick as well (BlockTable.ingest)
        t_ms = (seen.window + 1) * int(self.tick_ms)
        self.table.ingest_blocks(seen.block, seen.count, t_ms, positional=seen.positional,
                                 sharers=seen.sharers, seen_ms=now_ms)

    def plan(self, budget_bytes, now_ms):
        budget = min(budget_bytes, self.policy.budget_bytes)
        plan = self.policy.tick(self.table, now_ms=now_ms, budget_bytes=budget)
        return plan.blocks, self.lut[plan.to_tier]

    def moved(self, blocks, to, now_ms) -> None:
        self.table.set_location(blocks, to.astype(np.int16), self.tier_values[to], now_ms=now_ms)


class ShadowPlanner:
    """A demand cache of ``low_watermark × capacity`` blocks fed with the observed accesses says what
    the fast tier should hold; the tick moves toward it (see the module doc)."""

    def __init__(self, cache_cls, acc: Accesses, layout: Layout, cfg: PolicyConfig, mem: Memory):
        cap = float(layout.capacity_blocks[0])
        self.mem = mem
        self.block_bytes = acc.block_bytes
        self.low = int(cfg.low_watermark * cap)
        self.high = int(cfg.high_watermark * cap)
        self.reserve = cfg.demotion_reserve
        self.last = np.full(acc.nblocks, -1, np.int64)   # block → its latest observed read (recency order)
        self.cache = cache_cls(self.low, self.last)
        self.want_in: set[int] = set()              # in the shadow, not in the fast tier
        self.want_out: set[int] = set()             # in the fast tier, not in the shadow
        self.clock = 0

    def allocated(self, first, tiers, now_ms) -> None:
        pass                                         # the first access is observed in its own window

    def observe(self, seen: Delivery, now_ms) -> None:
        where = self.mem.where
        # reads of one window carry no order (a decode batch reads every active sequence at the same
        # step): feed them in block order — blocks already in the fast tier last, so that, as in
        # tieringd's fill, an incumbent wins a tie, then the newer block
        blocks = seen.block[np.lexsort((seen.block, where[seen.block] == 0, seen.window))]
        unique = seen.window[0] == seen.window[-1]          # one window's reads: each block once
        if unique:
            self.last[blocks] = np.arange(self.clock + 1, self.clock + 1 + len(blocks))
        else:
            once, at = np.unique(blocks[::-1], return_index=True)  # a block read twice: its later read
            self.last[once] = self.clock + len(blocks) - at
        self.clock += len(blocks)
        if isinstance(self.cache, RecencyShadow):
            changed, inside = self.cache.feed(blocks, unique)
        else:
            events = self.cache.feed(blocks)
            changed = np.fromiter(events.keys(), np.int64, len(events))
            inside = np.fromiter(events.values(), bool, len(events))
        if len(changed) == 0:
            return
        # what the fast tier should gain and lose follows from where the shadow ended, whatever
        # happened to a block within the batch
        fast = where[changed] == 0
        self.want_in.update(changed[inside & ~fast].tolist())
        self.want_in.difference_update(changed[~inside & ~fast].tolist())
        self.want_out.update(changed[~inside & fast].tolist())
        self.want_out.difference_update(changed[inside & fast].tolist())

    def _by_recency(self, blocks: set[int], newest_first: bool) -> list[int]:
        a = np.fromiter(blocks, np.int64, len(blocks))
        order = np.argsort(self.last[a])
        return a[order[::-1] if newest_first else order].tolist()

    def plan(self, budget_bytes, now_ms):
        mem = self.mem
        budget = int(budget_bytes // self.block_bytes)
        if budget <= 0 or not (self.want_in or (mem.used[0] > self.high and self.want_out)):
            return np.zeros(0, np.int64), np.zeros(0, np.int8)
        ins = self._by_recency(self.want_in, newest_first=True)
        outs = self._by_recency(self.want_out, newest_first=False)
        used = mem.used.astype(np.float64)
        pressure = used[0] > self.high
        reserve = int(self.reserve * budget) if pressure and outs else 0
        left = budget - reserve
        blocks, to = [], []
        o = 0

        def demote() -> None:
            nonlocal o
            v = outs[o]
            o += 1
            k = next(k for k in range(1, len(used)) if used[k] < mem.cap[k] or k == len(used) - 1)
            used[0] -= 1
            used[k] += 1
            blocks.append(v)
            to.append(k)

        room = mem.cap[0] - used[0]          # promotions run first: inflow never exceeds the room there was
        for b in ins:
            if left <= 0 or room < 1:
                break
            if used[0] < self.high:
                left -= 1
            elif o < len(outs) and left >= 2:
                demote()
                left -= 2
            else:
                break
            room -= 1
            used[mem.where[b]] -= 1
            used[0] += 1
            blocks.append(b)
            to.append(0)
        left += reserve
        while pressure and used[0] > self.low and o < len(outs) and left > 0:
            demote()
            left -= 1
        return np.array(blocks, np.int64), np.array(to, np.int8)

    def moved(self, blocks, to, now_ms) -> None:
        for b, k in zip(blocks.tolist(), to.tolist()):
            (self.want_in if k == 0 else self.want_out).discard(b)
