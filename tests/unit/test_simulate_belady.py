# SPDX-License-Identifier: Apache-2.0
"""Belady's MIN bounds every policy's hit rate (hypothesis, small traces so it runs in seconds)."""
import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tieringd.contracts import Tier
from tieringd.placement.heat import HeatConfig
from tieringd.placement.policy import PolicyConfig
from tieringd.simulate.expand import _finish
from tieringd.simulate.layout import Layout
from tieringd.simulate.model import TransparentModel
from tieringd.simulate.policies import POLICIES, run_policy

MiB = 1 << 20


def accesses(pairs, counts):
    w = np.array([p[0] for p in pairs])
    b = np.array([p[1] for p in pairs])
    n = len(pairs)
    return _finish(np.cumsum(w), b, np.array(counts[:n], float), np.linspace(0, 1, n), np.ones(n),
                   np.arange(n), MiB, 1000.0, "hypothesis")


@settings(max_examples=60, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(0, 1), st.integers(0, 9)), min_size=1, max_size=80),
       counts=st.lists(st.integers(1, 30), min_size=80, max_size=80),
       cap=st.integers(0, 6), pmem=st.booleans(), hysteresis=st.sampled_from([0.0, 0.05]))
def test_belady_hit_rate_is_at_least_every_policys(pairs, counts, cap, pmem, hysteresis):
    acc = accesses(pairs, counts)
    layout = Layout((Tier.DRAM, Tier.CXL_DRAM, Tier.PMEM), (cap, 2, math.inf)) if pmem else \
        Layout((Tier.DRAM, Tier.CXL_DRAM), (cap, math.inf))
    cfg = PolicyConfig(hysteresis=hysteresis, min_residency_ms=0)
    model = TransparentModel(mover_bytes_s=64 * MiB)            # 64 MiB per 1 s tick
    hits = {name: int(run_policy(name, acc, layout, model, HeatConfig(), cfg).hit.sum()) for name in POLICIES}
    for name, h in hits.items():
        assert hits["belady"] >= h, (name, hits)


def test_belady_on_a_known_sequence():
    # capacity 2: a b c a b c …: MIN (with bypass) keeps a and b and never admits c
    seq = [0, 1, 2] * 6
    acc = accesses([(1, b) for b in seq], [1] * len(seq))
    layout = Layout((Tier.DRAM, Tier.CXL_DRAM), (2, math.inf))
    model = TransparentModel(mover_bytes_s=1e12)
    belady = run_policy("belady", acc, layout, model)
    lru = run_policy("demand-lru", acc, layout, model)
    assert lru.hit.sum() == 0                      # LRU's classic worst case
    assert belady.hit.sum() == 10                  # a and b in each of the 5 later rounds
    assert (belady.served[2::3] == 1).all() and (belady.served[0::3] == 0).all()
