# SPDX-License-Identifier: Apache-2.0
"""[policy] and [prefetch]: what each key does to the plan of a tick — the daemon's own ``_plan``
(its budget from admission, ``Policy.tick`` of the policy ``_start`` builds, with the prefetcher of
``Daemon._prefetcher``) on a block table built for the case, with tiers sized for it."""
from __future__ import annotations

from typing import Callable

import numpy as np

from tieringd.contracts import ACCESS_DELTA_DTYPE, Priority, SampleSource, Tier
from tieringd.placement.heat import BlockTable
from tieringd.placement.plan import TierSpec

from keyprobe import Ctx, probe

MiB = 1 << 20
BASE = 0x7F00_0000_0000
PID = 100
NODE = {Tier.DRAM: 0, Tier.CXL_DRAM: 1}


def plan(ctx: Ctx, text: str, build: Callable[[BlockTable], None], dram: float, now_ms: int):
    """The plan ``Daemon._plan`` makes at ``now_ms`` of the table ``build`` fills, with ``dram`` bytes
    of DRAM and ample CXL memory."""
    d = ctx.daemon(text)
    build(d.table)
    d.policy.set_tiers([TierSpec(Tier.DRAM, (0,), dram), TierSpec(Tier.CXL_DRAM, (1,), 1 << 40)])
    return d._plan(now_ms * 1_000_000)


def region(t: BlockTable, i: int, blocks: int, tier: Tier, block_bytes: int = 2 * MiB, **kw) -> slice:
    rid = t.add_region(PID, BASE + i * (1 << 32), blocks * block_bytes, block_bytes, node=NODE[tier],
                       tier=tier, **kw)
    return t.region_slice(rid)


def read(t: BlockTable, blocks: slice | list[int], t_ms: int) -> None:
    idx = np.arange(t.n)[blocks]
    t.ingest_blocks(idx, np.ones(len(idx)), t_ms)


def moved(p, priority: Priority) -> float:
    return float(p.moved_bytes.get(priority.name, 0))


def hot_on_cxl(t: BlockTable) -> None:
    """40 blocks (80 MiB) on CXL memory, all read at 1 s."""
    read(t, region(t, 0, 40, Tier.CXL_DRAM), 1_000)


def idle_on_cxl(t: BlockTable) -> None:
    """10 blocks on CXL memory read 12 s ago (heat ≈ 0.5)."""
    read(t, region(t, 0, 10, Tier.CXL_DRAM), 0)


def rival(t: BlockTable) -> None:
    """One block in DRAM read at 1.0 s, one on CXL memory read at 1.1 s; DRAM holds one."""
    read(t, region(t, 0, 1, Tier.DRAM), 1_000)
    read(t, region(t, 1, 1, Tier.CXL_DRAM), 1_100)


def cold_dram(t: BlockTable) -> None:
    """96 blocks of 1 MiB in DRAM, read long ago."""
    read(t, region(t, 0, 96, Tier.DRAM, MiB), 0)


@probe("policy", "interval_ms")
def _(ctx):
    """A 1 s tick: a scan is prefetched a tick's lead ahead, 41 blocks where a 100 ms tick takes 5."""
    assert prefetched(ctx, "[prefetch]\nmax_window_blocks = 100\n") == 5
    assert prefetched(ctx, "[policy]\ninterval_ms = 1000\n[prefetch]\nmax_window_blocks = 100\n") == 41


@probe("policy", "fill")
def _(ctx):
    """fill = "thresholds": blocks at heat 0.5 stay on CXL memory although DRAM has room."""
    assert moved(plan(ctx, "", idle_on_cxl, 1 << 30, 12_000), Priority.PROMOTE) == 20 * MiB
    assert moved(plan(ctx, '[policy]\nfill = "thresholds"\n', idle_on_cxl, 1 << 30, 12_000),
                 Priority.PROMOTE) == 0


@probe("policy", "thresholds")
def _(ctx):
    """With the thresholds fill, lower thresholds let blocks at heat 0.5 deserve DRAM."""
    fill = '[policy]\nfill = "thresholds"\n'
    assert moved(plan(ctx, fill, idle_on_cxl, 1 << 30, 12_000), Priority.PROMOTE) == 0
    assert moved(plan(ctx, fill + "thresholds = [0.3, 0.2, 0.1]\n", idle_on_cxl, 1 << 30, 12_000),
                 Priority.PROMOTE) == 20 * MiB


