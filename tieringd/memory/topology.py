# SPDX-License-Identifier: Apache-2.0
"""What memory this machine has, and which tier each NUMA node belongs to — with the reasons.

``discover()`` reads (through :mod:`tieringd.kernel.sysfs`, so a captured tree can stand in):

- NUMA nodes: ``/sys/devices/system/node/nodeN/{cpulist,meminfo,distance}``, the HMAT performance
  figures the kernel publishes per access class (``nodeN/access0|access1/initiators/*``,
  Documentation/admin-guide/mm/numaperf.rst: bandwidth in MB/s, latency in ns), and the kernel's own
  memory tiers (``/sys/devices/virtual/memory_tiering/memory_tierN/nodelist``, v6.1+);
- DAX devices (``/sys/bus/dax/devices``), NVDIMM regions and namespaces (``/sys/bus/nd/devices``),
  fsdax mounts (``/proc/self/mountinfo``), CXL memdevs and regions (``/sys/bus/cxl/devices``);
- GPUs through NVML when ``pynvml`` imports and a driver answers (report only).

Each node is put in one of the memory tiers (DRAM, CXL DRAM, PMem) by :func:`classify` from *several* kinds of evidence,
because firmware tables are often missing or wrong (a CXL node without HMAT lands in the kernel's DRAM
memory tier on 6.1): CPUs on the node, where its memory came from (dax/kmem from a pmem namespace, a
CXL region or soft-reserved "hmem"), HMAT figures, the kernel memory tier, distance, and a per-node
config override. The evidence is kept as text on the node, so reports can show *why*.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from tieringd.kernel import procfs, sysfs
from tieringd.config import ConfigError, Table, check_keys, section
from tieringd.contracts import FallbackMap, Tier
from tieringd.memory.devices import (CxlMemdev, CxlRegion, DaxDevice, FsdaxMount, Gpu, Namespace, int_or_none,
                                     read_cxl, read_dax, read_fsdax, read_gpus, read_int_or_none,
                                     read_namespaces)
from tieringd.memory.probe import DEFAULT_FILE, read_saved, saved_path

NODE_DIR = "/sys/devices/system/node"
TIERING_DIR = "/sys/devices/virtual/memory_tiering"

# A CPU-less node whose firmware latency is at least this is persistent-memory-like: the
# reference figures put CXL DRAM at 200-800 ns and CXL PMem at 1-3 us. Used only when nothing says
# where the node's memory came from.
PMEM_LATENCY_NS = 1000
# The same test on measured figures (``tieringctl probe --save``), relative to DRAM measured the same
# way, because an absolute number means little across machines (or under emulation).
PMEM_PROBE_LATENCY_RATIO = 5.0

_TOPOLOGY_KEYS = {"nodes", "probe_file"}


@dataclasses.dataclass(frozen=True)
class HmatAccess:
    """HMAT performance of a node's memory as seen from its best initiators of one access class.

    access class 0: the best initiators of any kind (CPUs or generic initiators such as GPUs);
    access class 1: the best CPU initiators (kernel v5.10+; older kernels publish access0 only).
    """
    access_class: int
    initiators: list[int]
    read_bandwidth_mb_s: int | None
    write_bandwidth_mb_s: int | None
    read_latency_ns: int | None
    write_latency_ns: int | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Node:
    id: int
    cpus: list[int]
    tier: Tier
    mem_total_bytes: int
    mem_free_bytes: int
    distances: dict[int, int]
    hmat: dict[int, HmatAccess] | None      # by access class; None when the kernel publishes none
    memory_tier: int | None                 # the kernel's memory_tierN id (higher = slower)
    evidence: list[str]
    overridden: bool = False                # tier set by the config file
    dax_devices: list[str] = dataclasses.field(default_factory=list)   # kmem sources onlined here
    origin: str | None = None               # where dax/kmem memory came from: pmem, cxl-ram, hmem…

    @property
    def has_memory(self) -> bool:
        return self.mem_total_bytes > 0

    @property
    def hmat_cpu(self) -> HmatAccess | None:
        """The figures seen from CPUs: access class 1 when published, else access class 0."""
        if not self.hmat:
            return None
        return self.hmat.get(1) or self.hmat.get(0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "tier": self.tier.label,
            "tier_rank": int(self.tier),
            "overridden": self.overridden,
            "cpus": self.cpus,
            "mem_total_bytes": self.mem_total_bytes,
            "mem_free_bytes": self.mem_free_bytes,
            "distances": {str(k): v for k, v in sorted(self.distances.items())},
            "hmat": None if self.hmat is None else
                    {f"access{k}": v.to_dict() for k, v in sorted(self.hmat.items())},
            "memory_tier": self.memory_tier,
            "origin": self.origin,
            "dax_devices": self.dax_devices,
            "evidence": self.evidence,
        }


@dataclasses.dataclass
class Topology:
    nodes: list[Node]
    dax_devices: list[DaxDevice] = dataclasses.field(default_factory=list)
    namespaces: list[Namespace] = dataclasses.field(default_factory=list)
    fsdax_mounts: list[FsdaxMount] = dataclasses.field(default_factory=list)
    cxl_memdevs: list[CxlMemdev] = dataclasses.field(default_factory=list)
    cxl_regions: list[CxlRegion] = dataclasses.field(default_factory=list)
    gpus: list[Gpu] = dataclasses.field(default_factory=list)
    kernel: dict[str, Any] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)   # what could not be read, and why

    def node(self, node_id: int) -> Node:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise KeyError(f"no NUMA node {node_id} (nodes: "
                       f"{sysfs.format_list(n.id for n in self.nodes) or 'none'})")

    def nodes_in_tier(self, tier: Tier) -> list[int]:
        """Ids of the nodes with memory in ``tier``, lowest id first."""
        return [n.id for n in self.nodes if n.tier == tier and n.has_memory]

    def fallback_nodes(self, node_id: int) -> list[int]:
        """Where to put memory when ``node_id`` is full: the other nodes of its tier, nearest first,
        then the slower tiers in order, nearest first within each. Faster tiers never appear."""
        me = self.node(node_id)
        far = 1 << 16

        def dist(n: Node) -> int:
            return me.distances.get(n.id, far)

        others = [n for n in self.nodes if n.id != node_id and n.has_memory
                  and n.tier != Tier.GPU_HBM and n.tier >= me.tier]
        others.sort(key=lambda n: (int(n.tier), dist(n), n.id))
        return [n.id for n in others]

    def fallback_map(self) -> FallbackMap:
        """What the mover is handed (computed once; again after a hot-plug): every node's
        :meth:`fallback_nodes`, and the nodes of each tier that has some."""
        tiers = {t: tuple(self.nodes_in_tier(t)) for t in Tier}
        return FallbackMap(chains={n.id: tuple(self.fallback_nodes(n.id)) for n in self.nodes},
                           tiers={t: nodes for t, nodes in tiers.items() if nodes})

    def to_dict(self) -> dict[str, Any]:
        return {
            "kernel": self.kernel,
            "nodes": [n.to_dict() for n in self.nodes],
            "dax_devices": [d.to_dict() for d in self.dax_devices],
            "namespaces": [n.to_dict() for n in self.namespaces],
            "fsdax_mounts": [m.to_dict() for m in self.fsdax_mounts],
            "cxl": {"memdevs": [m.to_dict() for m in self.cxl_memdevs],
                    "regions": [r.to_dict() for r in self.cxl_regions]},
            "gpus": [g.to_dict() for g in self.gpus],
            "notes": self.notes,
        }


# ---- reading -------------------------------------------------------------------------------------


def node_meminfo(node_id: int) -> dict[str, int]:
    """``Node 0 MemTotal:  24669304 kB`` lines → {"MemTotal": bytes}."""
    out: dict[str, int] = {}
    for line in sysfs.read_lines(f"{NODE_DIR}/node{node_id}/meminfo", []):
        parts = line.split()
        if len(parts) >= 4 and parts[0] == "Node":
            key, value = parts[2].rstrip(":"), int_or_none(parts[3])
            if value is not None:
                out[key] = value * 1024 if len(parts) > 4 and parts[4] == "kB" else value
    return out


def _read_hmat(node_id: int) -> dict[int, HmatAccess] | None:
    out = {}
    for cls in (0, 1):
        base = f"{NODE_DIR}/node{node_id}/access{cls}/initiators"
        if not sysfs.is_dir(base):
            continue
        figures = {k: read_int_or_none(f"{base}/{k}") for k in
                   ("read_bandwidth", "write_bandwidth", "read_latency", "write_latency")}
        initiators = sorted(int(m.rsplit("node", 1)[1]) for m in sysfs.glob(f"{base}/node[0-9]*"))
        if all(v is None for v in figures.values()):
            continue
        out[cls] = HmatAccess(
            access_class=cls, initiators=initiators,
            read_bandwidth_mb_s=figures["read_bandwidth"], write_bandwidth_mb_s=figures["write_bandwidth"],
            read_latency_ns=figures["read_latency"], write_latency_ns=figures["write_latency"])
    return out or None


def _memory_tiers(notes: list[str]) -> dict[int, int]:
    """node id → kernel memory tier id."""
    if not sysfs.is_dir(TIERING_DIR):
        notes.append(f"kernel memory tiers: {TIERING_DIR} is absent (kernel before v6.1, or sysfs "
                     "not mounted)")
        return {}
    out = {}
    for d in sysfs.glob(f"{TIERING_DIR}/memory_tier[0-9]*"):
        tier_id = int(d.rsplit("memory_tier", 1)[1])
        text = sysfs.read_text(f"{d}/nodelist", "")
        try:
            for nid in sysfs.parse_list(text):
                out[nid] = tier_id
        except ValueError:
            notes.append(f"{d}/nodelist: cannot parse {text!r}")
    return out


@dataclasses.dataclass(frozen=True)
class TopologySettings(Table):
    """The ``[topology]`` table: node tiers the operator sets beyond the evidence
    (``[topology.nodes.N] tier = "pmem"``), and where ``tieringctl probe --save`` keeps its figures."""
    NAME = "topology"
    nodes: Mapping[int, Tier] = dataclasses.field(default_factory=dict)  # tier = "dram" | "cxl-dram" | "pmem": node N's tier, whatever its evidence says
    probe_file: str = DEFAULT_FILE      # figures of `tieringctl probe --save` ("" = none)

    @classmethod
    def from_config(cls, table: Mapping[str, Any] | None = None) -> "TopologySettings":
        whole = {"topology": table or {}}
        return cls(nodes=tier_overrides(whole), probe_file=saved_path(whole))


def tier_overrides(cfg: dict[str, Any] | None) -> dict[int, Tier]:
    """``[topology.nodes.N] tier = "pmem"`` → {N: Tier.PMEM}; a bad entry is a ConfigError."""
    topo = section(cfg or {}, "topology")
    check_keys("topology", topo, _TOPOLOGY_KEYS)
    nodes = topo.get("nodes", {})
    if not isinstance(nodes, dict):
        raise ConfigError("[topology.nodes] must be a table of node ids, e.g. [topology.nodes.1]")
    out = {}
    for key, value in nodes.items():
        try:
            nid = int(key)
        except ValueError:
            raise ConfigError(f"[topology.nodes.{key}]: {key!r} is not a node id") from None
        if not isinstance(value, dict) or set(value) - {"tier"} or "tier" not in value:
            raise ConfigError(f"[topology.nodes.{key}] takes one key, tier = \"dram\" | \"cxl-dram\" | \"pmem\"")
        try:
            out[nid] = Tier.parse(str(value["tier"]))
        except ValueError as e:
            raise ConfigError(f"[topology.nodes.{key}] tier: {e}") from None
        if not out[nid].numa:
            raise ConfigError(f"[topology.nodes.{key}] tier: {out[nid].label} is not a NUMA node's tier "
                              "(the DAX-remap tier is a file: [dax] path)")
    return out


# ---- classification ------------------------------------------------------------------------------

_ORIGIN_TEXT = {
    "pmem": "a pmem namespace",
    "cxl-pmem": "a CXL pmem region",
    "cxl-ram": "a CXL ram region",
    "hmem": "soft-reserved (EFI specific-purpose) memory",
    "unknown": "an unknown parent",
}


def _fmt_hmat(a: HmatAccess) -> str:
    parts = []
    if a.read_latency_ns is not None:
        parts.append(f"read latency {a.read_latency_ns} ns")
    if a.read_bandwidth_mb_s is not None:
        parts.append(f"read bandwidth {a.read_bandwidth_mb_s} MB/s")
    src = f" from node{sysfs.format_list(a.initiators)}" if a.initiators else ""
    return f"HMAT{src}: " + ", ".join(parts) if parts else "HMAT: no figures"


def classify(node: Node, cpu_nodes: list[Node], dax: list[DaxDevice], cxl_present: bool,
             probe: dict[int, dict[str, Any]] | None = None) -> tuple[Tier, list[str], str | None]:
    """The node's tier, the evidence for it, and where its memory came from (dax/kmem origin).

    Rules, strongest first: a node with CPUs is DRAM; a CPU-less node whose memory was onlined by
    kmem from pmem (NVDIMM or CXL pmem region) is PMem, from a CXL ram region or soft-reserved memory
    is CXL DRAM; with no origin, a CPU-less memory node is CXL DRAM unless its HMAT read latency is at
    least PMEM_LATENCY_NS. HMAT, kernel memory tier and distance are recorded either way, and a
    disagreement (a CPU-less node in the DRAM memory tier) is stated, not silently followed.
    """
    ev: list[str] = []
    kmem = [d for d in dax if d.driver == "kmem" and d.target_node == node.id]
    origins = sorted({d.origin for d in kmem})
    origin = origins[0] if len(origins) == 1 else ("mixed" if origins else None)

    if node.cpus:
        ev.append(f"{len(node.cpus)} CPU{'s' if len(node.cpus) != 1 else ''} "
                  f"({sysfs.format_list(node.cpus)})")
    else:
        ev.append("CPU-less")
    if not node.has_memory:
        ev.append("no memory")
    for d in kmem:
        ev.append(f"kmem from {d.name} on {d.parent or '?'} ({_ORIGIN_TEXT.get(d.origin, d.origin)})")

    probe_ratio = _performance_evidence(node, cpu_nodes, probe or {}, ev)
    ev += _memory_tier_evidence(node, cpu_nodes)
    if not node.cpus and cpu_nodes:
        near = min(cpu_nodes, key=lambda n: (node.distances.get(n.id, 1 << 16), n.id))
        d = node.distances.get(near.id)
        if d is not None:
            ev.append(f"distance {d} from node{near.id} (local {node.distances.get(node.id, '?')})")
    return _tier_by_rules(node, kmem, origin, origins, probe_ratio, cxl_present, ev), ev, origin


def _performance_evidence(node: Node, cpu_nodes: list[Node], probe: dict[int, dict[str, Any]],
                          ev: list[str]) -> float | None:
    """HMAT and probe figures into ``ev``, relative to the DRAM nodes where they publish the same
    figure. Returns the measured latency over DRAM's (None when not measured)."""
    perf = node.hmat_cpu
    if perf is not None:
        text = _fmt_hmat(perf)
        ref = [n.hmat_cpu.read_latency_ns for n in cpu_nodes
               if n.id != node.id and n.hmat_cpu is not None and n.hmat_cpu.read_latency_ns]
        if ref and perf.read_latency_ns:
            text += f" (DRAM: {min(ref)} ns)"
        ev.append(text)
    else:
        ev.append("no HMAT figures")
    measured = probe.get(node.id)
    probe_ratio = None
    if measured:
        text = (f"probe: read latency {measured['read_latency_ns']:.0f} ns, "
                f"bandwidth {measured['read_bandwidth_mb_s'] / 1000:.1f} GB/s")
        ref = [probe[n.id]["read_latency_ns"] for n in cpu_nodes if n.id != node.id and n.id in probe]
        if ref and min(ref) > 0:
            probe_ratio = measured["read_latency_ns"] / min(ref)
            text += f" ({probe_ratio:.1f}x DRAM)"
        ev.append(text)
    return probe_ratio


