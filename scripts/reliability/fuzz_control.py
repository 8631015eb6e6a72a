#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Fuzz the control socket: ≥ 1 M generated request lines over thousands of connections to a real tieringd.

    python scripts/reliability/fuzz_control.py [--json OUT] [--quick] [--seed S] [--lines N]

Worker processes open connection after connection to ``control.sock`` and send a seeded stream of
lines. One worker is root (every request is heard, ``policy-set`` included); the others are members
of the daemon's ``[control] group`` (uid 65533 in ``users``), so that when a ``policy-set`` lowers
``max_clients`` they are the ones turned away as ``busy`` and root's probe below lives on the
connections root has reserved (``root_reserved_clients``; the generator gives that key no accepted
value under 4, what the root worker and the probe hold at once). Each session is a mix of:

- random bytes (newlines where they fall), lines cut short, a line longer than ``max_line_bytes``;
- JSON that is not a request: numbers, strings, arrays, nesting thousands deep, NaN and Infinity;
- requests with edge values in every field of every request — pids, offsets and limits at 0, -1,
  2^31, 2^63, 2^64, 1e308, NaN, ±Infinity, strings, null, lists; ``migrate`` of the worker's own
  memory or of no process, to nodes and tiers that exist or not; unknown requests and fields;
  protocol versions; ids of every JSON type;
- ``policy-set`` of every key of every table with extreme values (NaN, ±Infinity, 0, -1, 1e308,
  2^64, in-range values) and values of the wrong type; unknown keys and tables;
- valid sessions (``status``, ``regions``, ``policy-get``) then garbage on the same connection.

