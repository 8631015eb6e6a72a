# SPDX-License-Identifier: Apache-2.0
"""Belady's MIN on a sequence worked by hand (that it bounds every policy is a property of
tests/unit/test_simulate_stream.py's random streams)."""
import math

from tieringd.contracts import Tier
from tieringd.simulate import policies
from tieringd.simulate.expand import spool_rows
from tieringd.simulate.layout import Layout
from tieringd.simulate.model import TransparentModel

MiB = 1 << 20


def test_belady_on_a_known_sequence():
    # capacity 2: a b c a b c …: MIN (with bypass) keeps a and b and never admits c
    seq = [0, 1, 2] * 6
    acc = spool_rows(range(1, len(seq) + 1), seq, [1] * len(seq), MiB, 1000.0)
    layout = Layout((Tier.DRAM, Tier.CXL_DRAM), (2, math.inf))
    model = TransparentModel(mover_bytes_s=1e12)
    belady, lru = (policies.make_run(name, acc, layout, model, record=True) for name in ("belady", "demand-lru"))
    policies.replay(acc, [belady, lru])
    assert lru.tally.hits == 0                       # LRU's classic worst case
    assert belady.tally.hits == 10                   # a and b in each of the 5 later rounds
    served = belady.tally.served_each
    assert (served[2::3] == 1).all() and (served[0::3] == 0).all()
