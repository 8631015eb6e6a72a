# SPDX-License-Identifier: Apache-2.0
"""The memory devices behind the nodes, as sysfs and NVML show them: DAX devices (and the memory
they came from), NVDIMM namespaces, fsdax mounts, CXL memory devices and regions, GPUs.

Each reader returns plain dataclasses and appends what it could not read to ``notes``;
:func:`tieringd.memory.topology.discover` puts them together with the nodes.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from tieringd.contracts import Tier
from tieringd.kernel import procfs, sysfs

# The kernel's namespace modes under ndctl's names (ndctl/namespace.c): what users type and read.
_ND_MODES = {"memory": "fsdax", "dax": "devdax", "safe": "sector", "raw": "raw"}
_MOUNT_ESCAPE = re.compile(r"\\([0-7]{3})")


@dataclasses.dataclass
class DaxDevice:
    name: str                   # dax0.0
    size_bytes: int | None
    target_node: int | None     # the node kmem onlines it into (None: unknown / -1)
    driver: str | None          # kmem, device_dax, or None (unbound)
    origin: str                 # pmem | cxl-pmem | cxl-ram | hmem | unknown
    parent: str | None          # region0, hmem.0, … (the device the memory came from)
    path: str                   # kernel path of the device directory

    @property
    def mode(self) -> str:
        """daxctl's names: kmem → system-ram, device_dax → devdax."""
        return {"kmem": "system-ram", "device_dax": "devdax"}.get(self.driver or "", "unbound")

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "mode": self.mode}


@dataclasses.dataclass
class Namespace:
    """An NVDIMM namespace (ndctl's unit): fsdax → /dev/pmemN, devdax → /dev/daxX.Y."""
    name: str
    region: str | None
    mode: str | None            # fsdax | devdax | raw | sector
    size_bytes: int | None
    blockdev: str | None        # pmem0 (fsdax/raw)
    numa_node: int | None
    target_node: int | None
    cxl: bool                   # the region sits on a CXL nvdimm-bridge

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class FsdaxMount:
    mountpoint: str
    source: str
    fstype: str
    dax: str                    # always | inode | never (ext4/xfs "dax" alone = always)
    namespace: str | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class CxlMemdev:
    name: str
    ram_size_bytes: int | None
    pmem_size_bytes: int | None
    serial: str | None
    numa_node: int | None       # proximity of the device (host bridge), not of its memory
    firmware_version: str | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class CxlRegion:
    name: str
    mode: str | None            # ram | pmem
    size_bytes: int | None
    targets: list[str]          # endpoint decoders (one per interleaved memdev)
    dax_devices: list[str]
    nodes: list[int]            # NUMA nodes its memory became

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Gpu:
    index: int
    name: str
    uuid: str | None
    memory_total_bytes: int | None
    memory_free_bytes: int | None
    pci_bus_id: str | None
    numa_node: int | None

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "tier": Tier.GPU_HBM.label}


def int_or_none(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text.strip(), 0)
    except ValueError:
        return None


def read_int_or_none(p: str) -> int | None:
    return int_or_none(sysfs.read_text(p, None))


def _driver(dev: str) -> str | None:
    link = sysfs.readlink(f"{dev}/driver", None)
    return os.path.basename(link) if link else None


def read_dax(notes: list[str]) -> list[DaxDevice]:
    if not sysfs.is_dir("/sys/bus/dax"):
        return []
    out = []
    for link in sysfs.glob("/sys/bus/dax/devices/dax*"):
        name = os.path.basename(link)
        real = sysfs.realpath(link)
        origin, parent = "unknown", None
        # The device's place in the device tree says where its memory came from:
        #   …/ndbusN/regionM/daxM.K/daxM.0            NVDIMM (NFIT, e820 pmem, or a CXL pmem region
        #                                              when ndbusN hangs off a cxl nvdimm-bridge)
        #   …/decoderX.Y/regionN/dax_regionN/daxN.0    CXL ram region (v6.3+, drivers/dax/cxl.c)
        #   …/hmem.N/daxN.0                            soft-reserved (EFI specific-purpose) memory
        m = re.search(r"/ndbus\d+/(region\d+)/", real)
        if m:
            parent = m.group(1)
            origin = "cxl-pmem" if "/nvdimm-bridge" in real else "pmem"
        else:
            m = re.search(r"/(region\d+)/dax_region\d+/", real)
            if m:
                parent, origin = m.group(1), "cxl-ram"
            else:
                m = re.search(r"/(hmem\.?\d*)/", real)
                if m:
                    parent, origin = m.group(1), "hmem"
        target = read_int_or_none(f"{link}/target_node")
        out.append(DaxDevice(
            name=name, size_bytes=read_int_or_none(f"{link}/size"),
            target_node=target if target is not None and target >= 0 else None,
            driver=_driver(link), origin=origin, parent=parent, path=real))
    return out