def _memory_tier_evidence(node: Node, cpu_nodes: list[Node]) -> list[str]:
    """What the kernel's memory tiers say of the node, beside DRAM's."""
    ev: list[str] = []
    dram_tiers = sorted({n.memory_tier for n in cpu_nodes if n.memory_tier is not None and n.has_memory})
    if node.memory_tier is not None:
        if node.cpus or not dram_tiers:
            ev.append(f"kernel memory tier {node.memory_tier}")
        elif node.memory_tier > max(dram_tiers):
            ev.append(f"kernel memory tier {node.memory_tier}, slower than DRAM's "
                      f"{sysfs.format_list(dram_tiers)}")
        elif node.memory_tier in dram_tiers:
            # A boot-time CPU-less node joins the DRAM tier whatever HMAT says before v6.10 ("memory
            # tier: create CPUless memory tiers after obtaining HMAT info"; kmem nodes use HMAT since
            # v6.7). So this placement is no evidence that the node is as fast as DRAM.
            ev.append(f"kernel memory tier {node.memory_tier}, the same as DRAM "
                      "(the kernel did not rank it: HMAT-based tiers for CPU-less nodes need v6.10+)")
        else:
            ev.append(f"kernel memory tier {node.memory_tier}, faster than DRAM's "
                      f"{sysfs.format_list(dram_tiers)}")
    return ev


