# SPDX-License-Identifier: Apache-2.0
"""Access samplers — the daemon's eyes: which blocks of which tracked process were touched, per interval.

Sources (see docs/sampling.md):

- ``fault`` :class:`PageFaultSampler` — user page faults, NUMA-balancing hint faults included (VMs);
- ``pmu``   :class:`PmuSampler` — data-address samples (Intel PEBS, AMD IBS; software page faults in tests);
- ``dma``   :class:`DmaCopySampler` — host pointers passed to CUDA copy APIs (GPU DMA reads no CPU sees);
- fallback without BPF: :class:`DamonSampler` (DAMON vaddr) or :class:`IdlePageSampler` (idle page
  tracking), rows with source ACCESSED;
- :class:`MigrationCounter` — migrations per reason, to tell the daemon's moves from the kernel's.

Which samplers exist, of what kind and how each is built is :mod:`.catalog`'s (one registry).

All BPF samplers filter in the kernel by the :class:`TrackedSet` (shared maps) and aggregate per
(tgid, block). ``read_deltas()`` of each, and of a :class:`SamplerSet`, returns rows of
:data:`tieringd.contracts.ACCESS_DELTA_DTYPE`.
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np

from .accessed import DamonSampler, IdlePageSampler
from .base import BpfSampler, Sampler, SamplerUnavailable, empty_deltas, touches
from .catalog import SAMPLERS, Kind, access_sampler, names
from .dmacopy import DmaCopySampler
from .migrations import MigrationCounter
from .options import SamplingConfig
from .pagefault import PageFaultSampler
from .pmusample import PmuSampler
from .tracking import TrackedSet, TrackingError

__all__ = ["TrackedSet", "TrackingError", "Sampler", "SamplerUnavailable", "PageFaultSampler",
           "PmuSampler", "DmaCopySampler", "MigrationCounter", "DamonSampler", "IdlePageSampler",
           "SamplerSet", "open_samplers", "probe_samplers", "Probe", "Kind", "SamplingConfig", "SOURCES",
           "FALLBACKS", "touches"]

log = logging.getLogger(__name__)

SOURCES = names(Kind.SOURCE)            # ("fault", "pmu", "dma")
FALLBACKS = names(Kind.FALLBACK)        # ("damon", "idle-page"), in the order "auto" tries them


@dataclasses.dataclass
class SamplerSet:
    """The samplers that started, and for each one that did not, why."""
    tracked: TrackedSet
    samplers: list[Sampler]
    unavailable: dict[str, str]
    migrations: MigrationCounter | None = None
    fallback_reason: str | None = None      # set when the accessed-bit fallback is in use
    # per row of the last read_deltas(): write faults seen in the block (0 where the sampler that
    # gave the row cannot tell writes): the daemon's decode frontier (daemon/position.py)
    last_writes: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.uint32))

    @property
    def mode(self) -> str:
        if any(isinstance(s, BpfSampler) for s in self.samplers):
            return "bpf"
        if self.samplers:
            return f"fallback:{self.samplers[0].name}"
        return "none"

    @property
    def tells_writes(self) -> bool:
        """Whether a running sampler tells writes from reads (``last_writes`` can be non-zero)."""
        return any(s.tells_writes for s in self.samplers)

    def read_deltas(self) -> np.ndarray:
        parts = [s.read_deltas() for s in self.samplers]
        writes = []
        for s, rows in zip(self.samplers, parts):
            w = s.last_writes if s.tells_writes else None
            writes.append(w if w is not None and len(w) == len(rows) else np.zeros(len(rows), np.uint32))
        self.last_writes = np.concatenate(writes) if writes else np.zeros(0, np.uint32)
        return np.concatenate(parts) if parts else empty_deltas()

    def stats(self) -> dict[str, dict[str, int]]:
        """Per sampler its counters; the migration counter's (migrations per reason) under "migrations"."""
        out = {s.name: s.stats() for s in self.samplers}
        if self.migrations is not None:
            out["migrations"] = self.migrations.stats()
        return out

    def describe(self) -> str:
        """One paragraph for the daemon's log and ``tieringctl doctor``."""
        text = f"access sampling: {self.mode}"
        if self.samplers:
            text += " (" + ", ".join(s.name for s in self.samplers) + ")"
        if self.fallback_reason:
            text += f"; BPF unavailable: {self.fallback_reason}"
        for name, why in self.unavailable.items():
            if not self.fallback_reason or name in FALLBACKS:
                text += f"\n  {name}: {why}"
        return text

    def close(self) -> None:
        for s in self.samplers:
            s.close()
        if self.migrations is not None:
            self.migrations.close()
        self.samplers.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_samplers(tracked: TrackedSet, config: SamplingConfig | None = None, **options) -> SamplerSet:
    """Starts every source of ``config.sources`` that can run here. When no BPF sampler can (no
    CAP_BPF, no BTF, old kernel), falls back to an accessed-bit tracker (``fallback``: auto = DAMON
    then idle page tracking; a name; or "none") and records why in ``fallback_reason``.
    ``options`` are SamplingConfig fields that override ``config`` (``sources=("fault",)``)."""
    cfg = dataclasses.replace(config or SamplingConfig(), **options)
    started: list[Sampler] = []
    unavailable: dict[str, str] = {}
    for name in cfg.sources:
        s = access_sampler(name).make(tracked, cfg)
        try:
            s.start()
            started.append(s)
        except SamplerUnavailable as e:
            unavailable[name] = str(e)
            log.info("sampler %s unavailable: %s", name, e)
    bpf_running = any(isinstance(s, BpfSampler) for s in started)
    result = SamplerSet(tracked, started, unavailable)
    if not bpf_running and cfg.fallback != "none":
        result.fallback_reason = "; ".join(unavailable.values()) or "no BPF source was asked for"
        for name in (FALLBACKS if cfg.fallback == "auto" else [cfg.fallback]):
            s = access_sampler(name).make(tracked, cfg)
            try:
                s.start()
                started.append(s)
                log.warning("BPF sampling unavailable (%s); falling back to %s",
                            result.fallback_reason, name)
                break
            except SamplerUnavailable as e:
                unavailable[name] = str(e)
    if bpf_running and cfg.migrations:
        m = SAMPLERS["migrations"].make(tracked, cfg)
        try:
            m.start()
            result.migrations = m
        except SamplerUnavailable as e:
            unavailable["migrations"] = str(e)
    return result


@dataclasses.dataclass(frozen=True)
class Probe:
    """One sampler loaded and attached once: whether it runs here, and why not or how."""
    name: str           # the sampler's name, or a variant's label ("pmu (software page faults)")
    sampler: str        # the registry entry
    kind: Kind
    ok: bool
    detail: str


def probe_samplers(pmu_event: str = "auto") -> list[Probe]:
    """Loads and attaches every sampler of the registry once (then closes it), variants included."""
    out = []
    base = SamplingConfig(pmu_event=pmu_event)
    tracked = TrackedSet()
    try:
        for spec in SAMPLERS.values():
            for label, overrides in spec.probe_variants().items():
                s = spec.make(tracked, dataclasses.replace(base, **overrides))
                try:
                    s.start()
                    out.append(Probe(label, spec.name, spec.kind, True, spec.running(s)))
                except SamplerUnavailable as e:
                    out.append(Probe(label, spec.name, spec.kind, False, str(e)))
                finally:
                    s.close()
    finally:
        tracked.close()
    return out
