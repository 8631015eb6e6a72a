#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Capture the pagemap/kpagecount/KSM data the sharing unit tests replay (run as root).

Maps two pages MAP_SHARED at a low fixed address, forks a child that touches the first one (mapcount 2;
the second stays mapcount 1), then maps two private pages and touches the first (present, mapcount 1;
the second is not present). Records the raw pagemap entries of the four pages, the kpagecount entries
of their frames, /sys/kernel/mm/ksm and /proc/self/ksm_stat, as JSON:

    sudo python3 scripts/capture-sharing-fixture.py tests/fixtures/sharing/capture.json
"""
from __future__ import annotations

import ctypes
import json
import mmap
import os
import platform
import struct
import sys

SHARED_AT = 0x2000_0000
PRIVATE_AT = 0x2001_0000
MAP_FIXED_NOREPLACE = 0x100000


def map_at(addr: int, size: int, flags: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    got = libc.mmap(addr, size, mmap.PROT_READ | mmap.PROT_WRITE,
                    flags | mmap.MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0)
    if got in (None, ctypes.c_void_p(-1).value) or got != addr:
        raise OSError(ctypes.get_errno(), f"mmap at {addr:#x} failed")
    return got


def pread_u64(path: str, index: int) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return struct.unpack("<Q", os.pread(fd, 8, index * 8))[0]
    finally:
        os.close(fd)


def main() -> int:
    if os.geteuid() != 0:
        print("capture-sharing-fixture: needs root (kpagecount, PFNs in pagemap)", file=sys.stderr)
        return 1
    out_path = sys.argv[1] if len(sys.argv) > 1 else "capture.json"
    page = os.sysconf("SC_PAGE_SIZE")
    shared = map_at(SHARED_AT, 2 * page, mmap.MAP_SHARED)
    ctypes.memset(shared, 0x5A, 2 * page)
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    child = os.fork()
    if child == 0:
        ctypes.memset(shared, 0x5B, 1)       # a write fault maps page 0 only (a read would map its
                                             # neighbours too: fault-around, fault_around_bytes)
        os.write(ready_w, b"x")
        os.read(done_r, 1)
        os._exit(0)
    os.read(ready_r, 1)
    private = map_at(PRIVATE_AT, 2 * page, mmap.MAP_PRIVATE)
    ctypes.memset(private, 0x33, 1)                         # page 0 present, page 1 never touched
    me = os.getpid()
    addrs = {"shared0": shared, "shared1": shared + page, "private0": private, "private1": private + page}
    entries = {name: pread_u64(f"/proc/{me}/pagemap", a // page) for name, a in addrs.items()}
    pfn_mask = (1 << 55) - 1
    counts = {}
    for e in entries.values():
        pfn = e & pfn_mask if e >> 63 else 0
        if pfn:
            counts[str(pfn)] = pread_u64("/proc/kpagecount", pfn)
    ksm = {}
    for name in sorted(os.listdir("/sys/kernel/mm/ksm")):
        try:
            with open(f"/sys/kernel/mm/ksm/{name}") as f:
                ksm[name] = f.read()
        except OSError:
            pass
    try:
        with open(f"/proc/{me}/ksm_stat") as f:
            ksm_stat = f.read()
    except OSError:
        ksm_stat = None
    os.write(done_w, b"x")
    os.waitpid(child, 0)
    expect = {"shared0": 2, "shared1": 1, "private0": 1, "private1": 0}
    got = {}
    for name, e in entries.items():
        pfn = e & pfn_mask if e >> 63 else 0
        got[name] = counts.get(str(pfn), 0) if pfn else 0
    if got != expect:
        print(f"capture-sharing-fixture: mapcounts {got}, expected {expect}", file=sys.stderr)
        return 1
    doc = {"kernel": platform.release(), "page_size": page, "pid": me,
           "addresses": {k: hex(v) for k, v in addrs.items()},
           "pagemap": {k: hex(v) for k, v in entries.items()},
           "kpagecount": counts, "ksm": ksm, "ksm_stat": ksm_stat,
           "expect_mapcount": expect}
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    print(f"capture-sharing-fixture: wrote {out_path} (kernel {doc['kernel']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
