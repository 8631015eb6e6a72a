# SPDX-License-Identifier: Apache-2.0
"""``tieringctl tiers``: one row per memory tier — its NUMA nodes, capacity and free memory,
and memory of that tier that is not a NUMA node (devdax devices, fsdax mounts, GPU HBM).
``--json``: schema ``tieringd.tiers/1`` (docs/json.md)."""
from __future__ import annotations

from typing import Any

import click

from tieringd.kernel import sysfs
from tieringd.memory import topology
from tieringd.config import load as load_config
from tieringd.cli._output import emit_json, human_bytes, load_topology, table
from tieringd.contracts import Tier

SCHEMA = "tieringd.tiers/1"

# Where a DAX device that is *not* onlined as system RAM belongs.
_DAX_TIER = {"pmem": Tier.PMEM, "cxl-pmem": Tier.PMEM, "cxl-ram": Tier.CXL_DRAM, "hmem": Tier.CXL_DRAM}


def summarize(topo: topology.Topology) -> list[dict[str, Any]]:
    remap = topology.remap_tier(topo, load_config())       # the DAX-remap tier (docs/dax.md)
    rows = []
    for tier in Tier:
        nodes = [n for n in topo.nodes if n.tier == tier and n.has_memory]
        row: dict[str, Any] = {
            "tier": tier.label,
            "rank": int(tier),
            "nodes": [n.id for n in nodes],
            "mem_total_bytes": sum(n.mem_total_bytes for n in nodes),
            "mem_free_bytes": sum(n.mem_free_bytes for n in nodes),
            "dax_devices": [d.name for d in topo.dax_devices
                            if d.driver != "kmem" and _DAX_TIER.get(d.origin) == tier],
            "fsdax_mounts": [m.mountpoint for m in topo.fsdax_mounts] if tier == Tier.DAX else [],
            "gpus": [g.index for g in topo.gpus] if tier == Tier.GPU_HBM else [],
            "dax_remap": remap.to_dict() if remap and tier == Tier.DAX else None,
        }
        if tier == Tier.GPU_HBM and topo.gpus:
            row["mem_total_bytes"] += sum(g.memory_total_bytes or 0 for g in topo.gpus)
            row["mem_free_bytes"] += sum(g.memory_free_bytes or 0 for g in topo.gpus)
        rows.append(row)
    return rows


def render(topo: topology.Topology) -> str:
    dax_size = {d.name: d.size_bytes for d in topo.dax_devices}
    lines = []
    for r in summarize(topo):
        other = []
        other += [f"{name} (devdax, {human_bytes(dax_size.get(name))})" for name in r["dax_devices"]]
        other += [f"{m} (fsdax)" for m in r["fsdax_mounts"]]
        other += [f"gpu{i}" for i in r["gpus"]]
        if r["dax_remap"]:
            size = r["dax_remap"]["size_bytes"]
            other.append(f"{r['dax_remap']['path']} (dax remap, {human_bytes(size) if size else 'not created'})")
        empty = not r["nodes"] and not r["gpus"]
        lines.append([r["tier"], r["rank"], sysfs.format_list(r["nodes"]) or "-",
                      "-" if empty else human_bytes(r["mem_total_bytes"]),
                      "-" if empty else human_bytes(r["mem_free_bytes"]),
                      ", ".join(other) or "-"])
    out = [table(["tier", "rank", "nodes", "total", "free", "also"], lines, right={1, 3, 4})]
    if topo.notes:
        out += ["", "notes:"] + [f"  {x}" for x in topo.notes]
    return "\n".join(out)


@click.command("tiers")
@click.option("--json", "as_json", is_flag=True, help=f"machine-readable output (schema {SCHEMA})")
def command(as_json: bool) -> None:
    """The memory tiers (GPU HBM, DRAM, CXL DRAM, PMem): nodes, capacity, free memory."""
    topo = load_topology()
    if as_json:
        emit_json(SCHEMA, {"tiers": summarize(topo), "notes": topo.notes})
    else:
        click.echo(render(topo))
