# SPDX-License-Identifier: Apache-2.0
"""``tieringctl sample --pid P --seconds N``: the hottest blocks of a process, per access source.

Tracks P at all addresses (``--block-size`` blocks) with every sampler that runs here — or the
accessed-bit fallback when BPF cannot — for N seconds, reading deltas every ``--interval-ms``, and
prints the blocks with the most samples per source (or ``--json``, schema tieringd.sample/1).
"""
from __future__ import annotations

import time

import click
import numpy as np

from tieringd.cli._output import emit_json, fail, human_bytes, table
from tieringd.contracts import SampleSource

SCHEMA = "tieringd.sample/1"


def accumulate(total: dict, rows: np.ndarray) -> None:
    """{(source, pid, block_start): [block_len, count, last_seen_ns]} += rows."""
    for r in rows.tolist():
        pid, start, blen, count, last, src = r
        key = (src, pid, start)
        cur = total.get(key)
        if cur is None:
            total[key] = [blen, count, last]
        else:
            cur[0] = max(cur[0], blen)
            cur[1] += count
            cur[2] = max(cur[2], last)


def hottest(total: dict, top: int) -> dict[str, list[dict]]:
    by_source: dict[str, list[dict]] = {}
    for (src, pid, start), (blen, count, last) in total.items():
        by_source.setdefault(SampleSource(src).name.lower(), []).append(
            {"pid": pid, "block_start": start, "block_len": blen, "count": count, "last_seen_ns": last})
    for name, rows in by_source.items():
        rows.sort(key=lambda r: (-r["count"], r["block_start"]))
        del rows[top:]
    return by_source


@click.command("sample")
@click.option("--pid", "pid", type=int, required=True, help="Process to sample.")
@click.option("--seconds", type=float, default=5.0, show_default=True, help="How long to sample.")
@click.option("--interval-ms", type=int, default=500, show_default=True, help="Delta read interval.")
@click.option("--block-size", default="2M", show_default=True,
              help="Block size for the process's addresses (power of two, 4K…1G).")
@click.option("--source", "sources", default="auto", show_default=True,
              help="Comma list of fault, pmu, dma; or auto (all that run here).")
@click.option("--pmu-event", default="auto", show_default=True,
              help="auto, amd-ibs-op, intel-mem-loads or software-page-faults.")
@click.option("--fallback", default="auto", show_default=True,
              help="Accessed-bit fallback when BPF is unavailable: auto, damon, idle-page, none.")
@click.option("--top", type=int, default=10, show_default=True, help="Blocks shown per source.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (tieringd.sample/1).")
def command(pid, seconds, interval_ms, block_size, sources, pmu_event, fallback, top, as_json):
    """Show the hottest blocks of process PID per access source."""
    from tieringd import _sysfs
    from tieringd.units import parse_size
    from tieringd.sampling import SOURCES, TrackedSet, TrackingError, open_samplers

    if not _sysfs.exists(f"/proc/{pid}"):
        fail(f"no process {pid}")
    if seconds <= 0 or interval_ms <= 0 or top <= 0:
        fail("--seconds, --interval-ms and --top must be positive")
    names = tuple(SOURCES) if sources == "auto" else tuple(s.strip() for s in sources.split(","))
    unknown = [s for s in names if s not in SOURCES]
    if unknown:
        fail(f"unknown source {unknown[0]!r}: choose from {', '.join(SOURCES)}")
    tracked = TrackedSet()
    try:
        tracked.add_process(pid, all_addresses=True,
                            default_block_len=parse_size(block_size, "--block-size"))
    except (TrackingError, ValueError) as e:
        fail(str(e))
    sset = open_samplers(tracked, sources=names, fallback=fallback, pmu_event=pmu_event,
                         migrations=False)
    total: dict = {}
    t0 = time.monotonic()
    try:
        if not sset.samplers:
            fail("no access source can run here:\n  " + "\n  ".join(
                f"{k}: {v}" for k, v in sset.unavailable.items()))
        end = t0 + seconds
        while True:
            time.sleep(max(0.0, min(interval_ms / 1000, end - time.monotonic())))
            accumulate(total, sset.read_deltas())
            if time.monotonic() >= end or not _sysfs.exists(f"/proc/{pid}"):
                break
        stats = sset.stats()
        mode, used = sset.mode, [s.name for s in sset.samplers]
    finally:
        sset.close()
        tracked.close()
    elapsed = time.monotonic() - t0
    result = hottest(total, top)
    now_ns = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    if as_json:
        emit_json(SCHEMA, {"pid": pid, "seconds": round(elapsed, 3), "mode": mode,
                           "samplers": used,
                           "unavailable": sset.unavailable, "stats": stats, "hottest": result})
        return
    click.echo(f"pid {pid}, {elapsed:.1f} s, {mode}: " + ", ".join(used))
    for name, why in sset.unavailable.items():
        click.echo(f"  ({name} unavailable: {why})")
    if not result:
        click.echo("no samples")
    for src, rows in result.items():
        click.echo(f"\n{src}:")
        click.echo(table(["block", "size", "samples", "last seen"],
                         [[f"{r['block_start']:#x}", human_bytes(r["block_len"]), r["count"],
                           f"{(now_ns - r['last_seen_ns']) / 1e9:.1f} s ago"] for r in rows],
                         right={2}))
