# SPDX-License-Identifier: Apache-2.0
"""``tieringctl policy [get [KEY]] | set KEY=VALUE…``: the running daemon's policy, heat and mover
settings, and changing them without a restart. ``KEY`` is a ``[policy]`` key (``interval_ms``) or
``TABLE.KEY`` (``heat.half_life_s``, ``mover.promote_rate_mb_s``); ``VALUE`` is a TOML value (``50``,
``0.9``, ``"4M"``, ``[0.8, 0.5]``; a bare word is a string). The whole configuration is validated first
(a bad value changes nothing) and the change lasts until the next reload (SIGHUP re-reads the file).
``--json``: ``tieringd.policy/1`` (docs/json.md)."""
from __future__ import annotations

import tomllib

import click

from tieringd.cli._output import RUN_DIR_OPTION_HELP, ask, daemon_client, emit_doc, fail
from tieringd.config import toml_value


def parse_value(text: str):
    """A TOML value, or the text itself when it is not one (``fast`` → "fast")."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_assignments(items: tuple[str, ...]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"{item!r}: expected KEY=VALUE (e.g. interval_ms=50)")
        out[key.strip()] = parse_value(value.strip())
    return out


def render(doc: dict, key: str | None = None) -> str:
    lines = []
    for table in ("policy", "heat", "mover"):
        for k, v in doc[table].items():
            name = k if table == "policy" else f"{table}.{k}"
            if key is None or key in (name, f"policy.{k}"):
                lines.append(f"{name} = {toml_value(v)}")
    if key is not None and not lines:
        fail(f"no key {key!r} (keys: {', '.join(doc['policy'])}, heat.*, mover.*)")
    if key is None and doc.get("overrides"):
        overrides = doc["overrides"].items()
        lines.append("# set at run time: " + ", ".join(f"{k}={toml_value(v)}" for k, v in overrides))
    return "\n".join(lines)


@click.command("policy")
@click.argument("action", type=click.Choice(["get", "set"]), default="get")
@click.argument("args", nargs=-1)
@click.option("--json", "as_json", is_flag=True, help="machine-readable output (tieringd.policy/1)")
@click.option("--run-dir", type=click.Path(file_okay=False), help=RUN_DIR_OPTION_HELP)
def command(action: str, args: tuple[str, ...], as_json: bool, run_dir: str | None) -> None:
    """Show (get [KEY]) or change (set KEY=VALUE…) the running policy."""
    if action == "get" and len(args) > 1:
        fail("policy get takes at most one KEY")
    if action == "set" and not args:
        fail("policy set needs KEY=VALUE (e.g. tieringctl policy set interval_ms=50)")
    try:
        changes = parse_assignments(args) if action == "set" else None
    except click.BadParameter as e:
        fail(e.message)
    with daemon_client(run_dir) as c:
        doc = ask(c, "policy-get") if changes is None else ask(c, "policy-set", set=changes)
    if as_json:
        emit_doc(doc)
    else:
        click.echo(render(doc, args[0] if action == "get" and args else None))
