# SPDX-License-Identifier: Apache-2.0
"""Trace readers. Every reader checks what it reads: a bad line is an error naming the file and line.

- **Mooncake** (FAST'25 release, JSON lines): ``timestamp`` (ms since the trace start), ``input_length``
  and ``output_length`` (tokens), ``hash_ids`` (one id per 512-token block of the input; equal ids =
  identical prefix KV).
- **Bailian** (Alibaba Qwen-Bailian usage traces, JSON lines): ``chat_id``, ``parent_chat_id`` (−1 for a
  session's first turn), ``timestamp`` (s), ``input_length``, ``output_length``, ``type``, ``turn``,
  ``hash_ids`` (16-token blocks).
- **Native**: what the samplers record, rows of ``contracts.ACCESS_DELTA_DTYPE`` — a ``.npy`` file of
  that dtype, or JSON lines with those field names; the block size is as recorded (``block_len``).

The trace's block size (tokens per hash id) is the format's unless ``trace_block_tokens`` says
otherwise; a request trace whose records say another (``input_length`` over the ids) is refused with the
size they suggest. The simulated block (``block_tokens``) is a whole number of the trace's: ids finer
than it are grouped, so many to a block, into *chained* blocks — a block's id names its ids and the block
before it, so equal ids still mean an identical prefix. Ids coarser than the simulated block are refused:
nothing in the trace says where within an id two requests part.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Iterator

import numpy as np

from tieringd.contracts import ACCESS_DELTA_DTYPE

FORMATS = ("mooncake", "bailian", "native")
BLOCK_TOKENS = {"mooncake": 512, "bailian": 16}


class TraceError(ValueError):
    pass


@dataclasses.dataclass
class Request:
    arrival_ms: float
    input_tokens: int
    output_tokens: int
    hash_ids: np.ndarray          # int64, one per block of the input
    session: int = -1             # Bailian: the root chat of the conversation


@dataclasses.dataclass
class RequestTrace:
    format: str
    block_tokens: int             # the simulated block
    requests: list[Request]
    id_tokens: int = 0            # tokens per id in the trace's records (0: block_tokens)
    id_tokens_given: bool = False  # from --trace-block-tokens, not the format's

    def describe_blocks(self) -> str:
        """The simulated block size and where it comes from, for reports."""
        ids = self.id_tokens or self.block_tokens
        origin = "--trace-block-tokens" if self.id_tokens_given else f"the {self.format} format's"
        if ids == self.block_tokens:
            return f"{self.block_tokens}-token blocks ({origin} block size)"
        return (f"{self.block_tokens}-token blocks (--block-tokens: {self.block_tokens // ids} ids of "
                f"{ids} tokens each, {origin})")


@dataclasses.dataclass
class NativeTrace:
    rows: np.ndarray              # ACCESS_DELTA_DTYPE, sorted by last_seen_ns


def _lines(path: str) -> Iterator[tuple[int, dict]]:
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror}") from None
    with f:
        for no, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise TraceError(f"{path}:{no}: not JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise TraceError(f"{path}:{no}: expected a JSON object")
            yield no, row


def detect_format(path: str) -> str:
    if path.endswith(".npy"):
        return "native"
    for _no, row in _lines(path):
        if "block_start" in row:
            return "native"
        if "chat_id" in row or "parent_chat_id" in row:
            return "bailian"
        if "hash_ids" in row:
            return "mooncake"
        raise TraceError(f"{path}: cannot tell the trace format from its first record "
                         f"(fields: {', '.join(sorted(row))[:200]}); pass --format")
    raise TraceError(f"{path}: empty trace")


def _int(row: dict, key: str, path: str, no: int, minimum: int = 0) -> int:
    v = row.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v < minimum:
        raise TraceError(f"{path}:{no}: {key!r} must be an integer ≥ {minimum}, got {v!r}")
    return int(v)


def _hash_ids(row: dict, path: str, no: int) -> np.ndarray:
    ids = row.get("hash_ids")
    if not isinstance(ids, list) or any(isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in ids):
        raise TraceError(f"{path}:{no}: 'hash_ids' must be a list of non-negative integers")
    return np.array(ids, np.int64)


def _check_id_tokens(path: str, fmt: str, reqs: list[Request], id_tokens: int) -> None:
    """Refuses a trace whose records say its ids are not ``id_tokens`` tokens each (a request's input
    has ⌈input_length / id_tokens⌉ ids in every trace of the format seen so far)."""
    with_ids = [r for r in reqs if len(r.hash_ids)]
    if not with_ids:
        return
    agree = sum(-(-r.input_tokens // id_tokens) == len(r.hash_ids) for r in with_ids)
    if agree * 2 >= len(with_ids):
        return
    per_id = float(np.median([r.input_tokens / len(r.hash_ids) for r in with_ids]))
    guess = 2 ** round(math.log2(max(per_id, 1.0)))
    raise TraceError(f"{path}: its ids cover about {per_id:.0f} tokens each (input_length over hash_ids; "
                     f"{agree} of {len(with_ids)} requests fit the {fmt} format's {id_tokens}): pass "
                     f"--trace-block-tokens {guess}, and --block-tokens N (a multiple of it) to simulate "
                     f"blocks of N tokens")


def group_ids(trace: RequestTrace, block_tokens: int) -> RequestTrace:
    """The trace with its ids grouped into chained blocks of ``block_tokens`` (a multiple of its ids'
    size): a block's id names the ids it holds and the block before it."""
    ids_tokens = trace.id_tokens or trace.block_tokens
    if block_tokens < ids_tokens or block_tokens % ids_tokens:
        raise TraceError(f"--block-tokens {block_tokens}: the trace's ids cover {ids_tokens} tokens each, and a "
                         f"simulated block must be a whole number of them ({ids_tokens}, {2 * ids_tokens}, …); "
                         f"ids coarser than the block cannot be split")
    k = block_tokens // ids_tokens
    if k == 1:
        return dataclasses.replace(trace, id_tokens=ids_tokens)
    chained: dict[tuple[int, bytes], int] = {}
    out = []
    for r in trace.requests:
        ids = r.hash_ids
        grouped, prev = [], -1
        for lo in range(0, len(ids), k):
            prev = chained.setdefault((prev, ids[lo:lo + k].tobytes()), len(chained))
            grouped.append(prev)
        out.append(dataclasses.replace(r, hash_ids=np.array(grouped, np.int64)))
    return dataclasses.replace(trace, block_tokens=block_tokens, requests=out, id_tokens=ids_tokens)


