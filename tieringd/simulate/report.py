# SPDX-License-Identifier: Apache-2.0
"""Figures of merit per (policy, fast-tier capacity), and the PNG of hit rate against capacity
(the table is the CLI's: tieringd/cli/simulate.py)."""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from tieringd.contracts import Tier
from tieringd.placement.prefetch import TierCost
from tieringd.simulate.expand import Accesses
from tieringd.simulate.layout import Layout, Tally
from tieringd.simulate.policies import KIND

SCHEMA = "tieringd.simulate/2"


@dataclasses.dataclass
class Result:
    policy: str
    kind: str                         # transparent, reference or bound (policies.KIND)
    fast_capacity_bytes: int
    fast_capacity_fraction: float     # of the trace's distinct block bytes
    accesses: int
    hit_rate: float                   # hits / accesses (see demand.py: bounded by Belady)
    fast_served: float                # accesses served by the fast tier / accesses (moved ahead included)
    tier_share: dict[str, float]      # accesses served by each tier / accesses
    migrated_bytes: float
    access_bytes: float               # bytes read or written by the accesses (reads × block size)
    access_s: float                   # time those bytes take on the tiers that served them
    stall_s: float                    # access_s minus the time had the fastest tier served everything
    effective_bandwidth_mb_s: float   # MB/s (10^6 B/s), the unit of docs/json.md
    tally: Tally | None = dataclasses.field(default=None, repr=False, compare=False)   # the run's counts

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "tally"}


def summarize(policy: str, acc: Accesses, layout: Layout, tally: Tally, costs: Mapping[Tier, TierCost],
              fast_capacity_bytes: int) -> Result:
    n = tally.accesses
    bb = acc.block_bytes
    per_read = np.array([costs[t].seconds(bb) for t in layout.tiers])
    reads = float(tally.served_reads.sum())           # whole numbers: exact in float64
    t_access = float((tally.served_reads * per_read).sum())
    t_fast = reads * per_read[0]
    share = tally.served / max(n, 1)
    nbytes = reads * bb
    return Result(policy=policy, kind=KIND[policy], fast_capacity_bytes=int(fast_capacity_bytes),
                  fast_capacity_fraction=fast_capacity_bytes / max(acc.unique_bytes, 1), accesses=n,
                  hit_rate=tally.hits / n if n else 0.0, fast_served=float(share[0]),
                  tier_share={t.label: float(s) for t, s in zip(layout.tiers, share)},
                  migrated_bytes=float(tally.moved_blocks) * bb, access_bytes=nbytes, access_s=t_access,
                  stall_s=t_access - t_fast,
                  effective_bandwidth_mb_s=nbytes / t_access / 1e6 if t_access > 0 else 0.0, tally=tally)


def plot(results: Sequence[Result], path: str, title: str) -> None:
    """Hit rate against fast-tier capacity, one line per policy (Agg: no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for name in dict.fromkeys(r.policy for r in results):
        pts = sorted((r.fast_capacity_fraction, r.hit_rate) for r in results if r.policy == name)
        style = {"linestyle": "--", "color": "black"} if name == "belady" else {}
        ax.plot([100 * x for x, _ in pts], [100 * y for _, y in pts], marker="o", label=name, **style)
    ax.set_xlabel("fast-tier capacity (% of the trace's distinct KV bytes)")
    ax.set_ylabel("fast-tier hit rate (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
