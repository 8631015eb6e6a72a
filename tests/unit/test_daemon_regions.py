# SPDX-License-Identifier: Apache-2.0
"""The region book (tieringd/daemon/regions.py): one registry event fans out to the tracked set, the
block table and the access signal's binds, and every sequence of events — resets, resyncs, exits, a
daemon restart — converges on the registry's own table. Real TrackedSet, BlockTable and AccessSignal
(the 6.12 lab facts); the nodes blocks are on are the input, as a move_pages query would give them."""
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from tieringd.sampling import access_signal as sig
from tieringd.kernel import knobs
from tieringd.shim import protocol as P
from tieringd.placement.blocksize import BlockSizer
from tieringd.contracts import LANDED_DTYPE, Tier
from tieringd.daemon import regions
from tieringd.daemon.regions import Book
from tieringd.placement.blocktable import FLAG_ABSENT
from tieringd.placement.heat import BlockTable
from tieringd.sampling import TrackedSet

MiB = 1 << 20
FACTS = Path(__file__).resolve().parents[1] / "fixtures" / "access_signal" / "cxl-6.12.json"
TIER_OF = np.array([int(Tier.DRAM), int(Tier.CXL_DRAM)] + [int(Tier.CXL_DRAM)] * 14, np.int8)


class Memory:
    """Where each page is, as a query would answer: -1 for pages nobody touched yet."""

    def __init__(self):
        self.node: dict[tuple[int, int], int] = {}

    def put(self, pid, start, length, node, step=4096):
        for a in range(start, start + length, step):
            self.node[(pid, a)] = node

    def locate(self, pid, addrs):
        return np.array([self.node.get((pid, int(a)), -1) for a in addrs], np.int64)


class Clock:
    t = 1000.0

    def __call__(self):
        return self.t


@pytest.fixture
def world(tmp_path):
    signal = sig.AccessSignal(sig.choose(sig.Facts.from_dict(json.loads(FACTS.read_text()))),
                              knobs.Knobs(tmp_path / "knobs.json"))
    mem, clock, sent = Memory(), Clock(), []
    book = Book(BlockTable(), TrackedSet(), BlockSizer(kv_bytes_per_token=128 << 10, small_tokens=16),
                tier_of_node=lambda n: TIER_OF[np.asarray(n)], fast_node=0, locate=mem.locate,
                place=signal.blocks_placed,
                forget=lambda pid, start: signal.process_exited(pid) if start is None
                else signal.region_removed(pid, start),
                bind=sent.extend, clock=clock)
    return dataclasses.make_dataclass("W", ["book", "mem", "signal", "sent", "clock"])(
        book, mem, signal, sent, clock)


def reg(pid, start, length, flags=(), policy="fast", node=-1, region_id=1):
    return {"pid": pid, "start": start, "length": length, "flags": list(flags), "policy": policy,
            "source": "malloc", "node": node, "tag": "", "region_id": region_id}


def consistent(w, expected: set[tuple[int, int, int]]):
    """Book, tracked set and table hold exactly ``expected`` (pid, start, length)."""
    book = {(r.pid, r.start, r.length) for r in w.book}
    tracked = {(t.pid, t.start, t.length) for t in w.book.tracked.ranges()}
    t = w.book.table
    live = np.flatnonzero(t.r_live[:t.nregions])
    table = {(int(t.r_pid[i]), int(t.r_start[i]), int(t.r_length[i])) for i in live}
    assert book == tracked == table == expected
    for r in w.book:           # ids re-derived after compaction
        assert (int(t.r_pid[r.rid]), int(t.r_start[r.rid])) == r.key


