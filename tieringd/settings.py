# SPDX-License-Identifier: Apache-2.0
"""Every table of the configuration file: one list, built and checked together.

:data:`TABLES` names each table's class, in the file's usual order; every class is a
:class:`tieringd.config.Table` (a frozen dataclass with ``from_config(table)``), owned by the part that
reads it. :meth:`Settings.from_config` builds them all, so that ``tieringd --check-config FILE``, a
start and a SIGHUP reload refuse the same files with the same one-line message,
``tieringd.toml:14: [policy] interval_ms: expected …, got "fast"``:

- an unknown table, or a key outside any table, is refused like an unknown key;
- every table present or not is built (defaults fill what is absent), so a value that is wrong only
  in combination with a default (``low_watermark`` above the default ``high_watermark``) is caught;
- the error is placed on its line by :meth:`tieringd.config.ConfigFile.locate`.

The daemon builds a new :class:`Settings` first and swaps only when all of it is good, so a bad file
never leaves half of the new settings in force.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import re
import sys
import typing
from typing import Any, Mapping

from tieringd import config
from tieringd.config import ConfigError, ConfigFile, Table, section, toml_value
from tieringd.daemon.sharing import SharingConfig
from tieringd.memory.hotplug import HotplugConfig
from tieringd.memory.probe import DEFAULT_FILE as DEFAULT_PROBE_FILE
from tieringd.memory.topology import TopologySettings
from tieringd.mover import MoverConfig
from tieringd.placement.blocksize import BlockSizer
from tieringd.placement.heat import HeatConfig
from tieringd.placement.policy import PolicyConfig
from tieringd.placement.prefetch import PrefetchConfig
from tieringd.pool.settings import PoolConfig
from tieringd.sampling.options import SamplingConfig
from tieringd.service.control import ControlConfig
from tieringd.service.lifecycle import LifecycleConfig
from tieringd.service.metrics import MetricsConfig
from tieringd.shim.remap import DaxConfig
from tieringd.shim.settings import ShimSettings

# table → (class, what it is for): the one list of tables, in the file's usual order
TABLES: dict[str, tuple[type[Table], str]] = {
    "topology": (TopologySettings, "node tiers beyond the evidence (docs/topology.md#configuration)"),
    "shim": (ShimSettings, "what `tieringctl run` and the CONFIG record tell the shim (docs/shim.md); "
                           "unset = the shim's own"),
    "sampling": (SamplingConfig, "the access samplers (docs/sampling.md)"),
    "heat": (HeatConfig, "the 4-factor heat; weights are normalised to sum to 1 (docs/heat-policy.md)"),
    "sharing": (SharingConfig, "how the daemon learns each KV block's sharers, a budget per tick: pages "
                               "mapped by several processes, KSM merges, identical cold blocks "
                               "(docs/heat-policy.md)"),
    "policy": (PolicyConfig, "the placement plan per tick (docs/heat-policy.md)"),
    "prefetch": (PrefetchConfig, "sequential read-ahead (docs/heat-policy.md)"),
    "blocksize": (BlockSizer, "tokens per KV block by region size (docs/heat-policy.md)"),
    "mover": (MoverConfig, "the migration engine (docs/mover.md)"),
    "control": (ControlConfig, "the control socket tieringctl talks to (docs/service.md)"),
    "metrics": (MetricsConfig, "Prometheus exposition, off unless listen is set (docs/service.md)"),
    "lifecycle": (LifecycleConfig, "process exit/exec events (docs/service.md)"),
    "hotplug": (HotplugConfig, "memory that arrives at run time: udev helper and the daemon's uevent "
                               "listener (docs/dax.md)"),
    "dax": (DaxConfig, "the DAX-remap tier: a log file on fsdax or a devdax device (docs/dax.md)"),
    "pool": (PoolConfig, "one CXL memory pool shared by several hosts, coordinated through etcd; off "
                         "until endpoints is set (docs/pool.md)"),
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """One instance of every table's class, and the file they came from."""
    topology: TopologySettings
    shim: ShimSettings
    sampling: SamplingConfig
    heat: HeatConfig
    sharing: SharingConfig
    policy: PolicyConfig
    prefetch: PrefetchConfig
    blocksize: BlockSizer
    mover: MoverConfig
    control: ControlConfig
    metrics: MetricsConfig
    lifecycle: LifecycleConfig
    hotplug: HotplugConfig
    dax: DaxConfig
    pool: PoolConfig
    source: ConfigFile = dataclasses.field(default_factory=ConfigFile, compare=False)

    @classmethod
    def from_config(cls, cfg: ConfigFile) -> "Settings":
        """Build every table of ``cfg``. Raises a ConfigError placed at file:line when ``cfg`` came
        from a file."""
        try:
            for name, value in cfg.items():
                if name not in TABLES:
                    what = "unknown table" if isinstance(value, Mapping) else "a key outside any table"
                    raise ConfigError(f"[{name}]: {what} (tables: {', '.join(TABLES)})",
                                      table=name if isinstance(value, Mapping) else None,
                                      key=None if isinstance(value, Mapping) else name)
            return cls(**{name: klass.from_config(section(cfg, name)) for name, (klass, _) in TABLES.items()},
                       source=cfg)
        except ConfigError as e:
            raise cfg.locate(e) from None

    def tables(self) -> dict[str, Table]:
        """Table name → its built dataclass, in :data:`TABLES` order."""
        return {name: getattr(self, name) for name in TABLES}

    def as_dict(self) -> dict[str, Any]:
        """The tables as plain values (for ``policy get`` and the status)."""
        return {name: dataclasses.asdict(obj) for name, obj in self.tables().items()}

    def describe(self) -> dict[str, Any]:
        return {"interval_ms": self.policy.interval_ms, "sources": list(self.sampling.sources),
                "config": self.source.path}


