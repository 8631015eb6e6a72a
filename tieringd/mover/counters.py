# SPDX-License-Identifier: Apache-2.0
"""What became of every page: outcomes, counters per (source node, target node), and the report of one
request (with the placement the engine verified)."""
from __future__ import annotations

import collections
import dataclasses
import enum
from typing import Any

import numpy as np

from tieringd.kernel.procfs import PAGE_SIZE
from tieringd.contracts import LANDED_DTYPE, Priority
from tieringd.mover.ranges import merge_landed


class Outcome(enum.StrEnum):
    """The final outcome of one requested page (``Report.by_reason()`` keys; JSON strings)."""
    MOVED = "moved"                      # on the target
    FALLBACK = "fallback"                # target full, placed on a fallback node
    ALREADY = "already-there"
    LANDED_ELSEWHERE = "landed-elsewhere"
    NOT_PRESENT = "not-present"
    TARGET_FULL = "target-full"          # no room on the target (nor, in a report, on any fallback)
    PINNED = "pinned"                    # refused (busy/pinned) on every retry
    SHARED = "shared"                    # mapped by other processes (-EACCES without MPOL_MF_MOVE_ALL)
    FAULT = "fault"                      # zero page / no mapping: nothing to move
    VANISHED = "vanished"                # present before the call, gone after (munmap, exit)
    PROCESS_EXITED = "process-exited"
    ERROR = "error"                      # the call failed as a whole (permission, node offline)
    DROPPED = "dropped"                  # the bounded queue dropped the job before these were tried

    @property
    def failed(self) -> bool:
        """Counted under ``failed_pages`` (the page is not where it was asked to go)."""
        return self not in _PLACED


# Outcomes with a field of their own in PairCounters; every other outcome is a failure reason.
_PLACED = {Outcome.MOVED: "moved_pages", Outcome.ALREADY: "already_pages",
           Outcome.LANDED_ELSEWHERE: "landed_elsewhere_pages", Outcome.FALLBACK: "fallback_pages"}
FAILURE_REASONS = tuple(o for o in Outcome if o.failed)


@dataclasses.dataclass
class PairCounters:
    """Pages of one (source node, target node) pair; bytes are pages × page size."""
    requested_pages: int = 0
    moved_pages: int = 0
    already_pages: int = 0
    landed_elsewhere_pages: int = 0
    fallback_pages: int = 0          # pages that found the target full and went to a fallback node
    failed_pages: dict[Outcome, int] = dataclasses.field(default_factory=dict)

    def count(self, outcome: Outcome, n: int) -> None:
        field = _PLACED.get(outcome)
        if field is None:
            self.failed_pages[outcome] = self.failed_pages.get(outcome, 0) + n
        else:
            setattr(self, field, getattr(self, field) + n)

    def add(self, other: "PairCounters") -> None:
        self.requested_pages += other.requested_pages
        self.moved_pages += other.moved_pages
        self.already_pages += other.already_pages
        self.landed_elsewhere_pages += other.landed_elsewhere_pages
        self.fallback_pages += other.fallback_pages
        for k, v in other.failed_pages.items():
            self.failed_pages[k] = self.failed_pages.get(k, 0) + v

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["failed_pages"] = {str(k): v for k, v in sorted(self.failed_pages.items())}
        d["moved_bytes"] = self.moved_pages * PAGE_SIZE
        d["requested_bytes"] = self.requested_pages * PAGE_SIZE
        d["failed_bytes"] = {k: v * PAGE_SIZE for k, v in d["failed_pages"].items()}
        return d


