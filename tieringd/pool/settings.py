# SPDX-License-Identifier: Apache-2.0
"""The ``[pool]`` table: one CXL memory pool shared by several hosts (docs/pool.md).

The pool is off until ``endpoints`` names etcd. Then ``device`` is the devdax device (or file) every host maps
(the same memory, proven at join), ``prefix`` the part of etcd's key space this pool owns (several
pools, or tenants, in one etcd), and ``weight``/``min_bytes``/``max_bytes`` this host's share of it.
"""
from __future__ import annotations

import dataclasses
import re

from tieringd.config import ConfigError, Table, ranged

MiB = 1 << 20
GiB = 1 << 30

HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
PREFIX = re.compile(r"/[A-Za-z0-9._/-]{0,200}/")
ENDPOINT = re.compile(r"[A-Za-z0-9.-]{1,253}:[0-9]{1,5}")
DEVDAX = re.compile(r"/dev/dax[0-9]+\.[0-9]+")
# a file every host maps: a test's stand-in for the device, or one file on a shared fsdax mount
FILE = re.compile(r"/(?!dev/)[^\0\n]{1,4095}")


@dataclasses.dataclass(frozen=True)
class PoolConfig(Table):
    """The ``[pool]`` table (docs/pool.md)."""
    NAME = "pool"
    endpoints: tuple[str, ...] = dataclasses.field(default=(), metadata={
        "doc": 'etcd members, "host:port" each (the v3 gateway, etcd 3.4+); empty: no pool'})
    prefix: str = dataclasses.field(default="/tieringd/pool/", metadata={
        "doc": "the key prefix this pool owns in etcd (one per pool or tenant); starts and ends with /"})
    device: str = dataclasses.field(default="", metadata={
        "doc": "the pool's memory on this host: its devdax device (/dev/daxX.Y), or a file every host "
               "maps (an absolute path)"})
    host: str = dataclasses.field(default="", metadata={
        "doc": "this host's name in the pool; empty: the machine's host name"})
    weight: float = ranged(1.0, 0.01, 1000, doc=(
        "this host's share of the pool against the others' when it runs short"))
    min_bytes: int = ranged(0, 0, 1 << 50, unit="bytes", doc="kept free for this host while it is "
                            "below it: others claim nothing that would eat into it")
    max_bytes: int = ranged(0, 0, 1 << 50, unit="bytes", doc="the most this host claims; 0: no cap")
    lease_ttl_s: int = ranged(10, 2, 3600, unit="seconds", doc=(
        "how long this host's claims and references outlive it (its etcd lease)"))
    extent_bytes: int = ranged(64 * MiB, 2 * MiB, 16 * GiB, unit="bytes", doc=(
        "the unit of a claim; fixed by the first host when it creates the pool"))

    @property
    def enabled(self) -> bool:
        return bool(self.endpoints)

    def validate(self) -> None:
        super().validate()
        for ep in self.endpoints:
            if not ENDPOINT.fullmatch(ep) or not 0 < int(ep.rsplit(":", 1)[1]) < 65536:
                raise ConfigError.bad_value("pool", "endpoints", '"host:port" entries', ep)
        if not PREFIX.fullmatch(self.prefix) or "//" in self.prefix:
            raise ConfigError.bad_value("pool", "prefix", "a path that starts and ends with /, "
                                        "letters, digits, . _ - /", self.prefix)
        if self.device and not (DEVDAX.fullmatch(self.device) or FILE.fullmatch(self.device)):
            raise ConfigError.bad_value("pool", "device", "a devdax device (/dev/daxX.Y) or an absolute "
                                        "path of a file", self.device)
        if self.enabled and not self.device:
            raise ConfigError.bad_value("pool", "device", "the pool's devdax device when endpoints are set",
                                        self.device)
        if self.host and not HOST_NAME.fullmatch(self.host):
            raise ConfigError.bad_value("pool", "host", "letters, digits, . _ -, at most 63", self.host)
        if self.extent_bytes % (2 * MiB):
            raise ConfigError.bad_value("pool", "extent_bytes", "a multiple of 2 MiB", self.extent_bytes)
        if self.max_bytes and self.max_bytes < self.min_bytes:
            raise ConfigError.bad_value("pool", "max_bytes", f"0 or at least min_bytes ({self.min_bytes})",
                                        self.max_bytes)
