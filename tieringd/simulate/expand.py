# SPDX-License-Identifier: Apache-2.0
"""From a trace to a stream of block accesses, one per (block, tick window), written window by window
to a spool (stream.py) as the requests run: memory holds the requests in flight and one number or two
per block, never the trace's accesses.

Request model (docs/simulator.md):

- A request arriving at ``t`` with ``input_tokens`` and ``hash_ids`` *prefills* from ``t``. Its leading
  blocks that an earlier request already created are the cached prefix (equal ids = identical KV);
  only the rest is computed, in chunks of ``prefill_chunk_tokens`` at ``prefill_tokens_per_s``. Each
  chunk reads every block before it — the cached prefix and the chunks already written — and writes
  its own (a block's first access is its allocation). A fully cached input is read once at ``t``.
  ``prefill_chunk_tokens = 0``: the simpler model of earlier versions, one access to each input block
  at ``t`` and decode ``input_tokens / prefill_tokens_per_s`` later.
- Decode starts once prefill is done and runs ``output_tokens`` steps ``tpot_ms`` apart. Every step
  reads **every block** of the request so far; output tokens fill the last input block, then new
  blocks (unique to the request).
- Accesses of one block within one tick window (``tick_ms``) collapse into one access whose ``count``
  is the number of reads; the window is also when the tieringd policy runs. Within a window, accesses
  keep the order of their first read: by request (in arrival order), its prefill before its decode,
  then by the block's place in the request.
- Positional weight of an access: 2^(−d / position_half_life_tokens), d = tokens between the block and
  the request's newest block. Sharers: how many requests have referenced the block so far (requests
  are counted in arrival order, when they arrive).

Block ids are renumbered 0, 1, 2… in order of first access, so each window's new blocks are a range.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterator

import numpy as np

from tieringd.simulate.stream import Spool, SpoolWriter, WindowAccesses
from tieringd.simulate.traces import NativeTrace, Request, RequestTrace

_DECODE = 1 << 20          # order within a request: prefill rows by block, then decode rows by block
_REQUEST = 1 << 24         # order between requests: arrival


@dataclasses.dataclass
class RequestModel:
    kv_bytes_per_token: int
    tick_ms: float = 250.0                # sampler interval + tick + move of the daemon (docs/simulator.md)
    tpot_ms: float = 30.0                 # time per output token
    prefill_tokens_per_s: float = 8000.0
    position_half_life_tokens: float = 2048.0
    prefill_chunk_tokens: int = 2048      # chunked prefill (vLLM's default batch); 0: one read at arrival


@dataclasses.dataclass
class Accesses:
    """A trace's block accesses, spooled: ordered by window, read back with :meth:`windows`."""
    spool: Spool
    block_bytes: int
    tick_ms: float
    description: str = ""

    def __len__(self) -> int:
        return self.spool.accesses

    @property
    def nblocks(self) -> int:
        return self.spool.nblocks

    @property
    def unique_bytes(self) -> int:
        return self.nblocks * self.block_bytes

    def windows(self, next_use: bool = False) -> Iterator[WindowAccesses]:
        return self.spool.windows(next_use)

    def close(self) -> None:
        self.spool.close()


class _Grown:
    """An int64 array indexed by a growing id, filled with ``fill``."""

    def __init__(self, fill: int):
        self.fill = fill
        self.a = np.full(1024, fill, np.int64)

    def reserve(self, n: int) -> np.ndarray:
        if n > len(self.a):
            more = np.full(max(n, 2 * len(self.a)), self.fill, np.int64)
            more[:len(self.a)] = self.a
            self.a = more
        return self.a


class _Renumber:
    """Blocks in order of first access: the ids the spool carries (dense ids in, access ids out)."""

    def __init__(self):
        self.ids = _Grown(-1)
        self.count = 0

    def __call__(self, dense: np.ndarray) -> np.ndarray:
        table = self.ids.reserve(int(dense.max()) + 1)
        out = table[dense]
        new = np.flatnonzero(out < 0)        # each block once per window: new blocks in order of access
        out[new] = np.arange(self.count, self.count + len(new))
        table[dense[new]] = out[new]
        self.count += len(new)
        return out


