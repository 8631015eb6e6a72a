# SPDX-License-Identifier: Apache-2.0
"""``tieringctl simulate TRACE``: replay a KV trace against tieringd's policy and the transparent forms
of LRU, ARC and LFU (one mover model, one view of the accesses), the demand caches and static
first-fit as references, and Belady's MIN as the bound; print hit rate, the share of accesses the
fast tier served, per-tier shares, bytes migrated, effective bandwidth and stall time for each
fast-tier capacity. ``--json``: schema ``tieringd.simulate/2``; ``--plot``: PNG of hit rate against
capacity. docs/simulator.md describes the trace formats, the model and its limits."""
from __future__ import annotations

import math
import os
import sys
from typing import Sequence

import click

from tieringd import config as config_mod
from tieringd import simulate
from tieringd.placement.blocksize import load_model
from tieringd.cli._output import emit_json, fail, human_bytes, need_matplotlib, table
from tieringd.placement.heat import HeatConfig
from tieringd.placement.policy import PolicyConfig
from tieringd.units import parse_size
from tieringd.simulate.cost import CostError, reference_costs, load_costs
from tieringd.simulate.report import SCHEMA, Result, plot
from tieringd.simulate.traces import FORMATS, TraceError

DEFAULT_CAPACITIES = ("5%", "10%", "25%", "50%")


def render_table(results: Sequence[Result]) -> str:
    """One row per (capacity, policy): hit rate, fast-served share, per-tier shares, migration,
    bandwidth, stall; references and the bound are marked."""
    tiers = list(results[0].tier_share)[1:] if results else []
    headers = ["fast capacity", "policy", "hit rate", "fast-served"] + [f"{t} %" for t in tiers] + \
        ["migrated", "eff. GB/s", "stall s"]
    rows = []
    for r in results:
        label = r.policy + {"transparent": "", "reference": " (ref)", "bound": " (bound)"}[r.kind]
        rows.append([f"{human_bytes(r.fast_capacity_bytes)} ({100 * r.fast_capacity_fraction:.0f}%)", label,
                     f"{100 * r.hit_rate:.1f}%", f"{100 * r.fast_served:.1f}%"] +
                    [f"{100 * r.tier_share[t]:.1f}" for t in tiers] +
                    [human_bytes(r.migrated_bytes), f"{r.effective_bandwidth_mb_s / 1000:.1f}", f"{r.stall_s:.3f}"])
    return table(headers, rows, right=set(range(2, len(headers))))


def parse_capacity(text: str) -> int | float:
    """"25%" → 0.25 (of the trace's distinct bytes); "64GiB" → bytes."""
    t = text.strip()
    if t.endswith("%"):
        try:
            frac = float(t[:-1]) / 100
        except ValueError:
            raise click.BadParameter(f"not a percentage: {text!r}") from None
        if not 0 < frac <= 1:
            raise click.BadParameter(f"a percentage in (0, 100]: {text!r}")
        return frac
    try:
        return parse_size(t)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@click.command("simulate")
