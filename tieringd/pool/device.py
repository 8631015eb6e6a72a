# SPDX-License-Identifier: Apache-2.0
"""The pool's memory on this host: a devdax device every host of the pool maps (or one file they all
map: a shared fsdax mount, or the host tests' stand-in for the device).

Extent 0 is the pool's own: a header (magic, the pool's uuid and geometry, a checksum) that the host
which created the pool writes once, and from 4 KiB on, 64-byte *nonce slots*. A joining host writes a
fresh random nonce into a slot and says where in etcd; a member reads that slot on its own device and
answers whether it found the nonce there. A device name (dax0.0) or a uuid in a header proves nothing
— two machines may hold copies of one image — a nonce written now by one host and read by another does
(docs/pool.md, "Joining").

Reads of blocks for their content hash go through one read-only mapping of the whole device. The
daemon writes the device only here: the header, a nonce, and a block it publishes in the shared
index (:meth:`PoolDevice.write_block`, flushed before its index entry appears); the KV the log
holds is written by the shims (``shim/remap.c``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import mmap
import os
import stat
import struct
import zlib

from tieringd.memory import devices

MiB = 1 << 20
HEADER_MAP_BYTES = 2 * MiB          # a devdax mapping is a multiple of the device's alignment (2 MiB)
MAGIC = b"TRDPOOL1"
HEADER = struct.Struct("<8sII16sQQQ")        # magic, version, 0, uuid, device_bytes, extent_bytes, extents
CRC = struct.Struct("<I")
SLOT_MAGIC = b"TRDNONCE"
SLOT = struct.Struct("<8s16s32s8x")            # 64 bytes: magic, nonce, host
SLOTS_FROM = 4096
SLOTS = (HEADER_MAP_BYTES - SLOTS_FROM) // SLOT.size


class DeviceError(OSError):
    """The pool device cannot be used; the message says why in one line."""


@dataclasses.dataclass(frozen=True)
class Header:
    uuid: str
    device_bytes: int
    extent_bytes: int
    extents: int


def device_size(path: str) -> int:
    """The device's size: a devdax device's from sysfs (a character device has no size of its own),
    a file's from its length."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise DeviceError(f"{path}: {e.strerror}") from None
    if stat.S_ISREG(st.st_mode):
        return st.st_size
    name = os.path.basename(path)
    for d in devices.read_dax([]):
        if d.name == name:
            if not d.size_bytes:
                raise DeviceError(f"{path}: its size is unknown")
            return int(d.size_bytes)
    raise DeviceError(f"{path}: no such devdax device")


class PoolDevice:
    """One open pool device: the header, the nonce slots, a read-only view of every block."""

    def __init__(self, path: str, size_bytes: int | None = None):
        self.path = path
        try:
            self.size_bytes = size_bytes if size_bytes is not None else device_size(path)
            self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise DeviceError(f"{path}: {e.strerror}") from None
        try:
            self._head = mmap.mmap(self.fd, HEADER_MAP_BYTES, mmap.MAP_SHARED,
                                   mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
            self._view = mmap.mmap(self.fd, self.size_bytes - self.size_bytes % HEADER_MAP_BYTES,
                                   mmap.MAP_SHARED, mmap.PROT_READ, offset=0)
        except (OSError, ValueError) as e:
            os.close(self.fd)
            raise DeviceError(f"{path}: cannot map it ({e})") from None

    def close(self) -> None:
        for m in (self._head, self._view):
            m.close()
        os.close(self.fd)

    # ---- the header ------------------------------------------------------------------------------
    def read_header(self) -> Header | None:
        """The header, or None when there is none (a fresh device) or its checksum is wrong."""
        raw = bytes(self._head[:HEADER.size + CRC.size])
        magic, version, _, uuid, dev, ext, n = HEADER.unpack_from(raw)
        if magic != MAGIC or version != 1 or CRC.unpack_from(raw, HEADER.size)[0] != zlib.crc32(raw[:HEADER.size]):
            return None
        return Header(uuid.hex(), dev, ext, n)

    def write_header(self, h: Header) -> None:
        body = HEADER.pack(MAGIC, 1, 0, bytes.fromhex(h.uuid), h.device_bytes, h.extent_bytes, h.extents)
        self._head[:len(body) + CRC.size] = body + CRC.pack(zlib.crc32(body))

    # ---- nonce slots -------------------------------------------------------------------------------
    def write_nonce(self, slot_offset: int, nonce: str, host: str) -> None:
        self._check_slot(slot_offset)
        self._head[slot_offset:slot_offset + SLOT.size] = SLOT.pack(SLOT_MAGIC, bytes.fromhex(nonce),
                                                                    host.encode()[:32])

    def read_nonce(self, slot_offset: int) -> str | None:
        self._check_slot(slot_offset)
        magic, nonce, _ = SLOT.unpack_from(self._head, slot_offset)
        return nonce.hex() if magic == SLOT_MAGIC else None

    @staticmethod
    def _check_slot(offset: int) -> None:
        if not SLOTS_FROM <= offset <= HEADER_MAP_BYTES - SLOT.size or (offset - SLOTS_FROM) % SLOT.size:
            raise DeviceError(f"nonce slot {offset:#x}: not a slot of the header")

    @staticmethod
    def slot_offset(k: int) -> int:
        return SLOTS_FROM + (k % SLOTS) * SLOT.size

    # ---- blocks ------------------------------------------------------------------------------------
    def digest(self, offset: int, length: int) -> str:
        """sha256 of the device's bytes there (what the shared index is keyed by)."""
        if offset < 0 or length <= 0 or offset + length > len(self._view):
            raise DeviceError(f"{offset:#x}+{length:#x}: outside the device")
        return hashlib.sha256(memoryview(self._view)[offset:offset + length]).hexdigest()

    def write_block(self, offset: int, data: bytes) -> None:
        """Write a block that is about to be published, and flush it before anything names it: CXL
        shared memory need not be coherent between hosts, so another host may read it only after
        this host's caches hold none of it. ``msync`` is the flush on a file (the host tests' stand-in,
        an fsdax file: the kernel writes the cache lines back); on a devdax device the kernel has no
        fsync and the writer must write the lines back itself (docs/pool.md, "Coherence")."""
        if offset < 0 or offset % 4096 or not data or offset + len(data) > len(self._view):
            raise DeviceError(f"{offset:#x}+{len(data):#x}: not a page-aligned block of the device")
        lo = offset - offset % HEADER_MAP_BYTES
        hi = -(-(offset + len(data)) // HEADER_MAP_BYTES) * HEADER_MAP_BYTES
        try:
            m = mmap.mmap(self.fd, hi - lo, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=lo)
        except (OSError, ValueError) as e:
            raise DeviceError(f"{self.path}: cannot map {lo:#x}+{hi - lo:#x} to write it ({e})") from None
        try:
            m[offset - lo:offset - lo + len(data)] = data
            try:
                m.flush()
            except OSError as e:
                if not stat.S_ISCHR(os.fstat(self.fd).st_mode):
                    raise DeviceError(f"{self.path}: flushing {offset:#x}+{len(data):#x}: {e.strerror}") from None
        finally:
            m.close()

    def read(self, offset: int, length: int) -> bytes:
        if offset < 0 or length <= 0 or offset + length > len(self._view):
            raise DeviceError(f"{offset:#x}+{length:#x}: outside the device")
        return bytes(self._view[offset:offset + length])
