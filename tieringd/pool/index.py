# SPDX-License-Identifier: Apache-2.0
"""Identical KV stored once across hosts: the pool's index of shared blocks (``P index/…``).

A *shared block* is a run of bytes on the pool's device, in an extent claimed ``shared``, written
once by the host that published it and never written again. The index maps the sha256 of those
bytes to where they are; it holds one key per host that references the block::

    P index/<sha256>/<host>      IndexEntry(extent, offset, length)    under <host>'s lease
    P claims/<extent>/<host>     ClaimEntry("shared")                  under <host>'s lease

A reference is a host's two keys: its index key (the reference count is the number of keys under
``P index/<sha256>/``) and its ``shared`` claim on the block's extent, so the extent stays out of
every host's log for as long as any host references a block in it — the publisher included, and
after the publisher died. Everything hangs on leases: a dead host's references go with its lease,
and the extent comes free when the last reference went. Nothing else cleans up.

**Publish** (:meth:`SharedIndex.publish`): the caller has written the bytes into an extent it
claimed ``shared`` and flushed them (:meth:`PoolDevice.write_block`); the index key goes in only if
no key of that digest is there (one transaction), so two hosts publishing the same bytes at once end
with one copy: the loser references the winner's and gives its own space back.

**Reference** (:meth:`SharedIndex.reference`): never on a hash alone. The host reads the block on its
own device and compares it byte for byte with its own bytes; the entry must lie inside an extent its
holder claims ``shared`` (a forged entry pointing into another host's writable log is refused, though
its bytes may match today); then one transaction puts both keys only if the holder's index key and
claim are the ones it read (unchanged since: the bytes compared cannot have been given back and
overwritten in between). A refusal is counted and logged, never trusted.

The writes a process makes into memory that references a shared block must never reach the block;
how the shim keeps them apart is docs/pool.md's "Identical KV stored once".
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import Callable

from tieringd.pool import etcd as E
from tieringd.pool import schema as S
from tieringd.pool.device import DeviceError, PoolDevice

log = logging.getLogger("tieringd.pool")


@dataclasses.dataclass(frozen=True)
class Reference:
    """One block this host references: where it is, and whether this host wrote it."""
    digest: str
    entry: S.IndexEntry
    published: bool


class SharedIndex:
    """This host's side of the index; one thread (the pool agent's) calls it."""

    def __init__(self, etcd: E.Etcd, keys: S.Keys, host: str, device: PoolDevice, extent_bytes: int,
                 refused=None):
        self.etcd, self.keys, self.host, self.device = etcd, keys, host, device
        self.extent_bytes = extent_bytes
        self.refs: dict[str, Reference] = {}
        self.mismatches = 0              # entries whose bytes were not the caller's: refused
        # where this host appends the blocks it publishes: extent → next free offset in it. Append
        # only (a published block is never written again); an extent leaves when this host lets go
        # of it, even where other hosts still reference blocks there
        self.open_extents: dict[int, int] = {}
        self.published_blocks = self.referenced_blocks = 0
        self.refused = refused or (lambda key, why: log.warning("etcd %s refused: %s", key, why))

    # ---- reading -----------------------------------------------------------------------------------
    def holders(self, digest: str) -> list[tuple[str, S.IndexEntry, E.KV]]:
        """The valid references to ``digest``: (host, entry, its key as read)."""
        out = []
        for kv in self.etcd.prefix(self.keys.index(digest)):
            try:
                got, host = self.keys.split(kv.key, "index")
                entry = S.parse("index", kv.value)
                if got != digest:
                    raise S.BadEntry(f"under digest {got}, asked for {digest}")
                self._inside_extent(entry)
            except S.BadEntry as e:
                self.refused(kv.key, str(e))
                continue
            out.append((host, entry, kv))
        return out

    def _inside_extent(self, entry: S.IndexEntry) -> None:
        lo = entry.extent * self.extent_bytes
        if not (lo <= entry.offset and entry.offset + entry.length <= lo + self.extent_bytes):
            raise S.BadEntry(f"block {entry.offset:#x}+{entry.length:#x} is not inside extent {entry.extent}")
        if entry.offset + entry.length > self.device.size_bytes:
            raise S.BadEntry(f"block {entry.offset:#x}+{entry.length:#x} is beyond the device")

    def references(self, digest: str) -> int:
        return len(self.holders(digest))

    # ---- publishing and referencing ------------------------------------------------------------------
    def publish(self, digest: str, entry: S.IndexEntry, lease: int) -> bool:
        """Put this host's block in the index if no host published those bytes yet; False when one
        did (then :meth:`reference` theirs and give this copy's space back)."""
        entry.check()
        self._inside_extent(entry)
        if self.device.digest(entry.offset, entry.length) != digest:
            raise DeviceError(f"block {entry.offset:#x}+{entry.length:#x} does not hold {digest[:16]}…: "
                              "not written (or not flushed) yet")
        claim = self.keys.claims(entry.extent, self.host)
        ok = self.etcd.txn([E.cmp_none_under(self.keys.index(digest)), E.cmp_present(claim)],
                           [E.op_put(self.keys.index(digest, self.host), S.dump(entry), lease)])
        if ok:
            self.refs[digest] = Reference(digest, entry, published=True)
        return ok

    def reference(self, digest: str, data: bytes, lease: int) -> S.IndexEntry | None:
        """A reference to the published block holding ``data`` (whose sha256 is ``digest``), after
        its bytes on this host's device compared equal; None when there is none to take."""
        if digest in self.refs:
            return self.refs[digest].entry
        for host, entry, kv in self.holders(digest):
            if entry.length != len(data):
                self.refused(kv.key, f"{entry.length} bytes, the block has {len(data)}")
                continue
            claim = self.etcd.get(self.keys.claims(entry.extent, host))
            if claim is None or _kind(claim.value) != "shared":
                self.refused(kv.key, f"extent {entry.extent} is not claimed shared by {host}")
                continue
            if self.device.read(entry.offset, entry.length) != data:
                self.mismatches += 1
                self.refused(kv.key, f"the bytes at {entry.offset:#x} are not the block's (same digest claimed)")
                continue
            if self.etcd.txn([E.cmp_mod(kv.key, kv.mod_revision), E.cmp_mod(claim.key, claim.mod_revision)],
                             [E.op_put(self.keys.index(digest, self.host), S.dump(entry), lease),
                              E.op_put(self.keys.claims(entry.extent, self.host),
                                       S.dump(S.ClaimEntry("shared")), lease)]):
                self.refs[digest] = Reference(digest, entry, published=False)
                return entry
        return None

    def store(self, data: bytes, lease: int, claim_extent: Callable[[], int | None]) -> Reference | None:
        """Keep ``data`` (a page-multiple block) in the pool once: a reference to the copy another
        host published when its bytes compare equal, else this host's own copy appended to one of
        its shared extents (``claim_extent()`` claims another when none has room) and published.
        None when the pool has no room for it."""
        digest = hashlib.sha256(data).hexdigest()
        if digest in self.refs:
            return self.refs[digest]
        if self.reference(digest, data, lease) is not None:
            self.referenced_blocks += 1
            return self.refs[digest]
        entry = self._append(data, claim_extent)
        if entry is None:
            return None
        if self.publish(digest, entry, lease):
            self.published_blocks += 1
            return self.refs[digest]
        # another host published the same bytes meanwhile: its copy, ours is a hole of our extent
        if self.reference(digest, data, lease) is not None:
            self.referenced_blocks += 1
            return self.refs[digest]
        return None

    def _append(self, data: bytes, claim_extent: Callable[[], int | None]) -> S.IndexEntry | None:
        if len(data) % 4096 or not 0 < len(data) <= self.extent_bytes:
            raise ValueError(f"a block of {len(data)} bytes: not whole pages of at most one extent")
        at = next((x for x, used in self.open_extents.items() if used + len(data) <= self.extent_bytes), None)
        if at is None:
            at = claim_extent()
            if at is None:
                return None
            self.open_extents[at] = 0
        entry = S.IndexEntry(extent=at, offset=at * self.extent_bytes + self.open_extents[at], length=len(data))
        self.open_extents[at] += len(data)
        self.device.write_block(entry.offset, data)
        return entry

    def release(self, digest: str) -> None:
        """Drop this host's reference; its claim on the extent goes with its last block there."""
        ref = self.refs.pop(digest, None)
        if ref is None:
            return
        ops = [E.op_delete(self.keys.index(digest, self.host))]
        if not any(r.entry.extent == ref.entry.extent for r in self.refs.values()):
            ops.append(E.op_delete(self.keys.claims(ref.entry.extent, self.host)))
            self.open_extents.pop(ref.entry.extent, None)     # never written by this host again
        self.etcd.txn([], ops)

    # ---- figures -------------------------------------------------------------------------------------
    # read by report threads while the agent's thread changes ``refs``: list() copies the values in
    # one step under the GIL, where iterating the dict itself could meet a change of its size
    @property
    def shared_bytes(self) -> int:
        return sum(r.entry.length for r in list(self.refs.values()))

    @property
    def saved_bytes(self) -> int:
        """Bytes this host would hold as its own copy had it not referenced another host's."""
        return sum(r.entry.length for r in list(self.refs.values()) if not r.published)


def _kind(value: bytes) -> str:
    try:
        return S.parse("claims", value).kind
    except S.BadEntry:
        return ""
