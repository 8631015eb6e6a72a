# SPDX-License-Identifier: Apache-2.0
"""The DAX-remap tier's configuration and where it lives (topology.remap_tier on captured trees).
The remapping itself runs against real processes: tests/host/test_shim_dax.py, tests/lab."""
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
