# SPDX-License-Identifier: Apache-2.0
"""The DAX-remap tier, daemon side: memfd-backed KV ranges of shim processes demoted onto a file on
persistent memory (fsdax, or a devdax device) and promoted back, by the shims themselves.

The daemon decides where (an extent of the append-only log, :mod:`tieringd.shim.pmemlog`) and asks; the
shim copies and remaps inside its process (``shim/remap.c``: write-protect, copy, ``MAP_FIXED``;
promotion post-copy) and replies when done. The file travels with the request (SCM_RIGHTS), with
``/dev/userfaultfd`` so that an unprivileged process gets a userfaultfd that handles kernel-mode
faults too. Nothing is taken on trust: before a demotion the range must be a registered memfd region
whose memfd no other process maps; what lives on the file is learnt from ``/proc/PID/maps`` (after a
daemon restart, and whenever a reply did not come); an extent is reused only when no process maps it
and no process holds the POSIX lock a shim takes on its extent while copying.

A pool's shared blocks use the same requests (``share``/``unshare``): the range stays the process's
memfd, punched, and its pages are filled privately from the pool's copy when touched; those are no
extents of the log, and the caller (the pool) says where the copy is.

The loop owns one :class:`DaxTier`: ``capacity()``/``tier_spec()`` for the policy (the slowest tier,
no NUMA node), ``demote``/``promote`` (or ``submit`` from the loop thread), ``extents()`` for where
blocks are, ``reconcile()`` after exits, ``clean()`` when the log runs out of free segments,
``stats()`` for ``tieringctl stats``. docs/dax.md has the design and the figures.
"""
from __future__ import annotations

import collections
import dataclasses
import errno as _errno
import fcntl
import logging
import os
import queue
import struct
import threading
import time
from typing import Any, Callable, Iterable

from tieringd.kernel import procfs
from tieringd.memory import topology as _topology
from tieringd.shim import protocol as P
from tieringd.config import ConfigError, Table, ranged
from tieringd.contracts import DAX_NODE, Tier
from tieringd.shim.pmemlog import Extent, LogFull, LogGeometry, PmemLog, SegmentState

log = logging.getLogger("tieringd.remap")

MiB = 1 << 20
GiB = 1 << 30
PAGE = procfs.PAGE_SIZE
MEMFD_PATH = "/memfd:tieringd-kv"
_FLOCK = struct.Struct("hhqqi4x")        # struct flock on x86-64: type, whence, start, len, pid


@dataclasses.dataclass(frozen=True)
class DaxConfig(Table):
    """The ``[dax]`` table (docs/configuration.md)."""
    NAME = "dax"
    path: str = dataclasses.field(default="", metadata={
        "doc": "a file on an fsdax mount or /dev/daxX.Y; empty: <first fsdax mount>/tieringd/kv.log"})
    size_bytes: int = ranged(0, 0, 1 << 50, unit="bytes",
                             doc="the log's size; 0: 90 % of the mount's free space, or the whole device")
    segment_bytes: int = ranged(64 * MiB, 2 * MiB, 16 * GiB, unit="bytes", doc="cleaning unit of the log")
    max_write_amplification: float = ranged(2.0, 1, 100, lo_open=True, doc=(
        "bytes written to the log per byte demoted, at most (cleaning bound)"))
    reserve_segments: int = ranged(2, 1, 1 << 20, doc="free segments kept for cleaning")
    timeout_s: float = ranged(30.0, 0.001, 86400, doc="how long a remap may take, plus timeout_s_per_gib per GiB")
    timeout_s_per_gib: float = ranged(120.0, 0, 86400, doc="see timeout_s")
    userfaultfd: str = dataclasses.field(default="/dev/userfaultfd", metadata={
        "doc": "sent with each request: a userfaultfd that handles kernel faults for any process"})

    def validate(self) -> None:
        super().validate()
        # what the log itself requires (pmemlog.LogGeometry), checked with the file rather than at open
        if self.segment_bytes % (2 * MiB):
            raise ConfigError.bad_value("dax", "segment_bytes", "a multiple of 2 MiB", self.segment_bytes)
        if self.size_bytes and self.size_bytes // self.segment_bytes <= self.reserve_segments:
            raise ConfigError.bad_value("dax", "size_bytes", f"0 or more than reserve_segments "
                                        f"({self.reserve_segments}) segments of segment_bytes", self.size_bytes)