def _tier_by_rules(node: Node, kmem: list[DaxDevice], origin: str | None, origins: list[str],
                   probe_ratio: float | None, cxl_present: bool, ev: list[str]) -> Tier:
    """The rules of :func:`classify`, strongest first; the deciding one adds its reason to ``ev``."""
    perf = node.hmat_cpu
    if node.cpus:
        if kmem:
            ev.append("holds kmem memory as well as CPU-attached DRAM: classified by its CPUs")
        return Tier.DRAM
    if not node.has_memory:
        return Tier.DRAM        # nothing to place there; the tier is moot
    if origin in ("pmem", "cxl-pmem"):
        return Tier.PMEM
    if origin in ("cxl-ram", "hmem"):
        return Tier.CXL_DRAM
    if origin == "mixed":
        ev.append("kmem from several kinds of memory: the slowest decides")
        return Tier.PMEM if {"pmem", "cxl-pmem"} & set(origins) else Tier.CXL_DRAM
    if perf is not None and perf.read_latency_ns and perf.read_latency_ns >= PMEM_LATENCY_NS:
        ev.append(f"read latency >= {PMEM_LATENCY_NS} ns: persistent-memory-like")
        return Tier.PMEM
    if perf is None and probe_ratio is not None and probe_ratio >= PMEM_PROBE_LATENCY_RATIO:
        ev.append(f"measured latency >= {PMEM_PROBE_LATENCY_RATIO:g}x DRAM: persistent-memory-like")
        return Tier.PMEM
    if cxl_present:
        ev.append("CXL devices present on this machine")
    ev.append("no device origin: a CPU-less memory node is taken as CXL DRAM")
    return Tier.CXL_DRAM


