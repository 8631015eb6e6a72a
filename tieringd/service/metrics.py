# SPDX-License-Identifier: Apache-2.0
"""Prometheus exposition (prometheus-client), off by default: ``[metrics] listen = "127.0.0.1:9464"``.

prometheus-client serves ``/metrics`` from its own thread; the collector there never reads the live
block table (numpy arrays only the loop writes). On each scrape it asks the loop for a fresh
:class:`Snapshot` (``daemon.call_soon``) and waits up to ``snapshot_timeout_ms``; a loop too busy to
answer in time gets the previous snapshot served, and ``tieringd_snapshot_age_seconds`` says how old
it is. A snapshot holds plain Python numbers, built by :mod:`tieringd.service.reports` in the loop thread.

Names follow the Prometheus conventions (``tieringd_`` prefix, base units, ``_bytes``, ``_seconds``,
``_total`` for counters); docs/service.md lists them with their labels.
"""
from __future__ import annotations

import bisect
import dataclasses
import ipaddress
import logging
import threading
import time
from typing import Any, Callable

from tieringd import __version__
from tieringd.service import reports
from tieringd.config import ConfigError, Table, ranged
from tieringd.contracts import Tier

log = logging.getLogger("tieringd.metrics")

# Tick durations, seconds: the policy interval is 100 ms by default; TCG guests run 10× slower.
TICK_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclasses.dataclass(frozen=True)
class MetricsConfig(Table):
    """The ``[metrics]`` table."""
    NAME = "metrics"
    listen: str = ""                 # "ADDRESS:PORT" to serve /metrics, e.g. "127.0.0.1:9464"; "" = off
    snapshot_timeout_ms: int = ranged(1000, 1, 60_000, unit="milliseconds")  # how long a scrape waits for the loop's snapshot

    def validate(self) -> None:
        super().validate()
        if self.listen:
            try:
                parse_listen(self.listen)
            except ValueError as e:
                raise ConfigError.bad_value("metrics", "listen", f'"ADDRESS:PORT" ({e})', self.listen) from None


def parse_listen(text: str) -> tuple[str, int]:
    """"127.0.0.1:9464", "[::1]:9464", ":9464" (all addresses) → (address, port); port 0 takes any
    free port (tests; the log says which)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError("the port must be 0-65535")
    host = host.strip("[]")
    if host:
        ipaddress.ip_address(host)      # a literal address: no resolver in the daemon's start path
    return host or "0.0.0.0", int(port)


class TickHistogram:
    """Cumulative tick-duration buckets, observed in the loop thread (``observe_ms`` after each tick)."""

    def __init__(self, buckets_s: tuple[float, ...] = TICK_BUCKETS_S):
        self.buckets_s = buckets_s
        self.counts = [0] * (len(buckets_s) + 1)      # the last one is +Inf
        self.sum_s = 0.0

    def observe_ms(self, duration_ms: float) -> None:
        s = duration_ms / 1000.0
        self.counts[bisect.bisect_left(self.buckets_s, s)] += 1
        self.sum_s += s

    def cumulative(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for edge, n in zip([*map(repr, self.buckets_s), "+Inf"], self.counts):
            total += n
            out.append((edge, total))
        return out


@dataclasses.dataclass
class Snapshot:
    """What one scrape shows, taken in the loop thread."""
    taken_ns: int
    process_tier_bytes: list[tuple[str, str, str, float]]      # pid, comm, tier, bytes
    tier_bytes: dict[str, float]
    tier_capacity_bytes: dict[str, float]
    node_bytes: dict[str, tuple[str, float]]                  # node → (tier, bytes)
    migration_bytes: dict[tuple[str, str], float]             # (direction, outcome) → bytes
    sampler_events: dict[tuple[str, str], int]                # (sampler, counter) → count
    ticks: int
    tick_overruns: int
    tick_histogram: list[tuple[str, int]] | None
    tick_sum_s: float
    mover_queue_jobs: int
    regions: int
    processes: int
    registered_bytes: int
    control_refusals: int
    info: dict[str, str]
    pool: dict[str, Any] | None = None                       # tieringd.pool.poolmap.metrics, with [pool]


def direction(src: int, dst: int, tiers_of: dict[int, Tier]) -> str:
    """promote (to a faster tier), demote (slower), lateral (same tier), unknown (no source)."""
    a, b = tiers_of.get(src), tiers_of.get(dst)
    if src < 0 or a is None or b is None:
        return "unknown"
    return "promote" if b < a else "demote" if b > a else "lateral"


def sampler_counters(d) -> dict[tuple[str, str], int]:
    """The samplers' own counters (``SamplerSet.stats()``: per BPF program, summed over CPUs)."""
    samplers = getattr(d, "samplers", None)
    if samplers is None:
        return {}
    try:
        stats = samplers.stats()
    except Exception:               # a sampler closing under us: no counters this scrape
        log.debug("sampler counters unavailable", exc_info=True)
        return {}
    return {(name, counter): int(v) for name, counters in stats.items() for counter, v in counters.items()}


