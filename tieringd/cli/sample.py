# SPDX-License-Identifier: Apache-2.0
"""``tieringctl sample --pid P --seconds N``: the hottest blocks of a process, ranked as the daemon
ranks them, with the raw samples per access source beside.

The session (the access signal, the kernel settings it borrows and puts back, the window over whole
scan passes, the ranking) is :mod:`tieringd.sampling.session`; this module is its command line and its
two outputs. Ctrl-C, SIGTERM and SIGHUP end the sampling early; the results so far are printed and
every setting is put back.

Output: the blocks in the daemon's order (heat from the ``[heat]`` settings in force, then the read
intervals in which a block was touched, then samples), then per source the blocks with the most
samples (``--json``: schema tieringd.sample/2, ``ranked`` and ``hottest``). The fault source counts
base pages seen accessed (a hint fault on a THP counts its 512).
"""
from __future__ import annotations

import signal
import threading
import time

import click

from tieringd.cli._output import emit_json, fail, human_bytes, table

SCHEMA = "tieringd.sample/2"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _stop_on_signals(stop: threading.Event) -> dict:
    """Ctrl-C, SIGTERM and SIGHUP end the sampling (and so restore the settings); returns the old
    handlers."""
    def handler(signum, frame):
        if stop.is_set():           # a second one: out at once (the finally blocks still restore)
            raise KeyboardInterrupt
        stop.set()
    return {s: signal.signal(s, handler) for s in STOP_SIGNALS}


def _window_line(w, warmup_s: float) -> str | None:
    if w.passes is None:
        return None
    if w.passes["aligned"]:
        return f"window: {w.passes['count']} whole scan passes"
    return (f"window: {w.t_end - w.t0:.1f} s, not whole scan passes: no scan pass of the process ended "
            f"within --warmup-s {warmup_s:g} s after it (NUMA balancing scans an idle-looking process "
            "slowly); blocks read alike may differ by a pass in their samples, not in their rank")


def _print_text(pid, w, run, ranked, result, kernel_moves, stopped, warmup_s) -> None:
    from tieringd.sampling.session import UNITS
    now_ns = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    click.echo(f"pid {pid}, {w.t_end - w.t0:.1f} s{' (stopped early)' if stopped else ''}, "
               f"{w.mode}: " + ", ".join(w.used))
    for line in run.lines():
        click.echo(line)
    if w.warmup is not None:
        click.echo(f"warm-up: {w.warmup['seconds']:.1f} s before the window ({w.warmup['result']})")
    line = _window_line(w, warmup_s)
    if line:
        click.echo(line)
    click.echo(f"kernel migrations meanwhile: {kernel_moves['numa_misplaced_pages']} pages by NUMA "
               f"balancing (pgpromote_success +{kernel_moves['vmstat']['pgpromote_success']}, "
               f"numa_pages_migrated +{kernel_moves['vmstat']['numa_pages_migrated']})")
    for name, why in w.unavailable.items():
        click.echo(f"  ({name} unavailable: {why})")
    if not result:
        click.echo("no samples")
        return
    click.echo("\nhottest blocks as the daemon ranks them (heat in [0, 1] from [heat]; intervals: "
               "read intervals in which the block was touched):")
    sources = sorted({s for r in ranked for s in r["samples"]})
    click.echo(table(["rank", "block", "size", "heat", "intervals", *sources, "last seen"],
                     [[r["rank"], f"{r['block_start']:#x}", human_bytes(r["block_len"]), f"{r['heat']:.4f}",
                       r["intervals"], *(r["samples"].get(s, 0) for s in sources),
                       f"{r['last_seen_ms_ago'] / 1000:.1f} s ago"] for r in ranked],
                     right={0, 3, 4, *range(5, 5 + len(sources))}))
    for src, rows in result.items():
        click.echo(f"\n{src} ({UNITS.get(src, 'samples')}), raw samples:")
        click.echo(table(["rank", "block", "size", "count", "last seen"],
                         [[r["rank"], f"{r['block_start']:#x}", human_bytes(r["block_len"]), r["count"],
                           f"{(now_ns - r['last_seen_ns']) / 1e9:.1f} s ago"] for r in rows],
                         right={0, 3}))


