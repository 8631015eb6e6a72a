# SPDX-License-Identifier: Apache-2.0
"""The BPF samplers on the running kernel (root, BTF, tracefs): CO-RE objects built by make, loaded
through libbpf with ctypes. Workloads are the programs in tests/progs/ (built by make), unmodified.

Acceptance checked here: skewed per-block rates are ranked right (Spearman ≥ 0.9) and other processes
are excluded (fault sampler; PMU sampler on the software page-fault event); the DMA-copy uprobes see
the exact host pointers a program passes to cudaMemcpyAsync & co. in libfakecudart.so. The CLI on
top of them: test_cli_doctor.py, test_cli_sample.py.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import select
import time

import numpy as np
import pytest

from tieringd.contracts import ACCESS_DELTA_DTYPE, SampleSource
from tieringd.sampling import (DmaCopySampler, MigrationCounter, PageFaultSampler, PmuSampler,
                               SamplerUnavailable, TrackedSet, open_samplers)
from tieringd.sampling import dmacopy, pagefault

from sampling_support import Workload, spearman

pytestmark = [pytest.mark.root, pytest.mark.bpf]


@pytest.fixture
def tracked():
    t = TrackedSet()
    yield t
    t.close()


def _track_blocks(t: TrackedSet, w: Workload, first: int = 0, last: int | None = None) -> None:
    info = w.info
    t.add_process(w.pid)
    last = info["blocks"] if last is None else last
    t.add_range(w.pid, info["base"] + first * info["block_size"],
                (last - first) * info["block_size"], info["block_size"])


def _counts_by_block(rows: np.ndarray, w: Workload) -> np.ndarray:
    info = w.info
    out = np.zeros(info["blocks"], np.int64)
    mine = rows[rows["pid"] == w.pid]
    idx = (mine["block_start"] - np.uint64(info["base"])) // np.uint64(info["block_size"])
    np.add.at(out, idx.astype(np.int64), mine["count"].astype(np.int64))
    return out


@pytest.mark.parametrize("kind", ["fault", "pmu"])
def test_skewed_rates_ranked_and_other_processes_excluded(tracked, kind):
    target = Workload("skewed_touch", "--touches", "2000", "--blocks", "16")
    other = Workload("skewed_touch", "--touches", "2000", "--blocks", "16")   # untracked, same pattern
    sampler = PageFaultSampler(tracked) if kind == "fault" else \
        PmuSampler(tracked, event="software-page-faults")
    try:
        sampler.start()
        _track_blocks(tracked, target)          # after load: the shared maps get it immediately
        tracked.add_process(os.getpid())        # a tracked pid with no ranges counts nothing
        target.go()
        other.go()
        rows = sampler.read_deltas()
        stats = sampler.stats()
    finally:
        sampler.close()
        target.finish()
        other.finish()
    assert rows.dtype == ACCESS_DELTA_DTYPE
    assert set(rows["pid"].tolist()) == {target.pid}, "only the tracked process's blocks"
    assert set(rows["source"].tolist()) == {SampleSource.FAULT if kind == "fault" else SampleSource.PMU}
    assert set(rows["block_len"].tolist()) == {target.info["block_size"]}
    counts = _counts_by_block(rows, target)
    touches = np.array(target.info["touches"])
    # each touch is exactly one fault (MADV_DONTNEED + write), so the counts are exact
    assert counts.tolist() == touches.tolist()
    assert spearman(counts, touches) >= 0.9
    assert stats["untracked_pid"] > 0 and stats["counted"] == touches.sum()
    assert (rows["last_seen_ns"] > 0).all()


def test_ranges_filter_in_kernel_and_epochs_do_not_lose_counts(tracked):
    w = Workload("skewed_touch", "--touches", "600", "--blocks", "8")
    s = PageFaultSampler(tracked)
    try:
        _track_blocks(tracked, w, 2, 6)          # before load: pushed when the maps exist
        s.start()
        w.go()
        first = s.read_deltas()
        second = s.read_deltas()                 # the other epoch map: empty, nothing double-counted
        stats = s.stats()
    finally:
        s.close()
        w.finish()
    counts = _counts_by_block(first, w)
    touches = np.array(w.info["touches"])
    assert counts[2:6].tolist() == touches[2:6].tolist()
    assert counts[:2].sum() == 0 and counts[6:].sum() == 0
    assert stats["outside_ranges"] >= touches[:2].sum() + touches[6:].sum()
    assert second.size == 0


def _own_region(pages: int, align: int = 4096):
    m = mmap.mmap(-1, pages * 4096 + align, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = ctypes.addressof(ctypes.c_char.from_buffer(m))
    return m, (raw + align - 1) // align * align


def test_protection_faults_are_counted_apart(tracked):
    """Reading untouched anonymous memory maps the zero page (not-present fault); the first write
    then takes a protection fault (COW from the zero page): ``extra`` counts only those, and
    ``last_writes`` only the write (the read's error code has no PF_ERR_WRITE)."""
    pages = 16
    m, base = _own_region(pages)
    me = os.getpid()
    s = PageFaultSampler(tracked)
    try:
        s.start()
        tracked.add_process(me)
        tracked.add_range(me, base, pages * 4096, 4096)
        for i in range(pages):
            ctypes.c_char.from_address(base + i * 4096).value       # read: zero page
        for i in range(pages):
            ctypes.c_char.from_address(base + i * 4096).value = b"x"  # write: COW from zero page
        rows = s.read_blocks()
    finally:
        s.close()
    assert len(rows) == pages
    assert rows["count"].tolist() == [2] * pages and rows["extra"].tolist() == [1] * pages
    assert s.last_writes.tolist() == [1] * pages
    del m


MADV_HUGEPAGE, MADV_NOHUGEPAGE = 14, 15


def _thp_and_small_regions(huge_pages: int):
    """Two regions of ``huge_pages`` × 2 MiB, 2 MiB-aligned: one advised MADV_HUGEPAGE, one
    MADV_NOHUGEPAGE (4 KiB pages only)."""
    H = pagefault.HPAGE_PMD_SIZE
    libc = ctypes.CDLL(None, use_errno=True)
    regions = []
    for advice in (MADV_HUGEPAGE, MADV_NOHUGEPAGE):
        m, base = _own_region(huge_pages * H // 4096, align=H)
        if libc.madvise(ctypes.c_void_p(base), ctypes.c_size_t(huge_pages * H), advice) != 0:
            pytest.skip(f"madvise({advice}) refused (THP disabled?)")
        regions.append((m, base))
    return regions


def test_first_touch_counts_base_pages_whatever_the_page_size(tracked):
    """Equal bytes touched, equal counts: one fault per 2 MiB on the THP region, 512 on the 4 KiB
    one, and both count 512 base pages per 2 MiB block (the raw fault counts, thp_accounting off,
    show the bias it removes)."""
    H = pagefault.HPAGE_PMD_SIZE
    (m1, thp), (m2, small) = _thp_and_small_regions(2)
    me = os.getpid()
    s = PageFaultSampler(tracked)
    raw = PageFaultSampler(tracked, thp_accounting=False)
    try:
        s.start()
        raw.start()
        tracked.add_process(me)
        tracked.add_range(me, thp, 2 * H, H)
        tracked.add_range(me, small, 2 * H, H)
        for base in (thp, small):
            for off in range(0, 2 * H, 4096):
                ctypes.c_char.from_address(base + off).value = b"t"
        if not pagefault.pmd_thp_at(me, np.array([thp, thp + H], np.uint64)).all():
            pytest.skip("the kernel did not back the region with THPs (fragmentation?)")
        rows, faults = s.read_blocks(), raw.read_blocks()
    finally:
        s.close()
        raw.close()
    got = {int(r["block_start"]): (int(r["count"]), int(r["block_len"])) for r in rows}
    assert got == {b: (512, H) for b in (thp, thp + H, small, small + H)}
    per_fault = {int(r["block_start"]): int(r["count"]) for r in faults}
    assert per_fault == {thp: 1, thp + H: 1, small: 512, small + H: 512}
    assert s.thp_rows == 2
    del m1, m2


def test_a_thp_fault_counts_for_every_block_of_the_huge_page(tracked):
    H = pagefault.HPAGE_PMD_SIZE
    (m, base), _ = _thp_and_small_regions(2)
    me = os.getpid()
    s = PageFaultSampler(tracked)
    try:
        s.start()
        tracked.add_process(me)
        tracked.add_range(me, base, 2 * H, 64 * 1024)
        for k in range(2):
            ctypes.c_char.from_address(base + k * H + 100 * 1024).value = b"t"
        if not pagefault.pmd_thp_at(me, np.array([base, base + H], np.uint64)).all():
            pytest.skip("the kernel did not back the region with THPs (fragmentation?)")
        rows = s.read_blocks()
    finally:
        s.close()
    # each fault unprotected (here: populated) its whole huge page: 16 base pages in each 64 KiB block
    assert sorted(rows["block_start"].tolist()) == [base + i * 65536 for i in range(2 * H // 65536)]
    assert set(rows["block_len"].tolist()) == {65536} and set(rows["count"].tolist()) == {16}
    assert s.thp_rows == 2
    del m


def _counts_per_pass(windows: list[int]) -> float:
    """Median of the windows that saw a scan pass (hint faults come in one burst per pass)."""
    seen = [w for w in windows if w]
    return float(np.median(seen)) if seen else 0.0


def test_hint_faults_on_thp_and_4k_memory_read_alike_count_alike(tracked, tmp_path):
    """NUMA balancing (mode 1, borrowed and put back) on two multi-threaded processes that read all
    of 4 × 2 MiB at the same rate, one THP-backed, one on 4 KiB pages: per scan pass the THP process
    takes one hint fault per block, the other 512, and both count 512 base pages per block. This
    machine has one NUMA node; the hint faults are the same (only migration needs a second node)."""
    from tieringd.kernel import knobs
    if knobs.resolve("kernel.numa_balancing")[0] is None:
        pytest.skip("no kernel.numa_balancing (CONFIG_NUMA_BALANCING off)")
    k = knobs.Knobs(tmp_path / "knobs.json")
    H = pagefault.HPAGE_PMD_SIZE
    loads = {}
    s = PageFaultSampler(tracked)
    raw = PageFaultSampler(tracked, thp_accounting=False)
    windows = {"thp": [], "4k": []}
    faults = {"thp": [], "4k": []}
    try:
        k.recover()
        for name, extra in (("thp", ["--thp"]), ("4k", [])):
            loads[name] = Workload("skewed_touch", "--mode", "read", "--idle-thread", "--blocks", "4",
                                   "--block-size", str(H), "--touches", "8", "--seconds", "40", *extra)
        first = loads["thp"].info["base"]
        if not pagefault.pmd_thp_at(loads["thp"].pid, np.arange(4, dtype=np.uint64) * np.uint64(H)
                                    + np.uint64(first)).all():
            pytest.skip("the kernel did not back the --thp workload with THPs")
        s.start()
        raw.start()
        for w in loads.values():
            _track_blocks(tracked, w)
        for w in loads.values():               # populated; every fault from here is a hint fault
            w.p.stdin.write("go\n")
            w.p.stdin.flush()
        k.borrow("kernel.numa_balancing", 1)
        for name in ("numa_balancing.scan_delay_ms", "numa_balancing.scan_period_min_ms"):
            k.borrow(name, 100)                 # debugfs: absent under lockdown, defaults then
        s.read_deltas()
        raw.read_deltas()
        for _ in range(30):
            time.sleep(1)
            rows, rrows = s.read_deltas(), raw.read_deltas()
            for name, w in loads.items():
                windows[name].append(int(rows["count"][rows["pid"] == w.pid].sum()))
                faults[name].append(int(rrows["count"][rrows["pid"] == w.pid].sum()))
            if all(sum(1 for x in v if x) >= 3 for v in windows.values()):
                break
    finally:
        k.restore()
        s.close()
        raw.close()
        for w in loads.values():
            w.p.kill()
            w.finish()
    assert all(sum(1 for x in v if x) >= 2 for v in windows.values()), windows
    thp, small = _counts_per_pass(windows["thp"]), _counts_per_pass(windows["4k"])
    assert 0.5 <= thp / small <= 2, windows            # base pages per pass: comparable
    assert _counts_per_pass(faults["4k"]) >= 64 * _counts_per_pass(faults["thp"]), faults


def test_dma_uprobes_record_the_host_pointers(tracked):
    w = Workload("dma_copy", "--copies", "12")
    s = DmaCopySampler(tracked, raw=True)
    seen = []
    try:
        tracked.add_process(w.pid)
        tracked.add_range(w.pid, w.info["base"], w.info["len"], w.info["block_size"])
        s.start()
        s.on_raw(seen.append)
        assert any("cudaMemcpyAsync" in syms for syms in s.attached.values())
        calls = [c for c in w.go() if not c.get("done")]
        deadline = time.monotonic() + 5
        while len(seen) < len(calls) and time.monotonic() < deadline:
            s.poll_raw(100)
        rows = s.read_blocks()
        stats = s.stats()
    finally:
        s.close()
        w.finish()
    got = [(e.addr, e.len, e.aux, e.tgid) for e in seen]
    want = [(c["host"], c["len"], dmacopy.DMA_DIR_WRITE if c["dir"] == "write" else dmacopy.DMA_DIR_READ,
             w.pid) for c in calls]
    assert got == want, "the exact pointers, sizes and directions the program passed"
    apis = [dmacopy.API_NAMES[e.kind] for e in seen]
    assert apis[:3] == ["cudaMemcpy*", "cudaMemcpy*", "cuMemcpyHtoD*"]
    # per block: one count per copy, extra = bytes of the copy inside the block
    bs, base = w.info["block_size"], w.info["base"]
    expect = {}
    for c in calls:
        b = base + (c["host"] - base) // bs * bs
        expect[b] = (expect.get(b, (0, 0))[0] + 1, expect.get(b, (0, 0))[1] + c["len"])
    assert {int(r["block_start"]): (int(r["count"]), int(r["extra"])) for r in rows} == expect
    assert stats["outside_ranges"] >= 1      # the "device" buffer is in no tracked range


def test_ring_buffer_fileno_and_callback_errors(tracked):
    w = Workload("skewed_touch", "--touches", "8", "--blocks", "4")
    s = PageFaultSampler(tracked, raw=True)
    calls = []

    def boom(ev):
        calls.append(ev)
        if len(calls) == 1:
            raise ValueError("callback failed on purpose")

    try:
        s.start()
        _track_blocks(tracked, w)
        s.on_raw(boom)
        fd = s.fileno()
        assert isinstance(fd, int) and fd >= 0
        w.go()
        r, _, _ = select.select([fd], [], [], 5)
        assert r == [fd], "the epoll fd becomes readable when samples wait"
        with pytest.raises(ValueError, match="on purpose"):
            s.poll_raw(0)
        while s.poll_raw(100):
            pass
    finally:
        s.close()
        w.finish()
    total = sum(w.info["touches"])
    assert len(calls) == total, "after the exception, polling resumes where it stopped"
    assert all(ev.tgid == w.pid for ev in calls)
    errcodes = {ev.kind & (pagefault.PF_ERR_USER | pagefault.PF_ERR_WRITE) for ev in calls}
    assert errcodes == {pagefault.PF_ERR_USER | pagefault.PF_ERR_WRITE}


def test_layout_mismatch_is_refused_at_open(tracked, monkeypatch):
    class Short(ctypes.Structure):
        _fields_ = [("count", ctypes.c_uint64)]
    monkeypatch.setattr("tieringd.sampling.base.BlockVal", Short)
    with pytest.raises(SamplerUnavailable, match="disagree"):
        PageFaultSampler(tracked).start()


def test_open_samplers_and_migration_counter(tracked):
    with open_samplers(tracked, sources=("fault", "pmu", "dma"), pmu_event="software-page-faults") as ss:
        assert ss.mode == "bpf"
        assert [s.name for s in ss.samplers] == ["pagefault", "pmusample", "dmacopy"]
        assert isinstance(ss.migrations, MigrationCounter)
        assert ss.read_deltas().dtype == ACCESS_DELTA_DTYPE
        assert isinstance(ss.migrations.read(), dict)
        assert "access sampling: bpf" in ss.describe()
