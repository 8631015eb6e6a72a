# SPDX-License-Identifier: Apache-2.0
"""tieringctl tune: the split, the search, and the TOML snippet the daemon reads."""
import json
import random
import subprocess
import sys
import tomllib

import pytest
from click.testing import CliRunner

from tieringd import config
from tieringd.simulate import tune
from tieringd.cli import main
from tieringd.placement.heat import HeatConfig
from tieringd.placement.policy import PolicyConfig
from tieringd.simulate import traces


@pytest.fixture(scope="module")
def trace(repo, tmp_path_factory):
    out = tmp_path_factory.mktemp("tune") / "mc.jsonl"
    subprocess.run([sys.executable, str(repo / "scripts" / "gen-trace.py"), "--format", "mooncake", "--requests",
                    "120", "--seed", "4", "-o", str(out)], check=True)
    return out


def test_the_split_holds_out_the_last_requests_by_arrival(trace):
    whole = traces.read(str(trace))
    a, b = tune.split(whole, 0.25)
    assert len(a.requests) == 90 and len(b.requests) == 30
    assert max(r.arrival_ms for r in a.requests) <= whole.requests[90].arrival_ms
    assert b.requests[0].arrival_ms == 0          # the held-out part starts its own clock
    with pytest.raises(ValueError):
        tune.split(whole, 1.0)


def test_settings_round_trip_through_their_knobs():
    base = tune.Setting(HeatConfig(), PolicyConfig())
    again = tune.Setting.from_knobs(base.knobs(), base.policy)
    assert again.heat == base.heat
    assert again.policy.thresholds == base.policy.thresholds
    assert again.policy.low_watermark == pytest.approx(base.policy.low_watermark)


def test_the_search_moves_the_sharing_gain_and_the_snippet_carries_it():
    """The gain is a knob like the weights: drawn, kept through from_knobs, written for the daemon."""
    base = tune.Setting(HeatConfig(), PolicyConfig())
    k = {**base.knobs(), "sharing_half_life_gain": 2.0}
    s = tune.Setting.from_knobs(k, base.policy)
    assert s.heat.sharing_half_life_gain == 2.0
    heat = config.from_table(HeatConfig, "heat", tomllib.loads(tune.toml_snippet(s, "t", 1e9))["heat"])
    assert heat.sharing_half_life_gain == 2.0
    rng = random.Random(3)
    drawn = {tune._draw(rng)["sharing_half_life_gain"] for _ in range(60)}
    assert len(drawn) > 2 and 0.0 in drawn


def test_the_search_moves_the_lag_quantile_and_the_snippet_carries_it():
    base = tune.Setting(HeatConfig(), PolicyConfig())
    s = tune.Setting.from_knobs({**base.knobs(), "lag_quantile": 0.75}, base.policy)
    heat = config.from_table(HeatConfig, "heat", tomllib.loads(tune.toml_snippet(s, "t", 1e9))["heat"])
    assert heat.lag_quantile == 0.75
    rng = random.Random(3)
    assert {tune._draw(rng)["lag_quantile"] for _ in range(60)} == {0.0, 0.75, 0.9}


def test_cli_tunes_validates_and_writes_a_snippet_the_config_accepts(trace, tmp_path):
    out = tmp_path / "tuned.toml"
    res = CliRunner().invoke(main, ["tune", str(trace), "--trials", "2", "--validate-fraction", "0.3",
                                    "-o", str(out), "--json", "--no-progress"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["schema"] == "tieringd.tune/1" and doc["trials"] == 3
    assert doc["split"].startswith("tuned on requests 1–84") and "85–120" in doc["split"]
    assert doc["score"]["tune"]["best"] >= doc["score"]["tune"]["defaults"]
    refs = {r["policy"] for r in doc["results"]["held_out"]["references"]}
    assert refs == {"lru", "arc", "belady"}
    for part in ("tune", "held_out"):
        bound = {r["fast_capacity_fraction"]: r for r in doc["results"][part]["references"] if r["policy"] == "belady"}
        for r in doc["results"][part]["best"]:
            assert r["hit_rate"] <= bound[r["fast_capacity_fraction"]]["hit_rate"] + 1e-12
    tables = tomllib.loads(out.read_text())
    heat = config.from_table(HeatConfig, "heat", tables["heat"])
    pol = config.from_table(PolicyConfig, "policy", tables["policy"])
    assert heat.weights == pytest.approx(tuple(doc["best"][k] for k in (
        "weight_recency", "weight_frequency", "weight_position", "weight_sharing")), rel=1e-3)
    assert pol.high_watermark == pytest.approx(doc["best"]["high_watermark"], abs=1e-3)


def test_cli_prints_the_comparison(trace):
    res = CliRunner().invoke(main, ["tune", str(trace), "--trials", "1", "-o", "-", "--no-progress",
                                    "--fast-capacity", "10%"])
    assert res.exit_code == 0, res.output
    assert "held out: requests 85–120" in res.output
    for label in ("tieringd (best)", "tieringd (defaults)", " lru ", " arc ", "belady (bound)"):
        assert label in res.output
    assert "[heat]" in res.output and "[policy]" in res.output
