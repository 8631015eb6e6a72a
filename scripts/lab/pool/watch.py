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
        # the shared index: (time, copies in the pool, references per host) at each change
        self.index: list[tuple[float, int, dict[str, int]]] = []
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

    def _index(self) -> tuple[int, dict[str, int]] | None:
        """Copies (digests) and references per host: ``P index/<sha256>/<host>``, one key a reference."""
        try:
            kvs = self.etcd.prefix(self.prefix + "index/", keys_only=True)
        except Exception:               # noqa: BLE001 - as above
            return None
        digests, refs = set(), {}
        for kv in kvs:
            digest, host = kv.key.rsplit("/", 2)[-2:]
            digests.add(digest)
            refs[host] = refs.get(host, 0) + 1
        return len(digests), refs

    def _run(self) -> None:
        polls = 0
        while not self._stop.wait(0.25):
            t = round(time.monotonic() - self.t0, 2)
            c = self._counts()
            if c is not None and (not self.rows or self.rows[-1][1] != c):
                self.rows.append((t, c))
            polls += 1
            ix = self._index() if polls % 4 == 0 else None
            if ix is not None and (not self.index or self.index[-1][1:] != ix):
                self.index.append((t, *ix))
            for name in os.listdir(self.shared):
                self.marks.setdefault(name, t)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self.etcd.close()

    def most_shared(self, t_from: float = 0.0, t_to: float = float("inf")) -> dict:
        """The index when it held the most references in [t_from, t_to): copies, references per host,
        and what that saves (a reference beyond a block's first is a copy the pool did not store)."""
        rows = [r for r in self.index if t_from <= r[0] < t_to]
        if not rows:
            return {"copies": 0, "references": {}, "saved_references": 0, "second_copy_saved": None}
        t, copies, refs = max(rows, key=lambda r: sum(r[2].values()))
        total = sum(refs.values())
        smaller = min(refs.values()) if len(refs) > 1 else 0
        return {"t": t, "copies": copies, "references": refs, "saved_references": total - copies,
                "second_copy_saved": round((total - copies) / smaller, 3) if smaller else None}

    def held(self, host: str, t_from: float, t_to: float = float("inf")) -> list[tuple[float, int]]:
        """(time, extents held by ``host``) for each change in [t_from, t_to), with the state at t_from first."""
        before = [c.get(host, 0) for t, c in self.rows if t <= t_from]
        out = [(t_from, before[-1] if before else 0)]
        out += [(t, c.get(host, 0)) for t, c in self.rows if t_from < t < t_to]
        return out
