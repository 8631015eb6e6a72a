# SPDX-License-Identifier: Apache-2.0
"""perf_event_open(2) through ctypes, and the choice of a data-address sampling event.

Events, in the order ``auto`` tries them:

- ``amd-ibs-op``: AMD Instruction-Based Sampling, op sampler (PMU ``ibs_op``); the data linear address
  reaches ``PERF_SAMPLE_ADDR`` on kernels with IBS load/store decoding (v6.1+).
- ``intel-mem-loads``: the core PMU's ``mem-loads`` event (PEBS load latency, ``ldlat`` threshold),
  precise; PEBS records the data linear address.
- ``software-page-faults`` (never chosen by ``auto``: the fault sampler already sees faults): the
  software page-fault event with period 1 — the kernel passes the faulting address as the sample
  address, so VMs without a PMU exercise the same BPF program path. The tests use it.
"""
from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import platform

from tieringd.kernel import sysfs

PERF_TYPE_HARDWARE = 0
PERF_TYPE_SOFTWARE = 1
PERF_COUNT_SW_PAGE_FAULTS = 2
PERF_SAMPLE_IP = 1 << 0
PERF_SAMPLE_TID = 1 << 1
PERF_SAMPLE_ADDR = 1 << 3
PERF_SAMPLE_WEIGHT = 1 << 14
PERF_SAMPLE_DATA_SRC = 1 << 15
PERF_FLAG_FD_CLOEXEC = 1 << 3

ATTR_DISABLED = 1 << 0
ATTR_EXCLUDE_KERNEL = 1 << 5
ATTR_EXCLUDE_HV = 1 << 6
ATTR_PRECISE_SHIFT = 15

_NR_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241, "riscv64": 241, "ppc64le": 319, "s390x": 331}
_SYSFS_PMUS = "/sys/bus/event_source/devices"


class PerfEventAttr(ctypes.Structure):
    """struct perf_event_attr up to PERF_ATTR_SIZE_VER5 (112 bytes): every field used here; the
    kernel accepts a smaller ``size`` from older user space."""
    _fields_ = [
        ("type", ctypes.c_uint32), ("size", ctypes.c_uint32), ("config", ctypes.c_uint64),
        ("sample_period", ctypes.c_uint64), ("sample_type", ctypes.c_uint64),
        ("read_format", ctypes.c_uint64), ("flags", ctypes.c_uint64),
        ("wakeup_events", ctypes.c_uint32), ("bp_type", ctypes.c_uint32),
        ("config1", ctypes.c_uint64), ("config2", ctypes.c_uint64),
        ("branch_sample_type", ctypes.c_uint64), ("sample_regs_user", ctypes.c_uint64),
        ("sample_stack_user", ctypes.c_uint32), ("clockid", ctypes.c_int32),
        ("sample_regs_intr", ctypes.c_uint64), ("aux_watermark", ctypes.c_uint32),
        ("sample_max_stack", ctypes.c_uint16), ("reserved_2", ctypes.c_uint16),
    ]


assert ctypes.sizeof(PerfEventAttr) == 112

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def perf_event_open(attr: PerfEventAttr, pid: int, cpu: int, group_fd: int = -1,
                    flags: int = PERF_FLAG_FD_CLOEXEC) -> int:
    nr = _NR_PERF_EVENT_OPEN.get(platform.machine())
    if nr is None:
        raise OSError(errno.ENOSYS, f"perf_event_open: unknown syscall number on {platform.machine()}")
    attr.size = ctypes.sizeof(attr)
    fd = _libc.syscall(ctypes.c_long(nr), ctypes.byref(attr), ctypes.c_int(pid), ctypes.c_int(cpu),
                       ctypes.c_int(group_fd), ctypes.c_ulong(flags))
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"perf_event_open(type={attr.type}, config={attr.config:#x}, cpu={cpu}): "
                      f"{os.strerror(e)}")
    return int(fd)


def online_cpus() -> list[int]:
    return sysfs.parse_list(sysfs.read_text("/sys/devices/system/cpu/online"))


@dataclasses.dataclass
class PmuEvent:
    name: str
    description: str
    attr: PerfEventAttr
    hardware: bool


