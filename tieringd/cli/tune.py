# SPDX-License-Identifier: Apache-2.0
"""``tieringctl tune TRACE``: search tieringd's ``[heat]`` weights and half-lives and ``[policy]``
thresholds, hysteresis, watermarks, residency and budget on the first part of a trace; print the best
setting against the defaults, transparent LRU and ARC and Belady's MIN on that part and on the
held-out rest; write the best as a TOML snippet tieringd reads. The search is in tieringd/simulate/tune.py;
``--json``: schema ``tieringd.tune/1`` (docs/json.md)."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from typing import Any

import click

from tieringd import config as config_mod
from tieringd import simulate
from tieringd.simulate import tune
from tieringd.placement.blocksize import load_model
from tieringd.cli._output import emit_json, fail, human_bytes, table
from tieringd.cli.simulate import parse_capacity
from tieringd.placement.heat import HeatConfig
from tieringd.placement.policy import PolicyConfig
from tieringd.simulate import expand, traces
from tieringd.simulate.cost import CostError, reference_costs, load_costs
from tieringd.simulate.traces import FORMATS, TraceError

SCHEMA = "tieringd.tune/1"
REFERENCES = ("lru", "arc", "belady")


def _expand(trace, rm: simulate.RequestModel, spool_dir: str | None):
    return expand.spool_trace(trace, rm, spool_dir)


def _units(trace) -> tuple[str, int]:
    if isinstance(trace, traces.NativeTrace):
        return "rows", len(trace.rows)
    return "requests", len(trace.requests)


def _rows(part: tune.Part, best, defaults) -> list[list[str]]:
    rows = []
    for cap in part.setup.fast_capacities:
        frac = simulate.capacity_bytes(part.acc, cap) / max(part.acc.unique_bytes, 1)
        bound = next(r for r in part.references if r.policy == "belady" and abs(r.fast_capacity_fraction - frac) < 1e-9)
        entries = [("tieringd (best)", r) for r in best if abs(r.fast_capacity_fraction - frac) < 1e-9] + \
            [("tieringd (defaults)", r) for r in defaults if abs(r.fast_capacity_fraction - frac) < 1e-9] + \
            [(r.policy + (" (bound)" if r.policy == "belady" else ""), r) for r in part.references
             if abs(r.fast_capacity_fraction - frac) < 1e-9]
        for label, r in entries:
            rows.append([part.name, f"{human_bytes(r.fast_capacity_bytes)} ({100 * frac:.0f}%)", label,
                         f"{100 * r.hit_rate:.1f}%", f"{r.hit_rate / max(bound.hit_rate, 1e-9):.3f}",
                         f"{100 * r.fast_served:.1f}%", f"{r.fast_served / max(bound.fast_served, 1e-9):.3f}",
                         human_bytes(r.migrated_bytes)])
    return rows


@click.command("tune")
@click.argument("trace", type=click.Path(dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(("auto",) + FORMATS), default="auto", show_default=True)
@click.option("--fast-capacity", "capacities", multiple=True, metavar="SIZE|PCT",
              help="Fast-tier capacities to tune for (repeatable; default: 5% and 10%).")
@click.option("--validate-fraction", type=click.FloatRange(0.05, 0.9), default=0.3, show_default=True,
              help="The last share of the trace's requests (by arrival) held out for validation.")
@click.option("--trials", type=click.IntRange(min=0), default=30, show_default=True,
              help="Settings tried besides the defaults.")
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--model", default="llama-3.1-8b", show_default=True)
@click.option("--kv-bytes-per-token", type=click.IntRange(min=1), default=None)
@click.option("--tick-ms", type=click.FloatRange(min=1), default=250.0, show_default=True,
              help="Simulation window (see tieringctl simulate --help).")
@click.option("--tpot-ms", type=click.FloatRange(min=0.01), default=30.0, show_default=True)
@click.option("--prefill-tokens-per-s", type=click.FloatRange(min=1), default=8000.0, show_default=True)
@click.option("--prefill-chunk-tokens", type=click.IntRange(min=0), default=2048, show_default=True,
              help="Chunked prefill: each chunk reads the cached prefix and the chunks before it "
                   "(0: one read per input block at arrival, the model of tieringd.simulate/1).")
@click.option("--mover-gb-s", type=click.FloatRange(min=0.001), default=None,
              help="Mover bandwidth of the model (default: 10% of the slowest tier's read bandwidth).")
@click.option("--delay-windows", type=click.IntRange(min=0), default=0, show_default=True,
              help="Extra windows before a read is seen (see tieringctl simulate --help).")
@click.option("--sample-fraction", type=click.FloatRange(min=0.0001, max=1.0), default=1.0, show_default=True,
              help="Share of reads the policies see: tune for the signal the daemon really gets.")
@click.option("--topology", "topology_path", type=click.Path(dir_okay=False), default=None)
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="tieringd.toml whose [heat] and [policy] are the starting point (default: the defaults).")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Read only the first N records.")
@click.option("--block-tokens", type=click.IntRange(min=1), default=None,
              help="Tokens per simulated block (see tieringctl simulate --help).")
@click.option("--trace-block-tokens", type=click.IntRange(min=1), default=None,
              help="Tokens per hash id in the trace's records, where they are not the format's.")
@click.option("--spool-dir", type=click.Path(file_okay=False), default=None,
              help="Where the expanded accesses wait (default: the system's temporary directory).")
@click.option("-o", "--output", "output", type=click.Path(dir_okay=False), default="tieringd-tuned.toml",
              show_default=True, help="Where to write the [heat]/[policy] snippet ('-': stdout only).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (schema tieringd.tune/1).")
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: when stderr is a terminal).")
def command(trace, fmt, capacities, validate_fraction, trials, seed, model, kv_bytes_per_token, tick_ms, tpot_ms,
            prefill_tokens_per_s, prefill_chunk_tokens, mover_gb_s, delay_windows, sample_fraction, topology_path,
            config_path, limit, block_tokens, trace_block_tokens, spool_dir, output, as_json, progress) -> None:
    """Tune tieringd's policy on TRACE and validate it on the trace's held-out last part."""
    try:
        caps = [parse_capacity(c) for c in (capacities or ("5%", "10%"))]
        cfg = config_mod.load(config_path) if config_path else {}
        heat = config_mod.from_table(HeatConfig, "heat", config_mod.section(cfg, "heat"))
        pcfg = config_mod.from_table(PolicyConfig, "policy", config_mod.section(cfg, "policy"))
        kv = kv_bytes_per_token or load_model(model).kv_bytes_per_token
        costs = load_costs(topology_path) if topology_path else reference_costs()
        rm = simulate.RequestModel(kv_bytes_per_token=kv, tick_ms=tick_ms, tpot_ms=tpot_ms,
                                   prefill_tokens_per_s=prefill_tokens_per_s,
                                   prefill_chunk_tokens=prefill_chunk_tokens,
                                   position_half_life_tokens=heat.position_half_life_tokens)
        whole = traces.read(trace, fmt, limit, trace_block_tokens, block_tokens)
        tuning, held = tune.split(whole, validate_fraction)
        parts_acc = [("tune", _expand(tuning, rm, spool_dir)), ("held-out", _expand(held, rm, spool_dir))]
    except click.BadParameter as e:
        fail(f"--fast-capacity: {e.message}", 2)
    except (TraceError, CostError, config_mod.ConfigError, ValueError) as e:
        fail(str(e))
    except OSError as e:
        fail(f"cannot spool the accesses: {e.strerror}")
    setup = simulate.Setup(fast_capacities=caps, policies=REFERENCES, costs=costs, heat=heat, policy=pcfg,
                           mover_bytes_s=mover_gb_s * 1e9 if mover_gb_s else None, delay_windows=delay_windows,
                           sample_fraction=sample_fraction)
    unit, count = _units(whole)
    cut = count - _units(held)[1]
    split_text = (f"tuned on {unit} 1–{cut} (the first {100 * (1 - validate_fraction):.0f}% by arrival); "
                  f"held out: {unit} {cut + 1}–{count} (the last {100 * validate_fraction:.0f}%)")
    a_len, b_len = len(parts_acc[0][1]), len(parts_acc[1][1])
    total = (a_len + b_len) * len(caps) * len(REFERENCES) + a_len * len(caps) * (trials + 1) + b_len * len(caps) * 2
    show = sys.stderr.isatty() if progress is None else progress
    bar_cm = click.progressbar(length=total, label="tuning", file=sys.stderr) if show else contextlib.nullcontext()
    t0 = time.monotonic()
    with bar_cm as bar:
        step = bar.update if show else None
        parts = [tune.Part(name, acc, setup, simulate.run(acc, setup, step)) for name, acc in parts_acc]
        start = tune.Setting(heat, pcfg)
        tried = tune.search(parts[0], trials, seed, start, step)
        best = tried[0]
        defaults = next(t for t in tried if t.setting == start)
        held_best = tune.evaluate(parts[1], best.setting, step)
        held_defaults = tune.evaluate(parts[1], start, step)
    wall = time.monotonic() - t0
    snippet = tune.toml_snippet(best.setting, f"{trace} ({split_text})", setup.model().mover_bytes_s)
    if output != "-":
        try:
            with open(output, "w", encoding="utf-8") as f:
                f.write(snippet)
        except OSError as e:
            fail(f"cannot write {output}: {e.strerror}")
    tuned = _Tuned(trace, split_text, setup, parts, tried, best, defaults, held_best, held_defaults,
                   start, wall, snippet)
    if as_json:
        _emit(tuned, {"validate_fraction": validate_fraction, "seed": seed, "delay_windows": delay_windows,
                      "sample_fraction": sample_fraction, "tick_ms": tick_ms}, output)
    else:
        _print(tuned, output)


@dataclasses.dataclass
class _Tuned:
    """What a search found, for either output."""
    trace: str
    split_text: str
    setup: simulate.Setup
    parts: list
    tried: list
    best: Any
    defaults: Any
    held_best: list
    held_defaults: list
    start: Any
    wall: float
    snippet: str


def _emit(t: _Tuned, run: dict, output: str) -> None:
    """``--json``: the ``tieringd.tune/1`` document."""
    def res(rs):
        return [r.as_dict() for r in rs]
    parts = t.parts
    emit_json(SCHEMA, {
        "trace": t.trace, "split": t.split_text, "validate_fraction": run["validate_fraction"],
        "trials": len(t.tried), "seed": run["seed"], "wall_s": round(t.wall, 1),
        "mover_bytes_s": t.setup.model().mover_bytes_s, "delay_windows": run["delay_windows"],
        "sample_fraction": run["sample_fraction"], "tick_ms": run["tick_ms"],
        "score": {"tune": {"best": t.best.score, "defaults": t.defaults.score},
                  "held_out": {"best": tune.score(parts[1], t.held_best),
                               "defaults": tune.score(parts[1], t.held_defaults)}},
        "best": t.best.setting.knobs(), "defaults": t.start.knobs(),
        "results": {"tune": {"best": res(t.best.results), "defaults": res(t.defaults.results),
                             "references": res(parts[0].references)},
                    "held_out": {"best": res(t.held_best), "defaults": res(t.held_defaults),
                                 "references": res(parts[1].references)}},
        "toml": t.snippet, "output": None if output == "-" else output})


def _print(t: _Tuned, output: str) -> None:
    """The text report: scores, the table of both parts, the settings, the TOML (or where it went)."""
    trace, split_text, tried, best, defaults = t.trace, t.split_text, t.tried, t.best, t.defaults
    parts, held_best, held_defaults, setup, wall, snippet = \
        t.parts, t.held_best, t.held_defaults, t.setup, t.wall, t.snippet
    knobs_best, knobs_default = best.setting.knobs(), t.start.knobs()
    click.echo(f"{trace}: {split_text}")
    click.echo(f"{len(tried)} settings in {wall:.0f} s; {setup.model().describe()}; score = mean over capacities "
               f"of (hit/Belady + fast-served/Belady) / 2")
    click.echo(f"score: tune best {best.score:.3f}, defaults {defaults.score:.3f}; held-out best "
               f"{tune.score(parts[1], held_best):.3f}, defaults {tune.score(parts[1], held_defaults):.3f}")
    headers = ["part", "fast capacity", "policy", "hit rate", "÷ Belady", "fast-served", "÷ Belady", "migrated"]
    tune_rows = _rows(parts[0], best.results, defaults.results) + _rows(parts[1], held_best, held_defaults)
    click.echo(table(headers, tune_rows, right=set(range(3, 8))))
    knob_rows = [[k, _fmt(knobs_default[k]), _fmt(knobs_best[k])] for k in knobs_best]
    click.echo(table(["setting", "defaults", "best"], knob_rows, right={1, 2}))
    if output == "-":
        click.echo(snippet, nl=False)
    else:
        click.echo(f"wrote {output}")


def _fmt(x: float) -> str:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return f"{x:.4g}"
