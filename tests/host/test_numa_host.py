# SPDX-License-Identifier: Apache-2.0
"""tieringd.kernel.numa against the running kernel — what a one-node machine can show. Two-node behaviour
(pages really moving, a full target, pinned pages) is proven in tests/lab/test_mover_lab.py."""
import ctypes
import errno
import mmap
import os
import subprocess
import sys

import pytest

from tieringd.kernel import numa

PS = numa.PAGE_SIZE


@pytest.fixture
def region():
    """8 private anonymous pages of this process; pages 0 and 3 touched, the rest never."""
    m = mmap.mmap(-1, 8 * PS, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m[0:1] = b"x"
    m[3 * PS:3 * PS + 1] = b"y"
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    yield base, m
    del base
    m.close()


def test_query_says_where_pages_are_and_enoent_for_untouched(region):
    base, _ = region
    home = numa.memory_nodes()[0]
    st = numa.query_pages(0, numa.page_addresses(base, 8 * PS))
    assert st[0] == home and st[3] == home
    assert [numa.decode_status(s).result for s in (st[1], st[2], st[7])] == [numa.PageResult.NOT_PRESENT] * 3
    assert numa.query_pages(os.getpid(), [base]) == [home]
    assert numa.node_of_address(base) == home


def test_moving_to_a_node_that_does_not_exist_raises_a_clear_typed_error(region):
    base, _ = region
    missing = max(numa.possible_nodes()) + 1
    with pytest.raises(numa.NodeUnavailableError) as ei:
        numa.move_pages(0, [base], missing)
    assert ei.value.errno == errno.ENODEV
    msg = str(ei.value)
    assert f"to node {missing}" in msg and "does not exist or has no memory" in msg
    assert "nodes with memory:" in msg
    # the page did not move and is intact
    assert numa.query_pages(0, [base]) == [numa.memory_nodes()[0]]
    assert region[1][0:1] == b"x"


def test_moving_to_the_node_a_page_is_on_reports_that_node(region):
    base, _ = region
    home = numa.memory_nodes()[0]
    r = numa.move_pages_batch(0, numa.page_addresses(base, 4 * PS), home)
    assert r.complete
    assert r.status.tolist() == [home, -errno.ENOENT, -errno.ENOENT, home]


def test_a_pid_that_does_not_exist_is_a_typed_error():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()   # reaped: the pid is free now (reuse within the test is practically impossible)
    with pytest.raises(numa.ProcessGoneError, match=f"pid={p.pid}"):
        numa.query_pages(p.pid, [0x10000])
    with pytest.raises(ProcessLookupError):
        numa.move_pages(p.pid, [0x10000], numa.memory_nodes()[0])


def test_policies_round_trip(region):
    base, _ = region
    home = numa.memory_nodes()[0]
    numa.mbind(base, 8 * PS, numa.MPOL_BIND, [home], numa.MPOL_MF_MOVE)
    pol = numa.get_mempolicy(base)
    assert (pol.mode, pol.nodes) == (numa.MPOL_BIND, (home,))
    try:
        numa.set_mempolicy(numa.MPOL_PREFERRED, [home])
        assert numa.get_mempolicy() == numa.MemPolicy(numa.MPOL_PREFERRED, 0, (home,))
    finally:
        numa.set_mempolicy(numa.MPOL_DEFAULT)
    assert numa.get_mempolicy().mode == numa.MPOL_DEFAULT
    assert home in numa.mems_allowed()
    with pytest.raises(numa.NodeUnavailableError, match="does not exist or has no memory"):
        numa.mbind(base, 8 * PS, numa.MPOL_BIND, [max(numa.possible_nodes()) + 1])
    assert numa.migrate_pages(os.getpid(), [home], [home]) == 0


def test_home_node_probe_matches_the_kernel_version():
    # set_mempolicy_home_node arrived in 5.17 (c6018b4b2549).
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    assert numa.has_set_mempolicy_home_node() is ((major, minor) >= (5, 17))


@pytest.mark.root
def test_thp_is_detected_where_the_kernel_made_one():
    m = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    m[:] = b"\1" * len(m)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    mask = numa.thp_mask(0, base, len(m) // PS)
    assert mask is not None and len(mask) == len(m) // PS
    anon_huge_kb = _smaps_anon_huge_kb(base)
    assert int(mask.sum()) * PS // 1024 == anon_huge_kb
    assert numa.status_counts(numa.query_pages(0, numa.page_addresses(base, len(m)))) == \
        {f"node {numa.memory_nodes()[0]}": len(m) // PS}


def _smaps_anon_huge_kb(addr: int) -> int:
    text = open("/proc/self/smaps").read()
    kb, inside = 0, False
    for line in text.splitlines():
        if "-" in line.split(" ")[0] and not line.endswith(":"):
            lo, _, hi = line.split(" ")[0].partition("-")
            try:
                inside = int(lo, 16) <= addr < int(hi, 16)
            except ValueError:
                pass
        elif inside and line.startswith("AnonHugePages:"):
            kb += int(line.split()[1])
    return kb


CHILD = """
import ctypes, mmap, sys
m = mmap.mmap(-1, 64 * 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
m[: 32 * 4096] = b"k" * (32 * 4096)          # half the pages touched
print(hex(ctypes.addressof(ctypes.c_char.from_buffer(m))), flush=True)
sys.stdin.read()
assert m[: 32 * 4096] == b"k" * (32 * 4096)
"""


def test_tieringctl_migrate_reports_every_page(tmp_path):
    """The CLI end to end on one node: every page accounted (already there / not present), JSON schema."""
    import json

    from click.testing import CliRunner

    from tieringd.cli import main

    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        addr = child.stdout.readline().strip()
        home = numa.memory_nodes()[0]
        r = CliRunner().invoke(main, ["migrate", "--pid", str(child.pid), "--range", f"{addr}+{64 * PS}",
                                      "--to", str(home), "--json", "-q"])
        assert r.exit_code == 0, r.output
        doc = json.loads(r.output)
        assert doc["schema"] == "tieringd.migrate/1"
        rep = doc["report"]
        assert rep["requested_pages"] == 64
        assert rep["by_reason"] == {"already-there": 32, "not-present": 32}
        assert rep["error"] is None and not rep["process_exited"]
        r = CliRunner().invoke(main, ["migrate", "--pid", str(child.pid), "--range", f"{addr}+{64 * PS}",
                                      "--to", str(home)])
        assert r.exit_code == 0 and "already-there 32, not-present 32" in r.output
    finally:
        child.communicate("")
    assert child.returncode == 0     # the child's data was intact


def test_process_gone_sees_zombies_and_missing_pids():
    from tieringd import mover
    k = mover.Kernel()
    assert not k.process_gone(os.getpid())
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    import time
    for _ in range(200):          # until it is a zombie (not reaped yet)
        if k.process_gone(p.pid):
            break
        time.sleep(0.01)
    assert k.process_gone(p.pid)
    with pytest.raises(numa.InvalidArgumentError):    # a zombie has no mm: EINVAL, not ESRCH
        numa.query_pages(p.pid, [0x10000])
    p.wait()
    assert k.process_gone(p.pid)