def check(cfg: ConfigFile) -> Settings:
    """:meth:`Settings.from_config`: every table of ``cfg``, or a located ConfigError."""
    return Settings.from_config(cfg)


def load(path: str | None = None) -> tuple[ConfigFile, Settings]:
    """:func:`tieringd.config.load` then :func:`check`: the file and its settings."""
    cfg = config.load(path)
    return cfg, check(cfg)


def check_file(path: str, out=None, err=None) -> int:
    """``tieringd --check-config FILE``: 0 and "FILE: ok" on stdout, or 1 and the one-line error."""
    out, err = out or sys.stdout, err or sys.stderr
    try:
        cfg, _ = load(path)
    except ConfigError as e:
        err.write(f"{e}\n")
        return 1
    present = [name for name in TABLES if name in cfg]
    out.write(f"{path}: ok ({', '.join(present) or 'no tables'}: given; the rest default)\n")
    return 0


# ---- the default file -------------------------------------------------------------------------------

_UNIT_SUFFIXES = (("_mb_s", "MB/s"), ("_ms", "milliseconds"), ("_s_per_gib", "seconds per GiB"),
                  ("_s", "seconds"), ("_bytes", "bytes"), ("_tokens", "tokens"), ("_blocks", "blocks"),
                  ("_pages", "pages"))

HEADER = """\
# /etc/tieringd/tieringd.toml — the tieringd configuration (docs/configuration.md).
#
# Every key is shown with its default, commented out: uncomment what you change. Sizes take binary
# suffixes ("4M", "1.5GiB"). Check a file with `tieringd --check-config FILE`; a running daemon
# re-reads this file on SIGHUP (`systemctl reload tieringd`) and keeps its old settings when the new
# file has an error (the error names file:line and key, in the journal).
# Generated from the code by `tieringd --print-default-config`.
"""


def _source_comments(cls: type) -> dict[str, str]:
    """``name: type = default  # comment`` lines of a dataclass's source: {name: comment}."""
    import inspect
    out = {}
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"^\s+(\w+)\s*:[^#]*#\s*(.+)$", line)
        if m:
            out[m[1]] = m[2].strip()
    return out


def _unit(field: dataclasses.Field) -> str | None:
    unit = field.metadata.get("unit")
    if unit:
        return unit
    return next((u for suffix, u in _UNIT_SUFFIXES if field.name.endswith(suffix)), None)


def _range_text(field: dataclasses.Field) -> str:
    """The key's range as the checks word it (``[1, 60000]``), "" for a key without one."""
    rng = config.range_of(field)
    return rng.text(field.metadata.get("unit")) if rng is not None else ""


def _unit_and_range(field: dataclasses.Field, unit: str | None) -> str:
    """``milliseconds, in [1, 60000]`` for the default file's comment."""
    rng = _range_text(field)
    return ", ".join(x for x in (unit, f"in {rng}" if rng else "") if x)


def _meaning(field: dataclasses.Field, notes: Mapping[str, str]) -> str | None:
    """What a key does: its ``doc`` metadata, else the comment on its line."""
    return field.metadata.get("doc") or notes.get(field.name)


def default_file_text() -> str:
    """The shipped etc/tieringd.toml: every table, every key with its default, unit and meaning."""
    lines = [HEADER, f"# [topology] — {TABLES['topology'][1]}", "[topology]",
             f"# probe_file = {toml_value(DEFAULT_PROBE_FILE)}  # path; figures of `tieringctl probe --save` (\"\" = none)",
             "# an example (node 2's tier, whatever its evidence says: dram | cxl-dram | pmem):",
             "#   [topology.nodes.2]", '#   tier = "pmem"',
             ""]
    for name, (cls, note) in TABLES.items():
        if name == "topology":
            continue
        lines += [f"# [{name}] — {note}", f"[{name}]"]
        notes = _source_comments(cls)
        defaults = cls()
        mappings = []
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            value = getattr(defaults, f.name)
            unit = None if isinstance(value, bool) else _unit(f)     # memory_blocks is a flag
            comment = "; ".join(x for x in (_unit_and_range(f, unit), _meaning(f, notes)) if x)
            if isinstance(value, Mapping):
                mappings.append((f, comment))
                continue
            if value is None:
                lines.append(f"# {f.name} =  # unset by default" + (f"; {comment}" if comment else ""))
            else:
                lines.append(f"# {f.name} = {toml_value(value)}" + (f"  # {comment}" if comment else ""))
        for f, comment in mappings:
            lines += [f"# [{name}.{f.name}]: {comment or 'a table'}; none by default. An example:",
                      f"#   [{name}.{f.name}]", '#   "cgroup:/inference/a" = "8G"']
        lines.append("")
    return "\n".join(lines)


