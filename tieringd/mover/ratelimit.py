# SPDX-License-Identifier: Apache-2.0
"""A token bucket for the mover's bandwidth budgets (bytes per second, bursts up to ``capacity``).

The clock is injected so the arithmetic is tested with a fake one (tests/unit/test_ratelimit.py);
real throughput is measured only by ``make bench`` (figure P2).

A request larger than the bucket's capacity is let through once the bucket is full and leaves the
bucket in debt: the long-run rate stays exact and a batch bigger than the burst never waits forever.
"""
from __future__ import annotations

import time
from typing import Callable

MB = 1_000_000   # rates are in MB/s (10^6 bytes), the unit memory bandwidth is quoted in


class TokenBucket:
    """``rate_bytes_s`` None or <= 0 means unlimited (every take succeeds at once)."""

    def __init__(self, rate_bytes_s: float | None, capacity_bytes: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._last = clock()
        self.rate_bytes_s: float | None = None
        self.capacity_bytes = 0.0
        self.tokens = 0.0
        self.set_rate(rate_bytes_s, capacity_bytes)

    @classmethod
    def from_mb_s(cls, rate_mb_s: float | None, burst_s: float = 0.1, min_burst_bytes: int = 2 << 20,
                  clock: Callable[[], float] = time.monotonic) -> "TokenBucket":
        """A bucket for ``rate_mb_s`` MB/s holding ``burst_s`` seconds of budget (at least
        ``min_burst_bytes``, so one batch of a few hundred pages fits)."""
        if not rate_mb_s or rate_mb_s <= 0:
            return cls(None, clock=clock)
        rate = float(rate_mb_s) * MB
        return cls(rate, max(rate * burst_s, float(min_burst_bytes)), clock=clock)

    @property
    def unlimited(self) -> bool:
        return self.rate_bytes_s is None

    @property
    def rate_mb_s(self) -> float | None:
        return None if self.rate_bytes_s is None else self.rate_bytes_s / MB

    def set_rate(self, rate_bytes_s: float | None, capacity_bytes: float | None = None) -> None:
        """Change the rate; the bucket keeps what it holds (capped at the new capacity)."""
        self._refill()
        was_unlimited = self.rate_bytes_s is None
        if rate_bytes_s is None or rate_bytes_s <= 0:
            self.rate_bytes_s, self.capacity_bytes, self.tokens = None, 0.0, 0.0
            return
        capacity = float(capacity_bytes if capacity_bytes else rate_bytes_s * 0.1)
        if capacity <= 0:
            raise ValueError("bucket capacity must be positive")
        self.rate_bytes_s, self.capacity_bytes = float(rate_bytes_s), capacity
        # A new bucket (or one that was unlimited) starts full.
        self.tokens = capacity if was_unlimited else min(self.tokens, capacity)

    def _refill(self) -> None:
        now = self._clock()
        if self.rate_bytes_s is not None and now > self._last:
            self.tokens = min(self.capacity_bytes, self.tokens + (now - self._last) * self.rate_bytes_s)
        self._last = now   # a clock that went backwards re-bases; it never mints tokens

    def _need(self, n: float) -> float:
        return min(float(n), self.capacity_bytes)

    def delay(self, n: float) -> float:
        """Seconds until ``take(n)`` would succeed (0.0: now)."""
        if self.unlimited:
            return 0.0
        self._refill()
        need = self._need(n)
        missing = need - self.tokens
        # Rounding: a sleep of exactly the computed delay may leave a sub-byte shortfall that a float
        # clock can no longer advance past; a millionth of a byte is not worth waiting for.
        return 0.0 if missing <= max(1e-6, need * 1e-12) else missing / self.rate_bytes_s

    def try_take(self, n: float) -> bool:
        if self.unlimited:
            return True
        if self.delay(n) > 0:
            return False
        self.tokens -= float(n)
        return True

    def refund(self, n: float) -> None:
        """Give back budget taken for bytes that did not move after all (never above capacity)."""
        if not self.unlimited and n > 0:
            self._refill()
            self.tokens = min(self.capacity_bytes, self.tokens + float(n))

    def take(self, n: float, sleep: Callable[[float], None] = time.sleep) -> float:
        """Block (through ``sleep``) until ``n`` bytes may go; returns the seconds waited."""
        waited = 0.0
        while not self.try_take(n):
            d = self.delay(n)
            sleep(d)
            waited += d
        return waited