@click.argument("trace", type=click.Path(dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(("auto",) + FORMATS), default="auto", show_default=True,
              help="Trace format (auto: from the first record).")
@click.option("--policy", "policies", multiple=True, type=click.Choice(simulate.POLICIES),
              help="Policy to run (repeatable; default: " + ", ".join(simulate.DEFAULT_POLICIES) + ").")
@click.option("--fast-capacity", "capacities", multiple=True, metavar="SIZE|PCT",
              help="DRAM for KV blocks: 64GiB, or 25% of the trace's distinct KV bytes (repeatable; "
                   "default: 5%, 10%, 25%, 50%).")
@click.option("--cxl-capacity", default=None, metavar="SIZE",
              help="CXL DRAM size; with it, PMEM holds what does not fit (default: CXL is unbounded).")
@click.option("--model", default="llama-3.1-8b", show_default=True,
              help="KV bytes per token from a known model name or a Hugging Face config.json.")
@click.option("--kv-bytes-per-token", type=click.IntRange(min=1), default=None, help="Overrides --model.")
@click.option("--tick-ms", type=click.FloatRange(min=1), default=250.0, show_default=True,
              help="Simulation window: the transparent policies tick once per window and see its reads at "
                   "its end (the daemon: 100 ms sampler interval + 100 ms tick + the move).")
@click.option("--tpot-ms", type=click.FloatRange(min=0.01), default=30.0, show_default=True,
              help="Time per output token during decode.")
@click.option("--prefill-tokens-per-s", type=click.FloatRange(min=1), default=8000.0, show_default=True)
@click.option("--prefill-chunk-tokens", type=click.IntRange(min=0), default=2048, show_default=True,
              help="Chunked prefill: each chunk reads the cached prefix and the chunks before it "
                   "(0: one read per input block at arrival, the model of tieringd.simulate/1).")
@click.option("--mover-gb-s", type=click.FloatRange(min=0.001), default=None,
              help="Mover bandwidth for every transparent policy (default: 10% of the slowest tier's "
                   "read bandwidth, 16 GB/s with the reference figures).")
@click.option("--delay-windows", type=click.IntRange(min=0), default=0, show_default=True,
              help="Extra windows before a read is seen by the transparent policies.")
@click.option("--sample-fraction", type=click.FloatRange(min=0.0001, max=1.0), default=1.0, show_default=True,
              help="Share of reads the transparent policies see (hint faults and PMU samples see few).")
@click.option("--topology", "topology_path", type=click.Path(dir_okay=False), default=None,
              help="Measured tier costs (JSON; `tieringctl numa --json` output works). Default: the reference cost table.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="tieringd.toml whose [heat] and [policy] tables tieringd's policy uses.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Read only the first N records.")
@click.option("--block-tokens", type=click.IntRange(min=1), default=None,
              help="Tokens per simulated block, a multiple of the trace's: finer ids are grouped into chained "
                   "blocks (default: the trace's own, mooncake 512, bailian 16; native traces record theirs).")
@click.option("--trace-block-tokens", type=click.IntRange(min=1), default=None,
              help="Tokens per hash id in the trace's records, where they are not the format's.")
@click.option("--spool-dir", type=click.Path(file_okay=False), default=None,
              help="Where the expanded accesses wait while they are replayed, about 28 bytes per access "
                   "(default: the system's temporary directory).")
@click.option("--jobs", type=click.IntRange(min=0), default=0, show_default=True,
              help="Processes the runs (policy × capacity) are shared out among; 0: one per CPU this "
                   "process may use.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (schema tieringd.simulate/2).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG of hit rate against fast-tier capacity for every policy.")
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: when stderr is a terminal).")
def command(trace, fmt, policies, capacities, cxl_capacity, model, kv_bytes_per_token, tick_ms, tpot_ms,
            prefill_tokens_per_s, prefill_chunk_tokens, mover_gb_s, delay_windows, sample_fraction, topology_path,
            config_path, limit, block_tokens, trace_block_tokens, spool_dir, jobs, as_json, plot_path,
            progress) -> None:
    """Replay TRACE (Mooncake FAST'25 JSONL, Alibaba Bailian JSONL, or a native sampler trace) and
    compare placement policies; Belady's MIN is the upper bound on hit rate."""
    if plot_path:
        need_matplotlib("--plot")
    try:
        caps = [parse_capacity(c) for c in (capacities or DEFAULT_CAPACITIES)]
        cfg = config_mod.load(config_path) if config_path else {}
        heat = config_mod.from_table(HeatConfig, "heat", config_mod.section(cfg, "heat"))
        pcfg = config_mod.from_table(PolicyConfig, "policy", config_mod.section(cfg, "policy"))
        kv = kv_bytes_per_token or load_model(model).kv_bytes_per_token
        costs = load_costs(topology_path) if topology_path else reference_costs()
        cxl = parse_size(cxl_capacity) if cxl_capacity else math.inf
        rm = simulate.RequestModel(kv_bytes_per_token=kv, tick_ms=tick_ms, tpot_ms=tpot_ms,
                                   prefill_tokens_per_s=prefill_tokens_per_s,
                                   prefill_chunk_tokens=prefill_chunk_tokens,
                                   position_half_life_tokens=heat.position_half_life_tokens)
        acc = simulate.load_accesses(trace, fmt, rm, limit, block_tokens, trace_block_tokens, spool_dir)
    except click.BadParameter as e:
        fail(f"--fast-capacity: {e.message}", 2)
    except (TraceError, CostError, config_mod.ConfigError, ValueError) as e:
        fail(str(e))
    except OSError as e:
        fail(f"cannot spool the accesses{' in ' + spool_dir if spool_dir else ''}: {e.strerror}")
    setup = simulate.Setup(fast_capacities=caps, policies=policies or simulate.DEFAULT_POLICIES,
                           cxl_capacity_bytes=cxl, costs=costs, heat=heat, policy=pcfg,
                           mover_bytes_s=mover_gb_s * 1e9 if mover_gb_s else None, delay_windows=delay_windows,
                           sample_fraction=sample_fraction)
    total = len(acc) * len(setup.policies) * len(caps)
    show = sys.stderr.isatty() if progress is None else progress
    jobs = jobs or len(os.sched_getaffinity(0))
    if show:
        with click.progressbar(length=total, label="simulating", file=sys.stderr) as bar:
            results = simulate.run(acc, setup, bar.update, jobs=jobs)
    else:
        results = simulate.run(acc, setup, jobs=jobs)
    title = f"{acc.description}; {len(acc)} accesses, {human_bytes(acc.unique_bytes)} distinct; " \
        f"{setup.model().describe()}"
    if plot_path:
        try:
            plot(results, plot_path, title)
        except OSError as e:
            fail(f"cannot write {plot_path}: {e.strerror}")
    if as_json:
        emit_json(SCHEMA, {"trace": trace, "description": acc.description, "accesses": len(acc),
                           "blocks": acc.nblocks, "block_bytes": acc.block_bytes, "tick_ms": acc.tick_ms,
                           "kv_bytes_per_token": kv, "mover_bytes_s": setup.model().mover_bytes_s,
                           "delay_windows": delay_windows, "sample_fraction": sample_fraction, "plot": plot_path,
                           "results": [r.as_dict() for r in results]})
        return
    click.echo(title)
    click.echo(render_table(results))
    if plot_path:
        click.echo(f"wrote {plot_path}")
