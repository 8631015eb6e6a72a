# SPDX-License-Identifier: Apache-2.0
"""The DAX-remap tier on this machine: a memfd-backed pool moves onto a log file and back while four
threads store into it and a fifth read(2)s into it from the kernel, and every word holds at the end
(tests/progs/dax_writers.c checks them against its own record); the daemon killed with SIGKILL in
the middle of a remap loses nothing; an unprivileged process is remapped with the /dev/userfaultfd
the daemon sends; what may not move is refused with the reason. The log is a plain file here (the
mechanism is the same); fsdax and devdax are proven in tests/lab/test_dax_lab.py."""
from __future__ import annotations

import errno
import os
import signal
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tieringd.shim import protocol as P
from tieringd.shim import remap

from shim_support import PROGS, REPO, SHIM, LiveRegistry, locked_by, shim_env

pytestmark = [pytest.mark.shim, pytest.mark.root]
MiB = 1 << 20

if os.geteuid() != 0:
    pytest.skip("remapping another process's memory needs a root daemon", allow_module_level=True)


class Workload:
    """tests/progs/dax_writers under the shim with memfd backing."""

    def __init__(self, run_dir: Path, mib: int = 64, user: int | None = None, **env: str):
        prog, env = str(PROGS / "dax_writers"), {"TIERINGD_BACKING": "memfd", **env}
        if user is not None:
            prog, env["LD_PRELOAD"] = _readable_copies(PROGS / "dax_writers", SHIM)
        self.p = subprocess.Popen([prog, str(mib)], env=shim_env(run_dir, **env),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, user=user)
        words = self.p.stdout.readline().split()
        assert words and words[0] == "pool", self.p.stderr.read()
        self.start, self.length = int(words[1], 16), int(words[2])
        assert self.p.stdout.readline().strip() == "running"

    @property
    def pid(self) -> int:
        return self.p.pid

    def maps(self, needle: str) -> list[str]:
        return [line for line in Path(f"/proc/{self.pid}/maps").read_text().splitlines() if needle in line]

    def finish(self) -> str:
        out, err = self.p.communicate("stop\n", timeout=120)
        assert self.p.returncode == 0, out + err
        assert out.startswith("ok "), out
        return out

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def _readable_copies(*paths: Path) -> list[str]:
    """Copies another user can execute and preload: the checkout may sit where only root can enter
    (a clone in root's home, 0700 on Debian: the fresh-root check's /root/tieringd)."""
    d = Path(tempfile.mkdtemp(prefix="tieringd-dax-bin-"))
    d.chmod(0o755)
    out = []
    for p in paths:
        shutil.copy(p, d / p.name)
        (d / p.name).chmod(0o755)
        out.append(str(d / p.name))
    return out


@pytest.fixture
def run_dir():
    d = Path(tempfile.mkdtemp(prefix="tieringd-dax-"))
    d.chmod(0o755)              # an unprivileged shim reaches the socket
    yield d
    subprocess.run(["rm", "-rf", str(d)])


@pytest.fixture
def live(run_dir):
    reg = LiveRegistry(run_dir / "run").start()
    yield reg
    reg.stop()


def tier_for(reg, log_path: Path, **kw) -> remap.DaxTier:
    cfg = remap.DaxConfig(path=str(log_path), size_bytes=kw.pop("size_bytes", 256 * MiB),
                          segment_bytes=kw.pop("segment_bytes", 16 * MiB), **kw)
    return remap.DaxTier(reg, cfg).open({})


def registered(live, w: Workload) -> None:
    assert live.wait_for(lambda: any(r.start == w.start for r in live.reg.regions(w.pid))), live.events