Replies are read as they come (a session in ten never reads, and is cut off when its replies pile
up, as the server promises) and each must be one JSON object with ``ok`` and, when refused, a code
the protocol documents; ``internal`` is a bug. Every 75 of its sessions the root worker sends SIGHUP,
so the file's settings come back over what ``policy-set`` changed. A thread asks ``status`` every
half second on a fresh connection. Afterwards: alive, ``status`` answering, RSS, no traceback.
"""
from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import random
import signal
import socket
import sys
import time
import typing
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, HostDaemon, Watch, arguments, result, seed_of, skip_unless_root, write  # noqa: E402

from tieringd import config, settings  # noqa: E402

WORKERS = 4                      # worker 0 is root, the others members of GROUP
GROUP, GROUP_GID, MEMBER = "users", 100, 65533     # Debian's users group, as the access part uses it
ROOT_RESERVED_FLOOR = 4          # root's worker (a connection, and one closing) and the probe, and one spare
CODES = {"forbidden", "bad-request", "unknown-request", "unsupported-version", "too-long", "busy",
         "not-found", "kernel", "config", "internal"}
NUMBERS = (0, 1, -1, 2**31 - 1, 2**31, 2**63, 2**64, -2**63, 1e308, -1e308, 1e-308, 0.5,
           float("nan"), float("inf"), float("-inf"))
ODD = (None, True, False, "", "1", "x" * 100, [], {}, [1, 2], {"a": 1})
REQUESTS = ("status", "tiers", "processes", "regions", "heat", "stats", "migrate", "policy-get", "policy-set")
FIELDS = {"regions": ("pid",), "heat": ("pid", "offset", "limit"),
          "migrate": ("pid", "ranges", "all", "to", "priority"), "policy-set": ("set",)}


def keys() -> list[tuple[str, str, typing.Any, config.Range | None]]:
    """(table, key, annotation, range) of every configuration key."""
    out = []
    for name, (cls, _) in settings.TABLES.items():
        hints = typing.get_type_hints(cls)
        out += [(name, f.name, hints[f.name], config.range_of(f)) for f in dataclasses.fields(cls) if f.init]
    return out


class Generator:
    def __init__(self, seed: int, pid: int, own: tuple[int, int]):
        self.r = random.Random(seed)
        self.pid, self.own = pid, own
        self.keys = keys()

    def value(self) -> typing.Any:
        r = self.r
        return r.choice(NUMBERS) if r.random() < 0.6 else r.choice(ODD)

    def setting(self) -> tuple[str, typing.Any]:
        """One policy-set entry: an extreme, in-range or ill-typed value for a real key (string keys get
        no string: a path or a group from a fuzzer has no business in a daemon's settings), or a key
        that does not exist."""
        r = self.r
        if r.random() < 0.05:
            return r.choice(("", ".", "nosuch", "policy.nosuch", "nosuch.key", "a.b.c", "k" * 300)), self.value()
        table, key, hint, rng = r.choice(self.keys)
        name = key if table == "policy" and r.random() < 0.5 else f"{table}.{key}"
        base = typing.get_args(hint)[0] if typing.get_origin(hint) in (typing.Union, __import__("types").UnionType) else hint
        if rng is not None and r.random() < 0.3:
            lo, hi = rng.lo, rng.hi
            v = r.uniform(lo, hi) if base is float else r.randint(int(lo), int(hi))
        elif typing.get_origin(base) in (tuple, list):
            v = [self.value() for _ in range(r.randrange(4))] if r.random() < 0.7 else self.value()
        elif typing.get_origin(base) in (dict, typing.Mapping, __import__("collections.abc").abc.Mapping):
            v = {r.choice(("pid:1", "cgroup:/x", "0", "2", "99")): self.value() for _ in range(r.randrange(3))}
        elif base is str:
            v = r.choice(NUMBERS + (None, [], {}, True))
        else:
            v = self.value()
        if (table, key) == ("control", "root_reserved_clients") and isinstance(v, int) and \
                not isinstance(v, bool) and 1 <= v < ROOT_RESERVED_FLOOR:
            v = ROOT_RESERVED_FLOOR     # accepted, but it would leave root's probe no slot: see above
        return name, v

    def request(self) -> dict:
        r = self.r
        name = r.choice(REQUESTS + ("nosuch", ""))
        msg: dict = {"request": name}
        if r.random() < 0.9:
            msg["v"] = 1 if r.random() < 0.9 else self.value()
        if r.random() < 0.9:
            msg["id"] = r.choice((r.randrange(1 << 31),) + NUMBERS + ODD)
        for f in FIELDS.get(name, ()):
            if r.random() < 0.3:
                continue
            if f == "set":
                msg[f] = dict(self.setting() for _ in range(r.randrange(1, 4))) if r.random() < 0.9 else self.value()
            elif f == "ranges":
                msg[f] = [[r.choice((self.own[0], 0, 2**64, -1, 1e308)), r.choice((self.own[1], 0, 4096, 2**64, -1))]
                          for _ in range(r.randrange(3))] if r.random() < 0.8 else self.value()
            elif f == "to":
                msg[f] = r.choice((0, 1, 2, 99, -1, "dram", "cxl-dram", "pmem", "dax", "0", "x", 1e308, None))
            elif f == "pid":
                msg[f] = r.choice((self.pid, self.pid, 1, 0, -1, 2**31, 2**64, 1e308, None, "1", 999_999_999))
            else:
                msg[f] = self.value()
        if r.random() < 0.05:
            msg[r.choice(("nosuch", "pid", "set"))] = self.value()
        return msg

    def line(self) -> bytes:
        r = self.r
        x = r.random()
        if x < 0.25:
            return r.randbytes(r.randrange(200)) + b"\n"
        if x < 0.3:
            return r.choice((b"{", b'{"v": 1, "request": "sta', b"[", b'"', b"nul", b"1e999999", b"-",
                             b'{"request": "status", "id": 1}}', b"\xff\xfe\n"[:2])) + b"\n"
        if x < 0.35:
            depth = r.choice((10, 1000, 100_000))
            return (b"[" * depth + b"]" * depth) if r.random() < 0.5 else (b'{"a":' * depth + b"1" + b"}" * depth) + b"\n"
        if x < 0.4:
            return json.dumps(r.choice(NUMBERS + ODD)).encode() + b"\n"
        data = json.dumps(self.request(), allow_nan=True).encode()
        if r.random() < 0.05:
            data = data[: r.randrange(len(data) + 1)]
        return data + b"\n"

    def session(self) -> tuple[list[bytes], bool]:
        """Lines of one connection, and whether the client reads its replies."""
        r = self.r
        n = r.choice((1, 5, r.randrange(1, 600), r.randrange(1, 600)))
        out = []
        if r.random() < 0.3:
            out += [json.dumps({"v": 1, "id": i, "request": q}).encode() + b"\n"
                    for i, q in enumerate(("status", "policy-get", "regions"))]
        out += [self.line() for _ in range(n)]
        if r.random() < 0.002:
            out.append(b"x" * ((1 << 20) + 10) + b"\n")         # longer than max_line_bytes
        return out, r.random() >= 0.1


def check_replies(buf: bytearray, counts: dict) -> None:
    """Complete reply lines in ``buf``: each one JSON object, ok or a documented code."""
    while True:
        nl = buf.find(b"\n")
        if nl < 0:
            return
        line = bytes(buf[:nl])
        del buf[:nl + 1]
        counts["replies"] += 1
        try:
            msg = json.loads(line)
            good = isinstance(msg, dict) and isinstance(msg.get("ok"), bool) and (
                msg["ok"] or (msg.get("error") or {}).get("code") in CODES)
        except ValueError:
            good = False
        if not good:
            counts["bad_replies"] += 1
            if len(counts["internal_examples"]) < 5:
                counts["internal_examples"].append(f"malformed reply: {line[:300]!r}")
        elif not msg["ok"] and msg["error"]["code"] == "busy":
            counts["busy"] += 1
        elif not msg["ok"] and msg["error"]["code"] == "internal":
            counts["internal"] += 1
            if len(counts["internal_examples"]) < 5:
                counts["internal_examples"].append(msg["error"]["message"][:300])


def worker(args: tuple) -> dict:
    path, seed, lines, daemon_pid, hup_every, uid = args
    import ctypes
    import mmap
    if uid != 0:                # a member: the kernel's SO_PEERGROUPS shows GROUP to the daemon
        os.setgroups([GROUP_GID])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    buf = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.write(b"\1" * (4 << 20))
    own = (ctypes.addressof(ctypes.c_char.from_buffer(buf)), 4 << 20)
    gen = Generator(seed, os.getpid(), own)
    counts = {"sent": 0, "connections": 0, "cut_off": 0, "replies": 0, "bad_replies": 0, "internal": 0, "busy": 0,
              "internal_examples": [], "hups": 0}
    sessions = 0
    while counts["sent"] < lines:
        session, reads = gen.session()
        sessions += 1
        if hup_every and sessions % hup_every == 0:
            os.kill(daemon_pid, signal.SIGHUP)
            counts["hups"] += 1
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        try:
            s.connect(path)
        except OSError:
            time.sleep(0.01)
            continue
        counts["connections"] += 1
        inbuf = bytearray()
        try:
            for line in session:
                s.sendall(line)
                counts["sent"] += 1
                if reads:
                    _drain(s, inbuf, counts, 0.0)
            if reads:
                _drain(s, inbuf, counts, 0.3)
        except OSError:
            counts["cut_off"] += 1
        s.close()
    del own
    return counts


def _drain(s: socket.socket, inbuf: bytearray, counts: dict, wait_s: float) -> None:
    s.settimeout(wait_s)
    try:
        while True:
            data = s.recv(1 << 16)
            if not data:
                break
            inbuf += data
            check_replies(inbuf, counts)
            s.settimeout(0.0 if wait_s == 0 else 0.05)
    except (BlockingIOError, socket.timeout):
        pass
    finally:
        s.settimeout(30)


def main() -> int:
    ap = arguments(__doc__)
    ap.add_argument("--lines", type=int, default=None, help="lines to send (default 1000000; quick 20000)")
    args = ap.parse_args()
    skipped = skip_unless_root(args, "fuzz-control", "control socket: generated request lines to a real daemon", "inputs")
    if skipped is not None:
        return skipped
    seed = seed_of(args, "fuzz-control")
    lines = args.lines or (20_000 if args.quick else 1_000_000)
    d = HostDaemon(config=f'[control]\ngroup = "{GROUP}"\n', tag="fuzz-control")
    try:
        ready_s = d.wait_ready()
        time.sleep(1.0)
        rss0 = d.rss_bytes()
        watch = Watch(d)
        per = -(-lines // WORKERS)
        t0 = time.monotonic()
        # one task per process (maxtasksperchild): a member's worker never runs root's task
        with multiprocessing.get_context("fork").Pool(WORKERS, maxtasksperchild=1) as pool:
            counts = pool.map(worker, [(str(d.run_dir / "control.sock"), seed * 1000 + i, per, d.pid,
                                        75 if i == 0 else 0, 0 if i == 0 else MEMBER) for i in range(WORKERS)], chunksize=1)
        wall = time.monotonic() - t0
        during = watch.stop()
        total = {k: sum(c[k] for c in counts) for k in counts[0] if k != "internal_examples"}
        examples = [e for c in counts for e in c["internal_examples"]]
        latency = d.status_latency_s(timeout_s=60)
        rss1 = d.rss_bytes()
        alive = d.alive()
        tracebacks = d.tracebacks()
        rc = d.stop() if alive else d.proc.returncode
    finally:
        d.cleanup(keep_log=REPO / "build" / "reliability" / "fuzz_control-daemon.log")
    figures = {"lines": total["sent"], "connections": total["connections"],
               "lines_per_s": round(total["sent"] / wall), "wall_s": round(wall, 1),
               "daemon_ready_s": round(ready_s, 2), **total,
               "workers": {"root": 1, "members": WORKERS - 1, "group": GROUP},
               "status_after_ms": None if latency is None else round(1000 * latency, 1), "during": during,
               "rss_before_mb": round((rss0 or 0) / 2**20, 1), "rss_after_mb": round((rss1 or 0) / 2**20, 1),
               "rss_growth_mb": round(((rss1 or 0) - (rss0 or 0)) / 2**20, 1), "daemon_rc": rc}
    crashes = (0 if alive else 1) + len(tracebacks)
    ok = alive and not tracebacks and latency is not None and total["bad_replies"] == 0 and \
        total["internal"] == 0 and rc == 0 and during["status_unanswered"] == 0
    print(f"fuzz-control: {total['sent']} lines over {total['connections']} connections in {wall:.1f} s "
          f"({figures['lines_per_s']}/s), {total['replies']} replies ({total['internal']} internal, "
          f"{total['bad_replies']} malformed, {total['busy']} busy), {total['cut_off']} connections cut off; status after "
          f"{figures['status_after_ms']} ms, during p50 {during['status_p50_ms']} max {during['status_max_ms']} ms; "
          f"RSS {figures['rss_before_mb']} → {figures['rss_after_mb']} MB (max {during['rss_max_mb']})", flush=True)
    for t in tracebacks[:5] + examples[:5]:
        print(f"fuzz-control: {t}", flush=True)
    return write(args, result("fuzz-control", "control socket: generated request lines to a real daemon",
                              tried=total["sent"], unit="inputs", ok=ok, crashes=crashes + total["internal"],
                              seed=seed, figures=figures, cases=tracebacks[:20] + examples))


if __name__ == "__main__":
    sys.exit(main())
