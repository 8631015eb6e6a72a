# SPDX-License-Identifier: Apache-2.0
"""The closed-loop figures (scripts/lab/loop_report.py, scripts/bench/p5_loop.py) from a loop.json
captured in a lab guest (6.12, sized cxl, one 40 s scattered run; trimmed to the fields they read)."""
import importlib.util
import json
import sys

import pytest


@pytest.fixture(scope="module")
def mods(repo):
    sys.path.insert(0, str(repo / "scripts" / "lab"))
    spec = importlib.util.spec_from_file_location("p5_loop", repo / "scripts" / "bench" / "p5_loop.py")
    p5 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(p5)
    import loop_report
    return loop_report, p5


@pytest.fixture(scope="module")
def loop(repo):
    return json.loads((repo / "tests" / "fixtures" / "loop" / "lab-6.12-scattered-40s.json").read_text())


def test_a_run_row_counts_what_happened_during_the_run(mods, loop):
    loop_report, _ = mods
    row = loop_report.run_row(loop["runs"][0])
    assert row["share_mean_2nd_half"] == pytest.approx(0.751, abs=1e-3)
    assert row["share_min_2nd_half"] == pytest.approx(0.698, abs=1e-3)
    assert row["share_first"] == pytest.approx(0.6538)
    assert row["bytes_intact"] is True
    # the daemon's counters at the run's end less those at its start
    assert (row["promoted_mib"], row["demoted_mib"]) == (28.0, 44.0)
    assert (row["ticks"], row["overruns"]) == (322, 97)
    assert row["failed_pages"] == {}


def test_the_timeline_has_a_row_per_report_with_cumulative_moves(mods, loop):
    loop_report, _ = mods
    rows = loop_report.timeline_rows(loop["runs"][0])
    assert len(rows) == len(loop["runs"][0]["reports"])
    promoted = [x["promoted_mib"] for x in rows]
    assert promoted == sorted(promoted) and promoted[0] == 0.0 and promoted[-1] > 0
    text = loop_report.ascii_timeline(loop["runs"][0])
    assert text.count("\n") == len(rows) and "0.654" in text


def test_p5_rows_and_summary(mods, loop):
    _, p5 = mods
    rows = p5.rows_of(loop, "6.12")
    assert len(rows) == 1 and len(rows[0]) == len(p5.COLUMNS)
    assert rows[0][:3] == ["6.12", "tieringd", "scattered"]
    s = p5.summarise(rows)
    assert s == {"6.12/tieringd/scattered": {"runs": 1, "mean": 0.751, "min_run": 0.751, "intact": True}}
    baseline = dict(loop, daemon_ready_s=None)
    assert p5.rows_of(baseline, "6.12")[0][1] == "none"
