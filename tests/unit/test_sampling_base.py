# SPDX-License-Identifier: Apache-2.0
"""The common sampler part (tieringd/sampling/base.py): per-block rows become access deltas."""
from __future__ import annotations

import numpy as np

from tieringd.contracts import ACCESS_DELTA_DTYPE, SampleSource
from tieringd.sampling import SamplerSet, TrackedSet
from tieringd.sampling.base import BLOCK_ROWS_DTYPE, Sampler, to_deltas


def test_to_deltas_saturates_and_tags_source():
    rows = np.array([(1, 0x1000, 1 << 33, 1 << 40, 7, 0)], BLOCK_ROWS_DTYPE)
    d = to_deltas(rows, SampleSource.DMA)
    assert d.dtype == ACCESS_DELTA_DTYPE
    assert d["count"][0] == 2**32 - 1 and d["block_len"][0] == 2**32 - 1
    assert d["source"][0] == SampleSource.DMA and d["last_seen_ns"][0] == 7


class _Rows(Sampler):
    """A source handing out fixed rows (and, when it tells writes, their write counts)."""

    def __init__(self, n, writes=None):
        self.rows = np.zeros(n, ACCESS_DELTA_DTYPE)
        self.writes = writes
        self.tells_writes = writes is not None

    def start(self):
        pass

    def read_deltas(self):
        self.last_writes = None if self.writes is None else np.asarray(self.writes, np.uint32)
        return self.rows


def test_a_sampler_set_lines_the_write_counts_up_with_its_rows():
    ss = SamplerSet(TrackedSet(), [_Rows(2), _Rows(3, [0, 4, 1]), _Rows(1)], {})
    assert ss.tells_writes
    assert len(ss.read_deltas()) == 6
    assert ss.last_writes.tolist() == [0, 0, 0, 4, 1, 0]
    assert not SamplerSet(TrackedSet(), [_Rows(2)], {}).tells_writes
    empty = SamplerSet(TrackedSet(), [], {})
    assert len(empty.read_deltas()) == 0 and len(empty.last_writes) == 0
