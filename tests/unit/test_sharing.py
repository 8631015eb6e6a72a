# SPDX-License-Identifier: Apache-2.0
"""Sharing from pagemap/kpagecount and KSM, on data captured from this machine.

tests/fixtures/sharing/capture.json comes from scripts/capture-sharing-fixture.py (root): two MAP_SHARED
pages, the first written by a forked child too (mapcount 2), the second not (1); two private pages,
the first touched (1), the second never (not present). Each test lays the raw entries out as a /proc
and /sys tree (sparse files at the kernel's offsets) and reads it through tieringd.kernel.sysfs.
"""
import json
import os

import numpy as np
import pytest

from tieringd.kernel import sysfs
from tieringd.placement import sharing
from tieringd.contracts import Tier
from tieringd.placement.heat import BlockTable, HeatConfig

# the brief's weights, which the heat assertion below works out by hand (the shipped defaults are tuned)
BRIEF = HeatConfig(weight_recency=0.30, weight_frequency=0.25, weight_position=0.25, weight_sharing=0.20,
                   sharing_half_life_gain=0.0)


@pytest.fixture(scope="module")
def capture(fixtures_dir):
    with open(fixtures_dir / "sharing" / "capture.json") as f:
        return json.load(f)


def write_u64(path, index: int, value: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "r+b" if path.exists() else "wb") as f:
        f.seek(index * 8)
        f.write(int(value).to_bytes(8, "little"))


def make_tree(root, cap, hide_pfns: bool = False):
    page = cap["page_size"]
    pid = cap["pid"]
    for name, addr in cap["addresses"].items():
        entry = int(cap["pagemap"][name], 16)
        if hide_pfns:                      # what a reader without CAP_SYS_ADMIN gets (4.0+): PFN zeroed
            entry &= ~((1 << 55) - 1)
        write_u64(root / f"proc/{pid}/pagemap", int(addr, 16) // page, entry)
    for pfn, count in cap["kpagecount"].items():
        write_u64(root / "proc/kpagecount", int(pfn), count)
    ksm = root / "sys/kernel/mm/ksm"
    ksm.mkdir(parents=True)
    for name, text in cap["ksm"].items():
        (ksm / name).write_text(text)
    if cap["ksm_stat"] is not None:
        (root / f"proc/{pid}/ksm_stat").write_text(cap["ksm_stat"])
    return pid


def addresses(cap):
    names = list(cap["addresses"])
    return names, np.array([int(cap["addresses"][n], 16) for n in names], np.uint64)


def test_mapcounts_from_kpagecount(tmp_path, capture):
    pid = make_tree(tmp_path, capture)
    names, addrs = addresses(capture)
    with sysfs.root(tmp_path):
        got = sharing.mapcounts(pid, addrs)
    assert dict(zip(names, got.tolist())) == capture["expect_mapcount"]


def test_mapcounts_without_pfns_fall_back_to_the_exclusive_bit(tmp_path, capture):
    pid = make_tree(tmp_path, capture, hide_pfns=True)
    names, addrs = addresses(capture)
    with sysfs.root(tmp_path):
        got = dict(zip(names, sharing.mapcounts(pid, addrs).tolist()))
    assert got == {"shared0": 2, "shared1": 1, "private0": 1, "private1": 0}


def test_block_sharers_feed_the_heat_table(tmp_path, capture):
    pid = make_tree(tmp_path, capture)
    page = capture["page_size"]
    start = int(capture["addresses"]["shared0"], 16)
    t = BlockTable(BRIEF)
    rid = t.add_region(pid=pid, start=start, length=2 * page, block_bytes=page, node=0, tier=Tier.DRAM)
    with sysfs.root(tmp_path):
        counts = sharing.block_sharers(pid, start, 2 * page, page)
        # one block of two pages: the larger mapcount of the two sampled pages
        assert sharing.block_sharers(pid, start, 2 * page, 2 * page, pages_per_block=2).tolist() == [2]
    assert counts.tolist() == [2, 1]
    sl = t.region_slice(rid)
    t.set_sharers(np.arange(sl.start, sl.stop), counts)
    assert t.sharers[:2].tolist() == [2, 1]
    h = t.compute_heat(10_000_000)
    assert h[0] == pytest.approx(0.2 * 0.5) and h[1] == pytest.approx(0.0, abs=1e-9)


def test_a_vanished_process_gives_none(tmp_path, capture):
    make_tree(tmp_path, capture)
    with sysfs.root(tmp_path):
        assert sharing.block_sharers(999_999_999, 0x1000, 4096, 4096) is None


def test_ksm_reports(tmp_path, capture):
    pid = make_tree(tmp_path, capture)
    with sysfs.root(tmp_path):
        st = sharing.ksm_status()
        proc = sharing.process_ksm(pid)
    assert st.run == int(capture["ksm"]["run"]) and st.pages_sharing == int(capture["ksm"]["pages_sharing"])
    assert st.saved_bytes == st.pages_sharing * capture["page_size"]
    if capture["ksm_stat"] is not None:
        assert proc.merging_pages == 0 and proc.mergeable is False
    with sysfs.root(tmp_path / "nothing"):
        assert sharing.ksm_status() is None and sharing.process_ksm(pid) is None


def test_fixture_is_from_a_real_capture(capture):
    # guard against hand edits: every present PFN has a kpagecount entry and the kernel is recorded
    assert capture["kernel"] and os.path.basename(capture["kernel"]) == capture["kernel"]
    for name, entry in capture["pagemap"].items():
        e = int(entry, 16)
        if e >> 63:
            assert str(e & ((1 << 55) - 1)) in capture["kpagecount"], name
