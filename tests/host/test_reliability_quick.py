# SPDX-License-Identifier: Apache-2.0
"""The short form of ``make reliability`` (``--quick``), inside ``make test``: every part against a real
daemon on this machine, with fewer generated inputs. Each part's record must say it held: nothing
lost, no crash, every forbidden access refused. The seed each part used is in its record and in the
failure message, so that ``make reliability RELIABILITY_ARGS='--seed S'`` replays it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.root]

REPO = Path(__file__).resolve().parents[2]


def test_the_quick_suite_loses_nothing_crashes_nothing_and_refuses_every_forbidden_access(tmp_path):
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "reliability" / "run.py"), "--quick",
                        "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=1800)
    summary = json.loads((tmp_path / "summary.json").read_text())
    parts = {d["part"]: d for d in summary["parts"]}
    assert set(parts) == {"access", "fuzz-config", "fuzz-registry", "fuzz-control", "load", "kill-trials",
                          "faults"}, p.stdout
    # the kill trials (and the faults, in their boot) take a lab guest many minutes: the short form
    # skips them, and says so
    assert parts.pop("kill-trials")["skipped"] and parts.pop("faults")["skipped"], p.stdout
    for name, d in parts.items():
        where = f"{name} (seed {d.get('seed')}): {d.get('cases')} {d.get('notes')}\n{p.stdout[-2000:]}"
        assert not d["skipped"], where
        assert d["ok"] and d["exit"] == 0, where
        assert d["tried"] > 0 and d["bytes_lost"] == 0 and d["crashes"] == 0 and d["let_through"] == 0, where
    assert parts["access"]["refused"] >= 9, parts["access"]
    assert summary["ok"] and p.returncode == 0