def test_demote_and_promote_while_threads_write(live, run_dir):
    w = Workload(live.reg.run_dir)
    try:
        registered(live, w)
        with tier_for(live.reg, run_dir / "kv.log") as tier:
            rep = tier.demote(w.pid, w.start, w.length)
            assert rep.ok, rep
            assert len(rep.extents) == 4                       # 64 MiB in 16 MiB segments
            # The pool is the log file now, at the offsets the log chose, in order.
            on_file = w.maps(str(run_dir / "kv.log"))
            assert on_file and not w.maps("/memfd:tieringd-kv"), w.maps("")
            assert int(on_file[0].split()[2], 16) == rep.extents[0][0]
            assert tier.capacity().used_bytes == w.length
            part = tier.promote(w.pid, w.start + 8 * MiB, 8 * MiB)
            assert part.ok and part.extents == [(8 * MiB, 8 * MiB)]
            assert len(w.maps("/memfd:tieringd-kv")) == 1 and len(w.maps("kv.log")) == 2
            back = tier.promote(w.pid, w.start, w.length)
            assert back.ok and back.done_bytes == w.length - 8 * MiB
            assert not w.maps("kv.log")
            assert tier.capacity().used_bytes == 0
            stats = tier.stats()
            assert stats["log"]["demoted_bytes"] == w.length and stats["log"]["write_amplification"] == 1.0
            assert stats["requests"]["promote"]["requests"] == 2
        w.finish()
    finally:
        w.kill()


def test_unprivileged_process_needs_the_userfaultfd_device(live, run_dir):
    w = Workload(live.reg.run_dir, mib=16, user=65534)
    try:
        registered(live, w)
        with tier_for(live.reg, run_dir / "kv.log", userfaultfd="/nonexistent") as tier:
            rep = tier.demote(w.pid, w.start, w.length)
            assert rep.code == errno.EPERM and "/dev/userfaultfd" in rep.error, rep
            assert w.maps("/memfd:tieringd-kv")              # nothing changed
        if not os.path.exists("/dev/userfaultfd"):
            pytest.skip("no /dev/userfaultfd (Linux < 6.1)")
        with tier_for(live.reg, run_dir / "kv.log") as tier:
            assert tier.demote(w.pid, w.start, w.length).ok
            assert tier.promote(w.pid, w.start, w.length).ok
        w.finish()
    finally:
        w.kill()


FORKER = textwrap.dedent("""
    import os, sys, numpy as np
    a = np.full(8 * 1024 * 1024, 7.0)            # 64 MiB, one memfd region
    if os.fork() == 0:
        sys.stdin.readline(); os._exit(0)
    # only after fork(2) returned: the child maps the memfd from then on (printed before it, a
    # loaded host let the demote run before the child existed and succeed)
    print(a.ctypes.data, a.nbytes, flush=True)
    sys.stdin.readline()
    os.wait()
""")


