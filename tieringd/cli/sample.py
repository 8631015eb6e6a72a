# SPDX-License-Identifier: Apache-2.0
"""``tieringctl sample --pid P --seconds N``: the hottest blocks of a process, per access source.

The access signal is the daemon's (:mod:`tieringd.sampling.access_signal`, chosen per kernel from doctor's
facts): on populated memory nothing faults unless something makes it, so ``sample`` borrows the
kernel settings the signal needs (NUMA-balancing hint-fault scanning with the kernel's promotion off,
or DAMON's prerequisites) for the run through :mod:`tieringd.kernel.knobs`, opens the samplers it names,
tracks P at all addresses (``--block-size`` blocks) for N seconds, and puts every setting back —
also after Ctrl-C, SIGTERM or SIGHUP (they end the sampling early; the results so far are printed).
The settings are recorded in the daemon's state file first (``--state-file``, default
/run/tieringd/knobs.json), so after a crash the next ``sample`` or daemon start restores them; while
another process holds that file (the daemon runs) its settings are used as they are.

What ``sample`` cannot do is bind P's memory to its nodes (``MPOL_F_NUMA_BALANCING``): that takes
P's shim, whose control channel the daemon holds. So while it samples, the kernel may migrate P's
pages itself — promotion in the tiering mode while the fast node has more than max(1 GiB, 1/16 of it)
free, the normal mode's moves toward the CPU's node where there is room (docs/loop.md). The faults
are counted before any move, so the ranking holds; the pages the kernel moved meanwhile are reported.

Scan passes (hint faults): a hint fault says "touched since the last scan pass", so a block read all
the time takes one fault per pass (512 on 4 KiB pages), and a window cut at arbitrary times gives
blocks one pass more or less depending on where the scan stood at its edges — enough to rank blocks
read alike apart. So the window runs over whole passes: it starts and ends when the process's
``mm->numa_scan_seq`` (/proc/PID/sched) advances, ending at the first pass boundary after N seconds,
and blocks read in every pass tie exactly. Warm-up: NUMA balancing paces its scanning per process, and
one it has been scanning with nothing to migrate has backed off to a scan window every several seconds
(up to ``scan_period_max_ms`` / windows: 12 s for a 1.2 GiB process at the defaults); the first pass
boundary comes within that pass. ``--warmup-s`` (default 90) bounds the wait for the first boundary
and the wait for the last one after N seconds; without /proc/PID/sched the window is N seconds.

Output: the blocks with the most samples per source (``--json``: schema tieringd.sample/2). The fault
source counts base pages seen accessed (a hint fault on a THP counts its 512 pages).
"""
from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import click
import numpy as np

from tieringd.cli._output import emit_json, fail, human_bytes, table
from tieringd.contracts import SampleSource

SCHEMA = "tieringd.sample/2"
UNITS = {"fault": "base pages seen accessed (4 KiB each; a fault on a THP counts its 512)",
         "pmu": "samples", "dma": "copies", "accessed": "accesses seen (DAMON nr_accesses, idle pages)"}
MIGRATION_VMSTAT = ("pgpromote_success", "numa_pages_migrated", "pgmigrate_success")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PASS_POLL_S = 0.05          # how often numa_scan_seq is read while waiting for a pass boundary
NO_BIND_NOTE = ("sample cannot bind the process's memory to its nodes (that takes its shim, which the "
                "daemon holds): while it samples, the kernel may migrate pages itself (promotion while "
                "the fast node has ample free memory, the normal mode's moves toward the CPU's node)")


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
        rank = 0
        for i, r in enumerate(rows):        # ties share a rank (1 + blocks with more samples)
            if i == 0 or r["count"] != rows[i - 1]["count"]:
                rank = i + 1
            r["rank"] = rank
        del rows[top:]
    return by_source


