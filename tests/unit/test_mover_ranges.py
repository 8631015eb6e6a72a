# SPDX-License-Identifier: Apache-2.0
"""The mover's range arithmetic (tieringd/mover/ranges.py): coalescing, page lists, THP heads, batch
ends — pure numpy, no system calls."""
import numpy as np

from tieringd._procfs import HPAGE_PMD_SIZE as HP
from tieringd._procfs import PAGE_SIZE as PS
from tieringd.mover import ranges

BASE = 0x7F0000000000


def test_coalesce_merges_overlapping_adjacent_and_unaligned_ranges():
    r = [(BASE + 5 * PS, PS), (BASE, 2 * PS), (BASE + 2 * PS, 10), (BASE + PS + 7, 100),
         (BASE + 20 * PS, 0), (BASE + 9 * PS + 1, 1)]
    assert ranges.coalesce(r) == [(BASE, BASE + 3 * PS), (BASE + 5 * PS, BASE + 6 * PS),
                                  (BASE + 9 * PS, BASE + 10 * PS)]
    assert ranges.coalesce([]) == []
    pages = ranges.interval_pages(ranges.coalesce(r))
    assert len(pages) == 5 and pages[0] == BASE
    assert ranges.interval_npages(ranges.coalesce(r)) == 5


def test_thp_heads_sends_one_address_per_huge_page():
    addrs = np.arange(BASE, BASE + 2 * HP + 4 * PS, PS, dtype=np.uint64)
    thp = np.zeros(len(addrs), dtype=bool)
    thp[: 2 * HP // PS] = True
    send = ranges.thp_heads(addrs, thp)
    assert send.sum() == 2 + 4
    assert addrs[send][:2].tolist() == [BASE, BASE + HP]


def test_batches_never_cut_a_huge_page():
    pages = np.arange(BASE + 100 * PS, BASE + 100 * PS + 3000 * PS, PS, dtype=np.uint64)  # not 2 MiB aligned
    end = ranges.batch_end(pages, 0, 512)
    assert int(pages[end]) % HP == 0 and end - 512 < 512
    assert ranges.batch_end(pages, 0, 10**6) == len(pages)
    aligned = np.arange(BASE, BASE + 2048 * PS, PS, dtype=np.uint64)
    assert ranges.batch_end(aligned, 0, 512) == 512
    assert ranges.batch_end(pages, 0, 512, in_thp=lambda a: False) == 512   # 4 KiB pages: not stretched


def test_contiguous_runs():
    a = np.array([BASE, BASE + PS, BASE + 5 * PS, BASE + 6 * PS, BASE + 7 * PS], dtype=np.uint64)
    assert ranges.contiguous_runs(a) == [(0, 2), (2, 3)]

