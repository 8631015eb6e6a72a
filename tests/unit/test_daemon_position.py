# SPDX-License-Identifier: Apache-2.0
"""Which regions are laid out in token order, read from where they are written
(tieringd/daemon/position.py), and the frontier that gives the heat's position factor.

``Layout`` is pure logic on the blocks written per interval; ``Positions`` on delta rows and their
write counts (as ``SamplerSet.read_deltas`` leaves them) against a real region book and block table."""
from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np
import pytest

from tieringd.contracts import ACCESS_DELTA_DTYPE, SampleSource, Tier
from tieringd.daemon import position as pos
from tieringd.daemon.position import Layout, Positions, places_of
from tieringd.daemon.regions import Book
from tieringd.kernel import knobs
from tieringd.placement.blocksize import BlockSizer
from tieringd.placement.heat import BlockTable, HeatConfig
from tieringd.sampling import TrackedSet
from tieringd.sampling import access_signal as sig

KiB, MiB = 1 << 10, 1 << 20
FACTS = Path(__file__).resolve().parents[1] / "fixtures" / "access_signal" / "cxl-6.12.json"
TIER_OF = np.array([int(Tier.DRAM), int(Tier.CXL_DRAM)] + [int(Tier.CXL_DRAM)] * 14, np.int8)


def decode(layout: Layout, tops, width: int = 1) -> None:
    """One interval per top: the ``width`` blocks up to it written."""
    for t in tops:
        layout.note(np.arange(t - width + 1, t + 1))


# ---- Layout: the rule ------------------------------------------------------------------------------

def test_places_are_runs_of_written_blocks_with_small_gaps():
    assert places_of(np.array([], np.int64)) == 0
    assert places_of(np.array([5])) == 1
    assert places_of(np.array([5, 6, 8, 11])) == 1            # two unwritten between: one place
    assert places_of(np.array([5, 6, 10, 11])) == 2          # three unwritten: two places
    assert places_of(np.array([0, 40, 80, 120])) == 4


def test_a_decoder_appending_in_one_place_is_token_order_with_its_frontier_at_the_top():
    lay = Layout()
    assert lay.verdict() == ("unseen", "not seen written yet")
    decode(lay, [10, 10])
    assert lay.state == "learning"                # two intervals, and it has not advanced
    decode(lay, [11])
    assert lay.verdict() == ("on", "frontier block 11")
    decode(lay, [12, 14, 15], width=2)             # a token straddling two blocks; one unseen write
    assert lay.verdict() == ("on", "frontier block 15") and lay.frontier == 15


def test_one_place_that_never_advances_is_not_yet_token_order():
    lay = Layout()
    decode(lay, [7] * 6)
    state, why = lay.verdict()
    assert state == "learning" and "not advancing" in why


def test_the_frontiers_own_block_written_again_is_not_a_jump_back():
    lay = Layout()
    decode(lay, [3, 4, 5, 6, 5, 6, 4, 7])
    assert lay.verdict() == ("on", "frontier block 7")


def test_writes_in_many_places_at_once_are_a_pooled_layout():
    lay = Layout()
    decode(lay, [10, 11, 12])
    assert lay.state == "on"
    lay.note(np.arange(12) * 37)                   # twelve sequences appending in their own blocks
    assert lay.verdict() == ("off", "writes in 12 places (pooled layout)")