@probe("policy", "hysteresis")
def _(ctx):
    """A 0.05 margin: the DRAM block keeps its place against one read 100 ms later (0.0025: the two
    swap, the incumbent demoted first and the promotion waiting for its room)."""
    swap = plan(ctx, "", rival, 2.2 * MiB, 1_100)
    assert moved(swap, Priority.DEMOTE) == 2 * MiB and swap.deferred_bytes == 2 * MiB
    assert plan(ctx, "[policy]\nhysteresis = 0.05\n", rival, 2.2 * MiB, 1_100).total_moved_bytes == 0


@probe("policy", "min_residency_ms")
def _(ctx):
    """0 (off): a block demoted 200 ms ago takes the place of a slightly colder incumbent at once (the
    incumbent is demoted, the block's promotion waits for the room)."""
    def demoted_recently(t: BlockTable) -> None:
        read(t, region(t, 0, 1, Tier.DRAM), 1_000)
        back = region(t, 1, 1, Tier.CXL_DRAM, now_ns=900 * 1_000_000)     # moved there at 0.9 s
        read(t, back, 1_100)
    assert plan(ctx, "", demoted_recently, 2.2 * MiB, 1_100).total_moved_bytes == 0
    back = plan(ctx, "[policy]\nmin_residency_ms = 0\n", demoted_recently, 2.2 * MiB, 1_100)
    assert moved(back, Priority.DEMOTE) == 2 * MiB and back.deferred_bytes == 2 * MiB


@probe("policy", "migration_rate_mb_s")
def _(ctx):
    """10 MB/s: a plan a second after the last one moves 8 MiB of the 64 MiB it would."""
    assert plan(ctx, "", hot_on_cxl, 1 << 30, 1_000).total_moved_bytes == 64 * MiB
    assert plan(ctx, "[policy]\nmigration_rate_mb_s = 10\n", hot_on_cxl, 1 << 30, 1_000).total_moved_bytes \
        == 8 * MiB


@probe("policy", "migration_budget_bytes")
def _(ctx):
    """A 4 MiB cap: two blocks of the 32 the mover's default budget takes."""
    assert plan(ctx, '[policy]\nmigration_budget_bytes = "4M"\n', hot_on_cxl, 1 << 30, 1_000) \
        .total_moved_bytes == 4 * MiB


@probe("policy", "high_watermark")
def _(ctx):
    """A 0.90 high watermark: DRAM 96 % full of cold blocks is under pressure and sheds to the low one."""
    low = "[policy]\nlow_watermark = 0.85\n"
    assert plan(ctx, low, cold_dram, 100 * MiB, 600_000).total_moved_bytes == 0
    assert moved(plan(ctx, low + "high_watermark = 0.9\n", cold_dram, 100 * MiB, 600_000),
                 Priority.DEMOTE) == 11 * MiB


@probe("policy", "low_watermark")
def _(ctx):
    """Under pressure, DRAM sheds down to the low watermark: 0.5 sheds 49 blocks where 0.95 sheds 4."""
    def full(t: BlockTable) -> None:
        read(t, region(t, 0, 99, Tier.DRAM, MiB), 0)
    assert moved(plan(ctx, "", full, 100 * MiB, 600_000), Priority.DEMOTE) == 4 * MiB
    assert moved(plan(ctx, "[policy]\nlow_watermark = 0.5\n", full, 100 * MiB, 600_000),
                 Priority.DEMOTE) == 49 * MiB


@probe("policy", "demote_only_under_pressure")
def _(ctx):
    """false, with the thresholds fill: cold blocks leave DRAM although it is far from full."""
    fill = '[policy]\nfill = "thresholds"\n'
    assert plan(ctx, fill, cold_dram, 1 << 30, 600_000).total_moved_bytes == 0
    assert moved(plan(ctx, fill + "demote_only_under_pressure = false\n", cold_dram, 1 << 30, 600_000),
                 Priority.DEMOTE) == 64 * MiB


@probe("policy", "demotion_reserve")
def _(ctx):
    """All of the budget reserved for demotions under pressure: no promotion this tick."""
    def pressed(t: BlockTable) -> None:
        read(t, region(t, 0, 99, Tier.DRAM, MiB), 0)
        read(t, region(t, 1, 20, Tier.CXL_DRAM, MiB), 1_000)
    assert moved(plan(ctx, "", pressed, 100 * MiB, 1_000), Priority.PROMOTE) > 0
    assert moved(plan(ctx, "[policy]\ndemotion_reserve = 1.0\n", pressed, 100 * MiB, 1_000),
                 Priority.PROMOTE) == 0


