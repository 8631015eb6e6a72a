# SPDX-License-Identifier: Apache-2.0
"""Aliases: rows of the block table that map the same memory share one heat and one place.

The table keeps a row per block of every registered region, and a region is one process's mapping.
Memory several registered processes map — a memfd pool a forked process inherited, pages a fork
left shared, pages KSM merged — is then several rows, each sampled on its own: each process's reads
are its row's. Planned apart, the rows of one memory disagree: the least recently sampled of them
would have the memory demoted under the others, so a block with three users would have three
chances to lose its place, not one. And a move of one row moves the memory of all of them, which
only that row learns (the mover verifies what it moved).

The sharing scan (:mod:`.sharing`) names, per block it examines, the smallest page frame among its
sampled non-exclusive pages (its *anchor*); rows with the same anchor map the same memory. Once a
tick, every group of such rows is made one: the latest sampled access of any of them (and the
largest decayed count) is every row's, and where the most recently moved of them landed is where all
of them are. The policy then ranks them alike, and a shared block moves as one or not at all.

The groups are rebuilt from the anchors at most every REBUILD_S (the anchors change as the scan
passes over blocks); applying them is a few vectorised passes over the aliased rows only.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from tieringd.contracts import RegionKey
from tieringd.placement.heat import BlockTable

REBUILD_S = 1.0


class Aliases:
    """Anchors per registered block (``note``), groups of rows with the same one, and their
    heat and place made one (``apply``, once a tick)."""

    def __init__(self, table: BlockTable, clock: Callable[[], float] = time.monotonic):
        self.table = table
        self.clock = clock
        self._anchors: dict[RegionKey, np.ndarray] = {}
        self._dirty = False
        self._built_at = -REBUILD_S
        self._generation = -1
        self.rows = np.zeros(0, np.int64)          # aliased rows, grouped
        self.starts = np.zeros(0, np.int64)        # where each group begins in ``rows``
        self.groups = 0
        self.synced_rows = 0                       # rows whose place was corrected, since start

    def note(self, key: RegionKey, nblocks: int, blocks: np.ndarray, anchors: np.ndarray) -> None:
        """The anchors the scan found for some blocks of a region (0: no shared page)."""
        arr = self._anchors.get(key)
        if arr is None:
            if not anchors.any():
                return
            arr = self._anchors[key] = np.zeros(nblocks, np.uint64)
        if not np.array_equal(arr[blocks], anchors):
            arr[blocks] = anchors
            self._dirty = True

    def drop(self, key: RegionKey) -> None:
        if self._anchors.pop(key, None) is not None:
            self._dirty = True

    def clear(self) -> None:
        self._anchors.clear()
        self.rows, self.starts, self.groups = np.zeros(0, np.int64), np.zeros(0, np.int64), 0
        self._dirty = False

    def apply(self) -> None:
        """Rebuild the groups if they changed (at most every REBUILD_S, and whenever the table's
        rows moved), then make each group's heat and place one."""
        t = self.table
        now = self.clock()
        if t.generation != self._generation or (self._dirty and now - self._built_at >= REBUILD_S):
            self._rebuild()
            self._built_at, self._generation = now, t.generation
        if self.groups:
            self._merge()

    def _rebuild(self) -> None:
        self._dirty = False
        t = self.table
        anchors, rows = [], []
        for key, arr in self._anchors.items():
            rid = t.region_id(key)
            if rid is None:
                continue
            blocks = np.flatnonzero(arr)
            anchors.append(arr[blocks])
            rows.append(t.region_slice(rid).start + blocks)
        anchor = np.concatenate(anchors) if anchors else np.zeros(0, np.int64)
        if not len(anchor):     # no region, or none with an anchored block (a fork's child, exec'd)
            self.rows, self.starts, self.groups = np.zeros(0, np.int64), np.zeros(0, np.int64), 0
            return
        row = np.concatenate(rows).astype(np.int64)
        order = np.argsort(anchor, kind="stable")
        anchor, row = anchor[order], row[order]
        first = np.concatenate([[True], anchor[1:] != anchor[:-1]])
        group = np.cumsum(first) - 1
        size = np.bincount(group)
        keep = size[group] > 1
        row, first = row[keep], first[keep]
        self.rows = row
        self.starts = np.flatnonzero(first)
        self.groups = len(self.starts)

    def _merge(self) -> None:
        t, rows, starts = self.table, self.rows, self.starts
        counts = np.diff(np.concatenate([starts, [len(rows)]]))
        last = np.maximum.reduceat(t.last_ms[rows], starts)
        t.last_ms[rows] = np.repeat(last, counts)
        freq = np.maximum.reduceat(t.freq[rows], starts)
        t.freq[rows] = np.repeat(freq, counts)
        # where the memory is: the row moved last knows (the mover verified it)
        moved = t.moved_ms[rows]
        latest = np.repeat(np.maximum.reduceat(moved, starts), counts)
        candidate = np.where(moved == latest, np.arange(len(rows)), len(rows))
        best = rows[np.minimum.reduceat(candidate, starts)]
        node, tier = np.repeat(t.node[best], counts), np.repeat(t.tier[best], counts)
        off = (t.node[rows] != node) | (t.tier[rows] != tier)
        if off.any():
            t.set_location(rows[off], node[off], tier[off])
            t.moved_ms[rows[off]] = latest[off]
            self.synced_rows += int(off.sum())
