# SPDX-License-Identifier: Apache-2.0
"""The fault sampler's page-size accounting (tieringd/sampling/pagefault.py): pieces (a block's part
within one 2 MiB chunk, as bpf/pagefault.bpf.c counts them) become one row per block, with ``count``
in base pages seen accessed — a fault on a PMD-mapped THP counts its 512 pages, shared among the
blocks it overlaps; ``pmd_thp_at`` against a fake pagemap/kpageflags tree."""
from __future__ import annotations

import numpy as np

from tieringd.kernel import procfs, sysfs
from tieringd.sampling import pagefault
from tieringd.sampling.base import BLOCK_ROWS_DTYPE
from tieringd.sampling.tracking import TrackedSet

H = pagefault.HPAGE_PMD_SIZE
NR = pagefault.HPAGE_PMD_NR
BASE = 0x7f0000000000            # 2 MiB-aligned


def _rows(*rows):
    return np.array(list(rows), BLOCK_ROWS_DTYPE)


def _by_block(out):
    return {(int(r["pid"]), int(r["block_start"])): r for r in out}


def test_a_thp_fault_counts_the_huge_pages_base_pages():
    t = TrackedSet()
    t.add_process(5)
    t.add_range(5, BASE, 4 * H, H)                   # 2 MiB blocks, aligned
    # block 0 on a THP, one fault; block 1 on 4 KiB pages, 300 faults (300 pages seen)
    rows = _rows((5, BASE, H, 1, 100, 0), (5, BASE + H, H, 300, 200, 2))
    out = _by_block(pagefault.count_base_pages(rows, t, np.array([True, False])))
    assert out[(5, BASE)]["count"] == NR and out[(5, BASE)]["block_len"] == H
    assert out[(5, BASE + H)]["count"] == 300 and out[(5, BASE + H)]["extra"] == 2
    assert len(out) == 2


