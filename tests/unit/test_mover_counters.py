# SPDX-License-Identifier: Apache-2.0
"""Outcomes, counters and reports of the mover (tieringd/mover/counters.py)."""
import json

from tieringd.contracts import Priority
from tieringd.mover.counters import FAILURE_REASONS, Counters, Outcome, PairCounters, Report


def test_outcomes_go_to_their_own_field_or_to_failed_pages():
    c = PairCounters()
    for outcome in Outcome:
        c.count(outcome, 1)
    assert (c.moved_pages, c.already_pages, c.landed_elsewhere_pages, c.fallback_pages) == (1, 1, 1, 1)
    assert set(c.failed_pages) == set(FAILURE_REASONS) and all(o.failed for o in FAILURE_REASONS)
    assert not Outcome.MOVED.failed and not Outcome.FALLBACK.failed


def test_by_reason_adds_up_and_fallback_pages_are_not_also_target_full():
    rep = Report(7, 1, Priority.DEMOTE, requested_pages=10)
    c = Counters()
    c.pairs[(0, 1)].requested_pages = 10
    c.pairs[(0, 1)].count(Outcome.MOVED, 3)
    c.pairs[(0, 1)].count(Outcome.TARGET_FULL, 7)        # 7 found node 1 full ...
    c.pairs[(0, 1)].count(Outcome.FALLBACK, 5)           # ... 5 of them went to node 2
    c.pairs[(0, 2)].count(Outcome.MOVED, 5)
    rep.counters.merge(c)
    assert rep.by_reason() == {"moved": 3, "fallback": 5, "target-full": 2}
    assert rep.moved_pages == 8                          # what pgmigrate_success would count


def test_reports_serialise_with_plain_string_keys():
    rep = Report(7, 1, Priority.PROMOTE, requested_pages=2)
    rep.counters.pairs[(0, 1)].count(Outcome.PINNED, 2)
    rep.samples[Outcome.PINNED] = [0x1000]
    d = json.loads(json.dumps(rep.to_dict()))
    assert d["by_reason"] == {"pinned": 2} and d["samples"] == {"pinned": ["0x1000"]}
    assert d["counters"]["pairs"][0]["failed_pages"] == {"pinned": 2}
    assert all(type(k) is str for k in rep.to_dict()["by_reason"])
    assert len(rep.landed()) == 0
