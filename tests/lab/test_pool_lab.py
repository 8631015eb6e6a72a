# SPDX-License-Identifier: Apache-2.0
"""The pool across hosts in the lab: two guests (hosts a and b) at once, one shared memory device, etcd
on the lab host's loopback reached through user-mode networking only (scripts/lab/pool/, docs/pool.md)."""
from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.lab, pytest.mark.etcd]
LAB_GROUP_S = 120


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_two_hosts_see_one_device_and_reach_etcd_only_through_the_forward(lab, etcd):
    port = etcd.client_ports[0]
    script = f"""set -e
dev=$(scripts/lab/pool/guest.sh devdax)
if [ "$LAB_HOST" = a ]; then
    .venv/bin/python scripts/lab/pool/device_check.py write $dev 64 4
    scripts/lab/pool/guest.sh mark written
else
    scripts/lab/pool/guest.sh wait written
    .venv/bin/python scripts/lab/pool/device_check.py read $dev 64 4
fi
.venv/bin/python scripts/lab/pool/device_check.py net {port}
"""
    r = lab.run_pair({"a": script, "b": script}, etcd, timeout_s=600)
    out = {}
    for h, res in r.items():
        assert res.rc == 0, f"host {h}: {res.stdout}\n{res.stderr}"
        out[h] = _json_lines(res.stdout)
    # 4 MiB of random bytes written by a, read back identical by b: one memory, two hosts
    assert out["a"][0]["md5"] == out["b"][0]["md5"]
    for h in "ab":
        assert out[h][1]["etcd"] == [h]
        assert out[h][1]["host_loopback"].startswith("refused"), out[h][1]
