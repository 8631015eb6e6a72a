# SPDX-License-Identifier: Apache-2.0
"""``tieringd``: the daemon — one loop from the shims' registrations to verified migrations.

    tieringd [--config FILE] [--run-dir DIR] [-v]
    tieringd --check-config FILE | --print-default-config

A foreground process (systemd or a terminal runs it), root, logging to stderr. SIGTERM and SIGINT
stop it cleanly: the mover stops, samplers and the registry close, the regions it bound get their
placement back, and every kernel setting it borrowed is restored. docs/loop.md describes it.

Modules: :mod:`.loop` (:class:`Daemon`, the event loop and the tick), :mod:`.regions` (the region
fan-out), :mod:`.moves` (moves in flight, the shim's way of moving before 6.5), :mod:`.capacity`
(tier capacities from the nodes), :mod:`.ticks` (tick schedule and timings), :mod:`.settings` (every
table validated together).
"""
from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys

from tieringd import config
from tieringd.shim import protocol as P

__all__ = ["main", "Daemon"]


def __getattr__(name: str):
    if name == "Daemon":        # lazy: `tieringd --help` need not import numpy and the samplers
        from tieringd.daemon.loop import Daemon
        return Daemon
    raise AttributeError(name)


class _ShortNames(logging.Formatter):
    """``tieringd: INFO control: …`` rather than ``tieringd: INFO tieringd.control: …``: the program's
    name leads every line already (and journald adds it once more)."""

    def format(self, record: logging.LogRecord) -> str:
        record.short_name = record.name.removeprefix("tieringd.")
        return super().format(record)


def _log_to_stderr(verbose: int) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_ShortNames(("%(asctime)s " if verbose else "") +
                                     "tieringd: %(levelname)s %(short_name)s: %(message)s"))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tieringd", description="Keep hot KV blocks in fast memory: "
                                 "the tiering daemon (foreground; root).")
    ap.add_argument("--config", metavar="FILE", help=f"configuration file (default {config.DEFAULT_PATH}, "
                    "or $TIERINGD_CONFIG; missing default = all defaults)")
    ap.add_argument("--run-dir", metavar="DIR", default=P.run_dir(),
                    help=f"socket and state directory (default {P.DEFAULT_RUN_DIR}, or $TIERINGD_RUN_DIR)")
    ap.add_argument("-v", "--verbose", action="count", default=0,
                    help="-v: per-tick timings and every move (debug)")
    _service_arguments(ap)
    args = ap.parse_args(argv)
    if args.check_config or args.print_default_config or args.print_config_reference:
        return _config_command(args)
    _log_to_stderr(args.verbose)
    faulthandler.register(signal.SIGUSR1, all_threads=True)    # kill -USR1: every thread's stack
    log = logging.getLogger("tieringd.daemon")
    if os.geteuid() != 0:
        log.error("tieringd runs as root: it loads BPF programs, moves other processes' pages and "
                  "borrows kernel settings (run it with sudo or as the systemd unit)")
        return 1
    _raise_open_files_limit(log)
    try:
        cfg = config.load(args.config)
        from tieringd.daemon.loop import Daemon
        daemon = Daemon(cfg, run_dir=args.run_dir)     # every table checked: what --check-config refuses
    except config.ConfigError as e:
        log.error("configuration: %s", e)
        return 1
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: daemon.request_stop())
    from tieringd.sampling.access_signal import AccessSignalError
    from tieringd.kernel.knobs import KnobError
    try:
        service = _start_service(daemon, cfg, args.run_dir)
    except (RuntimeError, OSError) as e:   # another daemon answers on control.sock, the metrics port is taken
        log.error("%s", e)
        return 1
    try:
        daemon.run()
    except (AccessSignalError, KnobError) as e:
        log.error("%s", e)
        return 1
    except RuntimeError as e:           # another registry listens on the socket, and the like
        log.error("%s", e)
        return 1
    finally:
        service.stop()
    return 1 if service.failed is not None else 0


# ---- the service around the loop (tieringd/service/service.py) -------------------------------------------
# Kept here, apart from main()'s own steps, so that the loop and the service change independently:
# the control socket, the metrics endpoint, the process lifecycle watcher, systemd's notifications and
# SIGHUP all hang on the Daemon's add_reader / call_soon / on_ready and nothing else.

def _raise_open_files_limit(log: logging.Logger) -> None:
    """Every shim holds a connection and a pidfd, every control client a connection: the soft limit
    systemd gives a unit that sets none (1024) ran out at about 330 registered processes (the
    reliability suite's load part). The daemon waits on epoll, not select(), so it takes the hard
    limit, as systemd.exec(5) asks of such programs."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= want:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError) as e:
        log.warning("open files limit stays at %d (raising it to %d failed: %s): about %d shims fit",
                    soft, want, e, soft // 2)


def _service_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--check-config", metavar="FILE",
                    help="validate FILE (every table) and exit: 0 and 'FILE: ok', or 1 and file:line: the error")
    ap.add_argument("--print-default-config", action="store_true",
                    help="print the default configuration file (every key, its default and unit) and exit")
    ap.add_argument("--print-config-reference", action="store_true",
                    help="print the configuration reference of docs/configuration.md (markdown) and exit")


def _config_command(args: argparse.Namespace) -> int:
    from tieringd import settings
    if args.print_default_config:
        sys.stdout.write(settings.default_file_text())
        return 0
    if args.print_config_reference:
        sys.stdout.write(settings.reference_markdown())
        return 0
    return settings.check_file(args.check_config)


def _start_service(daemon, cfg: config.ConfigFile, run_dir: str):
    from tieringd.service.service import Service
    service = Service(daemon, cfg, daemon.settings, run_dir=run_dir).start(wait=False)    # failed: the loop stops
    service.install_signal_handlers()       # after the loop's own: SIGTERM says STOPPING=1, then stops it
    return service

