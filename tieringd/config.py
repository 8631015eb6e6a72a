# SPDX-License-Identifier: Apache-2.0
"""The configuration file: TOML, one table per concern.

Default path ``/etc/tieringd/tieringd.toml`` (``TIERINGD_CONFIG`` overrides). A missing default file
means "all defaults"; a missing file that was named explicitly, or a file that does not parse, is an
error with the file and line in the message. Each module validates its own table (``section``) and
documents its keys in docs/configuration.md.
"""
from __future__ import annotations

import os
import tomllib
from typing import Any

DEFAULT_PATH = "/etc/tieringd/tieringd.toml"


class ConfigError(ValueError):
    pass


def load(path: str | None = None) -> dict[str, Any]:
    explicit = path or os.environ.get("TIERINGD_CONFIG")
    p = explicit or DEFAULT_PATH
    try:
        with open(p, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        if explicit:
            raise ConfigError(f"config file {p} does not exist") from None
        return {}
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: {e}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror}") from None


def section(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    """The table ``[name]`` (empty if absent); an error if ``name`` is there but is not a table."""
    value = cfg.get(name, {})
    if not isinstance(value, dict):
        raise ConfigError(f"[{name}] must be a table, not {type(value).__name__}")
    return value


def check_keys(name: str, table: dict[str, Any], known) -> None:
    """Refuse keys a table does not define, so a typo is an error rather than a silent default."""
    unknown = sorted(set(table) - set(known))
    if unknown:
        s = "s" if len(unknown) > 1 else ""
        raise ConfigError(f"[{name}]: unknown key{s} {', '.join(map(repr, unknown))} "
                          f"(known: {', '.join(sorted(known))})")
