# SPDX-License-Identifier: Apache-2.0
"""The pool as the loop's DAX-remap tier: the log on the pool's device, written only in the extents
this host holds, and the agent that holds them (what ``Daemon._open_dax`` opens when ``[pool]`` is set).

The log's segments are the pool's extents, so its geometry is the pool's: the device's header says
it (written by the host that created the pool), else etcd's definition, else ``[pool] extent_bytes``
for a pool this host is about to create. ``[dax]``'s cleaning bound and reserve apply to this log
too; its path and size are the pool's.
"""
from __future__ import annotations

import dataclasses
import logging

from tieringd.pool import etcd as E
from tieringd.pool import schema as S
from tieringd.pool.agent import PoolAgent
from tieringd.pool.device import PoolDevice
from tieringd.pool.settings import PoolConfig
from tieringd.shim.remap import DaxConfig, DaxTier

log = logging.getLogger("tieringd.pool")


def extent_bytes(cfg: PoolConfig, device: PoolDevice, etcd: E.Etcd) -> int:
    header = device.read_header()
    if header is not None:
        return header.extent_bytes
    try:
        kv = etcd.get(S.Keys(cfg.prefix).pool)
        if kv is not None:
            return S.parse("pool", kv.value).extent_bytes
    except (E.EtcdUnavailable, E.EtcdRefused, S.BadEntry) as e:
        log.warning("pool: the pool's geometry is not readable from etcd (%s): [pool] extent_bytes", e)
    return cfg.extent_bytes


def open_tier(cfg: PoolConfig, dax: DaxConfig, registry, topology, source, *,
              start: bool = True) -> tuple[DaxTier, PoolAgent]:
    """The tier (its worker started) and the agent, after its first heartbeat; ``start``: its
    heartbeat thread too (tests drive the heartbeats themselves). Raises OSError/ValueError (device,
    etcd client) like DaxTier.open."""
    etcd = E.Etcd(cfg.endpoints)
    device = PoolDevice(cfg.device)
    try:
        ext = extent_bytes(cfg, device, etcd)
        tier_cfg = dataclasses.replace(dax, path=cfg.device, size_bytes=0, segment_bytes=ext)
        src = dict(source or {})
        src["dax"] = {**src.get("dax", {}), "path": cfg.device}
        tier = DaxTier(registry, tier_cfg, topology=topology).open(src, foreign=True)
        if start:
            tier.start()
    except BaseException:
        device.close()
        etcd.close()
        raise
    agent = PoolAgent(cfg, tier, etcd=etcd, device=device)
    agent.beat()                  # join (or say why not) before the loop's first plan
    return tier, agent.start() if start else agent
