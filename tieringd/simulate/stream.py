# SPDX-License-Identifier: Apache-2.0
"""The access stream on disk: what the expansion writes once and every run reads, window by window.

A trace expands to far more block accesses than it has records — a request reads every block of its
context at every decode window, so a coding agent's 8,621 requests over 70k–150k-token contexts make
about 130 million — and no run needs more than one window of them at a time. So the expansion
(expand.py) writes the accesses to a spool directory as it makes them, and a replay reads them back a
chunk at a time: memory holds the blocks (what each policy keeps per block) and one chunk of accesses,
whatever the trace's length.

Files, one value per access unless said (raw little-endian arrays, appended in order):

- ``block.i32``: the block, numbered 0, 1, 2… in order of first access;
- ``count.f64``: reads collapsed into the access (a window's reads of one block are one access);
- ``positional.f32``, ``sharers.i32``: the access's positional weight and sharers (expand.py);
- ``window.i64``: per window with accesses, its index and the number of its first access;
- ``next.i64``: the access's block's next access (the stream's length when none), written by
  :meth:`Spool.index_next_use`, a reverse pass over ``block.i32`` one chunk at a time — what Belady's
  MIN needs and no forward pass can know.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import weakref
from typing import Iterator

import numpy as np

_FILES = {"block": np.int32, "count": np.float64, "positional": np.float32, "sharers": np.int32}
CHUNK_ACCESSES = 1 << 20        # accesses per read or write (about 20 MiB of arrays)
_WINDOW_RECORD = np.dtype([("window", np.int64), ("start", np.int64)])


@dataclasses.dataclass
class WindowAccesses:
    """One window's accesses, in order. ``lo`` is the number of the first one in the stream."""
    window: int
    lo: int
    block: np.ndarray        # int64
    count: np.ndarray        # float64
    positional: np.ndarray   # float32
    sharers: np.ndarray      # int64
    next_use: np.ndarray | None = None    # int64: the block's next access in the stream (Belady)

    @property
    def hi(self) -> int:
        return self.lo + len(self.block)


class SpoolWriter:
    """Appends windows of accesses to a spool directory, buffered to ``CHUNK_ACCESSES``."""

    def __init__(self, directory: str):
        self.directory = directory
        self.files = {k: open(os.path.join(directory, f"{k}.{np.dtype(t).str[1:]}"), "wb") for k, t in _FILES.items()}
        self.windows = open(os.path.join(directory, "window.i64"), "wb")
        self.buffers: dict[str, list[np.ndarray]] = {k: [] for k in _FILES}
        self.window_rows: list[tuple[int, int]] = []
        self.buffered = 0
        self.accesses = 0

    def add(self, window: int, block: np.ndarray, count: np.ndarray, positional: np.ndarray,
            sharers: np.ndarray) -> None:
        if len(block) == 0:
            return
        if block.max() >= np.iinfo(np.int32).max:
            raise ValueError("more than 2^31 distinct blocks: beyond the spool's block numbers")
        self.window_rows.append((window, self.accesses))
        for k, a in zip(_FILES, (block, count, positional, sharers)):
            self.buffers[k].append(np.asarray(a, _FILES[k]))
        self.accesses += len(block)
        self.buffered += len(block)
        if self.buffered >= CHUNK_ACCESSES:
            self.flush()

    def flush(self) -> None:
        for k, parts in self.buffers.items():
            if parts:
                self.files[k].write(np.concatenate(parts).tobytes())
            parts.clear()
        if self.window_rows:
            self.windows.write(np.array(self.window_rows, _WINDOW_RECORD).tobytes())
            self.window_rows.clear()
        self.buffered = 0

    def close(self) -> None:
        self.flush()
        for f in (*self.files.values(), self.windows):
            f.close()


