# SPDX-License-Identifier: Apache-2.0
"""[shim], [sampling] and [mover]: the CONFIG record the registry sends each shim at its HELLO, the
samplers the daemon opens and when it reads them, and what the migration engine does with a move —
through its ``Kernel`` seam (a simulated kernel that follows move_pages' reporting rules) and its clock."""
from __future__ import annotations

import json
import os
import socket
import threading
import time

import numpy as np

from tieringd.contracts import Priority
from tieringd.kernel import knobs, numa
from tieringd.mover import MigrationEngine, MoveRequest
from tieringd.sampling import SamplerSet, TrackedSet, open_samplers
from tieringd.sampling import _perf
from tieringd.sampling.access_signal import AccessSignal, Facts, choose
from tieringd.sampling.base import Sampler, empty_deltas
from tieringd.sampling.catalog import access_sampler
from tieringd.shim import protocol as P
from tieringd.shim.registry import Registry

from keyprobe import Ctx, host_probe, probe
from test_mover_engine import BASE, FALLBACKS, HP, PS, Clock, SimKernel

MiB = 1 << 20
HOST = "tests/host/test_config_keys_host.py"


# ---- [shim]: the CONFIG record a shim gets at its HELLO ------------------------------------------------

def config_record(ctx: Ctx, text: str = "") -> P.Config | None:
    """What a shim that says HELLO hears from the registry the daemon builds from ``text`` (None:
    nothing, the shim keeps its own settings)."""
    s = ctx.settings(text)
    reg = Registry(str(ctx.dir() / "run"), shim_config=s.shim.to_message()).start()   # as Daemon._start
    c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        c.connect(reg.path)
        c.send(P.Hello(pid=os.getpid(), min_bytes=4 * MiB, policy=P.Policy.FAST, agent="probe", seq=1).encode())
        deadline = time.monotonic() + 5
        while not reg.processes() and time.monotonic() < deadline:
            reg.poll(0.05)
        assert reg.processes(), "the registry did not take the HELLO"
        c.settimeout(0.3)
        try:
            return P.decode(c.recv(256))
        except TimeoutError:
            return None
    finally:
        c.close()
        reg.close()


def configured(ctx: Ctx, text: str, field: P.ConfigField) -> P.Config:
    assert config_record(ctx) is None                  # the defaults: no record, the shim's own
    msg = config_record(ctx, text)
    assert isinstance(msg, P.Config) and msg.fields == int(field), msg
    return msg


@probe("shim", "min_bytes")
def _(ctx):
    """The shims are told to manage allocations of 8 MiB and up."""
    assert configured(ctx, '[shim]\nmin_bytes = "8M"\n', P.ConfigField.MIN_BYTES).min_bytes == 8 * MiB


@probe("shim", "max_bytes")
def _(ctx):
    """The shims are told to leave allocations above 1 GiB alone."""
    assert configured(ctx, '[shim]\nmax_bytes = "1G"\n', P.ConfigField.MAX_BYTES).max_bytes == 1 << 30


@probe("shim", "policy")
def _(ctx):
    """The shims place new KV allocations slow tier first."""
    msg = configured(ctx, '[shim]\npolicy = "slow-first"\n', P.ConfigField.POLICY)
    assert msg.policy == int(P.Policy.parse("slow-first"))


@probe("shim", "pinned_policy")
def _(ctx):
    """The shims place pools pinned for a GPU on the fast tier."""
    msg = configured(ctx, '[shim]\npinned_policy = "fast"\n', P.ConfigField.PINNED_POLICY)
    assert msg.pinned_policy == int(P.Policy.FAST)


@probe("shim", "thp")
def _(ctx):
    """The shims are told not to advise huge pages."""
    assert configured(ctx, "[shim]\nthp = false\n", P.ConfigField.THP).thp == 0


@probe("shim", "ksm")
def _(ctx):
    """The shims are told to make managed regions mergeable."""
    assert configured(ctx, "[shim]\nksm = true\n", P.ConfigField.KSM).ksm == 1


