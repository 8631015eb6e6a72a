# SPDX-License-Identifier: Apache-2.0
"""``tieringctl probe [--node N]``: measure each node's memory the way Intel MLC does, from the CPUs
of a DRAM node — streaming read bandwidth (all CPUs of that node reading their slice) and load latency
(a dependent pointer chase over a random cycle of cache lines). Buffers are bound to the measured node
with ``mbind(MPOL_BIND, MPOL_MF_STRICT)`` and their placement is checked with ``move_pages`` before
anything is timed. The loops are C (``scripts/membench.c`` → ``build/libtieringd-membench.so``).

``--save`` stores the figures where ``topology.discover()`` finds them (``[topology] probe_file``),
so that nodes without HMAT figures get measured ones as evidence. ``--json``: schema
``tieringd.probe/1`` (docs/json.md).
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import click

from tieringd import _sysfs, topology
from tieringd.cli._output import emit_json, fail, human_bytes, table
from tieringd.cli.numa import human_ns, human_rate, load_topology
from tieringd.contracts import Tier

SCHEMA = "tieringd.probe/1"
LIB_NAME = "libtieringd-membench.so"


def library_path() -> Path:
    env = os.environ.get("TIERINGD_MEMBENCH")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "build" / LIB_NAME


def load_library() -> ctypes.CDLL:
    path = library_path()
    if not path.exists():
        fail(f"{path} is not built: run make (it builds scripts/membench.c)")
    try:
        lib = ctypes.CDLL(str(path), use_errno=True)
    except OSError as e:
        fail(f"cannot load {path}: {e}")
    lib.mb_alloc.restype = ctypes.c_void_p
    lib.mb_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int]
    lib.mb_free.restype = None
    lib.mb_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.mb_on_node.restype = ctypes.c_long
    lib.mb_on_node.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_size_t]
    lib.mb_read_bw.restype = ctypes.c_double
    lib.mb_read_bw.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                               ctypes.POINTER(ctypes.c_int)]
    lib.mb_chase.restype = ctypes.c_double
    lib.mb_chase.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_uint64]
    return lib


def pick_initiator(topo: topology.Topology, target: int, requested: int | None) -> topology.Node:
    """The DRAM node with CPUs the measurement runs on: ``requested``, else the nearest to ``target``."""
    cpu_nodes = [n for n in topo.nodes if n.cpus and n.tier == Tier.DRAM]
    if requested is not None:
        try:
            n = topo.node(requested)
        except KeyError as e:
            fail(str(e.args[0]))
        if not n.cpus:
            fail(f"node {requested} has no CPUs to measure from")
        return n
    if not cpu_nodes:
        fail("no DRAM node with CPUs to measure from")
    t = topo.node(target)
    return min(cpu_nodes, key=lambda n: (t.distances.get(n.id, 1 << 16), n.id))


_ALLOC_REASON = {
    errno.ENOMEM: "not enough free memory on the node",
    errno.EIO: "the kernel could not place the buffer on the node",
    errno.EINVAL: "the kernel refused the node (not online, or no memory)",
    errno.EPERM: "the node is outside this process's allowed memory nodes (cpuset)",
}


@contextlib.contextmanager
def bound_buffer(lib: ctypes.CDLL, size_bytes: int, node: int) -> Iterator[int]:
    buf = lib.mb_alloc(size_bytes, node)
    if not buf:
        err = ctypes.get_errno()
        raise ProbeError(_ALLOC_REASON.get(err, os.strerror(err)) + f" (mbind: {errno.errorcode.get(err, err)})")
    try:
        yield buf
    finally:
        lib.mb_free(buf, size_bytes)


class ProbeError(Exception):
    pass


def measure(lib: ctypes.CDLL, node: topology.Node, cpus: list[int], size_bytes: int,
            steps: int, iterations: int, tick=lambda: None) -> dict[str, Any]:
    """One node's figures; a node that cannot be measured gets ``error`` with the reason."""
    result: dict[str, Any] = {"node": node.id, "tier": node.tier.label, "on_node_fraction": None,
                              "read_bandwidth_mb_s": None, "read_latency_ns": None, "error": None}
    if not node.has_memory:
        result["error"] = "the node has no memory"
        return result
    if node.mem_free_bytes and node.mem_free_bytes < size_bytes * 1.1:
        result["error"] = (f"only {human_bytes(node.mem_free_bytes)} free, the probe needs "
                           f"{human_bytes(size_bytes)}")
        return result
    try:
        with bound_buffer(lib, size_bytes, node.id) as buf:
            samples = 256
            on = lib.mb_on_node(buf, size_bytes, node.id, samples)
            if on < 0:
                raise ProbeError(f"move_pages: {os.strerror(ctypes.get_errno())}")
            npages = min(samples, size_bytes // os.sysconf("SC_PAGE_SIZE"))
            result["on_node_fraction"] = round(on / npages, 3)
            if on < npages:
                raise ProbeError(f"only {on} of {npages} sampled pages landed on node {node.id}")
            tick()
            arr = (ctypes.c_int * len(cpus))(*cpus)
            gb_s = lib.mb_read_bw(buf, size_bytes, iterations, len(cpus), arr)
            if gb_s <= 0:
                raise ProbeError("bandwidth loop failed")
            result["read_bandwidth_mb_s"] = round(gb_s * 1000)
            tick()
            ns = lib.mb_chase(buf, size_bytes, steps, int(time.monotonic_ns()))
            if ns <= 0:
                raise ProbeError("latency loop failed")
            result["read_latency_ns"] = round(ns, 1)
            tick()
    except ProbeError as e:
        result["error"] = str(e)
    return result


def save(path: str, payload: dict[str, Any]) -> None:
    """Atomic write, so the daemon never reads half a file."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(payload, indent=2) + "\n")
        os.replace(tmp, p)
    except OSError as e:
        fail(f"cannot save the results to {path}: {e.strerror}")


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
              help=f"store the figures for topology evidence (default: {topology.DEFAULT_PROBE_FILE})")
@click.option("--json", "as_json", is_flag=True, help=f"machine-readable output (schema {SCHEMA})")
def command(nodes: tuple[int, ...], from_node: int | None, size_mib: int, threads: int | None,
            steps: int, iterations: int, save_path: str | None, as_json: bool) -> None:
    """Measure read bandwidth and load latency of each node's memory (MLC-like), with mbind-bound buffers."""
    if _sysfs.get_root():
        fail(f"probe measures this machine's memory, but TIERINGD_FS_ROOT points at a captured tree "
             f"({_sysfs.get_root()}): unset it")
    topo = load_topology()
    targets = []
    for nid in nodes or [n.id for n in topo.nodes if n.has_memory]:
        try:
            targets.append(topo.node(nid))
        except KeyError as e:
            fail(str(e.args[0]))
    lib = load_library()
    size_bytes = size_mib << 20
    allowed = os.sched_getaffinity(0)
    results, used = [], {}
    show = sys.stderr.isatty() and not as_json
    bar = click.progressbar(length=3 * len(targets), label="probing", file=sys.stderr) if show else None
    old_affinity = set(allowed)
    try:
        for t in targets:
            ini = pick_initiator(topo, t.id, from_node)
            cpus = [c for c in ini.cpus if c in allowed]
            if not cpus:
                results.append({"node": t.id, "tier": t.tier.label, "error":
                                f"no CPU of node {ini.id} is in this process's affinity mask"})
                continue
            cpus = cpus[:threads] if threads else cpus
            # the latency loop runs on this thread: keep it on the initiator node too
            os.sched_setaffinity(0, cpus)
            if bar:
                bar.label = f"node {t.id}"
            r = measure(lib, t, cpus, size_bytes, steps, iterations,
                        tick=(lambda: bar.update(1)) if bar else (lambda: None))
            r.update(initiator_node=ini.id, threads=len(cpus))
            hm = t.hmat_cpu
            r["hmat"] = None if hm is None else {"read_bandwidth_mb_s": hm.read_bandwidth_mb_s,
                                                 "read_latency_ns": hm.read_latency_ns}
            results.append(r)
            used[t.id] = ini.id
    finally:
        os.sched_setaffinity(0, old_affinity)
        if bar:
            bar.render_finish()

    payload = {"size_bytes": size_bytes, "steps": steps, "iterations": iterations,
               "boot_id": topology.boot_id(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "results": results}
    if save_path is not None:
        path = save_path or topology.probe_file(topology.config_or_empty())
        save(path, {"schema": SCHEMA, **payload})
        payload["saved_to"] = path
    if as_json:
        emit_json(SCHEMA, payload)
        return
    rows = []
    for r in results:
        h = r.get("hmat") or {}
        rows.append([r["node"], r["tier"], r.get("initiator_node", "-"), r.get("threads", "-"),
                     "-" if r.get("on_node_fraction") is None else f"{100 * r['on_node_fraction']:.0f}%",
                     human_rate(r.get("read_bandwidth_mb_s")), human_ns(r.get("read_latency_ns")),
                     human_rate(h.get("read_bandwidth_mb_s")), human_ns(h.get("read_latency_ns")),
                     r.get("error") or ""])
    click.echo(table(["node", "tier", "from", "threads", "on-node", "read-bw", "latency",
                      "hmat-bw", "hmat-lat", "error"], rows, right={0, 2, 3, 4, 5, 6, 7, 8}))
    click.echo(f"\nbuffer {human_bytes(size_bytes)} per node, best of {iterations} bandwidth passes, "
               f"{steps} dependent loads; buffers bound with mbind(MPOL_BIND)")
    if "saved_to" in payload:
        click.echo(f"saved to {payload['saved_to']}")
    if any(r.get("error") for r in results):
        sys.exit(1)
