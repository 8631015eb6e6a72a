# SPDX-License-Identifier: Apache-2.0
"""The shim ↔ daemon wire format, version 1 (``shim/protocol.h`` is the C side; docs/protocol.md the prose).

One ``AF_UNIX``/``SOCK_SEQPACKET`` connection per process to ``$TIERINGD_RUN_DIR/registry.sock``;
every datagram is one record: a 16-byte header (magic ``TRDK``, version, type, size, seq) and a
fixed-size little-endian body. :func:`decode` refuses anything that is not exactly a known record
of this version, with a :class:`ProtocolError` that carries an errno and a message fit to send back.

tests/unit/test_protocol.py compiles the C header and checks every size and field offset against
the tables here.
"""
from __future__ import annotations

import dataclasses
import enum
import errno
import os
import struct
from typing import ClassVar

MAGIC = 0x4B445254          # b"TRDK" on the wire
VERSION = 1
SOCKET_NAME = "registry.sock"
DEFAULT_RUN_DIR = "/run/tieringd"
MAX_RECORD = 128

HEADER = struct.Struct("<IHHII")


def run_dir() -> str:
    """Where the registry socket lives: ``$TIERINGD_RUN_DIR`` or /run/tieringd (the shim agrees)."""
    return os.environ.get("TIERINGD_RUN_DIR") or DEFAULT_RUN_DIR


def socket_path(directory: str | None = None) -> str:
    return os.path.join(directory or run_dir(), SOCKET_NAME)


class MsgType(enum.IntEnum):
    HELLO = 1
    RESET = 2
    REGISTER = 3
    UNREGISTER = 4
    ACK = 16
    ERROR = 17
    PING = 32
    PONG = 33
    RESYNC = 34
    REBIND = 35
    CONFIG = 36
    REMAP = 37


CONTROL_TYPES = frozenset({MsgType.PING, MsgType.RESYNC, MsgType.REBIND, MsgType.CONFIG, MsgType.REMAP})


class Flag(enum.IntFlag):
    MEMFD = 1 << 0
    PINNED = 1 << 1
    HUGEPAGE = 1 << 2
    KSM = 1 << 3
    INHERITED = 1 << 4
    FOREIGN = 1 << 5


WIRE_FLAGS = 0x3F


class Policy(enum.IntEnum):
    NONE = 0
    FAST = 1
    SLOW_FIRST = 2
    INTERLEAVE = 3
    WEIGHTED = 4
    BIND = 5
    PREFERRED = 6

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", "-")

    @classmethod
    def parse(cls, text: str) -> "Policy":
        t = text.strip().lower().replace("_", "-")
        if t == "weighted-interleave":
            return cls.WEIGHTED
        for p in cls:
            if t == p.label:
                return p
        raise ValueError(f"unknown policy {text!r}: expected one of "
                         + ", ".join(p.label for p in ALLOCATION_POLICIES))


# Policies an allocation can be given (bind/preferred need an explicit nodemask: REBIND only).
ALLOCATION_POLICIES = (Policy.NONE, Policy.FAST, Policy.SLOW_FIRST, Policy.INTERLEAVE, Policy.WEIGHTED)


class Source(enum.IntEnum):
    MALLOC = 1
    CALLOC = 2
    REALLOC = 3
    MEMALIGN = 4
    MMAP = 5
    CUDA_HOST_ALLOC = 6
    CUDA_HOST_REGISTER = 7


class ConfigField(enum.IntFlag):
    MIN_BYTES = 1 << 0
    MAX_BYTES = 1 << 1
    POLICY = 1 << 2
    PINNED_POLICY = 1 << 3
    THP = 1 << 4
    KSM = 1 << 5


class RebindFlag(enum.IntFlag):
    MOVE = 1 << 0              # also move pages already present (MPOL_MF_MOVE)
    # mbind(MPOL_BIND | MPOL_F_NUMA_BALANCING) (Linux 5.12, commit bda420b98505): NUMA balancing takes
    # hint faults on the range and migrates only within the nodemask; with one node, hint faults and
    # no kernel migration. Policy BIND only; a kernel that refuses answers EINVAL in the ERROR.
    NUMA_BALANCING = 1 << 1


