# SPDX-License-Identifier: Apache-2.0
"""The engine: a queue of jobs, workers that run them batch by batch, and the accounting of every batch.

Its inputs are a :class:`MoverConfig` (the ``[mover]`` table), a :class:`~tieringd.contracts.FallbackMap`
computed by the caller from the topology (the engine never looks the topology up), and the seams —
kernel, clock, sleep — that tests replace. Its outputs are reports, counters, and the placement it
verified (``on_landed``). The steps are listed in the package docstring (``tieringd/mover/__init__.py``).
"""
from __future__ import annotations

import collections
import dataclasses
import errno as _errno
import logging
import threading
import time
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from tieringd.kernel import numa
from tieringd.kernel.procfs import PAGE_SIZE
from tieringd.config import Table, ranged
from tieringd.contracts import FallbackMap, Move, Priority, Tier
from tieringd.mover.counters import Counters, Outcome, Report
from tieringd.mover.jobs import Job, Kernel, MoveRequest, Ticket
from tieringd.mover.ranges import batch_end, coalesce, contiguous_runs, landed_runs, thp_heads
from tieringd.mover.ratelimit import TokenBucket

log = logging.getLogger("tieringd.mover")

PS = PAGE_SIZE


@dataclasses.dataclass(frozen=True)
class MoverConfig(Table):
    """The ``[mover]`` table (docs/mover.md). A rate of 0 means unlimited."""
    NAME = "mover"
    batch_pages: int = ranged(4096, 1, 1 << 20)  # base pages per move_pages call (P2: larger batches, fewer calls)
    promote_rate_mb_s: float = ranged(0.0, 0, 1e6)  # MB/s (10^6 B/s) for PROMOTE + PREFETCH
    demote_rate_mb_s: float = ranged(0.0, 0, 1e6)  # MB/s for DEMOTE
    max_queued: int = ranged(4096, 1, 1 << 20)  # jobs waiting; beyond, the oldest lowest-priority job is dropped
    workers: int = ranged(2, 1, 64)  # worker threads (one process is held by one worker at a time)
    slice_batches: int = ranged(8, 1, 1 << 16)  # batches before a job yields its worker
    max_retries: int = ranged(3, 0, 100)  # back-off retries of refused (busy/pinned) pages, then "pinned"
    retry_backoff_s: float = ranged(0.05, 0, 60)  # first back-off; doubles per retry
    full_backoff_s: float = ranged(1.0, 0, 3600)  # after ENOMEM, go straight to the fallback chain for this long
    detect_thp: bool = True          # send one address per THP (needs CAP_SYS_ADMIN for PFNs)
    move_shared: bool = False        # MPOL_MF_MOVE_ALL for pages other processes map too (CAP_SYS_NICE)



