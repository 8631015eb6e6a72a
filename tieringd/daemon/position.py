# SPDX-License-Identifier: Apache-2.0
"""Which regions hold one sequence's KV in token order, and where their decode frontier is: the heat
model's position factor, fed from what the fault sampler sees written (docs/heat-policy.md,
*Position*).

The position factor, ``2^(−d / position_half_life_tokens)`` with ``d`` the tokens between a block and
its region's decode frontier, holds only for a region laid out in token order — token t's KV at
offset t × bytes-per-token, as in llama.cpp's K and V buffers of one sequence. Nothing the shim sees
at allocation says which layout a region has, so it is read from the writes: every fault's error code
says whether a write took it (bpf/pagefault.bpf.c), and the sampler hands the write counts out beside
its rows (``SamplerSet.last_writes``). Per region and sampling interval, the blocks written form
*places* (runs of written blocks with at most GAP_BLOCKS unwritten between them):

- **token order**: the writes stay in one place and do not go back — a decoder appends where it
  stopped; its frontier is the highest block written. A jump back once in a while is a new sequence
  in the same buffer (a server reusing its slot) and the frontier follows it.
- **pooled** (vLLM's block pool, a batch in one buffer): several sequences append at once, each in a
  block of its own anywhere in the pool: writes in several places in one interval, or one place
  jumping back and forth. Block index says nothing about position there: the factor stays off.

Reads do not decide it: both layouts read the blocks behind wherever they write, and a decoder may
read past its frontier (llama.cpp pads the cells it attends to up to 256). A region is called token
order after MIN_WRITTEN written intervals with the writes in one place and advancing; it turns off
when its last WINDOW written intervals show writes in POOLED_PLACES places or more, or more than
MAX_STRAYS with writes behind the frontier; it turns back on once those have left the window.

A region written whole within FILL_INTERVALS intervals is being cleared (llama.cpp zeroes its KV
buffer before the prompt): that says nothing of its layout, and the order its first-touch faults come
out in is the sampler's map order across reads, not the addresses'. So a fill forgets the evidence and
the frontier; the prefill after it writes populated pages without a fault, and the frontier is known
again from the decoder's first hint fault.

Regions whose layout is not token order keep a positional factor of 0; ``describe`` says per region
which case holds and why (``tieringctl status``, ``tieringctl regions --json``).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time

import numpy as np

from tieringd.contracts import RegionKey

log = logging.getLogger("tieringd.daemon")

GAP_BLOCKS = 2          # written blocks this close are one place: a write between them went unseen
BACK_SLACK_BLOCKS = 2   # a token straddles blocks, and the frontier's block is written again
POOLED_PLACES = 3       # writes in this many places in one interval: a pooled layout
WINDOW = 8              # written intervals remembered per region
MIN_WRITTEN = 3         # written intervals, all consistent, before a region is called token order
MAX_STRAYS = 1          # intervals of the window with writes behind the frontier (a new sequence)
FILL_INTERVALS = WINDOW # a region written whole within this many written intervals is being cleared
LOG_EVERY_S = 60.0      # an unexpected error in this module is logged at most this often


@dataclasses.dataclass(frozen=True)
class Observation:
    """One sampling interval in which a region was written."""
    places: int         # runs of written blocks (GAP_BLOCKS apart at most)
    top: int            # the highest block written
    stray: bool         # writes behind the frontier: a second place, or a jump back


def places_of(written: np.ndarray) -> int:
    """Runs of sorted, unique block indices with at most GAP_BLOCKS unwritten blocks between them."""
    return len(runs_of(written))


def runs_of(written: np.ndarray) -> list[tuple[int, int]]:
    """The places of sorted, unique block indices: (first, last) of each run."""
    if len(written) == 0:
        return []
    cut = np.flatnonzero(np.diff(written) > GAP_BLOCKS + 1)
    firsts = np.concatenate([[0], cut + 1])
    lasts = np.concatenate([cut, [len(written) - 1]])
    return [(int(written[a]), int(written[b])) for a, b in zip(firsts, lasts)]


class Layout:
    """One region's evidence, from the blocks written per interval (pure logic, no table)."""

    def __init__(self, blocks: int | None = None) -> None:
        self.blocks = blocks            # the region's blocks; None: unknown (no fill is recognised)
        self.window: collections.deque[Observation] = collections.deque(maxlen=WINDOW)
        self.frontier = -1              # the highest block written (local index), -1 before any
        self.written_intervals = 0
        self.advanced = False           # the frontier has moved forward at least once
        self.last_runs: list[tuple[int, int]] = []     # the latest written interval's places
        self.filled = False             # the latest evidence was forgotten for a fill
        self._recent: collections.deque[np.ndarray] = collections.deque(maxlen=FILL_INTERVALS)

    def note(self, written: np.ndarray) -> None:
        """One interval's written blocks (local indices, any order, duplicates allowed)."""
        written = np.unique(np.asarray(written, np.int64))
        if len(written) == 0:
            return
        runs = self.last_runs = runs_of(written)
        self.written_intervals += 1
        if self._fill(written):
            return
        top = runs[-1][1]
        if self.frontier >= 0:
            behind = [b for _, b in runs if b < self.frontier - BACK_SLACK_BLOCKS]
            if behind and len(runs) - len(behind) <= 1:
                # one place behind the frontier, beside at most the frontier's own: a new sequence
                # from the start of the buffer (the old one's last writes may share its interval)
                top = behind[-1]
        back = self.frontier >= 0 and top < self.frontier - BACK_SLACK_BLOCKS
        self.window.append(Observation(len(runs), top, len(runs) > 1 or back))
        if back:
            self.frontier = top
        elif top > self.frontier:
            self.advanced |= self.frontier >= 0
            self.frontier = top

    def _fill(self, written: np.ndarray) -> bool:
        """Whether the recent intervals, this one's ``written`` with them, wrote the whole region: then
        the layout's evidence and frontier are forgotten (a clear is no decoder)."""
        self.filled = False
        if not self.blocks:
            return False
        self._recent.append(written)
        seen = np.unique(np.concatenate(list(self._recent)))
        if np.count_nonzero((seen >= 0) & (seen < self.blocks)) < self.blocks:
            return False
        self._recent.clear()
        self.window.clear()
        self.frontier, self.advanced, self.filled = -1, False, True
        return True

    @property
    def state(self) -> str:
        """"unseen", "learning", "on" or "off"."""
        return self.verdict()[0]

    def verdict(self) -> tuple[str, str]:
        """(state, why) — why in words for ``tieringctl status``."""
        if not self.written_intervals:
            return "unseen", "not seen written yet"
        if self.filled:
            return "learning", "written whole (cleared): waiting for the decoder's writes"
        places = max(o.places for o in self.window)
        if places >= POOLED_PLACES:
            return "off", f"writes in {places} places (pooled layout)"
        strays = sum(o.stray for o in self.window)
        if strays > MAX_STRAYS:
            return "off", (f"writes behind the frontier in {strays} of the last {len(self.window)} "
                           f"written intervals (not token order)")
        if len(self.window) < MIN_WRITTEN:
            return "learning", f"written in {len(self.window)} interval(s), {MIN_WRITTEN} needed"
        if not self.advanced:
            return "learning", f"written in one place (block {self.frontier}), not advancing yet"
        return "on", f"frontier block {self.frontier}"