def test_what_may_not_move_is_refused_with_the_reason(live, run_dir):
    anon = Workload(live.reg.run_dir, mib=16, TIERINGD_BACKING="anon")
    forker = subprocess.Popen([sys.executable, "-c", FORKER], env=shim_env(live.reg.run_dir, TIERINGD_BACKING="memfd"),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        registered(live, anon)
        addr, size = map(int, forker.stdout.readline().split())
        assert live.wait_for(lambda: live.reg.regions(forker.pid))
        with tier_for(live.reg, run_dir / "kv.log") as tier:
            rep = tier.demote(anon.pid, anon.start, anon.length)
            assert rep.code == errno.EINVAL and "memfd" in rep.error
            rep = tier.demote(anon.pid, 0x1000, 4096)
            assert rep.code == errno.ENOENT
            region = max(live.reg.regions(forker.pid), key=lambda r: r.length)
            rep = tier.demote(forker.pid, region.start, region.length)
            assert rep.code == errno.EBUSY and "shared across fork" in rep.error, rep
            assert tier.promote(anon.pid, anon.start, anon.length).code == errno.ENOENT
            # The shim checks for itself too: a descriptor it cannot use, a range it does not own.
            ro = os.open(run_dir / "kv.log", os.O_RDONLY)
            bad = live.reg.request(anon.pid, P.Remap(start=anon.start, length=4096, file_offset=0), fds=[ro])
            assert isinstance(bad, P.Error) and bad.code == errno.EBADF
            bad = live.reg.request(anon.pid, P.Remap(start=anon.start, length=4096, file_offset=0), fds=[tier.fd])
            assert isinstance(bad, P.Error) and bad.code == errno.EINVAL and "memfd" in bad.message
            bad = live.reg.request(anon.pid, P.Remap(start=anon.start, length=4096))
            assert isinstance(bad, P.Error) and bad.code == errno.EBADF
            os.close(ro)
            assert tier.stats()["failed_by_errno"] == {"EINVAL": 1, "ENOENT": 2, "EBUSY": 1}
        forker.communicate("go\ngo\n", timeout=60)
        anon.finish()
    finally:
        anon.kill()
        forker.kill()


def daemon_main(argv: list[str]) -> None:
    """The daemon side of a remap, in a process of its own so that a test can SIGKILL it:
    ``test_shim_dax.py --daemon RUN_DIR LOG PID START LENGTH demote|promote LOG_BYTES SEGMENT_BYTES``
    (also used by tests/lab/test_dax_lab.py). Prints "sending" just before the request it is killed in."""
    from tieringd.shim import registry
    run_dir, log_path, pid, start, length, direction, size, segment = argv
    pid, start, length = int(pid), int(start), int(length)
    reg = registry.Registry(run_dir).start()
    deadline = time.monotonic() + 120
    while not any(r.start == start for r in reg.regions(pid)) and time.monotonic() < deadline:
        reg.poll(0.1)
    tier = remap.DaxTier(reg, remap.DaxConfig(path=log_path, size_bytes=int(size),
                                              segment_bytes=int(segment))).open({})
    if direction == "promote":
        assert tier.demote(pid, start, length).ok
    print("sending", flush=True)
    (tier.demote if direction == "demote" else tier.promote)(pid, start, length)
    print("done", flush=True)


if __name__ == "__main__" and sys.argv[1:2] == ["--daemon"]:
    daemon_main(sys.argv[2:])
    sys.exit(0)

@pytest.mark.parametrize("direction", ["demote", "promote"])
def test_daemon_killed_mid_remap_loses_nothing(run_dir, direction):
    run = run_dir / "run"
    log_path = run_dir / "kv.log"
    w = Workload(run, mib=256)
    daemon = subprocess.Popen([sys.executable, __file__, "--daemon", str(run), str(log_path), str(w.pid),
                               str(w.start), str(w.length), direction, str(1 << 30), str(64 * MiB)],
                              stdout=subprocess.PIPE, text=True, cwd=REPO)
    live = None
    try:
        assert daemon.stdout.readline().strip() == "sending"
        # Kill it while the shim holds the extent's lock: the copy is under way.
        deadline = time.monotonic() + 30
        while locked_by(log_path) != w.pid and daemon.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        assert locked_by(log_path) == w.pid, "the remap finished before the daemon could be killed"
        daemon.send_signal(signal.SIGKILL)
        daemon.wait()
        # The shim finishes the piece in flight on its own (the first 64 MiB: one segment); the
        # daemon never asked for the rest. A new daemon finds the pool where the shim left it.
        deadline = time.monotonic() + 60
        while locked_by(log_path) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert locked_by(log_path) is None
        first = [line for line in w.maps("") if int(line.split("-")[0], 16) == w.start][0]
        assert ("kv.log" in first) == (direction == "demote"), first
        live = LiveRegistry(run).start()
        # The shim connects again at once (inotify). A region partly on the log file is not
        # re-registered yet (the registry's maps check wants all of a memfd region on the memfd:
        # docs/dax.md, "Limits"); the connection is all a promotion needs.
        assert live.wait_for(lambda: live.of(w.pid, "hello"))
        with tier_for(live.reg, log_path, size_bytes=1 << 30, segment_bytes=64 * MiB) as tier:
            on_file = sum(int(x.split()[0].split("-")[1], 16) - int(x.split()[0].split("-")[0], 16)
                          for x in w.maps(str(log_path)))
            assert tier.capacity().used_bytes == on_file == (64 * MiB if direction == "demote" else 192 * MiB)
            assert tier.promote(w.pid, w.start, w.length).ok
            assert not w.maps(str(log_path))
            assert tier.reconcile() == 0 and tier.capacity().used_bytes == 0
        w.finish()
    finally:
        daemon.kill()
        w.kill()
        if live:
            live.stop()


def test_cleaning_moves_live_extents_through_the_shim_within_the_bound(live, run_dir):
    w = Workload(live.reg.run_dir, mib=64)
    try:
        registered(live, w)
        with tier_for(live.reg, run_dir / "kv.log", size_bytes=12 * 8 * MiB, segment_bytes=8 * MiB) as tier:
            half = w.length // 2
            assert tier.demote(w.pid, w.start, half).ok                  # segments 0-3
            for k in range(0, half, 4 * MiB):                              # every other 2 MiB back
                assert tier.promote(w.pid, w.start + k, 2 * MiB).ok
            assert tier.demote(w.pid, w.start + half, half).ok           # segments 4-7
            log = tier.log
            assert [s.live_bytes for s in log.segments[:4]] == [4 * MiB] * 4
            freed = tier.clean(max_segments=2)
            assert freed == 2 and log.cleaned_segments == 2
            st = tier.stats()["log"]
            assert st["cleaner_bytes"] == 8 * MiB                         # two half-live segments
            assert 1.0 < st["write_amplification"] <= st["write_amplification_bound"] == 2.0
            assert tier.stats()["requests"]["relocate"]["failed"] == 0
            # Where the log says each extent is, the process maps it.
            for e in tier.extents(w.pid):
                line = [x for x in w.maps("kv.log") if int(x.split("-")[0], 16) <= e.start
                        < int(x.split()[0].split("-")[1], 16)][0]
                vma_start, off = int(line.split("-")[0], 16), int(line.split()[2], 16)
                assert off + (e.start - vma_start) == e.offset
            assert tier.promote(w.pid, w.start, w.length).ok
        w.finish()
    finally:
        w.kill()


def test_a_loop_that_reads_the_capacity_every_tick_gets_the_reply(run_dir):
    """As in the daemon: one thread polls the registry (the replies come in there) and asks the tier's
    capacity every tick, while the tier's worker waits for a shim's reply to a demotion. The capacity
    must not wait for the worker, or nobody reads the reply and the request runs into its timeout
    (here 10 minutes: the safety net below ends the test long before)."""
    reg = LiveRegistry(run_dir / "run").reg
    reg.start()
    stop, ticks = threading.Event(), []

    def loop(tier: remap.DaxTier) -> None:
        reg.polled_elsewhere = True
        while not stop.is_set():
            reg.poll(0.05)
            ticks.append(tier.capacity().used_bytes)

    tier = tier_for(reg, run_dir / "kv.log", timeout_s=600.0, timeout_s_per_gib=0.0)
    t = threading.Thread(target=loop, args=(tier,), daemon=True)
    t.start()
    w = Workload(reg.run_dir, mib=32)
    try:
        deadline = time.monotonic() + 120
        while not reg.regions(w.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        done = threading.Event()
        tier.start()
        tier.submit(P.RemapDirection.DEMOTE, w.pid, w.start, w.length, done=lambda rep: done.set())
        assert done.wait(120), "the demotion's reply was never read while the loop asked the capacity"
        assert tier.reports[-1].ok, tier.reports[-1]
        assert tier.stats()["failed_by_errno"] == {}
        assert w.maps(str(run_dir / "kv.log"))
        deadline = time.monotonic() + 30
        while ticks[-1] != w.length and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ticks[-1] == w.length              # after the request, the figures are current
        w.finish()
    finally:
        stop.set()
        t.join(5)
        w.kill()
        tier.close()
        reg.close()


def test_a_restarted_tier_adopts_merged_mappings_one_segment_at_a_time(live, run_dir):
    """Two extents adjacent in memory and in the file (consecutive segments) are one VMA in the
    process. A tier opened afresh (a restarted daemon) must see both segments in use: its next
    demotion lands elsewhere, and every word of the pool holds at the end."""
    w = Workload(live.reg.run_dir, mib=64)
    try:
        registered(live, w)
        log_path = run_dir / "kv.log"
        with tier_for(live.reg, log_path) as tier:
            assert tier.demote(w.pid, w.start, 16 * MiB).ok
            assert tier.demote(w.pid, w.start + 16 * MiB, 16 * MiB).ok
            assert [e.offset for e in tier.extents(w.pid)] == [0, 16 * MiB]
        assert len(w.maps(str(log_path))) == 1, w.maps("")          # the kernel merged them
        with tier_for(live.reg, log_path) as again:
            assert again.capacity().used_bytes == 32 * MiB
            assert [(e.offset, e.length) for e in again.extents(w.pid)] == [(0, 16 * MiB), (16 * MiB, 16 * MiB)]
            rep = again.demote(w.pid, w.start + 32 * MiB, 16 * MiB)
            assert rep.ok and rep.extents[0][0] >= 32 * MiB, rep
            assert again.promote(w.pid, w.start, w.length).ok
            assert not w.maps(str(log_path))
        w.finish()
    finally:
        w.kill()
