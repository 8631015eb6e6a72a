# SPDX-License-Identifier: Apache-2.0
"""``tieringctl status``: the running daemon in one screen — its access signal, regions, ticks,
the sharing scan, tiers, mover, control socket, metrics and systemd state. ``--json``: ``tieringd.status/1``
(docs/json.md)."""
from __future__ import annotations

import click

from tieringd.cli._output import RUN_DIR_OPTION_HELP, ask, count, daemon_client, emit_doc, human_bytes, \
    human_duration, table
from tieringd.config import toml_value


def sharing_text(sh: dict | None) -> str:
    """What the sharing scan costs per tick and what it found, in one line."""
    if not sh:
        return "sharing: not reported"
    if not sh["enabled"]:
        return "sharing: off ([sharing] enabled = false)"
    last = f", a pass over every block in {sh['last_pass_s']:.1f} s" if sh.get("last_pass_s") is not None else ""
    content = f", content {sh['hash_pages_per_tick']} pages/tick" if sh["content"] else ", content off"
    return (f"sharing: {sh['pages_examined_per_tick']:.0f} of {sh['pages_per_tick']} pages/tick{content}, "
            f"{sh['ms_per_tick']:.2f} ms/tick (max {sh['ms_per_tick_max']:.1f}){last}; "
            f"{count(sh['shared_blocks'], 'shared block')}, {sh['ksm_blocks']} with KSM pages, "
            f"{sh['identical_blocks']} identical")


def render(st: dict) -> str:
    t = st["ticks"]
    out = [f"tieringd {st['version']}, pid {st['pid']}, up {human_duration(st['uptime_s'])}; "
           f"config {st.get('config_file') or 'defaults (no file)'}",
           st.get("signal_text") or "access signal: ?",
           f"processes {st['processes']}, regions {st['region_count']}, registered "
           f"{human_bytes(st['registered_bytes'])}",
           f"ticks {t['count']} every {t['interval_ms']:g} ms: last {t['last_duration_ms']:.1f} ms, "
           f"p50 {t['p50_ms']:.1f} ms, p99 {t['p99_ms']:.1f} ms, {t['overruns']} overran"
           + (f"; last one {t['last_tick_age_s']:.1f} s ago" if t.get("last_tick_age_s") is not None else ""),
           f"mover: {count(st['mover']['pending_jobs'], 'job')} pending, "
           f"{count(st['mover']['migrated_pages'], 'page')} migrated",
           sharing_text(st.get("sharing"))]
    pool = st.get("pool")
    if pool:                                # only where [pool] is set: one line of this host's part
        from tieringd.cli.pool import summary
        out.append(summary(pool))
    out.append("")
    rows = [[x["tier"], ",".join(map(str, x["nodes"])), human_bytes(x["managed_bytes"]),
             human_bytes(x["capacity_bytes"]), human_bytes(x["other_bytes"])] for x in st["tiers"]]
    out.append(table(["tier", "nodes", "managed", "capacity", "not managed"], rows, right={2, 3, 4}))
    out.append("")
    for r in st.get("regions") or []:
        if r.get("position"):
            out.append(f"region pid {r['pid']} {r['start']:#x} ({human_bytes(r['length'])}): "
                       f"{r['position']['text']}")
    if any(r.get("position") for r in st.get("regions") or []):
        out.append("")
    lc = st.get("lifecycle") or {}
    out.append(f"process lifecycle: {lc.get('mechanism', '?')} ({lc.get('why', '')}), "
               f"{count(lc.get('watched', 0), 'pid')} watched")
    c = st.get("control") or {}
    out.append(f"control: {c.get('path')} ({c.get('access')}), {count(c.get('clients', 0), 'client')}, "
               f"{c.get('refusals', 0)} refused")
    m = st.get("metrics") or {}
    out.append("metrics: " + (f"http://{m['address'][0]}:{m['address'][1]}/metrics" if m.get("address")
                              else "off ([metrics] listen)"))
    sd = st.get("systemd") or {}
    out.append("systemd: " + ("notified, ready" if sd.get("notify") and sd.get("ready") else
                              "notify socket set, not ready yet" if sd.get("notify") else
                              "not run by systemd"))
    if st.get("overrides"):
        out.append("set at run time (until the next reload): "
                   + ", ".join(f"{k}={toml_value(v)}" for k, v in st["overrides"].items()))
    return "\n".join(out)


@click.command("status")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output (tieringd.status/1)")
@click.option("--run-dir", type=click.Path(file_okay=False), help=RUN_DIR_OPTION_HELP)
def command(as_json: bool, run_dir: str | None) -> None:
    """Show the running daemon: signal, regions, ticks, tiers, mover, sockets."""
    with daemon_client(run_dir) as c:
        st = ask(c, "status")
    if as_json:
        emit_doc(st)
    else:
        click.echo(render(st))
