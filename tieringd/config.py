# SPDX-License-Identifier: Apache-2.0
"""The configuration file: TOML, one table per concern, each table a typed dataclass.

Default path ``/etc/tieringd/tieringd.toml`` (``TIERINGD_CONFIG`` overrides). A missing default file
means "all defaults"; a missing file that was named explicitly, or a file that does not parse, is an
error with the file and line in the message.

Every module that owns a table declares it as a frozen dataclass and builds it with
:func:`from_table`, which converts each value by the field's type, refuses unknown keys and raises one
:class:`ConfigError` naming the table and key (the idea of memtierd's ``SetConfigJSON`` into a typed
struct per component). :func:`load` returns a :class:`ConfigFile` that remembers its path and text, so
:meth:`ConfigFile.locate` can turn an error into ``tieringd.toml:14: [policy] interval_ms: …``.

Field metadata understood by :func:`from_table`:

- ``unit``: said in the error ("milliseconds"), and ``unit="bytes"`` parses sizes (``"4M"``,
  ``"1.5GiB"``: :func:`tieringd.units.parse_size`);
- ``doc``: one line for docs/configuration.md (not used here);
- ``range``: a :class:`Range`, the finite values a numeric key takes (each element of a list, each
  value of a sub-table). Fields declare it with :func:`ranged`; :meth:`Table.validate` refuses a
  value outside it (NaN and infinities are outside every range), and docs/configuration.md lists it.

Value checks beyond the type and the range (orderings, one key against another) live in the
dataclass's ``validate()``, after ``super().validate()``, and raise
``ConfigError.bad_value(table, key, expected, got)`` too.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import math
import os
import re
import tomllib
import types
import typing
from typing import Any, Mapping, TypeVar

from tieringd.units import parse_size

DEFAULT_PATH = "/etc/tieringd/tieringd.toml"

T = TypeVar("T")


class ConfigError(ValueError):
    """A bad configuration. ``str()`` is one line — ``[table] key: expected …, got …`` for a bad value —
    prefixed with ``file:line:`` once :meth:`ConfigFile.locate` has placed it."""

    def __init__(self, message: str, *, table: str | None = None, key: str | None = None):
        self.message, self.table, self.key = message, table, key
        self.file: str | None = None
        self.line: int | None = None
        super().__init__(message)

    @classmethod
    def bad_value(cls, table: str, key: str | None, expected: str, got: Any = dataclasses.MISSING
                  ) -> "ConfigError":
        """``[table] key: expected EXPECTED, got GOT`` (GOT rendered as TOML: "fast", 12, true)."""
        where = f"[{table}] {key}" if key else f"[{table}]"
        text = f"{where}: expected {expected}"
        if got is not dataclasses.MISSING:
            text += f", got {_show(got)}"
        return cls(text, table=table, key=key)

    def __str__(self) -> str:
        if self.file is None:
            return self.message
        return f"{self.file}:{self.line}: {self.message}" if self.line else f"{self.file}: {self.message}"


def _show(value: Any) -> str:
    """A TOML-ish rendering of a value for an error message ("fast" with quotes, 12, true)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace('"', '\\"') + '"'
    if isinstance(value, Mapping):
        return "a table"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return repr(value)


class ConfigFile(dict):
    """The parsed file (a dict of tables) plus where it came from, to place errors on a line."""

    def __init__(self, data: Mapping[str, Any] | None = None, path: str | None = None, text: str = ""):
        super().__init__(data or {})
        self.path = path
        self.text = text

    def locate(self, err: ConfigError) -> ConfigError:
        """Set ``err.file`` and ``err.line`` (the line of its key in its table, else of the table's
        header); returns ``err`` for ``raise cfg.locate(e) from None``."""
        if self.path is None or err.file is not None:
            return err
        err.file = os.path.basename(self.path) if os.path.dirname(self.path) == "" else self.path
        err.line = find_line(self.text, err.table, err.key)
        return err


_HEADER = re.compile(r"^\s*\[\s*([^\]\[]+?)\s*\]\s*(#.*)?$")
_KEY_PART = re.compile(r'\s*("(?:[^"\\]|\\.)*"|\'[^\']*\'|[A-Za-z0-9_-]+)\s*')