@dataclasses.dataclass
class SignalRun:
    """What ``sample`` did to the kernel: the signal chosen, the settings borrowed and put back, or
    whose settings it ran under."""
    choice: object                    # access_signal.Choice
    borrowed: list = dataclasses.field(default_factory=list)
    restored: list = dataclasses.field(default_factory=list)
    recovered: list = dataclasses.field(default_factory=list)
    missing: dict = dataclasses.field(default_factory=dict)
    held_by: int | None = None        # another process holds the settings: used as they are
    held: list = dataclasses.field(default_factory=list)
    kept: bool = False                # --keep-settings: nothing borrowed

    def as_dict(self) -> dict:
        c = self.choice
        return {"mechanism": c.mechanism.value, "why": c.why, "sources": list(c.sources),
                "rejected": dict(c.rejected), "regions_bound": False, "note": NO_BIND_NOTE,
                "state_held_by": self.held_by, "kept_settings": self.kept,
                "held": [dataclasses.asdict(x) for x in self.held],
                "borrowed": [dataclasses.asdict(x) for x in self.borrowed],
                "restored": [dataclasses.asdict(x) for x in self.restored],
                "recovered": [dataclasses.asdict(x) for x in self.recovered],
                "missing": dict(self.missing)}

    def lines(self) -> list[str]:
        out = [f"access signal: {self.choice.describe()} — {self.choice.why}"]
        if self.held_by is not None:
            out.append(f"kernel settings: held by pid {self.held_by} (the daemon?), used as they are: "
                       + (", ".join(map(str, self.held)) or "none"))
        elif self.kept:
            out.append("kernel settings: left as they are (--keep-settings)")
        else:
            out.append("kernel settings borrowed: " + (", ".join(map(str, self.borrowed)) or "none"))
            out.append("restored: " + (", ".join(f"{x.name} {x.value}→{x.original}"
                                                  for x in self.restored) or "nothing to restore"))
        if self.choice.mechanism.value == "hint-faults":
            out.append("note: " + NO_BIND_NOTE)
        if self.recovered:
            out.append("restored first, left by an earlier run: " + ", ".join(map(str, self.recovered)))
        if self.missing:
            first = next(iter(self.missing.values()))
            out.append(f"not set (absent or unreadable here): {', '.join(self.missing)} ({first})")
        return out


def _vmstat() -> dict[str, int]:
    from tieringd.kernel import procfs
    vm = procfs.read_vmstat(MIGRATION_VMSTAT)
    return {k: int(vm.get(k, 0)) for k in MIGRATION_VMSTAT}


def _stop_on_signals(stop: threading.Event) -> dict:
    """Ctrl-C, SIGTERM and SIGHUP end the sampling (and so restore the settings); returns the old
    handlers."""
    def handler(signum, frame):
        if stop.is_set():           # a second one: out at once (the finally blocks still restore)
            raise KeyboardInterrupt
        stop.set()
    return {s: signal.signal(s, handler) for s in STOP_SIGNALS}


def _next_pass(pid: int, seq: int | None, limit_s: float, stop: threading.Event) -> int | None:
    """Wait until ``pid``'s mm->numa_scan_seq moves past ``seq`` (a scan pass ended), at most
    ``limit_s``; the new value, or None (gave up, process gone, stopped)."""
    from tieringd.kernel import procfs
    t_end = time.monotonic() + limit_s
    while not stop.is_set() and time.monotonic() < t_end:
        now = procfs.read_numa_scan_seq(pid)
        if now is None:
            return None
        if seq is not None and now != seq:
            return now
        seq = now if seq is None else seq
        stop.wait(PASS_POLL_S)
    return None


def _maps_cuda(pid: int) -> bool:
    """Whether the process maps a library that may export the CUDA copy APIs (libcudart, libcuda, a
    framework's libtorch_cuda…, the tests' libfakecudart): only then is the dma source worth its
    uprobe scan of every mapped object (tens of seconds under the lab's TCG)."""
    from tieringd.sampling.dmacopy import mapped_objects
    return any("cuda" in os.path.basename(p) for p in mapped_objects(pid))


