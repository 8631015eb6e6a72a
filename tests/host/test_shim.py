# SPDX-License-Identifier: Apache-2.0
"""The shim under LD_PRELOAD on this machine: unmodified programs give identical output with and
without it, their large buffers reach a live registry, the daemon can be absent or come late, and
the control channel obeys only root. (Placement on real tiers is proven in tests/lab.)"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import shutil
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tieringd.shim import protocol as P

from shim_support import PROGS, REPO, SHIM, LiveRegistry, plain_env, run, shim_env, start

pytestmark = pytest.mark.shim
MiB = 1 << 20


@pytest.fixture
def live(tmp_path):
    reg = LiveRegistry(tmp_path / "run").start()
    yield reg
    reg.stop()


def same_output(cmd: list[str], live_dir: Path | None, extra_env: dict | None = None, **shim_extra):
    """Runs cmd without and with the shim; both must succeed with identical stdout."""
    base = run(cmd, plain_env(**(extra_env or {})))
    assert base.returncode == 0, base.stderr
    p = subprocess.Popen(cmd, env=shim_env(live_dir, **(extra_env or {}), **shim_extra),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert out == base.stdout
    assert err == "", err          # the shim says nothing when all is well
    return p.pid, out


NUMPY_SCRIPT = textwrap.dedent("""
    import numpy as np
    n = 256 * 1024 * 1024 // 8                    # 256 MiB of float64 each
    a = np.arange(n, dtype=np.float64)
    b = np.ones(n) * 0.5
    c = a * b + 1.0
    print(f"{c.sum():.6e} {c[12345]:.3f} {np.dot(a[:1000], b[:1000]):.3f}")
    del a, b, c
""")


def test_numpy_256mib_identical_output_and_registered(live):
    pid, out = same_output([sys.executable, "-c", NUMPY_SCRIPT], live.reg.run_dir)
    regs = live.of(pid, "register")
    big = [r for r in regs if r["length"] >= 256 * MiB]
    assert len(big) >= 3, regs
    assert all(r["start"] % (2 * MiB) == 0 and r["policy"] == "fast" for r in big)
    assert {r["source"] for r in big} <= {"malloc", "calloc", "memalign", "realloc"}
    assert live.wait_for(lambda: live.of(pid, "exit")), "process exit not seen"
    assert not live.of(pid, "refuse")


def test_threaded_hammer_with_forks_identical_and_registered(live):
    pid, out = same_output([str(PROGS / "alloc_hammer"), "4", "20000", "4", "300"], live.reg.run_dir)
    assert "total errors: 0" in out and "children failed: 0" in out
    regs = live.of(pid, "register")
    assert {"memalign", "realloc"} <= {r["source"] for r in regs}, regs
    # Each child registered what it inherited (the 8 MiB buffer) under its own pid.
    hellos = [d["pid"] for k, d in live.events if k == "hello" and d["pid"] != pid]
    inherited = [d for k, d in live.events if k == "register" and d["pid"] in hellos
                 and "inherited" in d["flags"]]
    assert hellos and inherited, live.events[:20]
    # Races are allowed one kind of refusal only: a region (or process) already gone when the
    # daemon looked.
    refusals = [d for k, d in live.events if k == "refuse"]
    assert all(d["errno"] in ("EFAULT", "ESRCH") for d in refusals), refusals


def test_pinned_pools_identical_output(live):
    env = {"LD_LIBRARY_PATH": str(PROGS)}
    pid, out = same_output([str(PROGS / "pinned_kv")], live.reg.run_dir, env)
    assert out.startswith("register 0 ") and out.endswith("unregister 0\n")


def test_pinned_pools_marked_placed_and_unmarked(live):
    env = shim_env(live.reg.run_dir, LD_LIBRARY_PATH=str(PROGS))
    p = start([str(PROGS / "pinned_kv"), "wait"], env)
    try:
        assert p.stdout.readline().startswith("register 0")
        assert p.stdout.readline() == "pinned\n"
        assert live.wait_for(lambda: sum(r.pinned for r in live.reg.regions(p.pid)) == 3), live.events
        regions = live.reg.regions(p.pid)
        pool = [r for r in regions if r.source == P.Source.CUDA_HOST_ALLOC]
        assert pool and pool[0].length == 64 * MiB and pool[0].pinned
        assert pool[0].policy == P.Policy.WEIGHTED              # placed for pinning before it was pinned
        buf = [r for r in regions if r.length == 32 * MiB]
        assert buf and buf[0].pinned and buf[0].policy == P.Policy.WEIGHTED   # re-bound, pages moved
        small = [r for r in regions if r.flags & P.Flag.FOREIGN]
        assert small and small[0].pinned and small[0].length >= MiB
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline() == "unregister 0\n"
        assert p.wait(30) == 0
    finally:
        p.kill()
    # Only the benign race: an update that arrived after the region (or process) was gone.
    assert all(d["errno"] in ("EFAULT", "ESRCH") for d in live.of(p.pid, "refuse"))


WAITER = textwrap.dedent("""
    import sys, numpy as np
    a = np.full(8 * 1024 * 1024, 3.0)             # 64 MiB
    print("ready", a[::4096].sum(), flush=True)
    sys.stdin.readline()
    print("done", a.sum(), flush=True)
