# SPDX-License-Identifier: Apache-2.0
"""Requests, the jobs the engine queues for them, the tickets callers wait on — and :class:`Kernel`, the
seam between the engine and the system calls (tests substitute a simulated kernel)."""
from __future__ import annotations

import dataclasses
import itertools
import threading

import numpy as np

from tieringd.kernel import procfs, numa
from tieringd.contracts import Move, Priority, Tier
from tieringd.mover.counters import Report
from tieringd.mover.ranges import interval_npages, interval_pages

PF_EXITING = 0x4      # include/linux/sched.h: the task is in do_exit()


@dataclasses.dataclass
class MoveRequest:
    """Move ``ranges`` ((start, length) in bytes) of ``pid`` to a node (int) or a tier (:class:`Tier`)."""
    pid: int
    ranges: list[tuple[int, int]]
    target: int | Tier
    priority: Priority = Priority.DEMOTE

    @classmethod
    def from_move(cls, m: Move) -> "MoveRequest":
        return cls(m.pid, [(m.start, m.length)], m.to_node, Priority(m.priority))


class Ticket:
    """Handed back by ``MigrationEngine.submit``: wait for it, then read ``report``."""

    def __init__(self, report: Report):
        self.report = report
        self._done = threading.Event()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Report:
        if not self._done.wait(timeout):
            raise TimeoutError(f"move of pid {self.report.pid} still running after {timeout} s")
        return self.report


_seq = itertools.count()


@dataclasses.dataclass(eq=False)
class Job:
    """One queued unit of work: pages of one process to one target at one priority. The first pass
    and each back-off retry of refused pages are jobs of their own sharing one report (``live``)."""
    pid: int
    target: int
    fallbacks: list[int]
    priority: Priority
    intervals: list[tuple[int, int]]
    report: Report
    tickets: list[Ticket]
    requested: int | Tier = -1         # the request's target (a tier re-resolves when the map changes)
    seq: int = dataclasses.field(default_factory=lambda: next(_seq))
    attempt: int = 0                   # 0: first pass; n: n-th retry of refused pages
    not_before: float = 0.0
    pages: np.ndarray | None = None    # built when the job first runs
    pos: int = 0
    full_until: float = 0.0            # target found full: go straight to fallbacks until then
    live: list[int] = dataclasses.field(default_factory=lambda: [1])   # jobs still open for the report

    @property
    def started(self) -> bool:
        return self.pages is not None

    def npages(self) -> int:
        """Pages not yet tried."""
        if self.pages is not None:
            return len(self.pages) - self.pos
        return interval_npages(self.intervals)

    def ensure_pages(self) -> None:
        if self.pages is None:
            self.pages = interval_pages(self.intervals)

    def finish(self, now: float) -> None:
        """One job of the report is over; the report is done when its retries are over too."""
        self.live[0] -= 1
        if self.live[0] <= 0:
            self.report.finished = now
            for t in self.tickets:
                t._done.set()


class Kernel:
    """The system calls the engine uses; tests substitute a simulated kernel
    (``SimKernel`` in tests/unit/test_mover_engine.py)."""
    query = staticmethod(numa.query_pages_array)
    move = staticmethod(numa.move_pages_batch)

    @staticmethod
    def thp(pid: int, start: int, npages: int) -> np.ndarray | None:
        try:
            return numa.thp_mask(pid, start, npages)
        except (OSError, ValueError):
            return None

    @staticmethod
    def process_gone(pid: int) -> bool:
        """No such process, a zombie, or a process on its way out (PF_EXITING): its mm is or will soon
        be gone, and move_pages says EINVAL rather than ESRCH until the pid is reaped."""
        fields = procfs.read_stat(pid)
        if fields is None or not fields or fields[0] in ("Z", "X", "x"):
            return True
        try:
            return bool(int(fields[9 - 3]) & PF_EXITING)       # proc(5) field 9: flags
        except (IndexError, ValueError):
            return False