class MigrationEngine:
    """Queue + workers. Use as a context manager (starts/stops the workers), or call
    :meth:`run_until_idle` to process the queue in the calling thread (CLI, tests).

    ``fallbacks``: where to go when a target is full, and the nodes of each tier (for requests that
    name a tier); without it there are no fallbacks and tier targets are refused. Replace it with
    :meth:`set_fallbacks` when the topology changes.
    ``on_progress(report)``: after every batch. ``on_landed(rows)``: after every batch, the
    ``LANDED_DTYPE`` rows of the pages it verified (called in the worker thread)."""

    def __init__(self, config: MoverConfig | None = None, fallbacks: FallbackMap | None = None, *,
                 kernel: Kernel | None = None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 on_progress: Callable[[Report], None] | None = None,
                 on_landed: Callable[[np.ndarray], None] | None = None):
        self.config = config = config or MoverConfig()
        config.validate()
        self.max_queued = max(1, config.max_queued)
        self.n_workers = max(1, config.workers)
        self.slice_batches = max(1, config.slice_batches)
        self.flags = numa.MPOL_MF_MOVE_ALL if config.move_shared else numa.MPOL_MF_MOVE
        self.kernel = kernel or Kernel()
        self._clock, self._sleep = clock, sleep
        self.on_progress = on_progress
        self.on_landed = on_landed
        self._fallbacks = fallbacks or FallbackMap()
        self.promote_bucket = TokenBucket.from_mb_s(config.promote_rate_mb_s, clock=clock)
        self.demote_bucket = TokenBucket.from_mb_s(config.demote_rate_mb_s, clock=clock)
        self._queue: list[Job] = []
        self._running: set[Job] = set()
        self._busy_pids: set[int] = set()
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self.counters = Counters()       # guarded by _cond
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=256)

    @classmethod
    def from_config(cls, table: Mapping[str, Any] | None, fallbacks: FallbackMap | None = None,
                    **seams: Any) -> "MigrationEngine":
        """An engine from the ``[mover]`` table (``ConfigError`` naming the key)."""
        return cls(MoverConfig.from_config(table), fallbacks, **seams)

    def set_rates(self, promote_rate_mb_s: float | None = None, demote_rate_mb_s: float | None = None) -> None:
        with self._cond:
            self.promote_bucket = TokenBucket.from_mb_s(promote_rate_mb_s, clock=self._clock)
            self.demote_bucket = TokenBucket.from_mb_s(demote_rate_mb_s, clock=self._clock)
            self._cond.notify_all()

    def _bucket(self, priority: Priority) -> TokenBucket:
        return self.demote_bucket if priority == Priority.DEMOTE else self.promote_bucket

    # ---- where memory may go -------------------------------------------------------------------

    @property
    def fallbacks(self) -> FallbackMap:
        return self._fallbacks

    def set_fallbacks(self, fallbacks: FallbackMap) -> None:
        """Replace the fallback map (the topology changed: memory hot-plug). New requests resolve
        through it, and every job already queued or running takes the new chain for its target node
        from its next batch on (its target node stays)."""
        with self._cond:
            self._fallbacks = fallbacks
            for job in [*self._queue, *self._running]:
                job.fallbacks = self._chain(job.requested, job.target)
                job.report.fallbacks = list(job.fallbacks)
            self._cond.notify_all()

    def resolve(self, target: int | Tier) -> tuple[int, list[int]]:
        """A node and its fallback chain for a node id or a tier. Raises ValueError if there is none."""
        if isinstance(target, Tier):
            nodes = self._fallbacks.tiers.get(target, ())
            if not nodes:
                raise ValueError(f"no node with memory in tier {target.label}")
            return nodes[0], self._chain(target, nodes[0])
        node = int(target)
        if node < 0:
            raise ValueError(f"bad node {node}")
        return node, self._chain(node, node)

    def _chain(self, requested: int | Tier, node: int) -> list[int]:
        """The fallbacks of ``node``; for a tier target, the tier's other nodes come first."""
        fmap = self._fallbacks
        chain = [n for n in fmap.tiers.get(requested, ()) if n != node] if isinstance(requested, Tier) else []
        return chain + [n for n in fmap.chains.get(node, ()) if n != node and n not in chain]

    # ---- submission ----------------------------------------------------------------------------

    def submit(self, request: MoveRequest | Move) -> Ticket:
        """Queue a request; never blocks and never raises for a bad target (the report says why)."""
        if isinstance(request, Move):
            request = MoveRequest.from_move(request)
        priority = Priority(request.priority)
        intervals = coalesce(request.ranges)
        with self._cond:
            try:
                target, fallbacks = self.resolve(request.target)
            except ValueError as e:
                t = Ticket(Report(request.pid, None, priority, error=str(e)))
                t._done.set()
                return t
            report = Report(request.pid, target, priority, fallbacks=fallbacks)
            ticket = Ticket(report)
            for job in self._queue:   # write coalescing: join a job still waiting for the same thing
                if (job.pid, job.target, job.priority) == (request.pid, target, priority) \
                        and not job.started and job.attempt == 0:
                    job.intervals = coalesce([(lo, hi - lo) for lo, hi in job.intervals + intervals])
                    job.tickets.append(ticket)
                    ticket.report = job.report
                    job.report.requested_pages = job.npages()
                    return ticket
            job = Job(request.pid, target, fallbacks, priority, intervals, report, [ticket],
                      requested=request.target)
            report.requested_pages = job.npages()
            self._enqueue(job)
            self._cond.notify()
        return ticket

    def submit_many(self, moves: Iterable[Move | MoveRequest]) -> list[Ticket]:
        return [self.submit(m) for m in moves]

    def _enqueue(self, job: Job) -> None:
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
            local.pairs[(-1, victim.target)].count(Outcome.DROPPED, victim.npages())
            victim.report.counters.merge(local)
            victim.finish(self._clock())

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

    def _pick(self) -> tuple[Job | None, float]:
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
            self._running.add(job)
            self._busy_pids.add(job.pid)
            return job, 0.0
        return None, max(wait, 0.001)

    def _next_bytes(self, job: Job) -> int:
        return min(self.config.batch_pages, max(1, job.npages())) * PS

    def _more_urgent_waiting(self, job: Job) -> bool:
        now = self._clock()
        return any(int(j.priority) < int(job.priority) and j.not_before <= now and j.pid not in self._busy_pids
                   for j in self._queue)

    def _run_job(self, job: Job) -> None:
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
                end = batch_end(job.pages, job.pos, self.config.batch_pages,
                                lambda a: self._in_thp(job.pid, a))
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
                self._running.discard(job)
                if requeue and not job.report.process_exited and job.report.error is None:
                    self._queue.append(job)        # keeps its seq: still the oldest of its class
                else:
                    job.finish(self._clock())
                self._cond.notify_all()

    def _event(self, kind: str, job: Job, **kw) -> None:
        ev = {"event": kind, "pid": job.pid, "target": job.target, "priority": job.priority.name.lower(), **kw}
        self.events.append(ev)
        log.info("mover: %s", ev)

    # ---- accounting ----------------------------------------------------------------------------

    def _count(self, job: Job, src: np.ndarray, target: int, outcomes: Mapping[Outcome, np.ndarray],
               requested: np.ndarray | None = None) -> None:
        """Add per-page outcomes (and requests) to the job's and the engine's counters, per (source,
        target); each mask has one entry per page of ``src``."""
        local = Counters()
        for s in np.unique(src).tolist():
            sel = src == s
            c = local.pairs[(int(s), target)]
            if requested is not None:
                c.requested_pages += int(np.count_nonzero(requested & sel))
            for outcome, mask in outcomes.items():
                n = int(np.count_nonzero(mask & sel))
                if n:
                    c.count(outcome, n)
        with self._cond:
            job.report.counters.merge(local)
            self.counters.merge(local)

    def _sample(self, job: Job, reason: Outcome, addrs: np.ndarray) -> None:
        if len(addrs):
            s = job.report.samples.setdefault(reason, [])
            s.extend(int(a) for a in addrs[:max(0, 8 - len(s))])

    def _landed(self, job: Job, addrs: np.ndarray, nodes: np.ndarray) -> None:
        """Hand on where the pages of a batch are now (the report keeps them too)."""
        rows = landed_runs(job.pid, addrs, nodes)
        if len(rows) == 0:
            return
        with self._cond:
            job.report.landed_parts.append(rows)
        if self.on_landed:
            self.on_landed(rows)

    def _gone(self, job: Job, e: Exception | None, uncounted: int) -> bool:
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
            self._lost(other, other.npages(), Outcome.PROCESS_EXITED)
            with self._cond:
                other.finish(self._clock())
        left = uncounted + (len(job.pages) - job.pos if job.pages is not None else job.npages())
        self._lost(job, left, Outcome.PROCESS_EXITED)
        self._event("process-exited", job, pages_left=left)
        return True

    def _lost(self, job: Job, n: int, reason: Outcome) -> None:
        """``n`` pages of ``job`` end without being tried: counted under (-1, target)."""
        if n > 0:
            self._count(job, np.full(n, -1), job.target, {reason: np.ones(n, dtype=bool)})

    def _job_error(self, job: Job, e: Exception, uncounted: int) -> bool:
        job.report.error = str(e)
        self._lost(job, uncounted + (len(job.pages) - job.pos if job.pages is not None else 0), Outcome.ERROR)
        self._event("error", job, message=str(e))
        return False

    # ---- one batch -----------------------------------------------------------------------------

    def _run_batch(self, job: Job, addrs: np.ndarray) -> bool:
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
        where = np.array(before, dtype=np.int32)       # node of every page once the batch is over
        # Retries re-count outcomes but not requests: the first pass requested these pages already.
        first = np.full(len(addrs), job.attempt == 0)
        notp = ~present
        # -ENOENT: nothing to move; -EFAULT: zero page or no mapping (nothing to move either).
        self._count(job, src, target, {Outcome.ALREADY: before == target,
                                       Outcome.NOT_PRESENT: notp & (before == -_errno.ENOENT),
                                       Outcome.FAULT: notp & (before != -_errno.ENOENT)}, requested=first)
        todo = present & (before != target)
        unsent = len(addrs) - int(np.count_nonzero(todo))
        if unsent:   # the budget was taken for the whole batch; pages with nothing to do give it back
            with self._cond:
                self._bucket(job.priority).refund(unsent * PS)
        if not todo.any():
            self._landed(job, addrs, where)
            return True
        todo_idx = np.flatnonzero(todo)
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
        where[todo_idx] = after
        with self._cond:
            self.counters.batches += 1
            job.report.counters.batches += 1

        moved, elsewhere, vanished, full, shared, fault, refused = \
            self._outcomes(job, addrs_t, src_t, thp, outcome, after)
        if full.any() and job.fallbacks:
            job.full_until = now + self.config.full_backoff_s
        self._count(job, src_t, target, {Outcome.MOVED: moved, Outcome.LANDED_ELSEWHERE: elsewhere,
                                         Outcome.VANISHED: vanished, Outcome.SHARED: shared,
                                         Outcome.FAULT: fault})
        self._sample(job, Outcome.SHARED, addrs_t[shared])
        if vanished.any() and self._gone(job, None, 0):
            return False
        if full.any():
            placed = self._fallback(job, addrs_t[full], src_t[full], thp[full] if thp is not None else None,
                                    uncounted=int(np.count_nonzero(refused)))
            if placed is None:            # the job ended (process gone, a fallback node refused)
                if not job.report.process_exited:
                    known = np.ones(len(addrs), dtype=bool)
                    known[todo_idx[full]] = False
                    self._landed(job, addrs[known], where[known])
                return False
            where[todo_idx[full]] = placed
        if refused.any():
            self._refused(job, addrs_t[refused], src_t[refused])
        self._landed(job, addrs, where)
        return True

    def _outcomes(self, job: Job, addrs: np.ndarray, src: np.ndarray, thp: np.ndarray | None,
                  outcome: numa.BatchResult, after: np.ndarray) -> tuple[np.ndarray, ...]:
        """Masks of a moved batch's pages by what became of them: moved, landed elsewhere, vanished,
        and of those that stayed, why (target full, shared, fault, refused). Counts THPs moved."""
        target = job.target
        moved = after == target
        elsewhere = (after >= 0) & (after != target) & (after != src)
        vanished = after < 0
        stuck = (after >= 0) & (after == src)
        if thp is not None and moved.any():
            with self._cond:
                n = int(np.count_nonzero(thp & moved))
                self.counters.thp_pages_moved += n
                job.report.counters.thp_pages_moved += n
        # Why did the stuck ones stay? Per-page status first (for THP tails, their head's status).
        st = self._page_status(addrs, outcome.status, thp)
        full = stuck & ((st == -_errno.ENOMEM) | ((outcome.error == _errno.ENOMEM) &
                                                  ((st == numa.STATUS_UNREPORTED) | (st == target))))
        shared = stuck & (st == -_errno.EACCES)
        fault = stuck & (st == -_errno.EFAULT)
        refused = stuck & ~full & ~shared & ~fault
        return moved, elsewhere, vanished, full, shared, fault, refused

    def _move_and_verify(self, job: Job, addrs: np.ndarray, node: int, thp: np.ndarray | None,
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
        if not self.config.detect_thp:
            return False
        m = self.kernel.thp(pid, addr, 1)
        return bool(m is not None and m.any())

    def _thp(self, pid: int, addrs: np.ndarray) -> np.ndarray | None:
        """Which pages of a sorted batch are THP-backed (None: none, or it cannot be known)."""
        if not self.config.detect_thp or len(addrs) == 0:
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

    def _fallback(self, job: Job, addrs: np.ndarray, src: np.ndarray, thp: np.ndarray | None,
                  uncounted: int) -> np.ndarray | None:
        """Pages the target had no room for: try the fallback chain in order; what fits nowhere stays.
        Returns the node of every page afterwards, or None when the job must end (``uncounted``: the
        batch's pages still without an outcome, counted then with the rest of the job)."""
        ones = np.ones(len(addrs), dtype=bool)
        self._count(job, src, job.target, {Outcome.TARGET_FULL: ones})
        self._sample(job, Outcome.TARGET_FULL, addrs)
        placed = src.astype(np.int32)
        left = ones.copy()
        for node in job.fallbacks:
            if not left.any():
                break
            # A page already on a fallback node has found its place; it stays.
            stay = left & (src == node)
            left &= ~stay
            if stay.any():
                self._count(job, src, job.target, {Outcome.FALLBACK: stay})
                self._count(job, src, node, {Outcome.ALREADY: stay}, requested=stay)
            if not left.any():
                break
            # Not the THP map from before the target refused: a huge page that found no room there
            # may have been split (mm/migrate.c splits large folios on -ENOMEM and retries).
            sub_thp = self._thp(job.pid, addrs[left]) if thp is not None else None
            outcome, after = self._move_and_verify(job, addrs[left], node, sub_thp, uncounted=uncounted)
            if outcome is None:
                return None
            idx = np.flatnonzero(left)
            placed[idx] = after
            moved_here = np.zeros(len(addrs), dtype=bool)
            moved_here[idx[after == node]] = True
            self._count(job, src, node, {Outcome.MOVED: moved_here}, requested=left)
            self._count(job, src, job.target, {Outcome.FALLBACK: moved_here})
            self._event("fallback", job, node=node, pages=int(moved_here.sum()))
            left &= ~moved_here
            if outcome.error != _errno.ENOMEM and left.any():
                # The fallback had room, yet these did not move: refused there too; they stay.
                self._count(job, src, node, {Outcome.PINNED: left})
                break
            self._count(job, src, node, {Outcome.TARGET_FULL: left})
        return placed

    def _refused(self, job: Job, addrs: np.ndarray, src: np.ndarray) -> None:
        """Busy or pinned pages: retry later with exponential back-off; after the last retry, pinned."""
        if job.attempt >= self.config.max_retries:
            self._count(job, src, job.target, {Outcome.PINNED: np.ones(len(addrs), dtype=bool)})
            self._sample(job, Outcome.PINNED, addrs)
            self._event("pinned", job, pages=len(addrs))
            return
        with self._cond:
            self.counters.retried_pages += len(addrs)
            job.report.counters.retried_pages += len(addrs)
            job.live[0] += 1
            retry = Job(job.pid, job.target, job.fallbacks, job.priority, [], job.report, job.tickets,
                        requested=job.requested, attempt=job.attempt + 1,
                        not_before=self._clock() + self.config.retry_backoff_s * (2 ** job.attempt),
                        live=job.live)
            retry.pages = np.array(addrs, dtype=np.uint64)
            self._queue.append(retry)
            self._cond.notify()
