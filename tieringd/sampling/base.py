# SPDX-License-Identifier: Apache-2.0
"""The sampler interface the heat model consumes, and the common part of the BPF samplers.

A sampler, whatever its source, hands out per-interval deltas: ``read_deltas()`` returns a numpy
array of :data:`tieringd.contracts.ACCESS_DELTA_DTYPE` — one row per (pid, block) seen since the
previous call, with the count of samples, the latest sample's CLOCK_MONOTONIC time and the source.
"""
from __future__ import annotations

import abc
import ctypes
import errno
import logging
import os
import sys
from pathlib import Path
from typing import Callable

import numpy as np

from tieringd.contracts import ACCESS_DELTA_DTYPE, SampleSource

from . import _libbpf
from .tracking import (BLOCK_KEY_DTYPE, BLOCK_VAL_DTYPE, BLOCKS_MAX_DEFAULT, RAW_RING_BYTES_DEFAULT,
                       STAT_MAX, STAT_NAMES, BlockKey, BlockVal, Control, RangeKey, RangeVal,
                       SampleEvent, TrackedPid, TrackedSet)

log = logging.getLogger(__name__)

# read_blocks(): the deltas plus the tool-specific column (protection faults, bytes, sample periods).
BLOCK_ROWS_DTYPE = np.dtype([("pid", np.int32), ("block_start", np.uint64), ("block_len", np.uint64),
                             ("count", np.uint64), ("last_seen_ns", np.uint64), ("extra", np.uint64)])

_U32_MAX = np.iinfo(np.uint32).max


class SamplerUnavailable(RuntimeError):
    """This sampler cannot run here; ``str()`` says why in words a user can act on."""


def empty_deltas() -> np.ndarray:
    return np.zeros(0, ACCESS_DELTA_DTYPE)


def to_deltas(rows: np.ndarray, source: SampleSource) -> np.ndarray:
    """BLOCK_ROWS_DTYPE → ACCESS_DELTA_DTYPE (counts and lengths saturate at 2^32-1)."""
    out = np.zeros(len(rows), ACCESS_DELTA_DTYPE)
    out["pid"] = rows["pid"]
    out["block_start"] = rows["block_start"]
    out["block_len"] = np.minimum(rows["block_len"], _U32_MAX)
    out["count"] = np.minimum(rows["count"], _U32_MAX)
    out["last_seen_ns"] = rows["last_seen_ns"]
    out["source"] = int(source)
    return out


class Sampler(abc.ABC):
    """One access source. Life cycle: ``start()`` → ``read_deltas()`` every interval → ``close()``.

    A source that can tell writes from reads (``tells_writes``: the fault sampler, from the error
    code) leaves in ``last_writes`` the write count of each row of its last ``read_deltas()`` (uint32,
    same order): a side channel, so ACCESS_DELTA_DTYPE stays what every consumer reads."""

    name: str = "sampler"
    source: SampleSource
    tells_writes: bool = False
    last_writes: np.ndarray | None = None

    @abc.abstractmethod
    def start(self) -> None:
        """Raises :class:`SamplerUnavailable` with the reason when it cannot run here."""

    @abc.abstractmethod
    def read_deltas(self) -> np.ndarray:
        """Rows of ACCESS_DELTA_DTYPE seen since the previous call."""

    def stats(self) -> dict[str, int]:
        return {}

    def fileno(self) -> int | None:
        """An fd that becomes readable when raw samples wait (None: this sampler has none)."""
        return None

    def close(self) -> None:
        pass

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def touches(deltas: np.ndarray) -> np.ndarray:
    """Fault rows counted as one touch each. A hint fault says "touched since the last scan pass",
    and how many a block takes depends on its page size: a hot THP-backed block faults once per pass,
    a 4 KiB-backed one up to 512 times (lab, docs/loop.md) — raw counts would rank every hot block on
    the slow tier (4 KiB pages) above every hot one on the fast tier (THPs). Counting each (block,
    interval) with a fault once makes both tiers comparable; frequency then means "intervals in
    which the block was touched". Other sources (PMU samples, DAMON) keep their counts."""
    if len(deltas) == 0:
        return deltas
    out = deltas.copy()
    fault = out["source"] == int(SampleSource.FAULT)
    out["count"][fault] = np.minimum(out["count"][fault], 1)
    return out