def test_blocks_smaller_than_the_huge_page_share_its_pages():
    t = TrackedSet()
    t.add_process(5)
    b = 64 * 1024
    t.add_range(5, BASE, 2 * H, b)
    # one fault in block 3 of the first huge page (a THP), with one protection fault
    rows = _rows((5, BASE + 3 * b, b, 1, 500, 1))
    out = pagefault.count_base_pages(rows, t, np.array([True]))
    assert len(out) == H // b
    assert set(out["block_len"].tolist()) == {b}
    assert out["count"].tolist() == [b // 4096] * (H // b)       # 16 pages each, 512 in all
    assert int(out["count"].sum()) == NR
    assert set(out["last_seen_ns"].tolist()) == {500}
    got = _by_block(out)
    assert got[(5, BASE + 3 * b)]["extra"] == 1 and int(out["extra"].sum()) == 1


def test_a_block_spanning_chunks_adds_its_pieces():
    t = TrackedSet()
    t.add_process(5)
    t.add_range(5, BASE, 8 * H, 4 * H)               # 8 MiB blocks: four pieces each
    rows = _rows((5, BASE, H, 1, 10, 0), (5, BASE + H, H, 2, 30, 0),      # two THP pieces
                 (5, BASE + 2 * H, H, 200, 20, 0),                          # a 4 KiB piece
                 (5, BASE + 4 * H, H, 7, 5, 0))                             # the next block
    out = _by_block(pagefault.count_base_pages(rows, t, np.array([True, True, False, False])))
    assert out[(5, BASE)]["count"] == 3 * NR + 200 and out[(5, BASE)]["block_len"] == 4 * H
    assert out[(5, BASE)]["last_seen_ns"] == 30
    assert out[(5, BASE + 4 * H)]["count"] == 7
    assert len(out) == 2


def test_an_unaligned_range_splits_the_huge_page_by_bytes():
    t = TrackedSet()
    t.add_process(5)
    start = BASE + H // 2                            # 2 MiB blocks starting mid-chunk
    t.add_range(5, start, 3 * H, H)
    # the THP at BASE + H holds the second half of block 0 and the first half of block 1
    rows = _rows((5, BASE + H, H // 2, 1, 1, 0), (5, BASE + H + H // 2, H // 2, 1, 2, 0))
    out = _by_block(pagefault.count_base_pages(rows, t, np.array([True, True])))
    # two faults on that huge page (two scan passes), each counting 256 pages in each block
    assert out[(5, start)]["count"] == 2 * (NR // 2)
    assert out[(5, start + H)]["count"] == 2 * (NR // 2)
    assert len(out) == 2


def test_all_addresses_default_blocks_and_untracked_pids():
    t = TrackedSet()
    t.add_process(6, all_addresses=True, default_block_len=H)
    rows = _rows((6, BASE + 5 * H, H, 1, 1, 0), (6, BASE + 7 * H, H, 9, 1, 0),
                 (8, BASE, 4096, 4, 1, 0))           # pid 8 left the tracked set: kept as it is
    out = _by_block(pagefault.count_base_pages(rows, t, np.array([True, False, False])))
    assert out[(6, BASE + 5 * H)]["count"] == NR
    assert out[(6, BASE + 7 * H)]["count"] == 9
    assert out[(8, BASE)]["count"] == 4 and out[(8, BASE)]["block_len"] == 4096


def test_without_thp_accounting_pieces_merge_into_blocks_as_faults():
    t = TrackedSet()
    t.add_process(5)
    t.add_range(5, BASE, 8 * H, 4 * H)
    rows = _rows((5, BASE, H, 1, 10, 0), (5, BASE + H, H, 2, 30, 1))
    out = pagefault.count_base_pages(rows, t, np.zeros(2, bool))
    assert out.tolist() == [(5, BASE, 4 * H, 3, 30, 1)]


def _extra(prot=0, writes=0):
    """``extra`` as bpf/pagefault.bpf.c packs it."""
    return prot | writes << pagefault.PF_EXTRA_WRITE_SHIFT


def test_writes_stay_with_their_block_on_small_pages_and_cover_a_thp():
    t = TrackedSet()
    t.add_process(5)
    b = 64 * 1024
    t.add_range(5, BASE, 2 * H, b)
    # block 2 of the first chunk (a THP): one write fault, one protection fault; block 1 of the
    # second chunk (4 KiB pages): two write faults
    rows = _rows((5, BASE + 2 * b, b, 1, 10, _extra(1, 1)), (5, BASE + H + b, b, 3, 20, _extra(0, 2)))
    out = _by_block(pagefault.count_base_pages(rows, t, np.array([True, False])))
    prot, writes = pagefault.split_extra(np.array([out[(5, BASE + i * b)]["extra"] for i in range(H // b)]))
    # the write made the whole huge page writable: every block of it counts it; the protection
    # fault stays with the block that took it
    assert writes.tolist() == [1] * (H // b) and prot.tolist() == [0, 0, 1] + [0] * (H // b - 3)
    prot, writes = pagefault.split_extra(np.array([out[(5, BASE + H + b)]["extra"]]))
    assert (int(prot[0]), int(writes[0])) == (0, 2)
    assert (5, BASE + H) not in out and (5, BASE + H + 2 * b) not in out


def test_split_extra_reads_both_halves():
    prot, writes = pagefault.split_extra(np.array([_extra(3, 0), _extra(0, 7), _extra(2**32 - 1, 2**31)],
                                                  np.uint64))
    assert prot.tolist() == [3, 0, 2**32 - 1] and writes.tolist() == [0, 7, 2**31]


def _fake_proc(tmp_path, pid, chunks):
    """/proc/PID/pagemap and /proc/kpageflags under tmp_path: chunks = {addr: (pfns, flags)}."""
    proc = tmp_path / "proc"
    (proc / str(pid)).mkdir(parents=True)
    with open(proc / str(pid) / "pagemap", "wb") as pm, open(proc / "kpageflags", "wb") as kf:
        for addr, (pfns, flags) in chunks.items():
            pm.seek((addr >> procfs.PAGE_SHIFT) * 8)
            pm.write((np.asarray(pfns, np.uint64) | np.uint64(procfs.PM_PRESENT)).astype("<u8").tobytes())
            for pfn, f in zip(pfns, flags):
                kf.seek(int(pfn) * 8)
                kf.write(np.array([f], "<u8").tobytes())


def test_pmd_thp_at_wants_one_aligned_order9_folio(tmp_path):
    thp, head = procfs.KPF_THP, procfs.KPF_COMPOUND_HEAD
    p0 = 0x40000                                     # 2 MiB-aligned frame
    order9 = [thp | head] + [thp] * (NR - 1)
    mthp = [thp | (head if i % 16 == 0 else 0) for i in range(NR)]   # 64 KiB multi-size THPs
    chunks = {BASE: (np.arange(NR) + p0, order9),
              BASE + H: (np.arange(NR) + p0 + NR, mthp),
              BASE + 2 * H: (np.arange(NR)[::-1] + p0 + 2 * NR, order9),     # not contiguous
              BASE + 3 * H: (np.arange(NR) + p0 + 3 * NR + 1, order9),       # not aligned
              BASE + 4 * H: (np.arange(NR) + p0 + 5 * NR, [0] * NR)}         # 4 KiB pages
    _fake_proc(tmp_path, 4242, chunks)
    with sysfs.root(tmp_path):
        got = pagefault.pmd_thp_at(4242, np.array(list(chunks) + [BASE + 9 * H], np.uint64))
    assert got.tolist() == [True, False, False, False, False, False]
