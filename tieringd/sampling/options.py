# SPDX-License-Identifier: Apache-2.0
"""The ``[sampling]`` table of tieringd.toml (docs/sampling.md): which samplers, and how they count.

Built with :func:`tieringd.config.from_table` (typed, unknown keys refused, one ``ConfigError``
shape); :func:`tieringd.sampling.open_samplers` takes it, and the registry's makers
(:mod:`.catalog`) read it.
"""
from __future__ import annotations

import dataclasses

from tieringd.config import ConfigError, Table, ranged

from ._perf import PMU_EVENTS
from .catalog import Kind, names
from .tracking import BLOCKS_MAX_DEFAULT


@dataclasses.dataclass(frozen=True)
class SamplingConfig(Table):
    NAME = "sampling"
    sources: tuple[str, ...] = names(Kind.SOURCE)    # BPF sources to start
    fallback: str = "auto"          # auto (DAMON, then idle pages), damon, idle-page or none
    pmu_event: str = "auto"  # the pmu source's perf event: auto (amd-ibs-op, then intel-mem-loads), amd-ibs-op, intel-mem-loads or software-page-faults
    pmu_sample_period: int | None = ranged(None, 1, 1 << 32)   # None: the event's own default
    blocks_max: int = ranged(BLOCKS_MAX_DEFAULT, 16, 1 << 22)   # entries of each epoch map
    raw: bool = False               # a ring buffer of raw samples besides the per-block counts
    thp_accounting: bool = True     # a fault on a THP counts for its huge page (docs/sampling.md)
    migrations: bool = True         # the migration counter beside the BPF sources
    interval_ms: int = ranged(100, 1, 60_000, unit="milliseconds")  # how often the daemon reads its samplers (at most once a [policy] tick)

    def validate(self) -> None:
        super().validate()
        for s in self.sources:
            if s not in names(Kind.SOURCE):
                raise ConfigError.bad_value("sampling", "sources", "a list of " + ", ".join(names(Kind.SOURCE)),
                                            list(self.sources))
        fallbacks = ("auto", "none", *names(Kind.FALLBACK))
        if self.fallback not in fallbacks:
            raise ConfigError.bad_value("sampling", "fallback", " or ".join(fallbacks), self.fallback)
        if self.pmu_event not in PMU_EVENTS:
            raise ConfigError.bad_value("sampling", "pmu_event", " or ".join(PMU_EVENTS), self.pmu_event)
