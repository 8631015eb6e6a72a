# SPDX-License-Identifier: Apache-2.0
"""The four-factor heat of every block, computed over the block table.

A *block* is a fixed-size slice of a registered KV region (``blocksize`` picks its size). The table
keeps one row per block as a numpy structure of arrays, so that a policy tick over millions of blocks
is a handful of vectorised passes and no Python loop over blocks.

Heat, a number in [0, 1] with no unit (docs/heat-policy.md explains it for users)::

    heat = w_r·recency + w_f·frequency + w_p·positional + w_s·sharing       (weights sum to 1)

    recency    = 2^(−age / (half_life_s·(1 + g·sharing)))
                                                     age: seconds since the block's last sampled access;
                                                     g: sharing_half_life_gain (a shared block is
                                                     forgotten more slowly; 0: plain recency)
    frequency  = min(log(1 + f) / log(1 + max(f_ref, 1)), 1)
                                                     f: sampled accesses, each decayed with
                                                     frequency_half_life_s; f_ref: the
                                                     frequency_quantile of the accessed blocks' f
    positional = 2^(−d / position_half_life_tokens)  d: tokens between the block and its region's decode
                                                     frontier (0 for the newest block; 0 when unknown)
    sharing    = 1 − 1/n                             n: processes (or requests) using the block, ≥ 1

Frequency is relative (sampled counts scale with the sampling rate, which differs per machine) but
not to the single hottest block: one shared system-prompt block read by every request would make
every other block look cold. The reference is a high quantile of the accessed blocks' counts, taken
from an evenly strided sample of at most 65,536 rows per tick; blocks above it score 1.

The reference weights are 0.30/0.25/0.25/0.20 with g = 0 (one setting away); the shipped defaults
are tuned on a real trace (HeatConfig). Times are kept as uint32 milliseconds since the table's epoch (49 days of range; the
table rebases before it runs out).
"""
from __future__ import annotations

import dataclasses
import numpy as np

from tieringd.config import ConfigError, Table, ranged
from tieringd.contracts import ACCESS_DELTA_DTYPE, NODE_SLOTS
from tieringd.placement.blocktable import REBASE_MS, BlockStore

# exp2 of an exponent below −126 underflows to a float32 subnormal or 0, and numpy's exp2 takes a
# slow path for those: 20× slower over a table of mostly idle blocks. 2^−64 is 0 for any ranking.
_MIN_EXP2 = np.float32(-64.0)
_CHUNK = 1 << 15           # rows per cache-sized chunk in compute_heat (128 KiB of float32)
_SHARERS_LUT = 256          # sharers ≥ 255 share one recency rate (their sharing differs by < 0.4%)
_FREQ_SAMPLE = 1 << 16      # rows sampled per tick for the frequency reference (f_ref)
_NO_TIER = -1
WEEK_S = 7 * 86400         # the longest half-life: the table's clock runs 49 days


