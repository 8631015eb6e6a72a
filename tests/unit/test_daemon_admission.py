# SPDX-License-Identifier: Apache-2.0
"""Admission between the plan and the mover (tieringd/daemon/admission.py): the budget follows the
mover's measured rate, what must wait is held back (in flight, unpopulated, warming up, no room), and
finished moves leave the in-flight set with their failures counted once."""
import dataclasses

import numpy as np

from tieringd.contracts import Move, Priority
from tieringd.daemon.admission import IN_FLIGHT_S, MIN_IN_FLIGHT_BYTES, RATE_WINDOW_S, Admission
from tieringd.mover import Outcome, Report, Ticket

MiB = 1 << 20
BASE = 0x7f0000000000


@dataclasses.dataclass
class Region:
    start: int = BASE
    block_bytes: int = 2 * MiB
    unpopulated: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(16, bool))
    warming: bool = False


class Book:
    def __init__(self, *regions: Region):
        self.regions = {(7, r.start): r for r in regions}

    def region_of(self, pid, start):
        return next((r for (p, s), r in self.regions.items()
                     if p == pid and s <= start < s + len(r.unpopulated) * r.block_bytes), None)

    def warming_up(self, region, start, length):
        return region.warming

    def ready_bytes(self, region, start, length, demote):
        lo = (start - region.start) // region.block_bytes
        hi = -(-(start + length - region.start) // region.block_bytes)
        waiting = region.unpopulated[lo:hi]
        first = int(waiting.argmax()) if waiting.any() else hi - lo
        return min((lo + first) * region.block_bytes + region.start - start, length)

    def moving(self, pid, start, length, to_node):
        self.flagged = getattr(self, "flagged", [])
        self.flagged.append((pid, start, length, to_node))


class Handle:
    def __init__(self):
        self.finished = False

    def done(self):
        return self.finished


class Carrier:
    def __init__(self):
        self.sent: list[Move] = []
        self.handles: list[Handle] = []

    def submit(self, move):
        self.sent.append(move)
        self.handles.append(Handle())
        return self.handles[-1]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def move(block: int, blocks: int = 1, to_node: int = 0, priority=Priority.PROMOTE) -> Move:
    return Move(7, BASE + block * 2 * MiB, blocks * 2 * MiB, 1 - to_node, to_node, priority)


def plenty(node):
    return 1 << 40


def test_the_budget_is_the_floor_until_the_rate_is_known_and_never_above_the_cap():
    a = Admission()
    assert a.budget_bytes(1 << 40) == MIN_IN_FLIGHT_BYTES
    assert a.budget_bytes(8 * MiB) == 8 * MiB
    a.inflight.add(7, BASE, 60 * MiB, Handle())
    assert a.budget_bytes(1 << 40) == MIN_IN_FLIGHT_BYTES - 60 * MiB
    a.inflight.add(7, BASE + 60 * MiB, 8 * MiB, Handle())
    assert a.budget_bytes(1 << 40) == 0.0                   # more in flight than the floor: nothing


def test_a_measured_rate_raises_the_budget_to_seconds_of_it():
    clock = Clock()
    a, carrier = Admission(clock), Carrier()
    a.submit([move(0, 8)], Book(Region()), carrier, plenty)
    clock.t += 2 * RATE_WINDOW_S
    carrier.handles[0].finished = True
    assert a.collect(clock.t)
    rate = 16 * MiB / (2 * RATE_WINDOW_S)
    assert a.rate.bytes_s == rate
    assert a.budget_bytes(1 << 40) == max(rate * IN_FLIGHT_S, MIN_IN_FLIGHT_BYTES)


def test_what_must_wait_is_held_back_and_counted():
    warm = Region(start=BASE + 64 * MiB, warming=True)
    holey = Region(start=BASE + 128 * MiB)
    holey.unpopulated[3] = True
    book, carrier, a = Book(Region(), warm, holey), Carrier(), Admission()
    a.submit([move(0, 2)], book, carrier, plenty)             # now in flight
    plan = [move(1),                                            # overlaps the one in flight
            move(32, priority=Priority.DEMOTE, to_node=1),      # demotes a region warming up
            move(32),                                           # a promotion there may go
            move(64 + 3),                                       # a block with no page yet
            move(64 + 4),
            move(200)]                                          # no region there
    assert a.submit(plan, book, carrier, plenty) == 2
    assert [m.start for m in carrier.sent[1:]] == [BASE + 64 * MiB, BASE + 136 * MiB]
    assert a.stats.held_back == 4 and a.stats.submitted == 3
    assert a.stats.by_priority == {"promote": 8 * MiB}


def test_a_node_without_room_takes_only_what_fits_counting_this_ticks_earlier_moves():
    book, carrier, a = Book(Region()), Carrier(), Admission()
    a.inflight.add(7, BASE + 30 * MiB, 2 * MiB, Handle(), 0)          # 2 MiB already on its way
    room = {0: 7 * MiB, 1: 1 << 40}
    sent = a.submit([move(0), move(1), move(2), move(3, to_node=1)], book, carrier, room.__getitem__)
    assert sent == 3 and [m.to_node for m in carrier.sent] == [0, 0, 1]     # 7 - 2 = 5 MiB: two blocks


def test_finished_moves_leave_and_their_failures_are_counted_once():
    a, carrier = Admission(), Carrier()
    rep = Report(7, 0, Priority.PROMOTE)
    rep.counters.pairs[(1, 0)].count(Outcome.PINNED, 5)
    ticket = Ticket(rep)
    a.add_outside(7, [(BASE, 2 * MiB), (BASE + 8 * MiB, 2 * MiB)], ticket)
    a.submit([move(20)], Book(Region(unpopulated=np.zeros(32, bool))), carrier, plenty)
    assert not a.collect(200.0) and a.inflight.bytes == 6 * MiB
    ticket._done.set()
    assert a.collect(201.0)
    assert a.inflight.bytes == 2 * MiB and a.stats.failed_pages == {str(Outcome.PINNED): 5}
    status = a.status()
    assert status["in_flight"] == 1 and status["in_flight_bytes"] == 2 * MiB and status["held_back"] == 0


def test_a_configured_rate_holds_the_plan_to_it_over_the_time_since_the_last_plan():
    a = Admission()
    assert a.budget_bytes(1 << 40, rate_bytes_s=10 * MiB, elapsed_s=0.5) == 5 * MiB
    assert a.budget_bytes(1 << 40, rate_bytes_s=0, elapsed_s=0.5) == MIN_IN_FLIGHT_BYTES   # 0: no rate of its own
    assert a.budget_bytes(2 * MiB, rate_bytes_s=10 * MiB, elapsed_s=1.0) == 2 * MiB          # the cap still holds


def test_blocks_in_flight_are_kept_out_of_the_plan_until_their_move_is_over():
    """A move that runs long (a target under memory pressure) must not be planned again and again,
    taking the budget from every other move: its blocks are marked moving while it runs."""
    book, carrier, a = Book(Region()), Carrier(), Admission()
    a.submit([move(0, 2)], book, carrier, plenty)
    assert book.flagged == [(7, BASE, 4 * MiB, 0)]
    assert not a.collect(1.0, book) and len(book.flagged) == 1
    carrier.handles[0].finished = True
    assert a.collect(2.0, book)
    assert book.flagged[-1] == (7, BASE, 4 * MiB, None)


def test_a_demotion_with_no_room_on_its_node_goes_to_the_next_slower_tier():
    """The plan's view of a tier lags what first touch takes from it: a demotion whose node is full
    falls back to the next slower tier (CXL full: the DAX tier), a promotion waits."""
    book, carrier, a = Book(Region()), Carrier(), Admission()
    room = {0: 1 << 40, 1: 0, 1024: 64 * MiB}
    slower = {0: 1, 1: 1024}.get
    sent = a.submit([move(0, 2, to_node=1, priority=Priority.DEMOTE), move(4, to_node=1, priority=Priority.PROMOTE)],
                    book, carrier, room.__getitem__, slower)
    assert sent == 1 and carrier.sent[0].to_node == 1024 and a.held_back_by_reason == {"no-room": 1}


def test_a_run_of_blocks_partly_unready_moves_its_ready_part():
    """A pool still filling: a demotion over blocks whose last ones have no page yet moves the first
    ones now instead of waiting for the whole run."""
    r = Region()
    r.unpopulated[3:] = True
    book, carrier, a = Book(r), Carrier(), Admission()
    assert a.submit([move(0, 6, to_node=1, priority=Priority.DEMOTE)], book, carrier, plenty) == 1
    assert carrier.sent[0].start == BASE and carrier.sent[0].length == 6 * MiB
