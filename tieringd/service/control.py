# SPDX-License-Identifier: Apache-2.0
"""The control socket: JSON lines over ``$RUN_DIR/control.sock``, what ``tieringctl`` talks to.

One request per line, one response line per request (docs/service.md lists every request)::

    → {"v": 1, "id": 7, "request": "regions", "pid": 4242}
    ← {"v": 1, "id": 7, "ok": true, "result": {"schema": "tieringd.regions/1", "regions": [...]}}
    ← {"v": 1, "id": 8, "ok": false, "error": {"code": "bad-request", "message": "..."}}

**Who may talk**: root, or a member of the ``[control] group`` (default ``tieringd``), as the kernel
says at connect time — ``SO_PEERCRED`` (uid, primary gid) and ``SO_PEERGROUPS`` (supplementary groups,
Linux 4.13) — never as the client says. The socket itself is ``0666`` so that a refused client hears
why: it gets one ``forbidden`` error line, then the connection closes, and the refusal is logged
(the first 20, then every 100th). Members may read every report; they may migrate only processes of
their own uid, and requests that change the daemon for everyone (``policy-set``: the handlers' root-only
set) are root's. Each such refusal is a ``forbidden`` error, logged and counted like the others; the
connection stays, so a member's client goes on reading. Past ``max_clients`` connections a client is
told the daemon is ``busy``; root has ``root_reserved_clients`` more, so that a flood of members'
connections leaves root's ``tieringctl status`` an answer.

**Never stalls the loop**: the server keeps its own epoll set (listener and clients) and hands the
daemon one descriptor (``daemon.add_reader``): every read and write is non-blocking, a client that
does not read its replies is cut off once ``max_backlog_bytes`` wait for it, a line longer than
``max_line_bytes`` is refused. Requests are answered in the loop thread (so they may read the block
table); a ``migrate`` is answered when its ticket is done, by a waiter thread handing the reply back
with ``daemon.call_soon``. Any error in a handler is a JSON error, never a dropped connection.
"""
from __future__ import annotations

import dataclasses
import errno
import grp
import json
import logging
import os
import selectors
import socket
import struct
import threading
import time
from typing import Any, Callable

from tieringd.kernel import procfs
from tieringd.shim import protocol as P
from tieringd.config import Table, ranged
from tieringd.kernel.unixsock import close_listener, remove_stale_socket

log = logging.getLogger("tieringd.control")

VERSION = 1
SOCKET_NAME = "control.sock"
_ucred = struct.Struct("iII")
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)     # include/uapi/asm-generic/socket.h


@dataclasses.dataclass(frozen=True)
class ControlConfig(Table):
    """The ``[control]`` table."""
    NAME = "control"
    group: str = "tieringd"          # members may use the control socket; root always may
    max_clients: int = ranged(64, 1, 65536)  # connections at once
    root_reserved_clients: int = ranged(4, 1, 1024)  # connections beyond max_clients that only root may open: root's tieringctl is answered while others hold every slot
    max_line_bytes: int = ranged(1 << 20, 1 << 10, 1 << 30, unit="bytes")  # a longer request line is refused ("too-long") and the client cut off
    max_backlog_bytes: int = ranged(64 << 20, 1 << 10, 1 << 36, unit="bytes")  # replies waiting for a client that does not read: then it is cut off
    heat_max_blocks: int = ranged(65536, 1, 1 << 24)  # blocks per heat reply (the client pages with offset)
    max_pending_migrations: int = ranged(16, 1, 4096)  # migrate requests waiting for their moves at once


def socket_path(run_dir: str | None = None) -> str:
    return os.path.join(run_dir or P.run_dir(), SOCKET_NAME)


