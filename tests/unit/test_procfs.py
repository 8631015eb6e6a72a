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
