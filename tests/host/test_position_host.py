# SPDX-License-Identifier: Apache-2.0
"""The write signal and the decode frontier on the running kernel (root, BPF): the real fault sampler
(``open_samplers``, as the daemon opens it) on ``token_kv`` — one sequence's KV in token order, written
one token after another while every token behind is read — and the daemon's region book, block table
and ``Positions`` (tieringd/daemon/position.py) on what it reads.

- first touch: every new token's pages fault on its write, so the blocks written per interval are one
  place at the decoder's position, and the frontier is the block of the last token written;
- a cleared buffer under NUMA balancing (mode 1, borrowed and put back; this machine has one node, the
  hint faults are the same): the decoder's writes show as hint faults a write took, at the frontier
  only; the tokens behind, read by the sweeps, show as faults without a write.
"""
from __future__ import annotations

import json
import queue
import threading
import time

import numpy as np
import pytest

from tieringd.contracts import Tier
from tieringd.daemon.position import Positions, places_of
from tieringd.daemon.regions import Book
from tieringd.kernel import knobs, numa
from tieringd.placement.blocksize import BlockSizer
from tieringd.placement.heat import BlockTable, HeatConfig
from tieringd.sampling import TrackedSet, open_samplers

from sampling_support import Workload

pytestmark = [pytest.mark.root, pytest.mark.bpf]

TOKEN_BYTES = 16384
TOKENS_PER_BLOCK = 8             # the sizer's small blocks: 128 KiB
BLOCK = TOKEN_BYTES * TOKENS_PER_BLOCK
SAFETY_S = 60                    # a limit for states that come much sooner, never a timing assertion


