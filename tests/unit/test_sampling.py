# SPDX-License-Identifier: Apache-2.0
"""Sampler logic that needs neither root nor BPF: the .h ↔ Python struct mirrors, LPM prefixes, the
tracked set's validation, THP widening, perf event encoding, ELF symbols, config, and the
accessed-bit fallbacks: DAMON against the sysfs tree captured in the 6.12 lab guest; the PMU format
files and the idle-page bitmap are built in tmp_path from the documented formats (no PMU, no idle
page tracking on any machine here to capture them from)."""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tieringd import _sysfs
from tieringd.config import ConfigError
from tieringd.contracts import ACCESS_DELTA_DTYPE, SampleSource
from tieringd.sampling import SamplingConfig, _damon_sysfs, _elf, _perf, accessed, migrations, pagefault
from tieringd.sampling import tracking as tr
from tieringd.sampling.base import BLOCK_ROWS_DTYPE, to_deltas

REPO = Path(__file__).resolve().parents[2]
BPF = REPO / "bpf"

_C_TYPES = {"__u8": 1, "__u16": 2, "__u32": 4, "__u64": 8, "__s32": 4, "__s64": 8}


def c_struct_fields(header: Path, name: str) -> list[tuple[str, int]]:
    """(field, size) of ``struct name`` in a bpf/*.h header (fixed-width types only, by design)."""
    text = header.read_text()
    m = re.search(r"struct\s+" + name + r"\s*\{(.*?)\};", text, re.S)
    assert m, f"struct {name} not in {header.name}"
    body = re.sub(r"/\*.*?\*/", "", m.group(1), flags=re.S)
    fields = []
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        ctype, field = decl.split()
        fields.append((field, _C_TYPES[ctype]))
    return fields


@pytest.mark.parametrize("header,cname,pytype", [
    ("tracking.h", "tracked_pid", tr.TrackedPid),
    ("tracking.h", "range_key", tr.RangeKey),
    ("tracking.h", "range_val", tr.RangeVal),
    ("tracking.h", "block_key", tr.BlockKey),
    ("tracking.h", "block_val", tr.BlockVal),
    ("tracking.h", "control", tr.Control),
    ("tracking.h", "sample_event", tr.SampleEvent),
    ("migrations.h", "migrate_stat", migrations.MigrateStat),
])
def test_python_mirrors_match_the_headers(header, cname, pytype):
    c = c_struct_fields(BPF / header, cname)
    py = [(n, ctypes.sizeof(t)) for n, t in pytype._fields_]
    assert py == c
    assert ctypes.sizeof(pytype) == sum(s for _, s in c)


def test_stat_names_match_the_header():
    # the #define constants are compiled and compared in test_sampling_headers.py
    text = (BPF / "tracking.h").read_text()
    stats = re.search(r"enum tracking_stat \{(.*?)\};", text, re.S).group(1)
    names = [n.lower().removeprefix("stat_") for n in re.findall(r"^\s*(STAT_\w+)", stats, re.M)]
    assert names[:-1] == tr.STAT_NAMES and names[-1] == "_max"
    assert np.dtype(tr.BLOCK_KEY_DTYPE).itemsize == ctypes.sizeof(tr.BlockKey)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, (1 << 56) - 1), st.integers(1, 1 << 40))
def test_range_prefixes_cover_exactly(start, length):
    end = min(start + length, 1 << 56)
    prefixes = tr.range_prefixes(start, end)
    assert len(prefixes) <= 2 * 64
    pos = start
    for addr, bits in prefixes:
        size = 1 << (64 - bits)
        assert addr == pos and addr % size == 0
        pos += size
    assert pos == end


def test_range_prefixes_page_aligned_is_small():
    assert tr.range_prefixes(0x7f0000000000, 0x7f0000000000 + (1 << 30)) == [(0x7f0000000000, 34)]
    assert tr.range_prefixes(0x1000, 0x6000) == [(0x1000, 52), (0x2000, 51), (0x4000, 51)]


def test_range_key_is_big_endian_bytes():
    k = tr.range_key(0x01020304, 0x1122334455667788, 48)
    raw = bytes(k)
    assert raw[:4] == (32 + 48).to_bytes(4, "little")
    assert raw[4:8] == bytes([1, 2, 3, 4])
    assert raw[8:] == bytes.fromhex("1122334455667788")