def pmu_type(pmu: str) -> int | None:
    return sysfs.read_int(f"{_SYSFS_PMUS}/{pmu}/type", None)


def encode_sysfs_event(pmu: str, spec: str) -> dict[str, int]:
    """"event=0xcd,umask=0x1,ldlat=3" with the PMU's format files ("config:0-7", "config1:0-15")
    → {"config": …, "config1": …}."""
    out = {"config": 0, "config1": 0, "config2": 0}
    for term in filter(None, (t.strip() for t in spec.split(","))):
        name, _, value = term.partition("=")
        val = int(value, 0) if value else 1
        fmt = sysfs.read_text(f"{_SYSFS_PMUS}/{pmu}/format/{name}")
        field, _, bits = fmt.partition(":")
        shift = 0
        for part in bits.split(","):
            lo, _, hi = part.partition("-")
            lo, hi = int(lo), int(hi or lo)
            width = hi - lo + 1
            out[field] |= ((val >> shift) & ((1 << width) - 1)) << lo
            shift += width
    return out


def _core_pmu() -> str | None:
    for name in ("cpu", "cpu_core"):             # cpu_core: the P-cores of hybrid Intel parts
        if pmu_type(name) is not None:
            return name
    return None


PMU_EVENTS = ("auto", "amd-ibs-op", "intel-mem-loads", "software-page-faults")


def resolve_event(name: str = "auto", sample_period: int | None = None) -> PmuEvent:
    """The perf event to sample data addresses with; OSError(ENOENT) says why none is usable."""
    tried = []
    if name in ("auto", "amd-ibs-op"):
        t = pmu_type("ibs_op")
        if t is not None:
            a = PerfEventAttr(type=t, config=0, sample_period=sample_period or 100_003,
                              sample_type=PERF_SAMPLE_ADDR | PERF_SAMPLE_TID,
                              flags=ATTR_DISABLED | ATTR_EXCLUDE_KERNEL | ATTR_EXCLUDE_HV)
            return PmuEvent("amd-ibs-op", "AMD IBS op sampling (data linear address)", a, True)
        tried.append("no AMD IBS (no ibs_op PMU)")
    if name in ("auto", "intel-mem-loads"):
        core = _core_pmu()
        spec = sysfs.read_text(f"{_SYSFS_PMUS}/{core}/events/mem-loads", None) if core else None
        if spec is not None:
            cfg = encode_sysfs_event(core, spec)
            if "ldlat" in spec:       # 30 cycles: beyond L1/L2 hits, what tiering cares about
                cfg = encode_sysfs_event(core, spec.replace("ldlat=3", "ldlat=30"))
            a = PerfEventAttr(type=pmu_type(core), config=cfg["config"], config1=cfg["config1"],
                              sample_period=sample_period or 1009,
                              sample_type=PERF_SAMPLE_ADDR | PERF_SAMPLE_TID | PERF_SAMPLE_WEIGHT,
                              flags=ATTR_DISABLED | ATTR_EXCLUDE_KERNEL | ATTR_EXCLUDE_HV
                              | (2 << ATTR_PRECISE_SHIFT))
            return PmuEvent("intel-mem-loads", f"Intel PEBS {core}/mem-loads (load latency)", a, True)
        tried.append("no Intel PEBS load-latency event (no cpu/events/mem-loads: "
                     + ("no core PMU exported — a VM without vPMU?" if core is None else
                        f"{core} PMU lacks it") + ")")
    if name == "software-page-faults":
        a = PerfEventAttr(type=PERF_TYPE_SOFTWARE, config=PERF_COUNT_SW_PAGE_FAULTS,
                          sample_period=sample_period or 1,
                          sample_type=PERF_SAMPLE_ADDR | PERF_SAMPLE_TID,
                          flags=ATTR_DISABLED | ATTR_EXCLUDE_KERNEL | ATTR_EXCLUDE_HV)
        return PmuEvent(name, "software page-fault event (fault address as sample address)", a, False)
    if name not in PMU_EVENTS:
        raise ValueError(f"unknown PMU event {name!r}: {', '.join(PMU_EVENTS)}")
    raise OSError(errno.ENOENT, "no data-address PMU: " + "; ".join(tried))
