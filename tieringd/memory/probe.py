# SPDX-License-Identifier: Apache-2.0
"""The probe: measure each node's memory the way Intel MLC does, from the CPUs of a DRAM node, and keep
the figures where topology discovery reads them back as evidence.

- **read bandwidth**: every CPU of the initiator node streams its slice of the buffer; best of N passes;
- **load latency**: one thread follows a dependent pointer chain over a random cycle of cache lines
  (one cycle, so prefetchers cannot help); mean ns per load.

Buffers are bound to the measured node with ``mbind(MPOL_BIND, MPOL_MF_STRICT)`` and their placement is
checked with ``move_pages`` before anything is timed. The loops are C (``scripts/membench.c`` →
``build/libtieringd-membench.so``, loaded with ctypes).

The saved file (``[topology] probe_file``, :data:`DEFAULT_FILE`) is the ``tieringd.probe/1`` document
(docs/json.md), written atomically; :func:`read_saved` gives topology the figures measured in this boot
(``boot_id``), per node. ``tieringctl probe`` (tieringd/cli/probe.py) only parses options and prints.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from tieringd.kernel import procfs, sysfs
from tieringd.config import ConfigError, section
from tieringd.contracts import Tier

if TYPE_CHECKING:       # topology reads this module's file; this module only reads what it is given
    from tieringd.memory.topology import Node, Topology

SCHEMA = "tieringd.probe/1"
DEFAULT_FILE = "/var/lib/tieringd/probe.json"
LIB_NAME = "libtieringd-membench.so"
SAMPLED_PAGES = 256          # pages whose node is checked before timing


class ProbeError(Exception):
    """The probe cannot run, or one node cannot be measured (``str()`` says why, in one line)."""


# ---- the measuring loops (C) ----------------------------------------------------------------------

def library_path() -> Path:
    env = os.environ.get("TIERINGD_MEMBENCH")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "build" / LIB_NAME


def load_library() -> ctypes.CDLL:
    path = library_path()
    if not path.exists():
        raise ProbeError(f"{path} is not built: run make (it builds scripts/membench.c)")
    try:
        lib = ctypes.CDLL(str(path), use_errno=True)
    except OSError as e:
        raise ProbeError(f"cannot load {path}: {e}") from None
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


def pick_initiator(topo: Topology, target: int, requested: int | None) -> Node:
    """The DRAM node with CPUs the measurement runs on: ``requested``, else the nearest to ``target``."""
    cpu_nodes = [n for n in topo.nodes if n.cpus and n.tier == Tier.DRAM]
    if requested is not None:
        try:
            n = topo.node(requested)
        except KeyError as e:
            raise ProbeError(str(e.args[0])) from None
        if not n.cpus:
            raise ProbeError(f"node {requested} has no CPUs to measure from")
        return n
    if not cpu_nodes:
        raise ProbeError("no DRAM node with CPUs to measure from")
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


def measure(lib: ctypes.CDLL, node: Node, cpus: list[int], size_bytes: int,
            steps: int, iterations: int, tick: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """One node's figures; a node that cannot be measured gets ``error`` with the reason."""
    result: dict[str, Any] = {"node": node.id, "tier": node.tier.label, "on_node_fraction": None,
                              "read_bandwidth_mb_s": None, "read_latency_ns": None, "error": None}
    if not node.has_memory:
        result["error"] = "the node has no memory"
        return result
    if node.mem_free_bytes and node.mem_free_bytes < size_bytes * 1.1:
        result["error"] = (f"only {node.mem_free_bytes >> 20} MiB free, the probe needs "
                           f"{size_bytes >> 20} MiB")
        return result
    try:
        with bound_buffer(lib, size_bytes, node.id) as buf:
            on = lib.mb_on_node(buf, size_bytes, node.id, SAMPLED_PAGES)
            if on < 0:
                raise ProbeError(f"move_pages: {os.strerror(ctypes.get_errno())}")
            npages = min(SAMPLED_PAGES, size_bytes // os.sysconf("SC_PAGE_SIZE"))
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


def probe_nodes(topo: Topology, targets: list[Node], *, from_node: int | None, size_bytes: int,
                threads: int | None, steps: int, iterations: int,
                on_node: Callable[[Node], None] = lambda node: None,
                tick: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Measure ``targets`` one after the other, each from its initiator's CPUs (this thread is pinned
    there too, and put back afterwards). Returns the ``tieringd.probe/1`` payload (without ``schema``);
    per-node failures are in each result's ``error``. ``tick``: three per node, for a progress bar."""
    lib = load_library()
    allowed = os.sched_getaffinity(0)
    results = []
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
            on_node(t)
            r = measure(lib, t, cpus, size_bytes, steps, iterations, tick)
            r.update(initiator_node=ini.id, threads=len(cpus))
            hm = t.hmat_cpu
            r["hmat"] = None if hm is None else {"read_bandwidth_mb_s": hm.read_bandwidth_mb_s,
                                                 "read_latency_ns": hm.read_latency_ns}
            results.append(r)
    finally:
        os.sched_setaffinity(0, allowed)
    return {"size_bytes": size_bytes, "steps": steps, "iterations": iterations, "boot_id": boot_id(),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "results": results}


# ---- the saved file -------------------------------------------------------------------------------

def boot_id() -> str | None:
    return procfs.read_sysctl("kernel.random.boot_id", None)


def saved_path(cfg: Mapping[str, Any] | None) -> str:
    """Where the figures are kept: ``[topology] probe_file`` ("" = nowhere), else :data:`DEFAULT_FILE`."""
    value = section(cfg or {}, "topology").get("probe_file", DEFAULT_FILE)
    if not isinstance(value, str):
        raise ConfigError.bad_value("topology", "probe_file", "a path", value)
    return value


def save(path: str, payload: Mapping[str, Any]) -> None:
    """Write the ``tieringd.probe/1`` document atomically, so the daemon never reads half a file.
    Raises :class:`ProbeError` naming the file."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps({"schema": SCHEMA, **payload}, indent=2) + "\n")
        os.replace(tmp, p)
    except OSError as e:
        raise ProbeError(f"cannot save the results to {path}: {e.strerror}") from None


def read_saved(path: str, notes: list[str]) -> dict[int, dict[str, Any]]:
    """Figures saved in this boot: node id → {read_latency_ns, read_bandwidth_mb_s, measured_at}.
    Nothing when ``path`` is "" or missing, or when a captured tree stands in for /sys without a boot
    id of its own (another machine's: the figures here are not its own); an unreadable file or one
    from another boot adds a note instead. The boot id is read where /proc is read from, so a tree
    that has one takes the figures saved in its boot."""
    if not path or (sysfs.get_root() and boot_id() is None):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        notes.append(f"probe results {path} unreadable, ignored: {e}")
        return {}
    if not isinstance(doc, dict) or doc.get("boot_id") != boot_id() or boot_id() is None:
        notes.append(f"probe results {path} are from another boot or machine: ignored")
        return {}
    out = {}
    for r in doc.get("results", []):
        if isinstance(r, dict) and isinstance(r.get("node"), int) and not r.get("error"):
            lat, bw = r.get("read_latency_ns"), r.get("read_bandwidth_mb_s")
            if isinstance(lat, (int, float)) and isinstance(bw, (int, float)):
                out[r["node"]] = {"read_latency_ns": float(lat), "read_bandwidth_mb_s": float(bw),
                                  "measured_at": doc.get("measured_at")}
    return out
