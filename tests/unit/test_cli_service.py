# SPDX-License-Identifier: Apache-2.0
"""``tieringctl status/top/regions/heatmap/stats/policy`` and ``migrate`` through the daemon, against a
running loop (tests/unit/daemon_standin.py) whose block table holds a region on two nodes of the
captured cxl-6.12 topology; and the error when no daemon runs."""
import json
import tomllib
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from daemon_standin import BLOCK_BYTES, StandInDaemon
from tieringd import settings
from tieringd.cli import main
from tieringd.cli import policy as cli_policy
from tieringd.config import ConfigFile
from tieringd.contracts import Tier
from tieringd.service.service import Service

MiB = 1 << 20
PID = 424242


@pytest.fixture
def run_dir(tmp_path):
    cfg = ConfigFile({"lifecycle": {"source": "poll"}})
    d = StandInDaemon(cfg, run_dir=str(tmp_path))
    t = d.table
    rid = t.add_region(PID, 0x7f0000000000, 16 * BLOCK_BYTES, BLOCK_BYTES, node=0, tier=Tier.DRAM)
    first = int(t.r_first[rid])
    t.set_location(np.arange(first + 8, first + 16), 1, int(Tier.CXL_DRAM))
    t.heat[first:first + 16] = np.linspace(1, 0, 16)
    t.set_sharers(np.arange(first, first + 3), np.array([4, 2, 2]))     # what the sharing scan writes
    d.moves_by_pid[PID] = {"promoted_bytes": 0, "demoted_bytes": 0}
    svc = Service(d, cfg, settings.check(cfg), run_dir=str(tmp_path)).start()
    d.start_thread()
    yield str(tmp_path)
    d.stop_thread()
    svc.stop()


def ctl(*args):
    r = CliRunner().invoke(main, list(args))
    assert "Traceback" not in r.output, r.output
    return r


def test_status_text_and_json(run_dir):
    r = ctl("status", "--run-dir", run_dir)
    assert r.exit_code == 0, r.output
    assert "access signal: hint faults" in r.output and "process lifecycle: /proc polling" in r.output
    assert "cxl-dram" in r.output and "systemd: not run by systemd" in r.output
    doc = json.loads(ctl("status", "--run-dir", run_dir, "--json").output)
    assert doc["schema"] == "tieringd.status/1" and doc["managed_bytes_by_tier"]["cxl-dram"] == 16 * MiB


def test_top_json_frames_carry_bytes_per_tier_and_rates_after_the_first(run_dir):
    r = ctl("top", "--run-dir", run_dir, "--json", "-n", "2", "-d", "0.1")
    assert r.exit_code == 0, r.output
    frames = [json.loads(line) for line in r.output.splitlines()]
    assert [f["schema"] for f in frames] == ["tieringd.top/1"] * 2
    (p,) = frames[0]["processes"]
    assert p["bytes_by_tier"]["dram"] == 16 * MiB and p["bytes_by_tier"]["cxl-dram"] == 16 * MiB
    assert p["moved_bytes_per_s"] is None and frames[1]["processes"][0]["moved_bytes_per_s"] == 0


def test_top_batch_output_is_plain_text_frames(run_dir):
    r = ctl("top", "--run-dir", run_dir, "-b", "-n", "2", "-d", "0.1")
    assert r.exit_code == 0 and "\033[" not in r.output
    assert r.output.count("tieringd top - ") == 2
    assert "HEAT>=0.8" in r.output and str(PID) in r.output and "50%" in r.output
    assert "SHARED" in r.output and " 3/4 " in r.output      # 3 shared blocks, the most shared has 4
    (p,) = json.loads(ctl("top", "--run-dir", run_dir, "--json").output)["processes"]
    assert p["shared_blocks"] == 3 and p["max_sharers"] == 4


