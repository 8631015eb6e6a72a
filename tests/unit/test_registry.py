# SPDX-License-Identifier: Apache-2.0
"""The daemon side of the registry: verification rules (docs/protocol.md) on maps, and a live
registry on a socket in a temporary directory, talked to by Python clients — this process, another
process, a process that exits — with real SO_PEERCRED and real /proc/PID/maps. No root needed."""
from __future__ import annotations

import errno
import mmap
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from tieringd.shim import protocol as P
from tieringd.shim import registry as R
from tieringd.kernel.procfs import Vma, read_maps

MiB = 1 << 20


# ---- verification against maps ------------------------------------------------------------------

def vma(start, end, perms="rw-p", path=""):
    return Vma(start, end, perms, 0, 0, path)


MAPS = [
    vma(0x555555554000, 0x555555556000, "r-xp", "/usr/bin/python3"),
    vma(0x555555600000, 0x555555800000, "rw-p", "[heap]"),
    vma(0x7F0000000000, 0x7F0000400000),                                   # anonymous, 4 MiB
    vma(0x7F0000400000, 0x7F0000600000),                                   # adjacent anonymous
    vma(0x7F0000800000, 0x7F0000A00000, "rw-s", "/memfd:tieringd-kv (deleted)"),
    vma(0x7F0000A00000, 0x7F0000C00000, "r--p"),
    vma(0x7F0000E00000, 0x7F0001000000, "rw-p", "/var/lib/model.bin"),
    vma(0x7FFFFFFDE000, 0x7FFFFFFFF000, "rw-p", "[stack]"),
]


def test_anonymous_region_across_adjacent_vmas_is_accepted():
    R.verify_range(MAPS, 0x7F0000000000, 6 * MiB, P.Flag(0))
    R.verify_range(MAPS, 0x7F0000200000, 2 * MiB, P.Flag.HUGEPAGE)


@pytest.mark.parametrize("start,length,flags,code,text", [
    (0x7F0000400000, 4 * MiB, 0, errno.EFAULT, "0x7f0000600000 is not mapped"),          # a hole
    (0x7F0001200000, 2 * MiB, 0, errno.EFAULT, "does not belong to it"),                  # nothing there
    (0x7F0000800000, 2 * MiB, 0, errno.EINVAL, "not private anonymous"),                 # memfd, claimed anon
    (0x7F0000000000, 2 * MiB, P.Flag.MEMFD, errno.EINVAL, "not a shared /memfd:tieringd-kv"),
    (0x7F0000A00000, 2 * MiB, 0, errno.EACCES, "not readable and writable"),
    (0x7F0000E00000, 2 * MiB, 0, errno.EINVAL, "/var/lib/model.bin"),                    # a file
    (0x7FFFFFFDE000, 4096, P.Flag.FOREIGN, errno.EACCES, "[stack]"),
])
def test_refusals(start, length, flags, code, text):
    with pytest.raises(R.Refused) as e:
        R.verify_range(MAPS, start, length, P.Flag(flags))
    assert e.value.code == code and text in e.value.reason


def test_memfd_and_foreign_pinned_memory():
    R.verify_range(MAPS, 0x7F0000800000, 2 * MiB, P.Flag.MEMFD)


def test_a_memfd_region_partly_on_the_dax_tier_is_the_daemons_own_remap():
    """After a daemon restart, a memfd region whose middle lives on the DAX-remap tier's file is
    accepted — that file, shared, and no other."""
    maps = [Vma(0x7F0000800000, 0x7F0000A00000, "rw-s", 0, 7, "/memfd:tieringd-kv (deleted)"),
            Vma(0x7F0000A00000, 0x7F0000C00000, "rw-s", 0x600000, 99, "/dev/dax0.0"),
            Vma(0x7F0000C00000, 0x7F0000E00000, "rw-s", 0x400000, 7, "/memfd:tieringd-kv (deleted)")]
    R.verify_range(maps, 0x7F0000800000, 6 * MiB, P.Flag.MEMFD, ("/dev/dax0.0", 99))
    for remap in (None, ("/dev/dax0.0", 98), ("/dev/dax1.0", 99)):
        with pytest.raises(R.Refused):
            R.verify_range(maps, 0x7F0000800000, 6 * MiB, P.Flag.MEMFD, remap)
    R.verify_range(MAPS, 0x555555600000, 8192, P.Flag.FOREIGN | P.Flag.PINNED)   # pinned heap memory