""")


def test_daemon_absent_then_started_learns_regions(tmp_path):
    run_dir = tmp_path / "run"            # does not exist yet: no daemon, no directory
    base = run([sys.executable, "-c", WAITER], plain_env(), input="go\n")
    p = subprocess.Popen([sys.executable, "-c", WAITER], env=shim_env(run_dir), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    live = None
    try:
        first = p.stdout.readline()
        assert first.startswith("ready")
        time.sleep(0.5)
        live = LiveRegistry(run_dir).start()      # the daemon appears
        assert live.wait_for(lambda: any(r.length >= 64 * MiB for r in live.reg.regions(p.pid)), 15), \
            live.events
        out, err = p.communicate("go\n", timeout=60)
        assert p.returncode == 0 and err == ""
        assert first + out == base.stdout
    finally:
        p.kill()
        if live:
            live.stop()


def test_control_channel_root_peer(live):
    p = start([sys.executable, "-c", WAITER], shim_env(live.reg.run_dir))
    try:
        assert p.stdout.readline().startswith("ready")
        assert live.wait_for(lambda: live.reg.regions(p.pid))
        region = max(live.reg.regions(p.pid), key=lambda r: r.length)
        pong = live.request(p.pid, P.Ping())
        assert isinstance(pong, P.Pong) and pong.pid == p.pid and pong.nregions >= 1
        assert pong.managed_bytes >= region.length
        ack = live.request(p.pid, P.Rebind(start=region.start, length=region.length, nodemask=1,
                                           policy=P.Policy.BIND, flags=P.REBIND_MOVE))
        assert isinstance(ack, P.Ack), ack
        assert live.wait_for(lambda: any(r.policy == P.Policy.BIND for r in live.reg.regions(p.pid)))
        err = live.request(p.pid, P.Rebind(start=0x1000, length=0x1000, policy=P.Policy.FAST))
        assert isinstance(err, P.Error) and err.code == errno.ENOENT
        assert "not inside a region" in err.message
        bad = live.request(p.pid, P.Rebind(start=region.start, length=4096, policy=P.Policy.BIND))
        assert isinstance(bad, P.Error) and bad.code == errno.EINVAL   # bind without a nodemask
        bad = live.request(p.pid, P.Rebind(start=region.start, length=4096, nodemask=1,
                                           policy=P.Policy.PREFERRED, flags=P.REBIND_NUMA_BALANCING))
        assert isinstance(bad, P.Error) and bad.code == errno.EINVAL   # balancing needs bind
        assert "numa-balancing without policy bind" in bad.message
        ack = live.request(p.pid, P.Resync())
        assert isinstance(ack, P.Ack)
        assert live.wait_for(lambda: len([k for k, d in live.events
                                          if k == "reset" and d["pid"] == p.pid]) >= 2)
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.wait(30) == 0
    finally:
        p.kill()


def numa_maps_policy(pid: int, start: int) -> str:
    """The policy column of /proc/PID/numa_maps for the VMA starting at start ("bind=balancing:0")."""
    for line in Path(f"/proc/{pid}/numa_maps").read_text().splitlines():
        if int(line.split()[0], 16) == start:
            return line.split()[1]
    raise AssertionError(f"no VMA at {start:#x} in /proc/{pid}/numa_maps")


def test_rebind_numa_balancing_binds_with_the_kernel_flag(live):
    p = start([sys.executable, "-c", WAITER], shim_env(live.reg.run_dir))
    try:
        assert p.stdout.readline().startswith("ready")
        assert live.wait_for(lambda: live.reg.regions(p.pid))
        region = max(live.reg.regions(p.pid), key=lambda r: r.length)
        ack = live.request(p.pid, P.Rebind(start=region.start, length=region.length, nodemask=1,
                                           policy=P.Policy.BIND, flags=P.REBIND_NUMA_BALANCING))
        assert isinstance(ack, P.Ack), ack
        # mpol_to_str() names MPOL_F_NUMA_BALANCING "balancing": the VMA carries the flag itself.
        assert numa_maps_policy(p.pid, region.start) == "bind=balancing:0"
        unknown = live.request(p.pid, P.Rebind(start=region.start, length=region.length, nodemask=1,
                                               policy=P.Policy.BIND, flags=0x80))
        assert isinstance(unknown, P.Error) and unknown.code == errno.EINVAL
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.wait(30) == 0
    finally:
        p.kill()


FAKE_DAEMON = textwrap.dedent("""
    import json, os, socket, sys
    from tieringd.shim import protocol as P
    run_dir = sys.argv[1]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(P.socket_path(run_dir))
    os.chmod(P.socket_path(run_dir), 0o666)
    s.listen(1)
    print("listening", os.getuid(), flush=True)
    c, _ = s.accept()
    hello = P.decode(c.recv(256))
    c.send(P.Ping(seq=7).encode())
    c.send(P.Rebind(seq=8, start=0, length=4096, policy=P.Policy.FAST).encode())
    replies = []
    while len(replies) < 2:
        m = P.decode(c.recv(256))
        if isinstance(m, (P.Error, P.Pong, P.Ack)):
            replies.append({"type": m.TYPE.name, "ref": getattr(m, "ref_seq", 0),
                            "code": getattr(m, "code", 0), "message": getattr(m, "message", "")})
    print(json.dumps({"hello_pid": hello.pid, "replies": replies}), flush=True)