REBIND_MOVE = RebindFlag.MOVE
REBIND_NUMA_BALANCING = RebindFlag.NUMA_BALANCING


class RemapDirection(enum.IntEnum):
    DEMOTE = 1     # memory → file: the range ends up MAP_SHARED from the DAX file
    PROMOTE = 2    # file → memory: the range ends up on the region's memfd again
    SHARE = 3      # bytes equal to the file's: memfd pages punched, filled privately from the file on touch
    UNSHARE = 4    # a shared range filled from the file in full: plain memfd memory again


# REMAP carries the DAX file (opened read-write) and optionally /dev/userfaultfd, with SCM_RIGHTS.
REMAP_MAX_FDS = 2


class ProtocolError(ValueError):
    """A record that cannot be accepted. ``code`` is the errno sent back in the ERROR reply."""

    def __init__(self, code: int, message: str, seq: int = 0):
        super().__init__(message)
        self.code = code
        self.seq = seq


def _cstr(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


def _cbytes(text: str, size: int) -> bytes:
    data = text.encode("utf-8")[: size - 1]
    return data + b"\0" * (size - len(data))


@dataclasses.dataclass
class Message:
    """Base of every record. ``seq`` is the sender's counter; ``encode`` fills the header."""
    TYPE: ClassVar[MsgType]
    BODY: ClassVar[struct.Struct]
    FIELDS: ClassVar[tuple[str, ...]] = ()

    seq: int = dataclasses.field(default=0, kw_only=True)

    @classmethod
    def size(cls) -> int:
        return HEADER.size + cls.BODY.size

    def _values(self) -> tuple:
        return tuple(getattr(self, f) for f in self.FIELDS)

    def encode(self) -> bytes:
        return HEADER.pack(MAGIC, VERSION, int(self.TYPE), self.size(), self.seq & 0xFFFFFFFF) + \
            self.BODY.pack(*self._values())

    @classmethod
    def _from_values(cls, values: tuple, seq: int) -> "Message":
        return cls(*values, seq=seq)


@dataclasses.dataclass
class Hello(Message):
    TYPE = MsgType.HELLO
    BODY = struct.Struct("<iIQBB6x24s")
    pid: int = 0
    min_bytes: int = 0
    policy: int = 0
    backing: int = 0
    agent: str = ""

    def _values(self):
        return (self.pid, 0, self.min_bytes, self.policy, self.backing, _cbytes(self.agent, 24))

    @classmethod
    def _from_values(cls, v, seq):
        return cls(v[0], v[2], v[3], v[4], _cstr(v[5]), seq=seq)


@dataclasses.dataclass
class Reset(Message):
    TYPE = MsgType.RESET
    BODY = struct.Struct("<")


@dataclasses.dataclass
class Register(Message):
    TYPE = MsgType.REGISTER
    BODY = struct.Struct("<QQQIBBh24s")
    region_id: int = 0
    start: int = 0
    length: int = 0
    flags: int = 0
    policy: int = 0
    source: int = 0
    node: int = -1
    tag: str = ""

    def _values(self):
        return (self.region_id, self.start, self.length, self.flags, self.policy, self.source, self.node,
                _cbytes(self.tag, 24))

    @classmethod
    def _from_values(cls, v, seq):
        return cls(*v[:7], _cstr(v[7]), seq=seq)


@dataclasses.dataclass
class Unregister(Message):
    TYPE = MsgType.UNREGISTER
    BODY = struct.Struct("<QQQ")
    FIELDS = ("region_id", "start", "length")
    region_id: int = 0
    start: int = 0
    length: int = 0


@dataclasses.dataclass
class Ack(Message):
    TYPE = MsgType.ACK
    BODY = struct.Struct("<Ii")
    FIELDS = ("ref_seq", "status")
    ref_seq: int = 0
    status: int = 0


@dataclasses.dataclass
class Error(Message):
    TYPE = MsgType.ERROR
    BODY = struct.Struct("<Ii104s")
    ref_seq: int = 0
    code: int = 0
    message: str = ""

    def _values(self):
        return (self.ref_seq, self.code, _cbytes(self.message, 104))

    @classmethod
    def _from_values(cls, v, seq):
        return cls(v[0], v[1], _cstr(v[2]), seq=seq)

    def __str__(self) -> str:
        name = errno.errorcode.get(self.code, str(self.code))
        return f"{self.message} ({name})"


@dataclasses.dataclass
class Ping(Message):
    TYPE = MsgType.PING
    BODY = struct.Struct("<")


@dataclasses.dataclass
class Pong(Message):
    TYPE = MsgType.PONG
    BODY = struct.Struct("<IiIIQ")
    ref_seq: int = 0
    pid: int = 0
    nregions: int = 0
    managed_bytes: int = 0

    def _values(self):
        return (self.ref_seq, self.pid, self.nregions, 0, self.managed_bytes)

    @classmethod
    def _from_values(cls, v, seq):
        return cls(v[0], v[1], v[2], v[4], seq=seq)


@dataclasses.dataclass
class Resync(Message):
    TYPE = MsgType.RESYNC
    BODY = struct.Struct("<")


@dataclasses.dataclass
class Rebind(Message):
    TYPE = MsgType.REBIND
    BODY = struct.Struct("<QQQBB6x")
    FIELDS = ("start", "length", "nodemask", "policy", "flags")
    start: int = 0
    length: int = 0
    nodemask: int = 0
    policy: int = 0
    flags: int = 0


@dataclasses.dataclass
class Config(Message):
    TYPE = MsgType.CONFIG
    BODY = struct.Struct("<IBBBBQQQ")
    fields: int = 0
    policy: int = 0
    pinned_policy: int = 0
    thp: int = 0
    ksm: int = 0
    min_bytes: int = 0
    max_bytes: int = 0

    def _values(self):
        return (self.fields, self.policy, self.pinned_policy, self.thp, self.ksm, self.min_bytes,
                self.max_bytes, 0)

    @classmethod
    def _from_values(cls, v, seq):
        return cls(*v[:7], seq=seq)


@dataclasses.dataclass
class Remap(Message):
    """Move ``start``+``length`` of a memfd region onto the passed file at ``file_offset`` (DEMOTE) or
    back into memory (PROMOTE; ``node`` ≥ 0 places the pages there); or let the range's pages be
    filled from the file's identical bytes on touch (SHARE) until UNSHARE fills the rest. The shim
    replies when done."""
    TYPE = MsgType.REMAP
    BODY = struct.Struct("<QQQBBhI")
    start: int = 0
    length: int = 0
    file_offset: int = 0
    direction: int = RemapDirection.DEMOTE
    flags: int = 0
    node: int = -1

    def _values(self):
        return (self.start, self.length, self.file_offset, self.direction, self.flags, self.node, 0)

    @classmethod
    def _from_values(cls, v, seq):
        return cls(*v[:6], seq=seq)


MESSAGES: dict[MsgType, type[Message]] = {
    cls.TYPE: cls for cls in (Hello, Reset, Register, Unregister, Ack, Error, Ping, Pong, Resync,
                              Rebind, Config, Remap)
}


def peek_seq(data: bytes) -> int:
    """The sender's seq from a header, or 0: used to address an ERROR reply to a bad record."""
    return HEADER.unpack_from(data)[4] if len(data) >= HEADER.size else 0


def decode(data: bytes) -> Message:
    """One record → a Message. Raises ProtocolError (errno + message) for anything else."""
    if len(data) < HEADER.size:
        raise ProtocolError(errno.EBADMSG, f"record of {len(data)} bytes is shorter than the "
                            f"{HEADER.size}-byte header")
    magic, version, mtype, size, seq = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ProtocolError(errno.EBADMSG, f"bad magic {magic:#010x} (expected \"TRDK\")", seq)
    if version != VERSION:
        raise ProtocolError(errno.EPROTO, f"protocol version {version} not supported; "
                            f"this side speaks {VERSION}", seq)
    try:
        cls = MESSAGES[MsgType(mtype)]
    except ValueError:
        raise ProtocolError(errno.EOPNOTSUPP, f"unknown message type {mtype}", seq) from None
    if size != len(data) or size != cls.size():
        raise ProtocolError(errno.EBADMSG, f"{cls.TYPE.name}: record is {len(data)} bytes "
                            f"(header says {size}), expected {cls.size()}", seq)
    return cls._from_values(cls.BODY.unpack_from(data, HEADER.size), seq)