class Decoder:
    """token_kv started with --wait, its region in a real book (the sizer gives 128 KiB blocks), its
    report lines collected as they come."""

    def __init__(self, tracked: TrackedSet, *args: str):
        self.w = Workload("token_kv", "--token-bytes", str(TOKEN_BYTES), "--report", "0.1", *args)
        info = self.w.info
        self.base, self.length = info["base"], info["len"]
        heat = HeatConfig(weight_recency=0.5, weight_position=0.5, position_half_life_tokens=64)
        self.book = Book(BlockTable(heat), tracked,
                         BlockSizer(kv_bytes_per_token=TOKEN_BYTES, small_tokens=TOKENS_PER_BLOCK),
                         tier_of_node=lambda n: np.full(len(np.atleast_1d(n)), int(Tier.DRAM), np.int8),
                         fast_node=0, locate=numa.query_pages_array, place=lambda *a: [],
                         forget=lambda pid, start: None, bind=lambda binds: None)
        self.book.apply("register", {"pid": self.w.pid, "start": self.base, "length": self.length,
                                     "flags": [], "policy": "none", "source": "malloc", "node": 0,
                                     "tag": "", "region_id": 1})
        r = self.book.get(self.w.pid, self.base)
        assert r is not None and r.block_bytes == BLOCK
        self.reports: queue.Queue[dict] = queue.Queue()
        self.token = 0                       # the next token, as of the latest report read
        self.end: dict | None = None

    def go(self) -> None:
        self.w.p.stdin.write("go\n")
        self.w.p.stdin.flush()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.w.p.stdout:
            self.reports.put(json.loads(line))

    def poll(self) -> int:
        """The next token as of the reports so far (the end line included)."""
        while True:
            try:
                msg = self.reports.get_nowait()
            except queue.Empty:
                return self.token
            if msg["event"] == "end":
                self.end = msg
            self.token = msg["token"]

    def blocks_of(self, rows: np.ndarray) -> np.ndarray:
        mine = rows[(rows["pid"] == self.w.pid) & (rows["block_start"] >= self.base)
                    & (rows["block_start"] < self.base + self.length)]
        return np.unique((mine["block_start"] - np.uint64(self.base)) // np.uint64(BLOCK)).astype(np.int64)


def block_of(token: int) -> int:
    return max(token - 1, 0) // TOKENS_PER_BLOCK


@pytest.fixture
def tracked():
    t = TrackedSet()
    yield t
    t.close()


def test_first_touch_writes_are_one_place_at_the_decoder_and_give_the_frontier(tracked):
    dec = Decoder(tracked, "--tokens", "2048", "--prompt", "64", "--rate", "100", "--seconds", "4",
                  "--sweep", "0.5")
    p = Positions()
    tops = []
    with open_samplers(tracked, sources=("fault",), fallback="none", migrations=False) as ss:
        assert ss.tells_writes
        dec.go()
        deadline = time.monotonic() + SAFETY_S
        while dec.end is None and time.monotonic() < deadline:
            before = dec.poll()
            time.sleep(0.2)
            rows = ss.read_deltas()
            p.observe(rows, ss, dec.book)
            written = dec.blocks_of(rows[ss.last_writes > 0])
            after = dec.poll()
            if len(written):
                # every fault here is a first touch by the decoder's write: one place, where it writes
                assert places_of(written) == 1, written
                # (a report is up to 0.1 s old: 10 tokens; the prefill's 8 blocks come at once)
                assert written.max() <= block_of(after) + 2 and written.min() >= block_of(before) - 1 - 8
                tops.append(int(written.max()))
        rows = ss.read_deltas()
        p.observe(rows, ss, dec.book)
    dec.w.finish()
    assert dec.end is not None and dec.end["ok"], dec.end
    assert tops == sorted(tops) and len(tops) >= 3, tops
    last = block_of(dec.end["token"])
    got = p.describe((dec.w.pid, dec.base))
    assert got["state"] == "on" and got["frontier_block"] == last, got
    t = dec.book.table
    sl = t.region_slice(t.region_id((dec.w.pid, dec.base)))
    pos = t.positional[sl]
    assert pos[last] == 1 and pos[last + 1:].max() == 0
    assert pos[last - 8] == pytest.approx(0.5)           # 64 tokens (8 blocks) behind: one half-life
    assert (np.diff(pos[:last + 1]) > 0).all()


def test_hint_faults_tell_the_decoders_writes_from_the_reads_behind(tracked, tmp_path):
    if knobs.resolve("kernel.numa_balancing")[0] is None:
        pytest.skip("no kernel.numa_balancing (CONFIG_NUMA_BALANCING off)")
    k = knobs.Knobs(tmp_path / "knobs.json")
    dec = Decoder(tracked, "--tokens", "3072", "--prompt", "64", "--rate", "40", "--seconds", "60",
                  "--sweep", "0.5", "--clear")
    p = Positions()
    windows = []                   # (next token before, after, written blocks, read-only blocks)
    try:
        k.recover()
        with open_samplers(tracked, sources=("fault",), fallback="none", migrations=False) as ss:
            dec.go()
            while dec.poll() < 64 + 20:         # the clear and the prefill are done: decoding
                time.sleep(0.1)
            ss.read_deltas()
            k.borrow("kernel.numa_balancing", 1)
            for name in ("numa_balancing.scan_delay_ms", "numa_balancing.scan_period_min_ms"):
                k.borrow(name, 100)             # debugfs: absent under lockdown, defaults then
            deadline = time.monotonic() + SAFETY_S
            while time.monotonic() < deadline and dec.end is None:
                before = dec.poll()
                time.sleep(0.5)
                rows = ss.read_deltas()
                p.observe(rows, ss, dec.book)
                written = dec.blocks_of(rows[ss.last_writes > 0])
                read = np.setdiff1d(dec.blocks_of(rows), written)
                after = dec.poll()
                if dec.end is not None:
                    break                       # its end reads every token to verify it: no sweep
                windows.append((before, after, written, read))
                hinted = [w for w in windows if len(w[2])]
                if p.describe((dec.w.pid, dec.base))["state"] == "on" and len(hinted) >= 4 \
                        and sum(len(w[3]) for w in windows) >= 8:
                    break
    finally:
        k.restore()
        dec.w.p.terminate()
        dec.w.finish()
    hinted = [w for w in windows if len(w[2])]
    assert len(hinted) >= 4, [(a, b, w.tolist()) for a, b, w, _ in windows]
    for before, after, written, read in windows:
        # writes only where the decoder wrote in the window; reads only behind it
        assert places_of(written) <= 1 and (len(written) == 0 or (
            written.min() >= block_of(before) - 1 and written.max() <= block_of(after) + 2)), \
            (before, after, written.tolist())
        assert len(read) == 0 or read.max() <= block_of(after) + 2, (after, read.tolist())
    assert any(len(r) and r.min() < block_of(b) - 8 for b, _, _, r in windows), "reads far behind"
    got = p.describe((dec.w.pid, dec.base))
    before, after = windows[-1][:2]
    assert got["state"] == "on" and block_of(before) - 1 <= got["frontier_block"] <= block_of(after) + 2, \
        (got, before, after)
