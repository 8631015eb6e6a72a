# SPDX-License-Identifier: Apache-2.0
"""``tieringctl pool``: the CXL pool this host shares with others, as this host's daemon sees it
(docs/pool.md) — the pool's uuid and extents, each host's claimed and used bytes, its state and how
long its lease has left. The daemon answers from the map its pool agent read at its last heartbeat,
so the report comes at once when etcd does not answer, and says how old the map is and why etcd is
away. ``--json``: ``tieringd.pool-map/1`` (docs/json.md)."""
from __future__ import annotations

import click

from tieringd.cli._output import RUN_DIR_OPTION_HELP, ask, daemon_client, emit_doc, human_bytes, \
    human_duration, table


def etcd_text(p: dict) -> str:
    if p.get("etcd") == "ok":
        return "etcd ok"
    return (f"etcd unreachable for {human_duration(p.get('etcd_lost_s'))} ({p.get('etcd_error')}): "
            "serving what this host holds, claiming nothing new")


def summary(p: dict | None) -> str:
    """One line for ``tieringctl status``: this host's part in the pool (``moves.pool`` of the status
    document: the agent's own status)."""
    if not p:
        return "pool: off ([pool] endpoints not set)"
    pool = p.get("pool") or {}
    ext = pool.get("extent_bytes", 0)
    head = f"pool {pool.get('uuid', '?')[:8]}: {p['host']} {p['state']}" + (f" ({p['why']})" if p.get("why") else "")
    if not pool:
        return f"{head}; {etcd_text(p)}"
    return (f"{head}, {len(p['extents_held'])} of {pool['extents'] - 1} extents of {human_bytes(ext)} "
            f"({human_bytes(p['used_bytes'])} used), {p.get('extents_free', 0)} free, "
            f"{p.get('hosts', 0)} hosts; {etcd_text(p)}")


def render(m: dict) -> str:
    if not m.get("enabled"):
        return m.get("why") or "no pool"
    pool = m.get("pool")
    out = [f"pool {pool['uuid'] if pool else '?'} under {m['prefix']} on {m['device']}; this host: {m['host']}, "
           f"{m['state']}" + (f" ({m['why']})" if m.get("why") else "")]
    if pool:
        out.append(f"extents: {m['extents_total']} of {human_bytes(pool['extent_bytes'])}, "
                   f"{m['extents_free']} free ({human_bytes(m['extents_free'] * pool['extent_bytes'])})"
                   + (f", {m['extents_refused_claims']} claim keys refused" if m.get("extents_refused_claims") else ""))
    age = m.get("map_age_s")
    out.append(f"{etcd_text(m)}; map read {'never' if age is None else human_duration(age) + ' ago'}, "
               f"leases of {m['lease_ttl_s']} s")
    refused = m.get("refused_entries") or {}
    if refused:
        out.append("refused etcd entries: " + ", ".join(f"{k} {n}" for k, n in sorted(refused.items())))
    if m.get("hosts"):
        rows = [[("* " if r["this"] else "  ") + r["host"], r["state"], r["extents"], human_bytes(r["claimed_bytes"]),
                 human_bytes(r["used_bytes"]), human_bytes(r["saved_bytes"]),
                 "-" if r["lease_left_s"] is None else f"{r['lease_left_s']} s"] for r in m["hosts"]]
        out += ["", table(["host", "state", "extents", "claimed", "used", "saved", "lease left"], rows,
                          right={2, 3, 4, 5, 6})]
    return "\n".join(out)


@click.command("pool")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output (tieringd.pool-map/1)")
@click.option("--run-dir", type=click.Path(file_okay=False), help=RUN_DIR_OPTION_HELP)
def command(as_json: bool, run_dir: str | None) -> None:
    """Show the CXL pool shared through etcd: extents, each host's claim, state and lease."""
    with daemon_client(run_dir) as c:
        m = ask(c, "pool")
    if as_json:
        emit_doc(m)
    else:
        click.echo(render(m))
