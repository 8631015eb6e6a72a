# SPDX-License-Identifier: Apache-2.0
"""[heat] and [blocksize]: what each key does to the heat of a block in the daemon's block table
(``BlockTable(settings.heat)``, as ``Daemon._start`` builds it), and to the block size the region book
gives a region (``settings.blocksize``, the book's sizer)."""
from __future__ import annotations

import numpy as np

from tieringd.contracts import ACCESS_DELTA_DTYPE, SampleSource, Tier

from keyprobe import Ctx, probe

MiB = 1 << 20
GiB = 1 << 30
BASE = 0x7F00_0000_0000
PID = 7
# block → (accesses, when in ms); block 3 is never read. The heat is taken at NOW_MS.
READS = {0: (1, 9_000), 1: (5, 0), 2: (100, 0)}
NOW_MS = 10_000


def rows(reads: dict[int, tuple[int, int]]) -> np.ndarray:
    out = np.zeros(len(reads), ACCESS_DELTA_DTYPE)
    for i, (block, (count, t_ms)) in enumerate(reads.items()):
        out[i] = (PID, BASE + block * 2 * MiB, 2 * MiB, count, t_ms * 1_000_000, int(SampleSource.PMU))
    return out


def heat(ctx: Ctx, text: str = "", sharers: int = 1, frontier: int | None = None) -> np.ndarray:
    """The heat of four 2 MiB blocks read as READS says (block 1 used by ``sharers`` processes,
    the decode position at ``frontier``), in the daemon's table built from ``text``."""
    t = ctx.daemon(text).table
    rid = t.add_region(PID, BASE, 8 * MiB, 2 * MiB, node=0, tier=Tier.DRAM)
    t.ingest(rows(READS))
    t.set_sharers(np.array([1]), np.array([sharers]))
    if frontier is not None:
        t.set_frontier(rid, frontier)
    return t.compute_heat(NOW_MS).copy()


@probe("heat", "weight_recency")
def _(ctx):
    """A small recency weight: the block read 1 s ago loses most of its heat."""
    assert heat(ctx)[0] > 0.9 and heat(ctx, "[heat]\nweight_recency = 0.001\n")[0] < 0.4


@probe("heat", "weight_frequency")
def _(ctx):
    """Weighing frequency: the block read 100 times 10 s ago outranks the one read once 1 s ago."""
    base, freq = heat(ctx), heat(ctx, "[heat]\nweight_frequency = 1.0\n")
    assert base[0] > base[2] and freq[2] > freq[0]


@probe("heat", "weight_position")
def _(ctx):
    """Weighing position: the never-read block at the decode position gains heat."""
    base = heat(ctx, frontier=3)
    pos = heat(ctx, "[heat]\nweight_position = 1.0\n", frontier=3)
    assert pos[3] > base[3] + 0.1


@probe("heat", "weight_sharing")
def _(ctx):
    """A heavy sharing weight: the shared block idle 10 s outranks the private one read 1 s ago."""
    base, shared = heat(ctx, sharers=4), heat(ctx, "[heat]\nweight_sharing = 1.0\n", sharers=4)
    assert base[0] > base[1] and shared[1] > shared[0]


@probe("heat", "half_life_s")
def _(ctx):
    """A 1 s half-life: the block idle 1 s is at half its heat (12 s: 94 %)."""
    assert heat(ctx)[0] > 0.9 and abs(heat(ctx, "[heat]\nhalf_life_s = 1.0\n")[0] - 0.5) < 0.01


@probe("heat", "sharing_half_life_gain")
def _(ctx):
    """No gain: the shared block idle 10 s cools as fast as a private one."""
    base = heat(ctx, sharers=4)
    plain = heat(ctx, "[heat]\nsharing_half_life_gain = 0.0\n", sharers=4)
    assert base[1] > plain[1] + 0.2 and abs(plain[1] - plain[2]) < 0.01


@probe("heat", "frequency_half_life_s")
def _(ctx):
    """With frequency weighed, a 0.5 s count half-life forgets the 100 reads of 10 s ago."""
    base = heat(ctx, "[heat]\nweight_frequency = 1.0\n")
    quick = heat(ctx, "[heat]\nweight_frequency = 1.0\nfrequency_half_life_s = 0.5\n")
    assert base[2] > quick[2] + 0.3


