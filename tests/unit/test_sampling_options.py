# SPDX-License-Identifier: Apache-2.0
"""The [sampling] table (tieringd/sampling/options.py): typed, unknown keys refused, one error shape."""
from __future__ import annotations

import pytest

from tieringd.config import ConfigError
from tieringd.sampling import SamplingConfig


def test_sampling_config_from_the_table():
    cfg = SamplingConfig.from_config({"sources": ["fault", "dma"], "pmu_event": "software-page-faults",
                                      "blocks_max": 4096})
    assert (cfg.sources, cfg.pmu_event, cfg.blocks_max) == (("fault", "dma"), "software-page-faults", 4096)
    assert SamplingConfig.from_config({}) == SamplingConfig() and SamplingConfig().sources == ("fault", "pmu", "dma")
    for bad, msg in [({"sourcez": []}, r"\[sampling\] sourcez: unknown key"),
                     ({"sources": ["x"]}, r"sources: expected a list of fault, pmu, dma, got \["),
                     ({"blocks_max": "1"}, "blocks_max: expected an integer"),
                     ({"raw": 1}, "raw: expected true or false"),
                     ({"fallback": "maybe"}, "fallback: expected auto or none or damon or idle-page"),
                     ({"pmu_event": "pebs"}, "pmu_event: expected auto or amd-ibs-op"),
                     ({"blocks_max": 0}, "blocks_max: expected an integer in \\[16, 4194304\\], got 0")]:
        with pytest.raises(ConfigError, match=msg):
            SamplingConfig.from_config(bad)
