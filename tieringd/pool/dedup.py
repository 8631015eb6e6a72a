# SPDX-License-Identifier: Apache-2.0
"""Identical KV stored once, the process side: the pool's moves to and from the DAX-remap tier.

With ``[pool]`` set, a cold block the policy sends to the DAX tier is not appended to this host's
log: its bytes (read from the process's memory) go to the pool's index
(:meth:`PoolAgent.store_block`), which finds another host's equal copy — compared byte for byte,
never on a hash alone — or publishes this host's. The process's shim then maps that copy
(``REMAP SHARE``, shim/remap.c): its memfd range is compared with the copy under write-protection,
punched, and filled page by page from the copy on access, each filled page the process's own. So
the pool holds the block once, and a write by the process never reaches it: no other host sees it.

A block promoted back is ``UNSHARE``d (the rest of it filled, the range plain memory again) and its
reference dropped. A block the index cannot take (no room, etcd away, this host not a member) or
whose bytes changed meanwhile goes to the log as before (``DaxTier.demote``).

References live on this host's lease. So that no process ever fills a page from a copy the pool
may have given to another host, every shared range is unshared when the lease is in doubt: etcd
away for a third of its TTL, or the agent reporting references lost; the shims unshare by
themselves when the daemon goes (shim/remap.c), and a restarted daemon starts with none.

One worker thread (``tieringd-pool-share``) carries the moves, as the tier's own worker does when
there is no pool; :class:`tieringd.daemon.daxmover.DaxMover` hands them here.
"""
from __future__ import annotations

import collections
import dataclasses
import errno
import logging
import queue
import threading
import time
from typing import Callable

from tieringd.kernel import procfs
from tieringd.shim import protocol as P
from tieringd.shim.remap import RemapReport, carry

log = logging.getLogger("tieringd.pool")

BLOCK_BYTES = 2 << 20          # the unit kept once: one PMD, the DAX tier's copy unit


@dataclasses.dataclass(frozen=True)
class SharedRange:
    pid: int
    start: int
    length: int
    digest: str
    offset: int                  # of the pool's copy on the device


