# SPDX-License-Identifier: Apache-2.0
"""``tieringctl numa``: one row per NUMA node — tier, CPUs, memory, HMAT figures, kernel memory tier —
then the distance matrix (as ``numactl --hardware`` prints it), why each node got its tier, the DAX
devices, and what could not be read. ``--json``: schema ``tieringd.numa/1`` (docs/json.md)."""
from __future__ import annotations

import click

from tieringd.kernel import sysfs
from tieringd.memory import topology
from tieringd.cli._output import emit_json, human_bytes, human_ns, human_rate, load_topology, table
from tieringd.config import load as load_config

SCHEMA = "tieringd.numa/1"


def distance_matrix(topo: topology.Topology) -> str:
    ids = [n.id for n in topo.nodes]
    width = max(3, *(len(str(d)) for n in topo.nodes for d in n.distances.values())) if ids else 3
    lines = ["node distances:", "node " + " ".join(f"{i:>{width}}" for i in ids)]
    for n in topo.nodes:
        row = " ".join(f"{n.distances.get(i, '-'):>{width}}" for i in ids)
        lines.append(f"{n.id:>3}: {row}")
    return "\n".join(lines)


def render(topo: topology.Topology, evidence: bool = True) -> str:
    rows = []
    for n in topo.nodes:
        perf = n.hmat_cpu
        rows.append([
            n.id, n.tier.label + ("*" if n.overridden else ""),
            sysfs.format_list(n.cpus) or "-",
            human_bytes(n.mem_total_bytes), human_bytes(n.mem_free_bytes),
            human_rate(perf.read_bandwidth_mb_s if perf else None),
            human_ns(perf.read_latency_ns if perf else None),
            "-" if n.memory_tier is None else n.memory_tier,
        ])
    out = [table(["node", "tier", "cpus", "total", "free", "read-bw", "read-lat", "mem-tier"],
                 rows, right={0, 3, 4, 5, 6, 7}),
           "", distance_matrix(topo)]
    if evidence:
        out += ["", "why:"]
        for n in topo.nodes:
            out.append(f"  node{n.id} {n.tier.label}: " + "; ".join(n.evidence))
    if topo.dax_devices:
        out += ["", "dax devices:", table(
            ["dev", "size", "mode", "node", "origin", "on"],
            [[d.name, human_bytes(d.size_bytes), d.mode,
              "-" if d.target_node is None else d.target_node, d.origin, d.parent or "-"]
             for d in topo.dax_devices], right={1, 3})]
    if topo.namespaces:
        out += ["", "nvdimm namespaces:", table(
            ["namespace", "region", "mode", "size", "blockdev", "cxl"],
            [[ns.name, ns.region or "-", ns.mode or "-", human_bytes(ns.size_bytes),
              ns.blockdev or "-", "yes" if ns.cxl else "no"] for ns in topo.namespaces], right={3})]
    if topo.fsdax_mounts:
        out += ["", "fsdax mounts:", table(
            ["mountpoint", "source", "fstype", "dax", "namespace"],
            [[m.mountpoint, m.source, m.fstype, m.dax, m.namespace or "-"] for m in topo.fsdax_mounts])]
    remap = topology.remap_tier(topo, load_config())
    if remap:
        out += ["", f"dax remap tier: {remap.path} ({remap.kind} on {remap.source or '-'}, "
                    f"{human_bytes(remap.size_bytes) if remap.size_bytes else 'not created yet'})"]
    if topo.cxl_memdevs or topo.cxl_regions:
        out += ["", "cxl:"]
        for m in topo.cxl_memdevs:
            out.append(f"  {m.name}: ram {human_bytes(m.ram_size_bytes)}, pmem {human_bytes(m.pmem_size_bytes)}"
                       f", serial {m.serial or '-'}")
        for r in topo.cxl_regions:
            out.append(f"  {r.name}: {r.mode or '?'} {human_bytes(r.size_bytes)}, targets "
                       f"{','.join(r.targets) or '-'}, dax {','.join(r.dax_devices) or '-'}, "
                       f"node {sysfs.format_list(r.nodes) or '-'}")
    if topo.gpus:
        out += ["", "gpus (tier gpu-hbm, reported only):", table(
            ["gpu", "name", "total", "free", "pci", "node"],
            [[g.index, g.name, human_bytes(g.memory_total_bytes), human_bytes(g.memory_free_bytes),
              g.pci_bus_id or "-", "-" if g.numa_node is None else g.numa_node] for g in topo.gpus],
            right={2, 3})]
    k = topo.kernel
    if k.get("release"):
        nb = {0: "off", 1: "on", 2: "memory tiering", 3: "on + memory tiering"}.get(
            k.get("numa_balancing"), "?")
        demotion = {True: "on", False: "off"}.get(k.get("demotion_enabled"), "?")
        out += ["", f"kernel {k['release']}: NUMA balancing {nb}, demotion {demotion}"]
    if any(n.overridden for n in topo.nodes):
        out += ["", "* tier set in the configuration file"]
    if topo.notes:
        out += ["", "notes:"] + [f"  {x}" for x in topo.notes]
    return "\n".join(out)


@click.command("numa")
@click.option("--json", "as_json", is_flag=True, help=f"machine-readable output (schema {SCHEMA})")
@click.option("--no-evidence", is_flag=True, help="omit the 'why' lines")
def command(as_json: bool, no_evidence: bool) -> None:
    """NUMA nodes: tier (with the evidence for it), CPUs, memory, HMAT, kernel memory tier, distances."""
    topo = load_topology()
    if as_json:
        emit_json(SCHEMA, topo.to_dict())
    else:
        click.echo(render(topo, evidence=not no_evidence))
