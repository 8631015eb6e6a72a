# SPDX-License-Identifier: Apache-2.0
"""Admission: which of a plan's moves go to the mover this tick, and what came of those that went.

The plan says where blocks belong; admission decides what is handed over now:

- the **budget** — a tick hands over what keeps ``IN_FLIGHT_S`` of the mover's measured rate in
  flight, at least ``MIN_IN_FLIGHT_BYTES``, at most ``[policy] migration_budget_bytes``
  (:meth:`Admission.budget_bytes`);
- a move is **held back** when it overlaps a move in flight, touches blocks not populated yet, demotes
  a region the signal has not had time to see, or would take its target node's free memory below
  its reserve (:meth:`Admission.submit`, :meth:`Admission.room`);
- **collect** — moves whose request is over leave the in-flight set, their failed pages are counted,
  and the bytes they carried measure the mover's rate (:meth:`Admission.collect`).

The carrier (the migration engine, or the shims' REBIND before 6.5) and the region book are handed in
per call, so admission is tested with stand-ins for both (tests/unit/test_daemon_admission.py).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterable, Protocol

from tieringd.contracts import Move, Priority
from tieringd.daemon.moves import InFlight, MoveStats, ticket_failures
from tieringd.mover import Ticket

RATE_WINDOW_S = 1.0          # the mover's rate is measured over at least this much busy time
# At most this many seconds of the mover's rate in flight, and at least MIN_IN_FLIGHT_BYTES. The
# rate is measured end to end (submitted → finished, seen at a tick), so it includes the loop's own
# latency: with one second of it in flight (16 MiB floor) the lab guest moved 4.5 MB/s where its
# mover alone moves 100+ MB/s (P2) — each round trip of plan → move → landed → next plan took
# ~3 s of ticks under TCG and the budget measured itself down. The engine runs promotions before
# queued demotions, so a longer queue does not hold urgent moves back.
IN_FLIGHT_S = 4.0
MIN_IN_FLIGHT_BYTES = 64 << 20


class Carrier(Protocol):
    """What carries a move out: the migration engine or the shims (``ShimMover``)."""
    def submit(self, move: Move) -> object: ...


class RegionBook(Protocol):
    """What admission asks of the region book (:class:`tieringd.daemon.regions.Book`)."""
    def region_of(self, pid: int, start: int): ...
    def warming_up(self, region, start: int, length: int) -> bool: ...
    def ready_bytes(self, region, start: int, length: int, demote: bool) -> int: ...
    def moving(self, pid: int, start: int, length: int, to_node: int | None) -> None: ...


@dataclasses.dataclass
class MoverRate:
    """Bytes the mover finished per second of time it had work, over windows of RATE_WINDOW_S."""
    busy_s: float = 0.0
    done_bytes: float = 0.0
    bytes_s: float = 0.0

    def note(self, busy_s: float, done_bytes: float) -> float | None:
        self.busy_s += busy_s
        self.done_bytes += done_bytes
        if self.busy_s < RATE_WINDOW_S or self.done_bytes <= 0:
            return None
        sample = self.done_bytes / self.busy_s
        self.bytes_s = sample if not self.bytes_s else 0.5 * sample + 0.5 * self.bytes_s
        self.busy_s = self.done_bytes = 0.0
        return self.bytes_s


class Admission:
    """The in-flight set, the move counters and the mover's rate, and the rules that use them."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.inflight = InFlight()
        self.stats = MoveStats()
        self.held_back_by_reason: dict[str, int] = {}
        self.rate = MoverRate()
        self._collected_at = clock()

    def budget_bytes(self, cap_bytes: float, rate_bytes_s: float = 0.0, elapsed_s: float = 0.0) -> float:
        """This plan's budget: what keeps IN_FLIGHT_S of the mover's measured rate in flight
        (MIN_IN_FLIGHT_BYTES until it is measured, and at least that: a budget below one block
        moves nothing), at most ``cap_bytes`` (``[policy] migration_budget_bytes``). The mover paces
        the plan: a short queue lets the next tick's urgent promotions in, where a long one would
        hold them behind old moves — and a per-tick budget from the rate alone (rate × interval)
        would be smaller than one block on a slow machine (the lab mover: 4-16 MB/s, 0.4-1.6 MB a
        tick). A configured rate (``[policy] migration_rate_mb_s``, ``rate_bytes_s``) holds the plan
        to that rate over the ``elapsed_s`` since the last plan as well."""
        limit = max(self.rate.bytes_s * IN_FLIGHT_S, MIN_IN_FLIGHT_BYTES)
        budget = min(float(cap_bytes), limit - self.inflight.bytes)
        if rate_bytes_s > 0:
            budget = min(budget, rate_bytes_s * max(elapsed_s, 0.0))
        return max(budget, 0.0)

    def submit(self, moves: Iterable[Move], book: RegionBook, carrier: Carrier,
               headroom: Callable[[int], int], slower: Callable[[int], int | None] = lambda node: None) -> int:
        """Hand ``moves`` to ``carrier``, holding back those that overlap a move in flight, touch
        blocks not populated yet, demote a region the signal has not had time to see, or find no
        room on their target node (:meth:`room`; ``headroom(node)``: its free bytes above every
        reserve). A demotion with no room goes to the next slower tier's node instead
        (``slower(node)``, None: none), as the mover falls back within the NUMA tiers: the plan's
        view of a tier's room lags what first-touch allocations take from it. Returns how many went."""
        free: dict[int, int] = {}
        sent = 0
        for m in moves:
            m = self._ready_part(m, book)
            why = self._hold(m, book, free, headroom)
            while why == "no-room" and m.priority == Priority.DEMOTE and slower(m.to_node) is not None:
                m = dataclasses.replace(m, to_node=slower(m.to_node))
                why = "" if self.room(m, free, headroom) else "no-room"
            if why:
                self.stats.held_back += 1
                self.held_back_by_reason[why] = self.held_back_by_reason.get(why, 0) + 1
                continue
            self.inflight.add(m.pid, m.start, m.length, carrier.submit(m), m.to_node)
            book.moving(m.pid, m.start, m.length, m.to_node)
            self.stats.submitted += 1
            self.stats.submitted_bytes += m.length
            name = Priority(m.priority).name.lower()
            self.stats.by_priority[name] = self.stats.by_priority.get(name, 0) + m.length
            sent += 1
        return sent

    @staticmethod
    def _ready_part(m: Move, book: RegionBook) -> Move:
        """``m`` cut to its first blocks that may move now, when its later ones must wait (a pool
        still filling: the newest blocks are unpopulated or warming up); unchanged otherwise."""
        r = book.region_of(m.pid, m.start)
        if r is None:
            return m
        ready = book.ready_bytes(r, m.start, m.length, m.priority == Priority.DEMOTE)
        return dataclasses.replace(m, length=ready) if 0 < ready < m.length else m

    def _hold(self, m: Move, book: RegionBook, free: dict[int, int], headroom: Callable[[int], int]) -> str:
        """Why ``m`` waits this tick ("" when it may go)."""
        r = book.region_of(m.pid, m.start)
        if r is None:
            return "no-region"
        if self.inflight.overlaps(m.pid, m.start, m.length):
            return "in-flight"
        if touches_unpopulated(r, m):
            return "unpopulated"
        if m.priority == Priority.DEMOTE and book.warming_up(r, m.start, m.length):
            return "warming-up"
        if not self.room(m, free, headroom):
            return "no-room"
        return ""

    def room(self, m: Move, free: dict[int, int], headroom: Callable[[int], int]) -> bool:
        """Whether the target node has free pages for ``m`` beyond what is already on its way there
        and beyond its reserve. Moving into a node without free pages makes the kernel reclaim for
        every target page, and the pages already unmapped for the batch wait for it: the workload
        stalls on them (lab, 6.12: 0 decode steps in some 4 s periods, 958 allocation stalls in
        40 s while the plan promoted into a node with 4 % free). A demotion planned in the same
        tick makes the room; the promotion follows once it has. ``free`` carries what this tick's
        earlier moves took."""
        node = m.to_node
        if node not in free:
            free[node] = headroom(node) - self.inflight.bytes_into(node)
        if free[node] < m.length:
            return False
        free[node] -= m.length
        return True

    def add_outside(self, pid: int, ranges: Iterable[tuple[int, int]], handle: object) -> None:
        """A move asked for outside the plan (``tieringctl migrate``): in flight like the plan's."""
        for start, length in ranges:
            self.inflight.add(pid, start, length, handle)

    def collect(self, now: float, book: RegionBook | None = None) -> bool:
        """Moves whose request is over leave the in-flight set (and their blocks may be planned
        again: ``book.moving``); their failures are counted, and the bytes they carried measure the
        mover's rate. True when any finished."""
        since, self._collected_at = now - self._collected_at, now
        before = self.inflight.bytes
        done = [h for h in self.inflight.handles() if h.done()]
        for h in done:
            for pid, lo, hi in self.inflight.done(h):
                if book is not None:
                    book.moving(pid, lo, hi - lo, None)
        self.stats.count_failures(ticket_failures([h for h in done if isinstance(h, Ticket)]))
        if before > 0:
            self.rate.note(since, before - self.inflight.bytes)
        return bool(done)

    def status(self) -> dict:
        return {**self.stats.to_dict(), "held_back_by_reason": dict(self.held_back_by_reason),
                "in_flight": len(self.inflight),
                "in_flight_bytes": self.inflight.bytes,
                "mover_rate_mb_s": round(self.rate.bytes_s / 1e6, 1)}


def touches_unpopulated(region, m: Move) -> bool:
    """Whether ``m`` covers a block of ``region`` that holds no page yet (nothing to move there)."""
    lo = (m.start - region.start) // region.block_bytes
    hi = -(-(m.start + m.length - region.start) // region.block_bytes)
    return bool(region.unpopulated[max(lo, 0):hi].any())