def _sources(sources: str, choice, pid: int) -> tuple[str, ...]:
    from tieringd.sampling.access_signal import Mechanism
    from tieringd.sampling import SOURCES
    if sources != "auto":
        names = tuple(s.strip() for s in sources.split(","))
        unknown = [s for s in names if s not in SOURCES]
        if unknown:
            fail(f"unknown source {unknown[0]!r}: choose from {', '.join(SOURCES)}")
        return names
    if choice.mechanism is Mechanism.NONE:
        return tuple(SOURCES)       # nothing sees populated memory: at least first touches
    dma = ("dma",) if "dma" not in choice.sources and _maps_cuda(pid) else ()
    return (*choice.sources, *dma)


def _borrow(sig, run: SignalRun) -> None:
    """Start the signal (restoring a crashed run's settings first); when another live process holds
    the state file, note it and go on under its settings."""
    from tieringd.kernel import knobs
    from tieringd.sampling.access_signal import AccessSignalError
    try:
        sig.start()
        run.borrowed = list(sig.knobs.changes)
        run.recovered, run.missing = list(sig.knobs.recovered), dict(sig.knobs.missing)
    except knobs.KnobError as e:
        held = sig.knobs.holder()
        if held is None:
            fail(str(e))
        run.held_by, run.held = held
    except AccessSignalError as e:
        fail(str(e))


@dataclasses.dataclass
class Window:
    """One sampling window's outcome."""
    total: dict
    t0: float
    t_end: float
    stats: dict
    migrated: dict
    mode: str
    used: list
    unavailable: dict
    warmup: dict | None
    passes: dict | None             # {"numa_scan_seq": [first, last], "aligned": bool}


def _sample(pid, tracked, sig, names, opts, stop: threading.Event) -> Window:
    """Open the samplers, warm up (hint faults), read deltas for ``opts["seconds"]``."""
    from tieringd.kernel import procfs
    from tieringd.sampling.access_signal import Mechanism
    from tieringd.sampling import open_samplers
    sset = open_samplers(tracked, sources=names, fallback=opts["fallback"],
                         pmu_event=opts["pmu_event"])
    try:
        if not sset.samplers:
            fail("no access source can run here:\n  " + "\n  ".join(
                f"{k}: {v}" for k, v in sset.unavailable.items()))
        from tieringd.kernel import procfs
        align = sig.choice.mechanism is Mechanism.HINT_FAULTS and "fault" in names and \
            opts["warmup_s"] > 0 and procfs.read_numa_scan_seq(pid) is not None
        warmup = passes = None
        first = None
        if align:
            t_w = time.monotonic()
            first = _next_pass(pid, None, opts["warmup_s"], stop)
            warmup = {"seconds": round(time.monotonic() - t_w, 3),
                      "result": "a scan pass ended" if first is not None else
                      f"no scan pass ended in {opts['warmup_s']:g} s: plain window"}
            align = first is not None
        sset.read_deltas()                      # before the window: not its samples
        total: dict = {}
        t0 = time.monotonic()
        end = t0 + opts["seconds"]
        last = first
        while not stop.is_set():
            stop.wait(max(0.0, min(opts["interval_ms"] / 1000, end - time.monotonic())))
            if time.monotonic() >= end or not procfs.alive(pid):
                if align and not stop.is_set():
                    seq = procfs.read_numa_scan_seq(pid)
                    last = _next_pass(pid, seq, opts["warmup_s"], stop)
                accumulate(total, sset.read_deltas())
                break
            accumulate(total, sset.read_deltas())
        t_end = time.monotonic()
        if align:
            passes = {"numa_scan_seq": [first, last], "aligned": last is not None,
                      "count": None if last is None else last - first}
        migrated = sset.migrations.read() if sset.migrations is not None else {}
        return Window(total, t0, t_end, sset.stats(), migrated, sset.mode,
                      [s.name for s in sset.samplers], dict(sset.unavailable), warmup, passes)
    finally:
        sset.close()


