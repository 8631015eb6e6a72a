# SPDX-License-Identifier: Apache-2.0
"""This host in the pool: its lease, the pool's definition, and the proof that it sees the pool's device.

**The lease.** Every key this host writes (its entry, claims, references, join and ack entries) is
attached to one etcd lease of ``[pool] lease_ttl_s``, kept alive on every heartbeat. A host that
dies, or stays cut off from etcd, loses all of them when the lease expires — nothing else cleans up.
A host that finds its lease expired (etcd was away longer than the TTL) takes a new one and must
claim again what it still uses (:meth:`Membership.ensure_lease` says so).

**The pool.** ``P pool`` defines the pool: a uuid and the geometry (device size, extent size, extent
count). The first host creates it in a transaction (only if absent), then writes the same into the
device's header. Every host checks that its device's header says what etcd says before it claims.

**The proof.** A uuid in a header proves nothing (an image copied to another machine carries it). A
joining host writes a fresh random nonce into a random slot of the header extent and puts where
(``P join/<host>``); every member reads that slot on its own device and answers (``P ack/<host>/<member>``:
found it, or not). One "found" from a live member makes the host a member; one "not found" refuses it.
A host alone in the pool checks the nonce the last member left in slot 0 (``PoolDef.nonce``: written
by another host, read by this one) and leaves one of its own.
"""
from __future__ import annotations

import logging
import os
import random
import time
import uuid as _uuid

from tieringd.pool import etcd as E
from tieringd.pool import schema as S
from tieringd.pool.device import DeviceError, Header, PoolDevice
from tieringd.pool.settings import PoolConfig

log = logging.getLogger("tieringd.pool")

LAST_NONCE_SLOT = PoolDevice.slot_offset(0)