""")


@pytest.mark.root
def test_control_channel_refuses_non_root_peer():
    """A daemon impostor running as nobody gets EPERM for every control request."""
    run_dir = tempfile.mkdtemp(prefix="tieringd-nonroot-")
    os.chmod(run_dir, 0o777)
    # nobody may not be able to enter the checkout (a clone under a 0700 mktemp folder, as CI makes):
    # give the impostor its own readable copy of the package
    pkg = tempfile.mkdtemp(prefix="tieringd-nonroot-pkg-")
    shutil.copytree(REPO / "tieringd", Path(pkg) / "tieringd",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for d, _, _ in os.walk(pkg):
        os.chmod(d, 0o755)
    fake = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                             "/usr/bin/python3", "-c", FAKE_DAEMON, run_dir],
                            env={"PYTHONPATH": pkg, "PATH": "/usr/bin:/bin"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    app = None
    try:
        assert fake.stdout.readline().split() == ["listening", "65534"], fake.stderr.read()
        app = start([sys.executable, "-c", WAITER], shim_env(Path(run_dir)))
        assert app.stdout.readline().startswith("ready")
        report = json.loads(fake.stdout.readline())
        assert report["hello_pid"] == app.pid
        assert [r["type"] for r in report["replies"]] == ["ERROR", "ERROR"]
        assert {r["ref"] for r in report["replies"]} == {7, 8}
        for r in report["replies"]:
            assert r["code"] == errno.EPERM
            assert "need a root peer; this peer is uid 65534" in r["message"]
        out, err = app.communicate("go\n", timeout=60)
        assert app.returncode == 0 and out.startswith("done")
        assert "refused control message" in err       # and the app's stderr says why
    finally:
        fake.kill()
        if app:
            app.kill()
        shutil.rmtree(pkg, ignore_errors=True)


def test_tieringctl_run_sets_policy_and_threshold(live):
    tieringctl = Path(sys.executable).with_name("tieringctl")
    env = plain_env(TIERINGD_SHIM=str(SHIM))
    r = run([str(tieringctl), "run", "--policy", "interleave", "--min-bytes", "32M",
             "--run-dir", str(live.reg.run_dir), "--", sys.executable, "-c", NUMPY_SCRIPT], env)
    assert r.returncode == 0, r.stderr
    hello = [d for k, d in live.events if k == "hello"]
    assert hello and hello[-1]["min_bytes"] == 32 * MiB and hello[-1]["policy"] == "interleave"
    pid = hello[-1]["pid"]
    assert live.wait_for(lambda: live.of(pid, "exit"))
    assert all(d["length"] >= 32 * MiB and d["policy"] == "interleave" for d in live.of(pid, "register"))
    bad = run([str(tieringctl), "run", "--min-bytes", "1k", "--", "true"], env)
    assert bad.returncode == 2 and "at least 2 MiB" in bad.stderr
    missing = run([str(tieringctl), "run", "--", "no-such-program-xyz"], env)
    assert missing.returncode == 127 and "command not found" in missing.stderr


def test_disabled_shim_is_a_pass_through(live):
    pid, out = same_output([sys.executable, "-c", NUMPY_SCRIPT], live.reg.run_dir, TIERINGD_DISABLE="1")
    assert not live.of(pid)


@pytest.mark.parametrize("extra,flag", [({"TIERINGD_BACKING": "memfd"}, "memfd"),
                                        ({"TIERINGD_KSM": "1"}, "ksm")])
def test_memfd_backing_and_ksm(live, extra, flag):
    pid, out = same_output([sys.executable, "-c", NUMPY_SCRIPT], live.reg.run_dir, **extra)
    big = [r for r in live.of(pid, "register") if r["length"] >= 256 * MiB]
    assert big and all(flag in r["flags"] for r in big), big
    assert not live.of(pid, "refuse")      # the daemon's maps check agrees with the claimed backing


TWO_STEPS = textwrap.dedent("""
    import sys, numpy as np
    a = np.full(8 * 1024 * 1024, 1.0)             # 64 MiB: the first region starts the shim's thread
    print("first", flush=True)
    sys.stdin.readline()
    b = np.full(2 * 1024 * 1024, 2.0)             # 16 MiB
    print("second", a.sum() + b.sum(), flush=True)
    sys.stdin.readline()
