# SPDX-License-Identifier: Apache-2.0
"""Trace-driven simulation of tiered KV placement: tieringd's policy against LRU, LFU, ARC, static
first-fit and Belady's MIN (the bound). Modules: traces (readers), expand (request → block accesses),
cost (tier costs), policies, report. docs/simulator.md describes the model."""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Sequence

from tieringd.contracts import Tier
from tieringd.heat import HeatConfig
from tieringd.policy import PolicyConfig
from tieringd.prefetch import TierCost
from tieringd.simulate import expand, policies, report, traces
from tieringd.simulate.cost import brief_costs
from tieringd.simulate.expand import Accesses, RequestModel
from tieringd.simulate.policies import POLICIES, Layout
from tieringd.simulate.report import Result


@dataclasses.dataclass
class Setup:
    """Everything a run needs besides the accesses."""
    fast_capacities: Sequence[int | float]   # bytes (int) or fractions of the distinct bytes (float ≤ 1)
    policies: Sequence[str] = POLICIES
    cxl_capacity_bytes: float = math.inf     # finite: PMEM sits behind CXL DRAM
    costs: Mapping[Tier, TierCost] = dataclasses.field(default_factory=brief_costs)
    heat: HeatConfig = dataclasses.field(default_factory=HeatConfig)
    policy: PolicyConfig = dataclasses.field(default_factory=PolicyConfig)


def load_accesses(path: str, fmt: str, model: RequestModel, limit: int | None = None) -> Accesses:
    tr = traces.read(path, fmt, limit)
    if isinstance(tr, traces.NativeTrace):
        return expand.expand_native(tr, model.tick_ms)
    return expand.expand_requests(tr, model)


def capacity_bytes(acc: Accesses, cap: int | float) -> int:
    """A capacity in bytes, or a fraction of the distinct bytes; rounded down to whole blocks."""
    raw = cap * acc.unique_bytes if isinstance(cap, float) else cap
    return int(raw // acc.block_bytes) * acc.block_bytes


def run(acc: Accesses, setup: Setup, progress: Callable[[int], None] | None = None) -> list[Result]:
    """Every policy at every capacity. The tieringd policy's per-tick migration budget is scaled from
    its interval to the simulator's tick."""
    scale = acc.tick_ms / setup.policy.interval_ms
    pcfg = dataclasses.replace(setup.policy, interval_ms=acc.tick_ms,
                               migration_budget_bytes=max(int(setup.policy.migration_budget_bytes * scale), 1))
    out = []
    for cap in setup.fast_capacities:
        cb = capacity_bytes(acc, cap)
        tiers = [Tier.DRAM, Tier.CXL_DRAM]
        caps = [cb // acc.block_bytes, setup.cxl_capacity_bytes / acc.block_bytes]
        if math.isfinite(setup.cxl_capacity_bytes):
            tiers.append(Tier.PMEM)
            caps[1] = setup.cxl_capacity_bytes // acc.block_bytes
            caps.append(math.inf)
        layout = Layout(tuple(tiers), tuple(float(c) for c in caps))
        for name in setup.policies:
            res = policies.run_policy(name, acc, layout, setup.heat, pcfg, progress)
            out.append(report.summarize(name, acc, layout, res, setup.costs, cb))
    return out


__all__ = ["Accesses", "RequestModel", "Result", "Setup", "POLICIES", "load_accesses", "capacity_bytes", "run"]
