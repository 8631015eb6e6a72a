# SPDX-License-Identifier: Apache-2.0
"""When a watched process exits or execs: the netlink proc connector, or polling /proc where the
connector is not available.

The registry already learns an exit from the shim's connection and a pidfd; this covers every pid the
daemon holds state for (a migration asked through the control socket, a process whose shim connection
outlives it in a child) and, above all, ``exec``: the old address space is gone, so what the daemon
knew about it is stale even while the pid lives on.

- **Proc connector** (``CONFIG_PROC_EVENTS``, ``drivers/connector/cn_proc.c``): pyroute2's
  :class:`~pyroute2.ProcEventSocket` subscribes and its marshal decodes the records; the socket is
  read here, non-blocking, when the daemon's selector says it is readable (:meth:`ProcessWatcher.handle`).
  Subscribing needs CAP_NET_ADMIN before Linux 6.6 (unprivileged listeners: bfdfdc2f3b70,
  "connector/cn_proc: Allow non-root users access"); outside the initial pid namespace the kernel
  ignores the subscription, which shows as no answer within a second;
  an overflowed socket (``ENOBUFS``: events lost) is answered by checking every watched pid at once.
  The event's ``timestamp_ns`` is CLOCK_MONOTONIC (``ktime_get_ns``), the clock of
  :attr:`tieringd.shim.registry.Region.registered_ns`, so an exec can be told from a registration after it.
- **Polling** (:func:`tieringd.kernel.procfs.process_identity`): a thread checks the watched pids
  every ``poll_interval_ms`` and hands
  events over through an eventfd, so both look the same to the loop. It sees an exec only when the
  executable or the command line changes (not a re-exec of the same command line).

``[lifecycle] source = "auto"`` takes the connector when it subscribes, else polls; ``"netlink"``
makes a failure to subscribe an error; ``"poll"`` always polls. :attr:`ProcessWatcher.mechanism`
says which runs (the daemon's status shows it).
"""
from __future__ import annotations

import collections
import dataclasses
import errno
import logging
import os
import select
import socket
import struct
import threading
import time
from typing import Callable, Iterable


from tieringd.kernel import procfs
from tieringd.config import ConfigError, Table, ranged

log = logging.getLogger("tieringd.lifecycle")

SOURCES = ("auto", "netlink", "poll")


@dataclasses.dataclass(frozen=True)
class LifecycleConfig(Table):
    """The ``[lifecycle]`` table."""
    NAME = "lifecycle"
    source: str = "auto"             # auto | netlink | poll
    poll_interval_ms: int = ranged(1000, 10, 3_600_000, unit="milliseconds")  # how often the poll source looks for exits and execs

    def validate(self) -> None:
        super().validate()
        if self.source not in SOURCES:
            raise ConfigError.bad_value("lifecycle", "source", " or ".join(f'"{s}"' for s in SOURCES),
                                        self.source)


@dataclasses.dataclass(frozen=True)
class ProcessEvent:
    kind: str           # "exit" | "exec"
    pid: int            # the thread-group id (the process)
    time_ns: int        # CLOCK_MONOTONIC


class LifecycleUnavailable(RuntimeError):
    pass


def process_gone(pid: int) -> bool:
    """The process has no running thread left: no /proc entry, or a zombie (or dead) thread-group
    leader without other threads (a leader that called pthread_exit is a zombie too, while its
    threads run on)."""
    fields = procfs.read_stat(pid)
    if fields is None:
        return True
    if fields[0] not in ("Z", "X"):
        return False
    return procfs.thread_count(pid) <= 1


# ---- the netlink proc connector ---------------------------------------------------------------------