# ---- discovery -----------------------------------------------------------------------------------

def _online_nodes(notes: list[str]) -> list[int]:
    text = sysfs.read_text(f"{NODE_DIR}/online", None)
    if text is not None:
        try:
            return sysfs.parse_list(text)
        except ValueError:
            notes.append(f"{NODE_DIR}/online: cannot parse {text!r}")
    found = sorted(int(p.rsplit("node", 1)[1]) for p in sysfs.glob(f"{NODE_DIR}/node[0-9]*"))
    if not found and text is None:
        notes.append(f"{NODE_DIR} is absent (kernel without CONFIG_NUMA, or /sys not mounted): "
                     "one node from /proc/meminfo")
    return found


def _fallback_single_node(notes: list[str]) -> Node:
    info = procfs.read_meminfo()

    def kb(key: str) -> int:
        v = int_or_none((info.get(key) or "0").split()[0])
        return (v or 0) * 1024
    try:
        cpus = sysfs.parse_list(sysfs.read_text("/sys/devices/system/cpu/online", ""))
    except ValueError:
        cpus = []
    cpus = cpus or sorted(os.sched_getaffinity(0))
    return Node(id=0, cpus=cpus, tier=Tier.DRAM, mem_total_bytes=kb("MemTotal"),
                mem_free_bytes=kb("MemFree"), distances={0: 10}, hmat=None, memory_tier=None,
                evidence=[f"{len(cpus)} CPUs", "no NUMA information: the whole machine as one node"])


