# SPDX-License-Identifier: Apache-2.0
"""What the pool keeps in etcd: the keys under the pool's prefix, and a checked type per value.

Everything read from etcd is untrusted input, as a shim's messages are: any process with access to
the cluster can write there, and an older or newer tieringd may share it. A value is taken only
when it parses into its type here (:func:`parse`): JSON of at most :data:`MAX_VALUE_BYTES`, an object
whose ``schema`` is this one's, every field of the right type and inside the pool's geometry, the key
agreeing with the value. Anything else raises :class:`BadEntry` with one line that says why, which
the caller logs and counts; it is never used.

Keys (``P`` is ``[pool] prefix``)::

    P pool                       PoolDef     the pool: uuid, geometry; written once, by the first host
    P hosts/<host>               HostEntry   a member (under its lease): share, figures for `tieringctl pool`
    P join/<host>                JoinEntry   a joining host's nonce and where on the device it wrote it (lease)
    P ack/<host>/<member>        AckEntry    a member read that nonce on its own device (member's lease)
    P claims/<extent>/<host>     ClaimEntry  <host> holds the extent (its lease): "own" or "shared"
    P index/<hash>/<host>        IndexEntry  <host> holds a reference to the shared block of that content

An extent is free exactly when no key starts with ``P claims/<extent>/``; a host that dies loses its
claims and references when its lease expires, and nothing else cleans up. <extent> is zero-padded so
that a range read returns extents in order.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

SCHEMA = "tieringd.pool/1"
MAX_VALUE_BYTES = 4096
HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
HEX32 = re.compile(r"[0-9a-f]{32}")
HASH = re.compile(r"[0-9a-f]{64}")                 # sha256 of a block's bytes
EXTENT_DIGITS = 6


class BadEntry(ValueError):
    """A value or key in etcd that is not what this pool writes."""


@dataclasses.dataclass(frozen=True)
class PoolDef:
    uuid: str
    device_bytes: int
    extent_bytes: int
    extents: int              # extents on the device, the header's (extent 0) included
    created_by: str
    nonce: str                # what slot 0 of the device holds: the last host to join alone wrote it
    nonce_by: str

    def check(self) -> None:
        _hex32(self.uuid, "uuid")
        _hex32(self.nonce, "nonce")
        _host(self.created_by)
        _host(self.nonce_by)
        if self.extent_bytes <= 0 or self.extent_bytes % (2 << 20):
            raise BadEntry(f"extent_bytes {self.extent_bytes}: not a positive multiple of 2 MiB")
        if not 2 <= self.extents <= 1 << 24 or self.extents * self.extent_bytes > self.device_bytes:
            raise BadEntry(f"{self.extents} extents of {self.extent_bytes} do not fit {self.device_bytes} bytes")


@dataclasses.dataclass(frozen=True)
class HostEntry:
    host: str
    lease: int
    weight: float
    min_bytes: int
    max_bytes: int
    claimed_bytes: int = 0
    used_bytes: int = 0
    shared_bytes: int = 0       # bytes of this host's processes that map shared blocks
    saved_bytes: int = 0        # what those would take were each block its own copy
    state: str = "joining"      # joining | member | refused | offline-etcd
    why: str = ""
    t: float = 0.0              # the host's clock when written (seconds since the epoch)

    def check(self) -> None:
        _host(self.host)
        if not 0 < self.weight <= 1000:
            raise BadEntry(f"weight {self.weight}: not in (0, 1000]")
        for k in ("lease", "min_bytes", "max_bytes", "claimed_bytes", "used_bytes", "shared_bytes", "saved_bytes"):
            if getattr(self, k) < 0:
                raise BadEntry(f"{k} {getattr(self, k)}: negative")
        if self.state not in ("joining", "member", "refused"):
            raise BadEntry(f"state {self.state!r}: unknown")
        if len(self.why) > 300:
            raise BadEntry("why: longer than 300 characters")


@dataclasses.dataclass(frozen=True)
class JoinEntry:
    nonce: str
    offset: int

    def check(self) -> None:
        _hex32(self.nonce, "nonce")
        if self.offset < 0 or self.offset % 64:
            raise BadEntry(f"offset {self.offset}: not a 64-byte slot")


@dataclasses.dataclass(frozen=True)
class AckEntry:
    nonce: str
    same: bool                  # the member read that nonce there (False: it read something else)

    def check(self) -> None:
        _hex32(self.nonce, "nonce")


@dataclasses.dataclass(frozen=True)
class ClaimEntry:
    kind: str                   # "own": written by its holder only; "shared": immutable published blocks

    def check(self) -> None:
        if self.kind not in ("own", "shared"):
            raise BadEntry(f"claim kind {self.kind!r}: neither own nor shared")


@dataclasses.dataclass(frozen=True)
class IndexEntry:
    extent: int
    offset: int                 # device offset of the block
    length: int

    def check(self) -> None:
        if self.extent < 1:
            raise BadEntry(f"extent {self.extent}: the header's, or negative")
        if self.offset < 0 or self.offset % 4096 or not 0 < self.length <= 1 << 30 or self.length % 4096:
            raise BadEntry(f"block {self.offset:#x}+{self.length:#x}: not page-aligned")


TYPES: dict[str, type] = {"pool": PoolDef, "hosts": HostEntry, "join": JoinEntry, "ack": AckEntry,
                          "claims": ClaimEntry, "index": IndexEntry}


def _hex32(v: str, what: str) -> None:
    if not isinstance(v, str) or not HEX32.fullmatch(v):
        raise BadEntry(f"{what}: not 32 hex digits")


def _host(v: str) -> None:
    if not isinstance(v, str) or not HOST.fullmatch(v):
        raise BadEntry(f"host {v!r}: not a host name")


def dump(entry: Any) -> bytes:
    return json.dumps({"schema": SCHEMA, **dataclasses.asdict(entry)}, separators=(",", ":")).encode()


def parse(kind: str, value: bytes) -> Any:
    """The value of a key of ``kind`` (a :data:`TYPES` name) as its type, or :class:`BadEntry`."""
    cls = TYPES[kind]
    if len(value) > MAX_VALUE_BYTES:
        raise BadEntry(f"{len(value)} bytes: larger than {MAX_VALUE_BYTES}")
    try:
        doc = json.loads(value)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadEntry(f"not JSON ({str(e)[:60]})") from None
    if not isinstance(doc, dict):
        raise BadEntry("not a JSON object")
    if doc.get("schema") != SCHEMA:
        raise BadEntry(f"schema {str(doc.get('schema'))[:40]!r}: not {SCHEMA}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(doc) - set(fields) - {"schema"}
    if unknown:
        raise BadEntry(f"unknown fields {sorted(unknown)[:3]}")
    kwargs = {}
    for name, f in fields.items():
        if name not in doc:
            if f.default is dataclasses.MISSING:
                raise BadEntry(f"{name}: missing")
            continue
        kwargs[name] = _typed(name, doc[name], f.type)
    entry = cls(**kwargs)
    entry.check()
    return entry


def _typed(name: str, v: Any, hint: str) -> Any:
    # bool is an int in Python: refuse it where a number is meant, and numbers where a bool is
    if hint == "int":
        if isinstance(v, bool) or not isinstance(v, int) or not -(1 << 63) <= v < 1 << 63:
            raise BadEntry(f"{name}: not an integer")
        return v
    if hint == "float":
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")):
            raise BadEntry(f"{name}: not a finite number")
        return float(v)
    if hint == "bool":
        if not isinstance(v, bool):
            raise BadEntry(f"{name}: not true or false")
        return v
    if not isinstance(v, str):
        raise BadEntry(f"{name}: not a string")
    return v


# ---- keys ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Keys:
    """The key names under one pool's prefix."""
    prefix: str

    @property
    def pool(self) -> str:
        return self.prefix + "pool"

    def host(self, host: str = "") -> str:
        return f"{self.prefix}hosts/{host}"

    def join(self, host: str = "") -> str:
        return f"{self.prefix}join/{host}"

    def ack(self, host: str, member: str = "") -> str:
        return f"{self.prefix}ack/{host}/{member}"

    def claims(self, extent: int | None = None, host: str = "") -> str:
        if extent is None:
            return f"{self.prefix}claims/"
        return f"{self.prefix}claims/{extent:0{EXTENT_DIGITS}d}/{host}"

    def index(self, digest: str | None = None, host: str = "") -> str:
        if digest is None:
            return f"{self.prefix}index/"
        return f"{self.prefix}index/{digest}/{host}"

    def split(self, key: str, kind: str) -> tuple[str, ...]:
        """The parts after ``P <kind>/`` of a key (validated), or :class:`BadEntry`."""
        head = f"{self.prefix}{kind}/"
        if not key.startswith(head):
            raise BadEntry(f"{key[:80]!r}: not under {head}")
        parts = tuple(key[len(head):].split("/"))
        want = {"hosts": 1, "join": 1, "ack": 2, "claims": 2, "index": 2}[kind]
        if len(parts) != want:
            raise BadEntry(f"{key[:80]!r}: {len(parts)} parts after {head}, not {want}")
        if kind == "claims":
            if not re.fullmatch(r"[0-9]{%d}" % EXTENT_DIGITS, parts[0]):
                raise BadEntry(f"{key[:80]!r}: extent not {EXTENT_DIGITS} digits")
        if kind == "index" and not HASH.fullmatch(parts[0]):
            raise BadEntry(f"{key[:80]!r}: not a sha256 digest")
        for p in parts[-1:] if kind in ("claims", "index") else parts:
            _host(p)
        return parts
