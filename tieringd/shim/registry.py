# SPDX-License-Identifier: Apache-2.0
"""The daemon side of the shim protocol: which regions of which processes hold KV memory.

Any process can load the shim, so nothing a shim says is believed without checking. Every record
is decoded strictly (:mod:`tieringd.shim.protocol`); the sender is identified by ``SO_PEERCRED`` (never by
what it claims); each registered range is verified against the sender's own ``/proc/PID/maps``
(:func:`tieringd.kernel.procfs.read_maps`): mapped without holes, the right kind of mapping, not
overlapping another registration. A refusal is logged, remembered (:attr:`Registry.refusals`) and
answered with an ERROR record; the connection stays up. A process's table is dropped when its
connection closes or, through a pidfd, when the process exits — whichever comes first.

Used by the daemon loop (``Registry.poll`` each tick, or ``serve`` in a thread) and, for tests and
for running it alone, ``python -m tieringd.shim.registry --run-dir DIR --events``: one JSON line per event.
docs/protocol.md lists the rules.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import errno
import json
import logging
import os
import selectors
import signal
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable, Iterable

from tieringd.kernel import sysfs
from tieringd.shim import protocol as P
from tieringd.kernel.procfs import PAGE_SIZE, Vma, read_maps
from tieringd.kernel.unixsock import close_listener, remove_stale_socket
from tieringd.contracts import RegionKey

log = logging.getLogger("tieringd.registry")

REGION_ALIGN = 2 << 20          # the shim maps its regions on 2 MiB boundaries
USER_ADDR_LIMIT = 1 << 56       # above any user address, 4- or 5-level paging
MEMFD_PREFIX = "/memfd:tieringd-kv"
MAX_REGIONS_PER_PROCESS = 65536
# Records read from one connection per poll: a shim that sends without pause (or a fuzzer) must not
# hold the loop, which also ticks and answers the control socket; epoll reports the rest next time.
RECORDS_PER_POLL = 64
_ucred = struct.Struct("iII")


class Refused(Exception):
    def __init__(self, code: int, reason: str):
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclasses.dataclass
class Region:
    """A verified range of one process's address space that holds (or may hold) KV tensors."""
    pid: int
    start: int
    length: int
    flags: P.Flag
    policy: P.Policy
    source: P.Source
    node: int | None
    tag: str
    region_id: int
    registered_ns: int

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def key(self) -> RegionKey:
        return RegionKey(self.pid, self.start)

    @property
    def pinned(self) -> bool:
        return bool(self.flags & P.Flag.PINNED)

    def as_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "start": self.start, "length": self.length,
                "flags": [f.name.lower() for f in P.Flag if self.flags & f],
                "policy": self.policy.label, "source": self.source.name.lower(), "node": self.node,
                "tag": self.tag, "region_id": self.region_id}


@dataclasses.dataclass
class Process:
    pid: int
    uid: int
    gid: int
    agent: str = ""
    min_bytes: int = 0
    policy: P.Policy = P.Policy.NONE
    regions: dict[int, Region] = dataclasses.field(default_factory=dict)   # by start

    @property
    def total_bytes(self) -> int:
        return sum(r.length for r in self.regions.values())


@dataclasses.dataclass(frozen=True)
class Refusal:
    time: float
    pid: int
    uid: int
    msg_type: str
    code: int
    reason: str


