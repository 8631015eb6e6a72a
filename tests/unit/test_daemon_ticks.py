# SPDX-License-Identifier: Apache-2.0
"""Tick accounting (tieringd/daemon/ticks.py): an overrun is counted and the schedule moves on from
where the tick ended — missed ticks are never run back to back."""
from tieringd.daemon.ticks import PhaseTimer, TickClock, TickStats


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_ticks_run_on_their_interval():
    c = Clock()
    tc = TickClock(0.1, clock=c)
    assert tc.due_in() == 0
    start = c.t
    c.t += 0.02                                  # the tick took 20 ms
    assert tc.finished(start) is False
    assert abs(tc.due_in() - 0.08) < 1e-9        # next one 100 ms after this one started


def test_an_overrun_is_counted_and_not_queued():
    c = Clock()
    tc = TickClock(0.1, clock=c)
    start = c.t
    c.t += 0.35                                  # 3.5 intervals
    assert tc.finished(start) is True
    assert abs(tc.due_in() - 0.1) < 1e-9         # one interval after it ended, no catch-up burst
    start = c.t + tc.due_in()
    c.t = start + 0.01
    assert tc.finished(start) is False


def test_stats_count_overruns_and_give_percentiles():
    s = TickStats()
    for i in range(100):
        s.record(1000 + i, float(i + 1), {"apply": 0.5, "plan": float(i)}, overran=i >= 98)
    assert s.count == 100 and s.overruns == 2
    assert s.last_duration_ms == 100.0 and s.last_tick_ns == 1099
    assert 49 <= s.p50_ms <= 52 and 98 <= s.p99_ms <= 100
    d = s.to_dict()
    assert d["phase_total_ms"]["apply"] == 50.0 and d["overruns"] == 2


def test_phase_timer_adds_up_phases():
    t = PhaseTimer()
    with t("sample"):
        pass
    with t("sample"):
        pass
    assert set(t.phases) == {"sample"} and t.phases["sample"] >= 0