class _Connector:
    """Subscribed proc-connector socket; :meth:`read` returns the exec/exit records waiting."""

    ACK_TIMEOUT_S = 1.0
    _ERR_OFFSET = 52    # nlmsghdr 16 + cn_msg 20 + proc_event's what, cpu, timestamp_ns: ack.err

    def __init__(self) -> None:
        # Imported here: pyroute2 is only needed where the connector is used.
        from pyroute2 import ProcEventSocket
        from pyroute2.netlink import NLMSG_DONE
        from pyroute2.netlink.connector import cn_proc
        self._cn = cn_proc
        try:
            self._nl = ProcEventSocket()
            self._nl.bind()
        except OSError as e:
            raise LifecycleUnavailable(f"no netlink connector socket: {e.strerror or e}") from None
        # Our own non-blocking reads of the same socket: pyroute2's asyncio reader runs only inside
        # its get(), never called here (its control() waits for the ack without a timeout, and the
        # kernel sends none to a process outside the initial pid namespace).
        self._sock = socket.socket(fileno=os.dup(self._nl.fileno()))
        self._sock.setblocking(False)
        self._marshal = cn_proc.ProcEventMarshal()
        self._what = struct.Struct("=I")
        self._wanted = {cn_proc.PROC_EVENT_EXEC, cn_proc.PROC_EVENT_EXIT}
        self._done = NLMSG_DONE
        self._subscribed = False
        try:
            # sent on our socket too: pyroute2's put() would run its reader, which takes the ack
            self._control(cn_proc.PROC_CN_MCAST_LISTEN)
            err = self._wait_ack()
        except Exception:
            self.close()
            raise
        self._subscribed = not err
        if err:
            self.close()
            why = "not permitted (CAP_NET_ADMIN is needed before Linux 6.6)" if err == errno.EPERM \
                else os.strerror(err)
            raise LifecycleUnavailable(f"cannot subscribe to process events: {why}")

    def _control(self, action: int) -> None:
        msg = self._cn.proc_event_control()
        msg["action"] = action
        msg["idx"], msg["val"], msg["len"] = self._cn.CN_IDX_PROC, self._cn.CN_VAL_PROC, 4
        msg["header"]["type"], msg["header"]["flags"] = self._done, 0
        msg.encode()
        self._sock.sendto(msg.data, (0, 0))

    def _wait_ack(self) -> int:
        """The error code of the kernel's answer to our PROC_CN_MCAST_LISTEN (cn_proc_ack)."""
        deadline = time.monotonic() + self.ACK_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([self._sock], [], [], left)[0]:
                break
            try:
                data = self._sock.recv(65536)
            except BlockingIOError:
                continue
            if len(data) >= self._ERR_OFFSET + 4 and \
                    self._what.unpack_from(data, self._marshal.key_offset)[0] == self._cn.PROC_EVENT_NONE:
                return self._what.unpack_from(data, self._ERR_OFFSET)[0]
        raise LifecycleUnavailable("the proc connector did not answer the subscription (outside the "
                                   "initial pid namespace, or CONFIG_PROC_EVENTS off)")

    def fileno(self) -> int:
        return self._sock.fileno()

    def read(self) -> tuple[list[dict], bool]:
        """(records, overflowed). Only exec and exit records are decoded; forks and the rest are
        skipped by their ``what`` field (at the marshal's key offset) before any decoding."""
        out, overflow = [], False
        while True:
            try:
                data = self._sock.recv(65536)
            except BlockingIOError:
                return out, overflow
            except OSError as e:
                if e.errno == errno.ENOBUFS:
                    overflow = True
                    continue
                raise
            if len(data) < self._marshal.key_offset + 4:
                continue
            (what,) = self._what.unpack_from(data, self._marshal.key_offset)
            if what in self._wanted:
                out.extend(self._marshal.parse(data))

    def close(self) -> None:
        if self._subscribed:
            # The kernel counts listeners globally and only IGNORE lowers the count (before 6.6 a
            # closed socket left it raised, and every fork/exec/exit kept paying for the events).
            try:
                self._control(self._cn.PROC_CN_MCAST_IGNORE)
            except OSError:
                pass
            self._subscribed = False
        self._sock.close()
        try:
            self._nl.close()
        except Exception:
            pass


# ---- the watcher ------------------------------------------------------------------------------------