def discover(config: dict[str, Any] | None = None) -> Topology:
    """Read the machine (or the tree under ``sysfs.get_root()``) and classify every node.

    ``config``: the parsed config file (``tieringd.config.load()``); None reads the default file.
    Missing files never raise: what could not be read is said in ``Topology.notes``.
    """
    if config is None:
        from tieringd import config as _config
        config = _config.load()
    overrides = tier_overrides(config)
    notes: list[str] = []

    kernel = {
        "release": procfs.read_sysctl("kernel.osrelease", None),
        "numa_balancing": procfs.read_sysctl_int("kernel.numa_balancing", None),
        "demotion_enabled": {"true": True, "false": False}.get(
            sysfs.read_text("/sys/kernel/mm/numa/demotion_enabled", ""), None),
    }

    ids = _online_nodes(notes)
    tiers = _memory_tiers(notes) if ids else {}
    nodes: list[Node] = []
    hmat_any = False
    for nid in ids:
        base = f"{NODE_DIR}/node{nid}"
        cpus_text = sysfs.read_text(f"{base}/cpulist", None)
        try:
            cpus = sysfs.parse_list(cpus_text or "")
        except ValueError:
            cpus = []
            notes.append(f"node{nid}/cpulist: cannot parse {cpus_text!r}")
        if cpus_text is None:
            notes.append(f"node{nid}/cpulist is unreadable: CPUs unknown")
        mem = node_meminfo(nid)
        if not mem:
            notes.append(f"node{nid}/meminfo is unreadable: memory size unknown")
        row = (sysfs.read_text(f"{base}/distance", "") or "").split()
        distances = {}
        if len(row) == len(ids):
            distances = {other: int(d) for other, d in zip(ids, row) if d.isdigit()}
        else:
            notes.append(f"node{nid}/distance has {len(row)} entries for {len(ids)} online nodes")
        hmat = _read_hmat(nid)
        hmat_any = hmat_any or hmat is not None
        nodes.append(Node(id=nid, cpus=cpus, tier=Tier.DRAM, mem_total_bytes=mem.get("MemTotal", 0),
                          mem_free_bytes=mem.get("MemFree", 0), distances=distances, hmat=hmat,
                          memory_tier=tiers.get(nid), evidence=[]))
    if not nodes:
        nodes = [_fallback_single_node(notes)]
    elif not hmat_any and len(nodes) > 1:
        notes.append("no HMAT figures on any node (firmware has no HMAT table, or kernel < v5.6): "
                     "classification uses CPUs, device origin, memory tiers and distance")

    dax = read_dax(notes)
    namespaces = read_namespaces()
    fsdax = read_fsdax(namespaces, notes)
    memdevs, regions = read_cxl(dax)
    gpus = read_gpus(notes)
    probe = read_saved(saved_path(config), notes)      # tieringctl probe --save, this boot only

    cpu_nodes = [n for n in nodes if n.cpus]
    for n in nodes:
        if n.evidence:      # the no-NUMA fallback node already says what it is
            continue
        n.tier, n.evidence, n.origin = classify(n, cpu_nodes, dax, bool(memdevs or regions), probe)
        n.dax_devices = [d.name for d in dax if d.driver == "kmem" and d.target_node == n.id]
    for nid, tier in overrides.items():
        try:
            n = next(x for x in nodes if x.id == nid)
        except StopIteration:
            notes.append(f"config [topology.nodes.{nid}] names a node that is not online")
            continue
        n.evidence.append(f"config override: tier = {tier.label} (evidence said {n.tier.label})")
        n.tier, n.overridden = tier, True

    return Topology(nodes=nodes, dax_devices=dax, namespaces=namespaces, fsdax_mounts=fsdax,
                    cxl_memdevs=memdevs, cxl_regions=regions, gpus=gpus, kernel=kernel, notes=notes)


