# SPDX-License-Identifier: Apache-2.0
"""Search the ``[heat]`` and ``[policy]`` settings on a trace, judged against Belady's MIN, and check
them on a part of the trace the search never saw.

Split: the trace's requests (or sampler rows) in arrival order; the last ``validate_fraction`` of them
are held out. Each part is expanded on its own, so the held-out part starts with empty memory (blocks
it shares with the tuning part are new to it).

Score of a setting on a part: the mean over the fast-tier capacities of ``(hit / Belady's hit +
fast-served / Belady's fast-served) / 2`` — the two ratios the acceptance of the policy is stated in.

Search: the defaults, then ``trials`` settings — a first third drawn at random from the ranges below,
the rest perturbations of the best so far (each knob moved with probability 1/2, by a factor on a log
scale or a step on a linear one). Deterministic for a seed.
"""
from __future__ import annotations

import dataclasses
import math
import random
from typing import Callable, Sequence

from tieringd.placement.heat import HeatConfig
from tieringd.placement.policy import PolicyConfig
from tieringd import simulate
from tieringd.simulate import policies
from tieringd.simulate.expand import Accesses
from tieringd.simulate.report import Result, summarize

# knob: (table, low, high, scale) — scale "log", "lin", or a tuple of choices
SPACE: dict[str, tuple] = {
    "weight_recency": ("heat", 0.0, 1.0, "lin"),
    "weight_frequency": ("heat", 0.0, 1.0, "lin"),
    "weight_position": ("heat", 0.0, 1.0, "lin"),
    "weight_sharing": ("heat", 0.0, 1.0, "lin"),
    "half_life_s": ("heat", 0.5, 600.0, "log"),
    "frequency_half_life_s": ("heat", 1.0, 600.0, "log"),
    "sharing_half_life_gain": ("heat", None, None, (0.0, 2.0, 5.0, 10.0, 20.0, 50.0)),
    "frequency_quantile": ("heat", None, None, (0.9, 0.99, 0.999, 1.0)),
    "lag_quantile": ("heat", None, None, (0.0, 0.75, 0.9)),
    "dram_threshold": ("policy", None, None, (0.2, 0.35, 0.5, 0.65, 0.8, 1.0)),
    "hysteresis": ("policy", 0.0, 0.2, "lin"),
    "high_watermark": ("policy", 0.7, 0.99, "lin"),
    "watermark_gap": ("policy", 0.02, 0.2, "lin"),
    "min_residency_ms": ("policy", None, None, (0.0, 1000.0, 3000.0, 10000.0)),
    "budget_share": ("policy", None, None, (0.25, 0.5, 1.0)),
}


@dataclasses.dataclass(frozen=True)
class Setting:
    """One point of the search: the two tables, and the share of the mover's rate it uses."""
    heat: HeatConfig
    policy: PolicyConfig
    budget_share: float = 1.0

    def knobs(self) -> dict[str, float]:
        h, p = self.heat, self.policy
        return {**{k: getattr(h, k) for k in ("weight_recency", "weight_frequency", "weight_position",
                                               "weight_sharing", "half_life_s", "frequency_half_life_s",
                                               "sharing_half_life_gain", "frequency_quantile",
                                               "lag_quantile")},
                "dram_threshold": p.thresholds[1] if len(p.thresholds) > 1 else p.thresholds[0],
                "hysteresis": p.hysteresis, "high_watermark": p.high_watermark,
                "watermark_gap": p.high_watermark - p.low_watermark, "min_residency_ms": p.min_residency_ms,
                "budget_share": self.budget_share}

    @classmethod
    def from_knobs(cls, k: dict[str, float], base: PolicyConfig) -> "Setting":
        w = [max(k[n], 0.0) for n in ("weight_recency", "weight_frequency", "weight_position", "weight_sharing")]
        if sum(w) <= 0:
            w[0] = 1.0
        heat = HeatConfig(weight_recency=w[0], weight_frequency=w[1], weight_position=w[2], weight_sharing=w[3],
                          half_life_s=k["half_life_s"], frequency_half_life_s=k["frequency_half_life_s"],
                          sharing_half_life_gain=k["sharing_half_life_gain"],
                          frequency_quantile=k["frequency_quantile"], lag_quantile=k["lag_quantile"])
        theta = k["dram_threshold"]
        high = min(max(k["high_watermark"], 0.05), 1.0)
        low = min(max(high - k["watermark_gap"], 0.01), high)
        pol = dataclasses.replace(base, thresholds=(max(theta, 0.8), theta, theta * 0.4),
                                  hysteresis=k["hysteresis"], high_watermark=high, low_watermark=low,
                                  min_residency_ms=k["min_residency_ms"])
        return cls(heat, pol, k["budget_share"])


@dataclasses.dataclass
class Part:
    """One part of the trace with its fixed references (Belady, transparent LRU/ARC, …) per capacity."""
    name: str
    acc: Accesses
    setup: simulate.Setup
    references: list[Result]

    def bound(self, frac: float) -> Result:
        return next(r for r in self.references if r.policy == "belady" and r.fast_capacity_fraction == frac)


@dataclasses.dataclass
class Trial:
    setting: Setting
    score: float                       # on the tuning part
    results: list[Result]