class RequestError(Exception):
    """A refused request: ``code`` (a short word, docs/service.md) and a message saying what to do."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


# ---- who is on the other end -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...]

    @property
    def root(self) -> bool:
        return self.uid == 0

    def __str__(self) -> str:
        return f"pid {self.pid} uid {self.uid} gid {self.gid}"


def peer_of(sock: socket.socket) -> Peer:
    pid, uid, gid = _ucred.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _ucred.size))
    groups: tuple[int, ...] = ()
    size = 64 * 4
    for _ in range(4):      # ERANGE: the buffer was too small (the kernel says how much it needs)
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, size)
            groups = struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4])
            break
        except OSError as e:
            if e.errno != errno.ERANGE:
                break       # before 4.13: only the primary gid is known
            size *= 4
    return Peer(pid, uid, gid, groups)


class Access:
    """Root, or a member of ``group`` (resolved when the server starts; a missing group: root only)."""

    def __init__(self, group: str):
        self.group = group
        try:
            self.gid: int | None = grp.getgrnam(group).gr_gid
        except KeyError:
            self.gid = None

    def refusal(self, peer: Peer) -> str | None:
        """None when ``peer`` may talk; else why not (said to the client and logged)."""
        if peer.root or (self.gid is not None and (peer.gid == self.gid or self.gid in peer.groups)):
            return None
        if self.gid is None:
            return (f"uid {peer.uid} may not use the tieringd control socket: only root may, as the "
                    f"group {self.group!r} does not exist (groupadd {self.group}; usermod -aG "
                    f"{self.group} USER)")
        return (f"uid {peer.uid} may not use the tieringd control socket: root or members of group "
                f"{self.group!r} only (usermod -aG {self.group} USER, then log in again)")

    def describe(self) -> str:
        return f"root and group {self.group}" + (f" (gid {self.gid})" if self.gid is not None else
                                                 " (no such group: root only)")


# ---- the server ----------------------------------------------------------------------------------------

class _Client:
    def __init__(self, sock: socket.socket, peer: Peer):
        self.sock, self.peer = sock, peer
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.closing = False        # close once outbuf is written
        self.closed = False
        self.writing = False        # EVENT_WRITE registered
        self.requests = 0


Handler = Callable[["Request"], Any]


@dataclasses.dataclass
class Request:
    name: str
    params: dict[str, Any]
    peer: Peer
    id: Any

    def get(self, key: str, default: Any = None) -> Any:
        return self.params.get(key, default)

    def int(self, key: str, default: Any = dataclasses.MISSING, minimum: int | None = None) -> Any:
        value = self.params.get(key, default)
        if value is dataclasses.MISSING:
            raise RequestError("bad-request", f"{self.name}: {key} is required")
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise RequestError("bad-request", f"{self.name}: {key} must be an integer, not {value!r}")
        if minimum is not None and value < minimum:
            raise RequestError("bad-request", f"{self.name}: {key} must be at least {minimum}")
        return value


class Deferred:
    """What a handler returns when its answer comes later: ``wait()`` runs in a waiter thread, its
    result (or RequestError) is sent from the loop thread."""

    def __init__(self, wait: Callable[[], Any]):
        self.wait = wait


class ControlServer:
    """Listens on ``run_dir/control.sock`` and answers with ``handlers`` (name → (function, the
    parameter names it takes)). ``start()`` registers with ``daemon.add_reader``; the daemon's
    ``call_soon`` carries deferred replies back into the loop thread."""

    def __init__(self, daemon, run_dir: str, cfg: ControlConfig | None = None,
                 handlers: dict[str, tuple[Handler, tuple[str, ...]]] | None = None,
                 root_only: frozenset[str] = frozenset()):
        """``root_only``: requests only root may make (they change the daemon for every user)."""
        self.daemon = daemon
        self.root_only = root_only
        self.run_dir = run_dir
        self.path = socket_path(run_dir)
        self.cfg = cfg or ControlConfig()
        self.access = Access(self.cfg.group)
        self.handlers = dict(handlers or {})
        self.refusals = 0
        self.requests = 0
        self.errors = 0
        self.pending_migrations = 0
        self._clients: dict[int, _Client] = {}
        self._sel = selectors.EpollSelector()
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> "ControlServer":
        os.makedirs(self.run_dir, mode=0o755, exist_ok=True)
        remove_stale_socket(self.path, socket.SOCK_STREAM, "another daemon")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        sock.bind(self.path)
        # Anyone may connect so that a refused client is told why; SO_PEERCRED decides (see above).
        os.chmod(self.path, 0o666)
        sock.listen(64)
        self._listener = sock
        self._sel.register(sock, selectors.EVENT_READ, None)
        self.daemon.add_reader(self._sel.fileno(), self.on_ready)
        log.info("control socket %s (access: %s)", self.path, self.access.describe())
        return self

    def answers(self) -> bool:
        """The socket accepts connections (READY=1 waits for this)."""
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        try:
            probe.connect(self.path)
            return True
        except OSError:
            return False
        finally:
            probe.close()

    def close(self) -> None:
        if self._listener is None:
            return
        try:
            self.daemon.remove_reader(self._sel.fileno())
        except Exception:
            pass
        for c in list(self._clients.values()):
            self._close(c)
        close_listener(self._sel, self._listener, self.path)
        self._listener = None
        self._sel.close()

    def status(self) -> dict[str, Any]:
        return {"path": self.path, "access": self.access.describe(), "clients": len(self._clients),
                "requests": self.requests, "errors": self.errors, "refusals": self.refusals,
                "pending_migrations": self.pending_migrations}

    def refusal(self, peer: Peer, request: str) -> str | None:
        """None when ``peer``, already let in, may make ``request``; else why not. (Whose process a
        ``migrate`` may move is its handler's to say: it needs the process.)"""
        if request in self.root_only and not peer.root:
            return f"{request} changes the daemon for every user: root only (this client is uid {peer.uid})"
        return None

    # ---- events (loop thread) -------------------------------------------------------------------
    def on_ready(self) -> None:
        for key, mask in self._sel.select(0):
            if key.data is None:
                self._accept()
                continue
            c: _Client = key.data
            if mask & selectors.EVENT_READ and not c.closed:
                self._read(c)
            if mask & selectors.EVENT_WRITE and not c.closed:
                self._flush(c)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as e:
                log.warning("control: accept failed: %s", e)
                return
            sock.setblocking(False)
            try:
                peer = peer_of(sock)
            except OSError as e:
                log.warning("control: no peer credentials (%s): connection closed", e)
                sock.close()
                continue
            c = _Client(sock, peer)
            self._clients[sock.fileno()] = c
            self._sel.register(sock, selectors.EVENT_READ, c)
            why = self.access.refusal(peer)
            if why is None and len(self._clients) > self.client_limit(peer):
                why = f"too many clients ({self.client_limit(peer)}); try again"
                code = "busy"
            else:
                code = "forbidden"
            if why is not None:
                self._refuse(c, code, why)

    def client_limit(self, peer: Peer) -> int:
        """Connections at once (this one counted) past which ``peer`` is turned away as busy. Root may
        open ``root_reserved_clients`` more than the others: members (or outsiders, while their
        refusal is written) holding every slot must not lock root out of the daemon it runs — the
        reason PostgreSQL keeps superuser_reserved_connections. ``peer`` is SO_PEERCRED's, never
        what the client says."""
        return self.cfg.max_clients + (self.cfg.root_reserved_clients if peer.root else 0)

    def _count_refusal(self, peer: Peer, why: str) -> None:
        """Every refusal of who the client is, or of what it may ask, is counted and logged (the first
        20, then every 100th: a client that retries in a loop does not flood the journal)."""
        self.refusals += 1
        if self.refusals <= 20 or self.refusals % 100 == 0:
            log.warning("control: refused %s: %s%s", peer, why,
                        f" ({self.refusals} refusals so far)" if self.refusals > 20 else "")

    def _refuse(self, c: _Client, code: str, why: str) -> None:
        self._count_refusal(c.peer, why)
        self._send(c, {"v": VERSION, "id": None, "ok": False, "error": {"code": code, "message": why}})
        c.closing = True
        self._flush(c)

    def _read(self, c: _Client) -> None:
        try:
            data = c.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError as e:
            log.debug("control: %s: %s", c.peer, e)
            self._close(c)
            return
        if not data:
            self._close(c)
            return
        if c.closing:
            return              # refused: what it says is not read
        c.inbuf += data
        while not c.closed and not c.closing:
            nl = c.inbuf.find(b"\n")
            if nl < 0:
                if len(c.inbuf) > self.cfg.max_line_bytes:
                    self._send(c, _error(None, "too-long", f"a request line is at most "
                                         f"{self.cfg.max_line_bytes} bytes"))
                    c.closing = True
                    self._flush(c)
                return
            line = bytes(c.inbuf[:nl])
            del c.inbuf[:nl + 1]
            if line.strip():
                self._request(c, line)

    def _request(self, c: _Client, line: bytes) -> None:
        self.requests += 1
        c.requests += 1
        rid = None
        try:
            try:
                msg = json.loads(line)
            except (ValueError, UnicodeDecodeError) as e:
                raise RequestError("bad-request", f"not a JSON line: {e}") from None
            except RecursionError:          # [[[[…]]]] thousands deep
                raise RequestError("bad-request", "not a JSON line: nested too deep") from None
            if not isinstance(msg, dict):
                raise RequestError("bad-request", "a request is a JSON object")
            rid = _request_id(msg.get("id"))
            v = msg.get("v", VERSION)
            if v != VERSION:
                raise RequestError("unsupported-version",
                                   f"protocol version {_short(v)} not supported; this daemon speaks {VERSION}")
            name = msg.get("request")
            if not isinstance(name, str) or name not in self.handlers:
                raise RequestError("unknown-request", f"unknown request {_short(name)} (requests: "
                                   + ", ".join(sorted(self.handlers)) + ")")
            fn, allowed = self.handlers[name]
            why = self.refusal(c.peer, name)
            if why is not None:
                raise RequestError("forbidden", why)
            params = {k: val for k, val in msg.items() if k not in ("v", "id", "request")}
            extra = sorted(set(params) - set(allowed))
            if extra:
                raise RequestError("bad-request", f"{name}: unknown field {extra[0]!r} (fields: "
                                   + (", ".join(allowed) or "none") + ")")
            result = fn(Request(name, params, c.peer, rid))
            if isinstance(result, Deferred):
                self._defer(c, rid, result)
                return
            self._send(c, {"v": VERSION, "id": rid, "ok": True, "result": result})
        except RequestError as e:
            self.errors += 1
            if e.code == "forbidden":
                self._count_refusal(c.peer, e.message)
            self._send(c, _error(rid, e.code, e.message))
        except Exception as e:          # a bug must not take the connection (or the loop) down
            self.errors += 1
            log.exception("control: request from %s failed", c.peer)
            self._send(c, _error(rid, "internal", f"{type(e).__name__}: {e}"))

    def _defer(self, c: _Client, rid: Any, deferred: Deferred) -> None:
        with self._lock:
            if self.pending_migrations >= self.cfg.max_pending_migrations:
                raise RequestError("busy", f"{self.pending_migrations} requests already wait; try again")
            self.pending_migrations += 1

        def wait() -> None:
            try:
                reply = {"v": VERSION, "id": rid, "ok": True, "result": deferred.wait()}
            except RequestError as e:
                reply = _error(rid, e.code, e.message)
            except Exception as e:
                log.exception("control: deferred request from %s failed", c.peer)
                reply = _error(rid, "internal", f"{type(e).__name__}: {e}")
            with self._lock:
                self.pending_migrations -= 1
            self.daemon.call_soon(lambda: None if c.closed else self._send(c, reply))

        threading.Thread(target=wait, name="tieringd-control-wait", daemon=True).start()

    # ---- output ----------------------------------------------------------------------------------
    def _send(self, c: _Client, obj: dict) -> None:
        if c.closed:
            return
        try:
            text = json.dumps(obj, separators=(",", ":"), allow_nan=False, default=_json_default)
        except (ValueError, TypeError) as e:    # a report with NaN in it: a bug, said as one
            log.error("control: an answer to %s cannot be written as JSON: %s", c.peer, e)
            text = json.dumps(_error(None, "internal", f"the answer cannot be written as JSON: {e}"))
        c.outbuf += text.encode() + b"\n"
        self._flush(c)
        # what the socket did not take waits: a reply larger than the bound reaches a client that reads
        if not c.closed and len(c.outbuf) > self.cfg.max_backlog_bytes:
            log.warning("control: %s does not read its replies (%d bytes waiting): disconnected",
                        c.peer, len(c.outbuf))
            self._close(c)

    def _flush(self, c: _Client) -> None:
        while c.outbuf and not c.closed:
            try:
                n = c.sock.send(c.outbuf)
            except BlockingIOError:
                break
            except OSError:
                self._close(c)
                return
            del c.outbuf[:n]
        if c.closed:
            return
        if not c.outbuf and c.closing:
            self._close(c)
            return
        want = bool(c.outbuf)
        if want != c.writing:
            c.writing = want
            self._sel.modify(c.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if want else 0), c)

    def _close(self, c: _Client) -> None:
        if c.closed:
            return
        c.closed = True
        self._clients.pop(c.sock.fileno(), None)
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.sock.close()