def test_stats_lists_every_node_and_the_kernel_counters(run_dir):
    r = ctl("stats", "--run-dir", run_dir)
    assert r.exit_code == 0, r.output
    assert "cxl-dram" in r.output and "pgmigrate_success" in r.output
    doc = json.loads(ctl("stats", "--run-dir", run_dir, "--json").output)
    assert doc["schema"] == "tieringd.stats/1" and [n["node"] for n in doc["nodes"]] == [0, 1]
    assert doc["managed_bytes_by_tier"]["dram"] == 16 * MiB


def test_the_sharing_scan_in_one_status_line():
    from tieringd.cli.status import sharing_text
    sh = {"enabled": True, "content": True, "pages_per_tick": 8192, "hash_pages_per_tick": 128,
          "pages_examined_per_tick": 8192.0, "ms_per_tick": 0.61, "ms_per_tick_max": 2.3,
          "last_pass_s": 4.2, "shared_blocks": 96, "ksm_blocks": 0, "identical_blocks": 2}
    assert sharing_text(sh) == ("sharing: 8192 of 8192 pages/tick, content 128 pages/tick, 0.61 ms/tick "
                                "(max 2.3), a pass over every block in 4.2 s; 96 shared blocks, 0 with "
                                "KSM pages, 2 identical")
    assert sharing_text({**sh, "enabled": False}) == "sharing: off ([sharing] enabled = false)"
    assert sharing_text(None) == "sharing: not reported"


def test_regions_render_the_shared_blocks_and_the_most_sharers():
    from tieringd.cli.regions import render
    region = {"pid": 7, "start": 0x7f0000000000, "length": 8 << 20, "blocks": 4, "block_bytes": 2 << 20,
              "bytes_by_node": {"0": 8 << 20}, "policy": "bind", "flags": ["inherited"], "tag": "",
              "age_s": 3.0, "shared_blocks": 4, "max_sharers": 3}
    text = render({"regions": [region, {**region, "pid": 8, "shared_blocks": 0, "max_sharers": 1}],
                   "pid": None})
    header, first, second = text.splitlines()[:3]
    assert "SHARED" in header and " 4/3 " in first and " - " in second


def test_regions_says_how_to_get_some_when_there_are_none(run_dir):
    r = ctl("regions", "--run-dir", run_dir)
    assert r.exit_code == 0 and "tieringctl run" in r.output
    assert json.loads(ctl("regions", "--run-dir", run_dir, "--json", "--pid", "7").output)["regions"] == []


def test_heatmap_renders_the_terminal_the_json_and_a_png(run_dir, tmp_path):
    png = tmp_path / "heat.png"
    r = ctl("heatmap", "--run-dir", run_dir, "--pid", str(PID), "--seconds", "0.3", "--interval", "0.1",
            "--png", str(png), "--width", "16")
    assert r.exit_code == 0, r.output
    rows = [line for line in r.output.splitlines() if line.strip().endswith("%") and "|" in line]
    assert len(rows) >= 2 and all(len(row.split("|")[1]) == 16 for row in rows)
    assert rows[0].split("|")[1][0] == "@" and rows[0].split("|")[1][-1] == " "    # hot first, cold last
    assert "fast  50%" in rows[0]
    assert "sharers at the end (3 shared blocks, at most 4;" in r.output
    assert r.output.splitlines()[-2].split("|")[1] == "422" + " " * 13      # the line under that heading
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    doc = json.loads(ctl("heatmap", "--run-dir", run_dir, "--pid", str(PID), "--seconds", "0",
                         "--json").output)
    assert doc["schema"] == "tieringd.heatmap/1" and len(doc["blocks"]["address"]) == 16
    assert doc["heat"][0][0] == 1.0 and doc["node"][0][-1] == 1
    assert doc["blocks"]["sharers"] == [4, 2, 2] + [1] * 13


def test_heatmap_of_an_unknown_pid_says_where_to_look(run_dir):
    r = ctl("heatmap", "--run-dir", run_dir, "--pid", "1", "--seconds", "0")
    assert r.exit_code == 1 and "tieringctl regions" in r.output


