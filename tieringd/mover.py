# SPDX-License-Identifier: Apache-2.0
"""The migration engine: carries out moves and reports, page by page, where memory really landed.

The policy decides *what* to move (``contracts.Move``); the engine decides only *how*:

1. **Coalescing.** Requests for the same (pid, target, priority) still waiting in the queue are merged,
   and their ranges page-aligned and merged into sorted, disjoint intervals — many small KV-block moves
   become a few large bursts (the brief's write coalescing).
2. **Batching.** Intervals are cut into ``move_pages`` calls of ``batch_pages`` base pages. A transparent
   huge page is sent once (its first base page in the batch): the kernel moves the whole folio, and
   sending its tail pages in the same call only earns spurious -EBUSY (they are already isolated).
3. **Budgets.** One token bucket (MB/s) for promotions (PROMOTE, PREFETCH) and one for demotions;
   promotions are picked before demotions; a job yields its worker after ``slice_batches`` batches or
   as soon as more urgent work waits, so one large process never stalls the others.
4. **Verification.** Each batch is bracketed by two ``move_pages`` queries: before (the source node of
   every page — counters are per (source, target)) and after (where every page is now). The status
   array alone cannot be trusted: after a partial failure the kernel leaves it unwritten (see numa.py).
5. **Outcomes.** Per page: moved; already there; landed elsewhere; not present; target full (ENOMEM →
   the next node of ``Topology.fallback_nodes``: same tier, then slower tiers); refused (busy/pinned →
   retried with exponential back-off, then reported as ``pinned``); shared (mapped by other processes);
   vanished (unmapped meanwhile); process exited.
6. **Bounded queue.** At ``max_queued`` jobs the oldest job of the lowest priority is dropped (counted).

Counters compare with /proc/vmstat: every page counted ``moved`` is one base page the kernel counted in
``pgmigrate_success`` (mm/migrate.c counts base pages, a THP as 512). ``pgpromote_success`` and
``pgdemote_*`` count only the kernel's own NUMA-balancing promotions and reclaim demotions, never
``move_pages``; :func:`vmstat_snapshot` reads all of them so reports can show them side by side.
"""
from __future__ import annotations

import collections
import dataclasses
import errno as _errno
import itertools
import logging
import threading
import time
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from tieringd import _sysfs, numa
from tieringd.contracts import Move, Priority, Tier
from tieringd.ratelimit import TokenBucket

log = logging.getLogger("tieringd.mover")

PS = numa.PAGE_SIZE
PF_EXITING = 0x4      # include/linux/sched.h: the task is in do_exit()

# Page outcomes (counter keys).
MOVED = "moved"
ALREADY = "already-there"
LANDED_ELSEWHERE = "landed-elsewhere"
NOT_PRESENT = "not-present"
TARGET_FULL = "target-full"
PINNED = "pinned"            # refused (busy/pinned) on every retry
SHARED = "shared"
FAULT = "fault"              # zero page / no mapping: nothing to move
VANISHED = "vanished"        # present before the call, gone after (munmap, exit)
PROCESS_EXITED = "process-exited"
ERROR = "error"              # the call failed as a whole (permission, node offline): see the report
DROPPED = "dropped"          # the bounded queue dropped the job before these pages were tried
FALLBACK = "fallback"        # target full, placed on a fallback node (report outcome)
FAILURE_REASONS = (TARGET_FULL, PINNED, SHARED, FAULT, NOT_PRESENT, VANISHED, PROCESS_EXITED, ERROR, DROPPED)

VMSTAT_KEYS = ("pgmigrate_success", "pgmigrate_fail", "pgpromote_success", "pgdemote_kswapd",
               "pgdemote_direct", "pgdemote_khugepaged", "pgdemote_proactive", "numa_pages_migrated",
               "thp_migration_success", "thp_migration_fail", "thp_migration_split")


def vmstat_snapshot() -> dict[str, int]:
    """The migration counters of /proc/vmstat (keys the kernel lacks are left out)."""
    raw = _sysfs.read_keyed("/proc/vmstat", {})
    out = {}
    for k in VMSTAT_KEYS:
        try:
            out[k] = int(raw[k])
        except (KeyError, ValueError):
            pass
    return out


def vmstat_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


# --------------------------------------------------------------------------------------------------
# Requests, ranges, batches
# --------------------------------------------------------------------------------------------------

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