@dataclasses.dataclass(frozen=True)
class HeatConfig(Table):
    """The ``[heat]`` table (``config.from_table(HeatConfig, "heat", table)``). Weights are
    normalised to sum to 1, so heat stays in [0, 1].

    Defaults: tuned with ``tieringctl tune`` on the Mooncake FAST'25 conversation trace (real
    production requests 1–2100 of its first 3,000; 2101–3000 held out) as a sampler sees it (10% of
    the reads, 500 ms late), then the gain, the sharing weight and the half-life (with the policy's
    low watermark) chosen by hand on the generated trace and requests 2101–3000 —
    docs/heat-policy.md. Recency carries
    what these traces reveal about reuse; sharing adds a little; frequency and position added nothing
    that held on held-out parts.
    The reference weights are 0.30/0.25/0.25/0.20 with half-lives 1 s and 10 s and no gain.

    ``sharing_half_life_gain`` (g): a block's recency half-life is ``half_life_s × (1 + g·sharing)``.
    Sharing enters the heat mostly as time: a prefix that several requests read is forgotten more
    slowly. Its weighted term is kept small (0.002, worth less than one 250 ms window of a block
    with two sharers): it breaks ties between blocks read together and keeps long-idle shared blocks
    above long-idle private ones — on the faster tiers only, as the policy asks
    (``compute_heat(sharing_above=...)``): sharing keeps a block, it does not fetch one. At the
    0.03 shipped before, a shared block idle for a few windows outranked a private one read in this
    one, and those are the next window's reads (docs/simulator.md). With recency alone the
    half-life itself does not change the ranking (every block's heat is the same function of its
    age); it sets the scale of heat values that thresholds and the sharing term are compared with.
    """
    NAME = "heat"
    weight_recency: float = ranged(1.0, 0, 1000)  # recency: 1 = read now, 0.5 = idle one half-life (the reference weights: 0.30, 0.25, 0.25, 0.20)
    weight_frequency: float = ranged(0.0, 0, 1000)  # frequency: decayed sampled accesses, relative to the frequency_quantile of the blocks in use
    weight_position: float = ranged(0.0, 0, 1000)  # position: 1 = the decode position, halving per position_half_life_tokens behind it
    weight_sharing: float = ranged(0.002, 0, 1000)  # sharing, 1 − 1/users: kept small, it breaks ties and keeps long-idle shared blocks
    half_life_s: float = ranged(12.0, 0.001, WEEK_S, unit="seconds")  # recency halves per half-life without an access
    sharing_half_life_gain: float = ranged(5.0, 0, 1000)  # half-life × (1 + gain × sharing): shared blocks are forgotten more slowly
    frequency_half_life_s: float = ranged(10.0, 0.001, WEEK_S, unit="seconds")  # an access counts half after this long
    position_half_life_tokens: float = ranged(2048.0, 1, 1e9, unit="tokens")  # the positional factor halves per this many tokens behind the decode position
    frequency_quantile: float = ranged(0.99, 0, 1, lo_open=True)  # f_ref: this quantile of the accessed blocks' f (1 = the max)
    lag_quantile: float = ranged(0.9, 0, 1, hi_open=True)  # idle time = age less the signal's lag (SignalLag); 0: the age

    def validate(self) -> None:
        super().validate()
        if sum(self.weights) <= 0:
            raise ConfigError.bad_value("heat", "weight_recency", "weights that are not all 0", 0)

    @property
    def weights(self) -> tuple[float, float, float, float]:
        return (self.weight_recency, self.weight_frequency, self.weight_position, self.weight_sharing)

    @property
    def normalised_weights(self) -> tuple[float, float, float, float]:
        s = sum(self.weights)
        return tuple(w / s for w in self.weights)  # type: ignore[return-value]

    def recency_half_life_s(self, sharers):
        """The recency half-life of a block with ``sharers`` (a count or an array): half_life_s ×
        (1 + g·sharing)."""
        return self.half_life_s * (1.0 + self.sharing_half_life_gain * sharing_factor(sharers))


def sharing_factor(sharers):
    """The sharing factor, 1 − 1/sharers (0 for a private block), of a count or an array of them."""
    return 1.0 - 1.0 / np.maximum(sharers, 1)


def heat_of(cfg: HeatConfig, age_s: float, freq: float, freq_ref: float, distance_tokens: float | None,
            sharers: int, lag_s: float = 0.0) -> float:
    """The formula for one block, in plain Python: the reference the vectorised code is tested against.

    ``freq`` is the decayed access count *now*; ``freq_ref`` the reference count (:func:`frequency_reference`);
    ``distance_tokens`` None means "position unknown"; ``lag_s`` the signal's lag (:class:`SignalLag`).
    """
    wr, wf, wp, ws = cfg.normalised_weights
    sharing = 1.0 - 1.0 / max(sharers, 1)
    idle_s = max(age_s - lag_s, 0.0)
    recency = 2.0 ** (-idle_s / (cfg.half_life_s * (1.0 + cfg.sharing_half_life_gain * sharing)))
    frequency = min(np.log1p(freq) / np.log1p(max(freq_ref, 1.0)), 1.0)
    positional = 0.0 if distance_tokens is None else 2.0 ** (-distance_tokens / cfg.position_half_life_tokens)
    return float(wr * recency + wf * frequency + wp * positional + ws * sharing)