def test_policy_get_set_and_a_refused_value(run_dir):
    out = ctl("policy", "--run-dir", run_dir).output
    assert "interval_ms = 100.0" in out
    # every line is TOML a user can paste into tieringd.toml (heat.x = … reads back as [heat] x)
    back = tomllib.loads("\n".join(line for line in out.splitlines() if not line.startswith("#")))
    assert back["fill"] == "rank" and back["mover"]["detect_thp"] is True and back["quotas"] == {}
    r = ctl("policy", "set", "interval_ms=50", "heat.half_life_s=2", "--run-dir", run_dir)
    assert r.exit_code == 0 and "interval_ms = 50.0" in r.output and "heat.half_life_s" in r.output
    assert ctl("policy", "get", "interval_ms", "--run-dir", run_dir).output.strip() == "interval_ms = 50.0"
    r = ctl("policy", "set", "mover.workers=many", "--run-dir", run_dir)
    assert r.exit_code == 1
    assert r.output.strip() == 'tieringctl: policy-set: [mover] workers: expected an integer, got "many"'
    assert ctl("policy", "set", "oops", "--run-dir", run_dir).exit_code == 1


def test_policy_values_are_toml_or_bare_words():
    assert cli_policy.parse_assignments(("a=1", "b=0.5", 'c="4M"', "d=[0.8, 0.5]", "e=fast", "f=true")) == \
        {"a": 1, "b": 0.5, "c": "4M", "d": [0.8, 0.5], "e": "fast", "f": True}


def test_migrate_goes_through_the_daemon_when_it_runs(run_dir):
    child = subprocess.Popen([sys.executable, "-c", "import mmap, ctypes, sys; m = mmap.mmap(-1, 1 << 20); "
                              "m.write(b'x' * (1 << 20)); print(hex(ctypes.addressof(ctypes.c_char.from_buffer(m))),"
                              " flush=True); sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        addr = child.stdout.readline().strip()
        r = ctl("migrate", "--run-dir", run_dir, "--pid", str(child.pid), "--range", f"{addr}+1M", "--to", "0",
                "--json")
        assert r.exit_code == 0, r.output
        doc = json.loads(r.output[r.output.index("{"):])
        assert doc["schema"] == "tieringd.migrate/1" and doc["request"]["via"] == "daemon"
        assert doc["report"]["by_reason"] == {"already-there": 256}
        r = ctl("migrate", "--run-dir", run_dir, "--pid", str(child.pid), "--range", f"{addr}+1M", "--to", "0",
                "--rate", "10")
        assert r.exit_code == 1 and "add --local" in r.output
    finally:
        child.communicate("")


@pytest.mark.parametrize("cmd", [["status"], ["top", "-n", "1"], ["regions"], ["heatmap", "--pid", "1"],
                                 ["stats"], ["policy"]])
def test_every_report_says_what_to_do_when_no_daemon_runs(cmd, tmp_path):
    r = ctl(*cmd, "--run-dir", str(tmp_path))
    assert r.exit_code == 1
    assert r.output.startswith("tieringctl: the tieringd daemon is not running") and \
        "systemctl start tieringd" in r.output


def test_a_daemon_report_loads_only_its_own_subcommand(tmp_path):
    """``tieringctl status`` with no daemon: the error, and none of the other subcommands' weight
    (simulator, samplers, topology discovery) imported — every report pays the imports it runs."""
    code = ("import sys\nfrom tieringd.cli import main\n"
            "try:\n    main(['status', '--run-dir', sys.argv[1]])\nexcept SystemExit as e:\n"
            "    heavy = [m for m in ('tieringd.simulate', 'tieringd.sampling', 'tieringd.memory.topology',"
            " 'tieringd.cli.sample') if m in sys.modules]\n    print(e.code, heavy)\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert r.stdout.strip() == "1 []", (r.stdout, r.stderr)
    assert "the tieringd daemon is not running" in r.stderr, r.stderr
