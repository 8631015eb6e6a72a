# SPDX-License-Identifier: Apache-2.0
"""``tieringd``: the daemon — one loop from the shims' registrations to verified migrations.

    tieringd [--config FILE] [--run-dir DIR] [-v]

A foreground process (systemd or a terminal runs it), root, logging to stderr. SIGTERM and SIGINT
stop it cleanly: the mover stops, samplers and the registry close, the regions it bound get their
placement back, and every kernel setting it borrowed is restored. docs/daemon.md describes it.

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
from tieringd import protocol as P

__all__ = ["main", "Daemon"]


def __getattr__(name: str):
    if name == "Daemon":        # lazy: `tieringd --help` need not import numpy and the samplers
        from tieringd.daemon.loop import Daemon
        return Daemon
    raise AttributeError(name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tieringd", description="Keep hot KV blocks in fast memory: "
                                 "the tiering daemon (foreground; root).")
    ap.add_argument("--config", metavar="FILE", help=f"configuration file (default {config.DEFAULT_PATH}, "
                    "or $TIERINGD_CONFIG; missing default = all defaults)")
    ap.add_argument("--run-dir", metavar="DIR", default=P.run_dir(),
                    help=f"socket and state directory (default {P.DEFAULT_RUN_DIR}, or $TIERINGD_RUN_DIR)")
    ap.add_argument("-v", "--verbose", action="count", default=0,
                    help="-v: per-tick timings and every move (debug)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format=("%(asctime)s " if args.verbose else "") +
                        "tieringd: %(levelname)s %(name)s: %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)    # kill -USR1: every thread's stack
    log = logging.getLogger("tieringd.daemon")
    if os.geteuid() != 0:
        log.error("tieringd runs as root: it loads BPF programs, moves other processes' pages and "
                  "borrows kernel settings (run it with sudo or as the systemd unit)")
        return 1
    try:
        cfg = config.load(args.config)
        from tieringd.daemon.loop import Daemon
        daemon = Daemon(cfg, run_dir=args.run_dir)
    except config.ConfigError as e:
        log.error("configuration: %s", e)
        return 1
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: daemon.request_stop())
    from tieringd.access_signal import AccessSignalError
    from tieringd.knobs import KnobError
    try:
        daemon.run()
    except (AccessSignalError, KnobError) as e:
        log.error("%s", e)
        return 1
    except RuntimeError as e:           # another registry listens on the socket, and the like
        log.error("%s", e)
        return 1
    return 0

