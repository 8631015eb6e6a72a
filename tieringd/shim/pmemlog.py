# SPDX-License-Identifier: Apache-2.0
"""Space on the persistent-memory file of the DAX-remap tier: an append-only log (persistent memory
writes best sequentially), with segment cleaning whose write amplification has a bound.

The file is cut into fixed-size *segments*. Demotions write at the *head*, one after another, so the
media sees sequential writes; when the head segment cannot take the next extent it is sealed and the
next free segment (in file order, wrapping) becomes the head. An extent dies when its range is
promoted back, freed, or its process exits; a sealed segment then holds live and dead bytes.

Cleaning (Rosenblum & Ousterhout's LFS) makes free segments out of sealed ones by moving their live
extents to the head. Cleaning a segment with live fraction ``u`` writes ``u`` of a segment to free
``1 - u`` of one, so if only segments with ``u ≤ u_max`` are ever cleaned the log writes at most
``1 / (1 - u_max)`` bytes per byte demoted: that is the bound. ``max_write_amplification = 2`` gives
``u_max = 1/2`` — a segment is cleaned only when it is at least half dead, and the cleaner never
copies more than it frees. Victims are chosen by LFS's cost-benefit ratio ``(1 - u)·age / (1 + u)``,
so cold, long-sealed segments go before hot ones. What the policy may fill (``capacity_bytes``) is
``u_max`` of the segments outside the reserve: at that fill at least one sealed segment is always
cleanable (if every one had ``u > u_max``, live bytes would exceed the capacity), and the reserve
segments always hold a victim's live bytes.

This module is bookkeeping only: it never touches the file or a process. ``tieringd/shim/remap.py`` asks
it for extents, carries out demotions, promotions and relocations through the shim, and reports back.
"""
from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any, Callable, Iterator

from tieringd.config import ConfigError

MiB = 1 << 20


class LogFull(Exception):
    """No room for an extent, and no segment can be cleaned within the write-amplification bound."""


class SegmentState(enum.Enum):
    FREE = "free"
    HEAD = "head"          # being appended to
    SEALED = "sealed"
    CLEANING = "cleaning"  # its live extents are being moved out
    FOREIGN = "foreign"    # not this host's to write: a pool's extent it has not claimed (docs/pool.md)


@dataclasses.dataclass
class Extent:
    """Bytes ``offset``..``offset+length`` of the file hold ``length`` bytes of ``pid`` at ``start``."""
    offset: int
    length: int
    pid: int
    start: int

    @property
    def end(self) -> int:
        return self.offset + self.length

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Segment:
    index: int
    state: SegmentState = SegmentState.FREE
    live_bytes: int = 0
    fill_bytes: int = 0                 # how far the head got (appends go at offset + fill)
    sealed_at: float = 0.0
    extents: dict[int, Extent] = dataclasses.field(default_factory=dict)   # by file offset


@dataclasses.dataclass(frozen=True)
class LogGeometry:
    size_bytes: int
    segment_bytes: int = 64 * MiB
    align_bytes: int = 2 * MiB          # extents of at least this much start on this boundary (a PMD)
    max_write_amplification: float = 2.0
    reserve_segments: int = 2

    def validate(self, table: str = "dax") -> None:
        if self.segment_bytes <= 0 or self.segment_bytes % self.align_bytes:
            raise ConfigError.bad_value(table, "segment_bytes", f"a positive multiple of "
                                        f"{self.align_bytes // MiB} MiB", self.segment_bytes)
        if self.max_write_amplification <= 1.0:
            raise ConfigError.bad_value(table, "max_write_amplification", "a number above 1",
                                        self.max_write_amplification)
        if self.reserve_segments < 1:
            raise ConfigError.bad_value(table, "reserve_segments", "at least 1", self.reserve_segments)
        if self.size_bytes // self.segment_bytes <= self.reserve_segments:
            raise ConfigError.bad_value(table, "size_bytes", f"more than {self.reserve_segments} "
                                        f"segments of {self.segment_bytes // MiB} MiB", self.size_bytes)

    @property
    def segments(self) -> int:
        return self.size_bytes // self.segment_bytes

    @property
    def max_live_fraction(self) -> float:
        """u_max: the fullest segment the cleaner may clean."""
        return 1.0 - 1.0 / self.max_write_amplification