""")


@pytest.mark.parametrize("env_min", [None, "8M"])
def test_daemon_config_applies_unless_the_environment_set_it(tmp_path, env_min):
    from tieringd.shim.settings import ShimSettings
    live = LiveRegistry(tmp_path / "run", shim_config=ShimSettings(min_bytes=32 * MiB).to_message()).start()
    extra = {"TIERINGD_MIN_BYTES": env_min} if env_min else {}
    p = start([sys.executable, "-c", TWO_STEPS], shim_env(live.reg.run_dir, **extra))
    try:
        assert p.stdout.readline() == "first\n"
        assert live.wait_for(lambda: live.reg.regions(p.pid))
        assert live.request(p.pid, P.Ping()).pid == p.pid     # CONFIG (sent at HELLO) was handled
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline().startswith("second")
        # 16 MiB is below the daemon's 32 MiB, but the environment's 8 MiB wins over the daemon.
        def has_16():
            return any(r.length == 16 * MiB for r in live.reg.regions(p.pid))
        if env_min:
            assert live.wait_for(has_16)
        else:
            live.request(p.pid, P.Ping())
            time.sleep(0.5)
            assert not has_16()
        pong = live.request(p.pid, P.Ping())
        assert pong.nregions == len(live.reg.regions(p.pid))
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.wait(30) == 0
    finally:
        p.kill()
        live.stop()


MMAP_SCRIPT = textwrap.dedent("""
    import ctypes, sys
    libc = ctypes.CDLL(None, use_errno=True)          # the preloaded mmap/munmap/mremap come first
    libc.mmap.restype = libc.mremap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int]
    M = 1 << 20
    a = libc.mmap(None, 32 * M, 3, 0x22, -1, 0)       # PROT_READ|WRITE, MAP_PRIVATE|MAP_ANONYMOUS
    ctypes.memset(a, 7, 32 * M)
    def step(name):
        print(name, flush=True)
        sys.stdin.readline()
    step("mapped")
    assert libc.munmap(a + 8 * M, 8 * M) == 0          # a hole in the middle: two regions remain
    step("split")
    b = libc.mremap(a + 16 * M, 16 * M, 24 * M, 1)     # MREMAP_MAYMOVE: the tail grows (or moves)
    assert b != ctypes.c_void_p(-1).value
    # Compared 64 KiB at a time: a 16 MiB bytes object would be a managed malloc of its own, freed at
    # once, whose REGISTER a busy daemon checks too late and rightly refuses (make test, 2026-12-02).
    C = 64 << 10
    def sevens(addr, n):
        return all(ctypes.string_at(addr + off, C) == bytes([7]) * C for off in range(0, n, C))
    ok = sevens(b, 16 * M) and sevens(a, 8 * M)
    print("intact", ok, flush=True)
    step("remapped")
    libc.munmap(a, 8 * M)
    libc.munmap(b, 24 * M)
    step("unmapped")
