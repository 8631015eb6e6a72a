# SPDX-License-Identifier: Apache-2.0
"""The lab host's view of a pool pair's run (scripts/lab/pool/kv_pool.py): etcd's claims per host and
the guests' barrier marks, each with the time this host first saw it — one clock for both guests.
Used by tests/lab/test_pool_lab.py and scripts/bench/p9_pool.py."""
from __future__ import annotations

import os
import threading
import time

PREFIX = "/tieringd/lab/"          # kv_pool.py's pool


class ClaimWatcher:
    """On the lab host, one clock: every claim in etcd per host and every barrier mark the guests
    leave in their shared folder, each with the time it was first seen."""

    def __init__(self, endpoints: list[str], prefix: str = PREFIX):
        from tieringd.pool.etcd import Etcd
        self.etcd = Etcd(endpoints)
        self.prefix = prefix
        self.rows: list[tuple[float, dict[str, int]]] = []
        self.marks: dict[str, float] = {}
        self.shared = None
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self, shared) -> None:
        self.shared = shared
        self.t0 = time.monotonic()
        self._thread.start()

    def _counts(self) -> dict[str, int] | None:
        try:
            kvs = self.etcd.prefix(self.prefix + "claims/", keys_only=True)
        except Exception:               # noqa: BLE001 - an election: try at the next poll
            return None
        counts: dict[str, int] = {}
        for kv in kvs:
            host = kv.key.rsplit("/", 1)[-1]
            counts[host] = counts.get(host, 0) + 1
        return counts

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            t = round(time.monotonic() - self.t0, 2)
            c = self._counts()
            if c is not None and (not self.rows or self.rows[-1][1] != c):
                self.rows.append((t, c))
            for name in os.listdir(self.shared):
                self.marks.setdefault(name, t)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self.etcd.close()

    def held(self, host: str, t_from: float, t_to: float = float("inf")) -> list[tuple[float, int]]:
        """(time, extents held by ``host``) for each change in [t_from, t_to), with the state at t_from first."""
        before = [c.get(host, 0) for t, c in self.rows if t <= t_from]
        out = [(t_from, before[-1] if before else 0)]
        out += [(t, c.get(host, 0)) for t, c in self.rows if t_from < t < t_to]
        return out