# ---- a live registry ------------------------------------------------------------------------------

def _addr(buf) -> int:
    import ctypes
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def aligned_region(size=4 * MiB):
    """An anonymous mapping with a 2 MiB-aligned 2 MiB range inside it (what a shim would register)."""
    buf = mmap.mmap(-1, size + 2 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = (_addr(buf) + 2 * MiB - 1) & ~(2 * MiB - 1)
    return buf, start


class Client:
    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.connect(path)
        self.sock.settimeout(5)
        self.seq = 0

    def send(self, msg):
        self.seq += 1
        msg.seq = self.seq
        self.sock.send(msg.encode())
        return self.seq

    def recv(self):
        return P.decode(self.sock.recv(256))

    def close(self):
        self.sock.close()


@pytest.fixture
def reg(tmp_path):
    events = []
    r = R.Registry(str(tmp_path / "run"), on_event=lambda k, d: events.append((k, d))).start()
    r.events = events
    yield r
    r.close()


def pump(reg, until, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reg.poll(0.05)
        if until():
            return True
    return False


def test_register_own_region_then_unregister(reg):
    buf, start = aligned_region()
    c = Client(reg.path)
    c.send(P.Hello(pid=os.getpid(), min_bytes=4 * MiB, policy=P.Policy.FAST, agent="test"))
    c.send(P.Register(region_id=1, start=start, length=2 * MiB, policy=P.Policy.FAST, source=P.Source.MALLOC))
    assert pump(reg, lambda: reg.regions(os.getpid()))
    (region,) = reg.regions(os.getpid())
    assert (region.start, region.length, region.pid) == (start, 2 * MiB, os.getpid())
    # The same range again is an update (flags change: pinned), not an overlap.
    c.send(P.Register(region_id=1, start=start, length=2 * MiB, flags=P.Flag.PINNED, source=P.Source.MALLOC))
    assert pump(reg, lambda: reg.regions(os.getpid())[0].pinned)
    c.send(P.Unregister(region_id=1, start=start, length=2 * MiB))
    assert pump(reg, lambda: not reg.regions(os.getpid()))
    assert [k for k, _ in reg.events] == ["hello", "register", "update", "unregister"]
    c.close()
    assert pump(reg, lambda: not reg.processes())
    buf.close()


def test_refusals_are_answered_and_logged(reg, caplog):
    buf, start = aligned_region()
    c = Client(reg.path)
    seq = c.send(P.Register(region_id=9, start=start, length=2 * MiB, source=P.Source.MALLOC))
    pump(reg, lambda: reg.refusals)
    e = c.recv()
    assert isinstance(e, P.Error) and e.ref_seq == seq and e.code == errno.EPROTO
    assert "REGISTER before HELLO" in e.message

    seq = c.send(P.Hello(pid=os.getpid() + 1))
    pump(reg, lambda: len(reg.refusals) >= 2)
    e = c.recv()
    assert e.code == errno.EPERM and f"but the peer is pid {os.getpid()}" in e.message

    c.send(P.Hello(pid=os.getpid()))
    cases = [
        (P.Register(region_id=1, start=start + 4096, length=2 * MiB, source=P.Source.MALLOC), errno.EINVAL,
         "2 MiB boundary"),
        (P.Register(region_id=2, start=start, length=1000, source=P.Source.MALLOC), errno.EINVAL, "page size"),
        (P.Register(region_id=3, start=start, length=2 * MiB, flags=1 << 9, source=P.Source.MALLOC),
         errno.EINVAL, "unknown"),
        (P.Register(region_id=4, start=1 << 46, length=2 * MiB, source=P.Source.MALLOC), errno.EFAULT,
         "does not belong to it"),
        (P.Ping(), errno.EOPNOTSUPP, "control request"),
    ]
    for msg, code, text in cases:
        seq = c.send(msg)
        pump(reg, lambda: False, 0.1)
        e = c.recv()
        assert isinstance(e, P.Error) and e.ref_seq == seq and e.code == code and text in e.message, e
    c.sock.send(b"garbage that is no record")
    pump(reg, lambda: False, 0.1)
    assert c.recv().code == errno.EBADMSG
    # Overlap with a registered region.
    c.send(P.Register(region_id=5, start=start, length=2 * MiB, source=P.Source.MALLOC))
    c.send(P.Register(region_id=6, start=start, length=4 * MiB, source=P.Source.MALLOC))
    pump(reg, lambda: False, 0.2)
    e = c.recv()
    assert e.code == errno.EEXIST and "overlaps" in e.message
    assert len(reg.regions(os.getpid())) == 1          # the good one stayed, the connection too
    assert any("refused REGISTER" in r.message for r in caplog.records)
    c.close()
    buf.close()


OTHER = textwrap.dedent("""
    import mmap, ctypes, sys
    buf = mmap.mmap(-1, 6 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    print((a + (2 << 20) - 1) & ~((2 << 20) - 1), flush=True)
    sys.stdin.readline()
""")


def test_another_process_range_is_refused(reg):
    other = subprocess.Popen([sys.executable, "-c", OTHER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        start = int(other.stdout.readline())
        mine = read_maps(os.getpid())
        if any(v.start < start + 2 * MiB and start < v.end for v in mine):
            pytest.skip("the other process's range happens to be mapped here too")
        c = Client(reg.path)
        c.send(P.Hello(pid=os.getpid()))
        seq = c.send(P.Register(region_id=1, start=start, length=2 * MiB, source=P.Source.MALLOC))
        pump(reg, lambda: reg.refusals)
        e = c.recv()
        assert e.ref_seq == seq and e.code == errno.EFAULT and "does not belong to it" in e.message
        assert not reg.regions()
        c.close()
    finally:
        other.kill()


CHILD = textwrap.dedent("""
    import mmap, ctypes, os, socket, sys, time
    from tieringd.shim import protocol as P
    buf = mmap.mmap(-1, 6 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = (ctypes.addressof(ctypes.c_char.from_buffer(buf)) + (2 << 20) - 1) & ~((2 << 20) - 1)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(sys.argv[1])
    s.send(P.Hello(pid=os.getpid(), seq=1).encode())
    s.send(P.Register(region_id=1, start=start, length=4 << 20, source=P.Source.MMAP, seq=2).encode())
    if sys.argv[2] == "orphan":
        # A grandchild keeps the connection open: only the pidfd can tell the daemon we are gone.
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
    print("registered", flush=True)
    sys.stdin.readline()
""")


@pytest.mark.parametrize("mode", ["exit", "orphan"])
def test_regions_dropped_when_the_process_exits(reg, mode):
    env = dict(os.environ, PYTHONPATH=str(R.__file__).rsplit("/tieringd/", 1)[0])
    child = subprocess.Popen([sys.executable, "-c", CHILD, reg.path, mode], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        assert child.stdout.readline() == "registered\n"
        assert pump(reg, lambda: reg.regions(child.pid))
        assert reg.regions(child.pid)[0].length == 4 * MiB
        child.stdin.write("bye\n")
        child.stdin.flush()
        child.wait(10)
        assert pump(reg, lambda: not reg.processes())
        exits = [d for k, d in reg.events if k == "exit"]
        assert exits and exits[0]["pid"] == child.pid and exits[0]["dropped"] == 1
        if mode == "orphan":        # the connection is still open in the grandchild
            assert exits[0]["why"] == "process exited"
    finally:
        child.kill()
        try:
            os.killpg(child.pid, 9)
        except ProcessLookupError:
            pass


def test_a_shim_that_never_pauses_does_not_hold_the_loop(reg):
    """One poll reads a bounded number of records from a connection (RECORDS_PER_POLL): a client that
    sends without pause (a thread here, refilling its queue as fast as the poll drains it) leaves the
    loop free to tick and answer others in between; the rest follow at the next polls."""
    import threading
    c = Client(reg.path)
    c.sock.settimeout(30)
    reg.poll(1.0)                   # accepts the connection
    sender = threading.Thread(target=lambda: [c.sock.send(b"garbage that is no record") for _ in range(1000)])
    sender.start()
    reg.poll(1.0)
    assert 0 < len(reg.refusals) <= R.RECORDS_PER_POLL
    assert pump(reg, lambda: len(reg.refusals) == 1000, timeout=30)
    sender.join()
    c.close()
