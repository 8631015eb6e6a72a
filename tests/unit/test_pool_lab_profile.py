# SPDX-License-Identifier: Apache-2.0
"""The two-host lab profile's machine: one pool file every guest maps with share=on, and user-mode
networking whose only way out is the forwards to the etcd members on the host's loopback."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lab_workers import load_lab_module
from paths import LAB_SCRIPTS

lab = load_lab_module()
sys.path.insert(0, str(LAB_SCRIPTS / "pool"))
import pair  # noqa: E402


def test_the_pool_is_one_host_file_mapped_shared():
    p = lab.PROFILES["pool"]
    args = p.qemu_args(Path("/x/pool.img"), ())
    backend = next(a for a in args if a.startswith("memory-backend-file,id=poolmem"))
    assert "share=on" in backend and "mem-path=/x/pool.img" in backend and f"size={p.shared_mib}M" in backend
    assert f"nvdimm,id=pool,memdev=poolmem,node={p.shared_node}" in args
    assert p.guests == 2 and "-netdev" not in args


def test_a_pool_profile_without_its_file_is_refused():
    with pytest.raises(lab.LabError, match="backing file"):
        lab.PROFILES["pool"].qemu_args()


def test_the_network_is_restricted_to_the_forwards(tmp_path):
    fwd = pair.forwarders(tmp_path, ["127.0.0.1:4001", "127.0.0.1:4002"])
    assert fwd == (f"tcp:10.0.2.100:2379-cmd:{tmp_path}/fwd-4001", f"tcp:10.0.2.101:2379-cmd:{tmp_path}/fwd-4002")
    prog = (tmp_path / "fwd-4001").read_text()
    assert prog.startswith("#!/bin/sh\nexec ") and prog.rstrip().endswith("fwd.py 4001")
    args = lab.PROFILES["pool"].qemu_args(Path("/x/pool.img"), fwd)
    netdev = args[args.index("-netdev") + 1]
    assert netdev.startswith("user,") and "restrict=on" in netdev and netdev.count("guestfwd=") == 2


def test_only_the_loopback_is_forwarded_to(tmp_path):
    with pytest.raises(ValueError, match="loopback"):
        pair.forwarders(tmp_path, ["10.1.2.3:2379"])
