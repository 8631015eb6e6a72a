# SPDX-License-Identifier: Apache-2.0
"""The one etcd client of tieringd: etcd's v3 JSON gateway (etcd 3.4+) through ``etcd3gw``.

etcd3gw carries the requests (a ``requests`` session per member, its errors); this module speaks the
API itself — ranges, puts, deletes, transactions with compares over a key range, leases — because the
pool needs what the library's helpers do not expose (a compare that a whole prefix is empty, the
revisions of every key read). Keys and values are bytes on the wire (base64 in JSON), 64-bit numbers
come back as strings: both are decoded here and nowhere else.

Several members: a request goes to the member that answered last; a member that does not answer (or
answers that it has no leader) is skipped for the next one, and :class:`EtcdUnavailable` is raised
only when none answered. Nothing read here is trusted: :mod:`tieringd.pool.schema` validates values.
"""
from __future__ import annotations

import base64
import dataclasses
import logging
import threading
import time
from typing import Any

log = logging.getLogger("tieringd.pool")

API_PATH = "/v3/"           # etcd 3.4 serves the gateway at /v3/ (and /v3beta/); etcd3gw's discovery costs a request


class EtcdUnavailable(Exception):
    """No member answered (each tried once); the message says what the last one said."""


class EtcdRefused(Exception):
    """A member answered with an error that is not about its availability (a bad request)."""


@dataclasses.dataclass(frozen=True)
class KV:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


def _b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def _unb64(s: str | None) -> bytes:
    return base64.b64decode(s) if s else b""


def prefix_end(prefix: str) -> str:
    """The end of the key range of every key starting with ``prefix`` (etcd's convention: the last
    byte plus one)."""
    b = bytearray(prefix.encode())
    while b and b[-1] == 0xFF:
        b.pop()
    if not b:
        return "\0"
    b[-1] += 1
    return b.decode("latin-1")


def _kv(d: dict) -> KV:
    return KV(_unb64(d.get("key")).decode("utf-8", "replace"), _unb64(d.get("value")),
              int(d.get("create_revision", 0)), int(d.get("mod_revision", 0)), int(d.get("lease", 0)))


# ---- transaction parts ---------------------------------------------------------------------------

def cmp_absent(key: str) -> dict:
    """The key does not exist."""
    return {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}


def cmp_present(key: str) -> dict:
    return {"key": _b64(key), "target": "CREATE", "result": "GREATER", "create_revision": "0"}


def cmp_none_under(prefix: str) -> dict:
    """No key starts with ``prefix`` (a compare over a key range, etcd 3.3+: every key in the range
    must pass, and an empty range compares as one absent key)."""
    return {**cmp_absent(prefix), "range_end": _b64(prefix_end(prefix))}


