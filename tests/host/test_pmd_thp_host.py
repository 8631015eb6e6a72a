# SPDX-License-Identifier: Apache-2.0
"""Which 2 MiB chunks of a process a PMD-mapped THP maps, on this machine's kernel: the fault sampler
counts a hint fault there as 512 base pages (tieringd/sampling/pagefault.py). Where the kernel has
PAGEMAP_SCAN (6.7+) one walk of the page tables tells it, and agrees with the pagemap + kpageflags
reading on every chunk but one whose PMD was split (an mprotect of one page of it): the scan sees a
PTE mapping there, the frames still look like one THP."""
from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

from tieringd.kernel import procfs
from tieringd.sampling import pagefault

from test_bpf_samplers import _thp_and_small_regions

pytestmark = pytest.mark.root          # kpageflags and PFNs in pagemap need CAP_SYS_ADMIN

H = pagefault.HPAGE_PMD_SIZE
PROT_READ = 1


def test_the_scan_tells_pmd_mapped_chunks_as_the_page_flags_do_and_a_split_one_apart():
    (m1, thp), (m2, small) = _thp_and_small_regions(4)
    for base in (thp, small):
        for off in range(0, 4 * H, 4096):
            ctypes.c_char.from_address(base + off).value = b"x"
    me = os.getpid()
    chunks = np.array([thp + i * H for i in range(4)] + [small + i * H for i in range(4)], np.uint64)
    by_flags = pagefault._pmd_thp_by_flags(me, chunks)
    if not by_flags[:4].any():
        pytest.skip("no THP was given to the advised region (memory fragmented?)")
    if procfs.pmd_mapped_ranges(me, thp, thp + H) is None:
        pytest.skip(f"no PAGEMAP_SCAN on {os.uname().release} (6.7+)")
    assert pagefault.pmd_thp_at(me, chunks).tolist() == by_flags.tolist()
    assert not by_flags[4:].any()
    # a chunk 1 TiB away (nothing mapped there) is asked in a walk of its own, and is no THP
    far = np.uint64(thp - (1 << 40) if thp > (1 << 41) else thp + (1 << 40))
    assert pagefault.pmd_thp_at(me, np.r_[chunks, far]).tolist() == by_flags.tolist() + [False]
    split = next(i for i in range(4) if by_flags[i])
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mprotect(ctypes.c_void_p(thp + split * H), ctypes.c_size_t(4096), PROT_READ) == 0
    scanned = pagefault.pmd_thp_at(me, chunks)
    assert not scanned[split] and pagefault._pmd_thp_by_flags(me, chunks)[split]
    assert scanned.tolist() == [v and i != split for i, v in enumerate(by_flags.tolist())]
    del m1, m2