class ProcessWatcher:
    """Tells ``on_event(ProcessEvent)`` when a watched pid exits or execs.

    Loop thread: :meth:`watch` (the pids that matter), :meth:`handle` when :meth:`fileno` is readable
    (``daemon.add_reader(w.fileno(), w.handle)``), :meth:`close`. ``on_event`` runs inside handle()."""

    def __init__(self, cfg: LifecycleConfig | None = None,
                 on_event: Callable[[ProcessEvent], None] | None = None):
        self.cfg = cfg = cfg or LifecycleConfig()
        self.on_event = on_event
        self._watched: frozenset[int] = frozenset()
        self._connector: _Connector | None = None
        self._poller: _Poller | None = None
        self.events_seen = collections.Counter()
        self.overflows = 0
        why = None
        if cfg.source in ("auto", "netlink"):
            try:
                self._connector = _Connector()
            except LifecycleUnavailable as e:
                if cfg.source == "netlink":
                    raise
                why = str(e)
        if self._connector is not None:
            self.mechanism = "netlink proc connector"
            self.why = "subscribed to the kernel's process events"
        else:
            self._poller = _Poller(cfg.poll_interval_ms / 1000.0)
            self.mechanism = "/proc polling"
            self.why = why or "[lifecycle] source = \"poll\""
        log.info("process lifecycle: %s (%s)", self.mechanism, self.why)

    def fileno(self) -> int:
        return self._connector.fileno() if self._connector is not None else self._poller.fileno()

    def watch(self, pids: Iterable[int]) -> None:
        self._watched = frozenset(int(p) for p in pids)
        if self._poller is not None:
            self._poller.watch(self._watched)

    @property
    def watched(self) -> frozenset[int]:
        return self._watched

    def handle(self) -> list[ProcessEvent]:
        """Read what is waiting; calls ``on_event`` for each event of a watched pid and returns them."""
        events = self._from_connector() if self._connector is not None else self._poller.drain()
        for ev in events:
            self.events_seen[ev.kind] += 1
            if self.on_event is not None:
                self.on_event(ev)
        return events

    def _from_connector(self) -> list[ProcessEvent]:
        records, overflow = self._connector.read()
        watched = self._watched
        out: list[ProcessEvent] = []
        for r in records:
            tgid = r.get("process_tgid")
            if tgid not in watched:
                continue
            if r["what"] == self._connector._cn.PROC_EVENT_EXEC:
                out.append(ProcessEvent("exec", tgid, r["timestamp_ns"]))
            elif process_gone(tgid):       # a thread's exit, or the leader's while threads run on
                out.append(ProcessEvent("exit", tgid, r["timestamp_ns"]))
        if overflow:
            self.overflows += 1
            log.warning("process events were lost (the connector socket overflowed): checking every "
                        "watched pid")
            now = time.monotonic_ns()
            out += [ProcessEvent("exit", p, now) for p in sorted(watched) if process_gone(p)]
        seen: set[tuple[str, int]] = set()
        return [e for e in out if (e.kind, e.pid) not in seen and not seen.add((e.kind, e.pid))]

    def status(self) -> dict:
        return {"mechanism": self.mechanism, "why": self.why, "watched": len(self._watched),
                "events": dict(self.events_seen), "overflows": self.overflows,
                "poll_interval_ms": self.cfg.poll_interval_ms if self._poller is not None else None}

    def close(self) -> None:
        if self._connector is not None:
            self._connector.close()
        if self._poller is not None:
            self._poller.close()


class _Poller:
    """The fallback: a thread compares each watched pid with what it saw last time."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._queue: collections.deque[ProcessEvent] = collections.deque()
        self._watched: frozenset[int] = frozenset()
        self._seen: dict[int, tuple[float, str, tuple[str, ...]]] = {}
        self._gone: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tieringd-lifecycle", daemon=True)
        self._thread.start()

    def fileno(self) -> int:
        return self._efd

    def watch(self, pids: frozenset[int]) -> None:
        self._watched = pids

    def drain(self) -> list[ProcessEvent]:
        try:
            os.eventfd_read(self._efd)
        except BlockingIOError:
            pass
        out = []
        while self._queue:
            out.append(self._queue.popleft())
        return out

    @staticmethod
    def _identity(pid: int) -> tuple[int, str, tuple[str, ...]] | None:
        """(start time, executable, command line), or None when the process is gone or a zombie."""
        return procfs.process_identity(pid)

    def poll_once(self) -> None:
        watched = self._watched
        found = []
        for pid in sorted(watched):
            now = time.monotonic_ns()
            ident = self._identity(pid)
            before = self._seen.get(pid)
            if ident is None:
                if pid not in self._gone:       # reported once, until the pid is watched anew
                    found.append(ProcessEvent("exit", pid, now))
                    self._gone.add(pid)
                self._seen.pop(pid, None)
                continue
            self._gone.discard(pid)
            if before is not None and ident[0] != before[0]:
                found.append(ProcessEvent("exit", pid, now))    # the pid was reused meanwhile
            elif before is not None and ident[1:] != before[1:]:
                found.append(ProcessEvent("exec", pid, now))
            self._seen[pid] = ident
        for pid in set(self._seen) - watched:
            del self._seen[pid]
        self._gone &= watched
        if found:
            self._queue.extend(found)
            os.eventfd_write(self._efd, 1)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll_once()
            except Exception:       # never let the fallback thread die silently
                log.exception("process polling failed; trying again")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        os.close(self._efd)


def wait_readable(fd: int, timeout_s: float) -> bool:
    """For tests and tools without a loop: is ``fd`` readable within ``timeout_s``?"""
    return bool(select.select([fd], [], [], timeout_s)[0])