def cmp_mod(key: str, revision: int) -> dict:
    """The key was last written at ``revision`` (unchanged since it was read)."""
    return {"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(revision)}


def op_put(key: str, value: bytes | str, lease: int = 0) -> dict:
    body = {"key": _b64(key), "value": _b64(value)}
    if lease:
        body["lease"] = str(lease)
    return {"request_put": body}


def op_delete(key: str) -> dict:
    return {"request_delete_range": {"key": _b64(key)}}


class Etcd:
    """A cluster of members, by ``"host:port"``; calls are thread-safe (one at a time)."""

    def __init__(self, endpoints: tuple[str, ...] | list[str], timeout_s: float = 2.0, retry_s: float = 6.0):
        try:
            from etcd3gw.client import Etcd3Client       # only a host in a pool needs it
        except ImportError:
            raise ValueError("the etcd3gw client is not installed (pip install etcd3gw)") from None
        if not endpoints:
            raise ValueError("no etcd endpoints")
        self.endpoints = tuple(endpoints)
        self._members = []
        for ep in self.endpoints:
            host, _, port = ep.rpartition(":")
            self._members.append(Etcd3Client(host=host, port=int(port), timeout=timeout_s, api_path=API_PATH))
        self._at = 0
        # a round of every member is tried again for this long: an election after a leader was lost
        # takes a few election timeouts, and members answer "leader changed" meanwhile
        self.retry_s = retry_s
        self._lock = threading.Lock()
        self.requests = 0
        self.failovers = 0
        self.last_error: str | None = None

    def close(self) -> None:
        for m in self._members:
            m.session.close()

    # ---- transport -----------------------------------------------------------------------------
    def post(self, path: str, body: dict) -> dict:
        """POST ``body`` to ``path`` of the gateway on the member that answered last, else the next;
        rounds of every member for ``retry_s``, then :class:`EtcdUnavailable`."""
        with self._lock:
            self.requests += 1
            deadline = time.monotonic() + self.retry_s
            pause = 0.05
            while True:
                out, why = self._round(path, body)
                if out is not None:
                    return out
                if time.monotonic() + pause > deadline:
                    break
                time.sleep(pause)
                pause = min(pause * 2, 0.5)
            self.last_error = why
            raise EtcdUnavailable(f"no etcd member answered ({why})")

    def _round(self, path: str, body: dict) -> tuple[dict | None, str]:
        """One try of every member, the last one that answered first: (answer, "") or (None, why)."""
        from etcd3gw import exceptions as ex
        why = ""
        for k in range(len(self._members)):
            i = (self._at + k) % len(self._members)
            m = self._members[i]
            try:
                out = m.post(m.get_url(path), json=body)
            except (ex.ConnectionFailedError, ex.ConnectionTimeoutError) as e:
                why = f"{self.endpoints[i]}: {type(e).__name__} {_short(e)}"
            except ex.InternalServerError as e:
                # "etcdserver: no leader", "request timed out": another member, or a later round, may do
                why = f"{self.endpoints[i]}: {_short(e)}"
            except ex.Etcd3Exception as e:
                raise EtcdRefused(f"{self.endpoints[i]}: {_short(e)}") from None
            except ValueError as e:          # a body that is not JSON
                why = f"{self.endpoints[i]}: unreadable answer ({e})"
            else:
                if k:
                    self.failovers += 1
                    log.info("etcd: %s answers (%s did not)", self.endpoints[i], self.endpoints[self._at])
                self._at = i
                self.last_error = None
                return (out if isinstance(out, dict) else {}), ""
        return None, why

    # ---- key-value ---------------------------------------------------------------------------------
    def get(self, key: str) -> KV | None:
        kvs = self.range(key)
        return kvs[0] if kvs else None

    def range(self, key: str, range_end: str | None = None, *, keys_only: bool = False,
              limit: int = 0) -> list[KV]:
        body: dict[str, Any] = {"key": _b64(key)}
        if range_end is not None:
            body["range_end"] = _b64(range_end)
        if keys_only:
            body["keys_only"] = True
        if limit:
            body["limit"] = str(limit)
        return [_kv(d) for d in self.post("kv/range", body).get("kvs", [])]

    def prefix(self, prefix: str, *, keys_only: bool = False) -> list[KV]:
        return self.range(prefix, prefix_end(prefix), keys_only=keys_only)

    def count(self, prefix: str) -> int:
        out = self.post("kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                     "count_only": True})
        return int(out.get("count", 0))

    def revision(self) -> int:
        """The cluster's current revision (a cheap read of nothing)."""
        out = self.post("kv/range", {"key": _b64("\0"), "limit": "1", "count_only": True})
        return int(out.get("header", {}).get("revision", 0))

    def put(self, key: str, value: bytes | str, lease: int = 0) -> None:
        self.post("kv/put", op_put(key, value, lease)["request_put"])

    def delete(self, key: str) -> int:
        return int(self.post("kv/deleterange", {"key": _b64(key)}).get("deleted", 0))

    def txn(self, compare: list[dict], success: list[dict], failure: list[dict] | None = None) -> bool:
        """Whether the compares held (and ``success`` ran; else ``failure``)."""
        out = self.post("kv/txn", {"compare": compare, "success": success, "failure": failure or []})
        return bool(out.get("succeeded", False))

    # ---- leases ------------------------------------------------------------------------------------
    def grant(self, ttl_s: int) -> tuple[int, int]:
        out = self.post("lease/grant", {"TTL": str(ttl_s), "ID": "0"})
        if out.get("error"):
            raise EtcdRefused(f"lease grant: {out['error']}")
        return int(out["ID"]), int(out.get("TTL", ttl_s))

    def keepalive(self, lease: int) -> int:
        """The lease's new TTL, or -1 when it has expired (its keys are gone)."""
        out = self.post("lease/keepalive", {"ID": str(lease)})
        return int(out.get("result", {}).get("TTL", -1))

    def time_to_live(self, lease: int) -> int:
        """Seconds the lease has left (what ``tieringctl pool`` shows per host), -1 when it is gone."""
        out = self.post("kv/lease/timetolive", {"ID": str(lease)})
        return int(out.get("TTL", -1))

    def revoke(self, lease: int) -> None:
        self.post("kv/lease/revoke", {"ID": str(lease)})


def _short(e: Exception) -> str:
    text = getattr(e, "detail_text", None) or str(e) or type(e).__name__
    return " ".join(str(text).split())[:200]