def test_a_region_enters_where_its_blocks_really_are_and_is_bound_there(world):
    w = world
    a = 0x7f0000000000
    w.mem.put(100, a, 6 * MiB, 0)                    # blocks 0-2 on node 0
    w.mem.put(100, a + 6 * MiB, 4 * MiB, 1)          # blocks 3-4 on node 1, block 5+ untouched
    w.book.apply("register", reg(100, a, 16 * MiB))
    r = w.book.get(100, a)
    assert r.block_bytes == 2 * MiB and r.nblocks == 8
    rows = w.book.table.region_slice(r.rid)
    assert w.book.table.node[rows].tolist() == [0, 0, 0, 1, 1, 0, 0, 0]   # untouched: the placement
    assert r.unpopulated.tolist() == [False] * 5 + [True] * 3
    assert w.book.table.tier[rows].tolist()[:5] == [1, 1, 1, 2, 2]
    assert w.sent == [sig.Bind(100, a, 6 * MiB, 0), sig.Bind(100, a + 6 * MiB, 4 * MiB, 1)]
    assert w.book.tracked.ranges(100)[0].block_len == 2 * MiB


def test_unpopulated_blocks_are_bound_once_they_are_touched(world):
    w = world
    a = 0x7f0000000000
    w.book.apply("register", reg(100, a, 8 * MiB, node=1))
    r = w.book.get(100, a)
    t, rows = w.book.table, w.book.table.region_slice(r.rid)
    assert r.unpopulated.all() and w.sent == []
    assert t.node[rows].tolist() == [1] * 4                  # the shim's node
    assert t.absent_blocks == 4 and (t.flags[rows] & FLAG_ABSENT).all()   # never planned
    assert (t.moved_ms[rows] == 0).all()                     # being found is not a move
    w.mem.put(100, a + 2 * MiB, 2 * MiB, 0)
    w.book.requery_unpopulated()
    assert r.unpopulated.tolist() == [True, False, True, True]
    assert ((t.flags[rows] & FLAG_ABSENT) != 0).tolist() == r.unpopulated.tolist()
    assert w.sent == [sig.Bind(100, a + 2 * MiB, 2 * MiB, 0)]
    w.mem.put(100, a, 2 * MiB, 1)
    w.book.requery_unpopulated()                   # asked again only every REQUERY_S
    assert r.unpopulated[0]
    w.clock.t += regions.REQUERY_S
    w.book.requery_unpopulated()
    assert r.unpopulated.tolist() == [False, False, True, True]
    assert w.sent[-1] == sig.Bind(100, a, 2 * MiB, 1)
    assert t.absent_blocks == 2


def test_pinning_updates_the_table_and_a_foreign_rebind_requeries(world):
    w = world
    a = 0x7f0000000000
    w.mem.put(100, a, 4 * MiB, 0)
    w.book.apply("register", reg(100, a, 4 * MiB))
    r = w.book.get(100, a)
    w.book.apply("update", reg(100, a, 4 * MiB, flags=["pinned"]))
    assert w.book.table.pinned_blocks == 2
    w.book.apply("update", reg(100, a, 4 * MiB, flags=["pinned"], policy="bind"))   # our own bind
    assert len(w.sent) == 1
    w.mem.put(100, a, 4 * MiB, 1)                  # cudaHostRegister moved it to its pinned policy
    w.book.apply("update", reg(100, a, 4 * MiB, flags=["pinned"], policy="weighted"))
    assert w.book.table.node[w.book.table.region_slice(r.rid)].tolist() == [1, 1]
    assert w.sent[-1] == sig.Bind(100, a, 4 * MiB, 1)
    assert r.placed_policy == P.Policy.WEIGHTED


