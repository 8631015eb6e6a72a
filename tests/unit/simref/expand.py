# SPDX-License-Identifier: Apache-2.0
"""From a trace to a stream of block accesses, one per (block, tick window).

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
  keep the order of their first read.
- Positional weight of an access: 2^(−d / position_half_life_tokens), d = tokens between the block and
  the request's newest block. Sharers: how many requests have referenced the block so far.

Block ids are renumbered 0, 1, 2… in order of first access, so each window's new blocks are a range.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from tieringd.simulate.traces import NativeTrace, RequestTrace


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
    """Block accesses ordered by time. ``window[i]`` is non-decreasing."""
    window: np.ndarray       # int64: tick window index
    block: np.ndarray        # int64: block id, numbered by first access
    count: np.ndarray        # float64: reads collapsed into this access
    positional: np.ndarray   # float32
    sharers: np.ndarray      # int64
    block_bytes: int
    nblocks: int
    tick_ms: float
    description: str = ""

    def __len__(self) -> int:
        return len(self.block)

    @property
    def unique_bytes(self) -> int:
        return self.nblocks * self.block_bytes

    def prev_next(self) -> tuple[np.ndarray, np.ndarray]:
        """Index of the previous / next access to the same block (−1 / len when none)."""
        n = len(self.block)
        order = np.lexsort((np.arange(n), self.block))
        same = self.block[order][1:] == self.block[order][:-1]
        prev = np.full(n, -1, np.int64)
        nxt = np.full(n, n, np.int64)
        prev[order[1:][same]] = order[:-1][same]
        nxt[order[:-1][same]] = order[1:][same]
        return prev, nxt


def _finish(window, block, count, pos, sharers, order, block_bytes, tick_ms, description) -> Accesses:
    """Merge duplicates of (window, block), sort by (window, first occurrence), renumber blocks."""
    window = np.asarray(window, np.int64)
    block = np.asarray(block, np.int64)
    nb = int(block.max()) + 1 if len(block) else 1
    key = window * nb + block
    uniq, first, inv = np.unique(key, return_index=True, return_inverse=True)
    cnt = np.bincount(inv, weights=count, minlength=len(uniq))
    p = np.zeros(len(uniq), np.float32)
    np.maximum.at(p, inv, np.asarray(pos, np.float32))
    sh = np.ones(len(uniq), np.int64)
    np.maximum.at(sh, inv, np.asarray(sharers, np.int64))
    w = uniq // nb
    b = uniq % nb
    o = np.lexsort((np.asarray(order)[first], w))
    w, b, cnt, p, sh = w[o], b[o], cnt[o], p[o], sh[o]
    ids, first_seen = np.unique(b, return_index=True)
    rank = np.empty(len(ids), np.int64)
    rank[np.argsort(first_seen, kind="stable")] = np.arange(len(ids))
    b = rank[np.searchsorted(ids, b)]
    return Accesses(w, b, cnt, p, sh, int(block_bytes), len(ids), tick_ms, description)


def _prefill(r, ids: np.ndarray, sharers: np.ndarray, seen: set[int], bt: int, model: RequestModel):
    """The prefill's block accesses (window, block, reads, positional, sharers, order) and how long it
    takes (ms). Adds the request's blocks to ``seen``."""
    h = len(ids)
    tick = model.tick_ms
    cached = 0
    for hid in ids.tolist():
        if hid not in seen:
            break
        cached += 1
    seen.update(ids.tolist())
    half = model.position_half_life_tokens
    computed = max(r.input_tokens - cached * bt, 0)
    if model.prefill_chunk_tokens <= 0 or computed == 0:
        d = (h - 1 - np.arange(h)) * bt
        arrays = (np.full(h, int(r.arrival_ms // tick)), ids, np.ones(h), np.exp2(-d / half), sharers, np.arange(h))
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
    arrays = (np.concatenate(rows_w), ids[j], np.concatenate(rows_n), np.exp2(-np.concatenate(rows_d) / half),
              sharers[j], j)
    return arrays, float(t_end[-1] - r.arrival_ms)


def expand_requests(trace: RequestTrace, model: RequestModel) -> Accesses:
    bt = trace.block_tokens
    tick = model.tick_ms
    next_id = int(max((int(r.hash_ids.max()) for r in trace.requests if len(r.hash_ids)), default=-1)) + 1
    refs: dict[int, int] = {}
    seen: set[int] = set()
    W, B, C, P, S, O = [], [], [], [], [], []
    for ri, r in enumerate(trace.requests):
        ids = r.hash_ids
        h = len(ids)
        total_blocks = max(math.ceil((r.input_tokens + r.output_tokens) / bt), h)
        n_out = total_blocks - h
        blocks = np.concatenate([ids, np.arange(next_id, next_id + n_out)])
        next_id += n_out
        sharers = np.ones(total_blocks, np.int64)
        for j, hid in enumerate(ids.tolist()):
            refs[hid] = refs.get(hid, 0) + 1
            sharers[j] = refs[hid]
        seq = ri * (1 << 24)
        if h:
            parts, prefill_ms = _prefill(r, ids, sharers[:h], seen, bt, model)
            for lst, part in zip((W, B, C, P, S, O), parts):
                lst.append(part if lst is not O else seq + part)
        else:
            prefill_ms = 0.0
        if r.output_tokens <= 0:
            continue
        t_dec = r.arrival_ms + prefill_ms
        steps = r.output_tokens
        w0 = int(t_dec // tick)
        w1 = int((t_dec + (steps - 1) * model.tpot_ms) // tick)
        win = np.arange(w0, w1 + 1)
        # steps s with t_dec + s·tpot in [w·tick, (w+1)·tick)
        s_lo = np.clip(np.ceil((win * tick - t_dec) / model.tpot_ms), 0, steps).astype(np.int64)
        s_hi = np.clip(np.ceil(((win + 1) * tick - t_dec) / model.tpot_ms), 0, steps).astype(np.int64) - 1
        # block j exists from step max(0, j·bt − input_tokens) (token input+s lands in block (input+s)//bt)
        created = np.maximum(np.arange(total_blocks) * bt - r.input_tokens, 0)
        lo = np.maximum(s_lo[:, None], created[None, :])
        n = np.maximum(s_hi[:, None] - lo + 1, 0)
        wi, bi = np.nonzero(n)
        if len(wi) == 0:
            continue
        newest = np.minimum((r.input_tokens + s_hi) // bt, total_blocks - 1)
        d = (newest[wi] - bi) * bt
        W.append(win[wi])
        B.append(blocks[bi])
        C.append(n[wi, bi].astype(np.float64))
        P.append(np.exp2(-np.maximum(d, 0) / model.position_half_life_tokens))
        S.append(sharers[bi])
        O.append(seq + (1 << 20) + bi)
    if not W:
        raise ValueError("the trace has no block accesses (no hash_ids and no output)")
    cat = np.concatenate
    desc = f"{trace.format} trace: {len(trace.requests)} requests, {bt}-token blocks"
    return _finish(cat(W), cat(B), cat(C), cat(P), cat(S), cat(O), bt * model.kv_bytes_per_token, tick, desc)


def expand_native(trace: NativeTrace, tick_ms: float) -> Accesses:
    rows = trace.rows
    _, block = np.unique(rows[["pid", "block_start"]], return_inverse=True)
    t0 = int(rows["last_seen_ns"].min())
    window = ((rows["last_seen_ns"].astype(np.int64) - t0) / 1e6 // tick_ms).astype(np.int64)
    lens = rows["block_len"]
    vals, counts = np.unique(lens, return_counts=True)
    block_bytes = int(vals[np.argmax(counts)])           # the common block size; see docs/simulator.md
    desc = f"native trace: {len(rows)} rows, {block_bytes}-byte blocks"
    if len(vals) > 1:
        desc += f" ({len(vals)} block sizes in the trace; all counted as {block_bytes} bytes)"
    n = len(rows)
    return _finish(window, block, rows["count"].astype(np.float64), np.zeros(n), np.ones(n), np.arange(n),
                   block_bytes, tick_ms, desc)