def _heat_settings():
    """The ``[heat]`` table in force (the daemon's configuration file, defaults without one)."""
    from tieringd import config
    from tieringd.placement.heat import HeatConfig
    try:
        return HeatConfig.from_config(config.section(config.load(), "heat"))
    except config.ConfigError as e:
        fail(f"configuration: {e}")


@click.command("sample")
@click.option("--pid", "pid", type=int, required=True, help="Process to sample.")
@click.option("--seconds", type=float, default=5.0, show_default=True, help="How long to sample.")
@click.option("--interval-ms", type=int, default=500, show_default=True, help="Delta read interval.")
@click.option("--block-size", default="2M", show_default=True,
              help="Block size for the process's addresses (power of two, 4K…1G).")
@click.option("--signal", "prefer", default="auto", show_default=True,
              type=click.Choice(["auto", "hint-faults", "damon", "pmu"]),
              help="Access signal to try first (the daemon's choice per kernel: auto).")
@click.option("--warmup-s", type=float, default=90.0, show_default=True,
              help="Hint faults: wait at most this long for a scan-pass boundary to start and to end "
                   "the window (0: a plain N-second window).")
@click.option("--keep-settings", is_flag=True,
              help="Borrow no kernel settings: sample with the kernel as it is.")
@click.option("--state-file", default=None,
              help="Where borrowed settings are recorded (default: the daemon's, /run/tieringd/knobs.json).")
@click.option("--source", "sources", default="auto", show_default=True,
              help="Comma list of fault, pmu, dma; or auto (the signal's samplers; dma too when the "
                   "process maps a CUDA library).")
@click.option("--pmu-event", default="auto", show_default=True,
              help="auto, amd-ibs-op, intel-mem-loads or software-page-faults.")
@click.option("--fallback", default="auto", show_default=True,
              help="Accessed-bit fallback when BPF is unavailable: auto, damon, idle-page, none.")
@click.option("--top", type=int, default=10, show_default=True, help="Blocks shown (ranked, and per source).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (tieringd.sample/2).")
def command(pid, seconds, interval_ms, block_size, prefer, warmup_s, keep_settings, state_file,
            sources, pmu_event, fallback, top, as_json):
    """Show the hottest blocks of process PID, ranked as the daemon ranks them."""
    from tieringd.kernel import knobs, procfs
    from tieringd.sampling import TrackedSet, TrackingError
    from tieringd.sampling.access_signal import AccessSignal
    from tieringd.sampling.session import UNITS, Options, Session, SessionError, hottest
    from tieringd.units import parse_size

    if not procfs.alive(pid):
        fail(f"no process {pid}")
    if seconds <= 0 or interval_ms <= 0 or top <= 0 or warmup_s < 0:
        fail("--seconds, --interval-ms and --top must be positive, --warmup-s not negative")
    heat = _heat_settings()
    tracked = TrackedSet()
    stop = None
    try:
        tracked.add_process(pid, all_addresses=True, default_block_len=parse_size(block_size, "--block-size"))
        sig = AccessSignal.for_this_machine(state_file or knobs.DEFAULT_STATE_PATH, prefer=prefer)
        session = Session(pid, tracked, sig, Options(seconds, interval_ms, warmup_s, sources, fallback,
                                                     pmu_event, keep_settings), heat)
        stop = session.stop
        old_handlers = _stop_on_signals(stop)
        try:
            w, kernel_moves = session.run()
        finally:
            for s, h in old_handlers.items():
                signal.signal(s, h)
    except (TrackingError, ValueError, SessionError) as e:
        fail(str(e))
    finally:
        tracked.close()
    result, ranked = hottest(w.total, top), w.ranking.ranked(top)
    if not as_json:
        _print_text(pid, w, session.run_info, ranked, result, kernel_moves, stop.is_set(), warmup_s)
        return
    emit_json(SCHEMA, {"pid": pid, "seconds": round(w.t_end - w.t0, 3), "stopped_early": stop.is_set(),
                       "window_monotonic_s": [round(w.t0, 3), round(w.t_end, 3)],
                       "warmup": w.warmup, "scan_passes": w.passes, "mode": w.mode, "samplers": w.used,
                       "signal": session.run_info.as_dict(), "kernel_migrations": kernel_moves,
                       "units": {k: UNITS[k] for k in result if k in UNITS},
                       "unavailable": w.unavailable, "stats": w.stats, "ranked": ranked, "hottest": result})
