# SPDX-License-Identifier: Apache-2.0
"""Helpers for the pool's host tests (test_pool_etcd.py, test_pool_faults.py): "hosts" as pool agents
opened as the daemon opens them (``pool.tier.open_tier``), each with its own etcd client, DAX-remap
tier and mapping of one file that stands for the shared device; heartbeats driven by the test.

The tiers are opened with the process view pointed at a captured guest (tests/fixtures/sysfs): two
"hosts" in one machine would otherwise each take the other's mappings of the device for extents its
own shims hold (``DaxTier.recover``), which two real hosts never see.

Demand is the log's live bytes (what demotions would have written), allocated and released on the
tier's log directly: the shims that write KV there are the DAX-remap tier's business (docs/dax.md)."""
from __future__ import annotations

import contextlib
from pathlib import Path

from paths import REPO
from tieringd.kernel import sysfs
from tieringd.pool import etcd as E
from tieringd.pool import schema as S
from tieringd.pool.agent import PoolAgent
from tieringd.pool.settings import PoolConfig
from tieringd.pool.tier import open_tier
from tieringd.shim.pmemlog import LogFull
from tieringd.shim.remap import DaxConfig

MiB = 1 << 20
EXT = 2 * MiB
MACHINE = REPO / "tests/fixtures/sysfs/cxl-6.12"
TTL = 4                     # etcd 3.4 grants at least 1.5 election timeouts (3 s with the cluster's 2 s)
ROUNDS = 200                # a safety net for loops that beat until a state holds, never a timing


def pool_file(tmp: Path, extents: int, name: str = "pool.dev") -> str:
    path = tmp / name
    with open(path, "wb") as f:
        f.truncate(extents * EXT)
    return str(path)


def config(etcd, device: str, host: str, **kw) -> PoolConfig:
    cfg = PoolConfig(endpoints=tuple(etcd.endpoints), prefix=kw.pop("prefix", "/t/pool/"), device=device,
                     host=host, lease_ttl_s=kw.pop("lease_ttl_s", TTL), extent_bytes=kw.pop("extent_bytes", EXT),
                     **kw)
    cfg.validate()
    return cfg


def host(cfg: PoolConfig) -> PoolAgent:
    """An agent as the daemon opens it, its heartbeats driven by the test (no thread)."""
    with sysfs.root(MACHINE):
        tier, agent = open_tier(cfg, DaxConfig(), None, None, {}, start=False)
    return agent


@contextlib.contextmanager
def hosts(*cfgs: PoolConfig):
    agents = []
    try:
        for c in cfgs:
            agents.append(host(c))
        yield agents
    finally:
        for a in agents:
            a.stop()
            a.tier.close()


def settle(agents: list[PoolAgent], done) -> None:
    """Heartbeats of every agent in turn until ``done()``."""
    for _ in range(ROUNDS):
        if done():
            return
        for a in agents:
            a.beat()
    assert done(), f"not reached after {ROUNDS} rounds: {[a.status() for a in agents]}"


def held(a: PoolAgent) -> list[int]:
    return a.status()["extents_held"]


def claims_in_etcd(etcd: E.Etcd, prefix: str = "/t/pool/") -> dict[int, list[str]]:
    """extent → holders, as etcd has them (keys of another shape, which a test put there, left out)."""
    keys = S.Keys(prefix)
    out: dict[int, list[str]] = {}
    for kv in etcd.prefix(keys.claims()):
        try:
            ext, name = keys.split(kv.key, "claims")
        except S.BadEntry:
            continue
        out.setdefault(int(ext), []).append(name)
    return out


def of(claims: dict[int, list[str]], name: str) -> set[int]:
    return {i for i, names in claims.items() if name in names}


class Demand:
    """KV bytes a host keeps in its share of the pool: extents of its log, within the capacity the
    log offers (as the policy fills the tier: never beyond it)."""

    def __init__(self, agent: PoolAgent):
        self.agent, self.extents = agent, []

    def grow(self, nbytes: int) -> int:
        """Up to ``nbytes`` more, as far as the claimed extents allow; what was added."""
        log, added = self.agent.tier.log, 0
        while added < nbytes and log.live_bytes + EXT <= log.capacity_bytes:
            try:
                e = log.allocate(EXT, 1, len(self.extents) * EXT)
            except LogFull:
                break
            self.extents.append(e)
            added += e.length
        return added

    def shrink(self, nbytes: int) -> None:
        while nbytes > 0 and self.extents:
            e = self.extents.pop()
            self.agent.tier.log.release(e.offset, e.length)
            nbytes -= e.length

    def press(self, agents: list[PoolAgent], total: int) -> None:
        """Demand up to ``total`` bytes: grow, beat (the agent claims more), until it holds it or
        claims no more."""
        for _ in range(ROUNDS):
            before = held(self.agent)
            self.grow(total - self.agent.tier.log.live_bytes)
            for a in agents:
                a.beat()
            if self.agent.tier.log.live_bytes >= total or (held(self.agent) == before and not self.grow(EXT)):
                return


@contextlib.contextmanager
def serving_pool(agent: PoolAgent, run_dir: str, metrics_listen: str = ""):
    """The daemon's service (control socket, and the metrics endpoint when ``metrics_listen``) around
    the stand-in loop of the service tests (tests/unit/daemon_standin.py: real registry, table,
    mover), with ``agent`` as its pool agent: what ``tieringctl pool`` and ``status`` ask."""
    import sys
    unit = str(REPO / "tests" / "unit")
    if unit not in sys.path:
        sys.path.insert(0, unit)               # the stand-in lives with the unit tests
    from daemon_standin import StandInDaemon
    from tieringd import settings
    from tieringd.config import ConfigFile
    from tieringd.service.service import Service
    table = {"lifecycle": {"source": "poll"}, **({"metrics": {"listen": metrics_listen}} if metrics_listen else {})}
    cfg = ConfigFile(table)
    d = StandInDaemon(cfg, run_dir=run_dir)
    d.pool = agent
    svc = Service(d, cfg, settings.check(cfg), run_dir=run_dir)
    svc.start()
    d.start_thread()
    try:
        yield svc
    finally:
        d.stop_thread()
        svc.stop()