def coalesce(ranges: Iterable[tuple[int, int]], page_size: int = PS) -> list[tuple[int, int]]:
    """(start, length) byte ranges → sorted, disjoint, page-aligned [start, end) intervals; ranges that
    overlap or touch (after alignment) become one."""
    spans = []
    for start, length in ranges:
        if length <= 0:
            continue
        lo = start - start % page_size
        hi = -(-(start + length) // page_size) * page_size
        spans.append((lo, hi))
    spans.sort()
    out: list[list[int]] = []
    for lo, hi in spans:
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def interval_pages(intervals: Sequence[tuple[int, int]], page_size: int = PS) -> np.ndarray:
    if not intervals:
        return np.zeros(0, dtype=np.uint64)
    return np.concatenate([np.arange(lo, hi, page_size, dtype=np.uint64) for lo, hi in intervals])


def thp_heads(addrs: np.ndarray, thp: np.ndarray | None) -> np.ndarray:
    """Boolean mask of the addresses to send: every base page, but only the first page of each THP."""
    if thp is None or not thp.any():
        return np.ones(len(addrs), dtype=bool)
    huge = addrs // np.uint64(numa.HPAGE_PMD_SIZE)
    first = np.ones(len(addrs), dtype=bool)
    first[1:] = huge[1:] != huge[:-1]
    return ~thp | first


def batch_end(pages: np.ndarray, pos: int, batch_pages: int,
              in_thp: Callable[[int], bool] = lambda addr: True) -> int:
    """End index of the batch starting at ``pos``: ``batch_pages`` pages, stretched to the next 2 MiB
    boundary when its last page is part of a THP (``in_thp``). A THP cut by a batch boundary would move
    whole with the first batch (the kernel migrates folios, not pages) and its other part would then be
    counted "already there" by the next — seen on 6.1, where large anonymous mappings are not yet
    THP-aligned (that came in 6.7)."""
    end = min(pos + batch_pages, len(pages))
    if end >= len(pages) or end <= pos or not in_thp(int(pages[end - 1])):
        return end
    hp = np.uint64(numa.HPAGE_PMD_SIZE)
    boundary = (pages[end - 1] // hp + np.uint64(1)) * hp
    return int(np.searchsorted(pages, boundary, side="left"))


def contiguous_runs(addrs: np.ndarray, page_size: int = PS) -> list[tuple[int, int]]:
    """(index, count) of runs of consecutive pages in a sorted address array."""
    if len(addrs) == 0:
        return []
    breaks = np.flatnonzero(np.diff(addrs.astype(np.int64)) != page_size) + 1
    starts = np.r_[0, breaks]
    ends = np.r_[breaks, len(addrs)]
    return list(zip(starts.tolist(), (ends - starts).tolist()))


# --------------------------------------------------------------------------------------------------
# Counters and reports
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class PairCounters:
    """Pages of one (source node, target node) pair; bytes are pages × page size."""
    requested_pages: int = 0
    moved_pages: int = 0
    already_pages: int = 0
    landed_elsewhere_pages: int = 0
    fallback_pages: int = 0          # pages that found the target full and went to a fallback node
    failed_pages: dict[str, int] = dataclasses.field(default_factory=dict)

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
        d["failed_pages"] = dict(sorted(self.failed_pages.items()))
        d["moved_bytes"] = self.moved_pages * PS
        d["requested_bytes"] = self.requested_pages * PS
        d["failed_bytes"] = {k: v * PS for k, v in d["failed_pages"].items()}
        return d


class Counters:
    """Per (source, target) pair counters plus engine-wide totals. Source -1 = the page was not present."""

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
        for f in ("thp_pages_moved", "move_pages_calls", "batches", "retried_pages", "dropped_jobs",
                  "dropped_pages", "processes_exited"):
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

    def failed(self, reason: str) -> int:
        return sum(c.failed_pages.get(reason, 0) for c in self.pairs.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "page_size": PS,
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
    samples: dict[str, list[int]] = dataclasses.field(default_factory=dict)   # a few addresses per failure
    started: float | None = None
    finished: float | None = None

    @property
    def moved_pages(self) -> int:
        """Pages migrated by the kernel for this request (to the target or a fallback node)."""
        return self.counters.moved_pages

    def by_reason(self) -> dict[str, int]:
        """One final outcome per requested page; the values add up to ``requested_pages``.

        ``moved``: on the target; ``fallback``: target full, placed on a fallback node; ``target-full``:
        target full and no fallback had room either (left where it was)."""
        t = PairCounters()
        for (_, dst), c in self.counters.pairs.items():
            if dst == self.target:
                t.add(c)
        out = {MOVED: t.moved_pages, FALLBACK: t.fallback_pages, ALREADY: t.already_pages,
               LANDED_ELSEWHERE: t.landed_elsewhere_pages}
        out.update(t.failed_pages)
        out[TARGET_FULL] = out.get(TARGET_FULL, 0) - t.fallback_pages
        return {k: v for k, v in out.items() if v}

    def to_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid, "target": self.target, "priority": self.priority.name.lower(),
            "fallbacks": self.fallbacks, "requested_pages": self.requested_pages,
            "by_reason": self.by_reason(), "process_exited": self.process_exited, "dropped": self.dropped,
            "error": self.error, "samples": {k: [hex(a) for a in v] for k, v in self.samples.items()},
            "elapsed_s": None if self.started is None or self.finished is None
            else round(self.finished - self.started, 6),
            "counters": self.counters.to_dict(),
        }


class Ticket:
    """Handed back by :meth:`MigrationEngine.submit`: wait for it, then read ``report``."""

    def __init__(self, report: Report):
        self.report = report
        self._done = threading.Event()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Report:
        if not self._done.wait(timeout):
            raise TimeoutError(f"move of pid {self.report.pid} still running after {timeout} s")
        return self.report


# --------------------------------------------------------------------------------------------------
# Jobs
# --------------------------------------------------------------------------------------------------

_seq = itertools.count()


@dataclasses.dataclass(eq=False)
class _Job:
    pid: int
    target: int
    fallbacks: list[int]
    priority: Priority
    intervals: list[tuple[int, int]]
    report: Report
    tickets: list[Ticket]
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
        if self.pages is not None:
            return len(self.pages) - self.pos
        return sum((hi - lo) // PS for lo, hi in self.intervals)

    def ensure_pages(self) -> None:
        if self.pages is None:
            self.pages = interval_pages(self.intervals)


class Kernel:
    """The system calls the engine uses; tests substitute a simulated kernel (tests/unit/test_mover.py)."""
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
        stat = _sysfs.read_text(f"/proc/{pid}/stat", None)
        if stat is None:
            return True
        fields = stat.rpartition(")")[2].split()
        if not fields or fields[0] in ("Z", "X", "x"):
            return True
        try:
            return bool(int(fields[6]) & PF_EXITING)
        except (IndexError, ValueError):
            return False


# --------------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------------

class MigrationEngine:
    """Queue + workers. Use as a context manager (starts/stops the workers), or call
    :meth:`run_until_idle` to process the queue in the calling thread (CLI, tests)."""

    def __init__(self, topology=None, *, batch_pages: int = 4096, promote_rate_mb_s: float | None = None,
                 demote_rate_mb_s: float | None = None, max_queued: int = 4096, workers: int = 2,
                 slice_batches: int = 8, max_retries: int = 3, retry_backoff_s: float = 0.05,
                 full_backoff_s: float = 1.0, detect_thp: bool = True, move_shared: bool = False,
                 kernel: Kernel | None = None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 on_progress: Callable[[Report], None] | None = None):
        if batch_pages < 1:
            raise ValueError("batch_pages must be at least 1")
        self.batch_pages = int(batch_pages)
        self.max_queued = max(1, int(max_queued))
        self.n_workers = max(1, int(workers))
        self.slice_batches = max(1, int(slice_batches))
        self.max_retries = int(max_retries)
        self.retry_backoff_s = float(retry_backoff_s)
        self.full_backoff_s = float(full_backoff_s)
        self.detect_thp = detect_thp
        self.flags = numa.MPOL_MF_MOVE_ALL if move_shared else numa.MPOL_MF_MOVE
        self.kernel = kernel or Kernel()
        self._clock, self._sleep = clock, sleep
        self.on_progress = on_progress
        self._topology = topology
        self.promote_bucket = TokenBucket.from_mb_s(promote_rate_mb_s, clock=clock)
        self.demote_bucket = TokenBucket.from_mb_s(demote_rate_mb_s, clock=clock)
        self._queue: list[_Job] = []
        self._busy_pids: set[int] = set()
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self.counters = Counters()       # guarded by _cond
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=256)

    # ---- configuration -------------------------------------------------------------------------

    # [mover] keys of the config file and their types (docs/mover.md).
    CONFIG_KEYS = {"batch_pages": int, "promote_rate_mb_s": float, "demote_rate_mb_s": float,
                   "max_queued": int, "workers": int, "slice_batches": int, "max_retries": int,
                   "retry_backoff_s": float, "full_backoff_s": float, "detect_thp": bool,
                   "move_shared": bool}

    @classmethod
    def from_config(cls, cfg: dict[str, Any], topology=None, **overrides) -> "MigrationEngine":
        """An engine from the ``[mover]`` table of the config file; a rate of 0 means unlimited."""
        from tieringd.config import ConfigError, check_keys, section
        table = section(cfg, "mover")
        check_keys("mover", table, cls.CONFIG_KEYS)
        kw: dict[str, Any] = {}
        for key, value in table.items():
            want = cls.CONFIG_KEYS[key]
            ok = isinstance(value, bool) if want is bool else (
                isinstance(value, (int, float)) and not isinstance(value, bool)
                and (want is float or float(value).is_integer()))
            if not ok or (want is not bool and value < 0):
                raise ConfigError(f"[mover] {key} = {value!r}: expected a non-negative {want.__name__}")
            kw[key] = want(value)
        if kw.get("batch_pages") == 0:
            raise ConfigError("[mover] batch_pages must be at least 1")
        kw.update(overrides)
        return cls(topology, **kw)

    def set_rates(self, promote_rate_mb_s: float | None = None, demote_rate_mb_s: float | None = None) -> None:
        with self._cond:
            self.promote_bucket = TokenBucket.from_mb_s(promote_rate_mb_s, clock=self._clock)
            self.demote_bucket = TokenBucket.from_mb_s(demote_rate_mb_s, clock=self._clock)
            self._cond.notify_all()

    def _bucket(self, priority: Priority) -> TokenBucket:
        return self.demote_bucket if priority == Priority.DEMOTE else self.promote_bucket

    def topology(self):
        if self._topology is None:
            from tieringd import topology as _topology
            self._topology = _topology.discover()
        elif callable(self._topology) and not hasattr(self._topology, "nodes_in_tier"):
            self._topology = self._topology()
        return self._topology

    def resolve(self, target: int | Tier) -> tuple[int, list[int]]:
        """A node and its fallback chain for a node id or a tier. Raises ValueError if there is none."""
        if isinstance(target, Tier):
            topo = self.topology()
            nodes = topo.nodes_in_tier(target)
            if not nodes:
                raise ValueError(f"no node with memory in tier {target.label}")
            chain = nodes[1:] + [n for n in self._fallbacks_of(topo, nodes[0]) if n not in nodes]
            return nodes[0], chain
        node = int(target)
        if node < 0:
            raise ValueError(f"bad node {node}")
        try:
            topo = self.topology()
        except Exception as e:   # topology is a report; moving to an explicit node must not need it
            log.warning("no topology for fallbacks: %s", e)
            return node, []
        return node, self._fallbacks_of(topo, node)

    @staticmethod
    def _fallbacks_of(topo, node: int) -> list[int]:
        try:
            return [n for n in topo.fallback_nodes(node) if n != node]
        except (KeyError, ValueError):
            return []

    # ---- submission ----------------------------------------------------------------------------

    def submit(self, request: MoveRequest | Move) -> Ticket:
        """Queue a request; never blocks and never raises for a bad target (the report says why)."""
        if isinstance(request, Move):
            request = MoveRequest.from_move(request)
        priority = Priority(request.priority)
        intervals = coalesce(request.ranges)
        try:
            target, fallbacks = self.resolve(request.target)
        except ValueError as e:
            rep = Report(request.pid, None, priority, error=str(e))
            t = Ticket(rep)
            t._done.set()
            return t
        report = Report(request.pid, target, priority, fallbacks=fallbacks)
        ticket = Ticket(report)
        with self._cond:
            for job in self._queue:   # write coalescing: join a job still waiting for the same thing
                if (job.pid, job.target, job.priority) == (request.pid, target, priority) \
                        and not job.started and job.attempt == 0:
                    job.intervals = coalesce([(lo, hi - lo) for lo, hi in job.intervals + intervals])
                    job.tickets.append(ticket)
                    ticket.report = job.report
                    job.report.requested_pages = job.npages()
                    return ticket
            job = _Job(request.pid, target, fallbacks, priority, intervals, report, [ticket])
            report.requested_pages = job.npages()
            self._enqueue(job)
            self._cond.notify()
        return ticket

    def submit_many(self, moves: Iterable[Move | MoveRequest]) -> list[Ticket]:
        return [self.submit(m) for m in moves]

    def _enqueue(self, job: _Job) -> None:
        """Add ``job``; at the limit drop the oldest job of the lowest priority (maybe ``job`` itself)."""
        self._queue.append(job)
        while len(self._queue) > self.max_queued:
            victim = max(self._queue, key=lambda j: (int(j.priority), -j.seq))
            self._queue.remove(victim)
            c = self.counters
            c.dropped_jobs += 1
            c.dropped_pages += victim.npages()
            name = victim.priority.name.lower()
            c.dropped_by_priority[name] = c.dropped_by_priority.get(name, 0) + 1
            victim.report.dropped = True
            self._event("dropped", victim, pages=victim.npages())
            local = Counters()
            local.pairs[(-1, victim.target)].failed_pages[DROPPED] = victim.npages()
            victim.report.counters.merge(local)
            self._close(victim)

    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + len(self._busy_pids)

    # ---- workers -------------------------------------------------------------------------------

    def start(self) -> "MigrationEngine":
        with self._cond:
            self._stopping = False
            while len(self._threads) < self.n_workers:
                t = threading.Thread(target=self._worker, name=f"tieringd-mover-{len(self._threads)}",
                                     daemon=True)
                self._threads.append(t)
                t.start()
        return self

    def stop(self, timeout: float | None = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout)
        self._threads = []

    def __enter__(self) -> "MigrationEngine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """With workers running: wait until the queue is empty and nothing is in flight."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy_pids:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(0.05 if left is None else min(left, 0.05))
        return True

    def _worker(self) -> None:
        while True:
            with self._cond:
                job, wait = self._pick()
                while job is None:
                    if self._stopping:
                        return
                    self._cond.wait(wait)
                    job, wait = self._pick()
            self._run_job(job)

    def run_until_idle(self) -> Counters:
        """Process the queue in the calling thread until it is empty (``sleep`` waits for budgets and
        retries). Returns the engine's counters."""
        while True:
            with self._cond:
                if not self._queue and not self._busy_pids:
                    return self.counters.copy()
                job, wait = self._pick()
            if job is None:
                self._sleep(wait)
                continue
            self._run_job(job)

    def _pick(self) -> tuple[_Job | None, float]:
        """The next job to run (caller holds the lock): most urgent priority, then oldest, among jobs
        whose retry time has come, whose process no worker holds, and whose budget has room."""
        now = self._clock()
        wait = 1.0
        for job in sorted(self._queue, key=lambda j: (int(j.priority), j.seq)):
            if job.pid in self._busy_pids:
                continue
            if job.not_before > now:
                wait = min(wait, job.not_before - now)
                continue
            d = self._bucket(job.priority).delay(self._next_bytes(job))
            if d > 0:
                wait = min(wait, d)
                continue
            self._queue.remove(job)
            self._busy_pids.add(job.pid)
            return job, 0.0
        return None, max(wait, 0.001)

    def _next_bytes(self, job: _Job) -> int:
        return min(self.batch_pages, max(1, job.npages())) * PS

    def _more_urgent_waiting(self, job: _Job) -> bool:
        now = self._clock()
        return any(int(j.priority) < int(job.priority) and j.not_before <= now and j.pid not in self._busy_pids
                   for j in self._queue)

    def _run_job(self, job: _Job) -> None:
        requeue = False
        try:
            if job.report.started is None:
                job.report.started = self._clock()
            job.ensure_pages()
            for i in range(self.slice_batches):
                if job.pos >= len(job.pages):
                    break
                nbytes = self._next_bytes(job)
                with self._cond:
                    if i > 0 and (self._more_urgent_waiting(job) or
                                  not self._bucket(job.priority).try_take(nbytes)):
                        requeue = True
                        break
                    if i == 0:
                        self._bucket(job.priority).try_take(nbytes)   # _pick saw room for it
                end = batch_end(job.pages, job.pos, self.batch_pages, lambda a: self._in_thp(job.pid, a))
                batch = job.pages[job.pos:end]
                job.pos = end
                if not self._run_batch(job, batch):
                    job.pos = len(job.pages)     # process gone / whole-call error: job over
                    break
                if self.on_progress:
                    self.on_progress(job.report)
            requeue = job.pos < len(job.pages)
        except Exception as e:   # the engine carries on whatever one job does
            log.exception("mover: job for pid %d failed", job.pid)
            job.report.error = f"{type(e).__name__}: {e}"
            requeue = False
        finally:
            with self._cond:
                self._busy_pids.discard(job.pid)
                if requeue and not job.report.process_exited and job.report.error is None:
                    self._queue.append(job)        # keeps its seq: still the oldest of its class
                else:
                    self._close(job)
                self._cond.notify_all()

    def _close(self, job: _Job) -> None:
        """One job of a report is over; the report is done when its retries are over too."""
        job.live[0] -= 1
        if job.live[0] <= 0:
            job.report.finished = self._clock()
            for t in job.tickets:
                t._done.set()

    def _event(self, kind: str, job: _Job, **kw) -> None:
        ev = {"event": kind, "pid": job.pid, "target": job.target, "priority": job.priority.name.lower(), **kw}
        self.events.append(ev)
        log.info("mover: %s", ev)

    # ---- one batch -----------------------------------------------------------------------------

    def _count(self, job: _Job, src: np.ndarray, target: int, **fields: np.ndarray) -> None:
        """Add per-page outcomes to the job's and the engine's counters, per (source, target)."""
        local = Counters()
        for s in np.unique(src).tolist():
            sel = src == s
            c = local.pairs[(int(s), target)]
            for name, mask in fields.items():
                n = int(np.count_nonzero(mask & sel))
                if not n:
                    continue
                if name == "requested":
                    c.requested_pages += n
                elif name == MOVED:
                    c.moved_pages += n
                elif name == ALREADY:
                    c.already_pages += n
                elif name == LANDED_ELSEWHERE:
                    c.landed_elsewhere_pages += n
                elif name == "fallback":
                    c.fallback_pages += n
                else:
                    c.failed_pages[name] = c.failed_pages.get(name, 0) + n
        with self._cond:
            job.report.counters.merge(local)
            self.counters.merge(local)

    def _sample(self, job: _Job, reason: str, addrs: np.ndarray) -> None:
        if len(addrs):
            s = job.report.samples.setdefault(reason, [])
            s.extend(int(a) for a in addrs[:max(0, 8 - len(s))])

    def _gone(self, job: _Job, e: Exception | None, uncounted: int) -> bool:
        """Handle a process that exited mid-move; True if it did. ``uncounted``: pages of the current
        batch that have no outcome yet (they and the rest of the job count as process-exited)."""
        if e is not None and isinstance(e, numa.ProcessGoneError):
            gone = True
        else:
            gone = self.kernel.process_gone(job.pid)
        if not gone:
            return False
        with self._cond:
            first = not job.report.process_exited
            job.report.process_exited = True
            if first:
                self.counters.processes_exited += 1
            # Queued work for the same process is pointless now.
            others = [j for j in self._queue if j.pid == job.pid]
            for other in others:
                self._queue.remove(other)
        for other in others:
            other.report.process_exited = True
            self._lost(other, other.npages(), PROCESS_EXITED)
            with self._cond:
                self._close(other)
        left = uncounted + (len(job.pages) - job.pos if job.pages is not None else job.npages())
        self._lost(job, left, PROCESS_EXITED)
        self._event("process-exited", job, pages_left=left)
        return True

    def _lost(self, job: _Job, n: int, reason: str) -> None:
        """``n`` pages of ``job`` end without being tried: counted under (-1, target)."""
        if n > 0:
            self._count(job, np.full(n, -1), job.target, **{reason: np.ones(n, dtype=bool)})

    def _run_batch(self, job: _Job, addrs: np.ndarray) -> bool:
        """Move one batch; False when the job cannot go on (process gone, call refused as a whole)."""
        pid, target = job.pid, job.target
        thp = self._thp(pid, addrs)
        try:
            before = self._query(pid, addrs, thp)
        except numa.NumaError as e:
            if self._gone(job, e, len(addrs)):
                return False
            return self._job_error(job, e, len(addrs))
        src = before.astype(np.int64)
        src[before < 0] = -1
        present = before >= 0
        # Retries re-count outcomes but not requests: the first pass requested these pages already.
        first = np.ones(len(addrs), dtype=bool) if job.attempt == 0 else np.zeros(len(addrs), dtype=bool)
        notp = ~present
        # -ENOENT: nothing to move; -EFAULT: zero page or no mapping (nothing to move either).
        self._count(job, src, target, requested=first, **{ALREADY: before == target,
                                                          NOT_PRESENT: notp & (before == -_errno.ENOENT),
                                                          FAULT: notp & (before != -_errno.ENOENT)})
        todo = present & (before != target)
        unsent = len(addrs) - int(np.count_nonzero(todo))
        if unsent:   # the budget was taken for the whole batch; pages with nothing to do give it back
            with self._cond:
                self._bucket(job.priority).refund(unsent * PS)
        if not todo.any():
            return True
        addrs_t, src_t = addrs[todo], src[todo]
        thp = thp[todo] if thp is not None else None

        now = self._clock()
        if job.fallbacks and job.full_until > now:
            # Target was full moments ago: don't make the kernel reclaim on it for every batch.
            outcome = numa.BatchResult(np.full(len(addrs_t), -_errno.ENOMEM, np.int32), error=_errno.ENOMEM)
            after = before[todo].copy()
        else:
            outcome, after = self._move_and_verify(job, addrs_t, target, thp, uncounted=len(addrs_t))
            if outcome is None:
                return False
        with self._cond:
            self.counters.batches += 1
            job.report.counters.batches += 1

        moved = after == target
        elsewhere = (after >= 0) & (after != target) & (after != src_t)
        vanished = after < 0
        stuck = (after >= 0) & (after == src_t)
        if thp is not None and moved.any():
            with self._cond:
                n = int(np.count_nonzero(thp & moved))
                self.counters.thp_pages_moved += n
                job.report.counters.thp_pages_moved += n
        # Why did the stuck ones stay? Per-page status first (for THP tails, their head's status).
        st = self._page_status(addrs_t, outcome.status, thp)
        full = stuck & ((st == -_errno.ENOMEM) | ((outcome.error == _errno.ENOMEM) &
                                                  ((st == numa.STATUS_UNREPORTED) | (st == target))))
        shared = stuck & (st == -_errno.EACCES)
        fault = stuck & (st == -_errno.EFAULT)
        refused = stuck & ~full & ~shared & ~fault
        if full.any() and job.fallbacks:
            job.full_until = now + self.full_backoff_s
        self._count(job, src_t, target, **{MOVED: moved, LANDED_ELSEWHERE: elsewhere, VANISHED: vanished,
                                           SHARED: shared, FAULT: fault})
        self._sample(job, SHARED, addrs_t[shared])
        if vanished.any() and self._gone(job, None, 0):
            return False
        if full.any():
            self._fallback(job, addrs_t[full], src_t[full], thp[full] if thp is not None else None)
        if refused.any():
            self._refused(job, addrs_t[refused], src_t[refused])
        return True

    def _move_and_verify(self, job: _Job, addrs: np.ndarray, node: int, thp: np.ndarray | None,
                         uncounted: int):
        """move_pages + the query that says where pages are; (None, None) if the job must end."""
        send = thp_heads(addrs, thp)
        try:
            with self._cond:
                self.counters.move_pages_calls += 1
                job.report.counters.move_pages_calls += 1
            outcome = self.kernel.move(job.pid, addrs[send], node, self.flags)
            status = np.full(len(addrs), numa.STATUS_UNREPORTED, dtype=np.int32)
            status[send] = outcome.status
            outcome = numa.BatchResult(status, outcome.not_migrated, outcome.error)
            # After a complete call a huge page is wherever its head is; after a partial one a THP
            # may have been split on the way (ENOMEM on a large folio), so every page is asked.
            clean = outcome.complete and not (outcome.status[send] < 0).any()
            after = self._query(job.pid, addrs, thp if clean else None)
        except numa.NumaError as e:
            if not self._gone(job, e, uncounted):
                self._job_error(job, e, uncounted)
            return None, None
        return outcome, after

    def _in_thp(self, pid: int, addr: int) -> bool:
        if not self.detect_thp:
            return False
        m = self.kernel.thp(pid, addr, 1)
        return bool(m is not None and m.any())

    def _thp(self, pid: int, addrs: np.ndarray) -> np.ndarray | None:
        """Which pages of a sorted batch are THP-backed (None: none, or it cannot be known)."""
        if not self.detect_thp or len(addrs) == 0:
            return None
        parts = []
        for i, n in contiguous_runs(addrs):
            m = self.kernel.thp(pid, int(addrs[i]), n)
            parts.append(m if m is not None else np.zeros(n, dtype=bool))
        thp = np.concatenate(parts)
        return thp if thp.any() else None

    def _query(self, pid: int, addrs: np.ndarray, thp: np.ndarray | None) -> np.ndarray:
        """Where each page is; a THP's tail pages are not asked (a folio sits on one node) but take
        their head's answer — 512 times fewer page-table walks for huge pages."""
        if thp is None:
            return self.kernel.query(pid, addrs)
        heads = thp_heads(addrs, thp)
        st = self.kernel.query(pid, addrs[heads])
        full = np.full(len(addrs), numa.STATUS_UNREPORTED, dtype=np.int32)
        full[heads] = st
        idx = np.maximum.accumulate(np.where(heads, np.arange(len(addrs)), 0))
        return full[idx]

    @staticmethod
    def _page_status(addrs: np.ndarray, status: np.ndarray, thp: np.ndarray | None) -> np.ndarray:
        """Status per page, a THP tail taking its head's (tails were not sent)."""
        if thp is None or not thp.any():
            return status
        st = status.copy()
        sent = st != numa.STATUS_UNREPORTED
        idx = np.maximum.accumulate(np.where(sent, np.arange(len(st)), 0))
        tails = thp & ~sent
        st[tails] = status[idx[tails]]
        return st

    def _job_error(self, job: _Job, e: Exception, uncounted: int) -> bool:
        job.report.error = str(e)
        self._lost(job, uncounted + (len(job.pages) - job.pos if job.pages is not None else 0), ERROR)
        self._event("error", job, message=str(e))
        return False

    def _fallback(self, job: _Job, addrs: np.ndarray, src: np.ndarray, thp: np.ndarray | None) -> None:
        """Pages the target had no room for: try the fallback chain in order; what fits nowhere stays."""
        self._count(job, src, job.target, **{TARGET_FULL: np.ones(len(addrs), dtype=bool)})
        self._sample(job, TARGET_FULL, addrs)
        left = np.ones(len(addrs), dtype=bool)
        for node in job.fallbacks:
            if not left.any():
                break
            # A page already on a fallback node has found its place; it stays.
            stay = left & (src == node)
            left &= ~stay
            if stay.any():
                self._count(job, src, job.target, fallback=stay)
                self._count(job, src, node, requested=stay, **{ALREADY: stay})
            if not left.any():
                break
            # Not the THP map from before the target refused: a huge page that found no room there
            # may have been split (mm/migrate.c splits large folios on -ENOMEM and retries).
            sub_thp = self._thp(job.pid, addrs[left]) if thp is not None else None
            outcome, after = self._move_and_verify(job, addrs[left], node, sub_thp, uncounted=0)
            if outcome is None:
                return
            idx = np.flatnonzero(left)
            moved_here = np.zeros(len(addrs), dtype=bool)
            moved_here[idx[after == node]] = True
            self._count(job, src, node, requested=left, **{MOVED: moved_here})
            self._count(job, src, job.target, fallback=moved_here)
            self._event("fallback", job, node=node, pages=int(moved_here.sum()))
            left &= ~moved_here
            if outcome.error != _errno.ENOMEM and left.any():
                # The fallback had room, yet these did not move: refused there too; they stay.
                self._count(job, src, node, **{PINNED: left})
                break
            self._count(job, src, node, **{TARGET_FULL: left})

    def _refused(self, job: _Job, addrs: np.ndarray, src: np.ndarray) -> None:
        """Busy or pinned pages: retry later with exponential back-off; after the last retry, pinned."""
        if job.attempt >= self.max_retries:
            self._count(job, src, job.target, **{PINNED: np.ones(len(addrs), dtype=bool)})
            self._sample(job, PINNED, addrs)
            self._event("pinned", job, pages=len(addrs))
            return
        with self._cond:
            self.counters.retried_pages += len(addrs)
            job.report.counters.retried_pages += len(addrs)
            job.live[0] += 1
            retry = _Job(job.pid, job.target, job.fallbacks, job.priority,
                         [(int(a), int(a) + PS) for a in addrs[:1]], job.report, job.tickets,
                         attempt=job.attempt + 1,
                         not_before=self._clock() + self.retry_backoff_s * (2 ** job.attempt),
                         live=job.live)
            retry.pages = np.array(addrs, dtype=np.uint64)
            retry.intervals = []
            self._queue.append(retry)
            self._cond.notify()
