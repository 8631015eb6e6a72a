# SPDX-License-Identifier: Apache-2.0
"""The access signal the daemon owns: what makes populated KV memory visible to the samplers.

A KV pool is written once and then only read. With NUMA balancing off it takes no page faults, so the
fault sampler sees nothing, and accessed bits are only as good as TLB misses make them. This module
chooses, per kernel and from doctor's facts (:class:`Facts`), a mechanism that yields per-block samples
on both tiers while the kernel migrates nothing by itself (the daemon decides every move), borrows the
kernel settings it needs through :mod:`tieringd.kernel.knobs`, and says what the daemon must do when a region
registers, moves or leaves. Measured in the lab (docs/loop.md):

- ``hint-faults`` (first choice): NUMA balancing in mode 3 (normal + memory tiering; mode 1 before
  v5.18), the tiering mode's promotion rate limit 0, reclaim-time demotion off, scanning made brisk
  (debugfs ``sched/numa_balancing/scan_*``), and every registered block bound to the node its first
  page is on with ``MPOL_BIND | MPOL_F_NUMA_BALANCING`` (through the shim's REBIND). Bound VMAs keep
  being scanned, and ``mpol_misplaced()`` gives a bound page no target when the faulting CPU's node
  is not in the mask, or the page is already on it — so no page on its bound node is ever migrated
  by the kernel, whatever the mode, the rate limit or the free space (``pgdat_free_space_enough()``
  lets the tiering mode promote past a zero rate limit while the fast node has more than 1 GiB
  free). The one exception: a block that straddles two nodes (where a fill ran out of the fast
  node) and is bound to the CPUs' node has pages off it, and a hint fault may pull those onto it
  (``MPOL_F_MORON``: toward the faulting CPU's node) — where the table already counts the block.
  The fault sampler counts the hint faults.
- ``damon``: DAMON virtual-address monitoring of the registered ranges, NUMA balancing off.
- ``pmu``: data-address samples (PEBS, IBS), NUMA balancing off. Where the CPU has them they are
  added to hint faults as a second source.
- ``none``: nothing can see populated memory here; :attr:`Choice.why` says why.

Use (the loop): ``sig = AccessSignal.for_this_machine(state_path)``; ``sig.start()``; open the
samplers with ``sig.choice.sources``/``sig.choice.fallback``; on every registration, verified move or
re-query, ``sig.blocks_placed(...)`` and send the :class:`Bind` requests it returns; ``sig.stop()``
on every exit path. See docs/loop.md for the whole contract.
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import os
import platform
import re

import numpy as np

from tieringd.kernel import procfs, sysfs, knobs, numa
from tieringd.sampling import features

log = logging.getLogger(__name__)

CHOICE_SAMPLERS = ("fault", "pmu", "damon")     # the samplers choose() looks at
CONFIG_FACTS = ("CONFIG_NUMA_BALANCING", "CONFIG_DAMON_VADDR", "CONFIG_DAMON_SYSFS",
                "CONFIG_TRANSPARENT_HUGEPAGE", "CONFIG_MIGRATION")

# Scanning: a 256 MB window (the default size) every 100 ms, i.e. a 1.2 GiB pool every ~0.5 s. The
# defaults (1 s to 60 s per window) back off to a minute on memory that faults locally, leaving hot
# blocks on the fast tier unseen; a larger window does not help, task_scan_min() floors the period at
# 1 s once 2560 MB / scan_size_mb < 2. Lab (6.12, 1.2 GiB pool): every hot block seen in every 4 s
# window on both tiers, hot/cold separation 1.0; the worker's system time 21 % against 7 % with NUMA
# balancing off (docs/loop.md).
SCAN_SETTINGS: tuple[tuple[str, int], ...] = (
    ("numa_balancing.scan_delay_ms", 100),
    ("numa_balancing.scan_period_min_ms", 100),
    ("numa_balancing.scan_period_max_ms", 500),
)
# v5.18: memory tiering mode (2) and normal + tiering (3); earlier kernels only know 0 and 1.
TIERING_MODE_SINCE = (5, 18)
# mbind(2) with MPOL_F_NUMA_BALANCING (set_mempolicy since v5.12; tieringd.kernel.numa notes 5.19 for mbind)
BIND_FLAG_SINCE = (5, 19)
# Before v6.5 follow_page() honoured NUMA faults, so move_pages(2) can neither see nor move a page
# that scanning has made PROT_NONE (-ENOENT for a base page, -EFAULT for a THP; mbind(MPOL_MF_MOVE)
# moves them): commit d74943a2f3cd "mm/gup: reintroduce FOLL_NUMA as FOLL_HONOR_NUMA_FAULT".
# Lab 6.1: 32 MiB left idle under scanning, move_pages to node1 moved 0 of 8192 pages, mbind all.
MOVE_PAGES_SEES_PROTNONE_SINCE = (6, 5)


class Mechanism(str, enum.Enum):
    HINT_FAULTS = "hint-faults"
    DAMON = "damon"
    PMU = "pmu"
    NONE = "none"


class AccessSignalError(RuntimeError):
    """The chosen signal cannot be set up safely (a required kernel setting could not be borrowed)."""


# --------------------------------------------------------------------------------------------------
# Facts

@dataclasses.dataclass(frozen=True)
class Facts:
    """What the choice depends on, read from the running kernel (the facts ``tieringctl doctor``
    prints). Captured per lab kernel in tests/fixtures/access_signal/."""
    release: str
    numa_balancing: int | None            # the mode now; None: CONFIG_NUMA_BALANCING is off
    settings: dict[str, bool]             # knobs.KNOWN name → this kernel has it
    memory_tiers: dict[str, list[int]]    # memory_tierN → its nodes (6.1+)
    cpu_nodes: list[int]
    memory_nodes: list[int]
    samplers: dict[str, list]             # probe_samplers(): name → [runs here, why / how]
    config: dict[str, str]

    @classmethod
    def probe(cls, samplers: dict | None = None) -> "Facts":
        """The running kernel's facts; ``samplers``: name → [runs here, why / how], from
        :func:`probe_choice_samplers` when not given."""
        if samplers is None:
            samplers = probe_choice_samplers()
        cfg = features.kernel_config() or {}
        return cls(
            release=procfs.read_sysctl("kernel.osrelease", platform.release()),
            numa_balancing=features.numa_balancing()["mode"],
            settings={name: knobs.resolve(name)[0] is not None for name in knobs.KNOWN},
            memory_tiers={os.path.basename(k): sysfs.parse_list(v)
                          for k, v in features.memory_tiers().items() if v != "?"},
            cpu_nodes=sysfs.parse_list(sysfs.read_text("/sys/devices/system/node/has_cpu", "")),
            memory_nodes=sysfs.parse_list(
                sysfs.read_text("/sys/devices/system/node/has_memory", "")),
            samplers={k: [bool(v[0]), str(v[1])] for k, v in samplers.items()},
            config={k: cfg[k] for k in CONFIG_FACTS if k in cfg})

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Facts":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})   # ignores extra keys

    @property
    def version(self) -> tuple[int, int]:
        m = re.match(r"(\d+)\.(\d+)", self.release)
        return (int(m.group(1)), int(m.group(2))) if m else (0, 0)

    def sampler(self, name: str) -> tuple[bool, str]:
        ok, why = self.samplers.get(name, [False, f"{name}: not probed"])
        return bool(ok), why

    @property
    def slow_nodes_in_lower_tier(self) -> bool:
        """CPU-less memory nodes sit in a lower memory tier than the CPU nodes (6.10+ places them by
        HMAT; 6.1 puts every boot-time node in the DRAM tier)."""
        tier_of = {n: t for t, nodes in self.memory_tiers.items() for n in nodes}
        slow = [n for n in self.memory_nodes if n not in self.cpu_nodes]
        return bool(slow) and any(tier_of.get(n) != tier_of.get(c) for n in slow
                                  for c in self.cpu_nodes)


def probe_choice_samplers() -> dict[str, list]:
    """Start and close once each sampler :func:`choose` asks about (:data:`CHOICE_SAMPLERS`): name →
    [runs here, how / why not]. Fewer than ``probe_samplers()`` loads (every sampler and variant),
    which under QEMU/TCG costs tens of seconds at every daemon start."""
    from tieringd.sampling import SAMPLERS, SamplerUnavailable, SamplingConfig, TrackedSet
    out: dict[str, list] = {}
    tracked = TrackedSet()
    try:
        for name in CHOICE_SAMPLERS:
            spec = SAMPLERS[name]
            s = spec.make(tracked, SamplingConfig())
            try:
                s.start()
                out[name] = [True, spec.running(s)]
            except SamplerUnavailable as e:
                out[name] = [False, str(e)]
            finally:
                s.close()
    finally:
        tracked.close()
    return out


# --------------------------------------------------------------------------------------------------
# Choice

@dataclasses.dataclass(frozen=True)
class Choice:
    """The signal for this kernel and everything the loop needs to know to run it."""
    mechanism: Mechanism
    sources: tuple[str, ...]              # open_samplers(sources=...)
    fallback: str                         # open_samplers(fallback=...)
    settings: tuple[tuple[str, int | str], ...]   # borrowed in this order (knobs.KNOWN names)
    required: tuple[str, ...]             # without these the mechanism is unsafe: start() fails
    bind_regions: bool                    # blocks must be bound to their node (Bind requests)
    query_via_pagemap: bool               # move_pages(2) can neither see nor move scanned pages
                                          # (< 6.5): query with nodes_of(), move with the shim's mbind
    why: str
    rejected: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        text = {Mechanism.HINT_FAULTS: "hint faults (NUMA-balancing scanning, kernel promotion off, "
                                       "blocks bound to their node)",
                Mechanism.DAMON: "DAMON virtual-address monitoring of the registered ranges",
                Mechanism.PMU: "PMU data-address samples",
                Mechanism.NONE: "none"}[self.mechanism]
        if self.sources:
            text += f", samplers {'+'.join(self.sources)}"
        return text


def _hint_faults_unavailable(f: Facts) -> str | None:
    if f.numa_balancing is None or not f.settings.get("kernel.numa_balancing"):
        return "NUMA balancing is not built in (CONFIG_NUMA_BALANCING)"
    ok, why = f.sampler("fault")
    if not ok:
        return f"the fault sampler cannot run: {why}"
    if f.version < BIND_FLAG_SINCE:
        return (f"Linux {f.release} predates mbind(MPOL_F_NUMA_BALANCING) (5.19): scanned memory "
                "could not be kept from the kernel's own migration")
    return None


def _hint_faults(f: Facts, pmu: bool) -> Choice:
    mode = 3 if f.version >= TIERING_MODE_SINCE else 1
    settings: list[tuple[str, int | str]] = [("kernel.numa_balancing", mode)]
    required = ["kernel.numa_balancing"]
    if f.settings.get("kernel.numa_balancing_promote_rate_limit_MBps"):
        # unbound memory (the rest of every process) in a lower tier is promoted by mode 3 unless
        # the rate limit stops it; bound blocks never are
        settings.append(("kernel.numa_balancing_promote_rate_limit_MBps", 0))
    if f.settings.get("mm.numa.demotion_enabled"):
        settings.append(("mm.numa.demotion_enabled", 0))   # reclaim would demote by itself
    settings += [s for s in SCAN_SETTINGS if f.settings.get(s[0])]
    why = (f"mode {mode} scans both tiers" + ("" if f.slow_nodes_in_lower_tier else
           " (all memory nodes share one tier here: the tiering mode alone would scan none)"))
    return Choice(Mechanism.HINT_FAULTS, ("fault", "pmu") if pmu else ("fault",), "none",
                  tuple(settings), tuple(required), bind_regions=True,
                  query_via_pagemap=f.version < MOVE_PAGES_SEES_PROTNONE_SINCE, why=why)


def _quiet_kernel(f: Facts, damon: bool = False) -> tuple[list[tuple[str, int | str]], list[str]]:
    """Settings under which the kernel migrates nothing by itself: NUMA balancing off (Debian turns
    it on at boot on NUMA machines), demotion off; for DAMON also DAMON_STAT off (its exclusive
    kdamond makes the sysfs interface answer EBUSY)."""
    settings: list[tuple[str, int | str]] = []
    if f.settings.get("kernel.numa_balancing"):
        settings.append(("kernel.numa_balancing", 0))
    if f.settings.get("mm.numa.demotion_enabled"):
        settings.append(("mm.numa.demotion_enabled", 0))
    if damon and f.settings.get("damon_stat.enabled"):
        settings.append(("damon_stat.enabled", "N"))
    return settings, [s for s, _ in settings if s in ("kernel.numa_balancing", "damon_stat.enabled")]


def choose(facts: Facts, prefer: str = "auto") -> Choice:
    """The signal for this kernel: ``prefer`` is "auto" or a :class:`Mechanism` value to try first."""
    rejected: list[tuple[str, str]] = []
    pmu_ok, pmu_why = facts.sampler("pmu")
    damon_ok, damon_why = facts.sampler("damon")
    hint_why = _hint_faults_unavailable(facts)
    order = [Mechanism.HINT_FAULTS, Mechanism.DAMON, Mechanism.PMU]
    if prefer != "auto":
        first = Mechanism(prefer)
        order = [first] + [m for m in order if m is not first]
    for m in order:
        if m is Mechanism.HINT_FAULTS:
            if hint_why is None:
                c = _hint_faults(facts, pmu_ok and prefer in ("auto", m.value))
                return dataclasses.replace(c, rejected=tuple(rejected))
            rejected.append((m.value, hint_why))
        elif m is Mechanism.DAMON:
            if damon_ok:
                settings, required = _quiet_kernel(facts, damon=True)
                return Choice(m, (), "damon", tuple(settings), tuple(required), False, False,
                              "DAMON monitors the registered ranges' accessed bits",
                              tuple(rejected))
            rejected.append((m.value, damon_why))
        elif m is Mechanism.PMU:
            if pmu_ok:
                settings, required = _quiet_kernel(facts)
                return Choice(m, ("pmu",), "none", tuple(settings), tuple(required), False, False,
                              f"the CPU samples data addresses ({pmu_why})", tuple(rejected))
            rejected.append((m.value, pmu_why))
    why = "; ".join(f"{m}: {w}" for m, w in rejected)
    return Choice(Mechanism.NONE, (), "none", (), (), False, False,
                  f"nothing sees populated memory here ({why})", tuple(rejected))


# --------------------------------------------------------------------------------------------------
# The running signal

@dataclasses.dataclass(frozen=True)
class Bind:
    """Ask pid's shim to bind [start, start + length) to ``node`` with MPOL_BIND |
    MPOL_F_NUMA_BALANCING (REBIND, policy BIND, nodemask 1 << node, the numa-balancing flag, no page
    moves): scanned, never migrated by the kernel."""
    pid: int
    start: int
    length: int
    node: int


@dataclasses.dataclass
class _Region:
    block_len: int
    bound: np.ndarray            # node each block is bound to, -1 none


class AccessSignal:
    """The chosen signal, its borrowed settings and the binding state of every registered block."""

    def __init__(self, choice: Choice, borrowed: knobs.Knobs):
        self.choice = choice
        self.knobs = borrowed
        self.started = False
        self.standing_by = ""        # why the signal borrows nothing now (one tier: nothing to tier)
        self._regions: dict[tuple[int, int], _Region] = {}
        self.bind_failures = 0
        self.last_bind_error = ""

    @classmethod
    def for_this_machine(cls, state_path: str | os.PathLike = knobs.DEFAULT_STATE_PATH, *,
                         prefer: str = "auto", facts: Facts | None = None) -> "AccessSignal":
        return cls(choose(facts or Facts.probe(), prefer), knobs.Knobs(state_path))

    # -- life cycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Restore what a crashed run left borrowed, then borrow this signal's settings. Raises
        :class:`AccessSignalError` (with everything put back) when a required one cannot be set."""
        self.knobs.recover()
        try:
            for name, value in self.choice.settings:
                try:
                    self.knobs.borrow(name, value)
                except OSError as e:
                    if name in self.choice.required:
                        raise AccessSignalError(f"access signal {self.choice.mechanism.value}: "
                                                f"cannot set {name} to {value}: {e}") from e
                    log.warning("access signal: %s stays as it is: %s", name, e)
                if name in self.choice.required and name in self.knobs.missing:
                    raise AccessSignalError(f"access signal {self.choice.mechanism.value}: "
                                            f"{self.knobs.missing[name]}")
        except BaseException:
            self.knobs.restore()
            raise
        self.started = True
        self.standing_by = ""
        log.info("%s", self.describe())

    def stop(self) -> list[knobs.Change]:
        """Put every borrowed setting back (idempotent; call it on every exit path)."""
        self.started = False
        return self.knobs.restore()

    def stand_by(self, why: str) -> list[knobs.Change]:
        """Borrow nothing while ``why`` holds (a machine with one tier has nothing to tier): put back
        what this run borrowed, and what a crashed run left, and say so. :meth:`start` ends it.
        Returns what was put back."""
        restored = self.stop()
        self.knobs.recover()
        self.standing_by = why
        log.info("%s", self.describe())
        return restored

    def __enter__(self) -> "AccessSignal":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- regions --------------------------------------------------------------------------------

    def blocks_placed(self, pid: int, start: int, block_len: int, nodes) -> list[Bind]:
        """A region's blocks are on ``nodes`` (one per block, queried: registration, a verified
        move, a periodic re-query; -1 or negative = not known / not populated). Returns the binds
        to send so that every known block is bound to the node it is on; unknown blocks are left
        to the shim's placement (binding unpopulated memory to a full node would make its first
        touch fail)."""
        nodes = np.asarray(nodes, np.int64)
        reg = self._regions.get((pid, start))
        if reg is None or reg.block_len != block_len or len(reg.bound) != len(nodes):
            reg = self._regions[(pid, start)] = _Region(block_len, np.full(len(nodes), -1))
        if not self.choice.bind_regions or self.standing_by:
            return []
        want = np.flatnonzero((nodes >= 0) & (nodes != reg.bound))
        if len(want) == 0:
            return []
        # runs of consecutive blocks on one node: one bind each
        brk = np.ones(len(want), bool)
        brk[1:] = (np.diff(want) != 1) | (nodes[want][1:] != nodes[want][:-1])
        first = np.flatnonzero(brk)
        last = np.append(first[1:], len(want)) - 1
        reg.bound[want] = nodes[want]
        return [Bind(pid, start + int(want[a]) * block_len, int(want[b] - want[a] + 1) * block_len,
                     int(nodes[want[a]])) for a, b in zip(first, last)]

    def bind_failed(self, bind: Bind, error: str, refused: bool = True) -> None:
        """The shim refused a bind (an older shim, a pinned region…) — or, ``refused=False``, it
        could not be sent (the process is leaving, its socket is full): those blocks count as
        unbound, so the next blocks_placed() asks again; the kernel may migrate them meanwhile."""
        self.last_bind_error = f"pid {bind.pid} {bind.start:#x}+{bind.length:#x}: {error}"
        if refused:
            self.bind_failures += 1
            log.warning("access signal: bind refused: %s", self.last_bind_error)
        for (pid, start), reg in self._regions.items():
            if pid == bind.pid and start <= bind.start < start + len(reg.bound) * reg.block_len:
                lo = (bind.start - start) // reg.block_len
                hi = -(-(bind.start + bind.length - start) // reg.block_len)
                reg.bound[lo:hi] = -1

    def region_removed(self, pid: int, start: int) -> None:
        self._regions.pop((pid, start), None)

    def process_exited(self, pid: int) -> None:
        for key in [k for k in self._regions if k[0] == pid]:
            del self._regions[key]

    def nodes_of(self, pid: int, addrs) -> np.ndarray:
        """Each page's node (-1 unknown). move_pages(2) first; before v6.5 it cannot see the pages
        scanning has protected (most cold pages): -ENOENT for a base page, -EFAULT for a THP (lab,
        6.1). Those are read from pagemap (PFN → memory block → node; needs CAP_SYS_ADMIN)."""
        addrs = np.asarray(addrs, np.uint64)
        nodes = numa.query_pages_array(pid, addrs).astype(np.int64)
        blind = (nodes == -2) | (nodes == -14)    # -ENOENT, -EFAULT
        if blind.any() and self.choice.query_via_pagemap:
            nodes[blind] = node_of_pfns(procfs.pfns(procfs.read_pagemap_at(pid, addrs[blind])))
        nodes[nodes < 0] = -1
        return nodes

    # -- reporting ------------------------------------------------------------------------------

    def bound_blocks(self) -> int:
        return int(sum((r.bound >= 0).sum() for r in self._regions.values()))

    def describe(self) -> str:
        """One line for the log and the status: "access signal: hint faults (…); kernel settings
        borrowed: kernel.numa_balancing 0→3, …"."""
        if self.standing_by:
            return f"access signal: standing by, kernel settings untouched — {self.standing_by}"
        text = f"access signal: {self.choice.describe()}; kernel settings borrowed: " \
               f"{self.knobs.describe()}"
        if self.knobs.recovered:
            text += "; restored after an earlier run: " + ", ".join(map(str, self.knobs.recovered))
        if self.knobs.missing:
            text += "; not on this kernel: " + ", ".join(self.knobs.missing)
        if self.choice.mechanism is Mechanism.NONE:
            text += f" — {self.choice.why}"
        return text

    def status(self) -> dict:
        return {"mechanism": self.choice.mechanism.value, "standing_by": self.standing_by or None,
                "sources": list(self.choice.sources),
                "fallback": self.choice.fallback, "why": self.choice.why,
                "borrowed": [dataclasses.asdict(c) for c in self.knobs.changes],
                "missing": dict(self.knobs.missing),
                "recovered": [dataclasses.asdict(c) for c in self.knobs.recovered],
                "rejected": dict(self.choice.rejected), "regions": len(self._regions),
                "bound_blocks": self.bound_blocks(), "bind_failures": self.bind_failures,
                "query_via_pagemap": self.choice.query_via_pagemap}


def node_of_pfns(pfns: np.ndarray) -> np.ndarray:
    """The node of each PFN (0 = unknown) from the memory blocks sysfs lists under each node."""
    size = int(sysfs.read_text("/sys/devices/system/memory/block_size_bytes", "0") or "0", 16)
    if not size:
        return np.full(len(pfns), -1, np.int64)
    block_node: dict[int, int] = {}
    for d in sysfs.glob("/sys/devices/system/node/node*/memory*"):
        m = re.search(r"/node(\d+)/memory(\d+)$", d)
        if m:
            block_node[int(m.group(2))] = int(m.group(1))
    blocks = (np.asarray(pfns, np.uint64) * np.uint64(procfs.PAGE_SIZE)) // np.uint64(size)
    return np.array([block_node.get(int(b), -1) if p else -1 for b, p in zip(blocks, pfns)],
                    np.int64)