# ---- the DAX-remap tier (docs/dax.md) ------------------------------------------------------------

DAX_LOG_NAME = "tieringd/kv.log"    # under an fsdax mount, unless [dax] path says otherwise


@dataclasses.dataclass
class RemapTier:
    """Where the DAX-remap tier keeps remapped KV ranges: a file on an fsdax mount, or a devdax
    device not onlined as system RAM. Slower than every NUMA tier; no node of its own."""
    path: str
    kind: str                   # fsdax | devdax | file (a mount without DAX: tests only)
    source: str | None          # the mount point or the dax device it lives on
    size_bytes: int | None      # the log's size (the file's, or the device's); None: not created yet
    configured: bool            # [dax] path named it (else: the first fsdax mount)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def remap_tier(topo: Topology, cfg: dict[str, Any] | None = None) -> RemapTier | None:
    """The DAX-remap tier of this machine: ``[dax] path`` when set (a file, or /dev/daxX.Y), else
    ``<first fsdax mount>/tieringd/kv.log``; None when there is neither. Reads no process state
    (what is in use there is the daemon's to say: ``tieringd.shim.remap.DaxTier.capacity``)."""
    path = section(cfg or {}, "dax").get("path") or ""
    if not isinstance(path, str):
        raise ConfigError.bad_value("dax", "path", "a path", path)
    configured = bool(path)
    if not path:
        mounts = [m for m in topo.fsdax_mounts if m.dax == "always"]
        if not mounts:
            return None
        path = os.path.join(mounts[0].mountpoint, DAX_LOG_NAME)
    name = os.path.basename(path)
    dev = next((d for d in topo.dax_devices if d.name == name and path.startswith("/dev/")), None)
    if dev is not None:
        return RemapTier(path, "devdax", dev.name, dev.size_bytes, configured)
    mount = max((m for m in topo.fsdax_mounts if path.startswith(m.mountpoint.rstrip("/") + "/")),
                key=lambda m: len(m.mountpoint), default=None)
    try:
        size = os.stat(path).st_size
    except OSError:
        size = None
    return RemapTier(path, "fsdax" if mount else "file", mount.mountpoint if mount else None, size,
                     configured)
