# SPDX-License-Identifier: Apache-2.0
"""Trace readers. Every reader checks what it reads: a bad line is an error naming the file and line.

- **Mooncake** (FAST'25 release, JSON lines): ``timestamp`` (ms since the trace start), ``input_length``
  and ``output_length`` (tokens), ``hash_ids`` (one id per 512-token block of the input; equal ids =
  identical prefix KV).
- **Bailian** (Alibaba Qwen-Bailian usage traces, JSON lines): ``chat_id``, ``parent_chat_id`` (−1 for a
  session's first turn), ``timestamp`` (s), ``input_length``, ``output_length``, ``type``, ``turn``,
  ``hash_ids`` (16-token blocks).
- **Native**: what the samplers record, rows of ``contracts.ACCESS_DELTA_DTYPE`` — a ``.npy`` file of
  that dtype, or JSON lines with those field names.
"""
from __future__ import annotations

import dataclasses
import json
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
    block_tokens: int
    requests: list[Request]


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


def read_requests(path: str, fmt: str, limit: int | None = None) -> RequestTrace:
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
    return RequestTrace(fmt, BLOCK_TOKENS[fmt], reqs)


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


def read(path: str, fmt: str = "auto", limit: int | None = None) -> RequestTrace | NativeTrace:
    if not os.path.exists(path):
        raise TraceError(f"trace {path} does not exist")
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt not in FORMATS:
        raise TraceError(f"unknown trace format {fmt!r}: one of {', '.join(FORMATS)}")
    return read_native(path, limit) if fmt == "native" else read_requests(path, fmt, limit)
