# SPDX-License-Identifier: Apache-2.0
"""Shared helpers of the subcommands: human sizes, rates and times, aligned tables, versioned JSON,
one-line errors, and the topology with its errors turned into one."""
from __future__ import annotations

import json
import sys

import click

from tieringd import _sysfs, topology
from tieringd.config import ConfigError

_UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]


def human_bytes(n: int | float | None) -> str:
    """1536 → "1.5 KiB"; None → "-" (unknown is shown, never guessed)."""
    if n is None:
        return "-"
    n = float(n)
    for unit in _UNITS:
        if abs(n) < 1024 or unit == _UNITS[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_rate(mb_s: int | float | None) -> str:
    """Bandwidth (MB/s) the way MLC prints it: 19500 → "19.5 GB/s"."""
    if mb_s is None:
        return "-"
    return f"{mb_s / 1000:.1f} GB/s" if mb_s >= 1000 else f"{mb_s} MB/s"


def human_ns(ns: int | float | None) -> str:
    if ns is None:
        return "-"
    return f"{ns / 1000:.1f} us" if ns >= 10000 else f"{ns:.0f} ns"


def table(headers: list[str], rows: list[list], right: set[int] | None = None) -> str:
    """A plain aligned table, the way numactl/daxctl users read them. ``right``: right-aligned columns."""
    right = right or set()
    cells = [[str(h) for h in headers]] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def emit_json(schema: str, payload: dict) -> None:
    """Every ``--json`` document carries ``schema`` ("tieringd.<what>/<version>"); see docs/json.md."""
    doc = {"schema": schema, **payload}
    json.dump(doc, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def fail(message: str, code: int = 1) -> None:
    """Print a one-line error and exit: bad input gets a clear message, never a traceback."""
    click.echo(f"tieringctl: {message}", err=True)
    sys.exit(code)


def load_topology() -> topology.Topology:
    """discover(), with bad configuration or an unreadable tree turned into a one-line error."""
    try:
        return topology.discover()
    except ConfigError as e:
        fail(f"configuration: {e}")
    except _sysfs.SysfsError as e:
        fail(str(e))
    raise AssertionError("unreachable")
