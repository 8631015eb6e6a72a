# SPDX-License-Identifier: Apache-2.0
"""Acceptance of the lab itself (issue 3): topology, HMAT, memory tiers and move_pages on every lab
kernel, and the pmem profile's devdax -> kmem and fsdax paths. One boot per kernel/profile: checks
are batched."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.lab


def test_cxl_smoke(lab):
    r = lab.run("cat /sys/devices/system/node/online; echo $LAB_OUT; pwd; test -x .venv/bin/python; echo hi > $LAB_OUT/f")
    assert r.rc == 0, r.stderr
    online, out, cwd = r.stdout.split()
    assert online == "0-1"
    assert out == str(r.out_dir)
    assert cwd == str(lab.repo)
    assert (r.out_dir / "f").read_text() == "hi\n"