class Membership:
    """The host's standing in the pool; one thread (the pool agent) calls it."""

    def __init__(self, etcd: E.Etcd, keys: S.Keys, cfg: PoolConfig, device: PoolDevice, host: str,
                 refused=None):
        self.etcd, self.keys, self.cfg, self.device, self.host = etcd, keys, cfg, device, host
        self.lease = 0
        self.pool: S.PoolDef | None = None
        self.pool_revision = 0
        self.state = "joining"
        self.why = "not joined yet"
        self.proved_by = ""
        self._nonce = ""
        self._joined_at = 0.0
        self.refused = refused or (lambda key, why: log.warning("etcd %s refused: %s", key, why))

    # ---- the lease ---------------------------------------------------------------------------------
    def ensure_lease(self) -> bool:
        """Keep the lease alive; True when it is new (the old one expired, or none yet): every key of
        the old one is gone, and the caller claims again what it uses."""
        if self.lease and self.etcd.keepalive(self.lease) > 0:
            return False
        if self.lease:
            log.warning("pool: lease %x expired (etcd away longer than %d s): claims and references "
                        "are gone, taking a new lease", self.lease, self.cfg.lease_ttl_s)
            if self.state == "member":
                self.state, self.why = "joining", "lease expired: proving the device again"
        self.lease, _ = self.etcd.grant(self.cfg.lease_ttl_s)
        return True

    def leave(self) -> None:
        """Revoke the lease: every key of this host goes at once (a clean stop)."""
        if self.lease:
            self.etcd.revoke(self.lease)
            self.lease = 0

    # ---- the pool's definition --------------------------------------------------------------------
    def ensure_pool(self) -> S.PoolDef | None:
        """The pool's definition (created by this host when there is none), checked against the
        device's header; None (with ``why``) while they disagree."""
        kv = self.etcd.get(self.keys.pool)
        if kv is None:
            kv = self._create_pool()
        try:
            pool = S.parse("pool", kv.value)
        except S.BadEntry as e:
            self.refused(self.keys.pool, str(e))
            return self._refuse(f"the pool's definition in etcd is not usable: {e}")
        self.pool, self.pool_revision = pool, kv.mod_revision
        have = self.device.read_header()
        want = Header(pool.uuid, pool.device_bytes, pool.extent_bytes, pool.extents)
        if have is None and pool.created_by == self.host:
            self.device.write_header(want)        # created by this host, which stopped before it wrote it
            self.device.write_nonce(LAST_NONCE_SLOT, pool.nonce, self.host)
            have = want
        if have != want:
            return self._refuse(f"{self.device.path} holds {'no pool header' if have is None else f'pool {have.uuid}'}, "
                                f"etcd says pool {pool.uuid}: not this pool's device (or not written yet)")
        if pool.device_bytes > self.device.size_bytes:
            return self._refuse(f"the pool is {pool.device_bytes} bytes, {self.device.path} only {self.device.size_bytes}")
        return pool

    def _create_pool(self) -> E.KV:
        ext = self.cfg.extent_bytes
        n = self.device.size_bytes // ext
        nonce = os.urandom(16).hex()
        pool = S.PoolDef(uuid=_uuid.uuid4().hex, device_bytes=n * ext, extent_bytes=ext, extents=n,
                         created_by=self.host, nonce=nonce, nonce_by=self.host)
        pool.check()
        if self.etcd.txn([E.cmp_absent(self.keys.pool)], [E.op_put(self.keys.pool, S.dump(pool))]):
            # only the host whose transaction created the pool writes the header: two hosts creating
            # at once would otherwise overwrite each other's
            self.device.write_header(Header(pool.uuid, pool.device_bytes, pool.extent_bytes, pool.extents))
            self.device.write_nonce(LAST_NONCE_SLOT, nonce, self.host)
            log.info("pool: created pool %s: %d extents of %d MiB on %s", pool.uuid, n, ext >> 20, self.device.path)
        kv = self.etcd.get(self.keys.pool)
        if kv is None:
            raise E.EtcdUnavailable("the pool's definition vanished after its creation")
        return kv

    def _refuse(self, why: str) -> None:
        if self.why != why:
            log.warning("pool: %s", why)
        self.state, self.why = "refused" if self.state != "member" else self.state, why
        return None

    # ---- the proof ---------------------------------------------------------------------------------
    def live_members(self) -> dict[str, S.HostEntry]:
        out = {}
        for kv in self.etcd.prefix(self.keys.host()):
            try:
                (name,) = self.keys.split(kv.key, "hosts")
                entry = S.parse("hosts", kv.value)
                if entry.host != name:
                    raise S.BadEntry(f"names host {entry.host} under {name}")
            except S.BadEntry as e:
                self.refused(kv.key, str(e))
                continue
            out[name] = entry
        return out

    def prove(self, members: dict[str, S.HostEntry]) -> bool:
        """One step of joining; True once this host is a member."""
        if self.state == "member":
            return True
        others = [h for h, e in members.items() if h != self.host and e.state == "member"]
        if not others:
            return self._prove_alone()
        if not self._nonce:
            self._nonce = os.urandom(16).hex()
            slot = PoolDevice.slot_offset(random.randrange(1, 1 << 30))
            self.device.write_nonce(slot, self._nonce, self.host)
            self.etcd.put(self.keys.join(self.host), S.dump(S.JoinEntry(self._nonce, slot)), self.lease)
            self._joined_at = time.monotonic()
            self.state, self.why = "joining", f"waiting for a member ({', '.join(others)}) to read its nonce"
            return False
        for kv in self.etcd.prefix(self.keys.ack(self.host)):
            try:
                _, member = self.keys.split(kv.key, "ack")
                ack = S.parse("ack", kv.value)
            except S.BadEntry as e:
                self.refused(kv.key, str(e))
                continue
            if ack.nonce != self._nonce or member not in others:
                continue
            if not ack.same:
                return self._fail(f"member {member} read another value where this host wrote its nonce: "
                                  f"{self.device.path} is not the pool's memory")
            return self._joined(f"member {member} read this host's nonce on its device")
        if time.monotonic() - self._joined_at > 3 * self.cfg.lease_ttl_s:
            return self._fail(f"no member ({', '.join(others)}) acknowledged the nonce in "
                              f"{3 * self.cfg.lease_ttl_s} s")
        return False

    def _prove_alone(self) -> bool:
        """No live member: the nonce the last one left in slot 0 must be on this device."""
        pool = self.pool
        found = self.device.read_nonce(LAST_NONCE_SLOT)
        if found != pool.nonce:
            return self._fail(f"slot 0 of {self.device.path} does not hold the nonce host {pool.nonce_by} "
                              "left there: not the pool's memory")
        new = os.urandom(16).hex()
        self.device.write_nonce(LAST_NONCE_SLOT, new, self.host)
        rotated = S.PoolDef(**{**pool.__dict__, "nonce": new, "nonce_by": self.host})
        if not self.etcd.txn([E.cmp_mod(self.keys.pool, self.pool_revision)],
                             [E.op_put(self.keys.pool, S.dump(rotated))]):
            # another host changed the pool meanwhile (it rotated the nonce): prove again next time
            self.device.write_nonce(LAST_NONCE_SLOT, pool.nonce, pool.nonce_by)
            return False
        self.pool = rotated
        by = "this host's own" if pool.nonce_by == self.host else f"host {pool.nonce_by}'s"
        return self._joined(f"alone: {by} nonce found in slot 0")

    def _joined(self, how: str) -> bool:
        self.state, self.why, self.proved_by = "member", "", how
        log.info("pool: %s joined pool %s (%s)", self.host, self.pool.uuid, how)
        try:
            self.etcd.delete(self.keys.join(self.host))
        except E.EtcdUnavailable:
            pass                               # it goes with the lease
        return True

    def _fail(self, why: str) -> bool:
        self.state, self.why, self._nonce = "refused", why, ""
        log.error("pool: %s", why)
        return False

    def answer_joins(self) -> int:
        """As a member: read every joining host's nonce slot on this device and say what was there."""
        if self.state != "member":
            return 0
        n = 0
        for kv in self.etcd.prefix(self.keys.join()):
            try:
                (host,) = self.keys.split(kv.key, "join")
                entry = S.parse("join", kv.value)
            except S.BadEntry as e:
                self.refused(kv.key, str(e))
                continue
            if host == self.host:
                continue
            ack_key = self.keys.ack(host, self.host)
            seen = self.etcd.get(ack_key)
            if seen is not None and _nonce_of(seen.value) == entry.nonce:
                continue
            try:
                same = self.device.read_nonce(entry.offset) == entry.nonce
            except DeviceError as e:
                self.refused(kv.key, str(e))
                continue
            self.etcd.put(ack_key, S.dump(S.AckEntry(entry.nonce, same)), self.lease)
            n += 1
        return n


def _nonce_of(value: bytes) -> str:
    try:
        return S.parse("ack", value).nonce
    except S.BadEntry:
        return ""
