# SPDX-License-Identifier: Apache-2.0
"""The reports the control socket and the metrics serve (tieringd/service/reports.py), over a real block table
with regions on two nodes of the captured cxl-6.12 topology and a real migration engine run on this
process's own pages."""
import mmap

import numpy as np
import pytest

from daemon_standin import BLOCK_BYTES, StandInDaemon
from tieringd.service import metrics, reports
from tieringd.config import ConfigFile
from tieringd.contracts import Priority, Tier
from tieringd.mover import MoveRequest

MiB = 1 << 20
PID = 424242          # no such process: the table does not care, the reports must not either


@pytest.fixture
def daemon(tmp_path):
    d = StandInDaemon(ConfigFile({}), run_dir=str(tmp_path))
    t = d.table
    rid = t.add_region(PID, 0x7f0000000000, 8 * BLOCK_BYTES, BLOCK_BYTES, node=0, tier=Tier.DRAM)
    first = int(t.r_first[rid])
    t.set_location(np.arange(first + 5, first + 8), 1, int(Tier.CXL_DRAM))
    t.heat[first:first + 8] = [0.9, 0.85, 0.6, 0.3, 0.1, 0.0, 0.95, 0.05]
    return d


def test_bytes_per_tier_and_node_come_from_the_blocks(daemon):
    assert reports.bytes_by_tier(daemon)["dram"] == 10 * MiB
    assert reports.bytes_by_tier(daemon)["cxl-dram"] == 6 * MiB
    assert reports.bytes_by_node(daemon) == {"0": 10 * MiB, "1": 6 * MiB}
    tiers = {t["tier"]: t for t in reports.tiers(daemon)["tiers"]}
    assert tiers["cxl-dram"]["nodes"] == [1] and tiers["cxl-dram"]["managed_bytes"] == 6 * MiB


def test_processes_sum_per_tier_and_heat_band(daemon):
    doc = reports.processes(daemon)
    (p,) = doc["processes"]
    assert p["pid"] == PID and p["comm"] is None and p["regions"] == 0 and p["blocks"] == 8
    assert p["bytes_by_tier"] == {"gpu-hbm": 0, "dram": 10 * MiB, "cxl-dram": 6 * MiB, "pmem": 0, "dax": 0}
    assert doc["heat_bands"] == [">=0.8", ">=0.5", ">=0.2", "<0.2"]
    assert p["heat"]["blocks"] == [3, 1, 1, 3]
    assert p["heat"]["max"] == pytest.approx(0.95, abs=1e-4)


def test_heat_lists_blocks_by_address_and_pages(daemon):
    h = reports.heat(daemon, PID, offset=2, limit=3)
    assert h["blocks_total"] == 8 and h["count"] == 3 and h["truncated"]
    assert h["blocks"]["address"] == [0x7f0000000000 + i * BLOCK_BYTES for i in (2, 3, 4)]
    assert h["blocks"]["heat"] == [0.6, 0.3, 0.1]
    assert reports.heat(daemon, PID, offset=5, limit=10)["blocks"]["tier"] == ["cxl-dram"] * 3
    assert reports.heat(daemon, 1, limit=10)["blocks_total"] == 0


def test_stats_count_a_real_move_of_our_own_pages(daemon):
    buf = mmap.mmap(-1, 4 * MiB)
    buf.write(b"x" * (4 * MiB))
    import ctypes
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    t = daemon.engine.submit(MoveRequest(0, [(addr, 4 * MiB)], 0, Priority.PROMOTE))
    daemon.engine.run_until_idle()
    rep = t.wait(0)
    s = reports.stats(daemon, {"pgmigrate_success": 0})
    node0 = next(n for n in s["nodes"] if n["node"] == 0)
    assert node0["requested_in_bytes"] == rep.requested_pages * 4096 == 4 * MiB
    assert node0["already_bytes"] == 4 * MiB        # one node here: every page was already there
    assert s["vmstat"]["pgmigrate_success"]["at_start"] == 0
    snap = metrics.take(daemon)
    assert snap.migration_bytes == {("lateral", "already-there"): 4 * MiB}
    del t, rep
    buf.close()