@probe("shim", "backing")
def _(ctx):
    """A server started with tieringctl run gets memfd-backed regions (the DAX-remap tier's kind)."""
    import subprocess
    import sys
    from paths import REPO

    def backing(text: str) -> str:
        path = ctx.dir() / "backing.toml"
        path.write_text(text)
        code = "from tieringd.cli import main; main(['run', '--', sys.executable, '-c', " \
               "'import os; print(os.environ.get(\\'TIERINGD_BACKING\\', \\'anon\\'))'])"
        r = subprocess.run([sys.executable, "-c", "import sys; " + code], capture_output=True, text=True,
                           env={**os.environ, "TIERINGD_CONFIG": str(path), "PYTHONPATH": str(REPO),
                                "TIERINGD_REGISTER": "0"}, timeout=60)
        return r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr
    assert backing("") == "anon"
    assert backing('[shim]\nbacking = "memfd"\n') == "memfd"


# ---- [sampling]: the samplers the daemon opens, and when it reads them --------------------------------

def with_signal(ctx: Ctx, text: str = ""):
    """A daemon whose access signal is the one chosen for the captured cxl-6.12 guest (hint faults)."""
    d = ctx.daemon(text)
    facts = Facts.from_dict(json.loads((ctx.repo / "tests/fixtures/access_signal/cxl-6.12.json").read_text()))
    d.signal = AccessSignal(choose(facts), knobs.Knobs(str(ctx.dir() / "knobs.json")))
    return d


def sampler(ctx: Ctx, name: str, text: str):
    """The sampler ``name`` as the daemon's catalog builds it from the [sampling] of ``text`` (not started)."""
    return access_sampler(name).make(TrackedSet(), ctx.settings(text).sampling)


@probe("sampling", "sources")
def _(ctx):
    """Without "fault" the daemon starts none of the signal's BPF sources (hint faults here)."""
    assert with_signal(ctx)._sources() == ("fault",)
    assert with_signal(ctx, '[sampling]\nsources = ["pmu", "dma"]\n')._sources() == ()


@probe("sampling", "fallback")
def _(ctx):
    """"idle-page": with no BPF source running the daemon's sampler set falls back to idle-page
    tracking, where "auto" takes the signal's choice (none, with hint faults)."""
    def opened(text: str) -> tuple[str | None, set[str]]:
        d = with_signal(ctx, text)
        s = d.settings.sampling
        tracked = TrackedSet()
        try:
            with open_samplers(tracked, s, **{**d._sampler_options(), "sources": ()}) as ss:
                return ss.fallback_reason, {x.name for x in ss.samplers} | set(ss.unavailable)
        finally:
            tracked.close()
    assert opened("") == (None, set())
    reason, tried = opened('[sampling]\nfallback = "idle-page"\n')
    assert reason is not None and tried == {"idle-page"}


@probe("sampling", "pmu_event")
def _(ctx):
    """The software page-fault event instead of the machine's data-address PMU (or none)."""
    def event(text: str) -> str:
        s = sampler(ctx, "pmu", text)
        try:
            return _perf.resolve_event(s.event_name, s.sample_period).name     # PmuSampler.open
        except OSError as e:
            return f"unavailable: {e.strerror}"
    assert event("") != "software-page-faults"
    assert event('[sampling]\npmu_event = "software-page-faults"\n') == "software-page-faults"


@probe("sampling", "pmu_sample_period")
def _(ctx):
    """One sample every 7 events instead of the event's own period (1 for page faults)."""
    sw = '[sampling]\npmu_event = "software-page-faults"\n'
    for text, period in ((sw, 1), (sw + "pmu_sample_period = 7\n", 7)):
        s = sampler(ctx, "pmu", text)
        assert _perf.resolve_event(s.event_name, s.sample_period).attr.sample_period == period


@probe("sampling", "blocks_max")
def _(ctx):
    """The BPF sources' epoch maps are sized for 1024 blocks."""
    for name in ("fault", "pmu", "dma"):
        assert sampler(ctx, name, "").blocks_max == 32768
        assert sampler(ctx, name, "[sampling]\nblocks_max = 1024\n").blocks_max == 1024


@probe("sampling", "raw")
def _(ctx):
    """The BPF sources write raw samples to a ring buffer beside their counts."""
    for name in ("fault", "pmu", "dma"):
        assert not sampler(ctx, name, "").raw and sampler(ctx, name, "[sampling]\nraw = true\n").raw