""")


def test_mmap_munmap_mremap_keep_the_table_exact(live):
    p = start([sys.executable, "-c", MMAP_SCRIPT], shim_env(live.reg.run_dir))

    def regions():
        return [(r.start, r.length) for r in live.reg.regions(p.pid) if r.source == P.Source.MMAP
                and r.length in (8 * MiB, 16 * MiB, 24 * MiB, 32 * MiB)]

    def go():
        p.stdin.write("\n")
        p.stdin.flush()

    try:
        assert p.stdout.readline() == "mapped\n"
        assert live.wait_for(lambda: [r for r in regions() if r[1] == 32 * MiB])
        (a, length), = [r for r in regions() if r[1] == 32 * MiB]
        assert a % (2 * MiB) == 0
        go()
        assert p.stdout.readline() == "split\n"
        assert live.wait_for(lambda: sorted(r for r in regions() if a <= r[0] < a + 32 * MiB) ==
                             [(a, 8 * MiB), (a + 16 * MiB, 16 * MiB)]), regions()
        go()
        assert p.stdout.readline() == "intact True\n"
        assert p.stdout.readline() == "remapped\n"
        assert live.wait_for(lambda: (a, 8 * MiB) in regions() and
                             any(length == 24 * MiB for _, length in regions())), regions()
        go()
        assert p.stdout.readline() == "unmapped\n"
        assert live.wait_for(lambda: regions() == []), regions()
        go()
        assert p.wait(30) == 0
    finally:
        p.kill()
    assert not live.of(p.pid, "refuse")