@probe("policy", "bins")
def _(ctx):
    """16 heat buckets: two blocks read 200 ms apart tie, and the one room in DRAM goes by the tie's
    order (the block registered later) instead of to the hotter one."""
    def close(t: BlockTable) -> None:
        read(t, region(t, 0, 1, Tier.CXL_DRAM), 1_000)
        read(t, region(t, 1, 1, Tier.CXL_DRAM), 800)
    fine = plan(ctx, "", close, 2.2 * MiB, 1_000)
    coarse = plan(ctx, "[policy]\nbins = 16\n", close, 2.2 * MiB, 1_000)
    assert fine.blocks.tolist() == [0] and coarse.blocks.tolist() == [1]


@probe("policy", "quotas")
def _(ctx):
    """A 4 MiB DRAM quota for the process: two of its hot blocks rise, not all of them."""
    def tenant(t: BlockTable) -> None:
        read(t, region(t, 0, 10, Tier.CXL_DRAM, tenant=f"pid:{PID}"), 1_000)
    assert moved(plan(ctx, "", tenant, 1 << 30, 1_000), Priority.PROMOTE) == 20 * MiB
    assert moved(plan(ctx, f'[policy.quotas]\n"pid:{PID}" = "4M"\n', tenant, 1 << 30, 1_000),
                 Priority.PROMOTE) == 4 * MiB


# ---- [prefetch]: the blocks a tick prefetches ahead of a scan -----------------------------------------

def scan_rows(first: int, n: int, t_ms: int) -> np.ndarray:
    out = np.zeros(n, ACCESS_DELTA_DTYPE)
    out["pid"], out["block_len"], out["count"] = PID, 4096, 1
    out["block_start"] = BASE + (first + np.arange(n)) * MiB
    out["last_seen_ns"] = t_ms * 1_000_000
    out["source"] = int(SampleSource.PMU)
    return out


def prefetched(ctx: Ctx, text: str = "", steps: tuple[int, ...] = (4, 4, 4)) -> int:
    """Blocks the third tick prefetches of a region on CXL memory read in order, ``steps`` blocks a
    tick (the daemon's table, policy and prefetcher)."""
    d = ctx.daemon(text)
    d.table.add_region(PID, BASE, 400 * MiB, MiB, node=1, tier=Tier.CXL_DRAM, sequential=True)
    d.policy.set_tiers([TierSpec(Tier.DRAM, (0,), 1 << 40), TierSpec(Tier.CXL_DRAM, (1,), 1 << 40)])
    first = 0
    for i, n in enumerate(steps):
        d.table.ingest(scan_rows(first, n, 100 * i))
        first += n
        p = d.policy.tick(d.table, now_ms=100 * i, budget_bytes=1 << 40)
    return int((p.priority == int(Priority.PREFETCH)).sum())


@probe("prefetch", "enabled")
def _(ctx):
    """Off: nothing is prefetched ahead of a scan."""
    assert prefetched(ctx) == 5 and prefetched(ctx, "[prefetch]\nenabled = false\n") == 0


@probe("prefetch", "min_runs")
def _(ctx):
    """Five forward advances before a region counts as a scan: after two, nothing yet."""
    assert prefetched(ctx, "[prefetch]\nmin_runs = 5\n") == 0


@probe("prefetch", "max_jump_blocks")
def _(ctx):
    """Advances of 4 blocks are seeks once the largest forward step is 2."""
    assert prefetched(ctx, "[prefetch]\nmax_jump_blocks = 2\n") == 0


@probe("prefetch", "max_window_blocks")
def _(ctx):
    """A window of at most 2 blocks."""
    assert prefetched(ctx, "[prefetch]\nmax_window_blocks = 2\n") == 2


@probe("prefetch", "min_window_blocks")
def _(ctx):
    """A window of at least 20 blocks."""
    assert prefetched(ctx, "[prefetch]\nmin_window_blocks = 20\n") == 20


@probe("prefetch", "lead_ms")
def _(ctx):
    """A 500 ms lead instead of one 100 ms tick: a window five times as long."""
    assert prefetched(ctx, "[prefetch]\nlead_ms = 500\n") == 21


@probe("prefetch", "rate_smoothing")
def _(ctx):
    """Only the newest advance counts: a scan speeding up gets the window of its new rate."""
    assert prefetched(ctx, steps=(4, 4, 12)) == 9
    assert prefetched(ctx, "[prefetch]\nrate_smoothing = 1.0\n", steps=(4, 4, 12)) == 13
