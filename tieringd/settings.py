# SPDX-License-Identifier: Apache-2.0
"""Every table of the configuration file, checked at once.

Each stage owns its table as a frozen dataclass (docs/configuration.md); this module only knows the
list, so that ``tieringd --check-config FILE``, a start and a SIGHUP reload refuse the same files with
the same one-line message, ``tieringd.toml:14: [policy] interval_ms: expected …, got "fast"``:

- an unknown table, or a key outside any table, is refused like an unknown key;
- every table present or not is built (defaults fill what is absent), so a value that is wrong only
  in combination with a default (``low_watermark`` above the default ``high_watermark``) is caught;
- the error is placed on its line by :meth:`tieringd.config.ConfigFile.locate`.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, Mapping

from tieringd.placement import blocksize, heat, policy, prefetch
from tieringd import config
from tieringd.service import lifecycle
from tieringd.memory import probe, topology
from tieringd.shim import settings as shim_settings
from tieringd.config import ConfigError, ConfigFile, from_table, section
from tieringd.mover import MoverConfig
from tieringd.sampling.options import SamplingConfig


def _typed(cls: type, name: str) -> Callable[[Mapping[str, Any]], Any]:
    """``from_table(cls, name, table)``; the tables that still have their own ``from_config`` (heat,
    policy, prefetch until they move to from_table) are built by it."""
    own = cls.__dict__.get("from_config")

    def build(table: Mapping[str, Any]) -> Any:
        return own.__get__(None, cls)(table) if own is not None else from_table(cls, name, table)
    return build


def _topology(table: Mapping[str, Any]) -> dict:
    overrides = topology.tier_overrides({"topology": table})
    return {"nodes": overrides, "probe_file": probe.saved_path({"topology": table})}


def _service_tables() -> dict[str, Callable[[Mapping[str, Any]], Any]]:
    # imported here: control and metrics import this module's neighbours, not the other way round
    from tieringd.service.control import ControlConfig
    from tieringd.service.metrics import MetricsConfig
    return {"control": lambda t: from_table(ControlConfig, "control", t),
            "metrics": lambda t: from_table(MetricsConfig, "metrics", t),
            "lifecycle": lambda t: from_table(lifecycle.LifecycleConfig, "lifecycle", t)}


def _memory_tables() -> dict[str, Callable[[Mapping[str, Any]], Any]]:
    # imported here: hotplug and remap import the daemon's neighbours (dax, registry)
    from tieringd.memory.hotplug import HotplugConfig
    from tieringd.shim.remap import DaxConfig
    return {"hotplug": lambda t: from_table(HotplugConfig, "hotplug", t),
            "dax": lambda t: from_table(DaxConfig, "dax", t)}


def tables() -> dict[str, Callable[[Mapping[str, Any]], Any]]:
    """Table name → the function that builds it from its TOML table (in the file's usual order)."""
    return {
        "topology": _topology,
        "shim": lambda t: from_table(shim_settings.ShimSettings, "shim", t),
        "sampling": lambda t: from_table(SamplingConfig, "sampling", t),
        "heat": _typed(heat.HeatConfig, "heat"),
        "policy": _typed(policy.PolicyConfig, "policy"),
        "prefetch": _typed(prefetch.PrefetchConfig, "prefetch"),
        "blocksize": lambda t: from_table(blocksize.BlockSizer, "blocksize", t),
        "mover": lambda t: from_table(MoverConfig, "mover", t),
        **_service_tables(),
        **_memory_tables(),
    }


def check(cfg: ConfigFile) -> dict[str, Any]:
    """Build every table of ``cfg``; returns {table: its dataclass}. Raises a located ConfigError."""
    known = tables()
    try:
        for name, value in cfg.items():
            if name not in known:
                what = "unknown table" if isinstance(value, Mapping) else "a key outside any table"
                raise ConfigError(f"[{name}]: {what} (tables: {', '.join(known)})",
                                  table=name if isinstance(value, Mapping) else None,
                                  key=None if isinstance(value, Mapping) else name)
        return {name: build(section(cfg, name)) for name, build in known.items()}
    except ConfigError as e:
        raise cfg.locate(e) from None


def load(path: str | None = None) -> tuple[ConfigFile, dict[str, Any]]:
    """:func:`tieringd.config.load` then :func:`check`: the file and its built tables."""
    cfg = config.load(path)
    return cfg, check(cfg)


def check_file(path: str, out=None, err=None) -> int:
    """``tieringd --check-config FILE``: 0 and "FILE: ok" on stdout, or 1 and the one-line error."""
    out, err = out or sys.stdout, err or sys.stderr
    try:
        cfg, built = load(path)
    except ConfigError as e:
        err.write(f"{e}\n")
        return 1
    present = [name for name in built if name in cfg]
    out.write(f"{path}: ok ({', '.join(present) or 'no tables'}: given; the rest default)\n")
    return 0


def as_dict(built: Mapping[str, Any]) -> dict[str, Any]:
    """The built tables as plain values (for ``policy get`` and the status)."""
    out = {}
    for name, obj in built.items():
        out[name] = dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj
    return out


# ---- the default file -------------------------------------------------------------------------------

_UNIT_SUFFIXES = (("_mb_s", "MB/s"), ("_ms", "milliseconds"), ("_s", "seconds"), ("_bytes", "bytes"),
                  ("_tokens", "tokens"), ("_blocks", "blocks"), ("_pages", "pages"))

HEADER = """\
# /etc/tieringd/tieringd.toml — the tieringd configuration (docs/configuration.md).
#
# Every key is shown with its default, commented out: uncomment what you change. Sizes take binary
# suffixes ("4M", "1.5GiB"). Check a file with `tieringd --check-config FILE`; a running daemon
# re-reads this file on SIGHUP (`systemctl reload tieringd`) and keeps its old settings when the new
# file has an error (the error names file:line and key, in the journal).
# Generated from the code by `tieringd --print-default-config`.
"""

_TABLE_NOTES = {
    "topology": "node tiers beyond the evidence (docs/topology.md#configuration)",
    "shim": "what `tieringctl run` and the CONFIG record tell the shim (docs/shim.md); unset = the shim's own",
    "sampling": "the access samplers (docs/sampling.md)",
    "heat": "the 4-factor heat; weights are normalised to sum to 1 (docs/heat-policy.md)",
    "policy": "the placement plan per tick (docs/heat-policy.md)",
    "prefetch": "sequential read-ahead (docs/heat-policy.md)",
    "blocksize": "tokens per KV block by region size (docs/heat-policy.md)",
    "mover": "the migration engine (docs/mover.md)",
    "control": "the control socket tieringctl talks to (docs/service.md)",
    "metrics": "Prometheus exposition, off unless listen is set (docs/service.md)",
    "lifecycle": "process exit/exec events (docs/service.md)",
    "hotplug": "memory that arrives at run time: udev helper and the daemon's uevent listener (docs/dax.md)",
    "dax": "the DAX-remap tier: a log file on fsdax or a devdax device (docs/dax.md)",
}


def _classes() -> dict[str, type]:
    from tieringd.service.control import ControlConfig
    from tieringd.memory.hotplug import HotplugConfig
    from tieringd.service.metrics import MetricsConfig
    from tieringd.shim.remap import DaxConfig
    return {"shim": shim_settings.ShimSettings, "sampling": SamplingConfig, "heat": heat.HeatConfig,
            "policy": policy.PolicyConfig, "prefetch": prefetch.PrefetchConfig,
            "blocksize": blocksize.BlockSizer, "mover": MoverConfig, "control": ControlConfig,
            "metrics": MetricsConfig, "lifecycle": lifecycle.LifecycleConfig, "hotplug": HotplugConfig,
            "dax": DaxConfig}


def _source_comments(cls: type) -> dict[str, str]:
    """``name: type = default  # comment`` lines of a dataclass's source: {name: comment}."""
    import inspect
    import re
    out = {}
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"^\s+(\w+)\s*:[^#]*#\s*(.+)$", line)
        if m:
            out[m[1]] = m[2].strip()
    return out


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def _unit(field: dataclasses.Field) -> str | None:
    unit = field.metadata.get("unit")
    if unit:
        return unit
    return next((u for suffix, u in _UNIT_SUFFIXES if field.name.endswith(suffix)), None)