@probe("sampling", "thp_accounting")
def _(ctx):
    """The fault source counts faults, not base pages seen accessed (the counts: tests/host)."""
    assert sampler(ctx, "fault", "").thp_accounting
    assert not sampler(ctx, "fault", "[sampling]\nthp_accounting = false\n").thp_accounting


host_probe("sampling", "migrations", HOST, "test_sampling_migrations_false_opens_no_migration_counter",
           "false: the daemon's BPF sampler set opens no migration counter, and its metrics export no "
           "migrations per reason")


class Counting(Sampler):
    """A sampler that sees nothing and counts how often it is read."""
    name = "counting"

    def __init__(self):
        self.reads = 0

    def start(self) -> None:
        pass

    def read_deltas(self) -> np.ndarray:
        self.reads += 1
        return empty_deltas()


@probe("sampling", "interval_ms")
def _(ctx):
    """Reading every 50 ms: each of five ticks 60 ms apart reads the samplers (every 100 ms: three)."""
    def reads(text: str) -> int:
        d = ctx.daemon(text)
        c = Counting()
        d.samplers = SamplerSet(TrackedSet(), [c], {})
        for i in range(5):
            d._sample(10.0 + 0.06 * i, 0)
        return c.reads
    assert reads("") == 3 and reads("[sampling]\ninterval_ms = 50\n") == 5


# ---- [mover]: the engine, through its Kernel seam ------------------------------------------------------

class Kernel(SimKernel):
    """The simulated kernel, recording the flags of each move_pages call; each call takes
    ``per_call_s`` of the engine's clock."""

    def __init__(self, clock: Clock | None = None, per_call_s: float = 0.0):
        super().__init__()
        self.flags: list[int] = []
        self.clock, self.per_call_s = clock, per_call_s

    def move(self, pid, addrs, node, flags):
        self.flags.append(flags)
        if self.clock is not None:
            self.clock.t += self.per_call_s
        return super().move(pid, addrs, node, flags)


def engine(ctx: Ctx, text: str, per_call_s: float = 0.0) -> tuple[MigrationEngine, Kernel]:
    """The engine ``Daemon._start`` builds from the [mover] of ``text``, on the simulated kernel."""
    clock = Clock()
    k = Kernel(clock, per_call_s)
    e = MigrationEngine(ctx.settings(text).mover, FALLBACKS, kernel=k, clock=clock, sleep=clock.sleep)
    return e, k


def demote(e: MigrationEngine, k: Kernel, pid: int, npages: int, priority=Priority.DEMOTE):
    k.populate(pid, BASE, npages, node=0)
    return e.submit(MoveRequest(pid, [(BASE, npages * PS)], 1, priority))


@probe("mover", "batch_pages")
def _(ctx):
    """256 pages per move_pages call: four calls for 1024 pages instead of one."""
    for text, calls in (("", 1), ("[mover]\nbatch_pages = 256\n", 4)):
        e, k = engine(ctx, text)
        demote(e, k, 7, 1024)
        e.run_until_idle()
        assert len(k.calls) == calls


def paced(ctx: Ctx, text: str, priority: Priority) -> float:
    """Seconds of the engine's clock to move 8 MiB."""
    e, k = engine(ctx, text)
    demote(e, k, 7, 2048, priority)
    e.run_until_idle()
    return k.clock.t


@probe("mover", "promote_rate_mb_s")
def _(ctx):
    """1 MB/s for promotions: 8 MiB takes seconds instead of no time (demotions are not held)."""
    text = "[mover]\npromote_rate_mb_s = 1\nbatch_pages = 64\n"
    assert paced(ctx, "", Priority.PROMOTE) == 0 and paced(ctx, text, Priority.PROMOTE) > 5
    assert paced(ctx, text, Priority.DEMOTE) == 0


@probe("mover", "demote_rate_mb_s")
def _(ctx):
    """1 MB/s for demotions: 8 MiB takes seconds instead of no time."""
    assert paced(ctx, "", Priority.DEMOTE) == 0
    assert paced(ctx, "[mover]\ndemote_rate_mb_s = 1\nbatch_pages = 64\n", Priority.DEMOTE) > 5


