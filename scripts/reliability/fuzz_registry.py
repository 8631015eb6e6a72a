#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Fuzz the registry socket: ≥ 1 M generated records over thousands of connections to a real tieringd.

    python scripts/reliability/fuzz_registry.py [--json OUT] [--quick] [--seed S] [--records N]

Worker processes (each its own pid, so HELLO may be honest) open connection after connection to
``registry.sock`` and send a seeded stream of records, each session one of:

- random bytes of random length (0 to 300: empty, shorter than a header, longer than any record);
- valid headers with a corrupted field (magic, version, type, size);
- valid records cut short, or with bytes appended (truncated and oversized frames);
- valid records with edge values (ranges at 0, 1, page and 2 MiB edges, 2^56, 2^64-1; every flag bit;
  policies, sources and nodes out of range; tags not UTF-8; HELLO naming another pid; control
  requests a shim may not send; replies to nothing);
- a valid session — HELLO, REGISTER of the worker's own mapped memory (accepted), UNREGISTER — then
  garbage on the same connection.

One session in 20 reads back every reply and checks it is a well-formed record of the protocol. A
thread asks the daemon's ``status`` every half second throughout (a fresh connection each time).
Afterwards: the daemon alive, ``status`` answering (how fast), its RSS before, at most during and
after, no traceback in its log, and the regions it holds for the workers gone with their
connections. The seed is printed first; ``--seed S`` replays the same records.
"""
from __future__ import annotations

import multiprocessing
import random
import socket
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, HostDaemon, Watch, arguments, result, seed_of, skip_unless_root, write  # noqa: E402

from tieringd.shim import protocol as P  # noqa: E402

MiB = 1 << 20
WORKERS = 4
EDGE_U64 = (0, 1, 4095, 4096, 4097, 2 * MiB - 1, 2 * MiB, 2 * MiB + 4096, (1 << 47) - 4096, 1 << 56,
            (1 << 56) - 2 * MiB, (1 << 63), (1 << 64) - 1, (1 << 64) - 4096)
EDGE_I32 = (0, 1, -1, 2**31 - 1, -2**31)


class Generator:
    """Seeded records. ``own``: (start, length) of 2 MiB-aligned anonymous memory of this process."""

    def __init__(self, seed: int, pid: int, own: list[tuple[int, int]]):
        self.r = random.Random(seed)
        self.pid, self.own = pid, own
        self.seq = 0

    def _seq(self) -> int:
        self.seq = (self.seq + 1) & 0xFFFFFFFF
        return self.seq

    def random_bytes(self) -> bytes:
        n = self.r.choice((0, 1, 15, 16, 17, self.r.randrange(300)))
        return self.r.randbytes(n)

    def edge_record(self) -> bytes:
        r = self.r
        kind = r.randrange(9)
        if kind == 0:
            m = P.Hello(pid=r.choice((self.pid, self.pid + 1, 1, 0, -1, 2**31 - 1)),
                        min_bytes=r.choice(EDGE_U64), policy=r.randrange(256), backing=r.randrange(256),
                        agent=r.choice(("", "x" * 40, "kv\udcff".encode("utf-8", "surrogateescape").decode("latin-1"))))
        elif kind in (1, 2):
            start = r.choice(EDGE_U64 + tuple(s for s, _ in self.own))
            length = r.choice(EDGE_U64 + tuple(n for _, n in self.own))
            m = P.Register(region_id=r.choice(EDGE_U64), start=start, length=length,
                           flags=r.choice((0, 1, 0x3F, 0x40, 0xFFFFFFFF, r.randrange(1 << 32))),
                           policy=r.randrange(256), source=r.randrange(256),
                           node=r.choice((-1, -32768, 32767, 0, 1, 63, 64)), tag="t" * r.randrange(30))
        elif kind == 3:
            m = P.Unregister(region_id=r.choice(EDGE_U64), start=r.choice(EDGE_U64), length=r.choice(EDGE_U64))
        elif kind == 4:
            m = P.Reset()
        elif kind == 5:
            m = r.choice((P.Ack(ref_seq=r.randrange(1 << 32), status=r.choice(EDGE_I32)),
                          P.Error(ref_seq=r.randrange(1 << 32), code=r.choice(EDGE_I32), message="e" * 200),
                          P.Pong(ref_seq=r.randrange(1 << 32), pid=r.choice(EDGE_I32), nregions=r.randrange(1 << 32),
                                 managed_bytes=r.choice(EDGE_U64))))
        elif kind == 6:
            m = r.choice((P.Ping(), P.Resync(), P.Rebind(start=r.choice(EDGE_U64), length=r.choice(EDGE_U64)),
                          P.Config(fields=r.randrange(1 << 32)), P.Remap(start=r.choice(EDGE_U64))))
        else:
            return self.corrupt_header()
        m.seq = self._seq()
        return m.encode()

    def corrupt_header(self) -> bytes:
        r = self.r
        msg = r.choice((P.Hello(pid=self.pid), P.Register(start=self.own[0][0], length=2 * MiB), P.Reset(),
                        P.Unregister()))
        msg.seq = self._seq()
        data = bytearray(msg.encode())
        field = r.randrange(5)
        if field == 0:
            struct.pack_into("<I", data, 0, r.randrange(1 << 32))
        elif field == 1:
            struct.pack_into("<H", data, 4, r.choice((0, 2, 0xFFFF)))
        elif field == 2:
            struct.pack_into("<H", data, 6, r.choice((0, 5, 15, 18, 31, 38, 0xFFFF)))
        elif field == 3:
            struct.pack_into("<I", data, 8, r.choice((0, 15, 16, len(data) - 1, len(data) + 1, 0xFFFFFFFF)))
        else:       # truncated or oversized
            return bytes(data[: r.randrange(len(data))]) if r.random() < 0.5 else \
                bytes(data) + r.randbytes(r.randrange(1, 200))
        return bytes(data)

    def valid_session(self) -> list[bytes]:
        start, length = self.r.choice(self.own)
        msgs = [P.Hello(pid=self.pid, min_bytes=2 * MiB, agent="fuzz"),
                P.Register(region_id=1, start=start, length=length, source=P.Source.MMAP),
                P.Register(region_id=1, start=start, length=length, flags=P.Flag.PINNED, source=P.Source.MMAP)]
        if self.r.random() < 0.5:
            msgs.append(P.Unregister(region_id=1, start=start, length=length))
        out = []
        for m in msgs:
            m.seq = self._seq()
            out.append(m.encode())
        return out

    def session(self) -> list[bytes]:
        r = self.r
        n = r.choice((1, 2, 10, r.randrange(1, 400), r.randrange(1, 400)))
        out = self.valid_session() if r.random() < 0.3 else []
        if r.random() < 0.5 and not out:
            out.append(self.edge_record() if r.random() < 0.3 else
                       P.Hello(pid=self.pid, agent="fuzz", seq=self._seq()).encode())
        mix = r.random()
        for _ in range(n):
            x = r.random()
            out.append(self.random_bytes() if x < mix * 0.6 else self.edge_record())
        return out


def own_regions(count: int = 4) -> tuple[list, list[tuple[int, int]]]:
    """Anonymous mappings of this process with a 2 MiB-aligned range each (what a shim registers)."""
    import ctypes
    import mmap
    keep, ranges = [], []
    for i in range(count):
        buf = mmap.mmap(-1, (i + 2) * 2 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        a = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        keep.append(buf)
        ranges.append(((a + 2 * MiB - 1) & ~(2 * MiB - 1), (i + 1) * 2 * MiB))
    return keep, ranges


def worker(args: tuple) -> dict:
    """One worker process: sessions until ``records`` are sent; counts of what happened."""
    path, seed, records = args
    import os
    keep, own = own_regions()
    gen = Generator(seed, os.getpid(), own)
    sent = conns = dropped = checked = replies = bad_replies = 0
    while sent < records:
        session = gen.session()
        check = gen.r.random() < 0.05
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(30)
        try:
            s.connect(path)
        except OSError:
            dropped += 1
            time.sleep(0.01)
            continue
        conns += 1
        try:
            for data in session:
                s.send(data) if data else s.send(b"")
                sent += 1
                if check:
                    got, bad = drain(s, wait_s=0.0)
                    replies += got
                    bad_replies += bad
        except OSError:           # the daemon closed it (an empty record reads as the end)
            dropped += 1
        if check:
            checked += 1
            got, bad = drain(s, wait_s=0.2)
            replies += got
            bad_replies += bad
        s.close()
    del keep
    return {"sent": sent, "connections": conns, "dropped": dropped, "checked_sessions": checked,
            "replies_read": replies, "bad_replies": bad_replies}


def drain(s: socket.socket, wait_s: float) -> tuple[int, int]:
    """Replies waiting on ``s`` (ERROR, CONFIG): how many, and how many did not decode as records."""
    got = bad = 0
    s.settimeout(wait_s if wait_s > 0 else 0.0)
    try:
        while True:
            data = s.recv(256)
            if not data:
                break
            got += 1
            try:
                msg = P.decode(data)
                if not isinstance(msg, (P.Error, P.Config)):
                    bad += 1
            except P.ProtocolError:
                bad += 1
    except (BlockingIOError, socket.timeout, OSError):
        pass
    s.settimeout(30)
    return got, bad


def main() -> int:
    ap = arguments(__doc__)
    ap.add_argument("--records", type=int, default=None, help="records to send (default 1000000; quick 20000)")
    args = ap.parse_args()
    skipped = skip_unless_root(args, "fuzz-registry", "registry socket: generated records to a real daemon", "inputs")
    if skipped is not None:
        return skipped
    seed = seed_of(args, "fuzz-registry")
    records = args.records or (20_000 if args.quick else 1_000_000)
    d = HostDaemon(tag="fuzz-registry")
    try:
        ready_s = d.wait_ready()
        time.sleep(1.0)
        rss0 = d.rss_bytes()
        watch = Watch(d)
        per = -(-records // WORKERS)
        t0 = time.monotonic()
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(WORKERS) as pool:
            counts = pool.map(worker, [(str(d.run_dir / "registry.sock"), seed * 1000 + i, per)
                                       for i in range(WORKERS)])
        wall = time.monotonic() - t0
        during = watch.stop()
        total = {k: sum(c[k] for c in counts) for k in counts[0]}
        latency = d.status_latency_s(timeout_s=60)
        deadline = time.monotonic() + 60       # the workers' regions leave with their connections
        held = None
        while time.monotonic() < deadline:
            held = d.ask("status")["processes"] if d.alive() else None
            if held == 0 or held is None:
                break
            time.sleep(0.2)
        rss1 = d.rss_bytes()
        alive = d.alive()
        tracebacks = d.tracebacks()
        refusals = d.log().count("refused ")
        rc = d.stop() if alive else d.proc.returncode
    finally:
        d.cleanup(keep_log=REPO / "build" / "reliability" / "fuzz_registry-daemon.log")
    figures = {"records": total["sent"], "connections": total["connections"],
               "records_per_s": round(total["sent"] / wall), "wall_s": round(wall, 1),
               "daemon_ready_s": round(ready_s, 2), **total,
               "status_after_ms": None if latency is None else round(1000 * latency, 1),
               "during": during, "rss_before_mb": round((rss0 or 0) / 2**20, 1),
               "rss_after_mb": round((rss1 or 0) / 2**20, 1),
               "rss_growth_mb": round(((rss1 or 0) - (rss0 or 0)) / 2**20, 1),
               "processes_held_after": held, "refusal_log_lines": refusals, "daemon_rc": rc}
    crashes = (0 if alive else 1) + len(tracebacks)
    ok = alive and not tracebacks and latency is not None and total["bad_replies"] == 0 and held == 0 \
        and rc == 0 and during["status_unanswered"] == 0
    print(f"fuzz-registry: {total['sent']} records over {total['connections']} connections in {wall:.1f} s "
          f"({figures['records_per_s']}/s); status after {figures['status_after_ms']} ms, during p50 "
          f"{during['status_p50_ms']} ms max {during['status_max_ms']} ms; RSS {figures['rss_before_mb']} → "
          f"{figures['rss_after_mb']} MB (max {during['rss_max_mb']})", flush=True)
    for t in tracebacks[:5]:
        print(f"fuzz-registry: traceback: {t}", flush=True)
    return write(args, result("fuzz-registry", "registry socket: generated records to a real daemon",
                              tried=total["sent"], unit="inputs", ok=ok, crashes=crashes, seed=seed,
                              figures=figures, cases=tracebacks[:20]))


if __name__ == "__main__":
    sys.exit(main())