def test_tracked_set_validates_and_finds():
    t = tr.TrackedSet()
    with pytest.raises(tr.TrackingError, match="positive integer"):
        t.add_process(0)
    with pytest.raises(tr.TrackingError, match="power of two"):
        t.add_process(10, default_block_len=3000)
    with pytest.raises(tr.TrackingError, match="not tracked"):
        t.add_range(10, 0x1000, 0x1000, 0x1000)
    t.add_process(10)
    r = t.add_range(10, 0x100000, 0x40000, 0x10000)
    with pytest.raises(tr.TrackingError, match="overlaps"):
        t.add_range(10, 0x130000, 0x20000, 0x10000)
    with pytest.raises(tr.TrackingError, match="not a user address"):
        t.add_range(10, (1 << 56) - 0x1000, 0x2000, 0x1000)
    with pytest.raises(tr.TrackingError, match="does not fit"):
        t.add_range(10, 0x200000, 0x1000, 0x2000)
    with pytest.raises(tr.TrackingError, match="non-negative integer"):
        t.add_range(10, -1, 0x1000, 0x1000)
    t.add_range(10, 0x140000, 0x1000, 0x1000)        # adjacent is fine
    assert t.find_range(10, 0x13ffff) == r
    assert t.find_range(10, 0x140000).start == 0x140000
    assert t.find_range(10, 0x141000) is None
    gen = t.generation
    assert t.remove_range(10, 0x100000) and t.generation > gen
    assert t.find_range(10, 0x100000) is None
    t.remove_process(10)
    assert 10 not in t and t.pids() == []


def _rows(*rows):
    return np.array(list(rows), BLOCK_ROWS_DTYPE)


def test_widen_thp_rows_merges_per_huge_page(monkeypatch):
    H = pagefault.HPAGE_PMD_SIZE
    base = 0x7f0000000000
    rows = _rows((5, base, 65536, 3, 100, 1), (5, base + 65536, 65536, 2, 300, 0),
                 (5, base + H, 65536, 1, 50, 1), (6, base, 65536, 7, 10, 0),
                 (5, base + 4 * H, 4 * H, 9, 10, 0))
    # pid 5's first huge page is THP-backed, the second is not; pid 6's is
    monkeypatch.setattr(pagefault, "thp_backed",
                        lambda pid, addrs: np.array([pid == 6 or a < base + H for a in addrs]))
    out, n = pagefault.widen_thp_rows(rows)
    assert n == 3
    got = {(int(r["pid"]), int(r["block_start"])): r for r in out}
    hp = got[(5, base)]
    assert hp["block_len"] == H and hp["count"] == 5 and hp["extra"] == 1 and hp["last_seen_ns"] == 300
    assert got[(5, base + H)]["block_len"] == 65536
    assert got[(6, base)]["block_len"] == H and got[(6, base)]["count"] == 7
    assert got[(5, base + 4 * H)]["block_len"] == 4 * H     # blocks ≥ 2 MiB are left alone
    assert int(out["count"].sum()) == int(rows["count"].sum())


def test_to_deltas_saturates_and_tags_source():
    rows = _rows((1, 0x1000, 1 << 33, 1 << 40, 7, 0))
    d = to_deltas(rows, SampleSource.DMA)
    assert d.dtype == ACCESS_DELTA_DTYPE
    assert d["count"][0] == 2**32 - 1 and d["block_len"][0] == 2**32 - 1
    assert d["source"][0] == SampleSource.DMA and d["last_seen_ns"][0] == 7


def _pmu_tree(root: Path, pmus: dict[str, dict]) -> None:
    for name, spec in pmus.items():
        d = root / "sys/bus/event_source/devices" / name
        (d / "format").mkdir(parents=True)
        (d / "events").mkdir()
        (d / "type").write_text(f"{spec['type']}\n")
        for k, v in spec.get("format", {}).items():
            (d / "format" / k).write_text(v + "\n")
        for k, v in spec.get("events", {}).items():
            (d / "events" / k).write_text(v + "\n")