def read_requests(path: str, fmt: str, limit: int | None = None, trace_block_tokens: int | None = None,
                  block_tokens: int | None = None) -> RequestTrace:
    if fmt not in ("mooncake", "bailian"):
        raise TraceError(f"not a request trace format: {fmt}")
    reqs: list[Request] = []
    root_of: dict[int, int] = {}
    for no, row in _lines(path):
        if limit is not None and len(reqs) >= limit:
            break
        ts = row.get("timestamp")
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0:
            raise TraceError(f"{path}:{no}: 'timestamp' must be a non-negative number, got {ts!r}")
        arrival_ms = float(ts) if fmt == "mooncake" else float(ts) * 1000.0
        session = -1
        if fmt == "bailian":
            chat = _int(row, "chat_id", path, no)
            parent = _int(row, "parent_chat_id", path, no, minimum=-1)
            session = root_of.get(parent, parent) if parent >= 0 else chat
            root_of[chat] = session
        reqs.append(Request(arrival_ms, _int(row, "input_length", path, no),
                            _int(row, "output_length", path, no), _hash_ids(row, path, no), session))
    if not reqs:
        raise TraceError(f"{path}: no requests")
    reqs.sort(key=lambda r: r.arrival_ms)            # stable: ties keep file order
    id_tokens = trace_block_tokens or BLOCK_TOKENS[fmt]
    if trace_block_tokens is None:
        _check_id_tokens(path, fmt, reqs, id_tokens)
    trace = RequestTrace(fmt, id_tokens, reqs, id_tokens, trace_block_tokens is not None)
    return group_ids(trace, block_tokens) if block_tokens else trace


def read_native(path: str, limit: int | None = None) -> NativeTrace:
    if path.endswith(".npy"):
        try:
            rows = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise TraceError(f"cannot read native trace {path}: {e}") from None
        if rows.dtype != ACCESS_DELTA_DTYPE:
            raise TraceError(f"{path}: expected rows of ACCESS_DELTA_DTYPE, got {rows.dtype}")
    else:
        recs = []
        for no, row in _lines(path):
            try:
                recs.append(tuple(row[name] for name in ACCESS_DELTA_DTYPE.names))
            except KeyError as e:
                raise TraceError(f"{path}:{no}: missing field {e}") from None
            if limit is not None and len(recs) >= limit:
                break
        try:
            rows = np.array(recs, ACCESS_DELTA_DTYPE)
        except (TypeError, ValueError, OverflowError) as e:
            raise TraceError(f"{path}: bad field value ({e})") from None
    if limit is not None:
        rows = rows[:limit]
    if len(rows) == 0:
        raise TraceError(f"{path}: no rows")
    if (rows["block_len"] == 0).any():
        raise TraceError(f"{path}: rows with block_len 0")
    return NativeTrace(rows[np.argsort(rows["last_seen_ns"], kind="stable")])


def read(path: str, fmt: str = "auto", limit: int | None = None, trace_block_tokens: int | None = None,
         block_tokens: int | None = None) -> RequestTrace | NativeTrace:
    """A trace; ``trace_block_tokens``/``block_tokens``: tokens per id in the records, tokens per simulated
    block (request traces only: a native trace records its block size in bytes)."""
    if not os.path.exists(path):
        raise TraceError(f"trace {path} does not exist")
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt not in FORMATS:
        raise TraceError(f"unknown trace format {fmt!r}: one of {', '.join(FORMATS)}")
    if fmt == "native":
        if trace_block_tokens or block_tokens:
            raise TraceError(f"{path}: a native trace records its block size (block_len, in bytes); "
                             f"--block-tokens and --trace-block-tokens apply to request traces")
        return read_native(path, limit)
    return read_requests(path, fmt, limit, trace_block_tokens, block_tokens)
