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