@dataclasses.dataclass
class _Region:
    identity: tuple                 # what the book registered: a new registration starts afresh
    layout: Layout
    applied: int = -1               # the frontier the table has, -1: none (positional 0)
    state: str = "unseen"           # the verdict last logged


class Positions:
    """Per region of the book: its layout and, for token order, its frontier in the block table.
    ``observe`` runs once per sampler read in the daemon's loop; ``describe`` answers reports."""

    def __init__(self) -> None:
        self._regions: dict[RegionKey, _Region] = {}
        self.tells_writes: bool | None = None   # None: no read yet
        self._half_life: float | None = None
        self._logged_at = -LOG_EVERY_S

    def observe(self, deltas: np.ndarray, samplers, book) -> None:
        """One read of ``samplers`` (its ``last_writes`` beside ``deltas``, ACCESS_DELTA_DTYPE rows)
        for the regions of ``book``; sets or clears their frontier in ``book.table``. Never raises:
        the factor is one part of the heat, and the loop must go on without it."""
        try:
            self._observe(deltas, samplers, book)
        except Exception:
            now = time.monotonic()
            if now - self._logged_at >= LOG_EVERY_S:
                self._logged_at = now
                log.exception("position: the write signal could not be read this interval")

    def _observe(self, deltas: np.ndarray, samplers, book) -> None:
        table = book.table
        self.tells_writes = bool(getattr(samplers, "tells_writes", False))
        self._forget_gone(book)
        if self._half_life != table.heat_cfg.position_half_life_tokens:
            self._half_life = table.heat_cfg.position_half_life_tokens
            for r in self._regions.values():
                r.applied = -2          # the factor's values change with the half-life: set again
        writes = getattr(samplers, "last_writes", None)
        if self.tells_writes and writes is not None and len(writes) == len(deltas) and len(deltas):
            rows = deltas[np.asarray(writes) > 0]
            if len(rows):
                self._note(table, book, rows)
        for key, r in self._regions.items():
            self._apply(table, key, r)

    def _note(self, table, book, rows: np.ndarray) -> None:
        """Written rows → the written blocks of each region, noted as one interval."""
        _, blocks = table.locate(rows["pid"], rows["block_start"], np.ones(len(rows), np.uint64))
        if len(blocks) == 0:
            return
        rid = table.region[blocks].astype(np.int64)
        local = blocks - table.r_first[rid]
        for r in np.unique(rid).tolist():
            key = table.region_key(r)
            state = self._region(key, book)
            if state is not None:
                state.layout.note(local[rid == r])
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("pid %d region %#x: blocks written %s", key.pid, key.start,
                              state.layout.last_runs)

    def _region(self, key: RegionKey, book) -> _Region | None:
        """The state of a region of the book, a fresh one for a region registered anew."""
        br = book.get(*key)
        if br is None:
            return None
        identity = (br.registered_ns, br.length, br.block_bytes)
        state = self._regions.get(key)
        if state is None or state.identity != identity:
            state = self._regions[key] = _Region(identity, Layout(br.nblocks))
        return state

    def _apply(self, table, key: RegionKey, r: _Region) -> None:
        """The table's frontier of the region as its layout says: set where token order holds and it
        moved, cleared (positional 0) where it stopped holding."""
        state, why = r.layout.verdict()
        if state != r.state:
            r.state = state
            log.info("pid %d region %#x: position %s: %s (blocks written in the latest interval: %s)",
                     key.pid, key.start, state, why,
                     ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in r.layout.last_runs[:8])
                     + (", …" if len(r.layout.last_runs) > 8 else ""))
        want = r.layout.frontier if state == "on" else -1
        if want == r.applied:
            return
        rid = table.region_id(key)
        if rid is None:
            return
        if want >= 0:
            table.set_frontier(rid, want)
        else:
            table.clear_frontier(rid)
        r.applied = want

    def _forget_gone(self, book) -> None:
        for key in [k for k in self._regions if book.get(*k) is None]:
            del self._regions[key]

    # ---- reports ---------------------------------------------------------------------------------
    def describe(self, key: RegionKey | tuple[int, int]) -> dict:
        """The position factor of one region, for reports: ``state`` (on, off, learning, unseen),
        ``frontier_block`` (when on), ``why`` and ``text`` ("position: on, frontier block 37")."""
        key = RegionKey(int(key[0]), int(key[1]))
        r = self._regions.get(key)
        if self.tells_writes is False:
            state, why = "off", "no running sampler tells writes (the fault sampler does)"
        elif r is None:
            state, why = "unseen", "not seen written yet"
        else:
            state, why = r.layout.verdict()
        frontier = r.layout.frontier if r is not None and state == "on" else None
        text = "position: " + (f"on, {why}" if state == "on" else f"off — {why}" if state == "off"
                               else f"learning — {why}" if state == "learning" else why)
        return {"state": state, "frontier_block": frontier, "why": why, "text": text,
                "written_intervals": r.layout.written_intervals if r is not None else 0}