def take(d, service: dict[str, Any] | None = None) -> Snapshot:
    """Build a snapshot from the daemon's parts (loop thread only)."""
    service = service or {}
    agg = reports.per_pid(d)
    per_process = []
    for i, pid in enumerate(agg.pids.tolist()):
        name = reports.comm(int(pid)) or ""
        for t, label in enumerate(reports.TIER_LABELS):
            b = float(agg.tier_bytes[i, t])
            if b:
                per_process.append((str(pid), name, label, b))
    tiers_of = reports.node_tiers(d)
    counters = reports.engine_counters(d.engine)
    ps = reports.counters_page_size()
    migrations: dict[tuple[str, str], float] = {}
    for (src, dst), c in counters.pairs.items():
        way = direction(src, dst, tiers_of)
        for outcome, pages in (("moved", c.moved_pages), ("fallback", c.fallback_pages),
                               ("landed-elsewhere", c.landed_elsewhere_pages),
                               ("already-there", c.already_pages),
                               *((str(k), v) for k, v in c.failed_pages.items())):
            if pages:
                migrations[(way, outcome)] = migrations.get((way, outcome), 0.0) + pages * ps
    by_node = reports.bytes_by_node(d)
    procs = d.registry.processes()
    hist = service.get("tick_histogram")
    try:
        mechanism = d.signal.choice.mechanism.value
    except Exception:
        mechanism = "unknown"
    return Snapshot(
        taken_ns=time.monotonic_ns(), process_tier_bytes=per_process, tier_bytes=reports.bytes_by_tier(d),
        tier_capacity_bytes={s.tier.label: float(s.capacity_bytes) for s in d.tiers},
        node_bytes={str(n): (t.label, by_node.get(str(n), 0.0)) for n, t in sorted(tiers_of.items())},
        migration_bytes=migrations, sampler_events=sampler_counters(d),
        ticks=d.ticks.count, tick_overruns=d.ticks.overruns,
        tick_histogram=hist.cumulative() if hist is not None else None,
        tick_sum_s=hist.sum_s if hist is not None else 0.0,
        mover_queue_jobs=d.engine.pending(), regions=sum(len(p.regions) for p in procs),
        processes=len(procs), registered_bytes=sum(p.total_bytes for p in procs),
        control_refusals=int(service.get("control_refusals", 0)),
        info={"version": __version__, "signal": mechanism,
              "lifecycle": str(service.get("lifecycle", ""))},
        pool=_pool(d))


def _pool(d) -> dict[str, Any] | None:
    agent = getattr(d, "pool", None)
    if agent is None:
        return None
    from tieringd.pool import poolmap
    return poolmap.metrics(agent)


class Exporter:
    """The /metrics endpoint. ``snapshot()`` is called in the loop thread (via ``daemon.call_soon``)."""

    def __init__(self, daemon, cfg: MetricsConfig, snapshot: Callable[[], Snapshot]):
        self.daemon, self.cfg, self._take = daemon, cfg, snapshot
        self._last: Snapshot | None = None
        self._lock = threading.Lock()
        self._server = None
        self.address: tuple[str, int] | None = None

    def start(self) -> "Exporter":
        from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        ProcessCollector(registry=registry)        # process_cpu_seconds_total, memory, fds: the daemon's own
        host, port = parse_listen(self.cfg.listen)
        self._server, _ = start_http_server(port, host, registry=registry)
        self.address = self._server.server_address[:2]
        log.info("metrics on http://%s:%d/metrics", *self.address)
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # ---- the scrape (prometheus-client's thread) ---------------------------------------------------
    def fresh(self) -> Snapshot | None:
        done = threading.Event()
        box: list[Snapshot] = []

        def publish() -> None:          # loop thread
            try:
                box.append(self._take())
            except Exception:
                log.exception("metrics: snapshot failed")
            finally:
                done.set()

        self.daemon.call_soon(publish)
        if done.wait(self.cfg.snapshot_timeout_ms / 1000.0) and box:
            with self._lock:
                self._last = box[0]
        with self._lock:
            return self._last

    def describe(self):
        return []

    def collect(self):
        snap = self.fresh()
        if snap is None:
            return
        yield from families(snap)


