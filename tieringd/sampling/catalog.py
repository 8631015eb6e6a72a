# SPDX-License-Identifier: Apache-2.0
"""The sampler registry: every sampler tieringd has, listed once (memtierd's ``TrackerRegister``).

Each :class:`SamplerSpec` says what the sampler is (:class:`Kind`), how to build it from the
``[sampling]`` table (:class:`tieringd.sampling.options.SamplingConfig`), and how to describe it once it runs. :func:`tieringd.sampling.open_samplers`
(which to start, what to fall back to), :func:`tieringd.sampling.probe_samplers` (what to load once)
and ``tieringctl doctor`` (which lines are access sources, the verdict) all read :data:`SAMPLERS`;
a new sampler is one entry here.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any, Callable, Mapping

from .accessed import DamonSampler, IdlePageSampler
from .base import Sampler
from .dmacopy import DmaCopySampler
from .migrations import MigrationCounter
from .pagefault import PageFaultSampler
from .pmusample import PmuSampler
from .tracking import TrackedSet

if TYPE_CHECKING:       # options.py validates names against this registry: no import cycle at run time
    from .options import SamplingConfig


class Kind(enum.Enum):
    SOURCE = "BPF access source"            # a BPF program counts accesses per block
    FALLBACK = "accessed-bit fallback"      # started only when no BPF source runs
    COUNTER = "migration counter"           # no access rows: migrations per reason

    @property
    def gives_access_rows(self) -> bool:
        return self is not Kind.COUNTER


@dataclasses.dataclass(frozen=True)
class SamplerSpec:
    name: str                   # as in [sampling] sources / fallback, doctor, sample --source
    kind: Kind
    cls: type[Sampler]
    make: Callable[[TrackedSet, "SamplingConfig"], Sampler]
    running: Callable[[Sampler], str]         # how it runs once started (doctor's detail)
    # What probe_samplers loads: label → SamplingConfig fields over the probe's own (default: the
    # sampler itself)
    probes: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)

    def probe_variants(self) -> Mapping[str, Mapping[str, Any]]:
        return self.probes or {self.name: {}}


def _fault(tracked: TrackedSet, cfg: "SamplingConfig") -> Sampler:
    return PageFaultSampler(tracked, thp_accounting=cfg.thp_accounting, raw=cfg.raw,
                            blocks_max=cfg.blocks_max)


def _pmu(tracked: TrackedSet, cfg: "SamplingConfig") -> Sampler:
    return PmuSampler(tracked, event=cfg.pmu_event, sample_period=cfg.pmu_sample_period, raw=cfg.raw,
                      blocks_max=cfg.blocks_max)


def _dma(tracked: TrackedSet, cfg: "SamplingConfig") -> Sampler:
    return DmaCopySampler(tracked, raw=cfg.raw, blocks_max=cfg.blocks_max)


SAMPLERS: dict[str, SamplerSpec] = {s.name: s for s in (
    SamplerSpec("fault", Kind.SOURCE, PageFaultSampler, _fault,
                lambda s: "tracepoints exceptions:page_fault_user/kernel"),
    SamplerSpec("pmu", Kind.SOURCE, PmuSampler, _pmu,
                lambda s: f"event {s.event.name}: {s.event.description}",
                # the software event runs everywhere (no PMU in VMs): the tests' stand-in
                probes={"pmu": {}, "pmu (software page faults)": {"pmu_event": "software-page-faults"}}),
    SamplerSpec("dma", Kind.SOURCE, DmaCopySampler, _dma,
                lambda s: "uprobes attach per library when a process is tracked"),
    SamplerSpec("migrations", Kind.COUNTER, MigrationCounter, lambda t, o: MigrationCounter(t),
                lambda s: "tracepoint migrate:mm_migrate_pages"),
    SamplerSpec("damon", Kind.FALLBACK, DamonSampler, lambda t, o: DamonSampler(t),
                lambda s: "available"),
    SamplerSpec("idle-page", Kind.FALLBACK, IdlePageSampler, lambda t, o: IdlePageSampler(t),
                lambda s: "available"),
)}


def names(*kinds: Kind) -> tuple[str, ...]:
    """Sampler names of these kinds, in registry order."""
    return tuple(n for n, s in SAMPLERS.items() if s.kind in kinds)


def access_sampler(name: str) -> SamplerSpec:
    """The spec of a sampler that gives access rows (a source or a fallback)."""
    spec = SAMPLERS.get(name)
    if spec is None or not spec.kind.gives_access_rows:
        raise ValueError(f"unknown sampler {name!r}: " + ", ".join(names(Kind.SOURCE, Kind.FALLBACK)))
    return spec