@probe("mover", "max_queued")
def _(ctx):
    """One job waiting at most: of three demotions queued at once, two are dropped."""
    for text, dropped in (("", 0), ("[mover]\nmax_queued = 1\n", 2)):
        e, k = engine(ctx, text)
        for pid in (1, 2, 3):
            demote(e, k, pid, 4)
        assert e.run_until_idle().dropped_jobs == dropped


@probe("mover", "workers")
def _(ctx):
    """Four worker threads start instead of two."""
    for text, n in (("", 2), ("[mover]\nworkers = 4\n", 4)):
        e, _ = engine(ctx, text)
        before = {t.ident for t in threading.enumerate()}
        e.start()
        try:
            mine = [t for t in threading.enumerate() if t.ident not in before and t.name.startswith("tieringd-mover")]
            assert len(mine) == n
        finally:
            e.stop()


@probe("mover", "slice_batches")
def _(ctx):
    """A job yields its worker after every batch: a retry that came due while it ran goes next (after
    8 batches it waits for the job's eighth). The retry is of a job older than the long one."""
    def retry_at(text: str) -> int:
        e, k = engine(ctx, "[mover]\nbatch_pages = 8\n" + text, per_call_s=0.01)
        k.busy_once = {BASE}                              # refused once, retried 0.05 s later

        def long_job_after_the_first_try(report) -> None:
            if report.pid == 1 and len(k.calls) == 1:
                demote(e, k, 2, 160)                      # 20 batches of 0.01 s
        e.on_progress = long_job_after_the_first_try
        demote(e, k, 1, 1)
        e.run_until_idle()
        return [i for i, (pid, _, _) in enumerate(k.calls) if pid == 1][1]
    assert retry_at("") == 9 and retry_at("slice_batches = 1\n") == 6


@probe("mover", "max_retries")
def _(ctx):
    """No retries: a pinned page is tried once and reported pinned, not four times."""
    for text, tries in (("", 4), ("[mover]\nmax_retries = 0\n", 1)):
        e, k = engine(ctx, text)
        k.pinned = {BASE}
        t = demote(e, k, 7, 1)
        e.run_until_idle()
        assert len(k.calls) == tries and t.wait(0).by_reason() == {"pinned": 1}


@probe("mover", "retry_backoff_s")
def _(ctx):
    """A 2 s first back-off: the busy page moves 2 s later, not 50 ms."""
    for text, at in (("", 0.05), ("[mover]\nretry_backoff_s = 2.0\n", 2.0)):
        e, k = engine(ctx, text)
        k.busy_once = {BASE}
        demote(e, k, 7, 1)
        e.run_until_idle()
        assert abs(k.clock.t - at) < 1e-6 and k.pages[7][BASE] == 1


@probe("mover", "full_backoff_s")
def _(ctx):
    """0: after the target was full, every batch asks it again before the fallback (1 s: only the first)."""
    def target_calls(text: str) -> int:
        e, k = engine(ctx, "[mover]\nbatch_pages = 16\n" + text)
        k.free[1] = 0
        demote(e, k, 7, 64)
        e.run_until_idle()
        assert set(k.pages[7].values()) == {2}            # the fallback took them all
        return sum(1 for _, _, node in k.calls if node == 1)
    assert target_calls("") == 1 and target_calls("full_backoff_s = 0\n") == 4


@probe("mover", "detect_thp")
def _(ctx):
    """false: a huge page is sent as its 512 base pages, not as one address."""
    for text, sent in (("", 1), ("[mover]\ndetect_thp = false\n", HP // PS)):
        e, k = engine(ctx, text)
        k.thp_blocks = {BASE}
        demote(e, k, 7, HP // PS)
        e.run_until_idle()
        assert [n for _, n, _ in k.calls] == [sent]


@probe("mover", "move_shared")
def _(ctx):
    """move_pages is called with MPOL_MF_MOVE_ALL: pages other processes map move too."""
    for text, flag in (("", numa.MPOL_MF_MOVE), ("[mover]\nmove_shared = true\n", numa.MPOL_MF_MOVE_ALL)):
        e, k = engine(ctx, text)
        demote(e, k, 7, 4)
        e.run_until_idle()
        assert k.flags == [flag]