def split(trace, validate_fraction: float):
    """(tuning part, held-out part) of a trace read by simulate.traces: requests or rows by time."""
    from tieringd.simulate.traces import NativeTrace
    if not 0 < validate_fraction < 1:
        raise ValueError("validate_fraction must be in (0, 1)")
    if isinstance(trace, NativeTrace):
        cut = int(len(trace.rows) * (1 - validate_fraction))
        return NativeTrace(trace.rows[:cut]), NativeTrace(trace.rows[cut:])
    cut = int(len(trace.requests) * (1 - validate_fraction))
    if cut < 1 or cut >= len(trace.requests):
        raise ValueError(f"{len(trace.requests)} requests are too few to hold {validate_fraction:.0%} out")
    later = trace.requests[cut].arrival_ms
    held = [dataclasses.replace(r, arrival_ms=r.arrival_ms - later) for r in trace.requests[cut:]]
    return dataclasses.replace(trace, requests=trace.requests[:cut]), dataclasses.replace(trace, requests=held)


def evaluate(part: Part, setting: Setting, progress: Callable[[int], None] | None = None) -> list[Result]:
    """tieringd with ``setting`` on a part, at every capacity of its setup (side by side, one replay)."""
    setup = part.setup
    model = setup.model()
    model = dataclasses.replace(model, mover_bytes_s=model.mover_bytes_s * setting.budget_share)
    runs, meta = [], []
    for cap in setup.fast_capacities:
        cb = simulate.capacity_bytes(part.acc, cap)
        layout = simulate.layout_for(part.acc, setup, cb)
        runs.append(policies.make_run("tieringd", part.acc, layout, model, setting.heat, setting.policy))
        meta.append((layout, cb))
    policies.replay(part.acc, runs, model, progress)
    return [summarize("tieringd", part.acc, layout, r.tally, setup.costs, cb) for r, (layout, cb) in zip(runs, meta)]


def score(part: Part, results: Sequence[Result]) -> float:
    parts = []
    for r in results:
        b = part.bound(r.fast_capacity_fraction)
        parts.append((r.hit_rate / max(b.hit_rate, 1e-9) + r.fast_served / max(b.fast_served, 1e-9)) / 2)
    return sum(parts) / len(parts)


def _draw(rng: random.Random) -> dict[str, float]:
    k = {}
    for name, (_, lo, hi, scale) in SPACE.items():
        if isinstance(scale, tuple):
            k[name] = rng.choice(scale)
        elif scale == "log":
            k[name] = math.exp(rng.uniform(math.log(lo), math.log(hi)))
        else:
            k[name] = rng.uniform(lo, hi)
            if name.startswith("weight_") and rng.random() < 0.25:
                k[name] = 0.0
    return k


def _perturb(k: dict[str, float], rng: random.Random) -> dict[str, float]:
    out = dict(k)
    moved = False
    while not moved:
        for name, (_, lo, hi, scale) in SPACE.items():
            if rng.random() >= 0.5:
                continue
            moved = True
            if isinstance(scale, tuple):
                i = scale.index(out[name]) if out[name] in scale else 0
                out[name] = scale[min(max(i + rng.choice((-1, 1)), 0), len(scale) - 1)]
            elif scale == "log":
                out[name] = min(max(out[name] * math.exp(rng.gauss(0, 0.7)), lo), hi)
            else:
                out[name] = min(max(out[name] + rng.gauss(0, 0.15 * (hi - lo)), lo), hi)
    return out


def search(part: Part, trials: int, seed: int = 1, base: Setting | None = None,
           progress: Callable[[int], None] | None = None) -> list[Trial]:
    """The defaults (or ``base``) and ``trials`` more settings on ``part``, best first."""
    rng = random.Random(seed)
    start = base or Setting(HeatConfig(), PolicyConfig())
    done: list[Trial] = []

    def run(setting: Setting) -> Trial:
        results = evaluate(part, setting, progress)
        t = Trial(setting, score(part, results), results)
        done.append(t)
        return t

    best = run(start)
    knobs = start.knobs()
    explore = trials // 3
    for i in range(trials):
        k = _draw(rng) if i < explore else _perturb(best.setting.knobs() if best else knobs, rng)
        t = run(Setting.from_knobs(k, start.policy))
        if t.score > best.score:
            best = t
    return sorted(done, key=lambda t: -t.score)


def toml_snippet(setting: Setting, trained_on: str, mover_bytes_s: float) -> str:
    """The ``[heat]`` and ``[policy]`` tables of a setting, as tieringd.toml reads them."""
    h, p = setting.heat, setting.policy

    def num(x: float) -> str:
        return f"{x:.4g}" if not float(x).is_integer() else f"{x:.1f}"

    lines = [f"# tieringctl tune: best setting on {trained_on}",
             "[heat]"]
    for name in ("weight_recency", "weight_frequency", "weight_position", "weight_sharing", "half_life_s",
                 "frequency_half_life_s", "sharing_half_life_gain", "frequency_quantile", "lag_quantile"):
        lines.append(f"{name} = {num(getattr(h, name))}")
    lines += ["", "[policy]",
              "thresholds = [" + ", ".join(num(t) for t in p.thresholds) + "]",
              f"hysteresis = {num(p.hysteresis)}",
              f"high_watermark = {num(p.high_watermark)}",
              f"low_watermark = {num(p.low_watermark)}",
              f"min_residency_ms = {num(p.min_residency_ms)}"]
    if setting.budget_share < 1:
        lines.append(f"# {setting.budget_share:g} of the simulated mover's {mover_bytes_s / 1e6:.0f} MB/s; on a "
                     f"machine, use that share of what its mover measures")
        lines.append(f"migration_rate_mb_s = {num(setting.budget_share * mover_bytes_s / 1e6)}")
    return "\n".join(lines) + "\n"