def families(snap: Snapshot):
    """The metric families of one snapshot (also what the tests read)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily

    def gauge(name, doc, labels=(), rows=()):
        g = GaugeMetricFamily(name, doc, labels=list(labels))
        for *lv, v in rows:
            g.add_metric(list(lv), v)
        return g

    def counter(name, doc, labels=(), rows=()):
        c = CounterMetricFamily(name, doc, labels=list(labels))
        for *lv, v in rows:
            c.add_metric(list(lv), v)
        return c

    info = InfoMetricFamily("tieringd", "tieringd version and the mechanisms in use")
    info.add_metric([], snap.info)
    yield info
    yield gauge("tieringd_process_tier_bytes", "Bytes of a process's managed blocks on each tier",
                ("pid", "comm", "tier"), snap.process_tier_bytes)
    yield gauge("tieringd_tier_managed_bytes", "Bytes of managed blocks on each tier", ("tier",),
                sorted(snap.tier_bytes.items()))
    yield gauge("tieringd_tier_capacity_bytes", "Bytes of managed blocks each tier may hold", ("tier",),
                sorted(snap.tier_capacity_bytes.items()))
    yield gauge("tieringd_node_managed_bytes", "Bytes of managed blocks on each NUMA node", ("node", "tier"),
                [(n, t, b) for n, (t, b) in sorted(snap.node_bytes.items())])
    yield counter("tieringd_migration_bytes", "Bytes the mover handled, by direction and outcome",
                  ("direction", "outcome"), [(d, o, b) for (d, o), b in sorted(snap.migration_bytes.items())])
    yield counter("tieringd_sampler_events", "The samplers' own counters (BPF programs, summed over CPUs)",
                  ("sampler", "counter"), [(s, c, v) for (s, c), v in sorted(snap.sampler_events.items())])
    yield counter("tieringd_ticks", "Policy ticks run", rows=[(snap.ticks,)])
    yield counter("tieringd_tick_overruns", "Ticks that overran their interval", rows=[(snap.tick_overruns,)])
    if snap.tick_histogram is not None:
        h = HistogramMetricFamily("tieringd_tick_duration_seconds", "Duration of one policy tick")
        h.add_metric([], snap.tick_histogram, snap.tick_sum_s)
        yield h
    yield gauge("tieringd_mover_queue_jobs", "Migration jobs queued or running", rows=[(snap.mover_queue_jobs,)])
    yield gauge("tieringd_regions", "Registered regions", rows=[(snap.regions,)])
    yield gauge("tieringd_processes", "Processes with a shim connected", rows=[(snap.processes,)])
    yield gauge("tieringd_registered_bytes", "Bytes of registered regions", rows=[(snap.registered_bytes,)])
    yield counter("tieringd_control_refusals", "Control socket connections refused", rows=[(snap.control_refusals,)])
    if snap.pool is not None:
        yield from pool_families(snap.pool, gauge, counter)
    yield gauge("tieringd_snapshot_age_seconds", "Age of the snapshot this scrape shows",
                rows=[((time.monotonic_ns() - snap.taken_ns) / 1e9,)])


def pool_families(p: dict[str, Any], gauge, counter):
    """The pool's metrics (docs/pool.md): what this host's agent read at its last heartbeat."""
    yield gauge("tieringd_pool_extents", "Extents of the shared pool: total, free, held by this host",
                ("state",), sorted(p["extents"].items()))
    yield gauge("tieringd_pool_host_claimed_bytes", "Bytes of the pool each host holds (its claims)",
                ("host",), [(h, c) for h, c, _, _ in p["hosts"]])
    yield gauge("tieringd_pool_host_used_bytes", "Bytes each host keeps in its part of the pool",
                ("host",), [(h, u) for h, _, u, _ in p["hosts"]])
    yield gauge("tieringd_pool_host_saved_bytes", "Bytes each host saves by mapping shared blocks",
                ("host",), [(h, s) for h, _, _, s in p["hosts"]])
    yield gauge("tieringd_pool_member", "1 while this host is a proven member of the pool",
                ("state",), [(p["state"], 1.0 if p["state"] == "member" else 0.0)])
    yield gauge("tieringd_pool_etcd_up", "1 while etcd answers this host's agent", rows=[(1.0 if p["etcd_up"] else 0.0,)])
    yield counter("tieringd_pool_claimed_extents", "Extents this host claimed", rows=[(p["claimed_extents_total"],)])
    yield counter("tieringd_pool_released_extents", "Extents this host gave back",
                  rows=[(p["released_extents_total"],)])
    yield counter("tieringd_pool_etcd_failovers", "Requests another etcd member answered",
                  rows=[(p["etcd_failovers"],)])
    yield counter("tieringd_pool_refused_entries", "etcd entries refused as not the pool's, by key kind",
                  ("kind",), sorted(p["refused_entries"].items()))
