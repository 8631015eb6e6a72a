# SPDX-License-Identifier: Apache-2.0
"""``tieringctl probe [--node N]``: measure each node's memory (read bandwidth, load latency) from the
CPUs of a DRAM node, MLC-style — the measurement is :mod:`tieringd.memory.probe`; this module parses options
and prints.

``--save`` stores the figures where ``topology.discover()`` finds them (``[topology] probe_file``),
so that nodes without HMAT figures get measured ones as evidence. ``--json``: schema
``tieringd.probe/1`` (docs/json.md).
"""
from __future__ import annotations

import sys

import click

from tieringd.kernel import sysfs
from tieringd import config
from tieringd.memory import probe
from tieringd.cli._output import emit_json, fail, human_bytes, human_ns, human_rate, load_topology, table
from tieringd.memory.probe import SCHEMA


@click.command("probe")
@click.option("--node", "nodes", type=int, multiple=True, help="node to measure (repeatable; default: every node with memory)")
@click.option("--from-node", type=int, default=None, help="DRAM node whose CPUs run the loops (default: nearest)")
@click.option("--size-mib", type=click.IntRange(8, 1 << 20), default=256, show_default=True,
              help="buffer per node (keep it well above the last-level cache)")
@click.option("--threads", type=click.IntRange(1, 1024), default=None,
              help="reader threads for the bandwidth loop (default: every CPU of the initiator node)")
@click.option("--steps", type=click.IntRange(1000, 1 << 40), default=2_000_000, show_default=True,
              help="dependent loads timed for the latency")
@click.option("--iterations", type=click.IntRange(1, 100), default=3, show_default=True,
              help="bandwidth passes; the best one counts")
@click.option("--save", "save_path", is_flag=False, flag_value="", default=None, metavar="[PATH]",
              help=f"store the figures for topology evidence (default: {probe.DEFAULT_FILE})")
@click.option("--json", "as_json", is_flag=True, help=f"machine-readable output (schema {SCHEMA})")
def command(nodes: tuple[int, ...], from_node: int | None, size_mib: int, threads: int | None,
            steps: int, iterations: int, save_path: str | None, as_json: bool) -> None:
    """Measure read bandwidth and load latency of each node's memory (MLC-like), with mbind-bound buffers."""
    if sysfs.get_root():
        fail(f"probe measures this machine's memory, but TIERINGD_FS_ROOT points at a captured tree "
             f"({sysfs.get_root()}): unset it")
    topo = load_topology()
    targets = []
    for nid in nodes or [n.id for n in topo.nodes if n.has_memory]:
        try:
            targets.append(topo.node(nid))
        except KeyError as e:
            fail(str(e.args[0]))
    size_bytes = size_mib << 20
    show = sys.stderr.isatty() and not as_json
    bar = click.progressbar(length=3 * len(targets), label="probing", file=sys.stderr) if show else None

    def on_node(node) -> None:
        if bar:
            bar.label = f"node {node.id}"

    try:
        payload = probe.probe_nodes(topo, targets, from_node=from_node, size_bytes=size_bytes, threads=threads,
                                    steps=steps, iterations=iterations, on_node=on_node,
                                    tick=(lambda: bar.update(1)) if bar else (lambda: None))
        if save_path is not None:
            path = save_path or probe.saved_path(config.load())
            probe.save(path, payload)
            payload["saved_to"] = path
    except (probe.ProbeError, config.ConfigError) as e:
        fail(str(e))
    finally:
        if bar:
            bar.render_finish()
    if as_json:
        emit_json(SCHEMA, payload)
        return
    click.echo(render(payload))
    if any(r.get("error") for r in payload["results"]):
        sys.exit(1)


def render(payload: dict) -> str:
    rows = []
    for r in payload["results"]:
        h = r.get("hmat") or {}
        rows.append([r["node"], r["tier"], r.get("initiator_node", "-"), r.get("threads", "-"),
                     "-" if r.get("on_node_fraction") is None else f"{100 * r['on_node_fraction']:.0f}%",
                     human_rate(r.get("read_bandwidth_mb_s")), human_ns(r.get("read_latency_ns")),
                     human_rate(h.get("read_bandwidth_mb_s")), human_ns(h.get("read_latency_ns")),
                     r.get("error") or ""])
    out = [table(["node", "tier", "from", "threads", "on-node", "read-bw", "latency",
                  "hmat-bw", "hmat-lat", "error"], rows, right={0, 2, 3, 4, 5, 6, 7, 8}),
           f"\nbuffer {human_bytes(payload['size_bytes'])} per node, best of {payload['iterations']} "
           f"bandwidth passes, {payload['steps']} dependent loads; buffers bound with mbind(MPOL_BIND)"]
    if "saved_to" in payload:
        out.append(f"saved to {payload['saved_to']}")
    return "\n".join(out)
