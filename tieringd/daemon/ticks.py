# SPDX-License-Identifier: Apache-2.0
"""Tick accounting: when the next tick is due, how long each took by phase, and how many overran.

A tick that takes longer than the interval is counted as an overrun and the next one starts a whole
interval after it ended — missed ticks are not queued up and run back to back (that would only make
the loop later still). Durations are wall time of the loop thread (``perf_counter``); the p50/p99
are over the last :data:`WINDOW` ticks.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

WINDOW = 8192
PHASES = ("apply", "sample", "plan", "move")


class TickClock:
    """The schedule: ``due_in()`` seconds until the next tick; ``started(now)`` / ``finished(now)``
    around each tick move the deadline (never backwards, never catching up)."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic):
        self.interval_s = interval_s
        self.clock = clock
        self.next_at = clock()

    def due_in(self) -> float:
        return max(0.0, self.next_at - self.clock())

    def finished(self, started_at: float) -> bool:
        """Schedule the tick after the one that started at ``started_at``; True when it overran."""
        now = self.clock()
        self.next_at = started_at + self.interval_s
        if now > self.next_at:
            self.next_at = now + self.interval_s     # skip what was missed, do not queue it
            return True
        return False


class TickStats:
    """``count``, ``overruns``, ``last_duration_ms``, ``p50_ms``, ``p99_ms``, ``last_tick_ns``
    (CLOCK_MONOTONIC of the last tick's start), and the last tick's phases in ``last_phases_ms``."""

    def __init__(self) -> None:
        self.count = 0
        self.overruns = 0
        self.last_duration_ms = 0.0
        self.last_tick_ns = 0
        self.last_phases_ms: dict[str, float] = {}
        self.phase_total_ms = {p: 0.0 for p in PHASES}
        self._durations = np.zeros(WINDOW, np.float64)

    def record(self, started_ns: int, duration_ms: float, phases_ms: dict[str, float],
               overran: bool) -> None:
        self._durations[self.count % WINDOW] = duration_ms
        self.count += 1
        self.overruns += int(overran)
        self.last_duration_ms = duration_ms
        self.last_tick_ns = started_ns
        self.last_phases_ms = phases_ms
        for p, v in phases_ms.items():
            self.phase_total_ms[p] = self.phase_total_ms.get(p, 0.0) + v

    def _recent(self) -> np.ndarray:
        return self._durations[:min(self.count, WINDOW)]

    @property
    def p50_ms(self) -> float:
        d = self._recent()
        return float(np.percentile(d, 50)) if len(d) else 0.0

    @property
    def p99_ms(self) -> float:
        d = self._recent()
        return float(np.percentile(d, 99)) if len(d) else 0.0

    def to_dict(self) -> dict:
        return {"count": self.count, "overruns": self.overruns,
                "last_duration_ms": round(self.last_duration_ms, 3), "p50_ms": round(self.p50_ms, 3),
                "p99_ms": round(self.p99_ms, 3), "last_tick_ns": self.last_tick_ns,
                "last_phases_ms": {k: round(v, 3) for k, v in self.last_phases_ms.items()},
                "phase_total_ms": {k: round(v, 1) for k, v in self.phase_total_ms.items()}}


class PhaseTimer:
    """``with timer("sample"): …`` adds that phase's wall time (ms) to ``phases``."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._name = ""
        self._t0 = 0.0

    def __call__(self, name: str) -> "PhaseTimer":
        self._name = name
        return self

    def __enter__(self) -> "PhaseTimer":
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.phases[self._name] = self.phases.get(self._name, 0.0) + (time.perf_counter() - self._t0) * 1e3