@dataclasses.dataclass(frozen=True)
class DaxCapacity:
    """What the policy needs of the DAX tier (``plan.TierSpec`` style: tier, nodes, capacity)."""
    tier: Tier
    nodes: tuple[int, ...]
    capacity_bytes: int
    used_bytes: int
    path: str
    kind: str

    @property
    def free_bytes(self) -> int:
        return max(self.capacity_bytes - self.used_bytes, 0)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "tier": self.tier.label, "free_bytes": self.free_bytes}


@dataclasses.dataclass
class RemapReport:
    """What became of one demote or promote request."""
    pid: int
    start: int
    length: int
    direction: P.RemapDirection
    done_bytes: int = 0
    extents: list[tuple[int, int]] = dataclasses.field(default_factory=list)   # (file offset, length)
    error: str | None = None
    code: int = 0                       # errno of the first failure (0: none)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.code == 0 and self.done_bytes == self.length

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "direction": self.direction.name.lower(),
                "errno": _errno.errorcode.get(self.code) if self.code else None}


class RefusedRemap(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


# ---- /proc: who maps what ----------------------------------------------------------------------

def _pids() -> list[int]:
    return procfs.pids()


def mappers(path: str, inode: int, skip: int | None = None) -> dict[int, list[procfs.Vma]]:
    """Every process (but ``skip``) whose maps show ``inode`` under ``path`` (a path prefix for
    memfds, whose names end in " (deleted)"), with those VMAs."""
    out: dict[int, list[procfs.Vma]] = {}
    for pid in _pids():
        if pid == skip:
            continue
        vmas = [v for v in procfs.read_maps(pid, []) if v.inode == inode and v.path.startswith(path)]
        if vmas:
            out[pid] = vmas
    return out


def _file_vmas(vmas: Iterable[procfs.Vma], path: str, inode: int) -> list[procfs.Vma]:
    """The log extents among vmas: writable mappings of the file. A shim reads a shared block of a
    devdax pool through a read-only window (``shim/remap.c``, share): that is no extent."""
    return [v for v in vmas if v.inode == inode and v.path == path and v.writable]


# ---- the tier ------------------------------------------------------------------------------------

def carry(carrier, direction: P.RemapDirection, pid: int, start: int, length: int, node: int,
          done: Callable[[RemapReport], None] | None) -> None:
    """One queued move, in a worker thread: ``carrier.demote``/``promote`` (the tier's own, or the
    pool's carrier), then ``done(report)``; a bug becomes an EIO report, never a dead worker."""
    try:
        rep = carrier.demote(pid, start, length) if direction == P.RemapDirection.DEMOTE \
            else carrier.promote(pid, start, length, node)
    except Exception as e:
        log.exception("move of pid %d failed", pid)
        rep = RemapReport(pid, start, length, direction, error=str(e), code=_errno.EIO)
    if done is not None:
        done(rep)


class DaxTier:
    """One log file (or devdax device), its space (:class:`PmemLog`), and the requests to the shims.

    Calls block until the shim has replied (a demotion of a GiB takes seconds); the loop runs them
    off its thread with :meth:`start`/:meth:`submit`, or calls them from a worker of its own. All
    operations are serialised by one lock."""

    def __init__(self, registry, config: DaxConfig | None = None, *, topology=None,
                 clock: Callable[[], float] = time.monotonic):
        self.registry = registry
        self.config = config or DaxConfig()
        self._topology = topology
        self._clock = clock
        self._lock = threading.RLock()
        self._capacity_before: DaxCapacity | None = None
        self.fd: int | None = None
        self.uffd_dev: int | None = None
        self.path = ""
        self.kind = ""
        self.inode = 0
        self.log: PmemLog | None = None
        self.counters = {d: collections.Counter() for d in ("demote", "promote", "relocate", "share", "unshare")}
        self.refused: collections.Counter = collections.Counter()
        self.reports: collections.deque[RemapReport] = collections.deque(maxlen=64)
        self._queue: queue.Queue = queue.Queue()
        self._working = 0                # 1 while the worker carries a request out
        self._worker: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------------
    def open(self, cfg: dict[str, Any] | None = None, *, foreign: bool = False) -> "DaxTier":
        """Open (or create and preallocate) the log, then learn what already lives there.
        ``cfg``: the parsed config file, for topology (None reads the default file). ``foreign``: a
        pool's device, written only where :meth:`own` allows (tieringd/pool/)."""
        topo = self._topology or _topology.discover(cfg if cfg is not None else {})
        where = _topology.remap_tier(topo, {"dax": {"path": self.config.path}})
        if where is None:
            raise FileNotFoundError("no DAX-remap tier: no fsdax mount, and [dax] path is not set")
        self.path, self.kind = where.path, where.kind
        if where.kind == "devdax":
            fd = os.open(where.path, os.O_RDWR | os.O_CLOEXEC)
            size = self.config.size_bytes or int(where.size_bytes or 0)
        else:
            os.makedirs(os.path.dirname(where.path), mode=0o700, exist_ok=True)
            fd = os.open(where.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            size = self._file_size(fd, where)
        self.fd = fd
        self.inode = os.fstat(fd).st_ino
        g = LogGeometry(size_bytes=size - size % self.config.segment_bytes,
                        segment_bytes=self.config.segment_bytes,
                        max_write_amplification=self.config.max_write_amplification,
                        reserve_segments=self.config.reserve_segments)
        self.log = PmemLog(g, clock=self._clock, foreign=foreign)
        try:
            self.uffd_dev = os.open(self.config.userfaultfd, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            log.info("no %s (%s): only privileged processes can be remapped", self.config.userfaultfd,
                     e.strerror)
        adopted = self.recover()
        log.info("DAX tier on %s (%s): %d segments of %d MiB, %d extents in use", self.path, self.kind,
                 g.segments, g.segment_bytes // MiB, adopted)
        self.capacity()                   # the figures the first request's callers are answered with
        return self

    def _file_size(self, fd: int, where) -> int:
        have = os.fstat(fd).st_size
        want = self.config.size_bytes
        if not want:
            if have:
                return have
            st = os.statvfs(os.path.dirname(where.path))
            want = int(st.f_bavail * st.f_frsize * 0.9)
        want -= want % self.config.segment_bytes
        if have < want:
            # Preallocated, so the log's writes never wait on block allocation and its extents are
            # as contiguous as the filesystem can make them.
            os.posix_fallocate(fd, 0, want)
        return max(have, want)

    def close(self) -> None:
        self.stop()
        for fd in (self.fd, self.uffd_dev):
            if fd is not None:
                os.close(fd)
        self.fd = self.uffd_dev = None

    def __enter__(self) -> "DaxTier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- what lives on the file ------------------------------------------------------------------
    def _locked_by(self, offset: int, length: int) -> int | None:
        """The pid holding a POSIX lock on the range (a shim copying there), or None."""
        req = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, offset, length, 0)
        got = _FLOCK.unpack(fcntl.fcntl(self.fd, fcntl.F_GETLK, req))
        return got[4] if got[0] != fcntl.F_UNLCK else None

    def recover(self) -> int:
        """Adopt every extent some process maps (a restarted daemon starts here), and keep segments a
        shim is copying into (its lock) away from the head. Returns how many extents were adopted."""
        with self._lock:
            n = self._adopt_mapped()
            for seg in self.log.segments:
                if seg.state != SegmentState.FREE:
                    continue
                holder = self._locked_by(seg.index * self.log.geometry.segment_bytes,
                                         self.log.geometry.segment_bytes)
                if holder is not None:
                    seg.state = SegmentState.SEALED      # reconcile() frees it once the lock is gone
                    seg.sealed_at = self._clock()
                    log.info("segment %d is locked by pid %d (a remap in flight): kept", seg.index, holder)
            return n

    def _adopt_mapped(self) -> int:
        """Adopt every range of the file some process maps that the log does not know. The kernel
        merges the mappings of extents adjacent in memory and in the file into one VMA, which may
        span segments and known extents: only the unknown parts are adopted, one piece per segment,
        or the next segment would look free and be written over."""
        n, seg_bytes = 0, self.log.geometry.segment_bytes
        # the daemon's own mappings are not extents (a pool's header and the view it hashes through)
        for pid, vmas in mappers(self.path, self.inode, skip=os.getpid()).items():
            for v in _file_vmas(vmas, self.path, self.inode):
                at = v.offset
                while at < v.offset + v.length:
                    end = min((at // seg_bytes + 1) * seg_bytes, v.offset + v.length)
                    for lo, hi in self._unknown_parts(at, end):
                        try:
                            self.log.adopt(lo, hi - lo, pid, v.start + (lo - v.offset))
                            n += 1
                        except ValueError as e:
                            log.warning("pid %d maps %s inconsistently with the log: %s", pid, self.path, e)
                    at = end
        return n

    def _unknown_parts(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The parts of lo..hi (inside one segment) that no extent of the log covers."""
        seg = self.log.segment_of(lo)
        parts, at = [], lo
        for a, b in sorted((e.offset, e.end) for e in seg.extents.values() if e.offset < hi and lo < e.end):
            if a > at:
                parts.append((at, a))
            at = max(at, b)
        return parts + ([(at, hi)] if at < hi else [])

    def extents(self, pid: int | None = None) -> list[Extent]:
        """The ranges that live on the DAX tier now (all processes, or one)."""
        with self._lock:
            return sorted((e for e in self.log.extents() if pid is None or e.pid == pid),
                          key=lambda e: (e.pid, e.start))

    def reconcile(self) -> int:
        """Release extents whose process no longer maps them (freed, exited, promoted while we were
        not listening). An extent that its owner does not map is released only after a scan of every
        process finds nobody else mapping it either (a child that inherited it across fork).
        Returns the bytes released."""
        with self._lock:
            by_pid: dict[int, list[Extent]] = collections.defaultdict(list)
            for e in self.log.extents():
                by_pid[e.pid].append(e)
            doubtful = []
            for pid, exts in by_pid.items():
                spans = [(v.offset, v.offset + v.length)
                         for v in _file_vmas(procfs.read_maps(pid, []), self.path, self.inode)]
                doubtful += [e for e in exts if not any(lo <= e.offset and e.end <= hi for lo, hi in spans)]
            freed = 0
            if doubtful:
                others = mappers(self.path, self.inode, skip=os.getpid())
                for e in doubtful:
                    held = any(v.offset <= e.offset and e.end <= v.offset + v.length
                               for vmas in others.values() for v in vmas)
                    if not held and self._locked_by(e.offset, e.length) is None:
                        self.log.release(e.offset, e.length)
                        freed += e.length
            # A remap a killed daemon asked for ends after the restart: what it left mapped is adopted
            # before the segments kept for its lock may be freed.
            self._adopt_mapped()
            for seg in self.log.segments:         # segments kept for a lock that is gone
                if seg.state == SegmentState.SEALED and not seg.extents and \
                        self._locked_by(seg.index * self.log.geometry.segment_bytes,
                                        self.log.geometry.segment_bytes) is None:
                    seg.state = SegmentState.FREE
            return freed

    # ---- a pool's claims (tieringd/pool/) ----------------------------------------------------------
    def own(self, segments: Iterable[int]) -> None:
        """Segments this host claimed in the pool: the log may write there."""
        with self._lock:
            for i in segments:
                self.log.own(i)

    def disown_free(self, count: int, keep: Iterable[int] = ()) -> list[int]:
        """Up to ``count`` empty segments given back (the last ones first, away from the head);
        ``keep``: never these. Returns their indexes."""
        with self._lock:
            kept = set(keep)
            out = []
            for seg in reversed(self.log.segments):
                if len(out) >= count:
                    break
                if seg.state == SegmentState.FREE and seg.index not in kept and self.log.disown(seg.index):
                    out.append(seg.index)
            return out

    def segment_states(self) -> list[SegmentState]:
        with self._lock:
            return [s.state for s in self.log.segments]

    # ---- the policy's view -------------------------------------------------------------------------
    def capacity(self) -> DaxCapacity:
        """The tier's size and what is live on it. The worker holds the lock for a whole request,
        waiting for the shim's reply — which the loop's own registry poll reads. So this never waits
        for the lock (the loop calls it every tick): during a request it answers with the figures
        taken before it; admission counts the bytes on their way there itself."""
        if not self._lock.acquire(blocking=False):
            return self._capacity_before
        try:
            self._capacity_before = DaxCapacity(Tier.DAX, (DAX_NODE,), self.log.capacity_bytes,
                                                self.log.live_bytes, self.path, self.kind)
            return self._capacity_before
        finally:
            self._lock.release()

    def tier_spec(self, other_bytes: float = 0.0):
        """``plan.TierSpec`` for this tier: the slowest tier, whose one node is ``DAX_NODE`` (no NUMA
        node: the loop hands moves to it to :meth:`demote` through ``daemon.daxmover.DaxMover``)."""
        from tieringd.placement.plan import TierSpec
        c = self.capacity()
        return TierSpec(tier=c.tier, nodes=c.nodes, capacity_bytes=float(c.capacity_bytes), other_bytes=other_bytes)

    # ---- requests ----------------------------------------------------------------------------------
    def _timeout(self, length: int) -> float:
        return self.config.timeout_s + self.config.timeout_s_per_gib * length / GiB

    def _fds(self) -> list[int]:
        return [self.fd] + ([self.uffd_dev] if self.uffd_dev is not None else [])

    def _check_memfd(self, pid: int, start: int, length: int) -> None:
        """The range is a registered, unpinned memfd region of pid, in memory now, and no other
        process maps its memfd (a child sharing it would see the pages punched away)."""
        if length <= 0 or start % PAGE or length % PAGE:
            raise RefusedRemap(_errno.EINVAL, f"{start:#x}+{length:#x}: not page-aligned")
        region = self.registry.region_around(pid, start, length)
        if region is None:
            raise RefusedRemap(_errno.ENOENT, f"pid {pid} has no registered region around {start:#x}+{length:#x}")
        if not region.flags & P.Flag.MEMFD or region.flags & (P.Flag.PINNED | P.Flag.INHERITED):
            raise RefusedRemap(_errno.EINVAL, f"region {region.start:#x} of pid {pid} is not a private "
                               "memfd region (TIERINGD_BACKING=memfd, not pinned, not inherited)")
        vmas = [v for v in procfs.read_maps(pid, []) if v.end > start and v.start < start + length]
        memfds = {v.inode for v in vmas if v.path.startswith(MEMFD_PATH) and v.shared}
        if len(memfds) != 1 or any(v.inode not in memfds for v in vmas):
            raise RefusedRemap(_errno.EINVAL, f"{start:#x}+{length:#x} of pid {pid} is not all in memory "
                               "(part of it is on the DAX tier already?)")
        others = mappers(MEMFD_PATH, memfds.pop(), skip=pid)
        if others:
            raise RefusedRemap(_errno.EBUSY, f"the memfd of {start:#x} is also mapped by pid "
                               f"{min(others)} (shared across fork): not remapped")

    def _send(self, pid: int, msg: P.Remap) -> tuple[int, str]:
        """(0, "") on ACK, else (errno, reason). A missing reply is settled from /proc/PID/maps."""
        try:
            reply = self.registry.request(pid, msg, timeout=self._timeout(msg.length), fds=self._fds())
        except LookupError as e:
            return _errno.ESRCH, str(e)
        except TimeoutError as e:
            return self._settle(pid, msg, str(e))
        if isinstance(reply, P.Ack):
            return 0, ""
        if isinstance(reply, P.Error):
            return reply.code or _errno.EIO, reply.message
        return _errno.EPROTO, f"unexpected reply {reply.TYPE.name}"

    def _settle(self, pid: int, msg: P.Remap, why: str) -> tuple[int, str]:
        """No reply in time: what the process maps says whether the remap happened. While the shim
        still holds the extent's lock it has not finished: wait for it (it finishes on its own)."""
        deadline = time.monotonic() + self._timeout(msg.length)
        while self._locked_by(msg.file_offset, msg.length) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        if msg.direction in (P.RemapDirection.SHARE, P.RemapDirection.UNSHARE):
            return _errno.ETIMEDOUT, why        # the range maps the memfd either way: maps cannot tell
        vmas = _file_vmas(procfs.read_maps(pid, []), self.path, self.inode)
        on_file = any(v.start <= msg.start and msg.start + msg.length <= v.end
                      and v.offset + (msg.start - v.start) == msg.file_offset for v in vmas)
        done = on_file if msg.direction == P.RemapDirection.DEMOTE else not on_file
        return (0, "") if done else (_errno.ETIMEDOUT, why)

    def demote(self, pid: int, start: int, length: int) -> RemapReport:
        """Move ``start``+``length`` of pid onto the log (in as many extents as the segments need)."""
        rep = RemapReport(pid, start, length, P.RemapDirection.DEMOTE)
        t0 = time.monotonic()
        with self._lock:
            try:
                self._check_memfd(pid, start, length)
                self._demote_pieces(pid, start, length, rep, relocation=False)
            except RefusedRemap as e:
                rep.code, rep.error = e.code, str(e)
        return self._finish("demote", rep, t0)

    def _demote_pieces(self, pid: int, start: int, length: int, rep: RemapReport, relocation: bool) -> None:
        at = 0
        while at < length:
            ext = self._allocate(length - at, pid, start + at, relocation)
            code, why = self._send(pid, P.Remap(start=start + at, length=ext.length, file_offset=ext.offset,
                                                direction=P.RemapDirection.DEMOTE))
            if code:
                # Never written, or written and rolled back: dead either way.
                self.log.release(ext.offset, ext.length)
                raise RefusedRemap(code, why)
            rep.extents.append((ext.offset, ext.length))
            rep.done_bytes += ext.length
            at += ext.length

    def _allocate(self, length: int, pid: int, start: int, relocation: bool) -> Extent:
        for _ in range(len(self.log.segments) + 1):
            try:
                if self.log.needs_cleaning() and not relocation:
                    self._clean_one()
                return self.log.allocate(length, pid, start, relocation=relocation, partial=True)
            except LogFull:
                if relocation or not self._clean_one():
                    raise RefusedRemap(_errno.ENOSPC, f"the DAX log is full ({self.log.live_bytes} live bytes "
                                       f"of {self.log.capacity_bytes}; no segment cleanable within "
                                       f"write amplification {self.log.geometry.max_write_amplification})")
        raise RefusedRemap(_errno.ENOSPC, "the DAX log is full")

    def promote(self, pid: int, start: int, length: int, node: int = -1) -> RemapReport:
        """Bring the parts of ``start``+``length`` of pid that live on the log back into memory (on
        ``node`` when ≥ 0, else by the region's own policy)."""
        rep = RemapReport(pid, start, length, P.RemapDirection.PROMOTE)
        t0 = time.monotonic()
        with self._lock:
            end = start + length
            pieces = [(e, max(e.start, start), min(e.start + e.length, end)) for e in self.log.extents()
                      if e.pid == pid and e.start < end and start < e.start + e.length]
            if not pieces:
                rep.code, rep.error = _errno.ENOENT, f"nothing of {start:#x}+{length:#x} of pid {pid} is on the DAX tier"
            for ext, lo, hi in sorted(pieces, key=lambda p: p[1]):
                off = ext.offset + (lo - ext.start)
                code, why = self._send(pid, P.Remap(start=lo, length=hi - lo, file_offset=off,
                                                    direction=P.RemapDirection.PROMOTE, node=node))
                if code:
                    rep.code, rep.error = code, why
                    break
                self.log.release(off, hi - lo)
                rep.extents.append((off, hi - lo))
                rep.done_bytes += hi - lo
            if pieces and not rep.code:
                rep.length = rep.done_bytes      # what was on the tier, all of it back
        return self._finish("promote", rep, t0)

    def share(self, pid: int, start: int, length: int, file_offset: int) -> RemapReport:
        """Let ``start``+``length`` of pid, whose bytes equal the file's at ``file_offset`` (a copy the
        pool published), be filled from there page by page when touched; its memory is given back.
        Bytes that differ: ``ESTALE``, nothing changed. Not an extent of the log: the caller owns
        ``file_offset`` and keeps the copy there until :meth:`unshare` (or the process's exit)."""
        rep = RemapReport(pid, start, length, P.RemapDirection.SHARE)
        t0 = time.monotonic()
        with self._lock:
            try:
                self._check_memfd(pid, start, length)      # a child mapping the memfd would read zeros
                self._sharing(pid, P.Remap(start=start, length=length, file_offset=file_offset,
                                           direction=P.RemapDirection.SHARE), rep)
            except RefusedRemap as e:
                rep.code, rep.error = e.code, str(e)
        return self._finish("share", rep, t0)

    def unshare(self, pid: int, start: int, length: int, file_offset: int, node: int = -1) -> RemapReport:
        """Fill every page of a shared range not filled yet from the file (on ``node`` when ≥ 0): plain
        memory of pid again. ``ENOENT``: not shared (any more: the shim unshares every range at a
        fork and when its daemon connection drops)."""
        rep = RemapReport(pid, start, length, P.RemapDirection.UNSHARE)
        t0 = time.monotonic()
        with self._lock:
            self._sharing(pid, P.Remap(start=start, length=length, file_offset=file_offset,
                                       direction=P.RemapDirection.UNSHARE, node=node), rep)
        return self._finish("unshare", rep, t0)

    def _sharing(self, pid: int, msg: P.Remap, rep: RemapReport) -> None:
        code, why = self._send(pid, msg)
        if code:
            rep.code, rep.error = code, why
        else:
            rep.extents.append((msg.file_offset, msg.length))
            rep.done_bytes = msg.length

    def _finish(self, kind: str, rep: RemapReport, t0: float) -> RemapReport:
        rep.seconds = time.monotonic() - t0
        c = self.counters[kind]
        c["requests"] += 1
        c["bytes"] += rep.done_bytes
        c["seconds_us"] += int(rep.seconds * 1e6)
        if rep.code:
            c["failed"] += 1
            self.refused[_errno.errorcode.get(rep.code, str(rep.code))] += 1
            log.info("%s of pid %d %#x+%#x: %s", kind, rep.pid, rep.start, rep.length, rep.error)
        self.reports.append(rep)
        return rep

    # ---- cleaning ----------------------------------------------------------------------------------
    def clean(self, max_segments: int = 1) -> int:
        """Free up to ``max_segments`` segments by moving their live extents to the head (through the
        shims: promote, then demote again). Returns the segments freed."""
        with self._lock:
            return sum(1 for _ in range(max_segments) if self._clean_one())

    def _clean_one(self) -> bool:
        seg = self.log.pick_victim()
        if seg is None:
            return False
        for ext in sorted(seg.extents.values(), key=lambda e: e.offset):
            rep = RemapReport(ext.pid, ext.start, ext.length, P.RemapDirection.DEMOTE)
            t0 = time.monotonic()
            code, why = self._send(ext.pid, P.Remap(start=ext.start, length=ext.length, file_offset=ext.offset,
                                                    direction=P.RemapDirection.PROMOTE))
            if code == 0:
                self.log.release(ext.offset, ext.length, moved=True)
                try:
                    self._demote_pieces(ext.pid, ext.start, ext.length, rep, relocation=True)
                except RefusedRemap as e:
                    # In memory now (promoted), not lost: it just left the tier.
                    rep.code, rep.error = e.code, str(e)
            else:
                rep.code, rep.error = code, why
            self._finish("relocate", rep, t0)
            if code:
                self.log.abandon_cleaning(seg)
                return False
        return True

    # ---- the loop's worker -------------------------------------------------------------------------
    def start(self) -> "DaxTier":
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name="tieringd-dax", daemon=True)
            self._worker.start()
        return self

    def stop(self, timeout: float | None = 30.0) -> None:
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(timeout)
            self._worker = None

    def submit(self, direction: P.RemapDirection, pid: int, start: int, length: int, node: int = -1,
               done: Callable[[RemapReport], None] | None = None) -> None:
        """Queue a demote/promote for the worker thread; ``done(report)`` is called from it."""
        self._queue.put((direction, pid, start, length, node, done))

    def pending(self) -> int:
        """Requests queued or being carried out now."""
        return self._queue.qsize() + self._working

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._working = 1
            try:
                carry(self, *item)
            finally:
                self._working = 0

    # ---- reports -----------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """For ``tieringctl stats``: the log (space, write amplification and its bound) and the
        requests (bytes, failures by errno, throughput)."""
        out: dict[str, Any] = {"path": self.path, "kind": self.kind,
                               "userfaultfd_device": self.uffd_dev is not None,
                               "log": self.log.stats() if self.log else None, "requests": {},
                               "in_flight": self.pending()}
        for kind, c in self.counters.items():
            secs = c["seconds_us"] / 1e6
            out["requests"][kind] = {"requests": c["requests"], "failed": c["failed"], "bytes": c["bytes"],
                                     "seconds": round(secs, 6),
                                     "mb_s": round(c["bytes"] / MiB / secs, 1) if secs else None}
        out["failed_by_errno"] = dict(self.refused)
        return out
