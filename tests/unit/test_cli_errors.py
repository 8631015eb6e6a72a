# SPDX-License-Identifier: Apache-2.0
"""What a new user meets first: errors under ``--json`` (one ``tieringd.error/1`` document on stdout,
the plain line still on stderr, the exit status kept), ``tieringctl run`` with no daemon to register
with (one warning line, the program still runs), and ``top``'s heat columns (bytes per heat band,
with the scale said in the header)."""
import json
import os
import socket
import subprocess
import sys
import threading

import click
from click.testing import CliRunner

from paths import REPO
from tieringd.cli import SUBCOMMANDS, main
from tieringd.cli import run as cli_run
from tieringd.cli import top as cli_top


def ctl(*args, env=None):
    r = CliRunner().invoke(main, list(args), env=env)
    assert "Traceback" not in r.output, r.output
    return r


def error_doc(r) -> dict:
    lines = r.stdout.splitlines()
    assert len(lines) == 1, r.stdout              # one document, on one line (top --json streams lines)
    doc = json.loads(lines[0])
    assert doc["schema"] == "tieringd.error/1" and doc["exit_status"] == r.exit_code != 0
    return doc


# ---- --json errors --------------------------------------------------------------------------------------

def test_no_daemon_under_json_is_an_error_document_on_stdout_and_the_line_on_stderr(tmp_path):
    r = ctl("status", "--json", "--run-dir", str(tmp_path))
    assert r.exit_code == 1
    doc = error_doc(r)
    assert doc["code"] == "daemon-not-running" and doc["command"] == "status"
    assert "systemctl start tieringd" in doc["error"]
    assert r.stderr.startswith("tieringctl: the tieringd daemon is not running")


def test_without_json_an_error_prints_nothing_on_stdout(tmp_path):
    r = ctl("status", "--run-dir", str(tmp_path))
    assert r.exit_code == 1 and r.stdout == "" and "tieringctl: " in r.stderr


def test_a_command_error_through_fail_and_a_topology_error_are_documents(tmp_path):
    doc = error_doc(ctl("simulate", str(tmp_path / "missing.jsonl"), "--json"))
    assert doc["code"] == "error" and doc["command"] == "simulate" and "does not exist" in doc["error"]
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[topology.nodes.0]\ntier = "ssd"\n')
    r = ctl("tiers", "--json", env={"TIERINGD_CONFIG": str(cfg),
                                    "TIERINGD_FS_ROOT": str(REPO / "tests/fixtures/sysfs/cxl-6.12")})
    doc = error_doc(r)
    assert doc["code"] == "config" and "ssd" in doc["error"] and r.exit_code == 1


def test_a_usage_error_of_a_json_command_is_a_document_too():
    r = ctl("top", "--json", "-n", "0")
    assert r.exit_code == 2
    doc = error_doc(r)
    assert doc["code"] == "usage" and doc["command"] == "top" and "--iterations" in doc["error"]
    assert r.stderr.startswith("Usage: ") and "top [OPTIONS]" in r.stderr      # click's own message
    doc = error_doc(ctl("dax", "list", "--json", "--no-such-option"))
    assert doc["command"] == "dax list" and doc["code"] == "usage"
    # after "--" the words are the program's (tieringctl run): no document
    assert ctl("run", "--min-bytes", "1k", "--", "prog", "--json").stdout == ""


class FakeControl:
    """A control socket that refuses every request with ``code``."""

    def __init__(self, run_dir, code: str, message: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(os.path.join(run_dir, "control.sock"))
        self.sock.listen(1)
        self.reply = {"code": code, "message": message}
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        conn, _ = self.sock.accept()
        with conn, conn.makefile("rb") as f:
            for line in f:
                rid = json.loads(line)["id"]
                conn.sendall(json.dumps({"v": 1, "id": rid, "ok": False, "error": self.reply}).encode() + b"\n")


def test_a_refusal_of_the_daemon_carries_its_code(tmp_path):
    fake = FakeControl(str(tmp_path), "forbidden", "uid 1000 may not use the tieringd control socket")
    try:
        r = ctl("policy", "--json", "--run-dir", str(tmp_path))
    finally:
        fake.sock.close()
    doc = error_doc(r)
    assert doc["code"] == "forbidden" and doc["command"] == "policy"
    assert doc["error"] == "policy-get: uid 1000 may not use the tieringd control socket [forbidden]"


def _commands(group: click.Group, ctx: click.Context):
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, ctx)
        else:
            yield cmd


