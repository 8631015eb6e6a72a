# SPDX-License-Identifier: Apache-2.0
"""Every table the daemon reads, validated together before anything uses them.

:meth:`Settings.from_config` builds each stage's frozen dataclass from its table of the configuration
file (``docs/configuration.md``); the first bad key raises one :class:`~tieringd.config.ConfigError`
placed on its file and line. ``Daemon.apply_config`` builds a new :class:`Settings` first and swaps
only when all of it is good, so a bad file never leaves half of the new settings in force.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from tieringd import config
from tieringd.placement.blocksize import BlockSizer
from tieringd.placement.heat import HeatConfig
from tieringd.memory.hotplug import HotplugConfig
from tieringd.mover import MoverConfig
from tieringd.placement.policy import PolicyConfig
from tieringd.placement.prefetch import PrefetchConfig
from tieringd.sampling import SamplingConfig
from tieringd.shim.settings import ShimSettings


def _build(cls: type, name: str, cfg: config.ConfigFile):
    """A stage's table through its own ``from_config`` where it has one, else ``from_table``."""
    table = config.section(cfg, name)
    own = getattr(cls, "from_config", None)
    return own(table) if own is not None else config.from_table(cls, name, table)


@dataclasses.dataclass(frozen=True)
class Settings:
    heat: HeatConfig
    policy: PolicyConfig
    prefetch: PrefetchConfig
    sampling: SamplingConfig
    mover: MoverConfig
    blocksize: BlockSizer
    shim: ShimSettings
    hotplug: HotplugConfig
    source: config.ConfigFile       # the file as read (the topology reads its own table from it)

    @classmethod
    def from_config(cls, cfg: config.ConfigFile) -> "Settings":
        """Raises ConfigError (with file:line when ``cfg`` came from a file)."""
        try:
            from tieringd.memory import topology
            topology.tier_overrides(cfg)                       # [topology] is checked now, read later
            return cls(heat=_build(HeatConfig, "heat", cfg),
                       policy=_build(PolicyConfig, "policy", cfg),
                       prefetch=_build(PrefetchConfig, "prefetch", cfg),
                       sampling=_build(SamplingConfig, "sampling", cfg),
                       mover=MoverConfig.from_config(cfg),
                       blocksize=_build(BlockSizer, "blocksize", cfg),
                       shim=_build(ShimSettings, "shim", cfg),
                       # from the whole file: HotplugConfig.from_config finds its own table
                       hotplug=HotplugConfig.from_config(cfg),
                       source=cfg)
        except config.ConfigError as e:
            raise cfg.locate(e) from None

    def describe(self) -> dict[str, Any]:
        return {"interval_ms": self.policy.interval_ms, "sources": list(self.sampling.sources),
                "config": self.source.path}
