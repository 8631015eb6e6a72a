# SPDX-License-Identifier: Apache-2.0
"""The block table's storage: one row per KV block, regions as contiguous runs of rows, and the lookup
from a (pid, address) to its block.

A *block* is a fixed-size slice of a registered KV region (:mod:`tieringd.placement.blocksize` picks its
size). The table keeps one row per block as a numpy structure of arrays, so that a policy tick over
millions of blocks is a handful of vectorised passes and no Python loop over blocks. A region is known
by one identity, its :class:`tieringd.contracts.RegionKey` (pid, start), and :meth:`BlockStore.region_id`
is the one lookup from it to the table's region row.

This module stores and finds; the heat computed over the rows is :mod:`tieringd.placement.heat`'s
(:class:`~tieringd.placement.heat.BlockTable` extends :class:`BlockStore`). Times are kept as uint32
milliseconds since the table's epoch (49 days of range; the table rebases before it runs out).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from tieringd.contracts import NODE_SLOTS, RegionKey, Tier

# The policy tests "movable" as flags == FLAG_VALID (one pass): every other flag keeps a block out
# of the plan, and a new flag must keep its count so a tick can skip the test (policy.Policy._fixed).
FLAG_VALID = np.uint8(1)    # the slot holds a live block
FLAG_PINNED = np.uint8(2)   # never planned (the user or the shim pinned its region)
FLAG_ABSENT = np.uint8(4)   # never planned: not populated yet, first touch will place it (daemon/regions.py)
FLAG_MOVING = np.uint8(8)   # never planned: a move of it is in flight (daemon/admission.py)

REBASE_MS = 1 << 31        # rebase the epoch once "now" passes this (uint32 ms would wrap at 2^32)


@dataclasses.dataclass(frozen=True)
class SizeProfile:
    """Every row is ``common_bytes`` long except ``rows``, which are ``common_bytes + delta_bytes``
    (BlockTable.size_profile). A byte histogram of 10M rows weighted by their sizes costs twice a
    plain count (P4: 21 / 12 ms): the policy counts blocks and corrects for these few."""
    common_bytes: float | None        # None: too many exceptions, weigh by the sizes
    rows: np.ndarray                  # int64
    delta_bytes: np.ndarray           # float64

    def bytes_per_key(self, key: np.ndarray, sizes: np.ndarray, nkeys: int) -> np.ndarray:
        """``np.bincount(key, weights=sizes, minlength=nkeys)``, the same figures (whole bytes in
        float64 are exact), from a count of the keys."""
        if self.common_bytes is None:
            return np.bincount(key, weights=sizes, minlength=nkeys)
        hist = np.bincount(key, minlength=nkeys) * self.common_bytes
        if len(self.rows):
            hist += np.bincount(key[self.rows], weights=self.delta_bytes, minlength=len(hist))
        return hist

class BlockStore:
    """One row per block, structure of arrays; regions own contiguous runs of rows.

    Per block (42 bytes): region (u32), size (f64 bytes: the policy sums it with ``np.bincount``, which
    wants float64 weights), node (i16), tier (i8), flags (u8), last_ms (u32), freq (f32, decayed count
    as of last_ms), positional (f32), sharers (u16), static (f32: the part of the heat that does not
    change with time, :meth:`tieringd.placement.heat.BlockTable.refresh_static`), heat (f32, as of the
    last tick), moved_ms (u32). The heat columns are stored here and computed by the heat model.

    Block indices are stable until a region is added or removed (compaction may move rows then).
    """

    BLOCK_FIELDS = {
        "region": np.uint32, "size": np.float64, "node": np.int16, "tier": np.int8, "flags": np.uint8,
        "last_ms": np.uint32, "freq": np.float32, "positional": np.float32, "sharers": np.uint16,
        "static": np.float32, "heat": np.float32, "moved_ms": np.uint32,
    }
    REGION_FIELDS = {
        "pid": np.int32, "start": np.uint64, "length": np.uint64, "block_bytes": np.uint64,
        "block_tokens": np.uint32, "first": np.int64, "count": np.int64, "tenant": np.uint16,
        "frontier": np.int64, "sequential": np.bool_, "live": np.bool_,
        "cursor": np.int64, "cursor_ms": np.int64,   # highest block touched by the latest ingest, and when
    }

    def __init__(self, capacity: int = 1024, epoch_ns: int = 0, max_nodes: int = NODE_SLOTS):
        self.epoch_ns = int(epoch_ns)
        self.n = 0                      # slots in use (live or dead)
        self.dead = 0                   # slots of removed regions not yet compacted
        self._cap = 0
        self._grow(max(int(capacity), 16))
        self.nregions = 0
        self._rcap = 0
        self._grow_regions(64)
        self.tenants: list[str] = [""]  # tenant 0: none
        self._tenant_ids = {"": 0}
        self.tier_bytes = np.zeros(len(Tier), np.float64)     # live block bytes per tier
        self.node_bytes = np.zeros(max_nodes, np.float64)     # live block bytes per node (DAX_NODE: the DAX tier)
        self._lookup: dict[int, tuple[np.ndarray, np.ndarray]] | None = None
        self.generation = 0             # bumped when a region is added or removed, or rows compacted
        self.compactions = 0            # bumped when compact() renumbers region ids and rows
        self._sizes: SizeProfile | None = None      # size_profile(); None until asked, and after a change
        self.last_max_ms = 0            # latest last_ms of any row: "now" is never earlier than this
        self.pinned_blocks = 0          # live pinned rows (lets a tick skip the pinned test when 0)
        self.absent_blocks = 0          # live rows marked absent (likewise)
        self.moving_blocks = 0          # live rows with a move in flight (likewise)
        self.moving_to: dict[int, int] = {}     # row → the tier its move in flight goes to
        self.moved_max_ms = 0           # latest moved_ms of any row (lets a tick skip residency tests)

    # ---- storage -------------------------------------------------------------------------------
    def _grow(self, cap: int) -> None:
        for name, dt in self.BLOCK_FIELDS.items():
            new = np.zeros(cap, dt)
            if self._cap:
                new[:self.n] = getattr(self, name)[:self.n]
            setattr(self, name, new)
        self._cap = cap

    def _grow_regions(self, cap: int) -> None:
        for name, dt in self.REGION_FIELDS.items():
            new = np.zeros(cap, dt)
            if self._rcap:
                new[:self.nregions] = getattr(self, "r_" + name)[:self.nregions]
            setattr(self, "r_" + name, new)
        self._rcap = cap

    @property
    def nbytes(self) -> int:
        """Bytes held by the per-block arrays (allocated capacity, not just the rows in use)."""
        return sum(getattr(self, name).nbytes for name in self.BLOCK_FIELDS)

    @property
    def bytes_per_block(self) -> float:
        return sum(np.dtype(dt).itemsize for dt in self.BLOCK_FIELDS.values())

    def view(self, name: str) -> np.ndarray:
        """The rows in use of one per-block array (a view, no copy)."""
        return getattr(self, name)[:self.n]

    # ---- time ----------------------------------------------------------------------------------
    def ms(self, t_ns) -> np.ndarray | int:
        """CLOCK_MONOTONIC ns → table milliseconds (clamped at 0)."""
        if isinstance(t_ns, np.ndarray):
            return np.maximum((t_ns.astype(np.int64) - self.epoch_ns) // 1_000_000, 0)
        return max((int(t_ns) - self.epoch_ns) // 1_000_000, 0)

    def now_ms(self, now_ns: int) -> int:
        now = self.ms(now_ns)
        if now >= REBASE_MS:
            self._rebase(now - (1 << 30))
            now = self.ms(now_ns)
        return now

    def _rebase(self, shift_ms: int) -> None:
        """Move the epoch forward; anything older than the new epoch reads as "at the epoch"
        (it is 12 days old by then: its recency and frequency have long decayed to nothing)."""
        s = np.uint32(shift_ms)
        for name in ("last_ms", "moved_ms"):
            a = self.view(name)
            np.subtract(a, s, out=a, where=a >= s)
            a[a < s] = 0
        self.epoch_ns += shift_ms * 1_000_000

    # ---- regions -------------------------------------------------------------------------------
    def tenant_id(self, tenant: str) -> int:
        """The id of a tenant (cgroup path or ``pid:N``), allocated on first use."""
        tid = self._tenant_ids.get(tenant)
        if tid is None:
            tid = len(self.tenants)
            if tid > np.iinfo(np.uint16).max:
                raise ValueError("too many tenants")
            self.tenants.append(tenant)
            self._tenant_ids[tenant] = tid
        return tid

    def tenant_blocks(self, tenant: str) -> np.ndarray:
        """Row indices of the live blocks of a tenant's regions (empty for an unknown tenant)."""
        tid = self._tenant_ids.get(tenant)
        if tid is None:
            return np.zeros(0, np.int64)
        nr = self.nregions
        rids = np.flatnonzero(self.r_live[:nr] & (self.r_tenant[:nr] == tid))
        if len(rids) == 0:
            return np.zeros(0, np.int64)
        return np.concatenate([np.arange(self.r_first[r], self.r_first[r] + self.r_count[r]) for r in rids])

    def add_region(self, pid: int, start: int, length: int, block_bytes: int, *, node: int,
                   tier: Tier | int, tenant: str = "", block_tokens: int = 16, sequential: bool = False,
                   pinned: bool = False, now_ns: int | None = None) -> int:
        """Register ``length`` bytes at ``start`` in ``pid``, split into ``block_bytes`` blocks (the
        last one may be shorter), all currently on ``node`` (tier ``tier``). Returns the region id.

        ``sequential``: one sequence's KV laid out in token order, so block index = position and the
        decode frontier gives the positional factor. Pooled layouts (vLLM's block pool) are not.
        """
        if length <= 0 or block_bytes <= 0:
            raise ValueError("region length and block size must be positive")
        count = -(-int(length) // int(block_bytes))
        if self.dead and self.dead * 2 > self.n:
            self.compact()
        while self.n + count > self._cap:
            self._grow(self._cap * 2)
        if self.nregions == self._rcap:
            self._grow_regions(self._rcap * 2)
        rid = self.nregions
        self.nregions += 1
        first = self.n
        for name, value in (("pid", pid), ("start", start), ("length", length), ("block_bytes", block_bytes),
                            ("block_tokens", block_tokens), ("first", first), ("count", count),
                            ("tenant", self.tenant_id(tenant)), ("frontier", -1), ("sequential", sequential),
                            ("live", True), ("cursor", -1), ("cursor_ms", -1)):
            getattr(self, "r_" + name)[rid] = value
        sl = slice(first, first + count)
        self.region[sl] = rid
        self.size[sl] = block_bytes
        self.size[first + count - 1] = int(length) - (count - 1) * int(block_bytes)
        self.node[sl] = node
        self.tier[sl] = int(tier)
        self.flags[sl] = FLAG_VALID | (FLAG_PINNED if pinned else 0)
        self.last_ms[sl] = 0
        self.freq[sl] = 0
        self.positional[sl] = 0
        self.sharers[sl] = 1
        self.heat[sl] = 0
        self.moved_ms[sl] = 0 if now_ns is None else self.ms(now_ns)
        self.moved_max_ms = max(self.moved_max_ms, int(self.moved_ms[first]))
        self.pinned_blocks += count if pinned else 0
        self.n += count
        self.tier_bytes[int(tier)] += length
        self.node_bytes[node] += length
        self._lookup = None
        self.generation += 1
        self._sizes = None
        return rid

    def remove_region(self, rid: int) -> None:
        if not self.r_live[rid]:
            return
        sl = self.region_slice(rid)
        self._account(sl, -1.0)
        self.pinned_blocks -= int(np.count_nonzero(self.flags[sl] & FLAG_PINNED))
        self.absent_blocks -= int(np.count_nonzero(self.flags[sl] & FLAG_ABSENT))
        self.moving_blocks -= int(np.count_nonzero(self.flags[sl] & FLAG_MOVING))
        for row in range(sl.start, sl.stop):
            self.moving_to.pop(row, None)
        self.flags[sl] = 0
        self.size[sl] = 0
        self.r_live[rid] = False
        self.dead += sl.stop - sl.start
        self._lookup = None
        self.generation += 1
        self._sizes = None

    def _account(self, idx, sign: float) -> None:
        tiers, nodes, sizes = self.tier[idx], self.node[idx], self.size[idx]
        live = (self.flags[idx] & FLAG_VALID) != 0
        self.tier_bytes += sign * np.bincount(tiers[live], weights=sizes[live], minlength=len(Tier))[:len(Tier)]
        nb = np.bincount(nodes[live], weights=sizes[live])
        self.node_bytes[:len(nb)] += sign * nb

    def region_slice(self, rid: int) -> slice:
        first = int(self.r_first[rid])
        return slice(first, first + int(self.r_count[rid]))

    def set_pinned(self, rid: int, pinned: bool = True) -> None:
        sl = self.region_slice(rid)
        self.pinned_blocks -= int(np.count_nonzero(self.flags[sl] & FLAG_PINNED))
        if pinned:
            self.flags[sl] |= FLAG_PINNED
            self.pinned_blocks += sl.stop - sl.start
        else:
            self.flags[sl] &= ~FLAG_PINNED

    def set_absent(self, idx: np.ndarray, absent: np.ndarray | bool) -> None:
        """Mark blocks (unique rows) not populated yet (``absent`` True) or populated: an absent
        block is never planned, as there is no memory to move; where first touch puts it is read
        back later."""
        idx = np.asarray(idx, np.int64)
        was = (self.flags[idx] & FLAG_ABSENT) != 0
        now = np.broadcast_to(np.asarray(absent, bool), idx.shape)
        self.absent_blocks += int(np.count_nonzero(now)) - int(np.count_nonzero(was))
        self.flags[idx] = np.where(now, self.flags[idx] | FLAG_ABSENT, self.flags[idx] & ~FLAG_ABSENT)

    def set_moving(self, idx: np.ndarray, to_tier: Tier | int | None) -> None:
        """Mark blocks (rows) whose move to ``to_tier`` is in flight, or (None) no longer: the plan
        counts them where they are going and plans nothing for them until the mover says where they
        are, instead of planning the same move again and again while it runs (and spending its
        budget on it)."""
        idx = np.unique(np.asarray(idx, np.int64))
        idx = idx[(self.flags[idx] & FLAG_VALID) != 0]
        was = (self.flags[idx] & FLAG_MOVING) != 0
        if to_tier is not None:
            self.flags[idx] |= FLAG_MOVING
            self.moving_blocks += int(np.count_nonzero(~was))
            self.moving_to.update(dict.fromkeys(idx.tolist(), int(to_tier)))
        else:
            self.flags[idx] &= ~FLAG_MOVING
            self.moving_blocks -= int(np.count_nonzero(was))
            for row in idx.tolist():
                self.moving_to.pop(row, None)

    def set_location(self, idx: np.ndarray, node: np.ndarray | int, tier: np.ndarray | int,
                     now_ns: int | None = None, now_ms: int | None = None) -> None:
        """Where blocks now are. With a time, a move (as the mover verified it) that starts their
        minimum residency; without one, where they were found (``moved_ms`` is left as it was)."""
        idx = np.asarray(idx, np.int64)
        if len(idx) == 0:
            return
        self._account(idx, -1.0)
        self.node[idx] = node
        self.tier[idx] = tier
        self._account(idx, +1.0)
        if now_ms is None and now_ns is not None:
            now_ms = self.now_ms(now_ns)
        if now_ms is not None:
            self.moved_ms[idx] = now_ms
            self.moved_max_ms = max(self.moved_max_ms, int(now_ms))

    def compact(self) -> None:
        """Drop the rows of removed regions (block indices change)."""
        live = np.flatnonzero(self.r_live[:self.nregions])
        keep = np.concatenate([np.arange(self.r_first[r], self.r_first[r] + self.r_count[r]) for r in live]) \
            if len(live) else np.zeros(0, np.int64)
        for name in self.BLOCK_FIELDS:
            arr = getattr(self, name)
            arr[:len(keep)] = arr[keep]
        rmap = np.full(self.nregions, -1, np.int64)
        rmap[live] = np.arange(len(live))
        for name in self.REGION_FIELDS:
            arr = getattr(self, "r_" + name)
            arr[:len(live)] = arr[live]
        self.nregions = len(live)
        self.n = len(keep)
        self.region[:self.n] = rmap[self.region[:self.n]]
        if self.moving_to:                     # rows kept are renumbered in order (keep is sorted)
            old = np.fromiter(self.moving_to, np.int64, len(self.moving_to))
            new = np.searchsorted(keep, old)
            self.moving_to = {int(n): self.moving_to[int(o)] for o, n in zip(old, new)
                              if n < len(keep) and keep[n] == o}
        self.r_first[:self.nregions] = np.concatenate([[0], np.cumsum(self.r_count[:self.nregions])[:-1]]) \
            if self.nregions else []
        self.dead = 0
        self._lookup = None
        self.generation += 1
        self.compactions += 1
        self._sizes = None

    def size_profile(self) -> SizeProfile:
        """The rows' sizes as one common block size and the few rows that differ (a region's short
        last block, a region with another block size, the rows of removed regions), read from the
        regions and kept until one is added or removed. ``common_bytes`` is None when the
        exceptions are not few (over an eighth of the rows): then only the sizes themselves say."""
        if self._sizes is None:
            self._sizes = self._build_size_profile()
        return self._sizes

    def _build_size_profile(self) -> SizeProfile:
        nr, none = self.nregions, np.zeros(0, np.int64)
        live, first, count = self.r_live[:nr], self.r_first[:nr], self.r_count[:nr]
        block_bytes = self.r_block_bytes[:nr]
        if not live.any():
            return SizeProfile(None if self.n else 0.0, none, np.zeros(0))
        sizes, rows_of = np.unique(block_bytes[live], return_inverse=True)
        common = int(sizes[np.argmax(np.bincount(rows_of, weights=count[live]))])
        whole = np.flatnonzero(~live | (block_bytes != common))        # every row differs
        counts = count[whole]
        if int(counts.sum()) * 8 > self.n:
            return SizeProfile(None, none, np.zeros(0))
        short = np.flatnonzero(live & (block_bytes == common) & (self.r_length[:nr] % np.uint64(common) != 0))
        skip = np.cumsum(counts) - counts               # rows of ``whole`` before each region
        rows = np.concatenate([np.repeat(first[whole] - skip, counts) + np.arange(int(counts.sum())),
                               first[short] + count[short] - 1]).astype(np.int64)
        return SizeProfile(float(common), rows, self.size[rows] - common)

    # ---- lookup --------------------------------------------------------------------------------
    def region_key(self, rid: int) -> RegionKey:
        """The identity of table region ``rid``."""
        return RegionKey(int(self.r_pid[rid]), int(self.r_start[rid]))

    def region_id(self, key: RegionKey | tuple[int, int]) -> int | None:
        """The live table region of ``key`` (pid, start), None when the table has none: the one
        lookup from a region's identity to its rows (``region_slice``)."""
        pid, start = key
        found = self._region_lookup().get(int(pid))
        if found is None:
            return None
        starts, rids = found
        i = int(np.searchsorted(starts, np.uint64(start)))
        return int(rids[i]) if i < len(starts) and int(starts[i]) == int(start) else None

    def _region_lookup(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        if self._lookup is None:
            live = np.flatnonzero(self.r_live[:self.nregions])
            out = {}
            pids = self.r_pid[live]
            for pid in np.unique(pids):
                rids = live[pids == pid]
                order = np.argsort(self.r_start[rids], kind="stable")
                out[int(pid)] = (self.r_start[rids][order], rids[order])
            self._lookup = out
        return self._lookup

    def locate(self, pid: np.ndarray, addr: np.ndarray, length: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
        """Rows (pid, addr, length) → (row index, block index) for each block a row overlaps.

        A sampled span larger than a block (a 2 MiB THP hint fault over 1 MiB blocks) counts for every
        block it covers; spans outside any registered region are dropped.
        """
        lookup = self._region_lookup()
        rows_out, blocks_out = [], []
        pid = np.asarray(pid)
        for p in np.unique(pid):
            if int(p) not in lookup:
                continue
            starts, rids = lookup[int(p)]
            rows = np.flatnonzero(pid == p)
            a = addr[rows].astype(np.uint64)
            pos = np.searchsorted(starts, a, side="right").astype(np.int64) - 1
            ok = pos >= 0
            rows, a, pos = rows[ok], a[ok], pos[ok]
            rid = rids[pos]
            off = a - self.r_start[rid]
            inside = off < self.r_length[rid]
            rows, rid, off = rows[inside], rid[inside], off[inside]
            end = np.minimum(off + np.maximum(length[rows].astype(np.uint64), 1), self.r_length[rid])
            bb = self.r_block_bytes[rid]
            b0 = (off // bb).astype(np.int64)
            b1 = ((end - 1) // bb).astype(np.int64)
            span = b1 - b0 + 1
            rep = np.repeat(np.arange(len(rows)), span)
            within = np.arange(len(rep)) - np.repeat(np.cumsum(span) - span, span)
            rows_out.append(rows[rep])
            blocks_out.append(self.r_first[rid][rep] + b0[rep] + within)
        if not rows_out:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(rows_out), np.concatenate(blocks_out)

    def block_address(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(pid, start address) of blocks."""
        idx = np.asarray(idx, np.int64)
        rid = self.region[idx].astype(np.int64)
        start = self.r_start[rid] + (idx - self.r_first[rid]).astype(np.uint64) * self.r_block_bytes[rid]
        return self.r_pid[rid], start
