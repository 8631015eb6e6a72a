# SPDX-License-Identifier: Apache-2.0
"""``tieringctl sample`` on a tests/progs workload: the hottest block ranks first; bad input is refused."""
from __future__ import annotations

import json
import os

import numpy as np

import pytest

from sampling_support import Workload, cli

pytestmark = [pytest.mark.root, pytest.mark.bpf]


def test_sample_cli_ranks_the_hottest_block():
    w = Workload("skewed_touch", "--touches", "400", "--blocks", "8", "--block-size", str(2 << 20),
                 "--repeat", "--seconds", "8")
    try:
        w.p.stdin.write("go\n")
        w.p.stdin.flush()
        r = cli("sample", "--pid", str(w.pid), "--seconds", "2", "--interval-ms", "250",
                 "--block-size", "2M", "--source", "fault", "--json")
    finally:
        w.p.kill()
        w.p.wait()
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema"] == "tieringd.sample/1" and doc["mode"] == "bpf"
    hot = doc["hottest"]["fault"]
    touches = w.info["touches"]
    hottest_block = w.info["base"] + int(np.argmax(touches)) * (2 << 20)
    # the default 2 MiB grid is 2 MiB-aligned, the workload's blocks need not be: they overlap
    assert hot[0]["block_start"] < hottest_block + (2 << 20) and \
        hottest_block < hot[0]["block_start"] + (2 << 20)
    assert hot[0]["count"] > hot[-1]["count"]


def test_sample_cli_rejects_bad_input():
    r = cli("sample", "--pid", "999999999", "--seconds", "1")
    assert r.returncode != 0 and "no process 999999999" in r.stderr
    r = cli("sample", "--pid", str(os.getpid()), "--source", "nope")
    assert r.returncode != 0 and "unknown source 'nope'" in r.stderr
    r = cli("sample", "--pid", str(os.getpid()), "--block-size", "3K", "--seconds", "0.1")
    assert r.returncode != 0 and "power of two" in r.stderr