@probe("heat", "position_half_life_tokens")
def _(ctx):
    """With position weighed, a 16-token half-life: three blocks behind the decode position is far."""
    base = heat(ctx, "[heat]\nweight_position = 1.0\n", frontier=3)
    short = heat(ctx, "[heat]\nweight_position = 1.0\nposition_half_life_tokens = 16.0\n", frontier=3)
    assert base[0] > short[0] + 0.3


@probe("heat", "frequency_quantile")
def _(ctx):
    """With frequency weighed, the reference at the lowest quantile: 5 reads count as the most."""
    base = heat(ctx, "[heat]\nweight_frequency = 1.0\n")
    low = heat(ctx, "[heat]\nweight_frequency = 1.0\nfrequency_quantile = 0.01\n")
    assert low[1] > base[1] + 0.2


@probe("heat", "lag_quantile")
def _(ctx):
    """Samples delivered 500 ms late: the measured lag is taken off a block's idle time, unless 0."""
    def lagged(text: str) -> tuple[float, float]:
        t = ctx.daemon(text).table
        t.add_region(PID, BASE, 2 * MiB, 2 * MiB, node=0, tier=Tier.DRAM)
        for k in range(10):          # read all the time, each sample delivered 500 ms after it
            t.ingest(rows({0: (1, 100 * k)}), seen_ns=(100 * k + 500) * 1_000_000)
        return t.lag_ms, float(t.compute_heat(1_900)[0])
    (lag, hot), (none, cold) = lagged(""), lagged("[heat]\nlag_quantile = 0.0\n")
    assert lag > 100 and none == 0 and hot > cold


# ---- [blocksize]: the region book's block size for a region --------------------------------------------

def block(ctx: Ctx, text: str, region_bytes: int) -> tuple[int, int]:
    """(tokens per block, bytes per block) the book gives a region of ``region_bytes``."""
    return ctx.settings(text).blocksize.block_bytes(region_bytes)


@probe("blocksize", "kv_bytes_per_token")
def _(ctx):
    """4 KiB per token instead of llama-3.1-8b's 128 KiB: 1 GiB is a long region of 32-token blocks."""
    assert block(ctx, "", GiB) == (16, 16 * 128 * 1024)
    assert block(ctx, '[blocksize]\nkv_bytes_per_token = "4K"\n', GiB) == (32, 32 * 4096)


@probe("blocksize", "model")
def _(ctx):
    """llama-3.1-70b (320 KiB per token): larger blocks for the same region."""
    assert block(ctx, '[blocksize]\nmodel = "llama-3.1-70b"\n', GiB) == (8, 8 * 320 * 1024)


@probe("blocksize", "small_tokens")
def _(ctx):
    """A short region (2048 tokens) gets 4-token blocks instead of 8."""
    assert block(ctx, "", 256 * MiB)[0] == 8
    assert block(ctx, "[blocksize]\nsmall_tokens = 4\n", 256 * MiB)[0] == 4


@probe("blocksize", "medium_tokens")
def _(ctx):
    """A region of 8192 tokens gets 64-token blocks instead of 16."""
    assert block(ctx, "[blocksize]\nmedium_tokens = 64\n", GiB) == (64, 64 * 128 * 1024)


@probe("blocksize", "large_tokens")
def _(ctx):
    """A long region (65536 tokens) gets 128-token blocks instead of 32."""
    assert block(ctx, "", 8 * GiB)[0] == 32
    assert block(ctx, "[blocksize]\nlarge_tokens = 128\n", 8 * GiB)[0] == 128


@probe("blocksize", "short_below_tokens")
def _(ctx):
    """Short means under 1024 tokens: a region of 2048 tokens gets medium blocks."""
    assert block(ctx, "[blocksize]\nshort_below_tokens = 1024\n", 256 * MiB)[0] == 16


@probe("blocksize", "long_above_tokens")
def _(ctx):
    """Long means over 4096 tokens: a region of 8192 tokens gets large blocks."""
    assert block(ctx, "[blocksize]\nlong_above_tokens = 4096\n", GiB)[0] == 32
