# SPDX-License-Identifier: Apache-2.0
"""Moves between the plan and the mover: what is in flight, what came of it, and the shim's way of
moving on kernels where ``move_pages(2)`` cannot.

- :class:`InFlight` — the address ranges handed to a mover and not finished yet. The table still has
  their blocks where they were (it learns only what the mover verified), so the next tick would plan
  the same moves again; they are held back until their request is over, and the bytes in flight are
  taken off the next tick's migration budget, so the mover's queue never grows past one tick's worth.
- :class:`MoveStats` — bytes promoted and demoted (blocks whose verified node changed tier), failed
  pages by reason, requests submitted.
- :class:`ShimMover` — before v6.5 ``move_pages(2)`` can neither see nor move a page that NUMA-balancing
  scanning has made PROT_NONE (``follow_page()`` honoured NUMA faults until d74943a2f3cd; lab 6.1: 0
  of 8192 idle pages moved), and those are exactly the cold pages a demotion wants. ``mbind(2)`` with
  ``MPOL_MF_MOVE`` moves them, but only the process itself can call it on its memory: the move goes to
  the shim as REBIND (bind to the target with MPOL_F_NUMA_BALANCING, move present pages), and where the
  pages landed is then asked through pagemap (``AccessSignal.nodes_of``).
"""
from __future__ import annotations

import collections
import dataclasses
import errno
import logging
import time
from typing import Callable

import numpy as np

from tieringd.shim import protocol as P
from tieringd.kernel.procfs import PAGE_SIZE
from tieringd.contracts import LANDED_DTYPE, Move
from tieringd.mover import Outcome, Ticket

log = logging.getLogger("tieringd.daemon")


class InFlight:
    """Ranges handed to a mover, per pid, until their completion is noted (``done``)."""

    def __init__(self) -> None:
        self._by_pid: dict[int, list[tuple[int, int, object]]] = collections.defaultdict(list)
        self._into: dict[int, tuple[int, int]] = {}     # id(handle) → (target node, bytes)
        self.bytes = 0

    def add(self, pid: int, start: int, length: int, handle: object, node: int = -1) -> None:
        self._by_pid[pid].append((start, start + length, handle))
        self.bytes += length
        n, b = self._into.get(id(handle), (node, 0))
        self._into[id(handle)] = (n, b + length)

    def bytes_into(self, node: int) -> int:
        """Bytes in flight towards ``node`` (room they will take there)."""
        return sum(b for n, b in self._into.values() if n == node)

    def overlaps(self, pid: int, start: int, length: int) -> bool:
        # a few dozen ranges at most (one tick's budget of coalesced moves): a scan is enough
        end = start + length
        return any(lo < end and start < hi for lo, hi, _ in self._by_pid.get(pid, ()))

    def done(self, handle: object) -> list[tuple[int, int, int]]:
        """The request is over: its ranges leave. Returns them, (pid, start, end)."""
        self._into.pop(id(handle), None)
        gone = []
        for pid, ranges in list(self._by_pid.items()):
            keep = [r for r in ranges if r[2] is not handle]
            gone += [(pid, lo, hi) for lo, hi, h in ranges if h is handle]
            self.bytes -= sum(hi - lo for lo, hi, h in ranges if h is handle)
            if keep:
                self._by_pid[pid] = keep
            else:
                del self._by_pid[pid]
        return gone

    def drop_pid(self, pid: int) -> None:
        ranges = self._by_pid.pop(pid, [])
        self.bytes -= sum(hi - lo for lo, hi, _ in ranges)
        for _, _, h in ranges:
            if not any(h is x for v in self._by_pid.values() for _, _, x in v):
                self._into.pop(id(h), None)

    def handles(self) -> list[object]:
        seen: dict[int, object] = {}
        for ranges in self._by_pid.values():
            for _, _, h in ranges:
                seen.setdefault(id(h), h)
        return list(seen.values())

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_pid.values())


@dataclasses.dataclass
class MoveStats:
    """What the daemon's moves came to. Bytes promoted/demoted are verified facts: blocks whose node
    the mover saw change to a faster / slower tier, times the block size."""
    submitted: int = 0
    submitted_bytes: int = 0
    held_back: int = 0                   # planned moves skipped: in flight, or not populated
    promoted_bytes: float = 0.0
    demoted_bytes: float = 0.0
    failed_pages: dict[str, int] = dataclasses.field(default_factory=dict)
    by_priority: dict[str, int] = dataclasses.field(default_factory=dict)   # bytes submitted

    def count_failures(self, failed_pages: dict[str, int]) -> None:
        for reason, n in failed_pages.items():
            self.failed_pages[reason] = self.failed_pages.get(reason, 0) + int(n)

    def to_dict(self) -> dict:
        return {"submitted": self.submitted, "submitted_bytes": self.submitted_bytes,
                "held_back": self.held_back, "promoted_bytes": int(self.promoted_bytes),
                "demoted_bytes": int(self.demoted_bytes),
                "failed_pages": dict(sorted(self.failed_pages.items())),
                "submitted_bytes_by_priority": dict(self.by_priority)}


@dataclasses.dataclass(eq=False)
class ShimMove:
    """One REBIND-with-move in flight; ``done`` once the shim answered and the pages were asked."""
    move: Move
    sent_at: float
    reply: P.Message | None = None
    answered: bool = False
    error: str | None = None

    def done(self) -> bool:
        return self.answered


