# SPDX-License-Identifier: Apache-2.0
"""The accessed-bit fallbacks' block rows and the idle-page sampler (tieringd/sampling/accessed.py),
against a pagemap and an idle bitmap built in tmp_path from the documented formats (no idle page
tracking on any machine here to capture them from). DAMON: test_sampling_damon.py."""
from __future__ import annotations

import numpy as np

from tieringd.kernel import sysfs
from tieringd.sampling import accessed
from tieringd.sampling import tracking as tr


def test_block_rows_follow_ranges_and_default_blocks():
    t = tr.TrackedSet()
    t.add_process(7)
    t.add_range(7, 0x10000, 0x50000, 0x14000)            # blocks of 80 KiB from 0x10000
    rows = accessed._block_rows(7, 0x20000, 0x40000, 3, t, 99)
    assert [(r[1], r[2], r[3]) for r in rows] == [(0x10000, 0x14000, 3), (0x24000, 0x14000, 3),
                                                  (0x38000, 0x14000, 3)]
    assert accessed._block_rows(7, 0x900000, 0x901000, 1, t, 0) == []   # outside, not all-addresses
    t.add_process(8, all_addresses=True, default_block_len=1 << 21)
    rows = accessed._block_rows(8, (1 << 21) - 4096, (1 << 21) + 4096, 2, t, 0)
    assert [(r[1], r[2]) for r in rows] == [(0, 1 << 21), (1 << 21, 1 << 21)]


def test_idle_page_sampler_counts_pages_the_kernel_unmarked(tmp_path):
    pid, base, page = 77, 0x7f0000000000, 4096
    pfns = [1000, 1001, 1002, 70000]      # four present pages, two bitmap words apart
    proc = tmp_path / f"proc/{pid}"
    proc.mkdir(parents=True)
    with open(proc / "pagemap", "wb") as f:
        for i, pfn in enumerate(pfns):
            f.seek((base // page + i) * 8)
            f.write(((1 << 63) | pfn).to_bytes(8, "little"))
    bitmap = tmp_path / "sys/kernel/mm/page_idle/bitmap"
    bitmap.parent.mkdir(parents=True)
    bitmap.write_bytes(b"\0" * ((70000 // 64 + 1) * 8))
    t = tr.TrackedSet()
    t.add_process(pid)
    t.add_range(pid, base, 4 * page, 2 * page)            # two blocks of two pages
    s = accessed.IdlePageSampler(t)
    s._started = True                                      # start() checks the live pagemap
    with sysfs.root(tmp_path):
        assert len(s.read_deltas()) == 0                   # first interval only marks
        words = np.frombuffer(bitmap.read_bytes(), "<u8").copy()
        for pfn in pfns:
            assert words[pfn // 64] >> np.uint64(pfn % 64) & np.uint64(1)
        # the "kernel" saw accesses to pfn 1001 and 70000: their idle bits are cleared
        for pfn in (1001, 70000):
            words[pfn // 64] &= ~np.uint64(1 << (pfn % 64))
        bitmap.write_bytes(words.tobytes())
        d = s.read_deltas()
    got = {int(r["block_start"]): int(r["count"]) for r in d}
    assert got == {base: 1, base + 2 * page: 1}
    assert accessed._word_runs(np.array([1, 2, 3, 900, 901]), gap=512) == [(1, 3), (900, 901)]