def _dotted(text: str) -> list[str] | None:
    """``a."b c".d`` → ["a", "b c", "d"]; None when ``text`` is no TOML key."""
    parts, pos = [], 0
    while True:
        m = _KEY_PART.match(text, pos)
        if m is None:
            return None
        parts.append(m[1].strip("\"'"))
        pos = m.end()
        if pos == len(text):
            return parts
        if text[pos] != ".":
            return None
        pos += 1


def find_line(text: str, table: str | None, key: str | None) -> int | None:
    """1-based line of ``key = …`` inside ``[table]`` (or of the header when the key is not found);
    dotted tables (``policy.quotas``) match their header. A table or key given another way is found
    too: as a dotted key (``quotas.x = 1`` under ``[policy]``, ``x.y = 1`` for a table ``x``) or inside
    an inline table (``shim = { ksm = 1 }``). None when the text has neither."""
    if not text:
        return None
    target = (table.replace(" ", "").replace('"', "").split(".") if table else []) + ([key] if key else [])
    current: list[str] = []
    header_line = None
    for n, line in enumerate(text.splitlines(), 1):
        m = _HEADER.match(line)
        if m:
            current = m[1].replace(" ", "").replace('"', "").strip("[]").split(".")
            if key is not None and current == target:      # [policy.nosuch]: the key is a table here
                return n
            if table is not None and current == target[: len(target) - (1 if key else 0)]:
                if key is None:
                    return n
                header_line = header_line or n
            continue
        left, eq, _ = line.partition("=")
        parts = _dotted(left.strip()) if eq and not line.lstrip().startswith("#") else None
        if parts is None or not target:
            continue
        full = current + parts
        if full[: len(target)] == target or target[: len(full)] == full:
            return n
    return header_line


