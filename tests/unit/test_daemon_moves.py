# SPDX-License-Identifier: Apache-2.0
"""Moves between the plan and the mover (tieringd/daemon/moves.py): what is in flight is held back and
off the budget, failures are counted once per report, and the shim's REBIND path (before 6.5) turns
the shim's answer and a placement query into verified rows."""
import errno

import numpy as np

from tieringd.shim import protocol as P
from tieringd.contracts import LANDED_DTYPE, Move, Priority
from tieringd.daemon.moves import InFlight, MoveStats, ShimMover, landed_runs_from, ticket_failures
from tieringd.mover import Outcome, Report, Ticket

MiB = 1 << 20


def test_in_flight_ranges_overlap_and_leave_when_done():
    f = InFlight()
    a, b = object(), object()
    f.add(1, 0x1000000, 4 * MiB, a)
    f.add(1, 0x2000000, 2 * MiB, b)
    f.add(2, 0x1000000, 2 * MiB, b)
    assert f.bytes == 8 * MiB and len(f) == 3
    assert f.overlaps(1, 0x1000000 + 4 * MiB - 4096, 4096)
    assert not f.overlaps(1, 0x1000000 + 4 * MiB, 4096)
    assert not f.overlaps(3, 0x1000000, 4096)
    f.done(b)
    assert f.bytes == 4 * MiB and f.handles() == [a] and not f.overlaps(2, 0x1000000, 1)
    f.drop_pid(1)
    assert f.bytes == 0 and len(f) == 0


def _ticket(outcomes: dict, target=0) -> Ticket:
    rep = Report(7, target, Priority.PROMOTE)
    for outcome, n in outcomes.items():
        rep.counters.pairs[(1, target)].count(outcome, n)
    t = Ticket(rep)
    t._done.set()
    return t


def test_failures_are_counted_once_per_report():
    t1 = _ticket({Outcome.MOVED: 500, Outcome.PINNED: 12, Outcome.NOT_PRESENT: 3})
    t2 = Ticket(t1.report)                        # coalesced into the same job: one report
    t3 = _ticket({Outcome.TARGET_FULL: 8})
    assert ticket_failures([t1, t2, t3]) == {"pinned": 12, "not-present": 3, "target-full": 8}
    s = MoveStats()
    s.count_failures(ticket_failures([t1, t3]))
    s.count_failures({"pinned": 1})
    assert s.to_dict()["failed_pages"] == {"not-present": 3, "pinned": 13, "target-full": 8}


def test_landed_runs_merge_adjacent_pages_on_one_node():
    rows = landed_runs_from([(5, 0x200000, 32, 0), (5, 0x220000, 32, 0), (5, 0x240000, 32, 1),
                             (6, 0x260000, 32, 1)])
    assert rows.dtype == LANDED_DTYPE
    assert rows.tolist() == [(5, 0x200000, 64, 0), (5, 0x240000, 32, 1), (6, 0x260000, 32, 1)]


class Shim:
    """Stands for the registry's send_request: records what went out, answers when told."""

    def __init__(self, connected=True):
        self.connected = connected
        self.sent = []

    def send(self, pid, msg, on_reply):
        if not self.connected:
            return False
        self.sent.append((pid, msg, on_reply))
        return True


def test_a_shim_move_sends_a_bind_with_move_and_verifies_where_pages_went():
    shim, landed, stats = Shim(), [], MoveStats()
    where = {}
    mover = ShimMover(shim.send, lambda pid, addrs: np.array([where.get(int(a), -1) for a in addrs]),
                      landed.append, stats)
    m = Move(9, 0x40000000, 4 * MiB, 1, 0, Priority.PROMOTE)
    sm = mover.submit(m)
    pid, msg, reply = shim.sent[0]
    assert pid == 9 and isinstance(msg, P.Rebind)
    assert (msg.start, msg.length, msg.nodemask, msg.policy) == (m.start, m.length, 1, int(P.Policy.BIND))
    assert msg.flags == int(P.RebindFlag.MOVE | P.RebindFlag.NUMA_BALANCING)
    assert not sm.done() and mover.pending == [sm]
    for a in range(m.start, m.start + m.length, 4096):
        where[a] = 0 if a < m.start + 3 * MiB else 1       # the last MiB found no room
    reply(P.Ack(ref_seq=msg.seq))
    assert sm.done() and mover.pending == []
    rows = landed[0]
    assert rows.tolist() == [(9, m.start, 768, 0), (9, m.start + 3 * MiB, 256, 1)]


def test_a_refused_or_unanswered_shim_move_counts_as_failed():
    shim, stats = Shim(), MoveStats()
    clock = [0.0]
    mover = ShimMover(shim.send, lambda pid, a: np.zeros(len(a)), lambda r: None, stats,
                      clock=lambda: clock[0])
    mover.submit(Move(9, 0x40000000, 2 * MiB, 1, 0))
    shim.sent[0][2](P.Error(ref_seq=1, code=errno.EBUSY, message="REBIND: region is pinned"))
    mover.submit(Move(9, 0x40200000, 2 * MiB, 1, 0))
    clock[0] = ShimMover.TIMEOUT_S + 1
    mover.expire()
    mover.submit(Move(9, 0x40400000, 2 * MiB, 1, 0))
    shim.sent[2][2](None)                                # the connection closed first
    ShimMover(Shim(connected=False).send, None, None, stats).submit(Move(3, 0, 4096, 1, 0))
    assert stats.failed_pages == {"ebusy": 512, "timeout": 512, "process-exited": 512, "no-shim": 1}
