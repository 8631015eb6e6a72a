# SPDX-License-Identifier: Apache-2.0
"""Shared helpers of the subcommands: human sizes, rates and times, aligned tables, versioned JSON,
one-line errors, and the topology with its errors turned into one.

Errors under ``--json``: every error path of the subcommands goes through :func:`fail` (directly, or
through :func:`daemon_client`, :func:`ask`, :func:`load_topology`). When the command being run was
given ``--json`` — its click parameter is named ``as_json`` in every subcommand, which is how
:func:`json_requested` finds it in the current click context, so no command wires anything — the
error is also printed as one ``tieringd.error/1`` document on one line of stdout (docs/json.md). The
plain ``tieringctl: MESSAGE`` line still goes to stderr and the exit status is unchanged, so a
person at a terminal reads the same line with or without ``--json``. Usage errors (a bad option
value, a missing argument), which click raises before the command runs, get the same document from
the group (``tieringd/cli/__init__.py``, :func:`emit_usage_error`)."""
from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

import click

from tieringd.kernel import sysfs
from tieringd.config import ConfigError

if TYPE_CHECKING:
    from tieringd.memory import topology

_UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]


def count(n: int, noun: str, plural: str | None = None) -> str:
    """1 → "1 job", 3 → "3 jobs" (``plural`` where adding an s is wrong)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


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


ERROR_SCHEMA = "tieringd.error/1"

# Set by use_json_errors() for callers outside a click context; None: ask the click context.
_json_errors: bool | None = None


def use_json_errors(on: bool | None) -> None:
    """Force errors to be (True) or not be (False) JSON documents too; None: follow ``--json``."""
    global _json_errors
    _json_errors = on


def json_requested() -> bool:
    """Was the running subcommand given ``--json``? (its ``as_json`` parameter, in the current click
    context or a parent: ``dax list --json``'s context is ``list``'s)."""
    if _json_errors is not None:
        return _json_errors
    ctx = click.get_current_context(silent=True)
    while ctx is not None:
        if ctx.params.get("as_json"):
            return True
        ctx = ctx.parent
    return False


def command_path() -> str | None:
    """The subcommand as typed after ``tieringctl`` ("dax list"), None outside a command."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return None
    return " ".join(ctx.command_path.split()[1:]) or None


def error_doc(message: str, exit_status: int, code: str, command: str | None) -> dict:
    """The ``tieringd.error/1`` document (docs/json.md)."""
    return {"schema": ERROR_SCHEMA, "command": command, "error": message, "code": code,
            "exit_status": exit_status}


def emit_error(message: str, exit_status: int, code: str, command: str | None = None) -> None:
    """One ``tieringd.error/1`` document on one line of stdout (a ``top --json`` stream stays one
    document per line)."""
    sys.stdout.write(json.dumps(error_doc(message, exit_status, code, command or command_path())) + "\n")
    sys.stdout.flush()


def emit_usage_error(e: click.ClickException, argv: list[str]) -> None:
    """A usage error click raised while parsing the subcommand's arguments: JSON too when ``--json``
    is among them (before a ``--``), since the command never ran to say so itself."""
    args = argv[: argv.index("--")] if "--" in argv else argv
    ctx = getattr(e, "ctx", None)
    wants = _json_errors if _json_errors is not None else (
        "--json" in args or bool(ctx is not None and ctx.params.get("as_json")))
    if wants:
        command = " ".join(ctx.command_path.split()[1:]) or None if ctx is not None else None
        emit_error(e.format_message(), e.exit_code, "usage", command)


def fail(message: str, code: int = 1, error_code: str = "error") -> None:
    """Print a one-line error and exit with status ``code``: bad input gets a clear message, never a
    traceback. Under ``--json`` the error is also one ``tieringd.error/1`` document on stdout, whose
    ``code`` is ``error_code`` (a short word: docs/json.md lists them)."""
    if json_requested():
        emit_error(message, code, error_code)
    click.echo(f"tieringctl: {message}", err=True)
    sys.exit(code)


def need_matplotlib(option: str) -> None:
    """``option`` draws a picture: matplotlib must import (the development venv has it; an installed
    service's venv has it after ``pip install matplotlib`` there, or ``tieringd[plot]``)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        fail(f"{option} draws with matplotlib, which this Python does not have: install it into "
             f"{sys.prefix} ({sys.prefix}/bin/python -m pip install matplotlib)")


def load_topology() -> topology.Topology:
    """discover(), with bad configuration or an unreadable tree turned into a one-line error."""
    from tieringd.memory import topology  # here, not at the top: the daemon's reports never need it
    try:
        return topology.discover()
    except ConfigError as e:
        fail(f"configuration: {e}", error_code="config")
    except sysfs.SysfsError as e:
        fail(str(e), error_code="sysfs")
    raise AssertionError("unreachable")


# ---- talking to the daemon (tieringd/service/control.py) ----------------------------------------------------

def daemon_client(run_dir: str | None = None):
    """A control-socket client, or a one-line error saying how to start the daemon (exit 1)."""
    from tieringd.service.control import Client, DaemonNotRunning
    try:
        return Client(run_dir)
    except DaemonNotRunning as e:
        fail(str(e), error_code="daemon-not-running")
    raise AssertionError("unreachable")


def ask(client, name: str, **params) -> dict:
    """One request; a refusal becomes ``tieringctl: NAME: MESSAGE`` and exit 1 (under ``--json`` the
    error document's ``code`` is the daemon's: ``bad-request``, ``forbidden``, ``config``, …)."""
    from tieringd.service.control import ControlError
    try:
        return client.request(name, **params)
    except ControlError as e:
        fail(f"{name}: {e.message}" + (f" [{e.code}]" if e.code not in ("config",) else ""),
             error_code=e.code or "refused")
    except (OSError, ValueError) as e:
        fail(f"{name}: the daemon did not answer: {e}", error_code="no-answer")
    raise AssertionError("unreachable")


def emit_doc(doc: dict) -> None:
    """A document that already carries its ``schema`` (the daemon's answers)."""
    json.dump(doc, sys.stdout, indent=2)
    sys.stdout.write("\n")


def human_duration(s: float | None) -> str:
    """3723 → "1h02m"; 75 → "1m15s"; 4.2 → "4.2s"."""
    if s is None:
        return "-"
    if s < 60:
        return f"{s:.1f}s"
    m, sec = divmod(int(s), 60)
    if m < 60:
        return f"{m}m{sec:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h < 48 else f"{h // 24}d{h % 24:02d}h"


RUN_DIR_OPTION_HELP = "the daemon's run directory (default $TIERINGD_RUN_DIR or /run/tieringd)"