def test_events_converge_on_the_registry_table(world):
    w = world
    a, b, c = 0x7f0000000000, 0x7f0040000000, 0x7f0080000000
    for start in (a, b, c):
        w.mem.put(100, start, 8 * MiB, 0)
    w.mem.put(200, a, 8 * MiB, 1)
    w.book.apply("hello", {"pid": 100})
    w.book.apply("register", reg(100, a, 8 * MiB))
    w.book.apply("register", reg(100, b, 8 * MiB, region_id=2))
    w.book.apply("register", reg(200, a, 8 * MiB))
    consistent(w, {(100, a, 8 * MiB), (100, b, 8 * MiB), (200, a, 8 * MiB)})
    w.book.apply("unregister", {"pid": 100, "start": b, "length": 8 * MiB})
    consistent(w, {(100, a, 8 * MiB), (200, a, 8 * MiB)})
    # a resync: RESET, then the shim's whole table again (a came back, c is new, b stays gone)
    w.book.table.ingest_blocks(np.array([w.book.table.region_slice(w.book.get(100, a).rid).start]),
                               np.array([5.0]), 10)
    w.book.apply("reset", {"pid": 100, "dropped": 1})
    w.book.apply("register", reg(100, a, 8 * MiB))
    w.book.apply("register", reg(100, c, 8 * MiB, region_id=3))
    w.clock.t += regions.RESET_GRACE_S
    w.book.sweep()
    consistent(w, {(100, a, 8 * MiB), (100, c, 8 * MiB), (200, a, 8 * MiB)})
    first = w.book.table.region_slice(w.book.get(100, a).rid).start
    assert w.book.table.freq[first] == 5.0       # revived as it was: its heat kept
    w.book.apply("exit", {"pid": 200, "why": "connection closed", "dropped": 1})
    consistent(w, {(100, a, 8 * MiB), (100, c, 8 * MiB)})
    assert 200 not in w.book.tracked and w.book.exits[-1]["pid"] == 200
    assert not [k for k in w.signal._regions if k[0] == 200]


def test_a_region_a_reset_left_behind_is_dropped_after_the_grace(world):
    w = world
    a = 0x7f0000000000
    w.mem.put(100, a, 4 * MiB, 0)
    w.book.apply("register", reg(100, a, 4 * MiB))
    w.book.apply("reset", {"pid": 100, "dropped": 1})
    assert w.book.sweep() == 0 and len(w.book) == 1
    w.clock.t += regions.RESET_GRACE_S
    assert w.book.sweep() == 1
    consistent(w, set())


def test_a_restarted_book_learns_the_same_table_from_the_resent_registrations(world, tmp_path):
    w = world
    events = [("hello", {"pid": 100}), ("reset", {"pid": 100, "dropped": 0})]
    starts = [0x7f0000000000 + i * (64 * MiB) for i in range(5)]
    for i, s in enumerate(starts):
        w.mem.put(100, s, 8 * MiB, i % 2)
        events.append(("register", reg(100, s, 8 * MiB, region_id=i + 1)))
    for kind, data in events:
        w.book.apply(kind, data)
    nodes_before = {r.key: w.book.table.node[w.book.table.region_slice(r.rid)].tolist() for r in w.book}
    fresh = Book(BlockTable(), TrackedSet(), w.book.sizer, tier_of_node=w.book.tier_of_node,
                 fast_node=0, locate=w.mem.locate, place=lambda *a: [], forget=lambda *a: None,
                 bind=lambda b: None)
    for kind, data in events:
        fresh.apply(kind, data)
    assert {r.key: fresh.table.node[fresh.table.region_slice(r.rid)].tolist() for r in fresh} == nodes_before


def test_many_registrations_and_removals_keep_table_ids_right_through_compaction(world):
    w = world
    rng = np.random.default_rng(1)
    live: set[tuple[int, int, int]] = set()
    for step in range(200):
        start = 0x7f0000000000 + int(rng.integers(0, 40)) * (16 * MiB)
        key = (100, start, 4 * MiB)
        if key in live:
            w.book.apply("unregister", {"pid": 100, "start": start, "length": 4 * MiB})
            live.discard(key)
        else:
            w.mem.put(100, start, 4 * MiB, int(rng.integers(0, 2)), step=2 * MiB)
            w.book.apply("register", reg(100, start, 4 * MiB))
            live.add(key)
    consistent(w, live)
    for r in w.book:
        rows = w.book.table.region_slice(r.rid)
        assert w.book.table.node[rows].tolist() == w.mem.locate(100, r.first_pages()).tolist()


