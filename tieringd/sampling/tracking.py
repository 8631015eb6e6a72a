# SPDX-License-Identifier: Apache-2.0
"""The tracked set (which processes and address ranges the samplers count) and the Python mirror of
``bpf/tracking.h``.

Every BPF sampler filters in the kernel by two maps the daemon writes: ``tracked_pids`` (tgid → how
to account it) and ``tracked_ranges`` (an LPM trie over big-endian (tgid, address) keys: a range
becomes the few aligned prefixes that cover it). :class:`TrackedSet` is the daemon's side: it
validates what it is told (the shim's reports are untrusted), keeps the set in Python for the
accessed-bit fallback and THP accounting, and mirrors it into the kernel maps once a BPF sampler
has loaded. All samplers share the same two kernel maps (``bpf_map__reuse_fd``).
"""
from __future__ import annotations

import bisect
import ctypes
import dataclasses
import os

import numpy as np

from . import _libbpf

u32, u64 = ctypes.c_uint32, ctypes.c_uint64

# bpf/tracking.h constants
TRACKED_PIDS_MAX = 4096
TRACKED_PREFIXES_MAX = 65536
BLOCKS_MAX_DEFAULT = 32768
RAW_RING_BYTES_DEFAULT = 256 * 1024
TRACK_ALL_ADDRS = 0x1
USER_ADDR_END = 1 << 56          # x86-64 with 5-level paging; 4-level user space ends at 2^47
STAT_NAMES = ["events", "untracked_pid", "outside_ranges", "counted", "block_full", "raw_dropped",
              "truncated", "filtered", "no_addr"]
STAT_MAX = 16


class TrackedPid(ctypes.Structure):
    _fields_ = [("flags", u32), ("default_block_shift", u32)]


class RangeKey(ctypes.Structure):
    _fields_ = [("prefixlen", u32), ("tgid_be", u32), ("addr_be", u64)]


class RangeVal(ctypes.Structure):
    _fields_ = [("start", u64), ("len", u64), ("block_len", u64)]


class BlockKey(ctypes.Structure):
    _fields_ = [("tgid", u32), ("pad", u32), ("block_start", u64)]


class BlockVal(ctypes.Structure):
    _fields_ = [("count", u64), ("last_seen_ns", u64), ("extra", u64), ("block_len", u64)]


class Control(ctypes.Structure):
    _fields_ = [("epoch", u32), ("pad", u32)]


class SampleEvent(ctypes.Structure):
    _fields_ = [("ts_ns", u64), ("addr", u64), ("ip", u64), ("len", u64),
                ("tgid", u32), ("tid", u32), ("kind", u32), ("aux", u32)]


# The same layouts as numpy dtypes, to turn a drained map into arrays without a Python loop.
BLOCK_KEY_DTYPE = np.dtype([("tgid", "<u4"), ("pad", "<u4"), ("block_start", "<u8")])
BLOCK_VAL_DTYPE = np.dtype([("count", "<u8"), ("last_seen_ns", "<u8"), ("extra", "<u8"),
                            ("block_len", "<u8")])
assert BLOCK_KEY_DTYPE.itemsize == ctypes.sizeof(BlockKey)
assert BLOCK_VAL_DTYPE.itemsize == ctypes.sizeof(BlockVal)


def _be32(x: int) -> int:
    """The integer whose little-endian bytes are ``x`` in big-endian (for a ctypes u32 field)."""
    return int.from_bytes(x.to_bytes(4, "big"), "little")


def _be64(x: int) -> int:
    return int.from_bytes(x.to_bytes(8, "big"), "little")


def range_prefixes(start: int, end: int) -> list[tuple[int, int]]:
    """The fewest aligned (address, prefix bits) blocks that exactly cover [start, end) in a 64-bit
    address space: what an LPM trie needs to match a range. Page-aligned ranges give a handful."""
    if not 0 <= start < end <= 1 << 64:
        raise ValueError(f"bad range [{start:#x}, {end:#x})")
    out = []
    while start < end:
        # largest power-of-two block aligned at start that fits
        size = start & -start if start else 1 << 64
        while size > end - start:
            size >>= 1
        out.append((start, 64 - (size.bit_length() - 1)))
        start += size
    return out