def load(path: str | None = None) -> ConfigFile:
    """The configuration file as a :class:`ConfigFile` (empty when the default file is missing)."""
    explicit = path or os.environ.get("TIERINGD_CONFIG")
    p = explicit or DEFAULT_PATH
    try:
        with open(p, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        if explicit:
            raise ConfigError(f"config file {p} does not exist") from None
        return ConfigFile()
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")          # TOML is UTF-8: a stray byte is an error, not a U+FFFD
    except UnicodeDecodeError as e:
        column = e.start - raw.rfind(b"\n", 0, e.start)
        raise _placed(ConfigError(f"not UTF-8 text (byte {raw[e.start]:#04x} at column {column})"),
                      p, raw[:e.start].count(b"\n") + 1) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise _toml_error(e, p, text) from None
    return ConfigFile(data, p, text)


_TOML_AT = re.compile(r"^(.*) \((?:at line (\d+), column (\d+)|at end of document)\)$")


def _toml_key(key: Any) -> str:
    return str(key) if re.fullmatch(r"[A-Za-z0-9_-]+", str(key)) else toml_value(str(key))


def toml_value(value: Any) -> str:
    """A value as TOML writes it (what a user pastes back into tieringd.toml or ``policy set``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _toml_error(e: tomllib.TOMLDecodeError, path: str, text: str) -> ConfigError:
    """tomllib's "Invalid value (at line 3, column 9)" as ``FILE:3: invalid TOML: Invalid value
    (column 9)``, like every other configuration error ("at end of document": the last line)."""
    m = _TOML_AT.match(str(e))
    if m is None:
        return _placed(ConfigError(f"invalid TOML: {e}"), path, None)
    what, line, column = m[1], m[2], m[3]
    if line is None:
        return _placed(ConfigError(f"invalid TOML: {what} (at the end of the file)"), path,
                       max(text.count("\n") + (0 if text.endswith("\n") else 1), 1))
    return _placed(ConfigError(f"invalid TOML: {what} (column {column})"), path, int(line))


def _placed(err: ConfigError, path: str, line: int | None) -> ConfigError:
    err.file, err.line = path, line
    return err


def section(cfg: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The table ``[name]`` (empty if absent); an error if ``name`` is there but is not a table.
    Dotted names (``policy.quotas``) walk sub-tables."""
    value: Any = cfg
    for part in name.split("."):
        value = value.get(part, {}) if isinstance(value, Mapping) else None
        if not isinstance(value, Mapping):
            raise ConfigError(f"[{name}] must be a table, not {type(value).__name__}", table=name)
    return dict(value)


def check_keys(name: str, table: Mapping[str, Any], known) -> None:
    """Refuse keys a table does not define, so a typo is an error rather than a silent default."""
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ConfigError(f"[{name}] {unknown[0]}: unknown key (known: {', '.join(sorted(known))})",
                          table=name, key=unknown[0])


# ---- ranges -----------------------------------------------------------------------------------------

_SIZE_UNITS = ((50, "PiB"), (40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB"))


@dataclasses.dataclass(frozen=True)
class Range:
    """The finite values a numeric key takes: ``lo`` to ``hi``, each end included unless it is open.
    Written as an interval, ``[1, 60000]`` or ``(0, 1]``; sizes in binary units (``[2MiB, 1PiB]``)."""
    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below

    def text(self, unit: str | None = None) -> str:
        return (("(" if self.lo_open else "[") + _number(self.lo, unit) + ", " + _number(self.hi, unit)
                + (")" if self.hi_open else "]"))


def _number(x: float, unit: str | None) -> str:
    if unit == "bytes" and x:
        for shift, suffix in _SIZE_UNITS:
            if x % (1 << shift) == 0:
                return f"{int(x) >> shift}{suffix}"
    if isinstance(x, int) or float(x).is_integer():
        return str(int(x))
    return f"{x:g}"


def ranged(default: Any, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False,
           unit: str | None = None, doc: str | None = None, factory: Any = None) -> Any:
    """A dataclass field with a :class:`Range` (and a unit, a doc line) in its metadata:
    ``interval_ms: float = ranged(100.0, 1, 60_000, unit="milliseconds")``. ``factory`` instead of
    ``default`` for a mutable default (a sub-table)."""
    meta: dict[str, Any] = {"range": Range(lo, hi, lo_open, hi_open)}
    if unit:
        meta["unit"] = unit
    if doc:
        meta["doc"] = doc
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def range_of(field: dataclasses.Field) -> Range | None:
    return field.metadata.get("range")


def check_ranges(obj: Any, table: str) -> None:
    """Refuse the first value of ``obj``'s ranged fields outside its range (``None``: unset, allowed):
    ``[policy] interval_ms: expected a number in [1, 60000] (milliseconds), got nan``."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        rng = range_of(f)
        value = getattr(obj, f.name)
        if rng is None or value is None:
            continue
        unit = f.metadata.get("unit")
        hint = hints[f.name]
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin in (dict, collections.abc.Mapping):
            for k, v in value.items():
                if v not in rng:
                    raise ConfigError.bad_value(f"{table}.{f.name}", str(k),
                                                _in(describe(args[1], unit), rng, unit), v)
        elif isinstance(value, (tuple, list)):
            if not all(v in rng for v in value):
                raise ConfigError.bad_value(table, f.name, _in(describe(hint, unit), rng, unit), list(value))
        elif value not in rng:
            raise ConfigError.bad_value(table, f.name, _in(describe(hint, unit), rng, unit), value)


def _in(what: str, rng: Range, unit: str | None) -> str:
    """``a number (milliseconds)`` + range → ``a number in [1, 60000] (milliseconds)``."""
    if unit == "bytes":
        return ("sizes" if what.startswith(("a list", "a table")) else "a size") + f" in {rng.text(unit)}"
    base, sep, paren = what.partition(" (")
    return f"{base} in {rng.text(unit)}" + (f" ({paren}" if sep else "")


# ---- typed tables -----------------------------------------------------------------------------------

class Table:
    """A configuration table's frozen dataclass: ``NAME`` is its ``[table]``, and
    ``from_config(table)`` builds it from that table's TOML values (None: all defaults), converting
    each value by its field's annotation and running ``validate()`` (:func:`from_table`). A class
    whose table needs more than that overrides ``from_config`` with the same shape."""
    NAME: typing.ClassVar[str] = ""

    @classmethod
    def from_config(cls, table: Mapping[str, Any] | None = None):
        return from_table(cls, cls.NAME, table)

    def validate(self) -> None:
        """Every numeric key within its :class:`Range`; a table with checks of its own calls this
        first (``super().validate()``)."""
        check_ranges(self, self.NAME)


def from_table(cls: type[T], name: str, table: Mapping[str, Any] | None, **fixed: Any) -> T:
    """Build the dataclass ``cls`` from the TOML table ``[name]``.

    Each key must be a field (``ConfigError`` otherwise); each value is converted by the field's
    annotation — ``bool``, ``int``, ``float``, ``str``, ``X | None``, ``tuple[X, ...]``,
    ``Mapping[str, X]`` — with ``metadata={"unit": "bytes"}`` parsing sizes. Fields named in ``fixed``
    are set by the caller, not the file. Then ``cls.validate()`` runs when the class has one.
    """
    table = {} if table is None else table
    if not isinstance(table, Mapping):
        raise ConfigError.bad_value(name, None, "a table", table)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and f.name not in fixed}
    check_keys(name, table, fields)
    hints = typing.get_type_hints(cls)
    kwargs = dict(fixed)
    for key, value in table.items():
        f = fields[key]
        kwargs[key] = convert(value, hints[key], name, key, f.metadata.get("unit"))
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate()
    return obj


def describe(hint: Any, unit: str | None = None) -> str:
    """What a value of this annotation looks like, for errors ("an integer (milliseconds)")."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if unit == "bytes":
        text = 'a size ("4M", "1.5GiB" or bytes)'
        unit = None
    elif hint is bool:
        text = "true or false"
    elif hint is int:
        text = "an integer"
    elif hint is float:
        text = "a number"
    elif hint is str:
        text = "a string"
    elif origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return describe(inner[0], unit) if len(inner) == 1 else " or ".join(describe(a, unit) for a in inner)
    elif origin in (tuple, list, collections.abc.Sequence):
        text = f"a list of {_plural(describe(args[0], None))}"
    elif origin in (dict, collections.abc.Mapping):
        text = f"a table of {_plural(describe(args[1], unit))}"
        unit = None
    else:
        text = getattr(hint, "__name__", str(hint))
    return f"{text} ({unit})" if unit else text


def _plural(text: str) -> str:
    for article in ("an ", "a "):
        if text.startswith(article):
            word, _, rest = text[len(article):].partition(" ")
            return f"{word}s {rest}".strip() if not word.endswith("s") else text[len(article):]
    return text


def convert(value: Any, hint: Any, table: str, key: str, unit: str | None = None) -> Any:
    """One TOML value → the annotation's type, or ConfigError(table, key, what was expected, value)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    bad = ConfigError.bad_value(table, key, describe(hint, unit), value)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"{table}.{key}: only X | None unions are supported")
        return convert(value, inner[0], table, key, unit)
    if unit == "bytes" and hint in (int, float):
        try:
            return parse_size(value, f"[{table}] {key}")
        except ValueError:
            raise bad from None
    if hint is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
            raise bad
        return int(value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        try:
            return float(value)
        except OverflowError:           # an integer beyond any float: no key's range holds it
            raise bad from None
    if hint is str:
        if not isinstance(value, str):
            raise bad
        return value
    if origin in (tuple, list, collections.abc.Sequence):
        if not isinstance(value, (list, tuple)):
            raise bad
        items = [convert(v, args[0], table, key, unit) for v in value]
        return tuple(items) if origin is not list else items
    if origin in (dict, collections.abc.Mapping):
        if not isinstance(value, Mapping):
            raise bad
        return {str(k): convert(v, args[1], f"{table}.{key}", str(k), unit) for k, v in value.items()}
    if isinstance(hint, type) and isinstance(value, hint):
        return value
    raise TypeError(f"{table}.{key}: annotation {hint!r} is not supported by config.from_table")