def test_landed_rows_move_blocks_in_the_table_and_rebind_them(world):
    w = world
    a = 0x7f0000000000
    w.mem.put(100, a, 8 * MiB, 1)
    w.book.apply("register", reg(100, a, 8 * MiB))
    w.sent.clear()
    rows = np.zeros(2, LANDED_DTYPE)
    rows[0] = (100, a, 512, 0)                     # block 0 promoted
    rows[1] = (100, a + 2 * MiB, 512, 1)           # block 1 refused, stayed
    got = w.book.apply_landed(rows)
    r = w.book.get(100, a)
    assert w.book.table.node[w.book.table.region_slice(r.rid)].tolist() == [0, 1, 1, 1]
    assert got.promoted_bytes == 2 * MiB and got.demoted_bytes == 0 and got.blocks == 2
    assert w.sent == []                            # rebound once per tick
    w.book.flush_binds()
    assert w.sent == [sig.Bind(100, a, 2 * MiB, 0)]
    rows = np.zeros(1, LANDED_DTYPE)
    rows[0] = (100, a, 512, 1)
    assert w.book.apply_landed(rows).demoted_bytes == 2 * MiB


def test_a_landed_block_is_populated_and_its_move_starts_its_residency(world):
    w = world
    a = 0x7f0000000000
    w.book.apply("register", reg(100, a, 4 * MiB, node=1))        # nothing populated yet
    r = w.book.get(100, a)
    t, rows = w.book.table, w.book.table.region_slice(r.rid)
    assert t.absent_blocks == 2
    landed = np.zeros(1, LANDED_DTYPE)
    landed[0] = (100, a, 512, 0)                   # block 0 moved (it had been touched meanwhile)
    w.book.apply_landed(landed)
    assert r.unpopulated.tolist() == [False, True] and t.absent_blocks == 1
    assert ((t.flags[rows] & FLAG_ABSENT) != 0).tolist() == [False, True]
    assert t.moved_ms[rows][0] > 0 and t.moved_ms[rows][1] == 0


def test_landed_rows_of_a_region_that_left_are_ignored(world):
    w = world
    rows = np.zeros(1, LANDED_DTYPE)
    rows[0] = (100, 0x7f0000000000, 512, 0)
    assert w.book.apply_landed(rows).blocks == 0


def test_a_small_region_is_one_block_of_its_own_length(world):
    w = world
    a = 0x7f0000000000
    w.mem.put(100, a, 1 * MiB, 0)
    w.book.apply("register", reg(100, a, 1 * MiB))
    r = w.book.get(100, a)
    assert r.nblocks == 1 and r.block_bytes == 1 * MiB


def test_a_region_just_populated_is_warming_up_until_the_signal_could_see_it(world):
    w = world
    a = 0x7f0000000000
    w.book.apply("register", reg(100, a, 4 * MiB))
    r = w.book.get(100, a)
    w.clock.t += regions.WARMUP_S                    # nothing populated: nothing to see yet
    w.mem.put(100, a, 4 * MiB, 0)
    w.clock.t += regions.REQUERY_S
    w.book.requery_unpopulated()
    assert w.book.warming_up(r) and w.book.warming_up(r, a, 2 * MiB)
    w.clock.t += regions.WARMUP_S
    assert not w.book.warming_up(r) and not w.book.warming_up(r, a, 2 * MiB)