def test_the_metrics_snapshot_carries_the_same_bytes(daemon):
    snap = metrics.take(daemon)
    assert snap.tier_bytes == reports.bytes_by_tier(daemon)
    assert sorted(snap.process_tier_bytes) == [(str(PID), "", "cxl-dram", 6 * MiB),
                                               (str(PID), "", "dram", 10 * MiB)]
    assert snap.node_bytes == {"0": ("dram", 10 * MiB), "1": ("cxl-dram", 6 * MiB)}


def test_migration_directions_follow_tier_ranks():
    tiers = {0: Tier.DRAM, 1: Tier.CXL_DRAM, 2: Tier.PMEM, 3: Tier.DRAM}
    assert metrics.direction(1, 0, tiers) == "promote"
    assert metrics.direction(0, 2, tiers) == "demote"
    assert metrics.direction(0, 3, tiers) == "lateral"
    assert metrics.direction(-1, 0, tiers) == "unknown"


def test_regions_heat_and_processes_say_how_many_blocks_are_shared(daemon):
    """A memfd range of this process whose first two blocks a forked child has written too,
    registered as a shim registers its memfd pools; the sharing scan (tieringd/daemon/sharing.py)
    learns who maps what, and every report says it."""
    import ctypes
    import os
    import socket
    import time
    from tieringd.daemon.sharing import SharingConfig, SharingScanner
    from tieringd.shim import protocol as P
    fd = os.memfd_create("tieringd-kv")
    os.ftruncate(fd, 6 * BLOCK_BYTES)
    buf = mmap.mmap(fd, 6 * BLOCK_BYTES, flags=mmap.MAP_SHARED)
    os.close(fd)
    start = (ctypes.addressof(ctypes.c_char.from_buffer(buf)) + BLOCK_BYTES - 1) & ~(BLOCK_BYTES - 1)
    off = start - ctypes.addressof(ctypes.c_char.from_buffer(buf))
    buf[off:off + 4 * BLOCK_BYTES] = os.urandom(4 * BLOCK_BYTES)
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    child = os.fork()
    if child == 0:
        for i in range(off, off + 2 * BLOCK_BYTES, 4096):
            buf[i] = buf[i]
        os.write(ready_w, b"x")
        os.read(done_r, 1)
        os._exit(0)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        os.read(ready_r, 1)
        daemon.registry.start()
        sock.connect(daemon.registry.path)
        for seq, msg in enumerate([P.Hello(pid=os.getpid(), min_bytes=4 * MiB, policy=P.Policy.FAST, agent="test"),
                                   P.Register(region_id=1, start=start, length=4 * BLOCK_BYTES,
                                              flags=P.Flag.MEMFD, policy=P.Policy.FAST,
                                              source=P.Source.MMAP)], 1):
            msg.seq = seq
            sock.send(msg.encode())
        deadline = time.monotonic() + 5
        while not daemon.registry.regions(os.getpid()) and time.monotonic() < deadline:
            daemon.registry.poll(0.05)
        daemon.tick()
        SharingScanner(SharingConfig(hash_pages_per_tick=0), daemon.table).tick()
        (region,) = reports.regions(daemon, os.getpid())["regions"]
        assert region["shared_blocks"] == 2 and region["max_sharers"] == 2 and region["blocks"] == 4
        assert reports.heat(daemon, os.getpid())["blocks"]["sharers"] == [2, 2, 1, 1]
        mine = next(p for p in reports.processes(daemon)["processes"] if p["pid"] == os.getpid())
        assert mine["shared_blocks"] == 2 and mine["max_sharers"] == 2
        other = next(p for p in reports.processes(daemon)["processes"] if p["pid"] == PID)
        assert other["shared_blocks"] == 0 and other["max_sharers"] == 1
    finally:
        sock.close()
        os.write(done_w, b"x")
        os.waitpid(child, 0)
        daemon.registry.close()