class PmemLog:
    """Segments, the head, and which extents are live. Not thread-safe: one owner (``DaxTier``)."""

    def __init__(self, geometry: LogGeometry, clock: Callable[[], float] = time.monotonic, *,
                 foreign: bool = False):
        """``foreign``: every segment starts FOREIGN (a pool's device, where this host writes only
        the extents it claimed: :meth:`own` hands them to the log, :meth:`disown` takes back an
        empty one)."""
        geometry.validate()
        self.geometry = geometry
        self._clock = clock
        start = SegmentState.FOREIGN if foreign else SegmentState.FREE
        self.segments = [Segment(i, start) for i in range(geometry.segments)]
        self.head: Segment | None = None
        self.demoted_bytes = 0          # written by demotions (what users asked for)
        self.cleaner_bytes = 0          # written by relocations
        self.cleaned_segments = 0
        self.freed_bytes = 0
        self._last_head = -1

    # ---- space -----------------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        """What the policy may keep on this tier: u_max of the segments that are neither reserve nor
        head (nor foreign). Below it, whenever no segment is free beyond the reserve, some sealed
        segment has ``u ≤ u_max`` (else the live bytes would exceed it), so cleaning can always make room."""
        g = self.geometry
        mine = g.segments - self.foreign_segments()
        return max(int(g.max_live_fraction * (mine - g.reserve_segments - 1) * g.segment_bytes)
                   // g.align_bytes * g.align_bytes, 0)

    def foreign_segments(self) -> int:
        return sum(1 for s in self.segments if s.state == SegmentState.FOREIGN)

    def own(self, index: int) -> None:
        """A foreign segment becomes this log's (claimed): free for the head."""
        seg = self.segments[index]
        if seg.state == SegmentState.FOREIGN:
            seg.state, seg.live_bytes, seg.fill_bytes = SegmentState.FREE, 0, 0

    def disown(self, index: int) -> bool:
        """An empty segment is given back (it becomes foreign); False when it holds anything."""
        seg = self.segments[index]
        if seg.state != SegmentState.FREE:
            return seg.state == SegmentState.FOREIGN
        seg.state = SegmentState.FOREIGN
        return True

    @property
    def live_bytes(self) -> int:
        return sum(s.live_bytes for s in self.segments)

    def free_segments(self) -> int:
        return sum(1 for s in self.segments if s.state == SegmentState.FREE)

    def extents(self) -> Iterator[Extent]:
        for s in self.segments:
            yield from s.extents.values()

    def segment_of(self, offset: int) -> Segment:
        return self.segments[offset // self.geometry.segment_bytes]

    def _aligned(self, seg: Segment, length: int) -> int:
        """Where in ``seg`` an extent of ``length`` would go (PMD-aligned when it is that large)."""
        g = self.geometry
        fill = seg.fill_bytes
        if length >= g.align_bytes:
            fill = -(-fill // g.align_bytes) * g.align_bytes
        return fill

    def _fits(self, seg: Segment | None, length: int, partial: bool) -> int:
        """How much of ``length`` the segment takes (0: none). Partial takes are whole PMDs, so a
        demotion larger than what is left of the head fills it to the end and goes on in the next."""
        if seg is None:
            return 0
        g = self.geometry
        room = g.segment_bytes - self._aligned(seg, length)
        if room >= length:
            return length
        if partial and length >= g.align_bytes:
            return max(room, 0) // g.align_bytes * g.align_bytes
        return 0

    def allocate(self, length: int, pid: int, start: int, *, relocation: bool = False,
                 partial: bool = False) -> Extent:
        """An extent at the head for ``length`` bytes (a page multiple). With ``partial`` the extent may
        be shorter (the rest of the head segment, in whole PMDs, or one segment): call again for the
        rest. Relocations may use the reserve segments; demotions may not (cleaning needs them).
        Raises LogFull."""
        g = self.geometry
        if length <= 0 or (length > g.segment_bytes and not partial):
            raise ValueError(f"extent of {length} bytes: must be 1..{g.segment_bytes} (one segment)")
        length = min(length, g.segment_bytes)
        take = self._fits(self.head, length, partial)
        if not take:
            self._advance_head(relocation)
            take = self._fits(self.head, length, partial)
        seg = self.head
        at = self._aligned(seg, take)
        ext = Extent(seg.index * g.segment_bytes + at, take, pid, start)
        length = take
        seg.fill_bytes = at + length
        seg.extents[ext.offset] = ext
        seg.live_bytes += length
        if relocation:
            self.cleaner_bytes += length
        else:
            self.demoted_bytes += length
        return ext

    def _advance_head(self, relocation: bool) -> None:
        if self.head is not None:
            self.head.state = SegmentState.SEALED
            self.head.sealed_at = self._clock()
            self.head = None
        floor = 0 if relocation else self.geometry.reserve_segments
        if self.free_segments() <= floor:
            raise LogFull(f"no free segment ({self.free_segments()} free, {floor} reserved for cleaning)")
        # The next free segment after the last head, in file order: the media sees one sequence.
        start = self._last_head + 1
        n = len(self.segments)
        for k in range(n):
            seg = self.segments[(start + k) % n]
            if seg.state == SegmentState.FREE:
                seg.state, seg.fill_bytes, seg.live_bytes = SegmentState.HEAD, 0, 0
                self.head = seg
                self._last_head = seg.index
                return
        raise LogFull("no free segment")

    def release(self, offset: int, length: int, *, moved: bool = False) -> None:
        """Bytes ``offset``..``offset+length`` are dead (promoted, freed, exited; ``moved``: relocated by
        the cleaner to extents allocated with ``relocation=True``). They may cover part of one extent
        (a partial promotion): the rest stays live as one or two extents."""
        seg = self.segment_of(offset)
        ext = next((e for e in seg.extents.values() if e.offset <= offset and offset + length <= e.end), None)
        if ext is None:
            raise KeyError(f"no live extent covers {offset:#x}+{length:#x}")
        del seg.extents[ext.offset]
        seg.live_bytes -= length
        if not moved:
            self.freed_bytes += length
        if offset > ext.offset:
            left = Extent(ext.offset, offset - ext.offset, ext.pid, ext.start)
            seg.extents[left.offset] = left
        if offset + length < ext.end:
            cut = offset + length - ext.offset
            right = Extent(offset + length, ext.end - offset - length, ext.pid, ext.start + cut)
            seg.extents[right.offset] = right
        self._free_if_empty(seg)

    def _free_if_empty(self, seg: Segment) -> None:
        if seg.state in (SegmentState.SEALED, SegmentState.CLEANING) and not seg.extents:
            if seg.state == SegmentState.CLEANING:
                self.cleaned_segments += 1
            seg.state, seg.live_bytes, seg.fill_bytes = SegmentState.FREE, 0, 0

    def adopt(self, offset: int, length: int, pid: int, start: int) -> Extent:
        """An extent found in use (a process maps it; after a daemon restart): live, in a sealed
        segment, so that nothing is ever appended over it."""
        seg = self.segment_of(offset)
        if seg.state in (SegmentState.FREE, SegmentState.FOREIGN):     # foreign: the pool must claim it
            seg.state, seg.sealed_at = SegmentState.SEALED, self._clock()
        for e in seg.extents.values():
            if e.offset < offset + length and offset < e.end:
                if (e.offset, e.length) == (offset, length):
                    return e            # the same extent seen in another process (fork)
                raise ValueError(f"extent {offset:#x}+{length:#x} overlaps {e.offset:#x}+{e.length:#x}")
        ext = Extent(offset, length, pid, start)
        seg.extents[offset] = ext
        seg.live_bytes += length
        seg.fill_bytes = max(seg.fill_bytes, offset + length - seg.index * self.geometry.segment_bytes)
        return ext

    # ---- cleaning --------------------------------------------------------------------------------
    def needs_cleaning(self) -> bool:
        return self.free_segments() <= self.geometry.reserve_segments

    def pick_victim(self) -> Segment | None:
        """The sealed segment with the best cost-benefit ratio among those with ``u ≤ u_max``."""
        g = self.geometry
        now = self._clock()
        best, best_score = None, -1.0
        for seg in self.segments:
            if seg.state != SegmentState.SEALED:
                continue
            u = seg.live_bytes / g.segment_bytes
            if u > g.max_live_fraction:
                continue
            score = (1.0 - u) * max(now - seg.sealed_at, 1e-3) / (1.0 + u)
            if score > best_score:
                best, best_score = seg, score
        if best is not None:
            best.state = SegmentState.CLEANING
            self._free_if_empty(best)
        return best

    def abandon_cleaning(self, seg: Segment) -> None:
        """A victim whose live extents could not all move (busy process): sealed again."""
        if seg.state == SegmentState.CLEANING:
            seg.state = SegmentState.SEALED

    # ---- reports ---------------------------------------------------------------------------------
    @property
    def write_amplification(self) -> float:
        """Bytes written to the log per byte demoted (1.0 before any cleaning)."""
        return (self.demoted_bytes + self.cleaner_bytes) / self.demoted_bytes if self.demoted_bytes else 1.0

    def stats(self) -> dict[str, Any]:
        g = self.geometry
        states = {s.value: 0 for s in SegmentState}
        for seg in self.segments:
            states[seg.state.value] += 1
        return {
            "size_bytes": g.size_bytes, "segment_bytes": g.segment_bytes, "segments": states,
            "capacity_bytes": self.capacity_bytes, "live_bytes": self.live_bytes,
            "extents": sum(len(s.extents) for s in self.segments),
            "demoted_bytes": self.demoted_bytes, "cleaner_bytes": self.cleaner_bytes,
            "freed_bytes": self.freed_bytes, "cleaned_segments": self.cleaned_segments,
            "write_amplification": round(self.write_amplification, 4),
            "write_amplification_bound": g.max_write_amplification,
            "head_segment": None if self.head is None else self.head.index,
        }