def frequency_reference(freq_now: np.ndarray, quantile: float) -> float:
    """f_ref of the frequency factor: the ``quantile`` of the blocks' decayed counts that are > 0,
    taking the next higher observed value (so 1.0 is the hottest block and a table of two blocks
    normalises against the busier one). 0 when no block was ever accessed."""
    f = freq_now[freq_now > 0]
    if len(f) == 0:
        return 0.0
    if quantile >= 1:
        return float(f.max())
    k = min(int(np.ceil(quantile * (len(f) - 1))), len(f) - 1)
    return float(np.partition(f, k)[k])


def _clip_exponent(exponent: np.ndarray) -> None:
    """In place: the recency exponent into [_MIN_EXP2, 0] (an age below the signal's lag is no idle
    time: recency 1). One np.clip: on a cached 32K-row float32 chunk it takes 6.6 µs where
    np.maximum alone took 12.8 (numpy 2.x on the build machine; maximum propagates NaNs)."""
    np.clip(exponent, _MIN_EXP2, np.float32(0), out=exponent)


class SignalLag:
    """How late a sampled signal shows that a block is in use, beyond the interval between
    deliveries of samples: per delivery, the ``quantile`` of the ages that blocks sampled again had
    reached; the lag is the median of that over the last ``window`` deliveries less the median
    interval between them (medians: a delivery of mostly long-idle blocks coming back, or a pause
    between deliveries, moves neither).

    A block read all the time looks ``age`` old at a tick for reasons that are the signal's, not the
    block's: its samples arrive late (the sampler's interval, the delivery) and not every read is
    sampled. Recency scaled by a sharing gain multiplies that lag too: a shared block idle for six
    times the lag tied with a private one in use (simulator: with 10 % of the reads seen
    500 ms late, 2 points of hit rate behind transparent LRU on two traces at 5 % of DRAM). With
    every read seen at once a block in use is sampled again one delivery later: the lag is 0 and
    heat is unchanged.
    """

    ACTIVE = 4.0        # ages up to this many times the freshest re-sample's count as "in use"

    def __init__(self, window: int = 64):
        self.fresh_ms = np.zeros(window)        # per delivery: the youngest age a block was re-sampled at
        self.ages_ms = np.zeros(window)         # per delivery: the quantile of the ages of blocks in use
        self.periods_ms = np.zeros(window)      # per delivery: the interval since the one before
        self.n_fresh = self.n_ages = self.n_periods = 0
        self.last_seen_ms: int | None = None

    @staticmethod
    def _median(ring: np.ndarray, n: int) -> float:
        return float(np.median(ring[:min(n, len(ring))])) if n else 0.0

    @property
    def lag_ms(self) -> float:
        if self.n_ages == 0:
            return 0.0
        age = self._median(self.ages_ms, self.n_ages)
        return max(age - self._median(self.periods_ms, self.n_periods), 0.0)

    def note(self, seen_ms: int, last_before_ms: np.ndarray, quantile: float) -> None:
        """One delivery at table time ``seen_ms`` of samples of blocks last sampled at
        ``last_before_ms`` (those sampled before; int64 ms); ``quantile`` of their ages (0: none).

        Blocks sampled again after a long idle time are not "in use": of the ages, only those up to
        ACTIVE × the usual freshest one count (the freshest is the delivery's delay plus one period),
        so a burst of blocks coming back after minutes, or a quiet spell with nothing else to
        sample, moves nothing."""
        if self.last_seen_ms is not None and seen_ms > self.last_seen_ms:
            self.periods_ms[self.n_periods % len(self.periods_ms)] = seen_ms - self.last_seen_ms
            self.n_periods += 1
        self.last_seen_ms = max(seen_ms, self.last_seen_ms or 0)
        ages = seen_ms - last_before_ms
        ages = ages[ages >= 0]
        if quantile <= 0 or len(ages) == 0:
            return
        self.fresh_ms[self.n_fresh % len(self.fresh_ms)] = ages.min()
        self.n_fresh += 1
        in_use = ages[ages <= self.ACTIVE * max(self._median(self.fresh_ms, self.n_fresh), 1.0)]
        if len(in_use):
            self.ages_ms[self.n_ages % len(self.ages_ms)] = np.quantile(in_use, quantile)
            self.n_ages += 1

    def rebase(self, shift_ms: int) -> None:
        if self.last_seen_ms is not None:
            self.last_seen_ms = max(self.last_seen_ms - shift_ms, 0)