def test_blocks_filled_long_ago_may_leave_while_the_newest_are_still_warming_up(world):
    """A pool that fills with its traffic: its first blocks are past their warm-up while the last
    are being written; only the moves that touch the new ones wait."""
    w = world
    a = 0x7f0000000000
    w.book.apply("register", reg(100, a, 4 * MiB))
    r = w.book.get(100, a)
    w.mem.put(100, a, 2 * MiB, 0)
    w.clock.t += regions.REQUERY_S
    w.book.requery_unpopulated()
    w.clock.t += regions.WARMUP_S
    w.mem.put(100, a + 2 * MiB, 2 * MiB, 0)
    w.clock.t += regions.REQUERY_S
    w.book.requery_unpopulated()
    assert w.book.warming_up(r)                                    # the region as a whole: yes
    assert not w.book.warming_up(r, a, 2 * MiB)                    # its first blocks: no
    assert w.book.warming_up(r, a + MiB, 2 * MiB)                  # a move over old and new: yes
    assert w.book.ready_bytes(r, a, 4 * MiB, demote=True) == 2 * MiB   # its settled part may go
    assert w.book.ready_bytes(r, a, 4 * MiB, demote=False) == 4 * MiB  # a promotion waits for nothing


# ---- population faults ---------------------------------------------------------------------------
# A KV pool registers before it is written: the fault sampler sees every block's first touch, and a
# first-touch fault cannot be told from a hint fault by its error code. The book drops the faults of
# blocks it had not found populated (regions.POPULATION_GRACE_S) so a pool filled once is not "hot".

def fault_rows(pid, block_starts, t_s, block_len=2 * MiB):
    from tieringd.contracts import ACCESS_DELTA_DTYPE, SampleSource
    out = np.zeros(len(block_starts), ACCESS_DELTA_DTYPE)
    out["pid"], out["block_start"], out["block_len"] = pid, block_starts, block_len
    out["count"], out["source"] = 1, int(SampleSource.FAULT)
    out["last_seen_ns"] = np.asarray(np.broadcast_to(t_s, len(out)), np.float64) * 1e9
    return out


def test_faults_before_or_just_after_a_block_is_found_populated_are_its_population(world):
    w = world
    a = 0x7f0000000000
    w.book.apply("register", reg(100, a, 8 * MiB))
    r = w.book.get(100, a)
    w.mem.put(100, a, 4 * MiB, 0)                        # blocks 0-1 filled: their first touch
    fill = fault_rows(100, [a, a + 2 * MiB], w.clock.t + 0.1)
    assert w.book.population_faults(fill).all()          # not found populated yet
    w.clock.t += regions.REQUERY_S
    w.book.requery_unpopulated()
    assert r.unpopulated.tolist() == [False, False, True, True]
    assert w.book.population_faults(fill).all()          # older than the query that found them
    straggler = fault_rows(100, [a + 2 * MiB], w.clock.t + 0.1)   # the rest of a block's fill
    assert w.book.population_faults(straggler).all()
    later = w.clock.t + regions.POPULATION_GRACE_S
    hint = fault_rows(100, [a, a + 2 * MiB, a + 4 * MiB], later)
    assert w.book.population_faults(hint).tolist() == [False, False, True]   # block 2: unpopulated
    assert r.as_dict()["population_faults"] == 2 + 2 + 1 + 1
    from tieringd.contracts import SampleSource
    pmu = hint.copy()
    pmu["source"] = int(SampleSource.PMU)                # only faults can be a population
    assert not w.book.population_faults(pmu).any()
    for addr in range(a, a + 2 * MiB, 4096):           # block 0 dropped (MADV_DONTNEED) …
        del w.mem.node[(100, addr)]
    w.book.requery(r, np.array([0]))
    assert r.unpopulated[0]
    refill = fault_rows(100, [a], w.clock.t + 10)      # … and written again: a population again
    assert w.book.population_faults(refill).all()