class Counters:
    """Per (source, target) pair counters plus engine-wide totals. Source -1 = the page was not present."""

    TOTALS = ("thp_pages_moved", "move_pages_calls", "batches", "retried_pages", "dropped_jobs",
              "dropped_pages", "processes_exited")

    def __init__(self) -> None:
        self.pairs: dict[tuple[int, int], PairCounters] = collections.defaultdict(PairCounters)
        self.thp_pages_moved = 0
        self.move_pages_calls = 0
        self.batches = 0
        self.retried_pages = 0
        self.dropped_jobs = 0
        self.dropped_pages = 0
        self.dropped_by_priority: dict[str, int] = {}
        self.processes_exited = 0

    def merge(self, other: "Counters") -> None:
        for key, c in other.pairs.items():
            self.pairs[key].add(c)
        for f in self.TOTALS:
            setattr(self, f, getattr(self, f) + getattr(other, f))
        for k, v in other.dropped_by_priority.items():
            self.dropped_by_priority[k] = self.dropped_by_priority.get(k, 0) + v

    def copy(self) -> "Counters":
        c = Counters()
        c.merge(self)
        return c

    def total(self) -> PairCounters:
        t = PairCounters()
        for c in self.pairs.values():
            t.add(c)
        return t

    @property
    def moved_pages(self) -> int:
        return sum(c.moved_pages for c in self.pairs.values())

    def failed(self, reason: Outcome | str) -> int:
        return sum(c.failed_pages.get(reason, 0) for c in self.pairs.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "page_size": PAGE_SIZE,
            "pairs": [{"source": s, "target": t, **c.to_dict()} for (s, t), c in sorted(self.pairs.items())],
            "total": self.total().to_dict(),
            "thp_pages_moved": self.thp_pages_moved,
            "move_pages_calls": self.move_pages_calls,
            "batches": self.batches,
            "retried_pages": self.retried_pages,
            "dropped_jobs": self.dropped_jobs,
            "dropped_pages": self.dropped_pages,
            "dropped_by_priority": dict(self.dropped_by_priority),
            "processes_exited": self.processes_exited,
        }


@dataclasses.dataclass
class Report:
    """What became of one submitted request (shared by requests coalesced into one job)."""
    pid: int
    target: int | None
    priority: Priority
    fallbacks: list[int] = dataclasses.field(default_factory=list)
    requested_pages: int = 0
    counters: Counters = dataclasses.field(default_factory=Counters)
    process_exited: bool = False
    dropped: bool = False
    error: str | None = None
    samples: dict[Outcome, list[int]] = dataclasses.field(default_factory=dict)   # a few addresses per failure
    started: float | None = None
    finished: float | None = None
    landed_parts: list[np.ndarray] = dataclasses.field(default_factory=list, repr=False)

    @property
    def moved_pages(self) -> int:
        """Pages migrated by the kernel for this request (to the target or a fallback node)."""
        return self.counters.moved_pages

    def landed(self) -> np.ndarray:
        """``LANDED_DTYPE`` rows: where the engine verified this request's pages, by address; a page
        handled twice (refused, then moved on a retry) appears once, where it was last seen. Pages
        that were not present, or were never tried (process exited, dropped, error), are absent."""
        if not self.landed_parts:
            return np.zeros(0, LANDED_DTYPE)
        return merge_landed(self.landed_parts)

    def by_reason(self) -> dict[Outcome, int]:
        """One final outcome per requested page; the values add up to ``requested_pages``.

        ``moved``: on the target; ``fallback``: target full, placed on a fallback node; ``target-full``:
        target full and no fallback had room either (left where it was)."""
        t = PairCounters()
        for (_, dst), c in self.counters.pairs.items():
            if dst == self.target:
                t.add(c)
        out = {Outcome.MOVED: t.moved_pages, Outcome.FALLBACK: t.fallback_pages,
               Outcome.ALREADY: t.already_pages, Outcome.LANDED_ELSEWHERE: t.landed_elsewhere_pages}
        out.update(t.failed_pages)
        out[Outcome.TARGET_FULL] = out.get(Outcome.TARGET_FULL, 0) - t.fallback_pages
        return {k: v for k, v in out.items() if v}

    def to_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid, "target": self.target, "priority": self.priority.name.lower(),
            "fallbacks": self.fallbacks, "requested_pages": self.requested_pages,
            "by_reason": {str(k): v for k, v in self.by_reason().items()},
            "process_exited": self.process_exited, "dropped": self.dropped, "error": self.error,
            "samples": {str(k): [hex(a) for a in v] for k, v in self.samples.items()},
            "elapsed_s": None if self.started is None or self.finished is None
            else round(self.finished - self.started, 6),
            "counters": self.counters.to_dict(),
        }