def verify_range(maps: list[Vma], start: int, length: int, flags: P.Flag,
                 remap_file: tuple[str, int] | None = None) -> None:
    """The checks against the sender's own maps; raises Refused. See docs/protocol.md.
    ``remap_file`` (path, inode): the DAX-remap tier's file; inside a memfd region a shared mapping
    of it is a range the daemon had remapped there (only the daemon opens that root-owned file and
    hands it to shims), so a region re-registered after a daemon restart is accepted."""
    end = start + length
    pos = start
    for vma in maps:
        if vma.end <= pos:
            continue
        if vma.start > pos:
            break
        if vma.stack or vma.no_struct_pages:
            raise Refused(errno.EACCES, f"{pos:#x} is in {vma.path}, which is never a KV region")
        if not vma.readable or not vma.writable:
            raise Refused(errno.EACCES, f"{vma.start:#x}-{vma.end:#x} is not readable and writable "
                          f"({vma.perms})")
        if flags & P.Flag.FOREIGN:
            pass  # memory the app pinned itself: any ordinary read-write mapping
        elif flags & P.Flag.MEMFD:
            on_tier = remap_file is not None and vma.shared and vma.inode == remap_file[1] and \
                vma.path == remap_file[0]
            if not on_tier and (not vma.path.startswith(MEMFD_PREFIX) or not vma.shared):
                raise Refused(errno.EINVAL, f"{vma.start:#x}-{vma.end:#x} is not a shared "
                              f"{MEMFD_PREFIX} mapping (backing claimed memfd)")
        elif not vma.anonymous:
            raise Refused(errno.EINVAL, f"{vma.start:#x}-{vma.end:#x} is {vma.path or 'shared'}, "
                          "not private anonymous memory (backing claimed anonymous)")
        pos = vma.end
        if pos >= end:
            return
    raise Refused(errno.EFAULT, f"{pos:#x} is not mapped in this process "
                  f"(range {start:#x}+{length:#x} does not belong to it)")


class _Conn:
    def __init__(self, sock: socket.socket, pid: int, uid: int, gid: int):
        self.sock = sock
        self.pid, self.uid, self.gid = pid, uid, gid
        self.hello: P.Hello | None = None
        self.pidfd: int | None = None
        self.seq = 0
        self.replies: dict[int, P.Message] = {}
        self.callbacks: dict[int, Callable[[P.Message | None], None]] = {}   # send_request()
        self.refused_ids: collections.deque[int] = collections.deque(maxlen=4096)
        self.refusals = 0
        self.unsent = 0             # replies dropped: the shim did not read its socket
        self.closed = False
        self.maps: list[Vma] | None = None     # the process's maps as read during this batch of records

    def next_seq(self) -> int:
        self.seq = (self.seq + 1) & 0xFFFFFFFF
        return self.seq


