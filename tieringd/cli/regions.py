# SPDX-License-Identifier: Apache-2.0
"""``tieringctl regions [--pid P]``: every region the daemon holds — who registered it, where its
blocks are, how many of them are shared (SHARED: blocks with more than one sharer / the most sharers
of one), how it is placed. ``--json``: ``tieringd.regions/1`` (docs/json.md)."""
from __future__ import annotations

import click

from tieringd.cli._output import RUN_DIR_OPTION_HELP, ask, daemon_client, emit_doc, human_bytes, \
    human_duration, table


def nodes_text(by_node: dict) -> str:
    return " ".join(f"{'-' if k == 'not_present' else k}:{human_bytes(v)}"
                    for k, v in sorted(by_node.items(), key=lambda kv: (kv[0] == "not_present", kv[0]))) or "-"


def position_text(p: dict | None) -> str:
    """The position factor in a word or two: "on @37" (its frontier block), "off", "learning"."""
    if not p:
        return "-"
    return f"on @{p['frontier_block']}" if p["state"] == "on" else p["state"]


def shared_text(shared_blocks: int, max_sharers: int) -> str:
    """"12/3": 12 blocks with more than one sharer, the most shared has 3; "-" when none is shared."""
    return f"{shared_blocks}/{max_sharers}" if shared_blocks else "-"


def render(doc: dict) -> str:
    rows = [[r["pid"], f"{r['start']:#x}", human_bytes(r["length"]), r["blocks"],
             human_bytes(r["block_bytes"]) if r["block_bytes"] else "-", nodes_text(r["bytes_by_node"]),
             shared_text(r.get("shared_blocks", 0), r.get("max_sharers", 0)),
             r["policy"], ",".join(r["flags"]) or "-", r["tag"] or "-", position_text(r.get("position")),
             human_duration(r["age_s"])]
            for r in doc["regions"]]
    if not rows:
        return "no regions" + (f" of pid {doc['pid']}" if doc.get("pid") else "") + \
            " (programs register theirs when run under `tieringctl run`)"
    return table(["PID", "START", "LENGTH", "BLOCKS", "BLOCK", "NODE:BYTES", "SHARED", "POLICY", "FLAGS",
                  "TAG", "POSITION", "AGE"], rows, right={2, 3, 4, 6})


@click.command("regions")
@click.option("--pid", type=click.IntRange(min=1), help="only this process")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output (tieringd.regions/1)")
@click.option("--run-dir", type=click.Path(file_okay=False), help=RUN_DIR_OPTION_HELP)
def command(pid: int | None, as_json: bool, run_dir: str | None) -> None:
    """List the registered regions and where their blocks are."""
    with daemon_client(run_dir) as c:
        doc = ask(c, "regions", **({"pid": pid} if pid else {}))
    if as_json:
        emit_doc(doc)
    else:
        click.echo(render(doc))
