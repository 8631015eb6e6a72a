# SPDX-License-Identifier: Apache-2.0
"""The fault sampler's THP accounting (tieringd/sampling/pagefault.py): rows on a huge page become one
row for it, counts kept."""
from __future__ import annotations

import numpy as np

from tieringd.sampling import pagefault
from tieringd.sampling.base import BLOCK_ROWS_DTYPE


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
