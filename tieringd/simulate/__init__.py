# SPDX-License-Identifier: Apache-2.0
"""Trace-driven simulation of tiered KV placement: tieringd's policy against the transparent forms of
LRU, ARC and LFU under one mover and one view of the accesses (model.py), the demand caches and
static first-fit as references, and Belady's MIN as the bound. The accesses are expanded once into a
spool on disk and replayed a window at a time, so memory holds the blocks, not the accesses. Modules:
traces (readers), expand (request → block accesses), cost (tier costs), model (the mover and the view), transparent (the
harness and the planners), caches (LRU, LFU, ARC), demand (references and the bound), policies (names,
kinds and the replay), stream (the accesses on disk), report.
docs/simulator.md describes the model and its limits."""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Sequence

from tieringd.contracts import Tier
from tieringd.placement.heat import HeatConfig
from tieringd.placement.policy import PolicyConfig
from tieringd.placement.prefetch import TierCost
from tieringd.simulate import expand, policies, report, traces
from tieringd.simulate.cost import reference_costs
from tieringd.simulate.expand import Accesses, RequestModel
from tieringd.simulate.layout import Layout
from tieringd.simulate.model import TransparentModel, default_mover_bytes_s
from tieringd.simulate.policies import DEFAULT_POLICIES, KIND, POLICIES
from tieringd.simulate.report import Result


@dataclasses.dataclass
class Setup:
    """Everything a run needs besides the accesses."""
    fast_capacities: Sequence[int | float]   # bytes (int) or fractions of the distinct bytes (float ≤ 1)
    policies: Sequence[str] = DEFAULT_POLICIES
    cxl_capacity_bytes: float = math.inf     # finite: PMEM sits behind CXL DRAM
    costs: Mapping[Tier, TierCost] = dataclasses.field(default_factory=reference_costs)
    heat: HeatConfig = dataclasses.field(default_factory=HeatConfig)
    policy: PolicyConfig = dataclasses.field(default_factory=PolicyConfig)
    mover_bytes_s: float | None = None       # None: model.MOVER_SHARE of the slowest tier's bandwidth
    delay_windows: int = 0
    sample_fraction: float = 1.0
    seed: int = 1

    def tiers(self) -> tuple[Tier, ...]:
        return (Tier.DRAM, Tier.CXL_DRAM) + ((Tier.PMEM,) if math.isfinite(self.cxl_capacity_bytes) else ())

    def model(self) -> TransparentModel:
        rate = self.mover_bytes_s or default_mover_bytes_s(self.costs, self.tiers())
        return TransparentModel(rate, self.delay_windows, self.sample_fraction, self.seed)


def load_accesses(path: str, fmt: str, model: RequestModel, limit: int | None = None,
                  block_tokens: int | None = None, trace_block_tokens: int | None = None,
                  spool_dir: str | None = None) -> Accesses:
    """Reads and expands a trace into a spool (a temporary directory under ``spool_dir``, or the
    system's): the trace's records are let go once it is written."""
    tr = traces.read(path, fmt, limit, trace_block_tokens, block_tokens)
    return expand.spool_trace(tr, model, spool_dir)


def capacity_bytes(acc: Accesses, cap: int | float) -> int:
    """A capacity in bytes, or a fraction of the distinct bytes; rounded down to whole blocks."""
    raw = cap * acc.unique_bytes if isinstance(cap, float) else cap
    return int(raw // acc.block_bytes) * acc.block_bytes


def layout_for(acc: Accesses, setup: Setup, fast_bytes: int) -> Layout:
    caps = [fast_bytes // acc.block_bytes, math.inf]
    if math.isfinite(setup.cxl_capacity_bytes):
        caps = [caps[0], setup.cxl_capacity_bytes // acc.block_bytes, math.inf]
    return Layout(setup.tiers(), tuple(float(c) for c in caps))


def run(acc: Accesses, setup: Setup, progress: Callable[[int], None] | None = None,
        record: bool = False, jobs: int = 1) -> list[Result]:
    """Every policy at every capacity, side by side in one pass over the stream. tieringd's policy
    ticks once per window (its interval is the window) and moves what the shared mover model allows.
    ``record``: each result's run keeps every access's tier and hit (``Result.tally``); ``jobs``: processes
    the runs are shared out among (policies.replay)."""
    model = setup.model()
    runs, meta = [], []
    for cap in setup.fast_capacities:
        cb = capacity_bytes(acc, cap)
        layout = layout_for(acc, setup, cb)
        for name in setup.policies:
            runs.append(policies.make_run(name, acc, layout, model, setup.heat, setup.policy, record))
            meta.append((name, layout, cb))
    policies.replay(acc, runs, model, progress, jobs)
    return [report.summarize(name, acc, layout, r.tally, setup.costs, cb) for r, (name, layout, cb) in zip(runs, meta)]


__all__ = ["Accesses", "RequestModel", "Result", "Setup", "POLICIES", "DEFAULT_POLICIES", "KIND",
           "TransparentModel", "load_accesses", "capacity_bytes", "layout_for", "run"]
