# SPDX-License-Identifier: Apache-2.0
"""Shared output helpers for the subcommands: human sizes, aligned tables, versioned JSON."""
from __future__ import annotations

import json
import sys

import click

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
