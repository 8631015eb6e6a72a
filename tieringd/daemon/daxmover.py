# SPDX-License-Identifier: Apache-2.0
"""The DAX-remap tier in the loop: moves to and from it, and where its blocks are.

The policy sees the DAX-remap tier (:class:`tieringd.shim.remap.DaxTier`: a log file on fsdax or a
devdax device) as the slowest tier, ``Tier.DAX``, whose one "node" is :data:`tieringd.contracts.DAX_NODE`
in the block table. A planned move into or out of it is not a ``move_pages`` call: the shim of the
process copies and remaps the range itself (``shim/remap.c``), asked by the tier's worker thread.
:class:`DaxMover` is the carrier admission hands those moves to — the same interface as the
migration engine and the shim mover: ``submit(move)`` returns a handle whose ``done()`` says when it
is over, and what was verified afterwards flows back as ``LANDED_DTYPE`` rows, by the same path as
the engine's.

Verification: after a request, whatever its reply, the process's own ``/proc/PID/maps`` says which
part of the range maps the tier's file (those blocks are on the DAX tier) and ``move_pages`` where the
rest is (a sampled page per stretch, as for the shim's moves). The mappings are the truth: a daemon
that restarts learns the same from them (:meth:`DaxMover.ranges_of`, ``DaxTier.recover``).

:class:`Carriers` routes a move to the DAX mover when it goes to or comes from the DAX tier, and to
the engine (or the shims' REBIND before 6.5) otherwise.
"""
from __future__ import annotations

import dataclasses
import errno
import logging
import threading
from typing import Callable

import numpy as np

from tieringd.contracts import DAX_NODE, Move
from tieringd.daemon.moves import MoveStats, landed_runs_from
from tieringd.kernel import procfs
from tieringd.kernel.procfs import PAGE_SIZE
from tieringd.shim import protocol as P

log = logging.getLogger("tieringd.daemon")

PAGES_PER_BLOCK = 16           # pages asked per 2 MiB of a range not on the file (as ShimMover)


@dataclasses.dataclass(eq=False)
class DaxMove:
    """One remap request in flight; ``done()`` once the tier's worker has answered and the range
    was looked at."""
    move: Move
    error: str | None = None
    done_bytes: int = 0
    finished: threading.Event = dataclasses.field(default_factory=threading.Event)

    def done(self) -> bool:
        return self.finished.is_set()


class DaxMover:
    """Carries moves to and from the DAX-remap tier. ``tier`` is an opened, started
    :class:`~tieringd.shim.remap.DaxTier`; ``locate(pid, addrs) -> nodes`` is
    ``AccessSignal.nodes_of``; ``on_landed(rows)`` takes the verified placement (from the tier's
    worker thread, as the engine's workers do); ``stats`` counts failed pages by reason."""

    def __init__(self, tier, locate: Callable[[int, np.ndarray], np.ndarray],
                 on_landed: Callable[[np.ndarray], None], stats: MoveStats, shared=None):
        self.tier = tier
        self.locate = locate
        self.on_landed = on_landed
        self.stats = stats
        # with [pool]: tieringd.pool.dedup.SharedBlocks carries the moves (blocks kept once in the
        # pool, the log for the rest); its ranges are on the DAX tier though they map the memfd
        self.shared = shared
        self.carrier = shared if shared is not None else tier

    # ---- the carrier -------------------------------------------------------------------------------
    def submit(self, m: Move) -> DaxMove:
        handle = DaxMove(m)
        demote = m.to_node == DAX_NODE
        self.carrier.submit(P.RemapDirection.DEMOTE if demote else P.RemapDirection.PROMOTE,
                         m.pid, m.start, m.length, node=-1 if demote else m.to_node,
                         done=lambda rep, h=handle: self._done(h, rep))
        return handle

    def _done(self, handle: DaxMove, rep) -> None:
        """In the tier's worker thread: count what failed, verify where the range is, hand it on."""
        m = handle.move
        handle.done_bytes = rep.done_bytes
        if rep.code:
            handle.error = errno.errorcode.get(rep.code, str(rep.code)).lower()
            self.stats.count_failures({f"dax-{handle.error}": max(m.length - rep.done_bytes, 0) // PAGE_SIZE})
        try:
            rows = self.placement(m.pid, m.start, m.length)
            if len(rows):
                self.on_landed(rows)
        except OSError as e:
            log.debug("pid %d: cannot ask where %#x+%#x is: %s", m.pid, m.start, m.length, e)
        finally:
            handle.finished.set()

    # ---- where blocks are -----------------------------------------------------------------------
    def ranges_of(self, pid: int) -> list[tuple[int, int]]:
        """(start, length) of every range of ``pid`` that maps the tier's file now, and of those
        that map the pool's shared copy of their bytes (filled on access: docs/pool.md)."""
        path, inode = self.tier.path, self.tier.inode
        shared = [(r.start, r.length) for r in self.shared.of(pid)] if self.shared is not None else []
        return [(v.start, v.end - v.start) for v in procfs.read_maps(pid, [])
                if v.inode == inode and v.path.startswith(path)] + shared

    def placement(self, pid: int, start: int, length: int) -> np.ndarray:
        """``LANDED_DTYPE`` rows for ``start``+``length`` of pid: the parts that map the tier's file
        on :data:`DAX_NODE`, the rest where ``move_pages`` finds it (sampled pages, each standing
        for the stretch up to the next; pages nowhere are left out)."""
        end = start + length
        on_file = sorted((max(s, start), min(s + n, end)) for s, n in self.ranges_of(pid)
                         if s < end and start < s + n)
        rows: list[tuple[int, int, int, int]] = []
        at = start
        for lo, hi in on_file + [(end, end)]:
            if at < lo:
                rows += self._in_memory(pid, at, lo)
            if lo < hi:
                rows.append((pid, lo, (hi - lo) // PAGE_SIZE, DAX_NODE))
            at = max(at, hi)
        return landed_runs_from(rows)

    def _in_memory(self, pid: int, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
        step = max(PAGE_SIZE, (2 << 20) // PAGES_PER_BLOCK)
        addrs = np.arange(lo, hi, step, dtype=np.uint64)
        nodes = np.asarray(self.locate(pid, addrs), np.int64)
        out = []
        for a, n in zip(addrs.tolist(), nodes.tolist()):
            if n >= 0:
                out.append((pid, a, min(step, hi - a) // PAGE_SIZE, n))
        return out

    def free_bytes(self) -> int:
        """Room left on the tier (admission takes off what is already on its way there): the log's,
        and with the pool what it can still take as shared blocks."""
        shared = self.shared.room_bytes() if self.shared is not None else 0
        return self.tier.capacity().free_bytes + shared

    def tier_spec(self, other_bytes: float = 0.0):
        """The tier for the policy: the log's capacity, and with the pool the shared blocks' bytes
        and room beside it."""
        spec = self.tier.tier_spec(other_bytes)
        if self.shared is None:
            return spec
        extra = self.shared.shared_bytes() + self.shared.room_bytes()
        return dataclasses.replace(spec, capacity_bytes=spec.capacity_bytes + float(extra))


class Carriers:
    """Admission's one carrier: a move to or from the DAX tier goes to ``dax``, the rest to ``memory``
    (the migration engine, or the shims' REBIND before 6.5)."""

    def __init__(self, memory, dax: DaxMover | None):
        self.memory, self.dax = memory, dax

    def submit(self, m: Move):
        if self.dax is not None and DAX_NODE in (m.to_node, m.from_node):
            return self.dax.submit(m)
        return self.memory.submit(m)