class BlockTable(BlockStore):
    """The block table with its heat: :class:`~tieringd.placement.blocktable.BlockStore` keeps the rows
    and finds them; this class takes in samples (``ingest``), keeps the parts of the heat that change
    only with a block's position or sharers (``static``), and computes every row's heat at a tick
    (``compute_heat``)."""

    def __init__(self, heat: HeatConfig | None = None, capacity: int = 1024, epoch_ns: int = 0,
                 max_nodes: int = NODE_SLOTS):
        super().__init__(capacity, epoch_ns, max_nodes)
        self.heat_cfg = heat or HeatConfig()
        self.freq_ref = 0.0             # f_ref of the last compute_heat (reports)
        self.any_shared = False         # a row has had sharers > 1: recency rates differ per block
        self._rates: tuple[tuple[float, float], np.ndarray] | None = None   # (config, LUT)
        self._static_for: tuple | None = None   # the config ``static`` was last computed for, all rows
        self.signal_lag = SignalLag()

    @property
    def lag_ms(self) -> float:
        """The signal's lag that recency discounts: measured (:class:`SignalLag`), 0 with
        ``lag_quantile = 0``."""
        return self.signal_lag.lag_ms if self.heat_cfg.lag_quantile > 0 else 0.0

    def _rebase(self, shift_ms: int) -> None:
        self.freq[:self.n] *= np.float32(2.0 ** (-shift_ms / 1000.0 / self.heat_cfg.frequency_half_life_s))
        self.signal_lag.rebase(shift_ms)
        super()._rebase(shift_ms)

    def add_region(self, *args, **kwargs) -> int:
        rid = super().add_region(*args, **kwargs)
        self.refresh_static(self.region_slice(rid))
        return rid

    # ---- ingest --------------------------------------------------------------------------------
    def ingest(self, deltas: np.ndarray, seen_ns: int | None = None, quantum_ms: float = 0) -> int:
        """Add one interval of sampler output (``ACCESS_DELTA_DTYPE`` rows), delivered at
        CLOCK_MONOTONIC ``seen_ns`` (measures the signal's lag; None: not measured). Returns rows
        matched.

        ``quantum_ms``: sample times are floored to a multiple of it (table time), so the samples of
        one interval tie (the daemon passes its tick; 0 keeps the sampler's times). Within a tick a
        sample's time says when the sampler caught the block, not when it was last read: a hint
        fault is the first touch after the scanner unmapped the page, a PMU sample one read in
        thousands. Recency then orders blocks read in the same tick by the scanner's phase, and that
        noise (up to 0.006 of heat per 100 ms at the 12 s half-life) outweighs the tie-breaks the
        policy relies on (the incumbent's 0.0025, the sharing term's 0.002). In the simulator, such
        times cost 0.1–0.6 point of hit rate at 5% of DRAM (docs/simulator.md)."""
        if deltas.dtype != ACCESS_DELTA_DTYPE:
            raise TypeError(f"expected ACCESS_DELTA_DTYPE rows, got {deltas.dtype}")
        if len(deltas) == 0:
            return 0
        rows, idx = self.locate(deltas["pid"], deltas["block_start"], deltas["block_len"])
        if len(idx) == 0:
            return 0
        t_ms = self.ms(deltas["last_seen_ns"][rows])
        if int(t_ms.max()) >= REBASE_MS:
            self.now_ms(int(deltas["last_seen_ns"].max()))
            t_ms = self.ms(deltas["last_seen_ns"][rows])
        quantum = int(quantum_ms)
        stamp_ms = t_ms - t_ms % quantum if quantum > 1 else t_ms
        self.ingest_blocks(idx, deltas["count"][rows], stamp_ms,
                           seen_ms=None if seen_ns is None else self.ms(seen_ns))
        self._note_cursors(idx, t_ms)           # the prefetcher times decode progress: as sampled
        return len(np.unique(rows))

    def ingest_blocks(self, idx: np.ndarray, counts: np.ndarray, t_ms, positional: np.ndarray | None = None,
                      sharers: np.ndarray | None = None, seen_ms: int | None = None) -> None:
        """Accesses to blocks by index: ``counts`` at table time ``t_ms`` (scalar or per access).

        The frequency is decayed to the access time and the count added; an access older than the
        block's last one is added without moving last_ms back. ``positional``/``sharers``, when the
        caller knows them (the simulator does), replace the stored values (max over duplicates).
        ``seen_ms``: when these samples were delivered (table time), for :class:`SignalLag`.
        """
        idx = np.asarray(idx, np.int64)
        if len(idx) == 0:
            return
        uniq, inv = np.unique(idx, return_inverse=True)
        cnt = np.bincount(inv, weights=np.asarray(counts, np.float64), minlength=len(uniq)).astype(np.float32)
        t = np.broadcast_to(np.asarray(t_ms, np.int64), idx.shape)
        tmax = np.zeros(len(uniq), np.int64)
        np.maximum.at(tmax, inv, t)
        last = self.last_ms[uniq].astype(np.int64)
        if seen_ms is not None:
            self.signal_lag.note(int(seen_ms), last[(last > 0) & (tmax > last)], self.heat_cfg.lag_quantile)
        dt = np.maximum(tmax - last, 0).astype(np.float32)
        decay = np.exp2(dt * np.float32(-1.0 / (1000.0 * self.heat_cfg.frequency_half_life_s)))
        self.freq[uniq] = self.freq[uniq] * decay + cnt
        self.last_ms[uniq] = np.maximum(tmax, last).astype(np.uint32)
        self.last_max_ms = max(self.last_max_ms, int(tmax.max()))
        if positional is not None:
            pos = np.zeros(len(uniq), np.float32)
            np.maximum.at(pos, inv, np.asarray(positional, np.float32))
            self.positional[uniq] = pos
        if sharers is not None:
            sh = np.ones(len(uniq), np.int64)
            np.maximum.at(sh, inv, np.asarray(sharers, np.int64))
            self.sharers[uniq] = np.clip(sh, 1, np.iinfo(np.uint16).max)
        if positional is not None or sharers is not None:
            self.refresh_static(uniq)

    def _note_cursors(self, idx: np.ndarray, t_ms: np.ndarray) -> None:
        """Per region touched: the highest block index and the latest time (the prefetcher's input).
        Sequential regions also take it as the decode frontier when it moves forward."""
        rid = self.region[idx].astype(np.int64)
        touched = np.unique(rid)
        top = np.full(self.nregions, -1, np.int64)
        np.maximum.at(top, rid, idx - self.r_first[rid])
        when = np.full(self.nregions, -1, np.int64)
        np.maximum.at(when, rid, np.asarray(t_ms, np.int64))
        self.r_cursor[touched] = top[touched]
        self.r_cursor_ms[touched] = when[touched]
        seq = touched[self.r_sequential[touched] & (top[touched] > self.r_frontier[touched])]
        for r in seq:
            self.set_frontier(int(r), int(top[r]))

    def set_frontier(self, rid: int, block_index: int) -> None:
        """The region's decode position (its newest block); blocks behind it get
        2^(−distance/position_half_life), blocks ahead of it (not yet written) get 0."""
        self.r_frontier[rid] = block_index
        sl = self.region_slice(rid)
        i = np.arange(sl.stop - sl.start, dtype=np.float32)
        hl_blocks = self.heat_cfg.position_half_life_tokens / max(int(self.r_block_tokens[rid]), 1)
        pos = np.exp2((i - np.float32(block_index)) / np.float32(hl_blocks))
        pos[i > block_index] = 0
        self.positional[sl] = pos
        self.refresh_static(sl)

    def clear_frontier(self, rid: int) -> None:
        """No decode position for the region (its layout is not token order, or no longer reads as
        such): every block's positional factor is 0 again."""
        self.r_frontier[rid] = -1
        sl = self.region_slice(rid)
        self.positional[sl] = 0
        self.refresh_static(sl)

    def set_sharers(self, idx: np.ndarray, sharers: np.ndarray) -> None:
        idx = np.asarray(idx)
        self.sharers[idx] = np.clip(np.asarray(sharers), 1, np.iinfo(np.uint16).max)
        self.refresh_static(idx)

    # ---- the parts of the heat that do not change with time -------------------------------------
    @property
    def static_holds_rates(self) -> bool:
        """Whether ``static`` holds each block's recency rate rather than w_p·positional +
        w_s·sharing: with a sharing gain, when neither frequency nor position weighs (the defaults).
        The sharing bonus is then a function of the rate (both are of the sharers alone), which the
        tick computes from it (``_recency_and_static``) instead of gathering the rate by sharers."""
        cfg = self.heat_cfg
        _, wf, wp, _ = cfg.normalised_weights
        return wf == 0 and wp == 0 and cfg.sharing_half_life_gain > 0

    def _static_key(self) -> tuple:
        cfg = self.heat_cfg
        return cfg.normalised_weights, cfg.half_life_s, cfg.sharing_half_life_gain

    def refresh_static(self, idx=None) -> None:
        """Recompute ``static`` for some rows (all when ``idx`` is None): w_p·positional +
        w_s·(1 − 1/sharers), or each row's recency rate (``static_holds_rates``). Callers that write
        ``positional``/``sharers`` directly must call this; a tick after a change of ``heat_cfg``
        recomputes every row itself."""
        if idx is None:
            idx = slice(0, self.n)
            self._static_for = self._static_key()
        elif self._static_for != self._static_key():
            return self.refresh_static()
        if self.static_holds_rates:
            self.static[idx] = self._rate_table()[np.minimum(self.sharers[idx], _SHARERS_LUT - 1)]
        else:
            _, _, wp, ws = (np.float32(w) for w in self.heat_cfg.normalised_weights)
            self.static[idx] = wp * self.positional[idx] + ws - ws / np.maximum(self.sharers[idx], 1)
        if not self.any_shared:
            self.any_shared = bool((self.sharers[idx] > 1).any())

    def recency_rates(self) -> np.ndarray | None:
        """float32 −1/(1000·half-life) per sharers count 0 … 255, the exponent per ms of a block's
        recency, for a tick that gathers it by sharers; None when every block has the same rate (no
        gain, or nothing shared: one scalar) or ``static`` holds each block's rate already."""
        cfg = self.heat_cfg
        if cfg.sharing_half_life_gain == 0 or not self.any_shared or self.static_holds_rates:
            return None
        return self._rate_table()

    def _rate_table(self) -> np.ndarray:
        cfg = self.heat_cfg
        key = (cfg.half_life_s, cfg.sharing_half_life_gain)
        if self._rates is None or self._rates[0] != key:
            half_life_ms = 1000.0 * cfg.recency_half_life_s(np.arange(_SHARERS_LUT))
            self._rates = key, (-1.0 / half_life_ms).astype(np.float32)
        return self._rates[1]

    def _recency_exponent(self, age_ms: np.ndarray, out: np.ndarray, lo: int, hi: int,
                          c_rec: np.float32, rates: np.ndarray | None) -> None:
        """out = −age/half-life of rows lo:hi: one multiply, or a gather of each row's rate by its
        sharers (clipped to the table's last entry) and a multiply."""
        if rates is None:
            np.multiply(age_ms, c_rec, out=out)
        else:
            np.take(rates, self.sharers[lo:hi], out=out, mode="clip")
            out *= age_ms

    # ---- heat ----------------------------------------------------------------------------------
    def compute_heat(self, now_ms: int, scratch: np.ndarray | None = None,
                     sharing_above: int | None = None) -> np.ndarray:
        """Recompute ``heat`` for every row at table time ``now_ms`` (vectorised, in place).

        ``scratch``: a float32 buffer of at least ``n`` rows, reused across ticks by the policy.
        ``sharing_above``: a ``Tier`` value; the sharing term (w_s·sharing) counts only for blocks
        on a faster tier (a smaller value), so sharing keeps a block where it is but does not
        fetch one (the policy passes its slowest tier; docs/heat-policy.md). None: every block.
        Returns the heat view.
        """
        n = self.n
        wr, wf, _, _ = (np.float32(w) for w in self.heat_cfg.normalised_weights)
        a = scratch[:n] if scratch is not None else np.empty(n, np.float32)
        h = self.heat[:n]
        c_rec = np.float32(-1.0 / (1000.0 * self.heat_cfg.half_life_s))
        c_freq = np.float32(-1.0 / (1000.0 * self.heat_cfg.frequency_half_life_s))
        # a sample stamped after the tick's clock reading (the sampler ran in between) is "now"
        now = np.uint32(max(now_ms, self.last_max_ms))
        if self._static_for != self._static_key():
            self.refresh_static()              # heat_cfg changed since static was computed
        rates = self.recency_rates()
        lag = np.float32(self.lag_ms)
        if wf == 0:
            h = self._recency_and_static(h, a, now, c_rec, wr, rates, lag, sharing_above)
            if not self.static_holds_rates:
                self._drop_sharing_at(h, sharing_above)
            return h
        # In chunks that stay in the CPU cache: each pass then reads the table once from memory
        # instead of once per operation (the numexpr idea). Pass 1: recency into h, decayed f into a,
        # and every stride-th decayed f into the sample that gives f_ref.
        stride = max(n // _FREQ_SAMPLE, 1)
        sample = []
        for lo in range(0, n, _CHUNK):
            hi = min(lo + _CHUNK, n)
            ac, hc = a[lo:hi], h[lo:hi]
            # age in ms, float32 (exact below 2^24 ms ≈ 4.6 h; beyond that every factor is ~0
            # anyway); now ≥ every last_ms (see above), so the uint32 difference cannot wrap
            np.subtract(now, self.last_ms[lo:hi], out=ac, casting="unsafe")
            if lag:
                ac -= lag                           # idle time: the age less the signal's lag
            self._recency_exponent(ac, hc, lo, hi, c_rec, rates)
            _clip_exponent(hc)
            np.exp2(hc, out=hc)                     # recency = 2^(−idle/half_life)
            hc *= wr
            if lag:
                ac += lag                           # counts decay with the age itself
            ac *= c_freq
            np.maximum(ac, _MIN_EXP2, out=ac)
            np.exp2(ac, out=ac)
            ac *= self.freq[lo:hi]                  # f·2^(−age/freq_half_life)
            sample.append(ac[(-lo) % stride::stride].copy())
        f_ref = frequency_reference(np.concatenate(sample) if sample else a[:0], self.heat_cfg.frequency_quantile)
        # pass 2: frequency = min(log1p(f) / log1p(max(f_ref, 1)), 1); positional + sharing from ``static``
        scale = np.float32(wf / np.log1p(max(f_ref, 1.0)))
        for lo in range(0, n, _CHUNK):
            hi = min(lo + _CHUNK, n)
            ac, hc = a[lo:hi], h[lo:hi]
            np.log1p(ac, out=ac)
            ac *= scale
            np.minimum(ac, wf, out=ac)
            hc += ac
            hc += self.static[lo:hi]
        self.freq_ref = f_ref
        self._drop_sharing_at(h, sharing_above)
        return h        # in [0, 1] up to float32 rounding: weights sum to 1, each factor is in [0, 1]

    def _drop_sharing_at(self, h: np.ndarray, slowest: int | None) -> None:
        """Take the sharing term back out of the heat of blocks on tier ``slowest`` or slower (where
        ``static`` holds w_p·positional + w_s·sharing; the default path does it in its pass)."""
        ws = np.float32(self.heat_cfg.normalised_weights[3])
        if slowest is None or ws == 0:
            return
        slow = np.flatnonzero(self.tier[:self.n] >= slowest)
        h[slow] -= ws - ws / np.maximum(self.sharers[slow], 1).astype(np.float32)

    def _recency_and_static(self, h: np.ndarray, a: np.ndarray, now: np.uint32, c_rec: np.float32,
                            wr: np.float32, rates: np.ndarray | None, lag: np.float32,
                            sharing_above: int | None = None) -> np.ndarray:
        """compute_heat when frequency weighs nothing (the shipped defaults): one pass, no f_ref.
        Decayed counts are still kept by every ingest, so a config that weighs them works at once.
        With a sharing gain and no positional weight (the defaults) ``static`` holds each block's
        rate (``static_holds_rates``) and the sharing bonus is computed from it; a weight of 1 is
        not multiplied by."""
        _, _, wp, ws = self.heat_cfg.normalised_weights
        per_block = self.static_holds_rates
        static = (wp > 0 or ws > 0) and not per_block
        derived = per_block and ws > 0
        if derived:
            # rate = −1/(1000·H·(1 + g·S)), so w_s·S = K1/rate − K2 with the constants below: one
            # divide and two adds where gathering each block's rate by its sharers costs three times that
            g, hl = self.heat_cfg.sharing_half_life_gain, self.heat_cfg.half_life_s
            k1, k2 = np.float32(-ws / (g * 1000.0 * hl)), np.float32(ws / g)
            above = np.empty(min(_CHUNK, self.n), np.bool_) if sharing_above is not None else None
        for lo in range(0, self.n, _CHUNK):
            hi = min(lo + _CHUNK, self.n)
            ac, hc = a[lo:hi], h[lo:hi]
            np.subtract(now, self.last_ms[lo:hi], out=ac, casting="unsafe")
            if lag:
                ac -= lag
            if per_block:
                np.multiply(ac, self.static[lo:hi], out=hc)
            else:
                self._recency_exponent(ac, hc, lo, hi, c_rec, rates)
            _clip_exponent(hc)
            np.exp2(hc, out=hc)
            if wr != 1:
                hc *= wr
            if static:
                hc += self.static[lo:hi]
            elif derived:
                np.divide(k1, self.static[lo:hi], out=ac)     # ac (the age) is not needed any more
                if above is None:
                    hc += ac
                    hc -= k2
                else:
                    ac -= k2
                    np.less(self.tier[lo:hi], sharing_above, out=above[:hi - lo])
                    ac *= above[:hi - lo]                     # 0 on the slowest tier
                    hc += ac
        self.freq_ref = 0.0
        return h

    def factors(self, idx: np.ndarray, now_ms: int) -> dict[str, np.ndarray]:
        """The four unweighted factors of some blocks, for reports and tests (not the hot path).
        f_ref is computed over every row here (compute_heat samples it)."""
        idx = np.asarray(idx, np.int64)
        n = self.n
        age_s = np.maximum(now_ms - self.last_ms[:n].astype(np.int64), 0) / 1000.0
        f = self.freq[:n] * np.exp2(-age_s / self.heat_cfg.frequency_half_life_s)
        f_ref = frequency_reference(f, self.heat_cfg.frequency_quantile)
        lag_s = self.lag_ms / 1000.0
        idle_s = np.maximum(age_s[idx] - lag_s, 0.0)
        return {
            "recency": np.exp2(-idle_s / self.heat_cfg.recency_half_life_s(self.sharers[idx])),
            "frequency": np.minimum(np.log1p(f[idx]) / np.log1p(max(f_ref, 1.0)), 1.0),
            "positional": self.positional[idx].astype(np.float64),
            "sharing": sharing_factor(self.sharers[idx]),
        }