def _print_text(pid, w: Window, run: SignalRun, result, kernel_moves, stopped) -> None:
    now_ns = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    click.echo(f"pid {pid}, {w.t_end - w.t0:.1f} s{' (stopped early)' if stopped else ''}, "
               f"{w.mode}: " + ", ".join(w.used))
    for line in run.lines():
        click.echo(line)
    if w.warmup is not None:
        click.echo(f"warm-up: {w.warmup['seconds']:.1f} s before the window ({w.warmup['result']})")
    if w.passes is not None:
        click.echo(f"window: {w.passes['count']} whole scan passes" if w.passes["aligned"] else
                   "window: not aligned to scan passes (no pass ended in time)")
    click.echo(f"kernel migrations meanwhile: {kernel_moves['numa_misplaced_pages']} pages by NUMA "
               f"balancing (pgpromote_success +{kernel_moves['vmstat']['pgpromote_success']}, "
               f"numa_pages_migrated +{kernel_moves['vmstat']['numa_pages_migrated']})")
    for name, why in w.unavailable.items():
        click.echo(f"  ({name} unavailable: {why})")
    if not result:
        click.echo("no samples")
    for src, rows in result.items():
        click.echo(f"\n{src} ({UNITS.get(src, 'samples')}):")
        click.echo(table(["rank", "block", "size", "count", "last seen"],
                         [[r["rank"], f"{r['block_start']:#x}", human_bytes(r["block_len"]), r["count"],
                           f"{(now_ns - r['last_seen_ns']) / 1e9:.1f} s ago"] for r in rows],
                         right={0, 3}))


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
@click.option("--top", type=int, default=10, show_default=True, help="Blocks shown per source.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (tieringd.sample/2).")
def command(pid, seconds, interval_ms, block_size, prefer, warmup_s, keep_settings, state_file,
            sources, pmu_event, fallback, top, as_json):
    """Show the hottest blocks of process PID per access source."""
    from tieringd.kernel import knobs, procfs
    from tieringd.sampling.access_signal import AccessSignal, Mechanism
    from tieringd.units import parse_size
    from tieringd.sampling import TrackedSet, TrackingError

    if not procfs.alive(pid):
        fail(f"no process {pid}")
    if seconds <= 0 or interval_ms <= 0 or top <= 0 or warmup_s < 0:
        fail("--seconds, --interval-ms and --top must be positive, --warmup-s not negative")
    tracked = TrackedSet()
    try:
        tracked.add_process(pid, all_addresses=True,
                            default_block_len=parse_size(block_size, "--block-size"))
    except (TrackingError, ValueError) as e:
        fail(str(e))
    sig = AccessSignal.for_this_machine(state_file or knobs.DEFAULT_STATE_PATH, prefer=prefer)
    names = _sources(sources, sig.choice, pid)
    if fallback == "auto" and sig.choice.mechanism is Mechanism.DAMON:
        fallback = "damon"
    opts = {"seconds": seconds, "interval_ms": interval_ms, "warmup_s": warmup_s,
            "fallback": fallback, "pmu_event": pmu_event}
    run = SignalRun(sig.choice, kept=keep_settings)
    stop = threading.Event()
    old_handlers = _stop_on_signals(stop)
    try:
        if not keep_settings:
            _borrow(sig, run)
        vm0 = _vmstat()
        w = _sample(pid, tracked, sig, names, opts, stop)
        vm1 = _vmstat()
    finally:
        tracked.close()
        run.restored = sig.stop() if sig.started else []
        for s, h in old_handlers.items():
            signal.signal(s, h)
    result = hottest(w.total, top)
    kernel_moves = {"vmstat": {k: vm1[k] - vm0[k] for k in MIGRATION_VMSTAT},
                    "numa_misplaced_pages": w.migrated.get("numa_misplaced", {}).get("succeeded", 0)}
    if not as_json:
        _print_text(pid, w, run, result, kernel_moves, stop.is_set())
        return
    emit_json(SCHEMA, {"pid": pid, "seconds": round(w.t_end - w.t0, 3), "stopped_early": stop.is_set(),
                       "window_monotonic_s": [round(w.t0, 3), round(w.t_end, 3)],
                       "warmup": w.warmup, "scan_passes": w.passes, "mode": w.mode, "samplers": w.used,
                       "signal": run.as_dict(), "kernel_migrations": kernel_moves,
                       "units": {k: UNITS[k] for k in result if k in UNITS},
                       "unavailable": w.unavailable, "stats": w.stats, "hottest": result})
