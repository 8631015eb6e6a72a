# SPDX-License-Identifier: Apache-2.0
"""The DAX-remap tier's configuration and where it lives (topology.remap_tier on captured trees);
what a share/unshare request carries. The remapping itself runs against real processes:
tests/host/test_shim_dax.py, tests/host/test_shim_share.py, tests/lab."""
from __future__ import annotations

import pytest

from tieringd.kernel import sysfs
from tieringd.memory import topology
from tieringd.config import ConfigError
from tieringd.shim.remap import DaxConfig

FIXTURES = "tests/fixtures/sysfs"


def test_config_defaults_and_sizes():
    cfg = DaxConfig.from_config({"size_bytes": "2G", "segment_bytes": "32M",
                                         "max_write_amplification": 3})
    assert (cfg.size_bytes, cfg.segment_bytes, cfg.max_write_amplification) == (2 << 30, 32 << 20, 3.0)
    assert DaxConfig.from_config({}).path == "" and DaxConfig.from_config(None).reserve_segments == 2


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"\[dax\] segment: unknown key"):
        DaxConfig.from_config({"segment": "32M"})
    with pytest.raises(ConfigError, match=r"\[dax\] reserve_segments: expected an integer in \[1, 1048576\], got 0"):
        DaxConfig.from_config({"reserve_segments": 0})
    with pytest.raises(ConfigError, match=r"\[dax\] timeout_s: expected a number"):
        DaxConfig.from_config({"timeout_s": "soon"})


def test_remap_tier_defaults_to_the_first_fsdax_mount(repo):
    with sysfs.root(repo / FIXTURES / "pmem-6.12"):
        topo = topology.discover({})
        tier = topology.remap_tier(topo, {})
        assert (tier.path, tier.kind, tier.source, tier.configured) == \
            ("/tmp/pmem/tieringd/kv.log", "fsdax", "/tmp/pmem", False)
        named = topology.remap_tier(topo, {"dax": {"path": "/tmp/pmem/other.log"}})
        assert named.kind == "fsdax" and named.configured
        assert topology.remap_tier(topo, {"dax": {"path": "/srv/kv.log"}}).kind == "file"
        dev = topology.remap_tier(topo, {"dax": {"path": "/dev/dax0.0"}})
        assert (dev.kind, dev.source, dev.size_bytes) == ("devdax", "dax0.0", 1054867456)


def test_no_fsdax_mount_no_remap_tier(repo):
    with sysfs.root(repo / FIXTURES / "cxl-6.12"):
        assert topology.remap_tier(topology.discover({}), {}) is None
    with pytest.raises(ConfigError, match=r"\[dax\] path: expected a path, got 3"):
        topology.remap_tier(topology.Topology(nodes=[]), {"dax": {"path": 3}})


class _Replies:
    """A registry that records each request and answers from a list."""

    def __init__(self, *replies):
        self.sent, self.replies = [], list(replies)

    def request(self, pid, msg, timeout, fds):
        self.sent.append((pid, msg))
        return self.replies.pop(0)


def test_unshare_sends_the_offset_it_is_given_and_keeps_out_of_the_log():
    from tieringd.shim import protocol as P
    from tieringd.shim.remap import DaxTier
    reg = _Replies(P.Ack(), P.Error(ref_seq=0, code=2, message="UNSHARE: not shared"))
    tier = DaxTier(reg)
    rep = tier.unshare(41, 0x200000, 0x400000, 0x800000, node=1)
    assert rep.ok and rep.extents == [(0x800000, 0x400000)] and rep.to_dict()["direction"] == "unshare"
    msg = reg.sent[0][1]
    assert (msg.direction, msg.file_offset, msg.node) == (P.RemapDirection.UNSHARE, 0x800000, 1)
    again = tier.unshare(41, 0x200000, 0x400000, 0x800000)
    assert again.code == 2 and not again.ok and "not shared" in again.error
    counted = tier.stats()["requests"]["unshare"]
    assert (counted["requests"], counted["failed"], counted["bytes"]) == (2, 1, 0x400000)
    assert tier.log is None                               # nothing was allocated anywhere


def test_read_only_mappings_of_the_file_are_not_extents():
    from tieringd.kernel.procfs import Vma
    from tieringd.shim.remap import _file_vmas
    rw = Vma(0x1000, 0x3000, "rw-s", 0, 7, "/dev/dax0.0")
    window = Vma(0x9000, 0xa000, "r--s", 0x200000, 7, "/dev/dax0.0")
    assert _file_vmas([rw, window], "/dev/dax0.0", 7) == [rw]