def default_file_text() -> str:
    """The shipped etc/tieringd.toml: every table, every key with its default, unit and meaning."""
    lines = [HEADER, f"# [topology] — {_TABLE_NOTES['topology']}", "[topology]",
             f"# probe_file = {_toml(probe.DEFAULT_FILE)}  # path; figures of `tieringctl probe --save` (\"\" = none)",
             "# an example (node 2's tier, whatever its evidence says: dram | cxl-dram | pmem):",
             "#   [topology.nodes.2]", '#   tier = "pmem"',
             ""]
    for name, cls in _classes().items():
        lines += [f"# [{name}] — {_TABLE_NOTES[name]}", f"[{name}]"]
        notes = _source_comments(cls)
        defaults = cls()
        mappings = []
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            value = getattr(defaults, f.name)
            unit = None if isinstance(value, bool) else _unit(f)     # memory_blocks is a flag
            comment = "; ".join(x for x in (unit, f.metadata.get("doc") or notes.get(f.name)) if x)
            if isinstance(value, Mapping):
                mappings.append((f, comment))
                continue
            if value is None:
                lines.append(f"# {f.name} =  # unset by default" + (f"; {comment}" if comment else ""))
            else:
                lines.append(f"# {f.name} = {_toml(value)}" + (f"  # {comment}" if comment else ""))
        for f, comment in mappings:
            lines += [f"# [{name}.{f.name}]: {comment or 'a table'}; none by default. An example:",
                      f"#   [{name}.{f.name}]", '#   "cgroup:/inference/a" = "8G"']
        lines.append("")
    return "\n".join(lines)
