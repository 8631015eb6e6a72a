# SPDX-License-Identifier: Apache-2.0
"""Identical KV kept once across hosts, with real processes (docs/pool.md): two "hosts" — each a pool
agent opened as the daemon opens it, its own registry and its own process under the shim — against a
real three-member etcd on loopback and one file standing for the shared device. Both processes hold
the same bytes (tests/progs/share_pool); their cold blocks go through the pool's carrier
(``tieringd.pool.dedup.SharedBlocks``, what the loop uses with ``[pool]``):

- the pool keeps one copy: the second host's blocks are all references to the first host's copy
  (index keys: two per digest, one copy on the device), and both processes give their memory back;
- a write into a shared page on host a reaches neither the pool's copy nor host b's process;
- a promotion on host a brings its block back (its write kept) and drops its reference; b's holds;
- a host whose process exits drops its references at the next heartbeat.

The devdax path of the same fill is the lab's (tests/lab/test_pool_lab.py)."""
from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from etcd_support import etcd, etcd_missing  # noqa: F401 - the fixture
from pool_support import MACHINE, config, pool_file, settle
from shim_support import PROGS, LiveRegistry, shim_env
from tieringd.kernel import sysfs
from tieringd.pool import etcd as E
from tieringd.pool.dedup import BLOCK_BYTES, SharedBlocks
from tieringd.pool.tier import open_tier
from tieringd.shim.remap import DaxConfig

pytestmark = [pytest.mark.etcd, pytest.mark.shim, pytest.mark.root]
MiB = 1 << 20
POOL_MIB, SHARED = 16, 8 * MiB          # each process's pool; the part of it sent to the pool (4 blocks)

if os.geteuid() != 0:
    pytest.skip("remapping another process's memory needs a root daemon", allow_module_level=True)
if etcd_missing():
    pytest.skip(etcd_missing(), allow_module_level=True)


class Proc:
    """tests/progs/share_pool under the shim (memfd backing), registered with one host's registry."""

    def __init__(self, live: LiveRegistry, tmp: Path):
        self.tmp = tmp
        self.p = subprocess.Popen([str(PROGS / "share_pool"), str(POOL_MIB)],
                                  env=shim_env(live.reg.run_dir, TIERINGD_BACKING="memfd"),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        words = self.p.stdout.readline().split()
        assert words and words[0] == "pool", self.p.stderr.read()
        self.start = int(words[1], 16)
        assert live.wait_for(lambda: any(r.start == self.start for r in live.reg.regions(self.p.pid)))

    def ask(self, line: str) -> str:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        return self.p.stdout.readline().strip()

    def read(self) -> bytes:
        assert self.ask(f"save {self.tmp / 'pool.bin'}") == "saved"
        return (self.tmp / "pool.bin").read_bytes()

    def rss_kib(self, lo: int, hi: int) -> int:
        """Resident KiB of the VMAs inside [lo, hi) (a shared range is a VMA of its own)."""
        total, inside = 0, False
        for line in Path(f"/proc/{self.p.pid}/smaps").read_text().splitlines():
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                a, b = (int(x, 16) for x in head.split("-"))
                inside = lo <= a and b <= hi
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
        return total

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


class Host:
    def __init__(self, etcd, device: str, name: str, tmp: Path):
        self.live = LiveRegistry(tmp / f"run-{name}").start()
        cfg = config(etcd, device, name)
        with sysfs.root(MACHINE):       # two hosts in one machine: see pool_support
            self.tier, self.agent = open_tier(cfg, DaxConfig(), self.live.reg, None, {}, start=False)
        self.shared = SharedBlocks(self.agent, self.tier)
        self.proc = Proc(self.live, tmp / name)

    def close(self) -> None:
        self.proc.stop()
        self.agent.stop()
        self.tier.close()
        self.live.stop()


@pytest.fixture
def two(etcd, tmp_path):    # noqa: F811 - the etcd fixture
    device = pool_file(tmp_path, extents=32)
    hosts = []
    try:
        for name in "ab":
            (tmp_path / name).mkdir()
            hosts.append(Host(etcd, device, name, tmp_path))
            settle([h.agent for h in hosts], lambda: all(h.agent.member.state == "member" for h in hosts))
        yield hosts
    finally:
        for h in hosts:
            h.close()


def index_keys(etcd) -> dict[str, list[str]]:     # noqa: F811
    """digest -> hosts that reference it, read from etcd itself."""
    client = E.Etcd(etcd.endpoints)
    try:
        out: dict[str, list[str]] = {}
        for kv in client.prefix("/t/pool/index/", keys_only=True):
            digest, host = kv.key.rsplit("/", 2)[-2:]
            out.setdefault(digest, []).append(host)
        return out
    finally:
        client.close()


def test_identical_blocks_are_kept_once_and_a_write_stays_with_its_writer(two, etcd, tmp_path):  # noqa: F811
    a, b = two
    orig = a.proc.read()
    assert b.proc.read() == orig                       # the same bytes on both hosts
    for h in (a, b):
        rep = h.shared.demote(h.proc.p.pid, h.proc.start, SHARED)
        assert rep.ok and rep.done_bytes == SHARED, rep
        assert h.shared.shared_bytes() == SHARED      # all of it through the pool, none in the log
        assert h.proc.rss_kib(h.proc.start, h.proc.start + SHARED) == 0
    # one copy per content (share_pool's pattern may repeat from block to block: then one copy for
    # them all): every digest has both hosts' keys, and b published nothing
    contents = {hashlib.sha256(orig[o:o + BLOCK_BYTES]).hexdigest() for o in range(0, SHARED, BLOCK_BYTES)}
    idx = index_keys(etcd)
    assert set(idx) == contents and all(sorted(v) == ["a", "b"] for v in idx.values()), idx
    assert b.agent.index.saved_bytes == len(contents) * BLOCK_BYTES and b.agent.index.published_blocks == 0
    assert a.agent.index.published_blocks == len(contents)
    copies = {r.offset for r in a.shared.ranges.values()}
    assert copies == {r.offset for r in b.shared.ranges.values()}
    device = Path(a.agent.cfg.device)
    with open(device, "rb") as f:
        pool_before = {off: os.pread(f.fileno(), BLOCK_BYTES, off) for off in copies}

    # a writes into a shared page: its own page, not the pool's copy, not b's memory
    assert a.proc.ask(f"poke {MiB} 170") == "poked"
    want_a = bytearray(orig)
    want_a[MiB:MiB + 4096] = b"\xaa" * 4096
    assert a.proc.read() == want_a
    assert b.proc.read() == orig
    with open(device, "rb") as f:
        assert {off: os.pread(f.fileno(), BLOCK_BYTES, off) for off in copies} == pool_before

    # a's blocks come back (its write kept); its references go, b's copy stays referenced
    rep = a.shared.promote(a.proc.p.pid, a.proc.start, SHARED)
    assert rep.ok, rep
    assert a.proc.read() == want_a and a.shared.shared_bytes() == 0
    idx = index_keys(etcd)
    assert set(idx) == contents and all(v == ["b"] for v in idx.values()), idx
    assert b.proc.read() == orig

    # b's process exits: its references go after the next heartbeat (the carrier's worker drops them)
    b.proc.stop()
    b.shared.start()
    b.agent.after_beat.append(b.shared.sweep)
    b.agent.beat()
    b.shared.stop()                 # the worker finishes what the sweep queued
    assert index_keys(etcd) == {}