class ShimMover:
    """Moves through the shims' REBIND (``mbind(MPOL_BIND | MPOL_F_NUMA_BALANCING, MPOL_MF_MOVE)``
    inside the process). ``send(pid, msg, on_reply) -> bool`` is ``Registry.send_request``;
    ``locate(pid, addrs) -> nodes`` is ``AccessSignal.nodes_of``; ``on_landed(rows)`` takes the
    verified placement, as the engine's does. Runs in the loop thread (the mbind runs in the shim's)."""

    TIMEOUT_S = 30.0                     # a shim that never answers: its moves count as "timeout"
    PAGES_PER_BLOCK = 16                 # pages asked per 2 MiB after a move (as the workload does)

    def __init__(self, send: Callable, locate: Callable[[int, np.ndarray], np.ndarray],
                 on_landed: Callable[[np.ndarray], None], stats: MoveStats,
                 clock: Callable[[], float] = time.monotonic):
        self.send = send
        self.locate = locate
        self.on_landed = on_landed
        self.stats = stats
        self.clock = clock
        self.pending: list[ShimMove] = []
        self.requests = 0

    def submit(self, move: Move) -> ShimMove:
        sm = ShimMove(move, self.clock())
        msg = P.Rebind(start=move.start, length=move.length, nodemask=1 << move.to_node,
                       policy=int(P.Policy.BIND),
                       flags=int(P.RebindFlag.MOVE | P.RebindFlag.NUMA_BALANCING))
        self.requests += 1
        if self.send(move.pid, msg, lambda reply, sm=sm: self._answered(sm, reply)):
            self.pending.append(sm)
        else:
            self._fail(sm, "no-shim")
        return sm

    def _answered(self, sm: ShimMove, reply: P.Message | None) -> None:
        if sm.answered:
            return
        if reply is None:
            self._fail(sm, str(Outcome.PROCESS_EXITED))
        elif isinstance(reply, P.Error):
            self._fail(sm, errno.errorcode.get(reply.code, str(reply.code)).lower(), str(reply))
        else:
            sm.answered = True
            self._verify(sm.move)
        if sm in self.pending:
            self.pending.remove(sm)

    def _verify(self, m: Move) -> None:
        """Where the moved range is now: a few pages per 2 MiB, as runs of whole pages."""
        step = max(PAGE_SIZE, (2 << 20) // self.PAGES_PER_BLOCK)
        addrs = np.arange(m.start, m.start + m.length, step, dtype=np.uint64)
        try:
            nodes = np.asarray(self.locate(m.pid, addrs), np.int64)
        except OSError as e:
            log.debug("pid %d: cannot ask where %#x went: %s", m.pid, m.start, e)
            return
        # each sampled page stands for the stretch up to the next one
        known = nodes >= 0
        if not known.any():
            return
        rows = []
        for a, n in zip(addrs[known].tolist(), nodes[known].tolist()):
            rows.append((m.pid, a, step // PAGE_SIZE, n))
        self.on_landed(landed_runs_from(rows))

    def _fail(self, sm: ShimMove, reason: str, detail: str = "") -> None:
        sm.answered, sm.error = True, reason
        self.stats.count_failures({reason: sm.move.length // PAGE_SIZE})
        log.info("move of pid %d %#x+%#x to node %d through the shim failed: %s %s", sm.move.pid,
                 sm.move.start, sm.move.length, sm.move.to_node, reason, detail)

    def expire(self) -> None:
        now = self.clock()
        for sm in [s for s in self.pending if now - s.sent_at > self.TIMEOUT_S]:
            self.pending.remove(sm)
            self._fail(sm, "timeout")


def landed_runs_from(rows: list[tuple[int, int, int, int]]) -> np.ndarray:
    """(pid, start, npages, node) tuples in address order → LANDED_DTYPE, adjacent runs merged."""
    out = np.zeros(len(rows), LANDED_DTYPE)
    if not rows:
        return out
    out["pid"], out["start"], out["npages"], out["node"] = zip(*rows)
    end = out["start"] + out["npages"].astype(np.uint64) * np.uint64(PAGE_SIZE)
    brk = np.ones(len(out), bool)
    brk[1:] = (out["start"][1:] != end[:-1]) | (out["node"][1:] != out["node"][:-1]) | \
        (out["pid"][1:] != out["pid"][:-1])
    starts = np.flatnonzero(brk)
    merged = out[starts].copy()
    merged["npages"] = np.add.reduceat(out["npages"], starts)
    return merged


def ticket_failures(tickets: list[Ticket]) -> dict[str, int]:
    """Failed pages by reason over finished tickets, each report once (coalesced requests share one)."""
    seen: set[int] = set()
    out: dict[str, int] = {}
    for t in tickets:
        rep = t.report
        if id(rep) in seen:
            continue
        seen.add(id(rep))
        for reason, n in rep.by_reason().items():
            if Outcome(reason).failed:
                out[str(reason)] = out.get(str(reason), 0) + int(n)
        if rep.error and not rep.by_reason():
            out["error"] = out.get("error", 0) + max(rep.requested_pages, 1)
    return out
