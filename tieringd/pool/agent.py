# SPDX-License-Identifier: Apache-2.0
"""The pool agent: this host's part in the pool, one thread beside the loop.

Every heartbeat (a third of the lease's TTL) it keeps the lease alive, proves the device when it
joins and answers other hosts' proofs, decides how many extents this host should hold
(:func:`tieringd.pool.claims.target_extents`), claims or releases them in etcd and hands them to the
DAX-remap tier's log (``DaxTier.own`` / ``disown_free``): the log writes only segments this host
holds. It writes this host's figures into its entry for ``tieringctl pool``.

It never moves memory. When etcd cannot be reached the host keeps serving what it holds and claims
nothing new; ``status()`` says why, and the next heartbeat that reaches etcd goes on (with a new
lease, claiming again what it still uses, when the old one expired meanwhile).
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Any

from tieringd.pool import claims as C
from tieringd.pool import etcd as E
from tieringd.pool import schema as S
from tieringd.pool.device import DeviceError, PoolDevice
from tieringd.pool.index import SharedIndex
from tieringd.pool.membership import Membership
from tieringd.pool.settings import PoolConfig
from tieringd.shim.pmemlog import SegmentState

log = logging.getLogger("tieringd.pool")

CLAIMS_PER_BEAT = 4          # extents claimed per heartbeat at most (one transaction each)


def host_name(cfg: PoolConfig) -> str:
    return cfg.host or os.uname().nodename.split(".")[0]


class PoolAgent:
    """``tier`` is the DAX-remap tier opened on the pool's device with ``foreign=True``."""

    def __init__(self, cfg: PoolConfig, tier, etcd: E.Etcd | None = None, device: PoolDevice | None = None):
        self.cfg = cfg
        self.tier = tier
        self.host = host_name(cfg)
        self.keys = S.Keys(cfg.prefix)
        self.etcd = etcd or E.Etcd(cfg.endpoints)
        self.device = device or PoolDevice(cfg.device)
        self.refused_entries: collections.Counter = collections.Counter()
        self._refused_logged: set[str] = set()
        self.member = Membership(self.etcd, self.keys, cfg, self.device, self.host, refused=self._refused)
        self.claims = C.ClaimMap()
        self.claimer = C.Claims(self.etcd, self.keys, self.host, refused=self._refused)
        self.etcd_error: str | None = None
        self.etcd_lost_at: float | None = None
        self.beats = 0
        self.claimed_total = self.released_total = 0
        self.lost: list[int] = []                  # extents in use that another host claimed meanwhile
        # the pool as last read (for tieringctl pool): replaced whole each heartbeat, never changed in
        # place, so a report thread reads one consistent map
        self.members: dict[str, S.HostEntry] = {}
        self.lease_left_s: dict[str, int] = {}
        self.map_read_at: float | None = None
        # the extents this host's log owns, as of its last heartbeat (only a heartbeat changes them):
        # reports read this, never the tier's segments, whose lock a DAX request holds for seconds
        self.extents_held: list[int] = []
        self.index: SharedIndex | None = None      # the shared blocks' index, once the pool is known
        self.lost_references = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        # called after each heartbeat, in the agent's thread (tieringd.pool.dedup.SharedBlocks.sweep)
        self.after_beat: list = []
        self.shared = None          # SharedBlocks, once share_blocks() made it

    @property
    def heartbeat_s(self) -> float:
        return max(self.cfg.lease_ttl_s / 3.0, 0.5)

    def _refused(self, key: str, why: str) -> None:
        """A value from etcd that is not the pool's: counted, logged once per key."""
        # counted by kind (hosts, claims, …), never by the key itself: a key is anybody's text, and
        # its kind is what the metrics label with
        kind = key[len(self.cfg.prefix):].split("/", 1)[0] if key.startswith(self.cfg.prefix) else ""
        self.refused_entries[kind if kind in S.TYPES else "other"] += 1
        if key not in self._refused_logged and len(self._refused_logged) < 1000:
            self._refused_logged.add(key)
            log.warning("pool: etcd key %s refused: %s", key[:120], why)

    # ---- the thread --------------------------------------------------------------------------------
    def start(self) -> "PoolAgent":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tieringd-pool", daemon=True)
            self._thread.start()
        return self

    def stop(self, leave: bool = True) -> None:
        """Stop the heartbeats; ``leave``: revoke the lease (every claim and reference goes now). A
        second call does nothing: the daemon's shutdown and a test's cleanup may both call it, and
        the device's descriptor is closed once."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
            self._thread = None
        if self.shared is not None:     # the processes' own copies again, while the lease holds
            self.shared.stop()
        if leave:
            try:
                self.member.leave()
            except (E.EtcdUnavailable, E.EtcdRefused) as e:
                log.info("pool: lease not revoked (%s): it expires in %d s", e, self.cfg.lease_ttl_s)
        self.etcd.close()
        self.device.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            self.beat()
            self._stop.wait(max(self.heartbeat_s - (time.monotonic() - t0), 0.05))

    # ---- one heartbeat -----------------------------------------------------------------------------
    def beat(self) -> None:
        try:
            with self._lock:
                self._beat()
            if self.etcd_error is not None:
                log.info("pool: etcd answers again after %.1f s", time.monotonic() - (self.etcd_lost_at or 0))
            self.etcd_error = self.etcd_lost_at = None
        except (E.EtcdUnavailable, E.EtcdRefused) as e:
            if self.etcd_error is None:
                self.etcd_lost_at = time.monotonic()
                log.warning("pool: %s; serving what this host holds, claiming nothing new", e)
            self.etcd_error = str(e)
        except DeviceError as e:
            self.member.state, self.member.why = "refused", str(e)
        self.beats += 1
        for hook in self.after_beat:
            try:
                hook()
            except Exception:           # noqa: BLE001 - a hook's bug must not stop the heartbeats
                log.exception("pool: after-heartbeat hook failed")

    def _beat(self) -> None:
        new_lease = self.member.ensure_lease()
        if self.member.pool is None or new_lease or self.member.state != "member":
            if self.member.ensure_pool() is None:
                return
        pool = self.member.pool
        if self.index is None:
            self.index = SharedIndex(self.etcd, self.keys, self.host, self.device, pool.extent_bytes,
                                     refused=self._refused)
        elif new_lease and self.index.refs:
            # the old lease's references went with it, and their extents may have been claimed and
            # written since: none of them is trusted again (the blocks are published afresh)
            self.lost_references += len(self.index.refs)
            log.error("pool: %d shared-block references lost with the old lease", len(self.index.refs))
            self.index.refs.clear()
        members = self.member.live_members()
        if not self.member.prove(members):
            self._publish()
            return
        self.member.answer_joins()
        self.claims = self.claimer.read(pool.extents)
        if new_lease or self.beats == 0:
            self._hold_in_use()
        self._size(members)
        self._publish()
        self._read_map(members)

    def _read_map(self, members: dict[str, S.HostEntry]) -> None:
        """What the other hosts hold and how long their leases have left (one request per host)."""
        left = {h: self.etcd.time_to_live(e.lease) for h, e in members.items() if e.lease > 0}
        self.members, self.lease_left_s, self.map_read_at = dict(members), left, time.monotonic()

    def _hold_in_use(self) -> None:
        """Under a (new) lease: claim again every segment the log uses or owns."""
        states = self.tier.segment_states()
        for i, st in enumerate(states):
            if i == 0 or st == SegmentState.FOREIGN:
                continue
            if not self.claimer.hold(i, self.member.lease):
                self.lost.append(i)
                log.error("pool: extent %d, which this host uses, is claimed by %s", i,
                          ", ".join(self.claims.holders.get(i, {})) or "another host")
        self.claims = self.claimer.read(self.member.pool.extents)

    def _size(self, members: dict[str, S.HostEntry]) -> None:
        """Claim or release toward the target."""
        pool = self.member.pool
        ext = pool.extent_bytes
        mine = [i for i, st in enumerate(self.tier.segment_states()) if i and st != SegmentState.FOREIGN]
        cap = self.tier.capacity()
        log_g = self.tier.log.geometry
        want = C.target_extents(
            used_bytes=cap.used_bytes, headroom_bytes=ext, extent_bytes=ext,
            working_extents=log_g.reserve_segments + 2,
            capacity_of=lambda n: int(log_g.max_live_fraction * (n - log_g.reserve_segments - 1) * ext),
            max_bytes=self.cfg.max_bytes, min_bytes=self.cfg.min_bytes)
        if len(mine) < want:
            others = [C.Share(e.weight, e.min_bytes, e.claimed_bytes) for h, e in members.items()
                      if h != self.host and e.state == "member"]
            n = min(C.grantable(want_more=want - len(mine), free_extents=len(self.claims.free(pool.extents)),
                                extents=pool.extents, extent_bytes=ext, weight=self.cfg.weight,
                                claimed=len(mine), others=others), CLAIMS_PER_BEAT)
            got = []
            for i in self.claims.free(pool.extents):
                if len(got) >= n:
                    break
                if self.claimer.claim(i, self.member.lease):
                    got.append(i)
            if got:
                self.tier.own(got)
                self.claimed_total += len(got)
                self.claims = self.claims.changed(self.host, got, [])
                log.info("pool: claimed extents %s (%d held, %d wanted)", got, len(mine) + len(got), want)
        elif len(mine) > want + 1:                 # one extent of hysteresis
            gone = self.tier.disown_free(len(mine) - want - 1)
            for i in gone:
                self.claimer.release(i)
                self.released_total += 1
                log.info("pool: released extent %d (%d held, %d wanted)", i, len(mine) - 1, want)
            self.claims = self.claims.changed(self.host, [], gone)

    def _publish(self) -> None:
        cap = self.tier.capacity()
        held = [i for i, st in enumerate(self.tier.segment_states()) if i and st != SegmentState.FOREIGN]
        self.extents_held = held
        mine = len(held)
        ext = self.member.pool.extent_bytes if self.member.pool else 0
        entry = S.HostEntry(host=self.host, lease=self.member.lease, weight=self.cfg.weight,
                            min_bytes=self.cfg.min_bytes, max_bytes=self.cfg.max_bytes,
                            claimed_bytes=(mine + self._shared_extents()) * ext, used_bytes=cap.used_bytes,
                            shared_bytes=self.index.shared_bytes if self.index else 0,
                            saved_bytes=self.index.saved_bytes if self.index else 0,
                            state=self.member.state, why=self.member.why[:300], t=time.time())
        self.etcd.put(self.keys.host(self.host), S.dump(entry), self.member.lease)

    # ---- shared blocks ---------------------------------------------------------------------------
    def claim_shared_extent(self) -> int | None:
        """A free extent claimed ``shared`` for blocks this host publishes (never in its log)."""
        with self._lock:
            return self._claim_shared()

    def _claim_shared(self) -> int | None:
        """One more extent for published blocks, within this host's share like its log's claims."""
        pool = self.member.pool
        if pool is None or self.member.state != "member" or self._shared_grant(1) < 1:
            return None
        for i in self.claimer.read(pool.extents).free(pool.extents):
            if self.claimer.claim(i, self.member.lease, kind="shared"):
                return i
        return None

    def _shared_extents(self) -> int:
        if self.index is None:
            return 0
        return len({r.entry.extent for r in list(self.index.refs.values())} | set(self.index.open_extents))

    def _shared_grant(self, want: int) -> int:
        """How many more extents this host may claim now (its max, the others' min and shares), from
        the map of the last heartbeat."""
        pool = self.member.pool
        if pool is None:
            return 0
        claimed = len(self.extents_held) + self._shared_extents()
        if self.cfg.max_bytes:
            want = min(want, max(self.cfg.max_bytes // pool.extent_bytes - claimed, 0))
        others = [C.Share(e.weight, e.min_bytes, e.claimed_bytes) for h, e in dict(self.members).items()
                  if h != self.host and e.state == "member"]
        return C.grantable(want_more=want, free_extents=len(self.claims.free(pool.extents)), extents=pool.extents,
                           extent_bytes=pool.extent_bytes, weight=self.cfg.weight, claimed=claimed, others=others)

    def shared_room_bytes(self) -> int:
        """Room for more published blocks: what is left in this host's open shared extents, and the
        extents it may still claim (no request to etcd: the last heartbeat's map)."""
        pool = self.member.pool
        if pool is None or self.index is None or self.member.state != "member":
            return 0
        left = sum(pool.extent_bytes - used for used in list(self.index.open_extents.values()))
        return left + self._shared_grant(pool.extents) * pool.extent_bytes

    def store_block(self, data: bytes):
        """A cold block kept in the pool once (``SharedIndex.store``): another host's equal copy
        referenced, or this host's published; None when the pool has no room or this host is no
        member. Raises EtcdUnavailable while etcd is away (nothing new is shared then)."""
        with self._lock:
            if self.index is None or self.member.state != "member":
                return None
            return self.index.store(data, self.member.lease, self._claim_shared)

    def share_blocks(self, tier):
        """The carrier of the DAX tier's moves with the pool (:class:`tieringd.pool.dedup.SharedBlocks`:
        cold blocks kept once), swept after each heartbeat and stopped before the agent."""
        from tieringd.pool.dedup import SharedBlocks
        self.shared = SharedBlocks(self, tier).start()
        self.after_beat.append(self.shared.sweep)
        return self.shared

    def release_block(self, digest: str) -> None:
        """No process maps this host's reference to the block any more: drop it."""
        with self._lock:
            if self.index is not None:
                self.index.release(digest)

    def unshare_block(self, digest: str) -> bytes:
        """A write is coming to this host's copy of a shared block: its bytes, for the writer's own
        page, and the reference dropped. The shared copy is never written: the other hosts that
        reference it read what they read before."""
        with self._lock:
            ref = self.index.refs[digest]
            data = self.device.read(ref.entry.offset, ref.entry.length)
            self.index.release(digest)
            return data

    # ---- reports -----------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        pool = self.member.pool
        mine = list(self.extents_held)
        return {
            "host": self.host, "prefix": self.cfg.prefix, "device": self.cfg.device,
            "endpoints": list(self.cfg.endpoints),
            "state": self.member.state, "why": self.member.why, "proved_by": self.member.proved_by,
            "etcd": "unreachable" if self.etcd_error else "ok", "etcd_error": self.etcd_error,
            "etcd_lost_s": round(time.monotonic() - self.etcd_lost_at, 1) if self.etcd_lost_at else None,
            "lease": self.member.lease, "lease_ttl_s": self.cfg.lease_ttl_s,
            "pool": None if pool is None else {"uuid": pool.uuid, "extents": pool.extents,
                                               "extent_bytes": pool.extent_bytes, "device_bytes": pool.device_bytes},
            "extents_held": mine, "claimed_bytes": len(mine) * (pool.extent_bytes if pool else 0),
            "capacity_bytes": self.tier.capacity().capacity_bytes, "used_bytes": self.tier.capacity().used_bytes,
            "claimed_total": self.claimed_total, "released_total": self.released_total,
            "extents_free": len(self.claims.free(pool.extents)) if pool else 0,
            "hosts": len(self.members),
            "lost_extents": list(self.lost), "refused_entries": dict(self.refused_entries),
            "shared_bytes": self.index.shared_bytes if self.index else 0,
            "saved_bytes": self.index.saved_bytes if self.index else 0,
            "shared_blocks": len(self.index.refs) if self.index else 0,
            "index_mismatches": self.index.mismatches if self.index else 0,
            "lost_references": self.lost_references,
            "dedup": self.shared.stats() if self.shared is not None else None,
            "etcd_requests": self.etcd.requests, "etcd_failovers": self.etcd.failovers, "beats": self.beats,
        }
