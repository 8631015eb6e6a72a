# SPDX-License-Identifier: Apache-2.0
"""[sharing]: what each key does to the sharers the daemon's sharing scan (tieringd/daemon/sharing.py,
``SharingScanner(settings.sharing, table)`` as ``Daemon._start`` builds it) writes into the block table,
on this process's own memory: a region a forked child maps too, and two regions with a block of the
same bytes."""
from __future__ import annotations

import mmap
import os

from keyprobe import Ctx, probe
from test_daemon_sharing import BLOCK, Clock, address, anonymous, region

from tieringd.daemon.sharing import SharingScanner
from tieringd.placement.heat import BlockTable


def scan(ctx: Ctx, text: str, memory: list[mmap.mmap], ticks: int = 1, clock: Clock | None = None) -> tuple:
    """Sharers of every block after ``ticks`` ticks of the scan built from ``text``."""
    t = BlockTable()
    rows = [region(t, m) for m in memory]
    s = SharingScanner(ctx.settings(text).sharing, t, clock=clock or Clock())
    for _ in range(ticks):
        s.tick()
    return tuple(tuple(t.sharers[r].tolist()) for r in rows)


def forked(nbytes: int) -> tuple[mmap.mmap, int]:
    """A MAP_SHARED region every page of which a child has mapped (written); the child's pid."""
    m = anonymous(nbytes, shared=True)
    m.write(os.urandom(nbytes))
    ready_r, ready_w = os.pipe()         # child → parent: mapped; parent → child: done (two pipes:
    done_r, done_w = os.pipe()           # on one, the child could read its own byte back)
    pid = os.fork()
    if pid == 0:
        for off in range(0, nbytes, mmap.PAGESIZE):
            m[off] = m[off]
        os.write(ready_w, b"x")
        os.read(done_r, 1)
        os._exit(0)
    os.read(ready_r, 1)
    return m, (pid, ready_r, ready_w, done_r, done_w)


def done(child) -> None:
    pid, *fds = child
    os.write(fds[3], b"x")
    os.waitpid(pid, 0)
    for fd in fds:
        os.close(fd)


@probe("sharing", "enabled")
def _(ctx):
    """false: the blocks a forked child maps too keep one sharer (2 when the scan runs)."""
    m, child = forked(2 * BLOCK)
    try:
        assert scan(ctx, "", [m]) == ((2, 2),)
        assert scan(ctx, "[sharing]\nenabled = false\n", [m]) == ((1, 1),)
    finally:
        done(child)


@probe("sharing", "pages_per_tick")
def _(ctx):
    """At 16 pages a tick, one tick finds the first block shared only (all four by default)."""
    m, child = forked(4 * BLOCK)
    try:
        assert scan(ctx, "[sharing]\nhash_pages_per_tick = 0\n", [m]) == ((2, 2, 2, 2),)
        pages = BLOCK // mmap.PAGESIZE
        assert scan(ctx, f"[sharing]\nhash_pages_per_tick = 0\npages_per_tick = {pages}\n", [m]) == ((2, 1, 1, 1),)
    finally:
        done(child)


def twins() -> list[mmap.mmap]:
    a, b = anonymous(2 * BLOCK), anonymous(2 * BLOCK)
    twin = os.urandom(BLOCK)
    a.write(twin + os.urandom(BLOCK))
    b.write(os.urandom(BLOCK) + twin)
    return [a, b]


@probe("sharing", "hash_pages_per_tick")
def _(ctx):
    """0: two regions' blocks of the same bytes are not compared (each keeps one sharer)."""
    mem = twins()
    text = "[sharing]\ncold_after_s = 0\n"
    assert scan(ctx, text, mem, ticks=4) == ((2, 1), (1, 2))
    assert scan(ctx, text + "hash_pages_per_tick = 0\n", mem, ticks=4) == ((1, 1), (1, 1))


@probe("sharing", "cold_after_s")
def _(ctx):
    """Blocks populated moments ago are not hashed at the default 30 s; at 0 s the copies count."""
    mem = twins()
    assert scan(ctx, "", mem, ticks=4) == ((1, 1), (1, 1))
    assert scan(ctx, "[sharing]\ncold_after_s = 0\n", mem, ticks=4) == ((2, 1), (1, 2))