def range_key(tgid: int, addr: int, addr_bits: int) -> RangeKey:
    return RangeKey(prefixlen=32 + addr_bits, tgid_be=_be32(tgid), addr_be=_be64(addr))


@dataclasses.dataclass(frozen=True)
class TrackedRange:
    pid: int
    start: int
    length: int
    block_len: int

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclasses.dataclass
class TrackedProcess:
    pid: int
    all_addresses: bool
    default_block_len: int
    ranges: list[TrackedRange] = dataclasses.field(default_factory=list)   # sorted by start


class TrackingError(ValueError):
    """Bad input to the tracked set (the message says what and why); nothing was changed."""


class TrackedSet:
    """Processes and ranges the samplers count. Validates every change; mirrors it into the kernel
    maps when bound (:meth:`bind_kernel_maps`)."""

    def __init__(self) -> None:
        self._procs: dict[int, TrackedProcess] = {}
        self._pids_fd: int | None = None
        self._ranges_fd: int | None = None
        self._nprefixes = 0
        self.generation = 0          # bumped on every change (samplers re-read what they derive)

    # ---- queries
    def pids(self) -> list[int]:
        return sorted(self._procs)

    def process(self, pid: int) -> TrackedProcess | None:
        return self._procs.get(pid)

    def ranges(self, pid: int | None = None) -> list[TrackedRange]:
        procs = [self._procs[pid]] if pid is not None and pid in self._procs else \
            ([] if pid is not None else list(self._procs.values()))
        return [r for p in procs for r in p.ranges]

    def __contains__(self, pid: int) -> bool:
        return pid in self._procs

    def __len__(self) -> int:
        return len(self._procs)

    # ---- changes
    def add_process(self, pid: int, *, all_addresses: bool = False,
                    default_block_len: int = 2 << 20) -> None:
        """Track ``pid``. ``all_addresses``: count samples outside registered ranges too, in
        ``default_block_len`` blocks (a power of two) — what ``tieringctl sample --pid`` uses."""
        if not isinstance(pid, int) or pid <= 0:
            raise TrackingError(f"pid must be a positive integer, not {pid!r}")
        if default_block_len < 4096 or default_block_len > 1 << 30 or \
                default_block_len & (default_block_len - 1):
            raise TrackingError(f"default block length must be a power of two in [4 KiB, 1 GiB], "
                                f"not {default_block_len}")
        if pid not in self._procs and len(self._procs) >= TRACKED_PIDS_MAX:
            raise TrackingError(f"cannot track more than {TRACKED_PIDS_MAX} processes")
        old = self._procs.get(pid)
        proc = TrackedProcess(pid, all_addresses, default_block_len, old.ranges if old else [])
        self._procs[pid] = proc
        self._push_pid(proc)
        self.generation += 1

    def remove_process(self, pid: int) -> None:
        proc = self._procs.pop(pid, None)
        if proc is None:
            return
        for r in proc.ranges:
            self._drop_range_prefixes(r)
        if self._pids_fd is not None:
            _libbpf.map_delete(self._pids_fd, u32(pid), "tracked_pids")
        self.generation += 1

    def add_range(self, pid: int, start: int, length: int, block_len: int) -> TrackedRange:
        """Count [start, start+length) of ``pid`` in ``block_len`` blocks counted from ``start``."""
        proc = self._procs.get(pid)
        if proc is None:
            raise TrackingError(f"pid {pid} is not tracked (add_process first)")
        for name, v in (("start", start), ("length", length), ("block_len", block_len)):
            if not isinstance(v, int) or v < 0:
                raise TrackingError(f"{name} must be a non-negative integer, not {v!r}")
        if length <= 0 or block_len <= 0:
            raise TrackingError("length and block_len must be positive")
        if start + length > USER_ADDR_END:
            raise TrackingError(f"range [{start:#x}, {start + length:#x}) is not a user address range")
        if block_len > length or block_len >= 1 << 40:
            raise TrackingError(f"block_len {block_len} does not fit the range ({length} bytes)")
        r = TrackedRange(pid, start, length, block_len)
        starts = [x.start for x in proc.ranges]
        i = bisect.bisect_left(starts, start)
        for nb in proc.ranges[max(0, i - 1):i + 1]:
            if nb.start < r.end and r.start < nb.end:
                raise TrackingError(f"range [{start:#x}, {r.end:#x}) overlaps tracked "
                                    f"[{nb.start:#x}, {nb.end:#x}) of pid {pid}")
        prefixes = range_prefixes(start, r.end)
        if self._nprefixes + len(prefixes) > TRACKED_PREFIXES_MAX:
            raise TrackingError(f"tracked ranges are full ({TRACKED_PREFIXES_MAX} prefixes)")
        proc.ranges.insert(i, r)
        self._nprefixes += len(prefixes)
        if self._ranges_fd is not None:
            val = RangeVal(start, length, block_len)
            for addr, bits in prefixes:
                _libbpf.map_update(self._ranges_fd, range_key(pid, addr, bits), val,
                                   name="tracked_ranges")
        self.generation += 1
        return r

    def remove_range(self, pid: int, start: int) -> bool:
        proc = self._procs.get(pid)
        if proc is None:
            return False
        for i, r in enumerate(proc.ranges):
            if r.start == start:
                del proc.ranges[i]
                self._drop_range_prefixes(r)
                self.generation += 1
                return True
        return False

    def find_range(self, pid: int, addr: int) -> TrackedRange | None:
        proc = self._procs.get(pid)
        if proc is None:
            return None
        starts = [x.start for x in proc.ranges]
        i = bisect.bisect_right(starts, addr) - 1
        if i >= 0 and proc.ranges[i].start <= addr < proc.ranges[i].end:
            return proc.ranges[i]
        return None

    # ---- kernel mirror
    @property
    def kernel_maps(self) -> tuple[int, int] | None:
        """(tracked_pids fd, tracked_ranges fd) once bound, for ``bpf_map__reuse_fd``."""
        if self._pids_fd is None:
            return None
        return self._pids_fd, self._ranges_fd

    def bind_kernel_maps(self, pids_fd: int, ranges_fd: int) -> None:
        """Adopt the maps of the first loaded sampler (fds are duplicated) and write the set."""
        if self._pids_fd is not None:
            return
        self._pids_fd, self._ranges_fd = os.dup(pids_fd), os.dup(ranges_fd)
        for proc in self._procs.values():
            self._push_pid(proc)
            for r in proc.ranges:
                val = RangeVal(r.start, r.length, r.block_len)
                for addr, bits in range_prefixes(r.start, r.end):
                    _libbpf.map_update(self._ranges_fd, range_key(r.pid, addr, bits), val,
                                       name="tracked_ranges")

    def close(self) -> None:
        for fd in (self._pids_fd, self._ranges_fd):
            if fd is not None:
                os.close(fd)
        self._pids_fd = self._ranges_fd = None

    def _push_pid(self, proc: TrackedProcess) -> None:
        if self._pids_fd is None:
            return
        v = TrackedPid(TRACK_ALL_ADDRS if proc.all_addresses else 0,
                       proc.default_block_len.bit_length() - 1)
        _libbpf.map_update(self._pids_fd, u32(proc.pid), v, name="tracked_pids")

    def _drop_range_prefixes(self, r: TrackedRange) -> None:
        prefixes = range_prefixes(r.start, r.end)
        self._nprefixes -= len(prefixes)
        if self._ranges_fd is None:
            return
        for addr, bits in prefixes:
            _libbpf.map_delete(self._ranges_fd, range_key(r.pid, addr, bits), "tracked_ranges")