def _request_id(rid: Any) -> Any:
    """The request's id, as the answer will repeat it: null, a string, or a finite number. Anything
    else (NaN, which Python's JSON reads, a list, an object) is refused — it could not be written back
    as JSON, and an answer that cannot be written is no answer."""
    if rid is None or isinstance(rid, (bool, int)) or (isinstance(rid, str) and len(rid) <= 256) or \
            (isinstance(rid, float) and rid == rid and abs(rid) != float("inf")):
        return rid
    raise RequestError("bad-request", "id must be null, a string (at most 256 characters) or a finite number")


def _short(value: Any, limit: int = 80) -> str:
    """A client's value quoted in an error, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def _error(rid: Any, code: str, message: str) -> dict:
    return {"v": VERSION, "id": rid, "ok": False, "error": {"code": code, "message": message}}


def _json_default(obj: Any) -> Any:
    """numpy scalars and the like, which a report may carry."""
    for attr in ("item", "tolist"):
        if hasattr(obj, attr):
            return getattr(obj, attr)()
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


# ---- the client ----------------------------------------------------------------------------------------

class DaemonNotRunning(ConnectionError):
    """No daemon answers on the control socket; ``str()`` says what to do."""


class ControlError(Exception):
    """The daemon refused a request (``code``, ``message``)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class Client:
    """``Client().request("status")`` → the result dict; raises ControlError or DaemonNotRunning."""

    def __init__(self, run_dir: str | None = None, timeout_s: float | None = 30.0):
        self.path = socket_path(run_dir)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(self.path)
        except (FileNotFoundError, ConnectionRefusedError) as e:
            self._sock.close()
            stale = "" if isinstance(e, FileNotFoundError) else " (a stale socket is left there)"
            raise DaemonNotRunning(
                f"the tieringd daemon is not running: nothing answers on {self.path}{stale}. Start it "
                f"with 'systemctl start tieringd' (or run 'tieringd' as root); set TIERINGD_RUN_DIR "
                f"if it runs with another run directory") from None
        except PermissionError:
            self._sock.close()
            raise DaemonNotRunning(f"cannot connect to {self.path}: permission denied (the run "
                                   f"directory is not readable for this user)") from None
        self._rfile = self._sock.makefile("rb")
        self._next_id = 0

    def request(self, name: str, timeout_s: float | None = None, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        rid = self._next_id
        line = json.dumps({"v": VERSION, "id": rid, "request": name, **params}).encode() + b"\n"
        if timeout_s is not None:
            self._sock.settimeout(timeout_s)
        try:
            self._sock.sendall(line)
        except BrokenPipeError:
            pass                     # a refused client: the error line is still there to read
        while True:
            raw = self._rfile.readline()
            if not raw:
                raise ControlError("closed", f"the daemon closed the connection ({self.path})")
            msg = json.loads(raw)
            if msg.get("id") not in (rid, None):
                continue                 # an answer to an earlier request that timed out
            if msg.get("ok"):
                return msg["result"]
            err = msg.get("error") or {}
            raise ControlError(err.get("code", "?"), err.get("message", "refused"))

    def close(self) -> None:
        self._rfile.close()
        self._sock.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def process_uid(pid: int) -> int | None:
    """The real uid of ``pid`` (``/proc/PID/status``), None when it is gone."""
    status = procfs.read_status(pid)
    if not status or "Uid" not in status:
        return None
    return int(status["Uid"].split()[0])


def process_ranges(pid: int) -> list[tuple[int, int]]:
    """Every mapping with struct pages (``migrate --all``, as migratepages moves them). RequestError
    when the process is gone (``not-found``) or its mappings cannot be read (``kernel``)."""
    try:
        return [(v.start, v.length) for v in procfs.read_maps(pid) if not v.no_struct_pages]
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ESRCH):
            raise RequestError("not-found", f"no process {pid}") from None
        raise RequestError("kernel", f"cannot read the mappings of process {pid}: "
                                     f"{e.strerror or e}") from None


def clip_ranges(ranges: list[tuple[int, int]], mapped: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``ranges`` that lie in ``mapped`` (both (start, length), ``mapped`` sorted): what a
    client asks to move is bounded by what the process maps, however large the numbers it sends."""
    out = []
    for start, length in ranges:
        end = start + length
        for m_start, m_length in mapped:
            lo, hi = max(start, m_start), min(end, m_start + m_length)
            if lo < hi:
                out.append((lo, hi - lo))
    return out


def wait_for_socket(path: str, timeout_s: float) -> bool:
    """Tests and scripts: wait until something answers on ``path``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            return True
        except OSError:
            time.sleep(0.05)
        finally:
            s.close()
    return False
