# SPDX-License-Identifier: Apache-2.0
"""The shim's small cache (shim/smallcache.h): blocks handed between threads stay intact, a
thread's cached chunks go back to glibc when it exits, a double free still aborts, and the cache
steps aside when glibc's malloc debugging is asked for."""
from __future__ import annotations

import signal

import pytest

from shim_support import PROGS, plain_env, run, shim_env

pytestmark = pytest.mark.shim
CHURN = str(PROGS / "small_churn")


def parse(out: str) -> dict[str, int]:
    words = out.split()
    return {words[i]: int(words[i + 1]) for i in range(0, len(words), 2)}


def test_cross_thread_blocks_intact_and_exited_threads_hold_nothing():
    base = run([CHURN, "churn", "100"], plain_env())
    shim = run([CHURN, "churn", "100"], shim_env(None, TIERINGD_LOG="2"))
    assert base.returncode == 0 and shim.returncode == 0, shim.stderr
    assert "small cache on" in shim.stderr
    b, s = parse(base.stdout), parse(shim.stdout)
    assert s["corrupt"] == 0 and s["checksum"] == b["checksum"]
    # 400 threads each leave up to 6 chunks of 64 sizes cached; had their caches not gone back to
    # glibc at exit, tens of MiB would still count as in use (82 MB measured with the flush cut).
    assert s["held_after_exit"] <= b["held_after_exit"] + 64 * 1024, (b, s)


def test_double_free_of_a_cached_chunk_aborts():
    r = run([CHURN, "double-free"], shim_env(None))
    assert r.returncode == -signal.SIGABRT
    # The cache's own message: glibc's tcache says "double free detected" too, but never sees
    # this chunk, which sits in the shim's cache after the first free.
    assert "double free detected (tieringd-shim small cache)" in r.stderr
    assert "unnoticed" not in r.stdout


@pytest.mark.parametrize("extra,why", [
    ({"TIERINGD_SMALL_CACHE": "0"}, "TIERINGD_SMALL_CACHE=0"),
    ({"MALLOC_CHECK_": "3"}, "glibc malloc debugging"),
    ({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}, "glibc malloc debugging"),
])
def test_cache_steps_aside(extra, why):
    r = run([CHURN, "double-free"], shim_env(None, TIERINGD_LOG="2", **extra))
    assert f"small cache off: {why}" in r.stderr
    # With the cache off the double free reaches glibc, which reports it in its own words.
    assert r.returncode == -signal.SIGABRT
    assert "tieringd-shim small cache" not in r.stderr
