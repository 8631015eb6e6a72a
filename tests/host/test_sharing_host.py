# SPDX-License-Identifier: Apache-2.0
"""Mapcount on the live system: a MAP_SHARED page written by a forked child is mapped twice."""
import ctypes
import mmap
import os

import numpy as np
import pytest

from tieringd.placement import sharing
from tieringd.contracts import Tier
from tieringd.placement.heat import BlockTable

pytestmark = pytest.mark.root


def test_shared_page_written_by_a_child_has_mapcount_two():
    page = mmap.PAGESIZE
    m = mmap.mmap(-1, 2 * page, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    m[:] = b"\x5a" * (2 * page)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    child = os.fork()
    if child == 0:                       # a write fault maps page 0 only (reads fault around)
        m[0:1] = b"\x5b"
        os.write(ready_w, b"x")
        os.read(done_r, 1)
        os._exit(0)
    try:
        os.read(ready_r, 1)
        counts = sharing.mapcounts(os.getpid(), np.array([addr, addr + page], np.uint64))
        t = BlockTable()
        rid = t.add_region(pid=os.getpid(), start=addr, length=2 * page, block_bytes=page, node=0,
                           tier=Tier.DRAM)
        sl = t.region_slice(rid)
        t.set_sharers(np.arange(sl.start, sl.stop), sharing.block_sharers(os.getpid(), addr, 2 * page, page))
    finally:
        os.write(done_w, b"x")
        os.waitpid(child, 0)
    assert counts.tolist() == [2, 1]
    assert t.sharers[:2].tolist() == [2, 1]
    # once the child is gone the page is mapped once
    assert sharing.mapcounts(os.getpid(), np.array([addr], np.uint64)).tolist() == [1]
    m.close()


def test_ksm_reports_match_the_kernel_files():
    st = sharing.ksm_status()
    if st is None:
        pytest.skip("kernel without KSM (CONFIG_KSM=n)")
    with open("/sys/kernel/mm/ksm/run") as f:
        assert st.run == int(f.read())
    me = sharing.process_ksm(os.getpid())
    assert me is not None and me.merging_pages >= 0
