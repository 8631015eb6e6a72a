# SPDX-License-Identifier: Apache-2.0
"""``tieringctl stats``: what the daemon's mover did, per node — bytes moved in and out, asked for but
placed on a fallback node or elsewhere, failed by reason — beside the kernel's own counters in
/proc/vmstat since the daemon started (``pgmigrate_*`` count every migration on the machine, ours
included; ``pgpromote_*``/``pgdemote_*`` only the kernel's own tiering). ``--json``:
``tieringd.stats/1`` (docs/json.md)."""
from __future__ import annotations

import click

from tieringd.cli._output import RUN_DIR_OPTION_HELP, ask, daemon_client, emit_doc, human_bytes, table

VMSTAT_ORDER = ("pgmigrate_success", "pgmigrate_fail", "numa_pages_migrated", "pgpromote_success",
                "pgdemote_kswapd", "pgdemote_direct", "pgdemote_khugepaged", "pgdemote_proactive",
                "thp_migration_success", "thp_migration_fail", "thp_migration_split")


def render(doc: dict) -> str:
    rows = []
    for n in doc["nodes"]:
        failed = ", ".join(f"{k} {human_bytes(v)}" for k, v in n["failed_bytes"].items()) or "-"
        rows.append([n["node"], n["tier"] or "-", human_bytes(n["managed_bytes"]), human_bytes(n["moved_in_bytes"]),
                     human_bytes(n["moved_out_bytes"]), human_bytes(n["already_bytes"]),
                     human_bytes(n["fallback_bytes"]), human_bytes(n["landed_elsewhere_bytes"]), failed])
    out = [table(["node", "tier", "managed", "moved in", "moved out", "already there", "to fallback",
                  "landed elsewhere", "failed"], rows, right={2, 3, 4, 5, 6, 7})]
    m = doc["mover"]
    ps = m["page_size"]
    out += ["", f"mover: {m['migrated_pages']} pages migrated ({human_bytes(m['migrated_pages'] * ps)}): "
                f"{m['moved_pages']} to the target, {m['fallback_pages']} to a fallback, "
                f"{m['landed_elsewhere_pages']} elsewhere; {m['thp_pages_moved']} in huge pages; "
                f"{m['move_pages_calls']} move_pages calls; {m['dropped_jobs']} jobs dropped; "
                f"{m['pending_jobs']} pending"]
    v = doc.get("verified")
    if v:
        out.append(f"verified by the loop: {human_bytes(v['promoted_bytes'])} promoted, "
                   f"{human_bytes(v['demoted_bytes'])} demoted (blocks whose node changed tier)")
    k = doc["vmstat"]
    rows = [[name, k[name]["delta"], k[name]["now"]] for name in VMSTAT_ORDER if name in k]
    out += ["", "/proc/vmstat (pages) since the daemon started, beside the mover's "
                f"{m['migrated_pages']} migrated:", table(["counter", "since start", "now"], rows, right={1, 2})]
    return "\n".join(out)


@click.command("stats")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output (tieringd.stats/1)")
@click.option("--run-dir", type=click.Path(file_okay=False), help=RUN_DIR_OPTION_HELP)
def command(as_json: bool, run_dir: str | None) -> None:
    """Migrations per node beside the kernel's own counters."""
    with daemon_client(run_dir) as c:
        doc = ask(c, "stats")
    if as_json:
        emit_doc(doc)
    else:
        click.echo(render(doc))