def test_perf_event_choice_from_sysfs(tmp_path):
    intel = {"cpu": {"type": 4, "format": {"event": "config:0-7", "umask": "config:8-15",
                                           "ldlat": "config1:0-15"},
                     "events": {"mem-loads": "event=0xcd,umask=0x1,ldlat=3"}}}
    _pmu_tree(tmp_path / "intel", intel)
    with _sysfs.root(tmp_path / "intel"):
        ev = _perf.resolve_event("auto")
        assert ev.name == "intel-mem-loads" and ev.hardware
        assert ev.attr.type == 4 and ev.attr.config == 0x1cd and ev.attr.config1 == 30
        assert ev.attr.sample_type & _perf.PERF_SAMPLE_ADDR
        assert (ev.attr.flags >> _perf.ATTR_PRECISE_SHIFT) & 3 == 2
    _pmu_tree(tmp_path / "amd", {"ibs_op": {"type": 11, "format": {"cnt_ctl": "config:19"}}})
    with _sysfs.root(tmp_path / "amd"):
        assert _perf.resolve_event("auto").name == "amd-ibs-op"
        assert _perf.resolve_event("auto").attr.type == 11
    _pmu_tree(tmp_path / "vm", {"software": {"type": 1}})
    with _sysfs.root(tmp_path / "vm"):
        with pytest.raises(OSError, match="no data-address PMU.*VM without vPMU"):
            _perf.resolve_event("auto")
        sw = _perf.resolve_event("software-page-faults")
        assert sw.attr.type == _perf.PERF_TYPE_SOFTWARE and sw.attr.sample_period == 1
    with pytest.raises(ValueError, match="unknown PMU event"):
        _perf.resolve_event("nonsense")


def test_encode_split_bitfields(tmp_path):
    _pmu_tree(tmp_path, {"x": {"type": 9, "format": {"ev": "config:0-7,32-35", "f": "config2:3"}}})
    with _sysfs.root(tmp_path):
        enc = _perf.encode_sysfs_event("x", "ev=0x1ab,f")
    assert enc["config"] == 0xab | (0x1 << 32) and enc["config2"] == 1 << 3


def test_elf_offsets_match_readelf(repo):
    lib = repo / "build/tests/libfakecudart.so"
    if not lib.exists():
        pytest.skip("build/tests/libfakecudart.so is not built (make)")
    offs = _elf.function_offsets(lib, {"cudaMemcpyAsync", "cuMemcpyHtoD_v2", "nope"})
    assert set(offs) == {"cudaMemcpyAsync", "cuMemcpyHtoD_v2"}
    # cross-check with binutils: symbol value → file offset through the program headers
    syms = subprocess.run(["readelf", "-W", "--dyn-syms", str(lib)], capture_output=True, text=True,
                          check=True).stdout
    value = {ln.split()[7]: int(ln.split()[1], 16) for ln in syms.splitlines()
             if len(ln.split()) >= 8 and ln.split()[3] == "FUNC"}
    phdrs = subprocess.run(["readelf", "-W", "-l", str(lib)], capture_output=True, text=True,
                           check=True).stdout
    # LOAD  Offset VirtAddr PhysAddr FileSiz MemSiz Flg Align
    loads = [(int(f[1], 16), int(f[2], 16), int(f[4], 16))
             for f in (ln.split() for ln in phdrs.splitlines()) if f[:1] == ["LOAD"]]
    for sym, off in offs.items():
        v = value[sym]
        (poff, vaddr, _filesz), = [(o, va, fs) for o, va, fs in loads if va <= v < va + fs]
        assert off == v - vaddr + poff
    assert _elf.function_offsets(lib, {"definitely_not_there"}) == {}
    with pytest.raises(_elf.ElfError):
        _elf.function_offsets(repo / "README.md")


def test_sampling_config_from_the_table():
    cfg = SamplingConfig.from_config({"sources": ["fault", "dma"], "pmu_event": "software-page-faults",
                                      "blocks_max": 4096})
    assert (cfg.sources, cfg.pmu_event, cfg.blocks_max) == (("fault", "dma"), "software-page-faults", 4096)
    assert SamplingConfig.from_config({}) == SamplingConfig() and SamplingConfig().sources == ("fault", "pmu", "dma")
    for bad, msg in [({"sourcez": []}, r"\[sampling\] sourcez: unknown key"),
                     ({"sources": ["x"]}, r"sources: expected a list of fault, pmu, dma, got \["),
                     ({"blocks_max": "1"}, "blocks_max: expected an integer"),
                     ({"raw": 1}, "raw: expected true or false"),
                     ({"fallback": "maybe"}, "fallback: expected auto or none or damon or idle-page"),
                     ({"pmu_event": "pebs"}, "pmu_event: expected auto or amd-ibs-op"),
                     ({"blocks_max": 0}, "blocks_max: expected a positive integer, got 0")]:
        with pytest.raises(ConfigError, match=msg):
            SamplingConfig.from_config(bad)