class Spool:
    """A spooled stream of accesses: its directory, its length and how many blocks it names. Read it
    with :meth:`windows`; the directory goes when the spool is closed or collected."""

    def __init__(self, directory: str, accesses: int, nblocks: int, owned: bool = True):
        self.directory = directory
        self.accesses = accesses
        self.nblocks = nblocks
        self.has_next_use = os.path.exists(self._path("next.i64"))
        self._cleanup = weakref.finalize(self, shutil.rmtree, directory, True) if owned else None

    @classmethod
    def create(cls, parent: str | None = None) -> tuple[str, SpoolWriter]:
        directory = tempfile.mkdtemp(prefix="tieringd-sim-", dir=parent)
        return directory, SpoolWriter(directory)

    def close(self) -> None:
        if self._cleanup is not None:
            self._cleanup()

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _file(self, key: str) -> str:
        return self._path(f"{key}.{np.dtype(_FILES[key]).str[1:]}")

    def window_records(self) -> Iterator[np.ndarray]:
        with open(self._path("window.i64"), "rb") as f:
            while True:
                rows = np.fromfile(f, _WINDOW_RECORD, 1 << 16)
                if len(rows) == 0:
                    return
                yield rows

    def index_next_use(self) -> None:
        """Writes ``next.i64``: for every access, the number of its block's next access (the stream's
        length when there is none), from a reverse pass over the blocks one chunk at a time; memory:
        one chunk and one number per block."""
        if self.has_next_use:
            return
        n = self.accesses
        upcoming = np.full(self.nblocks, n, np.int64)      # per block: its first access after the chunk
        partial = self._path(f"next.i64.{os.getpid()}")    # renamed when whole: a reader never sees a part
        with open(self._file("block"), "rb") as blocks, open(partial, "wb") as out:
            out.truncate(n * 8)
            for lo in range(((n - 1) // CHUNK_ACCESSES) * CHUNK_ACCESSES if n else -1, -1, -CHUNK_ACCESSES):
                hi = min(lo + CHUNK_ACCESSES, n)
                blocks.seek(lo * 4)
                b = np.fromfile(blocks, np.int32, hi - lo).astype(np.int64)
                out.seek(lo * 8)
                out.write(_next_in_chunk(b, lo, upcoming).tobytes())
        os.replace(partial, self._path("next.i64"))
        self.has_next_use = True

    def windows(self, next_use: bool = False) -> Iterator[WindowAccesses]:
        """The stream, window by window, read a chunk at a time."""
        if next_use:
            self.index_next_use()
        keys = list(_FILES) + (["next"] if next_use else [])
        files = {k: open(self._file(k) if k != "next" else self._path("next.i64"), "rb") for k in keys}
        dtypes = {**_FILES, "next": np.int64}
        try:
            buf: dict[str, np.ndarray] = {}
            base = 0                         # stream number of buf's first access
            for rows in self.window_records():
                starts = rows["start"]
                ends = np.append(starts[1:], self.accesses)
                for w, lo, hi in zip(rows["window"].tolist(), starts.tolist(), ends.tolist()):
                    if not buf or hi > base + len(buf["block"]):
                        want = max(hi, min(lo + CHUNK_ACCESSES, self.accesses)) - lo
                        buf = {k: _read_at(files[k], dtypes[k], lo, want) for k in keys}
                        base = lo
                    a, b = lo - base, hi - base
                    yield WindowAccesses(w, lo, buf["block"][a:b].astype(np.int64), buf["count"][a:b],
                                         buf["positional"][a:b], buf["sharers"][a:b].astype(np.int64),
                                         buf["next"][a:b] if next_use else None)
        finally:
            for f in files.values():
                f.close()


def _read_at(f, dtype, lo: int, count: int) -> np.ndarray:
    f.seek(lo * np.dtype(dtype).itemsize)
    return np.fromfile(f, dtype, count)


def _next_in_chunk(block: np.ndarray, lo: int, upcoming: np.ndarray) -> np.ndarray:
    """Next-access numbers for one chunk of the stream starting at ``lo``, given each block's first
    access after it (``upcoming``, updated to the chunk's first accesses)."""
    order = np.argsort(block, kind="stable")          # by block, then position
    sb = block[order]
    same = sb[1:] == sb[:-1]
    nxt = np.empty(len(block), np.int64)
    nxt[order[:-1][same]] = order[1:][same] + lo
    last = np.append(~same, True)                      # the last access of its block in the chunk
    nxt[order[last]] = upcoming[sb[last]]
    first = np.insert(~same, 0, True)
    upcoming[sb[first]] = order[first] + lo
    return nxt