# ---- the reference (docs/configuration.md) ----------------------------------------------------------

REFERENCE_BEGIN = "<!-- generated: tieringd --print-config-reference -->"
REFERENCE_END = "<!-- end generated -->"


def _cell(text: str) -> str:
    """Text for one cell of a markdown table: pipes escaped, one line."""
    return " ".join(text.split()).replace("|", "\\|")


def _size(n: int) -> str:
    """A byte count as the file would say it: ``"256MiB"`` when a binary unit divides it, else ``4095``."""
    for shift, suffix in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n and n % (1 << shift) == 0:
            return f'"{n >> shift}{suffix}"'
    return str(n)


def _declared_default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory()          # type: ignore[misc]


def _default_cell(value: Any, unit: str | None) -> str:
    if value is None:
        return "unset"
    if isinstance(value, Mapping):
        return "none" if not value else _cell(f"`{value}`")
    if unit == "bytes" and isinstance(value, int) and not isinstance(value, bool):
        return f"`{_size(value)}`"
    return _cell(f"`{toml_value(value)}`")


def _note_text(note: str) -> str:
    """A table's note as a sentence, its docs/X.md references as links from docs/."""
    text = note[:1].upper() + note[1:] + ("" if note.endswith(".") else ".")
    return re.sub(r"docs/([\w-]+\.md(?:#[\w-]+)?)", r"[docs/\1](\1)", text)


def _reference_row(name: str, f: dataclasses.Field, hint: Any, meaning: str) -> str:
    """``| key | type | default | range | unit | meaning |`` for one key; a nested mapping is one row for its
    sub-table (``[policy.quotas]``, or ``[topology.nodes.N]`` when its keys are integers)."""
    unit = None if hint is bool else _unit(f)
    if typing.get_origin(hint) in (dict, collections.abc.Mapping):
        key_hint, value_hint = typing.get_args(hint)
        by_int = key_hint is int
        key = f"[{name}.{f.name}.N]" if by_int else f"[{name}.{f.name}]"
        what = "a table per N (an integer)" if by_int else f"a table, each value {config.describe(value_hint, unit)}"
        meaning = "a sub-table" + (f": {meaning}" if meaning else "")
    else:
        key, what = f.name, config.describe(hint, "bytes" if unit == "bytes" else None)
    default = _default_cell(_declared_default(f), unit)
    rng = _range_text(f)
    return f"| `{key}` | {_cell(what)} | {default} | {_cell(rng)} | {unit or ''} | {_cell(meaning)} |"


def reference_keys() -> dict[str, list[str]]:
    """Table → its keys, as the reference lists them (a nested mapping by its field name)."""
    return {name: [f.name for f in dataclasses.fields(cls) if f.init] for name, (cls, _) in TABLES.items()}


def reference_markdown() -> str:
    """The reference part of docs/configuration.md: per table of :data:`TABLES`, in order, its note and
    a row per key (type as :func:`tieringd.config.describe` words it, default, range, unit, meaning —
    the comments :func:`default_file_text` uses). ``tieringd --print-config-reference`` prints it."""
    keys = sum(len(k) for k in reference_keys().values())
    lines = [f"{len(TABLES)} tables, {keys} keys, generated from the code by "
             "`tieringd --print-config-reference`. Every key is optional; an absent key has its "
             "default, and \"unset\" leaves the choice to the part that reads it. A number outside its "
             "range (each end included under [ ], excluded under ( ); NaN and infinities never) is "
             "refused by `--check-config`, a start, a reload and `tieringctl policy set` alike.", ""]
    for name, (cls, note) in TABLES.items():
        notes, hints = _source_comments(cls), typing.get_type_hints(cls)
        lines += [f"## [{name}]", "", f"{_note_text(note)} Read by `{cls.__module__}.{cls.__qualname__}`.", "",
                  "| key | type | default | range | unit | meaning |", "|---|---|---|---|---|---|",
                  *(_reference_row(name, f, hints[f.name], _meaning(f, notes) or "")
                    for f in dataclasses.fields(cls) if f.init), ""]
    return "\n".join(lines)