def read_namespaces() -> list[Namespace]:
    out = []
    for link in sysfs.glob("/sys/bus/nd/devices/namespace*"):
        real = sysfs.realpath(link)
        m = re.search(r"/(region\d+)/", real)
        size = read_int_or_none(f"{link}/size")
        if not size:
            continue        # the idle "seed" namespace every region offers
        target = read_int_or_none(f"{link}/target_node")
        # raw namespaces name their block device; in fsdax mode it hangs off the pfn device that
        # holds the namespace (…/regionN/pfnN.M/block/pmemN)
        blockdev = sysfs.read_text(f"{link}/blockdev", None) or None
        holder = sysfs.read_text(f"{link}/holder", "")
        if not blockdev and holder:
            found = sysfs.glob(f"/sys/bus/nd/devices/{holder}/block/*")
            blockdev = os.path.basename(found[0]) if found else None
        mode = sysfs.read_text(f"{link}/mode", None)
        out.append(Namespace(
            name=os.path.basename(link), region=m.group(1) if m else None,
            mode=_ND_MODES.get(mode or "", mode), size_bytes=size, blockdev=blockdev,
            numa_node=read_int_or_none(f"{link}/numa_node"),
            target_node=target if target is not None and target >= 0 else None,
            cxl="/nvdimm-bridge" in real))
    return out


def read_fsdax(namespaces: list[Namespace], notes: list[str]) -> list[FsdaxMount]:
    lines = procfs.read_mountinfo()
    if lines is None:
        notes.append("fsdax mounts: /proc/self/mountinfo is unreadable")
        return []
    by_blockdev = {ns.blockdev: ns.name for ns in namespaces if ns.blockdev}
    out = []
    for line in lines:
        pre, sep, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if not sep or len(fields) < 6 or len(tail) < 3:
            continue
        mountpoint = _MOUNT_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
        fstype, source = tail[0], tail[1]
        opts = fields[5].split(",") + tail[2].split(",")
        dax = None
        for o in opts:
            if o == "dax":
                dax = "always"          # the old ext4/xfs spelling
            elif o.startswith("dax="):
                dax = o[4:]
        if dax is None or dax == "never":
            continue
        out.append(FsdaxMount(mountpoint=mountpoint, source=source, fstype=fstype, dax=dax,
                              namespace=by_blockdev.get(os.path.basename(source))))
    return out


def read_cxl(dax: list[DaxDevice]) -> tuple[list[CxlMemdev], list[CxlRegion]]:
    memdevs, regions = [], []
    if not sysfs.is_dir("/sys/bus/cxl"):
        return memdevs, regions
    for link in sysfs.glob("/sys/bus/cxl/devices/mem[0-9]*"):
        memdevs.append(CxlMemdev(
            name=os.path.basename(link),
            ram_size_bytes=read_int_or_none(f"{link}/ram/size"), pmem_size_bytes=read_int_or_none(f"{link}/pmem/size"),
            serial=sysfs.read_text(f"{link}/serial", None), numa_node=read_int_or_none(f"{link}/numa_node"),
            firmware_version=sysfs.read_text(f"{link}/firmware_version", None)))
    for link in sysfs.glob("/sys/bus/cxl/devices/region[0-9]*"):
        name = os.path.basename(link)
        real = sysfs.realpath(link)
        targets = [t for t in (sysfs.read_text(p, "") for p in sysfs.glob(f"{link}/target[0-9]*")) if t]
        mine = [d for d in dax if d.path.startswith(real + "/")
                or (d.origin in ("cxl-ram", "cxl-pmem") and d.parent == name)]
        regions.append(CxlRegion(
            name=name, mode=sysfs.read_text(f"{link}/mode", None), size_bytes=read_int_or_none(f"{link}/size"),
            targets=targets, dax_devices=[d.name for d in mine],
            nodes=sorted({d.target_node for d in mine if d.driver == "kmem" and d.target_node is not None})))
    return memdevs, regions


def read_gpus(notes: list[str]) -> list[Gpu]:
    """GPUs through NVML; no pynvml or no driver means no GPUs, not an error."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except Exception:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:
        return []               # library present, no driver: a machine without NVIDIA GPUs
    gpus = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)

            def opt(fn, *args):
                try:
                    v = fn(h, *args)
                    return v.decode() if isinstance(v, bytes) else v
                except Exception:
                    return None
            mem = opt(pynvml.nvmlDeviceGetMemoryInfo)
            pci = opt(pynvml.nvmlDeviceGetPciInfo)
            bus_id = getattr(pci, "busId", None) if pci is not None else None
            numa = opt(pynvml.nvmlDeviceGetNumaNodeId) if hasattr(pynvml, "nvmlDeviceGetNumaNodeId") else None
            gpus.append(Gpu(
                index=i, name=opt(pynvml.nvmlDeviceGetName) or f"GPU {i}", uuid=opt(pynvml.nvmlDeviceGetUUID),
                memory_total_bytes=getattr(mem, "total", None), memory_free_bytes=getattr(mem, "free", None),
                pci_bus_id=bus_id.decode() if isinstance(bus_id, bytes) else bus_id,
                numa_node=numa if isinstance(numa, int) and numa >= 0 else None))
    except Exception as e:      # a driver that answers init but fails later: say so, keep the rest
        notes.append(f"NVML: {e}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return gpus
