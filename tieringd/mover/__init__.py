# SPDX-License-Identifier: Apache-2.0
"""The migration engine: carries out moves and reports, page by page, where memory really landed.

The policy decides *what* to move (``contracts.Move``); the engine decides only *how*:

1. **Coalescing.** Requests for the same (pid, target, priority) still waiting in the queue are merged,
   and their ranges page-aligned and merged into sorted, disjoint intervals — many small KV-block moves
   become a few large bursts (slow tiers take large sequential writes best).
2. **Batching.** Intervals are cut into ``move_pages`` calls of ``batch_pages`` base pages. A transparent
   huge page is sent once (its first base page in the batch): the kernel moves the whole folio, and
   sending its tail pages in the same call only earns spurious -EBUSY (they are already isolated).
3. **Budgets.** One token bucket (MB/s) for promotions (PROMOTE, PREFETCH) and one for demotions;
   promotions are picked before demotions; a job yields its worker after ``slice_batches`` batches or
   as soon as more urgent work waits, so one large process never stalls the others.
4. **Verification.** Each batch is bracketed by two ``move_pages`` queries: before (the source node of
   every page — counters are per (source, target)) and after (where every page is now). The status
   array alone cannot be trusted: after a partial failure the kernel leaves it unwritten (see numa.py).
   What the after-query says is handed on as ``LANDED_DTYPE`` runs (``on_landed``, ``Report.landed()``).
5. **Outcomes** (:class:`Outcome`). Per page: moved; already there; landed elsewhere; not present;
   target full (ENOMEM → the next node of the caller's :class:`~tieringd.contracts.FallbackMap`: same
   tier, then slower tiers); refused (busy/pinned → retried with exponential back-off, then reported
   as ``pinned``); shared (mapped by other processes); vanished (unmapped meanwhile); process exited.
6. **Bounded queue.** At ``max_queued`` jobs the oldest job of the lowest priority is dropped (counted).

Modules, one concern each: :mod:`.ranges` (range and page arithmetic), :mod:`.counters` (outcomes,
counters, reports), :mod:`.jobs` (requests, jobs, tickets, the :class:`Kernel` seam), :mod:`.engine`
(:class:`MoverConfig`, :class:`MigrationEngine`), :mod:`.ratelimit` (token buckets), :mod:`.vmstat`
(the kernel's migration counters, to cross-check ours).
"""
from __future__ import annotations

from tieringd.mover.counters import FAILURE_REASONS, Counters, Outcome, PairCounters, Report
from tieringd.mover.engine import MigrationEngine, MoverConfig
from tieringd.mover.jobs import Kernel, MoveRequest, Ticket
from tieringd.mover.ranges import batch_end, coalesce, contiguous_runs, interval_pages, landed_runs, thp_heads
from tieringd.mover.ratelimit import TokenBucket
from tieringd.mover.vmstat import MIGRATION_COUNTERS, vmstat_delta, vmstat_snapshot

__all__ = [
    "FAILURE_REASONS", "MIGRATION_COUNTERS", "Counters", "Kernel", "MigrationEngine", "MoveRequest",
    "MoverConfig", "Outcome", "PairCounters", "Report", "Ticket", "TokenBucket", "batch_end", "coalesce",
    "contiguous_runs", "interval_pages", "landed_runs", "thp_heads", "vmstat_delta", "vmstat_snapshot",
]
