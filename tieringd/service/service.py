# SPDX-License-Identifier: Apache-2.0
"""What turns the loop into a service: the control socket, the metrics endpoint, the process
lifecycle watcher, systemd's notifications, and reloading the configuration on SIGHUP.

    svc = Service(daemon, cfg, built, run_dir=run_dir)   # cfg, built = settings.load(path)
    svc.start()          # before daemon.run(): sockets listen, readers are in the loop
    daemon.run()         # READY=1 once the registry and control sockets answer (on_ready)
    svc.stop()           # STOPPING=1 (also sent from SIGTERM at once), everything closed

Everything here runs in the loop thread except the heartbeat (a thread that only calls
``daemon.call_soon``), the metrics HTTP thread (which reads snapshots) and the migrate waiters.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import os
import signal
import socket
import threading
import time
from typing import Any

from tieringd import config, settings
from tieringd.service import reports
from tieringd.shim import protocol as P
from tieringd.config import ConfigError, ConfigFile
from tieringd.contracts import Priority, Tier
from tieringd.service.control import (ControlServer, Deferred, Request, RequestError, clip_ranges, process_ranges,
                                      process_uid)
from tieringd.service.lifecycle import ProcessEvent, ProcessWatcher
from tieringd.service.metrics import Exporter, TickHistogram, take as take_snapshot
from tieringd.mover.vmstat import vmstat_snapshot
from tieringd.service.sd_notify import Notifier

log = logging.getLogger("tieringd.service")

# Requests that change the daemon for every user: root's alone, whoever else may use the socket.
ROOT_ONLY = frozenset({"policy-set"})
MAX_MIGRATE_RANGES = 4096     # ranges one migrate request may name
HEARTBEAT_S = 1.0            # lifecycle watch list, STATUS= every 5th beat, WATCHDOG=1 when asked
STATUS_EVERY = 5


class Service:
    def __init__(self, daemon, cfg: ConfigFile, built: settings.Settings, *, run_dir: str,
                 notifier: Notifier | None = None):
        self.d = daemon
        self.cfg, self.built = cfg, built
        self.run_dir = run_dir
        self.notifier = notifier or Notifier.from_env()
        self.control = ControlServer(daemon, run_dir, built.control, handlers=self.handlers(),
                                     root_only=ROOT_ONLY)
        self.metrics: Exporter | None = None
        self.watcher: ProcessWatcher | None = None
        self.vmstat_at_start = vmstat_snapshot()
        self.overrides: dict[str, Any] = {}          # `tieringctl policy set`, until the next reload
        self.ready = False
        self.process_events = 0
        self.tick_histogram = TickHistogram()
        self._ticks_seen = 0
        self._beats = 0
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._hup_fd: int | None = None
        self._old_handlers: dict[int, Any] = {}
        self._starting: threading.Thread | None = None
        self._parts_started = threading.Event()
        self.failed: Exception | None = None        # what stopped the start thread (the daemon stops)
        self.started_at = 0.0

    # ---- start and stop -------------------------------------------------------------------------
    def start(self, *, wait: bool = True) -> "Service":
        """The control socket now; the lifecycle watcher and the metrics endpoint in a thread
        (``tieringd-service-start``), joined here unless ``wait=False``. The daemon starts with
        ``wait=False``: importing pyroute2 and prometheus-client and subscribing to the connector
        take seconds where files are slow to read (the lab's 9p root under TCG), and overlap the
        loop's own start that way. READY=1 waits for them either way."""
        self.started_at = time.monotonic()
        self.control.start()
        self.d.on_ready.append(self._on_ready)
        self._starting = threading.Thread(target=self._start_parts, name="tieringd-service-start", daemon=True)
        self._starting.start()
        if wait:
            self._starting.join()
            if self.failed is not None:
                raise self.failed
        return self

    def _start_parts(self) -> None:
        timings = []
        try:
            t = time.monotonic()
            self.watcher = ProcessWatcher(self.built.lifecycle, on_event=self._process_event)
            timings.append(f"lifecycle {time.monotonic() - t:.2f} s")
            self.d.call_soon(self._attach_watcher)
            mcfg = self.built.metrics
            if mcfg.listen:
                t = time.monotonic()
                try:
                    self.metrics = Exporter(self.d, mcfg,
                                            lambda: take_snapshot(self.d, self._service_counts())).start()
                except OSError as e:
                    raise RuntimeError(f"[metrics] listen = {mcfg.listen!r}: {e.strerror or e}") from None
                timings.append(f"metrics {time.monotonic() - t:.2f} s")
        except Exception as e:          # [lifecycle] source = "netlink" unavailable, the port taken
            log.error("%s", e)
            self.failed = e
            self.d.request_stop()
            return
        finally:
            self._parts_started.set()
        log.info("service started in %.2f s beside the loop (%s)", time.monotonic() - self.started_at,
                 ", ".join(timings))
        self.d.call_soon(self._parts_done)

    def _parts_done(self) -> None:
        """Loop thread, after the watcher is attached: READY=1 now if the first tick already ran."""
        if self._heartbeat is not None:
            self._check_ready()

    def _attach_watcher(self) -> None:
        """Loop thread: the watcher's events into the loop (closed by :meth:`stop`)."""
        if self._stop.is_set() or self.watcher is None:
            return
        self.d.add_reader(self.watcher.fileno(), self.watcher.handle)
        if self.d.table is not None:
            self.watcher.watch(reports.pids_held(self.d))

    def install_signal_handlers(self) -> None:
        """SIGHUP: reload in the loop thread (the handler only writes an eventfd the loop reads).
        SIGTERM/SIGINT: STOPPING=1 at once, then whatever handler was there (the daemon's)."""
        self._hup_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.d.add_reader(self._hup_fd, self._on_hup)
        self._old_handlers[signal.SIGHUP] = signal.signal(signal.SIGHUP,
                                                          lambda *_: os.eventfd_write(self._hup_fd, 1))
        for sig in (signal.SIGTERM, signal.SIGINT):
            prev = signal.getsignal(sig)

            def handler(signum, frame, prev=prev):
                self.notifier.stopping(f"stopping ({signal.Signals(signum).name})")
                if callable(prev):
                    prev(signum, frame)
                elif prev == signal.SIG_DFL:
                    raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)
            self._old_handlers[sig] = signal.signal(sig, handler)

    def stop(self, why: str = "stopping") -> None:
        self.notifier.stopping(why)
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(2.0)
        if self._starting is not None:
            self._starting.join(10.0)
        for closer in (self.control.close, getattr(self.watcher, "close", None),
                       getattr(self.metrics, "close", None)):
            if closer is None:
                continue
            try:
                closer()
            except Exception:
                log.exception("closing %s failed", closer)
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        if self._hup_fd is not None:
            os.close(self._hup_fd)
            self._hup_fd = None

    # ---- readiness and the heartbeat (loop thread) ------------------------------------------------
    def _registry_answers(self) -> bool:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK)
        try:
            s.connect(P.socket_path(self.run_dir))
            return True
        except OSError:
            return False
        finally:
            s.close()

    def _on_ready(self) -> None:
        self._check_ready()
        self._heartbeat = threading.Thread(target=self._beat_thread, name="tieringd-heartbeat", daemon=True)
        self._heartbeat.start()

    def _check_ready(self) -> None:
        if self.ready:
            return
        if not self._parts_started.is_set() or self.failed is not None or self.watcher is None:
            return          # the lifecycle watcher and the metrics endpoint are starting (or failed)
        missing = [name for name, ok in (("registry", self._registry_answers()),
                                         ("control", self.control.answers())) if not ok]
        if missing:
            log.warning("not ready: the %s socket does not answer yet", " and ".join(missing))
            return
        self.ready = True
        self.notifier.ready(reports.one_line(self.d))
        log.info("ready %.1f s after the start: %s", time.monotonic() - self.started_at,
                 reports.one_line(self.d))

    def _beat_thread(self) -> None:
        interval = HEARTBEAT_S
        if self.notifier.watchdog_interval_s:
            interval = min(interval, self.notifier.watchdog_interval_s)
        while not self._stop.wait(interval):
            self.d.call_soon(self._beat)

    def _catch_up_ticks(self) -> None:
        """Loop thread: the tick durations since the last call into the histogram (the loop keeps
        the last 8192 in ``ticks``; a beat a second never falls that far behind)."""
        ticks = self.d.ticks
        since = getattr(ticks, "durations_since", None)
        if since is None or ticks.count == self._ticks_seen:
            return
        for ms in since(self._ticks_seen).tolist():
            self.tick_histogram.observe_ms(ms)
        self._ticks_seen = ticks.count

    def _beat(self) -> None:
        """Loop thread: keep the watched pids current, tell systemd the loop is alive."""
        self._beats += 1
        self._catch_up_ticks()
        self._check_ready()
        if self.watcher is not None:
            self.watcher.watch(reports.pids_held(self.d))
        if self.ready and self._beats % STATUS_EVERY == 0:
            self.notifier.status(reports.one_line(self.d))
        if self.notifier.watchdog_usec:
            self.notifier.watchdog()

    def _process_event(self, ev: ProcessEvent) -> None:
        self.process_events += 1
        log.info("process %d: %s (%s)", ev.pid, ev.kind, self.watcher.mechanism if self.watcher else "?")
        apply = getattr(self.d, "process_event", None)
        if apply is not None:
            apply(ev)

    # ---- reload -----------------------------------------------------------------------------------
    def _on_hup(self) -> None:
        try:
            os.eventfd_read(self._hup_fd)
        except BlockingIOError:
            return
        self.reload()

    def reload(self, path: str | None = None) -> str | None:
        """Re-read the file and apply it; on any error keep the old settings. Returns the error."""
        path = path or self.cfg.path
        self.notifier.reloading()
        new: ConfigFile | None = None
        try:
            new = config.load(path)
            built = settings.check(new)
            self.d.apply_config(new)
        except ConfigError as e:
            err = new.locate(e) if new is not None else e
            log.error("reload refused, the old settings stay: %s", err)
            self.notifier.reloaded(f"reload refused: {err}")
            return str(err)
        self._apply_service_tables(built)
        self.cfg, self.built = new, built
        self.overrides.clear()
        log.info("configuration reloaded from %s", new.path or "defaults")
        self.notifier.reloaded(reports.one_line(self.d))
        return None

    def _apply_service_tables(self, built: settings.Settings) -> None:
        """The service's part of a new configuration: the control socket's bounds and who may use it,
        and how long a scrape waits, at once; [metrics] listen and [lifecycle] at the next start."""
        self.control.cfg = built.control
        self.control.access = type(self.control.access)(built.control.group)
        if self.metrics is not None:
            self.metrics.cfg = built.metrics
        for name in ("metrics", "lifecycle"):
            old, new = getattr(self.built, name), getattr(built, name)
            if (old.listen != new.listen) if name == "metrics" else old != new:
                log.warning("[%s] changed: it takes effect when tieringd restarts", name)

    # ---- what the service adds to reports ------------------------------------------------------------
    def _service_counts(self) -> dict[str, Any]:
        """What a metrics snapshot takes from the service (loop thread)."""
        self._catch_up_ticks()
        return {"control_refusals": self.control.refusals, "tick_histogram": self.tick_histogram,
                "lifecycle": self.watcher.mechanism if self.watcher else ""}

    def service_status(self) -> dict[str, Any]:
        return {"control": self.control.status(),
                "metrics": {"listen": self.built.metrics.listen or None,
                            "address": list(self.metrics.address) if self.metrics and self.metrics.address
                            else None},
                "lifecycle": self.watcher.status() if self.watcher else None,
                "systemd": {"notify": self.notifier.enabled, "ready": self.ready,
                            "watchdog_usec": self.notifier.watchdog_usec},
                "overrides": dict(self.overrides), "config_file": self.cfg.path}

    # ---- the control requests ---------------------------------------------------------------------
    def handlers(self) -> dict[str, tuple[Any, tuple[str, ...]]]:
        return {
            "status": (lambda r: self._doc("status", reports.status(self.d, self.service_status())), ()),
            # not tieringd.tiers/1: that is `tieringctl tiers` (the topology, no daemon)
            "tiers": (lambda r: self._doc("managed-tiers", reports.tiers(self.d)), ()),
            "processes": (lambda r: self._doc("processes", reports.processes(self.d)), ()),
            "regions": (lambda r: self._doc("regions", reports.regions(self.d, r.int("pid", None, 1))),
                        ("pid",)),
            "heat": (self._heat, ("pid", "offset", "limit")),
            "stats": (lambda r: self._doc("stats", reports.stats(self.d, self.vmstat_at_start)), ()),
            "pool": (lambda r: self._doc("pool-map", reports.pool(self.d)), ()),
            "migrate": (self._migrate, ("pid", "ranges", "all", "to", "priority")),
            "policy-get": (lambda r: self._policy_doc(), ()),
            "policy-set": (self._policy_set, ("set",)),
        }

    @staticmethod
    def _doc(what: str, payload: dict) -> dict:
        return {"schema": f"tieringd.{what}/1", **payload}

    def _heat(self, r: Request) -> dict:
        pid = r.int("pid", minimum=1)
        limit = min(r.int("limit", self.control.cfg.heat_max_blocks, 1), self.control.cfg.heat_max_blocks)
        return self._doc("heat", reports.heat(self.d, pid, offset=r.int("offset", 0, 0), limit=limit))

    def _migrate(self, r: Request) -> Deferred:
        pid = r.int("pid", minimum=1)
        owner = process_uid(pid)
        if owner is None:
            raise RequestError("not-found", f"no process {pid}")
        if not r.peer.root and owner != r.peer.uid:
            raise RequestError("forbidden", f"process {pid} belongs to uid {owner}: only root may move "
                                            f"another user's memory")
        target = self._target(r.get("to"))
        ranges = r.get("ranges")
        if bool(ranges) == bool(r.get("all")):
            raise RequestError("bad-request", "migrate: give either ranges [[start, length], …] or all: true")
        mapped = process_ranges(pid)
        if ranges:
            if not isinstance(ranges, list) or len(ranges) > MAX_MIGRATE_RANGES or not all(
                    isinstance(x, list) and len(x) == 2 and
                    all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in x) for x in ranges):
                raise RequestError("bad-request", f"migrate: ranges must be [[start, length], …] of integers "
                                                  f"(at most {MAX_MIGRATE_RANGES})")
            spans = clip_ranges([(a, n) for a, n in ranges], mapped)
            if not spans:
                raise RequestError("bad-request", f"migrate: the ranges hold no memory process {pid} maps")
        else:
            spans = mapped
        try:
            priority = Priority[str(r.get("priority", "demote")).upper()]
        except KeyError:
            raise RequestError("bad-request", "migrate: priority is promote, prefetch or demote") from None
        ticket = self.d.submit_move(pid, spans, target, priority)

        def wait() -> dict:
            report = ticket.wait()
            return self._doc("migrate", {"request": {"pid": pid, "ranges": [[hex(a), n] for a, n in spans],
                                                     "to": r.get("to"), "priority": priority.name.lower(),
                                                     "via": "daemon"},
                                         "report": report.to_dict()})
        return Deferred(wait)

    def _target(self, to: Any) -> int | Tier:
        if isinstance(to, int) and not isinstance(to, bool):
            nodes = {n.id for n in self.d.topology.nodes if n.has_memory}
            if to not in nodes:
                raise RequestError("bad-request", f"node {to} has no memory (nodes with memory: "
                                                  f"{', '.join(map(str, sorted(nodes)))})")
            return to
        if isinstance(to, str):
            if to.isdigit():
                return self._target(int(to))
            try:
                return Tier.parse(to)
            except ValueError as e:
                raise RequestError("bad-request", f"{e}; or a node id") from None
        raise RequestError("bad-request", "migrate: to is a node id or a tier (dram, cxl-dram, pmem)")

    def _policy_doc(self) -> dict:
        live = {"policy": self.d.policy.cfg, "heat": self.d.table.heat_cfg, "mover": self.d.engine.config}
        return self._doc("policy", {name: dataclasses.asdict(obj) for name, obj in live.items()}
                         | {"overrides": dict(self.overrides), "config_file": self.cfg.path})

    def _policy_set(self, r: Request) -> dict:
        changes = r.get("set")
        if not isinstance(changes, dict) or not changes:
            raise RequestError("bad-request", 'policy-set: set is {"key": value, …}')
        known = settings.TABLES
        data = copy.deepcopy(dict(self.cfg))
        for key, value in changes.items():
            table, _, name = key.partition(".") if key.partition(".")[0] in known else ("policy", "", key)
            if not name:
                raise RequestError("bad-request", f"policy-set: {key!r}: give KEY or TABLE.KEY")
            data.setdefault(table, {})
            if not isinstance(data[table], dict):
                raise RequestError("bad-request", f"[{table}] is not a table")
            data[table][name] = value
        new = ConfigFile(data, None)
        try:
            built = settings.check(new)
            self.d.apply_config(new)
        except ConfigError as e:
            raise RequestError("config", str(e)) from None
        self._apply_service_tables(built)
        self.cfg = ConfigFile(data, self.cfg.path, self.cfg.text)     # a reload re-reads the file
        for key, value in changes.items():
            self.overrides[key if key.partition(".")[0] in known else f"policy.{key}"] = value
        log.info("policy set at run time: %s", ", ".join(f"{k}={v!r}" for k, v in changes.items()))
        return self._policy_doc()
