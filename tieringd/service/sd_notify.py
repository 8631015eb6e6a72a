# SPDX-License-Identifier: Apache-2.0
"""systemd's readiness protocol (sd_notify(3)) in a few lines, without libsystemd.

Under ``Type=notify`` systemd passes ``NOTIFY_SOCKET``: a datagram socket, a path or an abstract name
(``@…``). Each datagram is newline-separated ``KEY=VALUE`` assignments: ``READY=1`` when the service
answers, ``STATUS=…`` a line ``systemctl status`` shows, ``STOPPING=1`` when shutting down,
``WATCHDOG=1`` while the loop is alive (only when the unit sets ``WatchdogSec=``: ``WATCHDOG_USEC``).
Without ``NOTIFY_SOCKET`` (run by hand, in tests) every call is a no-op. A failed send is logged once
and never raised: systemd going away must not stop the daemon.
"""
from __future__ import annotations

import logging
import os
import socket
from typing import Mapping

log = logging.getLogger("tieringd.sd_notify")


class Notifier:
    """One service's notifications. ``Notifier.from_env()`` reads ``NOTIFY_SOCKET`` once."""

    def __init__(self, address: str | None, watchdog_usec: int | None = None):
        self.address = address
        self.watchdog_usec = watchdog_usec
        self._sock: socket.socket | None = None
        self._failed = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Notifier":
        env = os.environ if env is None else env
        path = env.get("NOTIFY_SOCKET") or None
        if path and path[0] not in "/@":
            log.warning("NOTIFY_SOCKET=%s is neither a path nor an abstract name: not notifying", path)
            path = None
        # WATCHDOG_PID names the process the watchdog is for (a forking wrapper may be in between)
        wd_pid = env.get("WATCHDOG_PID")
        usec = env.get("WATCHDOG_USEC")
        watchdog = int(usec) if usec and usec.isdigit() and (not wd_pid or wd_pid == str(os.getpid())) else None
        return cls(path, watchdog)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def watchdog_interval_s(self) -> float | None:
        """How often to send WATCHDOG=1: half the unit's WatchdogSec=, as sd_watchdog_enabled(3) advises."""
        return None if not self.watchdog_usec else self.watchdog_usec / 2e6

    def send(self, **fields: str | int) -> bool:
        """``send(READY=1, STATUS="…")``; False when not under systemd or when the send failed."""
        if self.address is None:
            return False
        text = "\n".join(f"{k}={str(v).replace(chr(10), ' ')}" for k, v in fields.items())
        addr = "\0" + self.address[1:] if self.address[0] == "@" else self.address
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(text.encode(), addr)
            return True
        except OSError as e:
            if not self._failed:
                log.warning("sd_notify to %s failed: %s (further failures are not logged)", self.address, e)
                self._failed = True
            return False

    def ready(self, status: str) -> bool:
        return self.send(READY=1, STATUS=status, MAINPID=os.getpid())

    def status(self, status: str) -> bool:
        return self.send(STATUS=status)

    def reloading(self) -> bool:
        return self.send(RELOADING=1)

    def reloaded(self, status: str) -> bool:
        return self.send(READY=1, STATUS=status)

    def stopping(self, status: str = "stopping") -> bool:
        return self.send(STOPPING=1, STATUS=status)

    def watchdog(self) -> bool:
        return self.send(WATCHDOG=1)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
