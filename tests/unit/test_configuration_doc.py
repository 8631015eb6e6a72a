# SPDX-License-Identifier: Apache-2.0
"""The example in docs/configuration.md is a real configuration: every table in it is accepted by the
module that reads it, so the reference cannot drift from the code."""
import re
import tomllib

import pytest

from tieringd.placement import blocksize, heat, policy, prefetch
from tieringd import config, sampling
from tieringd.shim import settings as shim_settings
from tieringd.memory import topology
from tieringd.contracts import Tier
from tieringd.mover import MoverConfig


@pytest.fixture(scope="module")
def example(repo):
    text = (repo / "docs" / "configuration.md").read_text()
    block = re.search(r"```toml\n(.*?)```", text, re.S)
    assert block, "docs/configuration.md has a ```toml example"
    return tomllib.loads(block[1])


def test_every_table_of_the_example_is_accepted(example):
    assert topology.tier_overrides(example) == {2: Tier.PMEM}
    assert shim_settings.ShimSettings.from_config(example["shim"]).min_bytes == 4 << 20
    assert sampling.SamplingConfig.from_config(example["sampling"]).sources == ("fault", "dma")
    assert config.from_table(heat.HeatConfig, "heat", example["heat"]).half_life_s == 1.0
    cfg = config.from_table(policy.PolicyConfig, "policy", example["policy"])
    assert cfg.migration_budget_bytes == 256 << 20 and cfg.fill == "rank" and cfg.migration_rate_mb_s == 0
    assert cfg.quotas == {"cgroup:/inference/a": 8 << 30}
    assert config.from_table(prefetch.PrefetchConfig, "prefetch", example["prefetch"]).enabled
    blocksize.BlockSizer.from_config(example["blocksize"])
    assert MoverConfig.from_config(example["mover"]).batch_pages == 4096


def test_a_typo_is_an_error_naming_the_table_and_key():
    with pytest.raises(config.ConfigError, match=r"\[heat\] half_life: unknown key"):
        config.from_table(heat.HeatConfig, "heat", {"half_life": 2})