class Registry:
    """Listens on ``run_dir/registry.sock``; keeps one :class:`Process` table per connected shim."""

    def __init__(self, run_dir: str | None = None, *, shim_config: P.Config | None = None,
                 on_event: Callable[[str, dict], None] | None = None,
                 max_regions_per_process: int = MAX_REGIONS_PER_PROCESS):
        """``shim_config``: the CONFIG record sent to every shim at HELLO (the ``[shim]`` table's,
        :meth:`tieringd.shim.settings.ShimSettings.to_message`); assign a new one to change it."""
        self.run_dir = run_dir or P.run_dir()
        self.path = P.socket_path(self.run_dir)
        self.shim_config = shim_config
        self.on_event = on_event
        self.max_regions = max_regions_per_process
        self.refusals: collections.deque[Refusal] = collections.deque(maxlen=1000)
        self._procs: dict[int, Process] = {}
        self._conns: dict[int, _Conn] = {}     # by pid
        self._sel = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._lock = threading.RLock()
        self._replied = threading.Condition(self._lock)
        self.polled_elsewhere = False   # another thread polls (serve(), or an event loop): request() waits
        self.remap_file: tuple[str, int] | None = None   # the DAX-remap tier's file (path, inode)
        self._accept_warned_at = -10.0

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> "Registry":
        os.makedirs(self.run_dir, mode=0o755, exist_ok=True)
        remove_stale_socket(self.path, socket.SOCK_SEQPACKET, "another registry")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        sock.bind(self.path)
        # Any user's shim may connect: what it says is verified, never trusted.
        os.chmod(self.path, 0o666)
        sock.listen(128)
        sock.setblocking(False)
        self._listener = sock
        self._sel.register(sock, selectors.EVENT_READ, ("listen", None))
        log.info("registry listening on %s", self.path)
        return self

    def close(self) -> None:
        with self._lock:
            for conn in list(self._conns.values()):
                self._drop(conn, "registry closing")
            if self._listener is not None:
                close_listener(self._sel, self._listener, self.path)
                self._listener = None
            self._sel.close()

    def __enter__(self) -> "Registry":
        return self.start() if self._listener is None else self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- queries -----------------------------------------------------------------------------------
    def processes(self) -> list[Process]:
        with self._lock:
            return sorted(self._procs.values(), key=lambda p: p.pid)

    def regions(self, pid: int | None = None) -> list[Region]:
        with self._lock:
            procs = [self._procs[pid]] if pid is not None and pid in self._procs else \
                [] if pid is not None else list(self._procs.values())
            return sorted((r for p in procs for r in p.regions.values()), key=lambda r: r.key)

    def region_around(self, pid: int, start: int, length: int = 1) -> Region | None:
        """The registered region of ``pid`` that holds all of ``start``..``start + length``."""
        return next((r for r in self.regions(pid) if r.start <= start and start + length <= r.end), None)

    # ---- event loop --------------------------------------------------------------------------------
    def fileno(self) -> int:
        """The registry's own epoll descriptor: readable when :meth:`poll` has something to do, so
        an outer event loop can wait on it and call ``poll(0)``."""
        return self._sel.fileno()

    def poll(self, timeout: float | None = 0.0) -> int:
        """Handle what is ready (waiting up to ``timeout`` s); returns the number of events handled."""
        handled = 0
        for key, _ in self._sel.select(timeout):
            kind, conn = key.data
            with self._lock:
                if kind == "listen":
                    self._accept()
                elif kind == "conn" and not conn.closed:
                    self._read(conn)
                elif kind == "pidfd" and not conn.closed:
                    self._drop(conn, "process exited")
            handled += 1
        return handled

    def serve(self, stop: threading.Event, tick: float = 0.2) -> None:
        """Poll until ``stop`` is set (run it in a thread; :meth:`request` then only waits)."""
        self.polled_elsewhere = True
        try:
            while not stop.is_set():
                self.poll(tick)
        finally:
            self.polled_elsewhere = False

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as e:       # EMFILE, ENFILE: the shim waits in the backlog, then retries
                now = time.monotonic()
                if now - self._accept_warned_at >= 10.0:
                    self._accept_warned_at = now
                    log.warning("registry: cannot accept a shim: %s", e.strerror or e)
                return
            sock.setblocking(False)
            pid, uid, gid = _ucred.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                          _ucred.size))
            conn = _Conn(sock, pid, uid, gid)
            self._sel.register(sock, selectors.EVENT_READ, ("conn", conn))
            try:
                conn.pidfd = os.pidfd_open(pid)
                self._sel.register(conn.pidfd, selectors.EVENT_READ, ("pidfd", conn))
            except (OSError, AttributeError) as e:
                # Without a pidfd the connection's end still drops the table (exit closes it).
                log.debug("no pidfd for pid %d (%s): relying on the connection closing", pid, e)
            log.debug("shim connected: pid %d uid %d", pid, uid)

    def _read(self, conn: _Conn) -> None:
        conn.maps = None            # a batch reads the maps once (_on_register), the next one anew
        for _ in range(RECORDS_PER_POLL):
            if conn.closed:
                return
            try:
                data, _, flags, _ = conn.sock.recvmsg(P.MAX_RECORD + 1)
            except BlockingIOError:
                return
            except OSError as e:
                self._drop(conn, f"connection error: {e.strerror}")
                return
            if not data:
                self._drop(conn, "connection closed")
                return
            self._handle(conn, data[: P.MAX_RECORD + 1])

    def _handle(self, conn: _Conn, data: bytes) -> None:
        try:
            msg = P.decode(data)
        except P.ProtocolError as e:
            self._refuse(conn, "?", e.code, str(e), e.seq)
            return
        name = msg.TYPE.name
        try:
            if isinstance(msg, P.Hello):
                self._on_hello(conn, msg)
            elif conn.hello is None:
                raise Refused(errno.EPROTO, f"{name} before HELLO")
            elif isinstance(msg, P.Register):
                self._on_register(conn, msg)
            elif isinstance(msg, P.Unregister):
                self._on_unregister(conn, msg)
            elif isinstance(msg, P.Reset):
                self._on_reset(conn)
            elif isinstance(msg, (P.Ack, P.Error, P.Pong)):
                callback = conn.callbacks.pop(msg.ref_seq, None)
                if callback is not None:
                    callback(msg)
                    return
                conn.replies[msg.ref_seq] = msg
                self._replied.notify_all()
                if isinstance(msg, P.Error):
                    log.info("pid %d answered request %d with an error: %s", conn.pid, msg.ref_seq, msg)
            else:
                raise Refused(errno.EOPNOTSUPP, f"{name} is a control request: they go daemon → shim")
        except Refused as r:
            if isinstance(msg, P.Register):
                conn.refused_ids.append(msg.region_id)
            self._refuse(conn, name, r.code, r.reason, msg.seq)

    def _on_hello(self, conn: _Conn, msg: P.Hello) -> None:
        if conn.hello is not None:
            raise Refused(errno.EPROTO, "second HELLO on one connection")
        if msg.pid != conn.pid:
            raise Refused(errno.EPERM, f"HELLO claims pid {msg.pid}, but the peer is pid {conn.pid}")
        old = self._conns.get(conn.pid)
        if old is not None and old is not conn:
            # The same pid again: the process exec()ed, and its old connection's close is still queued.
            self._drop(old, "replaced by a new connection from the same pid (exec)")
        conn.hello = msg
        self._conns[conn.pid] = conn
        try:
            policy = P.Policy(msg.policy)
        except ValueError:
            policy = P.Policy.NONE
        self._procs[conn.pid] = Process(conn.pid, conn.uid, conn.gid, msg.agent, msg.min_bytes, policy)
        self._emit("hello", {"pid": conn.pid, "uid": conn.uid, "agent": msg.agent,
                             "min_bytes": msg.min_bytes, "policy": policy.label})
        if self.shim_config is not None:
            self._send(conn, dataclasses.replace(self.shim_config))   # a copy: _send sets its seq

    def _on_register(self, conn: _Conn, msg: P.Register) -> None:
        proc = self._procs[conn.pid]
        start, length = msg.start, msg.length
        try:
            flags = P.Flag(msg.flags)
            policy = P.Policy(msg.policy)
            source = P.Source(msg.source)
        except ValueError:
            raise Refused(errno.EINVAL, f"unknown flags {msg.flags:#x}, policy {msg.policy} or "
                          f"source {msg.source}") from None
        if msg.flags & ~P.WIRE_FLAGS:
            raise Refused(errno.EINVAL, f"unknown flag bits {msg.flags & ~P.WIRE_FLAGS:#x}")
        if length == 0 or start % PAGE_SIZE or length % PAGE_SIZE:
            raise Refused(errno.EINVAL, f"{start:#x}+{length:#x}: start and length must be non-zero "
                          f"multiples of the page size")
        if start + length > USER_ADDR_LIMIT:
            raise Refused(errno.EFAULT, f"{start:#x}+{length:#x} is not a user address range")
        if not flags & P.Flag.FOREIGN and start % REGION_ALIGN:
            raise Refused(errno.EINVAL, f"{start:#x}: shim regions start on a 2 MiB boundary")
        existing = proc.regions.get(start)
        same = existing is not None and existing.length == length
        if not same:
            for r in proc.regions.values():
                if r.start < start + length and start < r.end:
                    raise Refused(errno.EEXIST, f"{start:#x}+{length:#x} overlaps registered region "
                                  f"{r.start:#x}+{r.length:#x}")
            if len(proc.regions) >= self.max_regions:
                raise Refused(errno.ENOSPC, f"more than {self.max_regions} regions")
        # A shim registers its regions one after another: the first REGISTER of a batch reads the
        # maps, the rest of the batch checks against them (reading them per record, with a few
        # hundred mappings, held registration to about 300 a second). A range they do not show
        # may have been mapped since: the maps are read again before it is refused.
        cached = conn.maps is not None
        if not cached:
            conn.maps = self._maps_of(conn.pid)
        try:
            verify_range(conn.maps, start, length, flags, self.remap_file)
        except Refused:
            if not cached:
                raise
            conn.maps = self._maps_of(conn.pid)
            verify_range(conn.maps, start, length, flags, self.remap_file)
        region = Region(conn.pid, start, length, flags, policy, source,
                        None if msg.node < 0 else msg.node, msg.tag, msg.region_id, time.monotonic_ns())
        proc.regions[start] = region
        self._emit("update" if same else "register", region.as_dict())

    @staticmethod
    def _maps_of(pid: int) -> list[Vma]:
        try:
            return read_maps(pid)
        except sysfs.SysfsError as e:
            if e.errno == errno.ENOENT:
                raise Refused(errno.ESRCH, f"process {pid} is gone") from None
            raise Refused(errno.EACCES, f"cannot verify: {e}") from None

    def _on_unregister(self, conn: _Conn, msg: P.Unregister) -> None:
        proc = self._procs[conn.pid]
        region = proc.regions.get(msg.start)
        if region is None or region.length != msg.length:
            # Benign when the region was refused, or came and went before the shim's resync: a
            # removal can only ever shrink what we hold, so it is ignored, not refused.
            log.debug("pid %d: UNREGISTER of unknown %#x+%#x ignored", conn.pid, msg.start, msg.length)
            return
        del proc.regions[msg.start]
        self._emit("unregister", region.as_dict())

    def _on_reset(self, conn: _Conn) -> None:
        proc = self._procs[conn.pid]
        dropped = len(proc.regions)
        proc.regions.clear()
        self._emit("reset", {"pid": conn.pid, "dropped": dropped})

    def _refuse(self, conn: _Conn, name: str, code: int, reason: str, seq: int) -> None:
        conn.refusals += 1
        self.refusals.append(Refusal(time.time(), conn.pid, conn.uid, name, code, reason))
        if conn.refusals <= 10 or conn.refusals % 1000 == 0:
            log.warning("refused %s from pid %d (uid %d): %s [%s]%s", name, conn.pid, conn.uid, reason,
                        errno.errorcode.get(code, code),
                        f" ({conn.refusals} refusals so far)" if conn.refusals > 10 else "")
        self._emit("refuse", {"pid": conn.pid, "uid": conn.uid, "type": name, "code": code,
                              "errno": errno.errorcode.get(code, str(code)), "reason": reason})
        self._send(conn, P.Error(ref_seq=seq, code=code, message=reason[:103]))

    def _send(self, conn: _Conn, msg: P.Message, fds: Iterable[int] = ()) -> int:
        msg.seq = conn.next_seq()
        try:
            fds = list(fds)
            if fds:     # SCM_RIGHTS (a REMAP's DAX file): the shim gets its own copies
                socket.send_fds(conn.sock, [msg.encode()], fds, socket.MSG_DONTWAIT)
            else:
                conn.sock.send(msg.encode(), socket.MSG_DONTWAIT)
        except BlockingIOError:
            conn.unsent += 1        # logged as refusals are: a client that never reads floods nothing
            if conn.unsent <= 10 or conn.unsent % 1000 == 0:
                log.info("pid %d is not reading its socket: %s dropped (%d so far)", conn.pid,
                         msg.TYPE.name, conn.unsent)
        except OSError as e:
            self._drop(conn, f"send failed: {e.strerror}")
        return msg.seq

    def _drop(self, conn: _Conn, why: str) -> None:
        if conn.closed:
            return
        conn.closed = True
        for fd in (conn.sock, conn.pidfd):
            if fd is None:
                continue
            try:
                self._sel.unregister(fd)
            except (KeyError, ValueError):
                pass
        conn.sock.close()
        if conn.pidfd is not None:
            os.close(conn.pidfd)
        callbacks, conn.callbacks = conn.callbacks, {}
        for callback in callbacks.values():       # no reply will come: say so once
            callback(None)
        if self._conns.get(conn.pid) is conn:
            del self._conns[conn.pid]
            proc = self._procs.pop(conn.pid, None)
            if proc is not None:
                self._emit("exit", {"pid": conn.pid, "why": why, "dropped": len(proc.regions)})
        log.debug("pid %d dropped: %s", conn.pid, why)

    def _emit(self, kind: str, data: dict) -> None:
        if self.on_event is not None:
            self.on_event(kind, data)

    # ---- control channel -----------------------------------------------------------------------------
    def send_request(self, pid: int, msg: P.Message,
                     on_reply: Callable[[P.Message | None], None]) -> bool:
        """Send a control request without waiting: ``on_reply(reply)`` runs inside a later
        :meth:`poll` with the ACK, PONG or ERROR — or with None when the connection ends first.
        Returns False (and never calls ``on_reply``) when pid has no shim or the send failed."""
        if msg.TYPE not in P.CONTROL_TYPES:
            raise ValueError(f"{msg.TYPE.name} is not a control request")
        with self._lock:
            conn = self._conns.get(pid)
            if conn is None or conn.closed:
                return False
            msg.seq = conn.next_seq()
            try:
                conn.sock.send(msg.encode(), socket.MSG_DONTWAIT)
            except BlockingIOError:
                log.info("pid %d is not reading its socket: %s not sent", pid, msg.TYPE.name)
                return False
            except OSError as e:
                self._drop(conn, f"send failed: {e.strerror}")
                return False
            conn.callbacks[msg.seq] = on_reply
            return True

    def request(self, pid: int, msg: P.Message, timeout: float = 2.0, fds: Iterable[int] = ()) -> P.Message:
        """Send a control request to pid's shim and wait for its reply (ACK, PONG or ERROR).

        ``fds`` are passed with the record (SCM_RIGHTS; the caller keeps its own copies open).
        Control requests are obeyed only by shims whose registry runs as root (docs/protocol.md).
        Raises LookupError when pid has no shim connected, TimeoutError when no reply comes."""
        if msg.TYPE not in P.CONTROL_TYPES:
            raise ValueError(f"{msg.TYPE.name} is not a control request")
        with self._lock:
            conn = self._conns.get(pid)
            if conn is None:
                raise LookupError(f"pid {pid} has no shim connected")
            seq = self._send(conn, msg, fds)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if seq in conn.replies:
                    return conn.replies.pop(seq)
                if conn.closed:
                    raise LookupError(f"pid {pid} went away before answering")
                if self.polled_elsewhere:     # another thread polls: wait for it to see the reply
                    self._replied.wait(min(0.1, max(0.0, deadline - time.monotonic())))
                    continue
            self.poll(min(0.05, max(0.0, deadline - time.monotonic())))
        raise TimeoutError(f"pid {pid} did not answer {msg.TYPE.name} within {timeout} s")


def _main(argv: Iterable[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tieringd.shim.registry",
                                 description="Run the shim registry alone (tests, debugging).")
    ap.add_argument("--run-dir", default=None, help=f"socket directory (default {P.run_dir()})")
    ap.add_argument("--events", action="store_true", help="print one JSON line per event on stdout")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="tieringd.shim.registry: %(message)s")

    def emit(kind: str, data: dict) -> None:
        sys.stdout.write(json.dumps({"event": kind, **data}) + "\n")
        sys.stdout.flush()

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    reg = Registry(args.run_dir, on_event=emit if args.events else None)
    try:
        reg.start()
    except (OSError, RuntimeError) as e:
        sys.stderr.write(f"tieringd.shim.registry: cannot listen on {reg.path}: {e}\n")
        return 1
    if args.events:
        emit("listening", {"path": reg.path, "pid": os.getpid()})
    try:
        reg.serve(stop)
    finally:
        reg.close()
    return 0


if __name__ == "__main__":
    sys.exit(_main())