def bpf_object_dirs() -> list[Path]:
    """Where the compiled ``*.bpf.o`` are looked for, first match wins."""
    dirs = []
    if os.environ.get("TIERINGD_BPF_DIR"):
        dirs.append(Path(os.environ["TIERINGD_BPF_DIR"]))
    dirs.append(Path(__file__).resolve().parents[2] / "build" / "bpf")   # source checkout (make)
    # make install: the package's venv is PREFIX/lib/tieringd/venv, the objects PREFIX/lib/tieringd/bpf
    dirs.append(Path(sys.prefix).parent / "bpf")
    dirs += [Path("/usr/local/lib/tieringd/bpf"), Path("/usr/lib/tieringd/bpf")]
    return dirs


def bpf_object_path(tool: str) -> Path:
    for d in bpf_object_dirs():
        p = d / f"{tool}.bpf.o"
        if p.exists():
            return p
    raise SamplerUnavailable(f"{tool}.bpf.o is not built (run make; looked in "
                             + ", ".join(str(d) for d in bpf_object_dirs()) + ")")


def explain_bpf_error(e: OSError, tool: str) -> str:
    """A sentence a user can act on for the usual reasons a load or attach fails."""
    if e.errno == errno.EPERM or e.errno == errno.EACCES:
        from .features import effective_caps
        caps = effective_caps()
        missing = [c for c in ("CAP_BPF", "CAP_PERFMON", "CAP_SYS_ADMIN") if not caps[c]]
        if os.geteuid() != 0:
            why = "not running as root"
        elif missing:
            why = "this process lacks " + ", ".join(missing)
        else:
            why = "refused despite root (lockdown or an LSM?)"
        return f"{tool}: the kernel refused BPF ({why}; loading needs CAP_BPF+CAP_PERFMON or CAP_SYS_ADMIN)"
    if e.errno == errno.ENOENT and "attach" in str(e):
        return f"{tool}: attach point missing on this kernel ({e})"
    if e.errno == errno.ENOSYS:
        return f"{tool}: this kernel has no bpf() system call (CONFIG_BPF_SYSCALL)"
    return f"{tool}: {e}"