def test_migrate_reason_names_from_format(tmp_path):
    fmt = tmp_path / "sys/kernel/tracing/events/migrate/mm_migrate_pages"
    fmt.mkdir(parents=True)
    (fmt / "format").write_text(
        'print fmt: "nr=%lu reason=%s", REC->succeeded, __print_symbolic(REC->reason, '
        '{0, "compaction"}, {5, "numa_misplaced"}, {11, "future_reason"})\n')
    with _sysfs.root(tmp_path):
        names = migrations.reason_names()
    assert names[5] == "numa_misplaced" and names[11] == "future_reason" and names[8] == "demotion"
    with _sysfs.root(tmp_path / "none"):
        assert migrations.reason_names() == migrations.DEFAULT_REASONS


# ---- accessed-bit fallbacks against fake trees

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


DAMON_612 = REPO / "tests/fixtures/damon/6.12"


def _damon_tree(root: Path) -> tuple[Path, int, int]:
    """The captured 6.12 DAMON sysfs tree (tests/fixtures/damon/6.12/README), writable, as the kernel
    shows it once nr_kdamonds=1 and nr_contexts=1 were written; (admin dir, pid, base)."""
    admin = root / "sys/kernel/mm/damon/admin"
    shutil.copytree(DAMON_612 / "admin", admin)
    (admin / "kdamonds/nr_kdamonds").write_text("0\n")
    (root / "proc").mkdir(exist_ok=True)
    pid, base = map(int, (DAMON_612 / "WORKLOAD").read_text().split())
    return admin, pid, base


def test_damon_sampler_writes_only_files_the_kernel_has(tmp_path, monkeypatch):
    admin, pid, base = _damon_tree(tmp_path)
    before = {p.relative_to(admin) for p in admin.rglob("*") if p.is_file()}
    monkeypatch.setattr(accessed, "kernel_config", lambda: None)
    t = tr.TrackedSet()
    t.add_process(pid)
    t.add_range(pid, base, 8 << 20, 1 << 20)
    with _sysfs.root(tmp_path):
        s = accessed.DamonSampler(t)
        s.start()
        after = {p.relative_to(admin) for p in admin.rglob("*") if p.is_file()}
        assert after == before, "the sampler wrote a file the 6.12 DAMON sysfs does not have"
        ctx = admin / "kdamonds/0/contexts/0"
        assert (ctx / "operations").read_text() == "fvaddr"      # avail_operations lists it
        assert (ctx / "targets/0/pid_target").read_text() == str(pid)
        assert (ctx / "targets/0/regions/0/start").read_text() == str(base)
        assert (ctx / "targets/0/regions/0/end").read_text() == str(base + (8 << 20))
        assert (ctx / "schemes/0/action").read_text() == "stat"
        assert (ctx / "schemes/0/access_pattern/sz/max").read_text() == str(2**64 - 1)
        assert (admin / "kdamonds/0/state").read_text() == "on"
        (admin / "kdamonds/0/state").write_text("on")
        regions = s.regions(0)
        d = s.read_deltas()
    assert (admin / "kdamonds/0/state").read_text() == "update_schemes_tried_regions"
    # the captured regions tile the range and were all idle at capture time: no rows
    assert len(regions) == 11 and all(nr == 0 for _, _, nr in regions)
    assert min(r[0] for r in regions) == base and max(r[1] for r in regions) == base + (8 << 20)
    assert d.dtype == ACCESS_DELTA_DTYPE and len(d) == 0


def test_damon_refuses_a_kdamond_someone_else_configured(tmp_path):
    admin, _, _ = _damon_tree(tmp_path)
    (admin / "kdamonds/nr_kdamonds").write_text("1\n")
    (admin / "kdamonds/0/state").write_text("on\n")
    with _sysfs.root(tmp_path):
        ok, why = _damon_sysfs.status()
        assert not ok and "in use by another tool" in why and "1 running" in why
        with pytest.raises(accessed.SamplerUnavailable, match="in use by another tool"):
            accessed.DamonSampler(tr.TrackedSet()).start()
    assert (admin / "kdamonds/nr_kdamonds").read_text() == "1\n"   # untouched


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
    with _sysfs.root(tmp_path):
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
