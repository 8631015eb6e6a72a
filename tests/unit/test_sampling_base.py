# SPDX-License-Identifier: Apache-2.0
"""The common sampler part (tieringd/sampling/base.py): per-block rows become access deltas."""
from __future__ import annotations

import numpy as np

from tieringd.contracts import ACCESS_DELTA_DTYPE, SampleSource
from tieringd.sampling.base import BLOCK_ROWS_DTYPE, to_deltas


def test_to_deltas_saturates_and_tags_source():
    rows = np.array([(1, 0x1000, 1 << 33, 1 << 40, 7, 0)], BLOCK_ROWS_DTYPE)
    d = to_deltas(rows, SampleSource.DMA)
    assert d.dtype == ACCESS_DELTA_DTYPE
    assert d["count"][0] == 2**32 - 1 and d["block_len"][0] == 2**32 - 1
    assert d["source"][0] == SampleSource.DMA and d["last_seen_ns"][0] == 7
