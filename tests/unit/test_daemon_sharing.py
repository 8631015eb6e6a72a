# SPDX-License-Identifier: Apache-2.0
"""The sharing scan (tieringd/daemon/sharing.py): each registered block's sharers from what the host
shows, a budget of pages per tick.

Against the real /proc of this process (cheap: a few MiB): pages a forked child maps too, blocks with
the same bytes in two regions (found by hash, counted only once compared byte for byte), a block
that changes or turns to zeros, a region that goes, a process that left. Then pure logic on a
/proc tree laid out by hand (sparse files at the kernel's offsets, read through
tieringd.kernel.sysfs): kpagecount, KSM frames, filler and the zero page, a block examined over two
ticks, hidden PFNs. As root and not: without CAP_SYS_ADMIN the PFNs read as 0 and a page mapped
twice counts as 2 (a lower bound), which is what the forked child gives anyway.
"""
import ctypes
import mmap
import os
import time

import numpy as np
import pytest

from tieringd import config
from tieringd.contracts import Tier
from tieringd.daemon.sharing import SharingConfig, SharingScanner
from tieringd.kernel import procfs, sysfs
from tieringd.placement.heat import BlockTable, HeatConfig
from tieringd.settings import Settings

PAGE = mmap.PAGESIZE
BLOCK = 16 * PAGE


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def address(m: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


def anonymous(nbytes: int, shared: bool = False) -> mmap.mmap:
    flags = (mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE) | mmap.MAP_ANONYMOUS
    return mmap.mmap(-1, nbytes, flags=flags)


def region(t: BlockTable, m: mmap.mmap, pid: int | None = None, block: int = BLOCK) -> slice:
    rid = t.add_region(pid=pid or os.getpid(), start=address(m), length=len(m), block_bytes=block,
                       node=0, tier=Tier.DRAM)
    return t.region_slice(rid)


def scanner(t: BlockTable, clock=None, **cfg) -> SharingScanner:
    base = dict(pages_per_tick=1 << 20, hash_pages_per_tick=1 << 20, cold_after_s=0.0)
    return SharingScanner(SharingConfig(**{**base, **cfg}), t, clock=clock or Clock())


def run(s: SharingScanner, ticks: int = 4) -> None:
    for _ in range(ticks):
        s.tick()


@pytest.fixture
def child_mapping():
    """A MAP_SHARED region of 4 blocks whose every page a forked child has written (mapped twice)."""
    m = anonymous(4 * BLOCK, shared=True)
    m.write(os.urandom(4 * BLOCK))
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:                                 # a write fault maps exactly the page written
        for off in range(0, len(m), PAGE):
            m[off] = m[off]
        os.write(ready_w, b"x")
        os.read(done_r, 1)
        os._exit(0)
    os.read(ready_r, 1)
    yield m
    os.write(done_w, b"x")
    os.waitpid(pid, 0)
    for fd in (ready_r, ready_w, done_r, done_w):
        os.close(fd)


# ---- the real /proc of this process ----------------------------------------------------------------

def test_pages_a_forked_child_maps_too_have_two_sharers_private_ones_one(child_mapping):
    private = anonymous(4 * BLOCK)
    private.write(os.urandom(4 * BLOCK))
    t = BlockTable()
    shared_rows, private_rows = region(t, child_mapping), region(t, private)
    s = scanner(t, hash_pages_per_tick=0)
    s.tick()
    assert t.sharers[shared_rows].tolist() == [2, 2, 2, 2]
    assert t.sharers[private_rows].tolist() == [1, 1, 1, 1]
    st = s.status()
    assert st["shared_blocks"] == 4 and st["enabled"] and not st["content"]
    # the heat's static part follows: a shared block is forgotten more slowly
    assert t.static[shared_rows.start] != t.static[private_rows.start]


def test_a_tick_examines_its_budget_of_pages_and_goes_on_where_it_stopped(child_mapping):
    t = BlockTable()
    rows = region(t, child_mapping)
    s = scanner(t, pages_per_tick=24, hash_pages_per_tick=0)       # a block and a half per tick
    s.tick()
    assert s.pages_examined == 24 and t.sharers[rows].tolist() == [2, 1, 1, 1]
    s.tick()
    assert s.pages_examined == 48 and t.sharers[rows].tolist() == [2, 2, 2, 1]
    run(s, 2)
    assert t.sharers[rows].tolist() == [2, 2, 2, 2]
    assert s.passes == 1 and s.status()["pages_examined_per_tick"] <= 24


def test_blocks_with_the_same_bytes_in_two_regions_count_each_other():
    a, b = anonymous(3 * BLOCK), anonymous(3 * BLOCK)
    twin = os.urandom(BLOCK)
    a.write(twin + os.urandom(BLOCK) + bytes(BLOCK))
    b.write(os.urandom(BLOCK) + twin + bytes(BLOCK))
    t = BlockTable()
    ra, rb = region(t, a), region(t, b)
    clock = Clock()
    s = scanner(t, clock=clock)
    run(s, 3)
    assert t.sharers[ra].tolist() == [2, 1, 1] and t.sharers[rb].tolist() == [1, 2, 1]
    assert s.status()["identical_blocks"] == 2          # the blocks of zeros are no KV: not counted
    read = s.pages_read
    run(s, 3)
    assert s.pages_read == read                         # the next pass is a second away
    # one of the two changes: at the next pass it leaves the group, and the other is alone again
    b[BLOCK + 7] ^= 0xFF
    clock.t += 1
    run(s, 3)
    assert t.sharers[ra].tolist() == [1, 1, 1] and t.sharers[rb].tolist() == [1, 1, 1]
    assert s.status()["identical_blocks"] == 0


def test_a_hash_alone_never_counts():
    """Every block hashes alike here: only the blocks whose bytes are equal are counted."""
    a, b = anonymous(2 * BLOCK), anonymous(2 * BLOCK)
    twin = os.urandom(BLOCK)
    a.write(twin + os.urandom(BLOCK))
    b.write(os.urandom(BLOCK) + twin)

    class Constant:
        def __init__(self, data=b""):
            pass

        def update(self, data):
            pass

        def digest(self):
            return b"\x01" * 8
    t = BlockTable()
    ra, rb = region(t, a), region(t, b)
    s = SharingScanner(SharingConfig(hash_pages_per_tick=1 << 20, cold_after_s=0.0), t, clock=Clock(),
                       digest=Constant)
    run(s, 4)
    assert t.sharers[ra].tolist() == [2, 1] and t.sharers[rb].tolist() == [1, 2]
    assert s.status()["mismatches"] > 0


def test_a_region_that_goes_takes_its_copies_with_it():
    a, b = anonymous(BLOCK), anonymous(BLOCK)
    twin = os.urandom(BLOCK)
    a.write(twin)
    b.write(twin)
    t = BlockTable()
    ra, _ = region(t, a), region(t, b)
    s = scanner(t)
    run(s, 3)
    assert t.sharers[ra].tolist() == [2]
    t.remove_region(t.region_id((os.getpid(), address(b))))
    s.tick()
    assert t.sharers[ra].tolist() == [1] and s.status()["identical_blocks"] == 0


def test_only_cold_blocks_fully_present_for_cold_after_s_are_read():
    a, b = anonymous(2 * BLOCK), anonymous(2 * BLOCK)
    twin = os.urandom(BLOCK)
    a.write(twin + os.urandom(BLOCK))
    b.write(twin)                               # b's second block is never touched: not present
    t = BlockTable()
    ra, rb = region(t, a), region(t, b)
    clock = Clock()
    s = scanner(t, clock=clock, cold_after_s=10.0)
    run(s, 3)
    assert s.pages_read == 0                     # present for less than 10 s: not read yet
    clock.t += 11
    t.ingest_blocks(np.array([ra.start]), np.array([1.0]), t.ms(time.monotonic_ns()))   # a's block 0: read now
    run(s, 3)
    assert t.sharers[ra].tolist() == [1, 1] and t.sharers[rb].tolist() == [1, 1]
    assert procfs.present(procfs.read_pagemap(os.getpid(), address(b) + BLOCK, 16)).sum() == 0
    assert s.pages_read == 16 * 2               # a's block 1 and b's block 0; never b's absent block


def test_a_process_that_left_is_passed_over(child_mapping):
    gone = os.fork()
    if gone == 0:
        os._exit(0)
    os.waitpid(gone, 0)
    t = BlockTable()
    t.add_region(pid=gone, start=0x7f0000000000, length=4 * BLOCK, block_bytes=BLOCK, node=0, tier=Tier.DRAM)
    rows = region(t, child_mapping)
    s = scanner(t)
    run(s, 2)
    assert t.sharers[rows].tolist() == [2, 2, 2, 2] and s.status()["regions_left"] == 1


def test_turned_off_every_block_goes_back_to_one_sharer(child_mapping):
    t = BlockTable()
    rows = region(t, child_mapping)
    cfg = [SharingConfig(hash_pages_per_tick=0)]
    s = SharingScanner(lambda: cfg[0], t, clock=Clock())
    s.tick()
    assert t.sharers[rows].tolist() == [2, 2, 2, 2]
    cfg[0] = SharingConfig(enabled=False)
    s.tick()
    assert t.sharers[rows].tolist() == [1, 1, 1, 1] and not s.status()["enabled"]


# ---- a /proc tree laid out by hand --------------------------------------------------------------------

PID = 4242
START = 0x7F12_3450_0000
PRESENT, EXCLUSIVE = 1 << 63, 1 << 56
KSM, ZERO = 1 << 21, 1 << 24


def write_u64(path, index: int, value: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "r+b" if path.exists() else "wb") as f:
        f.seek(index * 8)
        f.write(int(value).to_bytes(8, "little"))


def lay_out(root, pages: dict[int, tuple[int, bool]], frames: dict[int, tuple[int, int]]) -> None:
    """``pages``: page index → (PFN, exclusive); ``frames``: PFN → (mapcount, kpageflags)."""
    for i, (pfn, excl) in pages.items():
        write_u64(root / f"proc/{PID}/pagemap", (START >> procfs.PAGE_SHIFT) + i,
                  PRESENT | (EXCLUSIVE if excl else 0) | pfn)
    for pfn, (count, flags) in frames.items():
        write_u64(root / "proc/kpagecount", pfn, count)
        write_u64(root / "proc/kpageflags", pfn, flags)


def table_of(nblocks: int, pages_per_block: int) -> BlockTable:
    t = BlockTable(HeatConfig())
    t.add_region(pid=PID, start=START, length=nblocks * pages_per_block * PAGE,
                 block_bytes=pages_per_block * PAGE, node=0, tier=Tier.DRAM)
    return t


def test_mappings_ksm_filler_and_the_zero_page(tmp_path):
    """Block 0: mapped 3 times. 1: KSM frames with 5 mappings. 2: every page one KSM frame (a
    block of zeros merged): filler. 3: the zero page. 4: exclusive pages. 5: non-exclusive with the
    PFN hidden (a reader without CAP_SYS_ADMIN): 2. 6: nothing present."""
    ppb = 4
    pages, frames = {}, {}
    for k in range(ppb):
        pages[0 * ppb + k] = (1000 + k, False)
        frames[1000 + k] = (3, 0)
        pages[1 * ppb + k] = (2000 + k, False)
        frames[2000 + k] = (5, KSM)
        pages[2 * ppb + k] = (3000, False)
        pages[3 * ppb + k] = (4000, False)
        pages[4 * ppb + k] = (5000 + k, True)
        frames[5000 + k] = (1, 0)
        pages[5 * ppb + k] = (0, False)
    frames[3000] = (ppb, KSM)
    frames[4000] = (0, ZERO)
    lay_out(tmp_path, pages, frames)
    t = table_of(7, ppb)
    with sysfs.root(tmp_path):
        s = scanner(t, hash_pages_per_tick=0)
        s.tick()
    assert t.sharers[:7].tolist() == [3, 5, 1, 1, 1, 2, 1]
    st = s.status()
    assert st["ksm_blocks"] == 1 and st["shared_blocks"] == 3


def test_a_block_larger_than_the_budget_is_examined_over_ticks(tmp_path):
    """8 pages a block, 3 pages a tick: the shared page is in the block's last third."""
    pages = {i: (100 + i, True) for i in range(16)}
    pages[7] = (500, False)
    frames = {100 + i: (1, 0) for i in range(16)}
    frames[500] = (4, 0)
    lay_out(tmp_path, pages, frames)
    t = table_of(2, 8)
    with sysfs.root(tmp_path):
        s = scanner(t, pages_per_tick=3, hash_pages_per_tick=0)
        run(s, 2)
        assert t.sharers[:2].tolist() == [1, 1]
        s.tick()
        assert t.sharers[:2].tolist() == [4, 1]
        run(s, 3)
    assert t.sharers[:2].tolist() == [4, 1] and s.passes == 1


def test_a_table_region_added_later_is_scanned_too(tmp_path):
    lay_out(tmp_path, {i: (100 + i, False) for i in range(8)}, {100 + i: (2, 0) for i in range(8)})
    t = BlockTable()
    with sysfs.root(tmp_path):
        s = scanner(t, hash_pages_per_tick=0)
        s.tick()                                    # nothing registered yet: nothing to do
        t.add_region(pid=PID, start=START, length=8 * PAGE, block_bytes=4 * PAGE, node=0, tier=Tier.DRAM)
        s.tick()
    assert t.sharers[:2].tolist() == [2, 2]


def test_the_sharing_table_is_checked(tmp_path):
    p = tmp_path / "tieringd.toml"
    p.write_text("[sharing]\npages_per_tick = 0\n")
    with pytest.raises(config.ConfigError, match=r"tieringd.toml:2: \[sharing\] pages_per_tick"):
        Settings.from_config(config.load(str(p)))
    p.write_text("[sharing]\nhash_pages_per_tick = 0\ncold_after_s = 5\n")
    s = Settings.from_config(config.load(str(p))).sharing
    assert s.enabled and s.hash_pages_per_tick == 0 and s.cold_after_s == 5.0


# ---- aliases: rows that map the same memory ------------------------------------------------------------

def test_the_rows_of_memory_two_processes_map_share_one_heat_and_one_place():
    """The same memfd pages in this process and a forked child, registered by both: two rows per
    block. A read the child's row saw, and a move the child's row made, are the parent row's too."""
    fd = os.memfd_create("tieringd-kv")
    os.ftruncate(fd, 4 * BLOCK)
    m = mmap.mmap(fd, 4 * BLOCK, flags=mmap.MAP_SHARED)
    os.close(fd)
    m.write(os.urandom(4 * BLOCK))
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    child = os.fork()
    if child == 0:
        for off in range(0, len(m), PAGE):
            m[off] = m[off]
        os.write(ready_w, b"x")
        os.read(done_r, 1)
        os._exit(0)
    try:
        os.read(ready_r, 1)
        private = anonymous(2 * BLOCK)
        private.write(os.urandom(2 * BLOCK))
        t = BlockTable()
        mine, theirs = region(t, m), region(t, m, pid=child)
        alone = region(t, private)
        s = scanner(t, hash_pages_per_tick=0)
        s.tick()
        assert t.sharers[mine].tolist() == [2] * 4 == t.sharers[theirs].tolist()
        now = t.ms(time.monotonic_ns())
        t.ingest_blocks(np.array([theirs.start + 1]), np.array([1.0]), now)
        t.set_location(np.array([theirs.start + 2]), 1, int(Tier.CXL_DRAM), now_ms=now)   # moved, verified
        s.tick()
        st = s.status()
        assert st["alias_groups"] == 4 and st["alias_rows"] == 8 and st["alias_rows_placed"] == 1
        assert t.last_ms[mine.start + 1] == t.last_ms[theirs.start + 1] == now
        assert t.node[mine.start + 2] == 1 and t.tier[mine.start + 2] == int(Tier.CXL_DRAM)
        assert t.moved_ms[mine.start + 2] == now
        assert t.last_ms[alone].tolist() == [0, 0] and t.node[alone].tolist() == [0, 0]
        # the child's region goes: nothing is aliased any more
        t.remove_region(t.region_id((child, address(m))))
        s.tick()
        assert s.status()["alias_rows"] == 0
    finally:
        os.write(done_w, b"x")
        os.waitpid(child, 0)
        for fd in (ready_r, ready_w, done_r, done_w):
            os.close(fd)


def test_a_region_not_yet_scanned_goes_before_the_rest_of_a_pass(tmp_path):
    lay_out(tmp_path, {i: (100 + i, False) for i in range(64)}, {100 + i: (2, 0) for i in range(64)})
    write_u64(tmp_path / "proc/7/pagemap", 0x1000_0000 >> procfs.PAGE_SHIFT, 0)
    t = BlockTable()
    # a big region of another process first in order (1 GiB, nothing present: 16,384 ticks a pass)
    t.add_region(pid=7, start=0x1000_0000, length=1 << 30, block_bytes=1 << 20, node=0, tier=Tier.DRAM)
    cfg = [SharingConfig(pages_per_tick=300_000, hash_pages_per_tick=0)]
    with sysfs.root(tmp_path):
        s = SharingScanner(lambda: cfg[0], t, clock=Clock())
        s.tick()                                    # a first pass over it
        cfg[0] = SharingConfig(pages_per_tick=16, hash_pages_per_tick=0)
        t.add_region(pid=PID, start=START, length=64 * PAGE, block_bytes=16 * PAGE, node=0, tier=Tier.DRAM)
        run(s, 4)
    rows = t.region_slice(t.region_id((PID, START)))
    assert t.sharers[rows].tolist() == [2, 2, 2, 2] and s.status()["regions_left"] == 0


def test_aliases_whose_anchors_all_went_away_leave_no_group_and_no_error():
    # a fork's child shared the pool's pages, then exec'd: the scan writes its anchors back to 0
    from tieringd.daemon.aliases import Aliases
    from tieringd.contracts import RegionKey
    t = BlockTable()
    t.add_region(pid=4242, start=0x7f0000000000, length=4 * BLOCK, block_bytes=BLOCK, node=0, tier=Tier.DRAM)
    from tieringd.daemon import aliases
    now = [1000.0]
    a = Aliases(t, clock=lambda: now[0])
    key = RegionKey(4242, 0x7f0000000000)
    a.note(key, 4, np.arange(4), np.array([7, 7, 0, 0], np.uint64))
    a.apply()
    assert a.groups == 1
    a.note(key, 4, np.arange(4), np.zeros(4, np.uint64))
    now[0] += aliases.REBUILD_S + 1
    a.apply()
    assert (a.groups, len(a.rows)) == (0, 0)
