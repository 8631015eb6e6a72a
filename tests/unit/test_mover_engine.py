# SPDX-License-Identifier: Apache-2.0
"""The migration engine (tieringd/mover/engine.py) — coalescing, batching, budgets, priorities, the
bounded queue, the fallback map, the accounting of move_pages status arrays and the placement it
reports — against a simulated kernel (the ``Kernel`` seam) that follows mm/migrate.c's reporting rules
(partial status after a positive return, ENOMEM for a full target, THP folios moving whole). Real pages
moving between real nodes are proven in tests/lab/test_mover_lab.py."""
import errno
import threading

import numpy as np
import pytest

from tieringd import mover
from tieringd.kernel import numa
from tieringd.config import ConfigError
from tieringd.contracts import FallbackMap, Move, Priority, Tier

PS = numa.PAGE_SIZE
HP = numa.HPAGE_PMD_SIZE
BASE = 0x7F0000000000


class SimKernel(mover.Kernel):
    """Pages of pids on nodes, node capacities, pinned pages, THP blocks — and a call log."""

    def __init__(self, nodes=(0, 1, 2)):
        self.nodes = set(nodes)
        self.free = {n: 10**9 for n in nodes}
        self.pages: dict[int, dict[int, int]] = {}   # pid -> addr -> node
        self.pinned: set[int] = set()
        self.busy_once: set[int] = set()               # refused on the first try only
        self.thp_blocks: set[int] = set()              # 2 MiB-aligned starts
        self.calls: list[tuple] = []
        self.queried: list[int] = []
        self.exit_after_calls: dict[int, int] = {}     # pid -> exit after this many move calls
        self.gate: dict[int, threading.Event] = {}

    def populate(self, pid, start, npages, node=0):
        d = self.pages.setdefault(pid, {})
        for i in range(npages):
            d[start + i * PS] = node

    def _proc(self, pid):
        if pid not in self.pages:
            raise numa.ProcessGoneError(errno.ESRCH, f"move_pages(pid={pid}): no such process", "move_pages")
        return self.pages[pid]

    def query(self, pid, addrs):
        self.queried.append(len(addrs))
        d = self._proc(pid)
        return np.array([d.get(int(a), -errno.ENOENT) for a in addrs], dtype=np.int32)

    def _folio(self, addr):
        head = addr - addr % HP
        return [head + i * PS for i in range(HP // PS)] if head in self.thp_blocks else [addr]

    def move(self, pid, addrs, node, flags):
        if pid in self.gate:
            self.gate[pid].wait(10)
        d = self._proc(pid)
        if node not in self.nodes:
            raise numa.NodeUnavailableError(errno.ENODEV, f"move_pages(pid={pid}): no node {node}", "move_pages")
        self.calls.append((pid, len(addrs), node))
        if pid in self.exit_after_calls:
            self.exit_after_calls[pid] -= 1
            if self.exit_after_calls[pid] < 0:
                del self.pages[pid]
                raise numa.ProcessGoneError(errno.ESRCH, "gone", "move_pages")
        status = np.full(len(addrs), numa.STATUS_UNREPORTED, dtype=np.int32)
        run: list[int] = []

        def flush(i):
            # migrate the queued run; on failure return the kernel's positive count, status unwritten
            failed = 0
            for j in run:
                for a in self._folio(int(addrs[j])):
                    if a in self.pinned or a in self.busy_once:
                        self.busy_once.discard(a)
                        failed += 1
                        break
                    if self.free[node] <= 0:
                        return -errno.ENOMEM
                    self.free[d[a]] += 1
                    self.free[node] -= 1
                    d[a] = node
            if failed:
                return failed + (len(addrs) - i)
            for j in run:
                status[j] = node
            run.clear()
            return 0

        for i, a in enumerate(addrs.tolist()):
            if a not in d:
                status[i] = -errno.ENOENT
            elif d[a] == node:
                status[i] = node
            else:
                run.append(i)
                continue
            rc = flush(i)
            if rc:
                return numa.BatchResult(status, error=-rc) if rc < 0 else numa.BatchResult(status, rc)
        rc = flush(len(addrs))
        if rc < 0:
            return numa.BatchResult(status, error=-rc)
        return numa.BatchResult(status, not_migrated=rc)

    def thp(self, pid, start, npages):
        a = start + np.arange(npages, dtype=np.int64) * PS
        return np.isin(a - a % HP, list(self.thp_blocks))

    def process_gone(self, pid):
        return pid not in self.pages


# node0 DRAM, node1 CXL DRAM, node2 PMem — what Topology.fallback_map() gives for the pmem lab profile
FALLBACKS = FallbackMap(chains={0: (1, 2), 1: (2,), 2: ()},
                        tiers={Tier.DRAM: (0,), Tier.CXL_DRAM: (1,), Tier.PMEM: (2,)})


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s


def engine(kernel, fallbacks=FALLBACKS, on_landed=None, **config):
    clk = Clock()
    e = mover.MigrationEngine(mover.MoverConfig(**config), fallbacks, kernel=kernel, clock=clk,
                              sleep=clk.sleep, on_landed=on_landed)
    e.clock = clk
    return e


def accounted(report):
    by = report.by_reason()
    assert sum(by.values()) == report.requested_pages, by
    return by


# ---- batching and accounting ------------------------------------------------------------------

def test_unaligned_thp_buffer_counts_every_page_moved_once():
    k = SimKernel()
    start = BASE + 100 * PS                    # as on 6.1: the mapping is not 2 MiB aligned
    k.populate(7, start, 3000)
    k.thp_blocks = {BASE + HP, BASE + 2 * HP, BASE + 3 * HP, BASE + 4 * HP, BASE + 5 * HP}
    e = engine(k, batch_pages=512)
    t = e.submit(mover.MoveRequest(7, [(start, 3000 * PS)], 1))
    c = e.run_until_idle()
    assert accounted(t.wait(0)) == {"moved": 3000}
    assert c.thp_pages_moved == 5 * 512


def test_batches_respect_the_page_count_and_every_page_is_accounted():
    k = SimKernel()
    k.populate(7, BASE, 1000)
    e = engine(k, batch_pages=128)
    t = e.submit(mover.MoveRequest(7, [(BASE, 1000 * PS)], 1, Priority.DEMOTE))
    c = e.run_until_idle()
    assert [n for _, n, _ in k.calls] == [128] * 7 + [104]
    assert set(k.pages[7].values()) == {1}
    rep = t.wait(0)
    assert accounted(rep) == {"moved": 1000}
    pair = c.pairs[(0, 1)]
    assert (pair.requested_pages, pair.moved_pages) == (1000, 1000)
    assert pair.to_dict()["moved_bytes"] == 1000 * PS
    assert c.moved_pages == 1000 and c.batches == 8


def test_status_reasons_absent_already_there_and_pinned_after_back_off():
    k = SimKernel()
    k.populate(7, BASE, 64, node=0)
    for i in range(8):                       # 8 pages already on the target
        k.pages[7][BASE + i * PS] = 1
    for i in range(60, 64):                  # 4 never touched
        del k.pages[7][BASE + i * PS]
    k.pinned = {BASE + 10 * PS, BASE + 11 * PS}
    k.busy_once = {BASE + 20 * PS}           # busy once, moves on the retry
    e = engine(k, batch_pages=64, max_retries=3, retry_backoff_s=0.1)
    t = e.submit(mover.MoveRequest(7, [(BASE, 64 * PS)], 1))
    c = e.run_until_idle()
    rep = t.wait(0)
    # 64 = 8 already there + 4 never touched + 52 to move, of which 2 are pinned
    assert accounted(rep) == {"moved": 50, "already-there": 8, "not-present": 4, "pinned": 2}
    assert sorted(rep.samples["pinned"]) == [BASE + 10 * PS, BASE + 11 * PS]
    assert k.pages[7][BASE + 10 * PS] == 0 and k.pages[7][BASE + 20 * PS] == 1
    # refused pages are retried max_retries times with doubling back-off: 0.1 + 0.2 + 0.4 s;
    # the busy page moves on the first retry, the pinned two never do
    assert c.retried_pages == 3 + 2 + 2
    assert e.clock.t == pytest.approx(0.7)
    assert c.pairs[(0, 1)].failed_pages == {"pinned": 2}
    assert c.pairs[(-1, 1)].failed_pages == {"not-present": 4}
    assert c.moved_pages == 50


def test_target_full_goes_to_the_fallback_chain_and_nothing_raises():
    k = SimKernel()
    k.populate(7, BASE, 1000, node=0)
    k.free[1] = 300
    e = engine(k, batch_pages=256)
    t = e.submit(mover.MoveRequest(7, [(BASE, 1000 * PS)], 1))
    c = e.run_until_idle()
    rep = t.wait(0)
    assert rep.fallbacks == [2]
    assert accounted(rep) == {"moved": 300, "fallback": 700}
    assert list(k.pages[7].values()).count(1) == 300 and list(k.pages[7].values()).count(2) == 700
    assert c.pairs[(0, 1)].failed_pages == {"target-full": 700}
    assert c.pairs[(0, 2)].moved_pages == 700
    assert c.moved_pages == 1000                     # what /proc/vmstat pgmigrate_success would show
    assert any(ev["event"] == "fallback" and ev["node"] == 2 for ev in e.events)


def test_target_full_without_fallback_is_reported_and_left_in_place():
    k = SimKernel()
    k.populate(7, BASE, 100, node=1)
    k.free[0] = 10
    e = engine(k, FallbackMap(chains={0: (), 1: (0,)}), batch_pages=64)     # node0 the slowest
    t = e.submit(mover.MoveRequest(7, [(BASE, 100 * PS)], 0, Priority.PROMOTE))
    e.run_until_idle()
    rep = t.wait(0)
    assert rep.fallbacks == [] and rep.error is None
    assert accounted(rep) == {"moved": 10, "target-full": 90}
    assert len(rep.samples["target-full"]) == 8


def test_thp_sent_once_counted_as_512_pages():
    k = SimKernel()
    k.populate(7, BASE, 2 * HP // PS + 10)
    k.thp_blocks = {BASE, BASE + HP}
    e = engine(k, batch_pages=2048)
    t = e.submit(mover.MoveRequest(7, [(BASE, 2 * HP + 10 * PS)], 1))
    c = e.run_until_idle()
    assert k.calls == [(7, 2 + 10, 1)]
    # queries ask a huge page's head only: before and after the move, 2 heads + 10 base pages each
    assert k.queried == [12, 12]
    assert accounted(t.wait(0)) == {"moved": 1024 + 10}
    assert c.thp_pages_moved == 1024 and t.report.counters.thp_pages_moved == 1024


# ---- scheduling ---------------------------------------------------------------------------------

def test_promotions_run_before_demotions():
    k = SimKernel()
    k.populate(1, BASE, 10, node=0)
    k.populate(2, BASE, 101, node=1)
    e = engine(k)
    e.submit(Move(1, BASE, 10 * PS, 0, 1, Priority.DEMOTE))
    e.submit(Move(2, BASE, 10 * PS, 1, 0, Priority.PREFETCH))
    e.submit(Move(2, BASE + 100 * PS, PS, 1, 0, Priority.PROMOTE))
    e.run_until_idle()
    assert k.calls == [(2, 1, 0), (2, 10, 0), (1, 10, 1)]


def test_demotion_budget_paces_batches_by_the_fake_clock():
    k = SimKernel()
    npages = 4096                                   # 16 MiB
    k.populate(7, BASE, npages)
    e = engine(k, batch_pages=256, demote_rate_mb_s=4)    # 4 MB/s, burst max(0.4 MB, 2 MiB) = 2 MiB
    t = e.submit(mover.MoveRequest(7, [(BASE, npages * PS)], 1))
    e.run_until_idle()
    assert accounted(t.wait(0)) == {"moved": npages}
    cap = e.demote_bucket.capacity_bytes
    # all but the initial burst paid at 4 MB/s; the last batch may leave the bucket in debt
    assert e.clock.t == pytest.approx((npages * PS - cap) / 4e6, abs=256 * PS / 4e6)
    # pages with nothing to do (already there, never touched) cost no budget
    t0 = e.clock.t
    e.submit(mover.MoveRequest(7, [(BASE, npages * PS), (BASE + 2 * npages * PS, npages * PS)], 1))
    e.run_until_idle()
    assert e.clock.t == pytest.approx(t0, abs=256 * PS / 4e6)
    # promotions have their own, unlimited budget: no wait
    k.populate(8, BASE, 256, node=1)
    t0 = e.clock.t
    e.submit(mover.MoveRequest(8, [(BASE, 256 * PS)], 0, Priority.PROMOTE))
    e.run_until_idle()
    assert e.clock.t == t0


def test_waiting_requests_for_the_same_thing_are_coalesced_into_one_job():
    k = SimKernel()
    k.populate(7, BASE, 64)
    e = engine(k, batch_pages=64)
    tickets = [e.submit(Move(7, BASE + i * 4 * PS, 4 * PS, 0, 1, Priority.DEMOTE)) for i in range(16)]
    e.run_until_idle()
    assert k.calls == [(7, 64, 1)]
    assert all(t.done() for t in tickets) and tickets[0].report is tickets[-1].report
    assert accounted(tickets[0].report) == {"moved": 64}


def test_bounded_queue_drops_the_oldest_lowest_priority_job_first():
    k = SimKernel()
    for pid in (1, 2, 3, 4, 5):
        k.populate(pid, BASE, 4)
    e = engine(k, max_queued=2)
    a = e.submit(Move(1, BASE, 4 * PS, 0, 1, Priority.DEMOTE))
    b = e.submit(Move(2, BASE, 4 * PS, 0, 1, Priority.PREFETCH))
    c = e.submit(Move(3, BASE, 4 * PS, 0, 1, Priority.DEMOTE))     # full: a (oldest demotion) goes
    d = e.submit(Move(4, BASE, 4 * PS, 0, 1, Priority.PROMOTE))    # full: c goes
    f = e.submit(Move(5, BASE, 4 * PS, 0, 1, Priority.DEMOTE))     # full: the newcomer is the lowest
    assert [x.report.dropped for x in (a, b, c, d, f)] == [True, False, True, False, True]
    assert a.done() and c.done() and f.done()
    counters = e.run_until_idle()
    assert counters.dropped_jobs == 3 and counters.dropped_pages == 12
    assert counters.dropped_by_priority == {"demote": 3}
    assert accounted(a.report) == {"dropped": 4}
    assert [pid for pid, _, _ in k.calls] == [4, 2]


def test_a_process_exiting_mid_move_is_reported_and_the_engine_carries_on():
    k = SimKernel()
    k.populate(7, BASE, 1000)
    k.populate(8, BASE, 100)
    k.exit_after_calls[7] = 2
    e = engine(k, batch_pages=100)
    t7 = e.submit(mover.MoveRequest(7, [(BASE, 1000 * PS)], 1))
    t8 = e.submit(mover.MoveRequest(8, [(BASE, 100 * PS)], 1))
    c = e.run_until_idle()
    r7, r8 = t7.wait(0), t8.wait(0)
    assert r7.process_exited and r7.error is None
    assert accounted(r7) == {"moved": 200, "process-exited": 800}
    assert accounted(r8) == {"moved": 100}
    assert c.processes_exited == 1
    assert any(ev["event"] == "process-exited" and ev["pid"] == 7 for ev in e.events)


def test_bad_targets_are_reported_not_raised():
    k = SimKernel()
    k.populate(7, BASE, 10)
    e = engine(k)
    t = e.submit(mover.MoveRequest(7, [(BASE, 10 * PS)], 9))
    e.run_until_idle()
    rep = t.wait(0)
    assert "no node 9" in rep.error and accounted(rep) == {"error": 10}
    t = e.submit(mover.MoveRequest(7, [(BASE, PS)], Tier.GPU_HBM))
    assert t.done() and "no node with memory in tier gpu-hbm" in t.report.error
    t = e.submit(mover.MoveRequest(7, [(BASE, PS)], Tier.CXL_DRAM))
    e.run_until_idle()
    assert t.wait(0).target == 1 and t.report.fallbacks == [2]


def test_worker_threads_keep_other_processes_moving_while_one_is_stuck():
    k = SimKernel()
    k.populate(7, BASE, 10)
    k.populate(8, BASE, 10)
    k.gate[7] = threading.Event()
    e = mover.MigrationEngine(mover.MoverConfig(workers=2), FALLBACKS, kernel=k)
    with e:
        t7 = e.submit(mover.MoveRequest(7, [(BASE, 10 * PS)], 1))
        t8 = e.submit(mover.MoveRequest(8, [(BASE, 10 * PS)], 1))
        assert accounted(t8.wait(10)) == {"moved": 10}
        assert not t7.done()
        k.gate[7].set()
        assert accounted(t7.wait(10)) == {"moved": 10}
        assert e.wait_idle(10)


# ---- verified placement -------------------------------------------------------------------------

def pages_of(rows):
    """LANDED_DTYPE rows → {(pid, page address): node}."""
    return {(int(r["pid"]), int(r["start"]) + i * PS): int(r["node"]) for r in rows for i in range(int(r["npages"]))}


def test_every_batch_hands_on_where_its_pages_landed():
    k = SimKernel()
    k.populate(7, BASE, 1000)
    for i in range(8):
        k.pages[7][BASE + i * PS] = 1                 # already there
    for i in range(60, 64):
        del k.pages[7][BASE + i * PS]                 # never touched: no node, not reported
    k.pinned = {BASE + 10 * PS}
    k.free[1] = 500
    got = []
    e = engine(k, on_landed=got.append, batch_pages=128)
    t = e.submit(mover.MoveRequest(7, [(BASE, 1000 * PS)], 1))
    e.run_until_idle()
    assert accounted(t.wait(0)) == {"moved": 500, "fallback": 487, "already-there": 8, "not-present": 4,
                                    "pinned": 1}
    # one call per batch (8) and per back-off retry of the pinned page (3), each the pages it handled
    assert len(got) == 8 + 3 and all(len(rows) and (rows["pid"] == 7).all() for rows in got)
    seen = {}
    for rows in got:
        seen.update(pages_of(rows))
    assert seen == {(7, a): n for a, n in k.pages[7].items()}          # the query is the authority
    final = t.report.landed()
    assert pages_of(final) == seen
    assert [(int(r["start"]), int(r["node"])) for r in final[:4]] == [
        (BASE, 1), (BASE + 10 * PS, 0), (BASE + 11 * PS, 1), (BASE + 64 * PS, 1)]


def test_a_huge_page_lands_whole_and_is_reported_page_by_page():
    k = SimKernel()
    k.populate(7, BASE, HP // PS + 10)
    k.thp_blocks = {BASE}
    got = []
    e = engine(k, on_landed=got.append, batch_pages=4096)
    t = e.submit(mover.MoveRequest(7, [(BASE, HP + 10 * PS)], 1))
    e.run_until_idle()
    assert k.queried == [11, 11]                      # heads only, tails take their head's node
    assert [(int(r["start"]), int(r["npages"]), int(r["node"])) for r in got[0]] == [(BASE, 512 + 10, 1)]
    assert pages_of(t.report.landed()) == pages_of(got[0])


def test_nothing_is_reported_for_a_process_that_exited():
    k = SimKernel()
    k.populate(7, BASE, 300)
    k.exit_after_calls[7] = 1
    got = []
    e = engine(k, on_landed=got.append, batch_pages=100)
    t = e.submit(mover.MoveRequest(7, [(BASE, 300 * PS)], 1))
    e.run_until_idle()
    assert accounted(t.wait(0)) == {"moved": 100, "process-exited": 200}
    assert [int(r["npages"]) for rows in got for r in rows] == [100]


# ---- the fallback map ---------------------------------------------------------------------------

def test_the_engine_never_looks_the_topology_up(monkeypatch):
    from tieringd.memory import topology

    def discover(*a, **kw):
        raise AssertionError("the mover called topology.discover()")
    monkeypatch.setattr(topology, "discover", discover)
    k = SimKernel()
    k.populate(7, BASE, 10)
    k.free[1] = 4
    e = engine(k, fallbacks=None)            # no map: no fallbacks, no tier targets
    t = e.submit(mover.MoveRequest(7, [(BASE, 10 * PS)], 1))
    bad = e.submit(mover.MoveRequest(7, [(BASE, PS)], Tier.CXL_DRAM))
    e.run_until_idle()
    assert t.report.fallbacks == [] and accounted(t.report) == {"moved": 4, "target-full": 6}
    assert "no node with memory in tier cxl-dram" in bad.report.error


def test_a_new_fallback_map_applies_to_queued_jobs_and_new_requests():
    k = SimKernel(nodes=(0, 1, 2, 3))
    k.populate(7, BASE, 100)
    k.populate(8, BASE, 100)
    k.free[1] = 0
    e = engine(k, batch_pages=50)
    queued = e.submit(mover.MoveRequest(7, [(BASE, 100 * PS)], 1))
    assert queued.report.fallbacks == [2]
    # memory hot-plug: a new CXL node 3 comes online, nearer node 1 than the PMem node
    e.set_fallbacks(FallbackMap(chains={0: (1, 3, 2), 1: (3, 2), 2: (), 3: (1, 2)},
                                tiers={Tier.DRAM: (0,), Tier.CXL_DRAM: (1, 3), Tier.PMEM: (2,)}))
    by_tier = e.submit(mover.MoveRequest(8, [(BASE, 100 * PS)], Tier.CXL_DRAM))
    e.run_until_idle()
    assert queued.report.fallbacks == [3, 2] and by_tier.report.fallbacks == [3, 2]
    for t, pid in ((queued, 7), (by_tier, 8)):
        assert accounted(t.wait(0)) == {"fallback": 100}
        assert set(k.pages[pid].values()) == {3}
    assert e.fallbacks.tiers[Tier.CXL_DRAM] == (1, 3)


def test_a_fallback_node_that_fails_ends_the_job_and_every_page_is_counted_once():
    k = SimKernel()                           # node 5 is in the map but not in the machine
    k.populate(7, BASE, 300)
    k.free[1] = 100
    k.pinned = {BASE + 10 * PS}
    e = engine(k, FallbackMap(chains={1: (5, 2)}), batch_pages=50, full_backoff_s=0)
    t = e.submit(mover.MoveRequest(7, [(BASE, 300 * PS)], 1))
    e.run_until_idle()
    rep = t.wait(0)
    assert "no node 5" in rep.error
    # batches 1-2 fill node 1 (page 10 is refused, retried, pinned); batch 3 overflows, the fallback
    # call fails as a whole: the job ends there, and the 150 pages it never reached count as errors
    assert accounted(rep) == {"moved": 100, "target-full": 49, "pinned": 1, "error": 150}
    assert list(k.pages[7].values()).count(1) == 100


def test_engine_from_config_validates_the_mover_table():
    e = mover.MigrationEngine.from_config({"batch_pages": 1024, "demote_rate_mb_s": 500,
                                                     "detect_thp": False}, FALLBACKS)
    assert e.config.batch_pages == 1024 and e.demote_bucket.rate_mb_s == 500 and e.promote_bucket.unlimited
    assert not e.config.detect_thp
    assert mover.MoverConfig.from_config({}).batch_pages == 4096
    for bad, msg in [({"batch_pages": 0}, r"\[mover\] batch_pages: expected an integer in \[1, 1048576\], got 0"),
                     ({"batch_pages": 1.5}, r"\[mover\] batch_pages: expected an integer, got 1.5"),
                     ({"demote_rate_mb_s": -1}, r"demote_rate_mb_s: expected a number in \[0, 1000000\], got -1"),
                     ({"detect_thp": 1}, r"detect_thp: expected true or false, got 1"),
                     ({"speed": 1}, r"\[mover\] speed: unknown key")]:
        with pytest.raises(ConfigError, match=msg):
            mover.MigrationEngine.from_config(bad, FALLBACKS)