class SharedBlocks:
    """``agent``: the :class:`~tieringd.pool.agent.PoolAgent`; ``tier``: its DAX-remap tier."""

    def __init__(self, agent, tier, read_memory: Callable[[int, int, int], bytes] | None = None):
        self.agent, self.tier = agent, tier
        self.read_memory = read_memory or read_process_memory
        self.ranges: dict[tuple[int, int], SharedRange] = {}
        self.users: collections.Counter = collections.Counter()     # digest -> ranges mapping it
        self.counters: collections.Counter = collections.Counter()
        self._lock = threading.Lock()           # ranges/users: the worker writes, reports read
        self._queue: queue.Queue = queue.Queue()
        self._working = 0
        self._worker: threading.Thread | None = None
        self._lost_seen = agent.lost_references
        self._unsharing: set[tuple[int, int]] = set()   # queued by a sweep, not carried out yet

    # ---- the carrier (DaxMover's interface to the tier) ----------------------------------------
    def start(self) -> "SharedBlocks":
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name="tieringd-pool-share", daemon=True)
            self._worker.start()
        return self

    def stop(self, timeout: float | None = 30.0) -> None:
        """Before the agent revokes the lease: every shared range becomes its process's own memory
        again (after the lease, the pool may give the copies' extents to another host)."""
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(timeout)
            self._worker = None
        with self._lock:
            ranges = list(self.ranges.values())
        for r in ranges:
            if not self._unshare(r, -1):
                log.warning("pool: pid %d %#x+%#x not unshared at stop", r.pid, r.start, r.length)

    def submit(self, direction: P.RemapDirection, pid: int, start: int, length: int, node: int = -1,
               done: Callable[[RemapReport], None] | None = None) -> None:
        self._queue.put((direction, pid, start, length, node, done))

    def pending(self) -> int:
        return self._queue.qsize() + self._working

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if item[0] == "release":       # references of exited processes (sweep)
                for digest in item[1]:
                    self._drop_user(digest)
                continue
            self._working = 1
            try:
                carry(self, *item)
            finally:
                self._working = 0

    # ---- demote: keep it once ----------------------------------------------------------------------
    def demote(self, pid: int, start: int, length: int) -> RemapReport:
        rep = RemapReport(pid, start, length, P.RemapDirection.DEMOTE)
        for lo in range(start, start + length, BLOCK_BYTES):
            n = min(BLOCK_BYTES, start + length - lo)
            if not self._share_one(pid, lo, n):
                piece = self.tier.demote(pid, lo, n)        # this host's log, as without a pool
                if piece.code:
                    rep.code, rep.error = piece.code, piece.error
                    break
            rep.done_bytes += n
        return rep

    def _share_one(self, pid: int, lo: int, n: int) -> bool:
        """True when the block now maps the pool's one copy."""
        if self._lease_in_doubt():
            return False
        try:
            data = self.read_memory(pid, lo, n)
            ref = self.agent.store_block(data)
        except Exception as e:          # noqa: BLE001 - etcd away, the process gone: the log takes it
            self.counters["store-failed"] += 1
            log.debug("pid %d %#x: not shared: %s", pid, lo, e)
            return False
        if ref is None:
            self.counters["no-room"] += 1
            return False
        with self._lock:
            self.users[ref.digest] += 1         # before the shim maps it: a sweep must not drop it
        rep = self.tier.share(pid, lo, n, ref.entry.offset)
        if rep.code:
            self.counters["share-" + errno.errorcode.get(rep.code, str(rep.code)).lower()] += 1
            self._drop_user(ref.digest)
            return False
        with self._lock:
            self.ranges[(pid, lo)] = SharedRange(pid, lo, n, ref.digest, ref.entry.offset)
        self.counters["referenced" if not ref.published else "published"] += 1
        return True

    def _drop_user(self, digest: str) -> None:
        with self._lock:
            self.users[digest] -= 1
            last = self.users[digest] <= 0
            if last:
                del self.users[digest]
        if last:
            try:
                self.agent.release_block(digest)
            except Exception as e:      # noqa: BLE001 - the lease takes it when etcd is away
                log.info("pool: reference %s… not dropped now (%s): its lease ends it", digest[:12], e)

    # ---- promote: one's own copy again -----------------------------------------------------------
    def promote(self, pid: int, start: int, length: int, node: int = -1) -> RemapReport:
        rep = RemapReport(pid, start, length, P.RemapDirection.PROMOTE)
        end = start + length
        mine = sorted((r for r in self.of(pid) if r.start < end and start < r.start + r.length),
                      key=lambda r: r.start)
        for r in mine:
            if not self._unshare(r, node, rep):
                return rep
        if any(e.pid == pid and e.start < end and start < e.start + e.length for e in self.tier.extents(pid)):
            piece = self.tier.promote(pid, start, length, node)
            rep.done_bytes += piece.done_bytes
            rep.code, rep.error = piece.code, piece.error
        elif not mine:
            rep.code, rep.error = errno.ENOENT, f"nothing of {start:#x}+{length:#x} of pid {pid} is in the pool"
        return rep

    def _unshare(self, r: SharedRange, node: int, rep: RemapReport | None = None) -> bool:
        got = self.tier.unshare(r.pid, r.start, r.length, r.offset, node)
        if got.code and got.code not in (errno.ESRCH, errno.ENOENT):
            if rep is not None:
                rep.code, rep.error = got.code, got.error
            return False
        with self._lock:
            self.ranges.pop((r.pid, r.start), None)
            self._unsharing.discard((r.pid, r.start))
        self._drop_user(r.digest)
        if rep is not None:
            rep.done_bytes += r.length
        return True

    # ---- bookkeeping -------------------------------------------------------------------------------
    def of(self, pid: int) -> list[SharedRange]:
        with self._lock:
            return [r for r in self.ranges.values() if r.pid == pid]

    def _lease_in_doubt(self) -> bool:
        lost_at = self.agent.etcd_lost_at
        away = lost_at is not None and time.monotonic() - lost_at > self.agent.cfg.lease_ttl_s / 3
        return away or self.agent.lost_references != self._lost_seen or self.agent.member.state != "member"

    def sweep(self) -> None:
        """At each heartbeat (the agent's thread): drop what exited processes referenced, and unshare
        everything while the lease is in doubt."""
        with self._lock:
            ranges = list(self.ranges.values())
        gone = [r for r in ranges if not procfs.alive(r.pid)]
        with self._lock:
            for r in gone:
                self.ranges.pop((r.pid, r.start), None)
        if gone:
            # one etcd transaction per reference: the worker does them, never the heartbeat's thread
            # (hundreds of them once held its lease past the TTL in the lab, and the host lost it)
            self._queue.put(("release", [r.digest for r in gone]))
        ranges = [r for r in ranges if r not in gone]
        if ranges and self._lease_in_doubt():
            log.warning("pool: the lease is in doubt (%s): unsharing %d blocks",
                        self.agent.etcd_error or self.agent.member.why or "references lost", len(ranges))
            for r in ranges:
                with self._lock:
                    queued = (r.pid, r.start) in self._unsharing
                    self._unsharing.add((r.pid, r.start))
                if not queued:
                    self.submit(P.RemapDirection.PROMOTE, r.pid, r.start, r.length, -1)
        self._lost_seen = self.agent.lost_references

    def shared_bytes(self, pid: int | None = None) -> int:
        with self._lock:
            return sum(r.length for r in self.ranges.values() if pid is None or r.pid == pid)

    def room_bytes(self) -> int:
        """Bytes more the pool can take from this host as shared blocks."""
        return self.agent.shared_room_bytes()

    def stats(self) -> dict:
        with self._lock:
            return {"ranges": len(self.ranges), "bytes": sum(r.length for r in self.ranges.values()),
                    "blocks": len(self.users), **dict(self.counters)}


def read_process_memory(pid: int, addr: int, length: int) -> bytes:
    """``length`` bytes at ``addr`` of pid, all of them or OSError."""
    data = procfs.read_mem(pid, addr, length)
    if len(data) != length:
        raise OSError(errno.EIO, f"pid {pid}: read {len(data)} of {length} bytes at {addr:#x}")
    return data
