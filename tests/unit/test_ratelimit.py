# SPDX-License-Identifier: Apache-2.0
"""The token bucket's arithmetic, with a fake clock (the only place it is tested; no wall clock)."""
import pytest

from tieringd.mover.ratelimit import MB, TokenBucket


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        assert s >= 0
        self.t += s


def test_starts_full_and_refills_at_the_rate_up_to_capacity():
    clk = FakeClock()
    b = TokenBucket(1000.0, 500.0, clock=clk)
    assert b.try_take(500) and not b.try_take(1)
    assert b.delay(100) == pytest.approx(0.1)
    clk.t += 0.25
    assert b.try_take(250) and not b.try_take(1)
    clk.t += 10                      # a long idle time does not bank more than the capacity
    assert b.try_take(500) and not b.try_take(1)


def test_requests_larger_than_capacity_go_when_full_and_leave_a_debt():
    clk = FakeClock()
    b = TokenBucket(1000.0, 100.0, clock=clk)
    assert b.try_take(400)           # bucket full: allowed, now 300 in debt
    assert b.tokens == pytest.approx(-300)
    assert b.delay(100) == pytest.approx(0.4)   # repay 300, then gather 100
    assert b.delay(1) == pytest.approx(0.301)


def test_take_sleeps_exactly_what_the_rate_requires():
    clk = FakeClock()
    b = TokenBucket.from_mb_s(10, burst_s=0.1, min_burst_bytes=0, clock=clk)   # 10 MB/s, 1 MB burst
    assert b.capacity_bytes == pytest.approx(1 * MB)
    waited = sum(b.take(1 * MB, sleep=clk.sleep) for _ in range(21))
    # the first MB rides the initial burst; the other 20 MB take 2 s at 10 MB/s
    assert waited == pytest.approx(2.0)
    assert clk.t - 100.0 == pytest.approx(2.0)


def test_long_run_rate_is_exact_with_uneven_requests():
    clk = FakeClock()
    b = TokenBucket(4096.0, 8192.0, clock=clk)
    sizes = [100, 5000, 12000, 7, 4096, 30000, 1] * 20
    for n in sizes:
        b.take(n, sleep=clk.sleep)
    # everything beyond the initial burst was paid for at 4096 B/s (the last one may be in debt)
    assert clk.t - 100.0 == pytest.approx((sum(sizes) - 8192 - (-b.tokens)) / 4096.0)


def test_unlimited_and_rate_changes():
    clk = FakeClock()
    b = TokenBucket.from_mb_s(None, clock=clk)
    assert b.unlimited and b.rate_mb_s is None
    assert b.try_take(10**12) and b.delay(10**12) == 0.0
    b.set_rate(1000.0, 200.0)        # becoming limited starts full
    assert b.tokens == 200.0 and b.rate_mb_s == pytest.approx(0.001)
    assert b.try_take(150)
    b.set_rate(1000.0, 20.0)         # a smaller capacity caps what is held
    assert b.tokens == pytest.approx(20.0)
    b.set_rate(0)
    assert b.unlimited
    with pytest.raises(ValueError):
        TokenBucket(10.0, -1.0, clock=clk)


def test_clock_going_backwards_adds_nothing():
    clk = FakeClock()
    b = TokenBucket(1000.0, 100.0, clock=clk)
    b.try_take(100)
    clk.t -= 5
    assert b.delay(50) == pytest.approx(0.05)   # re-based at the new reading: no tokens minted
    clk.t += 0.05
    assert b.try_take(50)


def test_refund_returns_budget_up_to_capacity():
    clk = FakeClock()
    b = TokenBucket(1000.0, 100.0, clock=clk)
    b.try_take(100)
    b.refund(60)
    assert b.tokens == pytest.approx(60)
    b.refund(1000)
    assert b.tokens == pytest.approx(100)
