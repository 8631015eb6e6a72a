# SPDX-License-Identifier: Apache-2.0
"""The sampler registry (tieringd/sampling/catalog.py): every entry builds its class from the
[sampling] options, and the lists the factory, the CLI and doctor use are the registry's."""
from __future__ import annotations

import pytest

from tieringd import sampling
from tieringd.sampling import catalog
from tieringd.sampling.catalog import SAMPLERS, Kind
from tieringd.sampling.options import SamplingConfig
from tieringd.sampling.tracking import TrackedSet


def test_every_entry_and_variant_builds_its_class():
    t = TrackedSet()
    for spec in SAMPLERS.values():
        for label, opts in spec.probe_variants().items():
            s = spec.make(t, SamplingConfig(**opts))
            assert type(s) is spec.cls, label
    assert list(SAMPLERS["pmu"].probe_variants()) == ["pmu", "pmu (software page faults)"]


def test_options_reach_the_samplers():
    t = TrackedSet()
    opts = SamplingConfig(pmu_event="software-page-faults", pmu_sample_period=7, blocks_max=128, raw=True,
                          thp_accounting=False)
    pmu = SAMPLERS["pmu"].make(t, opts)
    assert (pmu.event_name, pmu.sample_period, pmu.blocks_max, pmu.raw) == ("software-page-faults", 7, 128, True)
    fault = SAMPLERS["fault"].make(t, opts)
    assert fault.thp_accounting is False and fault.blocks_max == 128
    assert SAMPLERS["dma"].make(t, SamplingConfig()).blocks_max == sampling.tracking.BLOCKS_MAX_DEFAULT


def test_the_lists_are_the_registry_s():
    assert sampling.SOURCES == catalog.names(Kind.SOURCE) == ("fault", "pmu", "dma")
    assert sampling.FALLBACKS == catalog.names(Kind.FALLBACK) == ("damon", "idle-page")
    assert catalog.names(Kind.COUNTER) == ("migrations",)
    assert catalog.access_sampler("damon").kind is Kind.FALLBACK
    with pytest.raises(ValueError, match="unknown sampler 'migrations': fault, pmu, dma, damon, idle-page"):
        catalog.access_sampler("migrations")
    with pytest.raises(ValueError, match="unknown sampler 'pebs'"):
        sampling.open_samplers(TrackedSet(), sources=("pebs",))