def test_every_json_option_is_named_as_json_which_is_how_errors_find_it():
    ctx = click.Context(main)
    seen = 0
    for cmd in _commands(main, ctx):
        for p in cmd.params:
            if "--json" in getattr(p, "opts", []):
                assert p.name == "as_json", (cmd.name, p.name)
                seen += 1
    assert seen >= len(SUBCOMMANDS) - 3


# ---- tieringctl run without a daemon --------------------------------------------------------------------

def test_run_warns_once_when_no_daemon_answers(tmp_path, capsys):
    env = {"TIERINGD_RUN_DIR": str(tmp_path)}
    cli_run.warn_without_daemon(env, "kv_server", 0)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tieringctl: warning: no tieringd daemon answers")
    assert "kv_server runs without tiering" in err and "systemctl start tieringd" in err
    assert str(tmp_path) not in err                          # which socket: only with -v
    cli_run.warn_without_daemon(env, "kv_server", 1)
    err = capsys.readouterr().err
    assert f"tried {tmp_path}/registry.sock: no such socket" in err


def test_run_is_quiet_when_the_registry_answers_and_names_a_stale_socket(tmp_path, capsys):
    path = str(tmp_path / "registry.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(path)
    s.listen(4)
    env = {"TIERINGD_RUN_DIR": str(tmp_path)}
    cli_run.warn_without_daemon(env, "kv_server", 1)
    assert capsys.readouterr().err == ""
    s.close()                                                # the file stays: a stale socket
    cli_run.warn_without_daemon(env, "kv_server", 1)
    assert "connection refused" in capsys.readouterr().err
    cli_run.warn_without_daemon({**env, "TIERINGD_REGISTER": "0"}, "kv_server", 1)
    assert capsys.readouterr().err == ""                     # told never to register: nothing to say


def test_run_still_runs_the_program_without_a_daemon(tmp_path):
    shim = tmp_path / "libtieringd-shim.so"    # an empty file: the loader says it cannot preload it
    shim.write_bytes(b"")
    r = subprocess.run([sys.executable, "-c", "from tieringd.cli import main; main()", "run", "--shim", str(shim), "--run-dir",
                        str(tmp_path / "none"), "--", sys.executable, "-c", "print('ran')"],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0 and r.stdout == "ran\n", r
    assert r.stderr.count("tieringctl: warning: no tieringd daemon answers") == 1, r.stderr


# ---- top's heat columns ---------------------------------------------------------------------------------

def test_top_heat_columns_are_bytes_per_band_and_say_so():
    doc = {"time": "2026-12-05T10:00:00+0000", "ticks": {"p50_ms": 1.0, "p99_ms": 2.0},
           "mover": {"pending_jobs": 0}, "signal": "hint faults", "managed_bytes_by_tier": {"dram": 1 << 30},
           "heat_bands": [">=0.8", ">=0.5", ">=0.2", "<0.2"],
           "processes": [{"pid": 7, "comm": "kv", "regions": 1,
                          "bytes_by_tier": {"dram": 3 << 28, "cxl-dram": 1 << 28, "pmem": 0},
                          "heat": {"blocks": [1, 2, 3, 4], "bytes": [2 << 20, 4 << 20, 6 << 20, 8 << 20]},
                          "moved_bytes_per_s": None}]}
    text = cli_top.render(doc)
    head, _, tab = text.partition("\n\n")
    assert "heat is in [0, 1], no unit" in head and "bytes of blocks by heat" in head
    header, row = tab.splitlines()
    assert header.split()[7:11] == ["HEAT>=0.8", "HEAT0.5-0.8", "HEAT0.2-0.5", "HEAT<0.2"]
    assert row.split()[-10:-2] == ["2.0", "MiB", "4.0", "MiB", "6.0", "MiB", "8.0", "MiB"]


def test_a_picture_without_matplotlib_is_one_line_not_a_traceback(tmp_path):
    """An installed service's venv may lack matplotlib: --plot says so and how to add it."""
    code = ("import sys, builtins\nreal = builtins.__import__\n"
            "def imp(name, *a, **k):\n    if name.startswith('matplotlib'): raise ImportError(name)\n"
            "    return real(name, *a, **k)\nbuiltins.__import__ = imp\n"
            "from tieringd.cli import main\nmain(['simulate', sys.argv[1], '--plot', sys.argv[2]])\n")
    trace = REPO / "data" / "traces" / "mooncake-synthetic.jsonl"
    r = subprocess.run([sys.executable, "-c", code, str(trace), str(tmp_path / "p.png")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "--plot draws with matplotlib" in r.stderr and "pip install matplotlib" in r.stderr
