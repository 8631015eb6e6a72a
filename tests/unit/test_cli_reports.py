# SPDX-License-Identifier: Apache-2.0
"""``tieringctl numa`` / ``tiers`` (and ``probe``'s input checks) on the captured sysfs trees."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tieringd.kernel import sysfs
from tieringd.cli import main

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "sysfs"
TREES = sorted(p for p in FIXTURES.iterdir() if p.is_dir())


def run(root, *args, config: Path | None = None):
    env = {"TIERINGD_CONFIG": str(config) if config else "/nonexistent-use-defaults"}
    with sysfs.root(root):
        # an explicit config path that does not exist is an error; point at an empty file instead
        return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


@pytest.fixture
def empty_config(tmp_path) -> Path:
    p = tmp_path / "tieringd.toml"
    p.write_text("")
    return p


def fixture_nodes(root: Path) -> dict[int, dict]:
    """Node facts read straight from the fixture files, independently of tieringd.memory.topology."""
    base = root / "sys/devices/system/node"
    out = {}
    for d in sorted(base.glob("node[0-9]*")):
        nid = int(d.name[4:])
        mem = {}
        for line in (d / "meminfo").read_text().splitlines():
            parts = line.split()
            mem[parts[2].rstrip(":")] = int(parts[3]) * 1024
        out[nid] = {"cpulist": (d / "cpulist").read_text().strip(),
                    "distance": [int(x) for x in (d / "distance").read_text().split()],
                    "MemTotal": mem["MemTotal"], "MemFree": mem["MemFree"]}
    return out


@pytest.mark.parametrize("root", TREES, ids=lambda p: p.name)
def test_numa_json_matches_the_tree(root, empty_config):
    r = run(root, "numa", "--json", config=empty_config)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["schema"] == "tieringd.numa/1"
    facts = fixture_nodes(root)
    assert [n["id"] for n in doc["nodes"]] == sorted(facts)
    for n in doc["nodes"]:
        f = facts[n["id"]]
        assert n["mem_total_bytes"] == f["MemTotal"]
        assert n["mem_free_bytes"] == f["MemFree"]
        assert sysfs.format_list(n["cpus"]) == f["cpulist"]
        assert [n["distances"][str(i)] for i in sorted(facts)] == f["distance"]
        assert n["tier"] in ("dram", "cxl-dram", "pmem") and n["evidence"]
        assert n["tier_rank"] in (1, 2, 3)


@pytest.mark.parametrize("root", TREES, ids=lambda p: p.name)
def test_numa_table_rows_and_distance_matrix(root, empty_config):
    r = run(root, "numa", config=empty_config)
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].split() == ["node", "tier", "cpus", "total", "free", "read-bw", "read-lat", "mem-tier"]
    facts = fixture_nodes(root)
    rows = lines[1:1 + len(facts)]
    assert [int(x.split()[0]) for x in rows] == sorted(facts)
    i = lines.index("node distances:")
    assert lines[i + 1].split() == ["node"] + [str(n) for n in sorted(facts)]
    for k, nid in enumerate(sorted(facts)):
        assert lines[i + 2 + k].split() == [f"{nid}:"] + [str(d) for d in facts[nid]["distance"]]
    assert "why:" in lines
    for nid in facts:
        assert any(x.startswith(f"  node{nid} ") for x in lines)


@pytest.mark.parametrize("root", TREES, ids=lambda p: p.name)
def test_tiers_add_up_to_the_nodes(root, empty_config):
    numa = json.loads(run(root, "numa", "--json", config=empty_config).output)
    r = run(root, "tiers", "--json", config=empty_config)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["schema"] == "tieringd.tiers/1"
    assert [t["tier"] for t in doc["tiers"]] == ["gpu-hbm", "dram", "cxl-dram", "pmem", "dax"]
    with_memory = [n for n in numa["nodes"] if n["mem_total_bytes"] > 0]
    assert sorted(i for t in doc["tiers"] for i in t["nodes"]) == sorted(n["id"] for n in with_memory)
    assert sum(t["mem_total_bytes"] for t in doc["tiers"] if t["tier"] != "gpu-hbm") == \
        sum(n["mem_total_bytes"] for n in with_memory)
    for t in doc["tiers"]:
        assert all(n["tier"] == t["tier"] for n in numa["nodes"] if n["id"] in t["nodes"])
    table = run(root, "tiers", config=empty_config).output.splitlines()
    assert table[0].split() == ["tier", "rank", "nodes", "total", "free", "also"]
    assert [x.split()[0] for x in table[1:6]] == ["gpu-hbm", "dram", "cxl-dram", "pmem", "dax"]


def test_config_override_is_marked(tmp_path):
    cfg = tmp_path / "tieringd.toml"
    cfg.write_text('[topology.nodes.0]\ntier = "pmem"\n')
    r = run(FIXTURES / "host-6.18", "numa", config=cfg)
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[1].split()[:2] == ["0", "pmem*"]
    assert "* tier set in the configuration file" in r.output
    assert "config override: tier = pmem (evidence said dram)" in r.output


@pytest.mark.parametrize("text, message", [
    ('[topology.nodes.0]\ntier = "ssd"\n', "unknown tier 'ssd'"),
    ("[topology\n", "tieringd.toml"),
])
def test_bad_config_is_one_line_not_a_traceback(tmp_path, text, message):
    cfg = tmp_path / "tieringd.toml"
    cfg.write_text(text)
    r = CliRunner().invoke(main, ["numa"], env={"TIERINGD_CONFIG": str(cfg)})
    assert r.exit_code == 1
    assert r.exception is None or isinstance(r.exception, SystemExit)
    assert "tieringctl: configuration:" in r.output and message in r.output
    assert "Traceback" not in r.output


def test_probe_refuses_a_captured_tree(empty_config):
    r = run(FIXTURES / "host-6.18", "probe", config=empty_config)
    assert r.exit_code == 1
    assert "probe measures this machine's memory" in r.output


def test_reports_on_an_empty_tree_state_the_reason(tmp_path, empty_config):
    """No /sys, no /proc (a minimal container): reports still come out, with the reason."""
    r = run(tmp_path, "numa", config=empty_config)
    assert r.exit_code == 0, r.output
    assert "notes:" in r.output and "CONFIG_NUMA" in r.output
    r = run(tmp_path, "tiers", "--json", config=empty_config)
    assert r.exit_code == 0 and json.loads(r.output)["notes"]