def test_two_sequences_appending_in_one_buffer_are_not_token_order():
    lay = Layout()
    for step in range(4):
        lay.note(np.array([10 + step // 2, 200 + step // 2]))
    state, why = lay.verdict()
    assert state == "off" and why.startswith("writes behind the frontier in 4 of the last 4")


def test_one_writer_jumping_about_a_pool_is_not_token_order():
    lay = Layout()
    decode(lay, [40, 41, 42, 7, 8, 90, 13])        # one sequence handed blocks from a free list
    state, why = lay.verdict()
    assert state == "off" and why.startswith("writes behind the frontier in 2 of the last")


def test_a_new_sequence_from_the_start_moves_the_frontier_back_and_stays_on():
    lay = Layout()
    decode(lay, [20, 21, 22, 23])
    decode(lay, [2, 3, 4])                         # the server reused the buffer for a new request
    assert lay.verdict() == ("on", "frontier block 4")


def test_the_old_sequences_last_writes_beside_the_new_ones_prompt_are_one_restart():
    lay = Layout()
    decode(lay, [100, 150, 200], width=8)          # a buffer cleared front to back
    lay.note(np.concatenate([np.arange(0, 48), np.arange(232, 256)]))    # its end, and a prompt
    decode(lay, [71, 79, 87], width=8)             # decoding from the prompt on
    assert lay.verdict() == ("on", "frontier block 87")
    assert sum(o.stray for o in lay.window) == 1


def test_a_pooled_spell_leaves_the_window_and_token_order_comes_back():
    lay = Layout()
    decode(lay, [1, 2, 3])
    lay.note(np.array([0, 20, 40, 60]))
    assert lay.state == "off"
    decode(lay, range(61, 61 + pos.WINDOW - 1))
    assert lay.state == "off"                      # the pooled interval is still in the window
    decode(lay, [61 + pos.WINDOW])
    assert lay.verdict() == ("on", f"frontier block {61 + pos.WINDOW}")


def test_a_huge_page_written_at_once_is_one_place():
    lay = Layout()
    for chunk in (0, 0, 1, 1, 2):                  # 32 blocks per 2 MiB: each write covers its chunk
        lay.note(np.arange(chunk * 32, chunk * 32 + 32))
    assert lay.verdict() == ("on", "frontier block 95")


def test_a_clear_read_out_of_order_forgets_the_frontier_until_the_decoder_writes():
    # 256 blocks zeroed at once; the sampler hands the first-touch faults out in map order across
    # reads, the last read behind the rest. The prefill then writes populated pages, unseen.
    lay = Layout(256)
    lay.note(np.arange(56, 88))
    lay.note(np.arange(88, 256))
    assert lay.state == "learning"
    lay.note(np.arange(0, 56))
    assert lay.verdict() == ("learning", "written whole (cleared): waiting for the decoder's writes")
    assert lay.frontier == -1
    for top in (71, 79, 87):                       # hint faults, one 2 MiB huge page of 8 blocks each
        lay.note(np.arange(top - 7, top + 1))
    assert lay.verdict() == ("on", "frontier block 87")


def test_a_clear_over_four_reads_with_the_prefill_beside_its_end_is_a_clear():
    # as a 6.12 lab guest reported it: the clear in address order over three reads, then its end
    # beside the prefill's first hint faults; the position says nothing until the decoder writes
    lay = Layout(256)
    for written in (np.arange(8, 40), np.arange(40, 120), np.arange(120, 200),
                    np.r_[0:24, 200:256]):
        lay.note(written)
    assert lay.state == "learning" and lay.frontier == -1
    for top in (71, 79, 87):
        lay.note(np.arange(top - 7, top + 1))
    assert lay.verdict() == ("on", "frontier block 87")


def test_a_decoder_writing_a_small_region_through_is_no_clear():
    lay = Layout(64)
    decode(lay, range(3, 64, 4), width=4)          # the whole region over 16 intervals: no fill
    assert lay.verdict() == ("on", "frontier block 63")


# ---- Positions: delta rows and the table -------------------------------------------------------------

class Memory:
    """Every page populated on node 0, as a move_pages query would say."""

    def locate(self, pid, addrs):
        return np.zeros(len(addrs), np.int64)


@pytest.fixture
def book(tmp_path):
    signal = sig.AccessSignal(sig.choose(sig.Facts.from_dict(json.loads(FACTS.read_text()))),
                              knobs.Knobs(tmp_path / "knobs.json"))
    # 16 KiB per token, 8 tokens per block: 128 KiB blocks
    table = BlockTable(HeatConfig(weight_recency=0.5, weight_position=0.5, position_half_life_tokens=64))
    return Book(table, TrackedSet(), BlockSizer(kv_bytes_per_token=16 * KiB, small_tokens=8),
                tier_of_node=lambda n: TIER_OF[np.asarray(n)], fast_node=0, locate=Memory().locate,
                place=signal.blocks_placed, forget=lambda pid, start: None, bind=lambda b: None)


PID, BASE, POOL = 4242, 0x7f0000000000, 0x7f4000000000
BLOCK = 128 * KiB


def register(book, start, length=8 * MiB):
    book.apply("register", {"pid": PID, "start": start, "length": length, "flags": [], "policy": "fast",
                            "source": "malloc", "node": 0, "tag": "", "region_id": 1})


def rows(start, blocks, written=(), reads_only=()):
    """Delta rows (one per block) and their write counts: ``blocks`` written, ``reads_only`` read."""
    idx = list(blocks) + list(reads_only)
    d = np.zeros(len(idx), ACCESS_DELTA_DTYPE)
    d["pid"] = PID
    d["block_start"] = [start + i * BLOCK for i in idx]
    d["block_len"] = BLOCK
    d["count"] = 1
    d["last_seen_ns"] = 1
    d["source"] = int(SampleSource.FAULT)
    w = np.array([1] * len(blocks) + [0] * len(reads_only), np.uint32)
    return d, w


def samplers(writes, tells=True):
    return types.SimpleNamespace(tells_writes=tells, last_writes=writes)


def test_a_token_order_region_gets_its_frontier_and_a_pool_keeps_position_off(book):
    register(book, BASE)
    register(book, POOL)
    p, t = Positions(), book.table
    for top in (5, 6, 7):
        d1, w1 = rows(BASE, [top], reads_only=range(top))           # writes at the top, reads behind
        d2, w2 = rows(POOL, [3, 17, 30, 44], reads_only=[5, 9])     # four sequences appending
        p.observe(np.concatenate([d1, d2]), samplers(np.concatenate([w1, w2])), book)
    assert p.describe((PID, BASE))["text"] == "position: on, frontier block 7"
    assert p.describe((PID, POOL))["text"] == "position: off — writes in 4 places (pooled layout)"
    rid = t.region_id((PID, BASE))
    sl = t.region_slice(rid)
    # 8 tokens per block, half-life 64 tokens: the positional factor halves every 8 blocks behind
    np.testing.assert_allclose(t.positional[sl][[7, 6, 0]], [1.0, 2 ** (-1 / 8), 2 ** (-7 / 8)], rtol=1e-6)
    assert t.positional[sl][8:].max() == 0 and t.r_frontier[rid] == 7
    assert t.positional[t.region_slice(t.region_id((PID, POOL)))].max() == 0


def test_heat_ranks_blocks_near_the_frontier_above_blocks_read_as_rarely_far_behind(book):
    register(book, BASE)
    p, t = Positions(), book.table
    for top in (40, 41, 42):
        d, w = rows(BASE, [top])
        p.observe(d, samplers(w), book)
    d, _ = rows(BASE, [], reads_only=[2, 38])       # one read each, at the same time
    t.ingest(d)
    rid = t.region_id((PID, BASE))
    first = t.region_slice(rid).start
    h = t.compute_heat(t.ms(2))
    assert h[first + 38] > h[first + 2] + 0.3


def test_a_region_that_stops_reading_as_token_order_loses_its_factor(book):
    register(book, BASE)
    p, t = Positions(), book.table
    for top in (5, 6, 7):
        d, w = rows(BASE, [top])
        p.observe(d, samplers(w), book)
    rid = t.region_id((PID, BASE))
    assert t.positional[t.region_slice(rid)].max() == 1
    d, w = rows(BASE, [0, 20, 40, 60])
    p.observe(d, samplers(w), book)
    assert p.describe((PID, BASE))["state"] == "off"
    assert t.positional[t.region_slice(rid)].max() == 0 and t.r_frontier[rid] == -1


def test_a_new_half_life_recomputes_the_factor(book):
    register(book, BASE)
    p, t = Positions(), book.table
    for top in (5, 6, 7):
        d, w = rows(BASE, [top])
        p.observe(d, samplers(w), book)
    rid = t.region_id((PID, BASE))
    t.heat_cfg = HeatConfig(weight_recency=0.5, weight_position=0.5, position_half_life_tokens=8)
    p.observe(np.zeros(0, ACCESS_DELTA_DTYPE), samplers(np.zeros(0, np.uint32)), book)
    assert t.positional[t.region_slice(rid).start + 6] == pytest.approx(0.5)


def test_regions_unseen_gone_and_registered_anew(book):
    register(book, BASE)
    p = Positions()
    assert p.describe((PID, BASE))["text"] == "position: not seen written yet"
    for top in (5, 6, 7):
        d, w = rows(BASE, [top])
        p.observe(d, samplers(w), book)
    assert p.describe((PID, BASE))["state"] == "on"
    book.apply("unregister", {"pid": PID, "start": BASE})
    register(book, BASE, length=4 * MiB)           # the same address, another allocation
    d, w = rows(BASE, [9])
    p.observe(d, samplers(w), book)
    got = p.describe((PID, BASE))
    assert got["state"] == "learning" and got["written_intervals"] == 1
    book.apply("exit", {"pid": PID})
    p.observe(d, samplers(w), book)
    assert p.describe((PID, BASE))["text"] == "position: not seen written yet"


def test_without_a_write_telling_sampler_position_is_off_and_says_why(book):
    register(book, BASE)
    p = Positions()
    d, _ = rows(BASE, [], reads_only=[1, 2])
    p.observe(d, samplers(None, tells=False), book)
    got = p.describe((PID, BASE))
    assert got["state"] == "off" and "no running sampler tells writes" in got["text"]


@pytest.mark.parametrize("writes", [None, np.ones(3, np.uint32), "garbage", np.array([2**32 - 1])])
def test_untrusted_or_mismatched_input_never_raises(book, writes):
    register(book, BASE)
    p = Positions()
    d, _ = rows(BASE, [1])
    d["pid"] = [PID]
    d["block_start"] = [2**63]                       # no region holds it
    p.observe(d, samplers(writes), book)
    p.observe(d, object(), book)                     # a stand-in without the side channel
    assert p.describe((PID, BASE))["state"] in ("unseen", "off")


def test_status_and_regions_say_per_region_whether_position_weighs(book):
    from tieringd.cli import regions as cli_regions
    from tieringd.cli import status as cli_status
    register(book, BASE)
    register(book, POOL)
    p = Positions()
    for top in (35, 36, 37):
        d1, w1 = rows(BASE, [top])
        d2, w2 = rows(POOL, [1, 2, 20, 21, 40, 60, 61])
        p.observe(np.concatenate([d1, d2]), samplers(np.concatenate([w1, w2])), book)
    regions = [{**r.as_dict(), "position": p.describe(r.key), "age_s": 1.0, "bytes_by_node": {"0": 8 * MiB}}
               for r in book]
    st = {"version": "x", "pid": 1, "uptime_s": 1.0, "signal_text": "access signal: hint faults",
          "processes": 1, "region_count": 2, "registered_bytes": 16 * MiB,
          "ticks": {"count": 1, "interval_ms": 100, "last_duration_ms": 1.0, "p50_ms": 1.0, "p99_ms": 1.0,
                    "overruns": 0}, "mover": {"pending_jobs": 0, "migrated_pages": 0}, "tiers": [],
          "regions": regions}
    text = cli_status.render(st)
    assert f"region pid {PID} {BASE:#x} (8.0 MiB): position: on, frontier block 37" in text
    assert f"region pid {PID} {POOL:#x} (8.0 MiB): position: off — writes in 4 places (pooled layout)" in text
    table = cli_regions.render({"regions": regions, "pid": None})
    assert "POSITION" in table and "on @37" in table and "off" in table