class BpfSampler(Sampler):
    """A CO-RE object from ``bpf/<tool>.bpf.c`` with the shared tracking maps.

    Steps, each its own method so a caller can stop between them: :meth:`open` (object parsed,
    struct sizes checked), :meth:`configure` (rodata, map sizes, shared maps), :meth:`load`
    (verifier), :meth:`attach`. :meth:`start` runs all four and cleans up on failure.
    """

    tool: str = ""
    programs: tuple[str, ...] = ()      # attached by section (tracepoints); others attach themselves
    rodata_defaults: dict[str, int] = {}

    def __init__(self, tracked: TrackedSet, *, raw: bool = False,
                 blocks_max: int = BLOCKS_MAX_DEFAULT, raw_ring_bytes: int = RAW_RING_BYTES_DEFAULT,
                 **targs):
        self.tracked = tracked
        self.raw = raw
        self.blocks_max = blocks_max
        self.raw_ring_bytes = raw_ring_bytes
        self.targs = {**self.rodata_defaults, **targs}
        self.name = self.tool
        self.obj: _libbpf.BpfObject | None = None
        self.links: list[_libbpf.Link] = []
        self._ring: _libbpf.RingBuffer | None = None
        self._epoch = 0

    # ---- life cycle
    def open(self) -> None:
        try:
            self.obj = _libbpf.BpfObject(bpf_object_path(self.tool))
        except _libbpf.LibbpfMissing as e:
            raise SamplerUnavailable(str(e).split("\n")[0]) from e
        except OSError as e:
            raise SamplerUnavailable(explain_bpf_error(e, self.tool)) from e
        try:
            self.check_layout()
        except _libbpf.BpfError as e:   # a stale .bpf.o, or a .h changed without its .py mirror
            raise SamplerUnavailable(f"{self.tool}: {e.strerror}") from e

    def check_layout(self) -> None:
        m = self.obj.map
        m("tracked_pids").check_sizes(ctypes.c_uint32, TrackedPid)
        m("tracked_ranges").check_sizes(RangeKey, RangeVal)
        m("stats").check_sizes(ctypes.c_uint32, ctypes.c_uint64)
        if "blocks0" in self.obj.maps:
            for name in ("blocks0", "blocks1"):
                m(name).check_sizes(BlockKey, BlockVal)
                m(name).check_sizes(BLOCK_KEY_DTYPE, BLOCK_VAL_DTYPE)
            m("control").check_sizes(ctypes.c_uint32, Control)

    def configure(self) -> None:
        obj = self.obj
        if "targ_raw" in obj.rodata.vars:
            obj.rodata["targ_raw"] = int(self.raw)
        for name, value in self.targs.items():
            obj.rodata[name] = int(value)
        if "blocks0" in obj.maps:
            obj.map("blocks0").set_max_entries(self.blocks_max)
            obj.map("blocks1").set_max_entries(self.blocks_max)
        if "events" in obj.maps:
            # a ring buffer is a power-of-two number of pages; one page when raw samples are off
            size = max(self.raw_ring_bytes, 4096) if self.raw else 4096
            obj.map("events").set_max_entries(1 << (size - 1).bit_length())
        shared = self.tracked.kernel_maps
        if shared:
            obj.map("tracked_pids").reuse_fd(shared[0])
            obj.map("tracked_ranges").reuse_fd(shared[1])

    def load(self) -> None:
        try:
            self.obj.load()
        except OSError as e:
            raise SamplerUnavailable(explain_bpf_error(e, self.tool)) from e
        self.tracked.bind_kernel_maps(self.obj.map("tracked_pids").fd,
                                      self.obj.map("tracked_ranges").fd)

    def attach(self) -> None:
        for prog in self.programs:
            try:
                self.links.append(self.obj.program(prog).attach())
            except OSError as e:
                raise SamplerUnavailable(explain_bpf_error(e, f"{self.tool}/{prog}")) from e

    def start(self) -> None:
        try:
            self.open()
            self.configure()
            self.load()
            self.attach()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for link in self.links:
            link.destroy()
        self.links.clear()
        if self._ring is not None:
            self._ring.close()
            self._ring = None
        if self.obj is not None:
            self.obj.close()
            self.obj = None

    # ---- reading
    def read_blocks(self) -> np.ndarray:
        """Flips the epoch and drains the map the programs counted into until now."""
        if self.obj is None or not self.obj.loaded:
            raise RuntimeError(f"{self.tool}: not started")
        old = self._epoch & 1
        self._epoch += 1
        self.obj.map("control").update(ctypes.c_uint32(0), Control(self._epoch, 0))
        kbytes, vbytes, n = self.obj.map(f"blocks{old}").drain(BLOCK_KEY_DTYPE.itemsize,
                                                              BLOCK_VAL_DTYPE.itemsize)
        keys = np.frombuffer(kbytes, BLOCK_KEY_DTYPE, count=n)
        vals = np.frombuffer(vbytes, BLOCK_VAL_DTYPE, count=n)
        rows = np.zeros(n, BLOCK_ROWS_DTYPE)
        rows["pid"] = keys["tgid"]
        rows["block_start"] = keys["block_start"]
        rows["block_len"] = vals["block_len"]
        rows["count"] = vals["count"]
        rows["last_seen_ns"] = vals["last_seen_ns"]
        rows["extra"] = vals["extra"]
        return rows

    def read_deltas(self) -> np.ndarray:
        return to_deltas(self.read_blocks(), self.source)

    def stats(self) -> dict[str, int]:
        """Counters summed over CPUs since load (STAT_* in bpf/tracking.h)."""
        if self.obj is None or not self.obj.loaded:
            return {}
        ncpu = _libbpf.possible_cpus()
        vt = ctypes.c_uint64 * ncpu
        out = {}
        for i, name in enumerate(STAT_NAMES[:STAT_MAX]):
            v = self.obj.map("stats").lookup(ctypes.c_uint32(i), vt)
            out[name] = int(sum(v)) if v is not None else 0
        return out

    # ---- raw samples (only when constructed with raw=True)
    def on_raw(self, callback: Callable[[SampleEvent], None]) -> None:
        """``callback(SampleEvent)`` for each raw sample, called from :meth:`poll_raw`."""
        if not self.raw:
            raise RuntimeError(f"{self.tool}: raw samples were not asked for (raw=True)")
        self._ring = _libbpf.RingBuffer(self.obj.map("events"), callback, SampleEvent)

    def poll_raw(self, timeout_ms: int = 0) -> int:
        return self._ring.poll(timeout_ms) if self._ring else 0

    def fileno(self) -> int | None:
        return self._ring.fileno() if self._ring else None
