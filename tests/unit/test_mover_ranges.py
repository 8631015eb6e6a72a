# SPDX-License-Identifier: Apache-2.0
"""The mover's range arithmetic (tieringd/mover/ranges.py): coalescing, page lists, THP heads, batch
ends, and placement runs — pure numpy, no system calls."""
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tieringd.kernel.procfs import HPAGE_PMD_SIZE as HP
from tieringd.kernel.procfs import PAGE_SIZE as PS
from tieringd.contracts import LANDED_DTYPE
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


def test_landed_runs_break_at_gaps_and_node_changes_and_leave_absent_pages_out():
    a = BASE + np.array([0, 1, 2, 3, 4, 7, 8, 9], dtype=np.uint64) * np.uint64(PS)
    nodes = np.array([1, 1, 2, 2, -2, 2, 2, 1], dtype=np.int32)      # -2: -ENOENT, not present
    rows = ranges.landed_runs(7, a, nodes)
    assert rows.dtype == LANDED_DTYPE
    assert [(int(r["start"]), int(r["npages"]), int(r["node"])) for r in rows] == [
        (BASE, 2, 1), (BASE + 2 * PS, 2, 2), (BASE + 7 * PS, 2, 2), (BASE + 9 * PS, 1, 1)]
    assert set(rows["pid"].tolist()) == {7}
    assert len(ranges.landed_runs(7, a[:0], nodes[:0])) == 0
    assert len(ranges.landed_runs(7, a[4:5], nodes[4:5])) == 0


def landed_runs_reference(pid, addrs, nodes):
    """Plain Python: walk the pages, extend the last run when the page follows it on the same node."""
    runs = []
    for a, n in zip(addrs.tolist(), nodes.tolist()):
        if n < 0:
            continue
        if runs and runs[-1][2] == n and runs[-1][0] + runs[-1][1] * PS == a:
            runs[-1][1] += 1
        else:
            runs.append([a, 1, n])
    return [tuple(r) for r in runs]


@given(st.lists(st.tuples(st.integers(1, 3), st.sampled_from([-2, -14, 0, 1, 2])), max_size=60))
def test_landed_runs_agree_with_the_plain_python_walk(steps):
    # (gap in pages to the previous page, node) per page: sorted, unique addresses as batches are
    addrs = BASE + np.cumsum([g for g, _ in steps], dtype=np.int64).astype(np.uint64) * np.uint64(PS)
    nodes = np.array([n for _, n in steps], dtype=np.int32)
    rows = ranges.landed_runs(7, addrs, nodes)
    assert [(int(r["start"]), int(r["npages"]), int(r["node"])) for r in rows] == \
        landed_runs_reference(7, addrs, nodes)


def test_merge_landed_keeps_the_latest_report_of_a_page_and_joins_neighbours():
    first = ranges.landed_runs(7, BASE + np.arange(8, dtype=np.uint64) * np.uint64(PS),
                               np.array([1, 1, 1, 0, 0, 1, 1, 1], np.int32))      # 3, 4 refused
    retry = ranges.landed_runs(7, BASE + np.array([3, 4], np.uint64) * np.uint64(PS), np.array([1, 1], np.int32))
    later = ranges.landed_runs(7, BASE + np.arange(8, 10, dtype=np.uint64) * np.uint64(PS), np.ones(2, np.int32))
    rows = ranges.merge_landed([first, retry, later])
    assert [(int(r["start"]), int(r["npages"]), int(r["node"])) for r in rows] == [(BASE, 10, 1)]
    assert len(ranges.merge_landed([])) == 0