def test_a_block_filled_once_and_never_read_does_not_displace_a_read_one(tmp_path):
    """The lab's front layout in miniature, through the daemon's own heat and policy settings: the
    fill puts blocks 0-3 on the fast node (0-1 the hot set, 2-3 idle requests; the node 80 % used)
    and blocks 4-7 on the slow one, and only blocks 0-1 are read again. With the fill's faults
    taken as accesses the late-filled blocks outrank the idle ones and swap with them (what the lab
    measured, docs/loop.md); without them no block on the slow node was ever accessed: no move."""
    from tieringd.sampling import touches
    from tieringd.settings import Settings
    from tieringd.placement.plan import TierSpec
    from tieringd.placement.policy import Policy
    from tieringd.config import ConfigFile

    def run(drop_population: bool):
        s = Settings.from_config(ConfigFile())          # the daemon's defaults
        mem, clock = Memory(), Clock()
        table = BlockTable(s.heat, epoch_ns=int(clock.t * 1e9))
        book = Book(table, TrackedSet(), BlockSizer(kv_bytes_per_token=128 << 10, small_tokens=16),
                    tier_of_node=lambda n: TIER_OF[np.asarray(n)], fast_node=0, locate=mem.locate,
                    place=lambda *a: [], forget=lambda *a: None, bind=lambda b: None, clock=clock)
        a = 0x7f0000000000
        book.apply("register", reg(100, a, 16 * MiB))
        r = book.get(100, a)
        blocks = a + np.arange(8, dtype=np.uint64) * np.uint64(2 * MiB)

        def ingest(rows):
            if drop_population:
                rows = rows[~book.population_faults(rows)]
            table.ingest(touches(rows))

        for i in range(8):                     # the fill: one block every 0.2 s, in order
            mem.put(100, int(blocks[i]), 2 * MiB, 0 if i < 4 else 1)
            ingest(fault_rows(100, blocks[i:i + 1], clock.t))
            clock.t += 0.2
            book.requery_unpopulated()
        clock.t += regions.REQUERY_S
        book.requery_unpopulated()
        assert not r.unpopulated.any()
        for _ in range(20):                    # decode: the hot set, seen every scan pass
            clock.t += 0.5
            ingest(fault_rows(100, blocks[:2], clock.t))
        fast = TierSpec(Tier.DRAM, (0,), 10 * MiB)     # 4 blocks: 80 %, no pressure
        slow = TierSpec(Tier.CXL_DRAM, (1,), 1 << 40)
        plan = Policy(s.policy, [fast, slow]).tick(table, now_ns=int(clock.t * 1e9),
                                                   budget_bytes=1 << 40)
        first = table.region_slice(r.rid).start
        moved = {int(b) - first: Tier(int(t)) for b, t in zip(plan.blocks, plan.to_tier)}
        return ({b for b, t in moved.items() if t == Tier.DRAM},
                {b for b, t in moved.items() if t != Tier.DRAM})

    promoted, demoted = run(drop_population=False)     # the fill's faults taken as accesses:
    assert promoted and promoted <= {4, 5, 6, 7}        # late-filled blocks up,
    assert demoted and demoted <= {2, 3}                # the idle requests' blocks down
    assert run(drop_population=True) == (set(), set())  # population dropped: nothing moves


def test_untouched_regions_are_asked_about_round_by_round_and_every_one_is_found_once_touched(world, monkeypatch):
    # 40 regions nobody touched; then all of them are: with no time to spare a round asks about the
    # minimum of regions, and the next round goes on where the last stopped (no region waits forever)
    monkeypatch.setattr(regions, "REQUERY_BUDGET_S", 0.0)
    w = world
    starts = [0x7f0000000000 + i * (16 * MiB) for i in range(40)]
    for s in starts:
        w.book.apply("register", reg(100, s, 4 * MiB))
    assert all(r.unpopulated.all() for r in w.book)
    for s in starts:
        w.mem.put(100, s, 4 * MiB, 1, step=2 * MiB)
    found = []
    for _ in range(3):
        w.clock.t += regions.REQUERY_S
        w.book.requery_unpopulated()
        found.append(sum(1 for r in w.book if not r.unpopulated.any()))
    assert found == [regions.REQUERY_MIN_REGIONS, 2 * regions.REQUERY_MIN_REGIONS, 40]
