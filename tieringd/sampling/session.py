# SPDX-License-Identifier: Apache-2.0
"""A sampling session: one process sampled for a while under the daemon's access signal, its blocks
ranked as the daemon ranks them (``tieringctl sample``).

The access signal is the daemon's (:mod:`tieringd.sampling.access_signal`, chosen per kernel from
doctor's facts): on populated memory nothing faults unless something makes it, so a session borrows
the kernel settings the signal needs (NUMA-balancing hint-fault scanning with the kernel's promotion
off, or DAMON's prerequisites) through :mod:`tieringd.kernel.knobs`, opens the samplers it names,
tracks the process at all addresses for N seconds, and puts every setting back. The settings are
recorded in the daemon's state file first, so after a crash the next session or daemon start
restores them; while another live process holds that file (the daemon runs) its settings are used
as they are.

What a session cannot do is bind the process's memory to its nodes (``MPOL_F_NUMA_BALANCING``): that
takes the process's shim, whose control channel the daemon holds. So while it samples, the kernel
may migrate pages itself; the faults are counted before any move, and the pages the kernel moved
meanwhile are reported.

**Ranking.** Raw counts rank blocks by how their pages fault, not by how they are used: a hint fault
says "touched since the last scan pass", once per page, so a block read all the time takes 512 faults
a pass on 4 KiB pages and one on a THP, and a window cut at arbitrary times gives blocks one pass
more or less depending on where the scan stood. The daemon does not rank by those counts: it counts
each (block, read interval) with a fault once (:func:`tieringd.sampling.touches`) and ranks by its
heat model. A session does the same — every interval's rows go through ``touches`` into a
:class:`~tieringd.placement.heat.BlockTable` with the ``[heat]`` settings in force — and ranks by
heat, then by the intervals in which a block was touched, then by samples. A block every request
reads (a shared system prompt's prefix) is touched in every interval and ranks first among blocks
as recent as it, whatever its page size. The raw counts per source are kept beside.

**Scan passes** (hint faults): the window starts and ends when the process's ``mm->numa_scan_seq``
advances, so blocks read in every pass are seen the same number of times. NUMA balancing paces its
scanning per process, and one it has been scanning with nothing to migrate has backed off to a scan
window every several seconds; ``warmup_s`` bounds the wait for the first boundary and for the last.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time

import numpy as np

from tieringd.contracts import SampleSource, Tier
from tieringd.kernel import knobs, procfs
from tieringd.placement.heat import BlockTable, HeatConfig
from tieringd.sampling import SOURCES, TrackedSet, open_samplers, touches
from tieringd.sampling.access_signal import AccessSignal, AccessSignalError, Mechanism

UNITS = {"fault": "base pages seen accessed (4 KiB each; a fault on a THP counts its 512)",
         "pmu": "samples", "dma": "copies", "accessed": "accesses seen (DAMON nr_accesses, idle pages)"}
MIGRATION_VMSTAT = ("pgpromote_success", "numa_pages_migrated", "pgmigrate_success")
PASS_POLL_S = 0.05          # how often numa_scan_seq is read while waiting for a pass boundary
NO_BIND_NOTE = ("sample cannot bind the process's memory to its nodes (that takes its shim, which the "
                "daemon holds): while it samples, the kernel may migrate pages itself (promotion while "
                "the fast node has ample free memory, the normal mode's moves toward the CPU's node)")


class SessionError(Exception):
    """Why a session cannot run (one line for the user)."""


@dataclasses.dataclass
class Options:
    seconds: float = 5.0
    interval_ms: int = 500
    warmup_s: float = 90.0
    sources: str = "auto"
    fallback: str = "auto"
    pmu_event: str = "auto"
    keep_settings: bool = False


@dataclasses.dataclass
class SignalRun:
    """What the session did to the kernel: the signal chosen, the settings borrowed and put back, or
    whose settings it ran under."""
    choice: object                    # access_signal.Choice
    borrowed: list = dataclasses.field(default_factory=list)
    restored: list = dataclasses.field(default_factory=list)
    recovered: list = dataclasses.field(default_factory=list)
    missing: dict = dataclasses.field(default_factory=dict)
    held_by: int | None = None        # another process holds the settings: used as they are
    held: list = dataclasses.field(default_factory=list)
    kept: bool = False                # keep_settings: nothing borrowed

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


class Ranking:
    """The window's blocks as the daemon would rank them: per interval, the rows through
    :func:`touches` into a block table (one single-block region per block seen), heat at the end."""

    def __init__(self, heat: HeatConfig, interval_ms: int):
        self.table = BlockTable(heat, epoch_ns=time.monotonic_ns())
        self.interval_ms = interval_ms
        self.rid: dict[tuple[int, int], int] = {}        # (pid, block_start) → table region
        self.touched: dict[tuple[int, int], int] = {}    # (pid, block_start) → intervals touched
        self.raw: dict[tuple[int, int], dict[str, int]] = {}   # … → samples per source
        self.length: dict[tuple[int, int], int] = {}

    def add(self, rows: np.ndarray) -> None:
        if len(rows) == 0:
            return
        for pid, start, blen, count, src in zip(rows["pid"].tolist(), rows["block_start"].tolist(),
                                                rows["block_len"].tolist(), rows["count"].tolist(),
                                                rows["source"].tolist()):
            key = (pid, start)
            if key not in self.rid:
                self.rid[key] = self.table.add_region(pid, start, blen, blen, node=0, tier=Tier.DRAM)
                self.length[key] = blen
            per = self.raw.setdefault(key, {})
            name = SampleSource(src).name.lower()
            per[name] = per.get(name, 0) + count
        for key in {(p, s) for p, s in zip(rows["pid"].tolist(), rows["block_start"].tolist())}:
            self.touched[key] = self.touched.get(key, 0) + 1
        self.table.ingest(touches(rows), quantum_ms=self.interval_ms)

    def ranked(self, top: int, now_ns: int | None = None) -> list[dict]:
        """The ``top`` hottest blocks at ``now_ns`` (CLOCK_MONOTONIC; default now): heat, then
        intervals touched, then samples, then address. Blocks of equal key share a rank."""
        if not self.rid:
            return []
        now_ms = max(self.table.now_ms(time.monotonic_ns() if now_ns is None else now_ns), self.table.last_max_ms)
        heat = self.table.compute_heat(now_ms)
        rows = []
        for key, rid in self.rid.items():
            i = self.table.region_slice(rid).start
            rows.append({"pid": key[0], "block_start": key[1], "block_len": self.length[key],
                         "heat": round(float(heat[i]), 4), "intervals": self.touched.get(key, 0),
                         "samples": dict(self.raw.get(key, {})),
                         "last_seen_ms_ago": int(now_ms - int(self.table.last_ms[i]))})
        rows.sort(key=lambda r: (-r["heat"], -r["intervals"], -sum(r["samples"].values()), r["block_start"]))
        _share_ranks(rows, lambda r: (r["heat"], r["intervals"], sum(r["samples"].values())))
        return rows[:top]


def _share_ranks(rows: list[dict], key) -> None:
    rank = 0
    for i, r in enumerate(rows):            # ties share a rank (1 + blocks ranked above)
        if i == 0 or key(r) != key(rows[i - 1]):
            rank = i + 1
        r["rank"] = rank


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
    """Per source, the ``top`` blocks by raw count (the samplers' own view)."""
    by_source: dict[str, list[dict]] = {}
    for (src, pid, start), (blen, count, last) in total.items():
        by_source.setdefault(SampleSource(src).name.lower(), []).append(
            {"pid": pid, "block_start": start, "block_len": blen, "count": count, "last_seen_ns": last})
    for rows in by_source.values():
        rows.sort(key=lambda r: (-r["count"], r["block_start"]))
        _share_ranks(rows, lambda r: r["count"])
        del rows[top:]
    return by_source


@dataclasses.dataclass
class Window:
    """One sampling window's outcome."""
    total: dict
    ranking: Ranking
    t0: float
    t_end: float
    stats: dict
    migrated: dict
    mode: str
    used: list
    unavailable: dict
    warmup: dict | None
    passes: dict | None             # {"numa_scan_seq": [first, last], "aligned": bool, "count": n}


def vmstat() -> dict[str, int]:
    vm = procfs.read_vmstat(MIGRATION_VMSTAT)
    return {k: int(vm.get(k, 0)) for k in MIGRATION_VMSTAT}


def next_pass(pid: int, seq: int | None, limit_s: float, stop: threading.Event) -> int | None:
    """Wait until ``pid``'s mm->numa_scan_seq moves past ``seq`` (a scan pass ended), at most
    ``limit_s``; the new value, or None (gave up, process gone, stopped)."""
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


def maps_cuda(pid: int) -> bool:
    """Whether the process maps a library that may export the CUDA copy APIs (libcudart, libcuda, a
    framework's libtorch_cuda…, the tests' libfakecudart): only then is the dma source worth its
    uprobe scan of every mapped object (tens of seconds under the lab's TCG)."""
    from tieringd.sampling.dmacopy import mapped_objects
    return any("cuda" in os.path.basename(p) for p in mapped_objects(pid))


def choose_sources(sources: str, choice, pid: int) -> tuple[str, ...]:
    """The sources to open: the named ones, or (``auto``) the signal's, with dma when the process
    maps a CUDA library, or every source when nothing sees populated memory."""
    if sources != "auto":
        names = tuple(s.strip() for s in sources.split(","))
        unknown = [s for s in names if s not in SOURCES]
        if unknown:
            raise SessionError(f"unknown source {unknown[0]!r}: choose from {', '.join(SOURCES)}")
        return names
    if choice.mechanism is Mechanism.NONE:
        return tuple(SOURCES)       # nothing sees populated memory: at least first touches
    dma = ("dma",) if "dma" not in choice.sources and maps_cuda(pid) else ()
    return (*choice.sources, *dma)


def borrow(sig: AccessSignal, run: SignalRun) -> None:
    """Start the signal (restoring a crashed run's settings first); when another live process holds
    the state file, note it and go on under its settings."""
    try:
        sig.start()
        run.borrowed = list(sig.knobs.changes)
        run.recovered, run.missing = list(sig.knobs.recovered), dict(sig.knobs.missing)
    except knobs.KnobError as e:
        held = sig.knobs.holder()
        if held is None:
            raise SessionError(str(e)) from None
        run.held_by, run.held = held
    except AccessSignalError as e:
        raise SessionError(str(e)) from None


class Session:
    """One process, one window: ``run()`` borrows, samples, puts back; ``stop`` ends it early."""

    def __init__(self, pid: int, tracked: TrackedSet, sig: AccessSignal, opts: Options, heat: HeatConfig):
        self.pid, self.tracked, self.sig, self.opts = pid, tracked, sig, opts
        self.names = choose_sources(opts.sources, sig.choice, pid)
        self.fallback = "damon" if opts.fallback == "auto" and sig.choice.mechanism is Mechanism.DAMON \
            else opts.fallback
        self.run_info = SignalRun(sig.choice, kept=opts.keep_settings)
        self.heat = heat
        self.stop = threading.Event()

    def run(self) -> tuple[Window, dict]:
        """The window and the kernel's own migrations meanwhile; the settings are back whatever
        happens."""
        try:
            if not self.opts.keep_settings:
                borrow(self.sig, self.run_info)
            vm0 = vmstat()
            w = self._window()
            vm1 = vmstat()
        finally:
            self.run_info.restored = self.sig.stop() if self.sig.started else []
        moves = {"vmstat": {k: vm1[k] - vm0[k] for k in MIGRATION_VMSTAT},
                 "numa_misplaced_pages": w.migrated.get("numa_misplaced", {}).get("succeeded", 0)}
        return w, moves

    def _window(self) -> Window:
        """Open the samplers, warm up (hint faults), read deltas for ``seconds``."""
        o = self.opts
        sset = open_samplers(self.tracked, sources=self.names, fallback=self.fallback, pmu_event=o.pmu_event)
        try:
            if not sset.samplers:
                raise SessionError("no access source can run here:\n  " + "\n  ".join(
                    f"{k}: {v}" for k, v in sset.unavailable.items()))
            align = self.sig.choice.mechanism is Mechanism.HINT_FAULTS and "fault" in self.names and \
                o.warmup_s > 0 and procfs.read_numa_scan_seq(self.pid) is not None
            warmup, first = None, None
            if align:
                t_w = time.monotonic()
                first = next_pass(self.pid, None, o.warmup_s, self.stop)
                warmup = {"seconds": round(time.monotonic() - t_w, 3),
                          "result": "a scan pass ended" if first is not None else
                          f"no scan pass ended in {o.warmup_s:g} s: plain window"}
                align = first is not None
            sset.read_deltas()                      # before the window: not its samples
            total: dict = {}
            ranking = Ranking(self.heat, o.interval_ms)
            t0 = time.monotonic()
            last = self._read_until_end(sset, total, ranking, t0 + o.seconds, align)
            passes = None if not align else {"numa_scan_seq": [first, last], "aligned": last is not None,
                                              "count": None if last is None else last - first}
            migrated = sset.migrations.read() if sset.migrations is not None else {}
            return Window(total, ranking, t0, time.monotonic(), sset.stats(), migrated, sset.mode,
                          [s.name for s in sset.samplers], dict(sset.unavailable), warmup, passes)
        finally:
            sset.close()

    def _read_until_end(self, sset, total: dict, ranking: Ranking, end: float, align: bool) -> int | None:
        """Read every interval until ``end`` (then to the next pass boundary when aligned); the
        numa_scan_seq the window ended at (None: not aligned)."""
        last = None
        while not self.stop.is_set():
            self.stop.wait(max(0.0, min(self.opts.interval_ms / 1000, end - time.monotonic())))
            over = time.monotonic() >= end or not procfs.alive(self.pid)
            if over and align and not self.stop.is_set():
                last = next_pass(self.pid, procfs.read_numa_scan_seq(self.pid), self.opts.warmup_s, self.stop)
            rows = sset.read_deltas()
            accumulate(total, rows)
            ranking.add(rows)
            if over:
                break
        return last
