# SPDX-License-Identifier: Apache-2.0
"""The /proc format readers: /proc/PID/maps of this process, and pagemap flags decoded from the
entries captured in tests/fixtures/sharing/capture.json (scripts/capture-sharing-fixture.py)."""
from __future__ import annotations

import ctypes
import json
import mmap
import os

import numpy as np

from tieringd.kernel import procfs

MiB = 1 << 20


def test_read_maps_of_this_process():
    buf = mmap.mmap(-1, 4 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    maps = procfs.read_maps(os.getpid())
    assert any(v.start <= addr < v.end and v.perms.startswith("rw") and v.anonymous for v in maps)
    assert maps == sorted(maps, key=lambda v: v.start)
    # every process has a stack and a vDSO; neither is memory move_pages or the registry will take
    assert [v for v in maps if v.stack] and [v for v in maps if v.path == "[vdso]" and v.no_struct_pages]
    assert not any(v.stack or v.no_struct_pages for v in maps if v.start <= addr < v.end)


def test_read_maps_of_a_missing_process_gives_the_default():
    assert procfs.read_maps(999_999_999, []) == []


def test_pagemap_flags_decode(fixtures_dir):
    with open(fixtures_dir / "sharing" / "capture.json") as f:
        capture = json.load(f)
    names = list(capture["addresses"])
    entries = np.array([int(capture["pagemap"][n], 16) for n in names], np.uint64)
    assert dict(zip(names, procfs.present(entries).tolist())) == {
        "shared0": True, "shared1": True, "private0": True, "private1": False}
    assert dict(zip(names, procfs.exclusive(entries).tolist()))["shared0"] is False
    assert dict(zip(names, procfs.exclusive(entries).tolist()))["private0"] is True
    assert dict(zip(names, procfs.file_or_shared(entries).tolist()))["shared0"] is True
    assert procfs.pfns(entries)[names.index("private1")] == 0


def test_per_pfn_files_are_read_at_scattered_pfns_in_any_order(tmp_path):
    """kpagecount laid out by hand: PFNs near each other share a read, far ones do not, PFN 0 and
    PFNs past the end of the file read as 0, and the answer follows the caller's order."""
    from tieringd.kernel import sysfs
    path = tmp_path / "proc" / "kpagecount"
    path.parent.mkdir(parents=True)
    counts = np.zeros(200_000, "<u8")
    counts[[5, 6, 40, 100_000, 199_999]] = [3, 4, 7, 9, 11]
    path.write_bytes(counts.tobytes())
    want = np.array([199_999, 6, 0, 100_000, 5, 40, 250_000, 6], np.uint64)
    with sysfs.root(tmp_path):
        assert procfs.read_kpagecount(want).tolist() == [11, 4, 0, 9, 3, 7, 0, 4]
        assert procfs.read_kpagecount(np.zeros(0, np.uint64)).tolist() == []


def test_read_mem_of_this_process():
    buf = mmap.mmap(-1, 2 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    data = os.urandom(MiB)
    buf[MiB:] = data
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert procfs.read_mem(os.getpid(), addr + MiB + 4095, 4097) == data[4095:8192]
