# SPDX-License-Identifier: Apache-2.0
"""Shared blocks in a process (docs/pool.md, "Identical KV stored once: what a process maps"): a range
of a memfd pool whose bytes equal a copy in the pool's file is SHAREd — its memory given back, each
page filled from the file when touched, a write kept private — and UNSHAREd back to plain memory;
bytes that differ are refused; a fork and a lost daemon leave the process holding its own bytes.
tests/progs/share_pool.c is the process. A regular file stands for the device, as in
test_shim_dax.py (a devdax device is read through a mapping instead: the same fill)."""
from __future__ import annotations

import errno
import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tieringd.shim import remap

from shim_support import PROGS, LiveRegistry, shim_env

pytestmark = [pytest.mark.shim, pytest.mark.root]
MiB = 1 << 20
AT, SIZE, FILE_AT = 4 * MiB, 8 * MiB, 8 * MiB      # the shared range: pool offset, length, file offset

if os.geteuid() != 0:
    pytest.skip("remapping another process's memory needs a root daemon", allow_module_level=True)


class Pool:
    """tests/progs/share_pool under the shim with memfd backing."""

    def __init__(self, run_dir: Path, tmp: Path, mib: int = 16):
        self.tmp = tmp
        self.p = subprocess.Popen([str(PROGS / "share_pool"), str(mib)],
                                  env=shim_env(run_dir, TIERINGD_BACKING="memfd"), stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        words = self.p.stdout.readline().split()
        assert words and words[0] == "pool", self.p.stderr.read()
        self.start, self.length = int(words[1], 16), int(words[2])

    @property
    def pid(self) -> int:
        return self.p.pid

    def ask(self, line: str) -> str:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        return self.p.stdout.readline().strip()

    def read(self, name: str = "pool.bin") -> bytes:
        """Every byte of the pool, as the process's write(2) from it reads them (kernel mode)."""
        assert self.ask(f"save {self.tmp / name}") == "saved"
        return (self.tmp / name).read_bytes()

    def vma(self, addr: int) -> dict[str, str]:
        """The smaps entry of the VMA holding addr: its fields, with "range"."""
        out: dict[str, str] = {}
        for line in Path(f"/proc/{self.pid}/smaps").read_text().splitlines():
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                if out:
                    break
                lo, hi = (int(x, 16) for x in head.split("-"))
                if lo <= addr < hi:
                    out["range"] = head
            elif out:
                key, _, value = line.partition(":")
                out[key] = value.strip()
        return out

    def rss(self, addr: int) -> int:
        return int(self.vma(addr)["Rss"].split()[0]) * 1024

    def registered(self, addr: int) -> bool:
        """Is the VMA at addr registered with a userfaultfd for missing faults (VmFlags "um")?"""
        return "um" in self.vma(addr)["VmFlags"].split()

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.stdin.write("stop\n")
            self.p.stdin.flush()
            assert self.p.wait(30) == 0

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


@pytest.fixture
def run_dir():
    d = Path(tempfile.mkdtemp(prefix="tieringd-share-"))
    yield d
    subprocess.run(["rm", "-rf", str(d)])


@pytest.fixture
def live(run_dir):
    reg = LiveRegistry(run_dir / "run").start()
    yield reg
    reg.stop()


def started(live, run_dir: Path):
    """A pool process registered with the daemon, its bytes, and a tier whose file holds the shared
    range's bytes at FILE_AT (garbage elsewhere)."""
    pool = Pool(live.reg.run_dir, run_dir)
    assert live.wait_for(lambda: any(r.start == pool.start for r in live.reg.regions(pool.pid)))
    cfg = remap.DaxConfig(path=str(run_dir / "pool.dev"), size_bytes=32 * MiB, segment_bytes=8 * MiB)
    tier = remap.DaxTier(live.reg, cfg).open({})
    orig = pool.read()
    os.pwrite(tier.fd, os.urandom(32 * MiB), 0)
    os.pwrite(tier.fd, orig[AT:AT + SIZE], FILE_AT)
    return pool, tier, orig


def file_bytes(tier) -> bytes:
    return os.pread(tier.fd, 32 * MiB, 0)


def test_a_shared_range_is_filled_from_the_file_and_written_privately(live, run_dir):
    pool, tier, orig = started(live, run_dir)
    try:
        before = file_bytes(tier)
        addr = pool.start + AT
        rep = tier.share(pool.pid, addr, SIZE, FILE_AT)
        assert rep.ok, rep
        # The memfd pages are gone: the range is its own VMA (registered), nothing resident.
        assert pool.vma(addr)["range"] == f"{addr:x}-{addr + SIZE:x}" and pool.registered(addr)
        assert pool.rss(addr) == 0
        # A write into a shared page: that page alone comes back, privately.
        assert pool.ask(f"poke {AT + MiB} 170") == "poked"
        assert pool.rss(addr) == 4096
        want = bytearray(orig)
        want[AT + MiB:AT + MiB + 4096] = b"\xaa" * 4096
        assert pool.ask("sum") == f"sum {sum(want)}"          # user-mode reads of every page
        assert pool.read() == want                            # kernel-mode reads
        assert file_bytes(tier) == before                     # the shared copy never changes
        # A second share of the range, an unshare at the wrong offset: refused, nothing changes.
        assert tier.share(pool.pid, addr + MiB, MiB, FILE_AT + MiB).code == errno.EBUSY
        assert tier.unshare(pool.pid, addr, SIZE, FILE_AT + 4096).code == errno.ENOENT
        assert pool.registered(addr)
        pool.stop()
    finally:
        pool.kill()
        tier.close()


def _pagemap(pid: int, addr: int, pages: int) -> list[int]:
    with open(f"/proc/{pid}/pagemap", "rb") as f:
        f.seek(addr // 4096 * 8)
        data = f.read(pages * 8)
    return [int.from_bytes(data[i:i + 8], "little") for i in range(0, len(data), 8)]


PRESENT, UFFD_WP = 1 << 63, 1 << 57


def test_a_page_read_back_is_a_clean_copy_until_the_process_writes_it(live, run_dir):
    """A read fills the page write-protected — a copy of the pool's the shim may drop again when
    memory is short (its trim punches present, still-protected pages) — and the first write makes
    it the process's: un-protected, never dropped, the write kept."""
    pool, tier, orig = started(live, run_dir)
    try:
        addr = pool.start + AT
        assert tier.share(pool.pid, addr, SIZE, FILE_AT).ok
        assert pool.ask("sum") == f"sum {sum(orig)}"           # every page read once
        flags = _pagemap(pool.pid, addr, SIZE // 4096)
        assert all(f & PRESENT and f & UFFD_WP for f in flags), "read-filled pages are not clean copies"
        assert pool.ask(f"poke {AT + MiB} 85") == "poked"
        page = _pagemap(pool.pid, addr + MiB, 1)[0]
        assert page & PRESENT and not page & UFFD_WP            # written: the process's own page
        want = bytearray(orig)
        want[AT + MiB:AT + MiB + 4096] = b"\x55" * 4096
        assert pool.read() == want
        pool.stop()
    finally:
        pool.kill()
        tier.close()


def test_unshare_brings_every_page_back(live, run_dir):
    pool, tier, orig = started(live, run_dir)
    try:
        before = file_bytes(tier)
        addr = pool.start + AT
        assert tier.share(pool.pid, addr, SIZE, FILE_AT).ok
        assert pool.ask(f"poke {AT} 85") == "poked"
        rep = tier.unshare(pool.pid, addr, SIZE, FILE_AT)
        assert rep.ok, rep
        assert rep.done_bytes == SIZE and tier.stats()["requests"]["unshare"]["requests"] == 1
        assert not pool.registered(addr) and pool.rss(addr) >= SIZE
        assert file_bytes(tier) == before
        want = bytearray(orig)
        want[AT:AT + 4096] = b"\x55" * 4096
        os.pwrite(tier.fd, os.urandom(SIZE), FILE_AT)         # the pool's copy is nothing to it now
        assert pool.read() == want
        assert tier.unshare(pool.pid, addr, SIZE, FILE_AT).code == errno.ENOENT
        # ... and the same address may be shared again (with the bytes it holds now).
        os.pwrite(tier.fd, bytes(want[AT:AT + SIZE]), FILE_AT)
        assert tier.share(pool.pid, addr, SIZE, FILE_AT).ok
        assert pool.read() == want
        pool.stop()
    finally:
        pool.kill()
        tier.close()


def test_bytes_that_differ_are_refused(live, run_dir):
    pool, tier, orig = started(live, run_dir)
    try:
        os.pwrite(tier.fd, b"\x00", FILE_AT + SIZE - 1)      # one byte off, at the very end
        addr = pool.start + AT
        rep = tier.share(pool.pid, addr, SIZE, FILE_AT)
        assert rep.code == errno.ESTALE and "differ" in rep.error, rep
        assert not pool.registered(addr) and pool.rss(addr) >= SIZE
        assert pool.read() == orig
        pool.stop()
    finally:
        pool.kill()
        tier.close()


def test_fork_gives_parent_and_child_the_right_bytes(live, run_dir):
    pool, tier, orig = started(live, run_dir)
    try:
        addr = pool.start + AT
        assert tier.share(pool.pid, addr, SIZE, FILE_AT).ok
        assert pool.ask(f"poke {AT + 2 * MiB} 1") == "poked"
        want = bytearray(orig)
        want[AT + 2 * MiB:AT + 2 * MiB + 4096] = b"\x01" * 4096
        assert pool.ask(f"fork {run_dir / 'child.bin'}") == "forked 0"
        assert (run_dir / "child.bin").read_bytes() == want
        assert pool.read() == want
        # The fork unshared the range in the parent: the file is nothing to it any more.
        assert not pool.registered(addr)
        os.pwrite(tier.fd, os.urandom(SIZE), FILE_AT)
        assert pool.read() == want
        assert tier.unshare(pool.pid, addr, SIZE, FILE_AT).code == errno.ENOENT
        pool.stop()
    finally:
        pool.kill()
        tier.close()


def test_a_freed_pool_leaves_no_shared_range_behind(live, run_dir):
    pool, tier, orig = started(live, run_dir)
    try:
        assert tier.share(pool.pid, pool.start + AT, SIZE, FILE_AT).ok
        words = pool.ask("renew").split()                    # free(), malloc() of the same size
        pool.start = int(words[1], 16)                       # (the same address, here)
        assert live.wait_for(lambda: any(r.start == pool.start for r in live.reg.regions(pool.pid)))
        assert pool.read() == orig
        # The table forgot the freed range: the new pool shares at once, wherever it landed.
        assert tier.share(pool.pid, pool.start + AT, SIZE, FILE_AT).ok
        assert pool.read() == orig
        pool.stop()
    finally:
        pool.kill()
        tier.close()


def test_a_lost_daemon_leaves_every_range_unshared(run_dir):
    live = LiveRegistry(run_dir / "run").start()
    pool, tier, orig = started(live, run_dir)
    try:
        addrs = [pool.start + AT, pool.start + AT + SIZE - 2 * MiB]
        assert tier.share(pool.pid, addrs[0], 2 * MiB, FILE_AT).ok
        assert tier.share(pool.pid, addrs[1], 2 * MiB, FILE_AT + SIZE - 2 * MiB).ok
        assert pool.ask(f"poke {AT} 7") == "poked"
        assert all(pool.registered(a) for a in addrs)
        live.stop()                                          # the shim's connection closes
        deadline = time.monotonic() + 30
        while any(pool.registered(a) for a in addrs) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(pool.registered(a) for a in addrs)
        assert all(pool.rss(a) >= 2 * MiB for a in addrs)
        os.pwrite(tier.fd, os.urandom(SIZE), FILE_AT)
        want = bytearray(orig)
        want[AT:AT + 4096] = b"\x07" * 4096
        assert pool.read() == want
        pool.stop()
    finally:
        pool.kill()
        tier.close()
        live.stop()