@dataclasses.dataclass
class _Flight:
    """A request from its arrival to its last access: its blocks (dense ids; the input's, then the
    output's), its prefill rows by window, and what its decode needs."""
    seq: int
    blocks: np.ndarray
    sharers: np.ndarray
    prefill: tuple               # (window, block index j, reads, positional, sharers) per row, by window
    prefill_at: int              # the next prefill row to emit
    input_tokens: int
    steps: int                   # output tokens (decode steps)
    t_dec: float                 # decode start, ms
    w0: int                      # decode's first and last window
    w1: int


def _prefill(r: Request, ids: np.ndarray, sharers: np.ndarray, cached: int, bt: int, model: RequestModel):
    """The prefill's block accesses (window, block index, reads, positional, sharers) and how long it
    takes (ms). ``cached``: the leading blocks an earlier request created."""
    h = len(ids)
    tick = model.tick_ms
    half = model.position_half_life_tokens
    computed = max(r.input_tokens - cached * bt, 0)
    if model.prefill_chunk_tokens <= 0 or computed == 0:
        d = (h - 1 - np.arange(h)) * bt
        arrays = (np.full(h, int(r.arrival_ms // tick)), np.arange(h), np.ones(h), np.exp2(-d / half), sharers)
        ms = 1000.0 * (r.input_tokens if model.prefill_chunk_tokens <= 0 else 0) / model.prefill_tokens_per_s
        return arrays, ms
    chunk = model.prefill_chunk_tokens
    nchunks = -(-computed // chunk)
    c = np.arange(nchunks)
    done_tokens = cached * bt + np.minimum((c + 1) * chunk, computed)    # tokens in KV after chunk c
    t_end = r.arrival_ms + 1000.0 * np.minimum((c + 1) * chunk, computed) / model.prefill_tokens_per_s
    reads = np.minimum(-(-done_tokens // bt), h)            # chunk c touches blocks 0 … reads[c] − 1
    cw = (t_end // tick).astype(np.int64)
    wins, first = np.unique(cw, return_index=True)
    last = np.append(first[1:], nchunks) - 1
    rows_w, rows_b, rows_n, rows_d = [], [], [], []
    for w, lo, hi in zip(wins.tolist(), first.tolist(), last.tolist()):
        j = np.arange(int(reads[hi]))
        # chunks lo..hi read block j when reads[c] > j (reads is non-decreasing)
        n = (hi + 1) - np.maximum(np.searchsorted(reads[lo:hi + 1], j, side="right") + lo, lo)
        rows_w.append(np.full(len(j), w))
        rows_b.append(j)
        rows_n.append(n.astype(np.float64))
        rows_d.append((int(reads[hi]) - 1 - j) * bt)
    j = np.concatenate(rows_b)
    arrays = (np.concatenate(rows_w), j, np.concatenate(rows_n), np.exp2(-np.concatenate(rows_d) / half), sharers[j])
    return arrays, float(t_end[-1] - r.arrival_ms)


class _Requests:
    """Turns arriving requests into flights: dense block ids, sharers and the cached prefix, counted in
    arrival order exactly as the requests arrive."""

    def __init__(self, bt: int, model: RequestModel):
        self.bt, self.model = bt, model
        self.dense: dict[int, int] = {}      # trace id → dense id
        self.next_dense = 0
        self.refs = _Grown(0)                # per dense id: requests that referenced it so far

    def _ids(self, hash_ids: np.ndarray) -> tuple[np.ndarray, int]:
        """Dense ids of a request's hash ids, and how many of them lead the request as a prefix an
        earlier request created (the ids assigned before this request)."""
        before = self.next_dense
        dense, table = self.dense, []
        for h in hash_ids.tolist():
            d = dense.get(h)
            if d is None:
                d = dense[h] = self.next_dense
                self.next_dense += 1
            table.append(d)
        ids = np.array(table, np.int64)
        new = ids >= before
        cached = int(np.argmax(new)) if new.any() else len(ids)
        return ids, cached

    def _sharers(self, ids: np.ndarray) -> np.ndarray:
        refs = self.refs.reserve(self.next_dense)
        if len(np.unique(ids)) == len(ids):
            refs[ids] += 1
            return refs[ids].copy()
        out = np.empty(len(ids), np.int64)
        for j, d in enumerate(ids.tolist()):          # an id twice in one request counts twice
            refs[d] += 1
            out[j] = refs[d]
        return out

    def flight(self, ri: int, r: Request) -> _Flight | None:
        bt, model = self.bt, self.model
        ids, cached = self._ids(r.hash_ids)
        h = len(ids)
        total_blocks = max(math.ceil((r.input_tokens + r.output_tokens) / bt), h)
        n_out = total_blocks - h
        blocks = np.concatenate([ids, np.arange(self.next_dense, self.next_dense + n_out)])
        self.next_dense += n_out
        sharers = np.ones(total_blocks, np.int64)
        sharers[:h] = self._sharers(ids)
        if h:
            prefill, prefill_ms = _prefill(r, ids, sharers[:h], cached, bt, model)
        else:
            prefill, prefill_ms = (np.zeros(0, np.int64),) * 5, 0.0
        t_dec = r.arrival_ms + prefill_ms
        steps = r.output_tokens
        w0 = int(t_dec // model.tick_ms)
        w1 = int((t_dec + (steps - 1) * model.tpot_ms) // model.tick_ms) if steps > 0 else w0 - 1
        if len(prefill[0]) == 0 and steps <= 0:
            return None
        return _Flight(ri * _REQUEST, blocks, sharers, prefill, 0, r.input_tokens, steps, t_dec, w0, w1)


class _Decoding:
    """The flights in decode, as one pool of (flight, block) rows so that a window's decode reads of
    every flight are a few vectorised passes."""

    def __init__(self, bt: int, model: RequestModel):
        self.bt, self.model = bt, model
        self.flights: list[_Flight] = []
        self.stale = True

    def add(self, f: _Flight) -> None:
        self.flights.append(f)
        self.stale = True

    def drop_done(self, w: int) -> None:
        if any(f.w1 < w for f in self.flights):
            self.flights = [f for f in self.flights if f.w1 >= w]
            self.stale = True

    def _rebuild(self) -> None:
        fl = self.flights
        self.t_dec = np.array([f.t_dec for f in fl], np.float64)
        self.steps = np.array([f.steps for f in fl], np.int64)
        self.input = np.array([f.input_tokens for f in fl], np.int64)
        self.total = np.array([len(f.blocks) for f in fl], np.int64)
        self.flight_of = np.repeat(np.arange(len(fl)), self.total)
        self.j = np.concatenate([np.arange(len(f.blocks)) for f in fl]) if fl else np.zeros(0, np.int64)
        self.block = np.concatenate([f.blocks for f in fl]) if fl else np.zeros(0, np.int64)
        self.sharers = np.concatenate([f.sharers for f in fl]) if fl else np.zeros(0, np.int64)
        self.key = np.repeat(np.array([f.seq for f in fl], np.int64), self.total) + _DECODE + self.j
        # block j exists from step max(0, j·bt − input_tokens) (token input+s lands in block (input+s)//bt)
        self.created = np.maximum(self.j * self.bt - self.input[self.flight_of], 0)
        self.stale = False

    def rows(self, w: int):
        """(key, block, reads, positional, sharers) of window ``w``'s decode reads."""
        if self.stale:
            self._rebuild()
        tick, tpot = self.model.tick_ms, self.model.tpot_ms
        # steps s with t_dec + s·tpot in [w·tick, (w+1)·tick)
        s_lo = np.clip(np.ceil((w * tick - self.t_dec) / tpot), 0, self.steps).astype(np.int64)
        s_hi = np.clip(np.ceil(((w + 1) * tick - self.t_dec) / tpot), 0, self.steps).astype(np.int64) - 1
        f = self.flight_of
        n = np.maximum(s_hi[f] - np.maximum(s_lo[f], self.created) + 1, 0)
        keep = np.flatnonzero(n)
        newest = np.minimum((self.input + s_hi) // self.bt, self.total - 1)
        d = (newest[f[keep]] - self.j[keep]) * self.bt
        pos = np.exp2(-np.maximum(d, 0) / self.model.position_half_life_tokens)
        return self.key[keep], self.block[keep], n[keep].astype(np.float64), pos, self.sharers[keep]


def _window_rows(w: int, prefilling: list[_Flight], decoding: _Decoding):
    """Every read of window ``w`` by every flight, sorted by (request, prefill before decode, block)."""
    parts = []
    for f in prefilling:
        pw, pj, pn, pp, ps = f.prefill
        a = f.prefill_at
        b = a + int(np.searchsorted(pw[a:], w, side="right"))
        if b > a:
            parts.append((f.seq + pj[a:b], f.blocks[pj[a:b]], pn[a:b], pp[a:b], ps[a:b]))
            f.prefill_at = b
    if decoding.flights:
        parts.append(decoding.rows(w))
    if not parts:
        return None
    key, block, reads, pos, sharers = (np.concatenate(x) for x in zip(*parts))
    order = np.argsort(key)
    return block[order], reads[order], pos[order], sharers[order]


def _merge(block, reads, pos, sharers):
    """One access per block, in order of its first read: reads summed, positional and sharers at their
    largest."""
    uniq, first, inv = np.unique(block, return_index=True, return_inverse=True)
    cnt = np.bincount(inv, weights=reads, minlength=len(uniq))
    p = np.zeros(len(uniq), np.float32)
    np.maximum.at(p, inv, pos.astype(np.float32))
    sh = np.ones(len(uniq), np.int64)
    np.maximum.at(sh, inv, sharers)
    o = np.argsort(first, kind="stable")
    return uniq[o], cnt[o], p[o], sh[o]


def expand_requests(trace: RequestTrace, model: RequestModel, writer: SpoolWriter) -> int:
    """Writes the trace's accesses window by window; returns the number of blocks."""
    bt, tick = trace.block_tokens, model.tick_ms
    reqs = trace.requests
    maker = _Requests(bt, model)
    renumber = _Renumber()
    prefilling: list[_Flight] = []
    waiting: list[_Flight] = []              # prefilled or prefilling, decode not started
    decoding = _Decoding(bt, model)
    ri, w = 0, int(reqs[0].arrival_ms // tick) if reqs else 0
    while ri < len(reqs) or prefilling or waiting or decoding.flights:
        while ri < len(reqs) and int(reqs[ri].arrival_ms // tick) <= w:
            f = maker.flight(ri, reqs[ri])
            ri += 1
            if f is not None:
                prefilling.append(f)
                if f.steps > 0:
                    waiting.append(f)
        for f in [f for f in waiting if f.w0 <= w]:
            decoding.add(f)
        waiting = [f for f in waiting if f.w0 > w]
        decoding.drop_done(w)
        rows = _window_rows(w, prefilling, decoding)
        prefilling = [f for f in prefilling if f.prefill_at < len(f.prefill[0])]
        if rows is not None and len(rows[0]):
            block, cnt, pos, sh = _merge(*rows)
            writer.add(w, renumber(block), cnt, pos, sh)
        w = _next_window(w, reqs[ri].arrival_ms if ri < len(reqs) else None, tick, prefilling, waiting, decoding)
    if writer.accesses == 0:
        raise ValueError("the trace has no block accesses (no hash_ids and no output)")
    return renumber.count


def _next_window(w: int, arrival_ms: float | None, tick: float, prefilling, waiting, decoding) -> int:
    """The next window anything happens in (idle stretches are skipped)."""
    nxt = [int(arrival_ms // tick)] if arrival_ms is not None else []
    if decoding.flights:
        nxt.append(w + 1)
    nxt += [int(f.prefill[0][f.prefill_at]) for f in prefilling]
    nxt += [f.w0 for f in waiting]
    return max(min(nxt), w + 1) if nxt else w + 1


def expand_rows(window: np.ndarray, block: np.ndarray, count: np.ndarray, writer: SpoolWriter,
                positional: np.ndarray | None = None, sharers: np.ndarray | None = None) -> int:
    """Writes accesses given as rows in time order (``window`` non-decreasing; ``block`` any ids):
    one access per (window, block), in the order of its first row; returns the number of blocks."""
    n = len(block)
    positional = np.zeros(n) if positional is None else positional
    sharers = np.ones(n, np.int64) if sharers is None else sharers
    renumber = _Renumber()
    cuts = np.flatnonzero(np.diff(window)) + 1
    for lo, hi in zip(np.concatenate([[0], cuts]).tolist(), np.concatenate([cuts, [n]]).tolist()):
        b, cnt, pos, sh = _merge(block[lo:hi], count[lo:hi], positional[lo:hi], sharers[lo:hi])
        writer.add(int(window[lo]), renumber(b), cnt, pos, sh)
    return renumber.count


def expand_native(trace: NativeTrace, tick_ms: float, writer: SpoolWriter) -> tuple[int, int, str]:
    """Writes a sampler trace's accesses window by window; returns (blocks, block bytes, description)."""
    rows = trace.rows
    _, block = np.unique(rows[["pid", "block_start"]], return_inverse=True)
    t0 = int(rows["last_seen_ns"].min())
    window = ((rows["last_seen_ns"].astype(np.int64) - t0) / 1e6 // tick_ms).astype(np.int64)
    lens = rows["block_len"]
    vals, counts = np.unique(lens, return_counts=True)
    block_bytes = int(vals[np.argmax(counts)])           # the common block size; see docs/simulator.md
    desc = f"native trace: {len(rows)} rows, {block_bytes}-byte blocks (as recorded)"
    if len(vals) > 1:
        desc += f" ({len(vals)} block sizes in the trace; all counted as {block_bytes} bytes)"
    nblocks = expand_rows(window, block.reshape(-1).astype(np.int64), rows["count"].astype(np.float64), writer)
    return nblocks, block_bytes, desc


def spool_rows(window: np.ndarray, block: np.ndarray, count: np.ndarray, block_bytes: int, tick_ms: float,
               description: str = "", spool_dir: str | None = None) -> Accesses:
    """Accesses from rows (``expand_rows``), spooled: small streams made by hand (tests)."""
    directory, writer = Spool.create(spool_dir)
    try:
        nblocks = expand_rows(np.asarray(window, np.int64), np.asarray(block, np.int64),
                              np.asarray(count, np.float64), writer)
    finally:
        writer.close()
    return Accesses(Spool(directory, writer.accesses, nblocks), int(block_bytes), tick_ms, description)


def spool_trace(trace: RequestTrace | NativeTrace, model: RequestModel, spool_dir: str | None = None) -> Accesses:
    """Expands a trace into a spool (a temporary directory under ``spool_dir``, removed with it)."""
    directory, writer = Spool.create(spool_dir)
    try:
        if isinstance(trace, NativeTrace):
            nblocks, block_bytes, desc = expand_native(trace, model.tick_ms, writer)
        else:
            nblocks = expand_requests(trace, model, writer)
            block_bytes = trace.block_tokens * model.kv_bytes_per_token
            desc = f"{trace.format} trace: {len(trace.requests)} requests, {trace.describe_blocks()}"
    finally:
        writer.close()
    spool = Spool(directory, writer.accesses, nblocks)
    return Accesses(spool, int(block_bytes), model.tick_ms, desc)
