# SPDX-License-Identifier: Apache-2.0
"""One reader per /proc format, all through :mod:`tieringd.kernel.sysfs` (so a captured tree can stand in).

- ``/proc/PID/numa_maps`` → :func:`read_numa_maps` (resident pages per node and VMA: who has pages on a
  node that is going offline, ``tieringd/memory/dax.py``);
- ``/proc/PID/maps`` → :func:`read_maps` (:class:`Vma` rows, one parser for the registry's ownership
  checks, ``tieringctl migrate --all``, the DMA uprobes and the accessed-bit fallback);
- ``/proc/PID/pagemap`` → :func:`read_pagemap` (a contiguous run) and :func:`read_pagemap_at`
  (scattered addresses, one ``pread`` per stretch), decoded with the ``PM_*`` masks; its
  PAGEMAP_SCAN ioctl (6.7+) → :func:`pmd_mapped_ranges`;
- ``/proc/kpageflags``, ``/proc/kpagecount`` → :func:`read_kpageflags`, :func:`read_kpagecount`;
- ``/proc/PID/mem`` → :func:`read_mem` (a block's bytes, to compare blocks by content);
- ``/proc/vmstat`` → :func:`read_vmstat`; ``/proc/PID/stat`` → :func:`read_stat`;
- ``/proc/zoneinfo`` → :func:`read_zoneinfo` (:class:`Zone` rows: each zone's watermarks, the free
  memory the kernel keeps for itself on a node).

Every flag below is a *mask* (``1 << bit``), named as the kernel names the bit
(Documentation/admin-guide/mm/pagemap.rst; include/uapi/linux/kernel-page-flags.h).
"""
from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import re
import struct
from typing import Iterable

import numpy as np

from tieringd.kernel import sysfs

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
PAGE_SHIFT = PAGE_SIZE.bit_length() - 1
HPAGE_PMD_SIZE = 2 << 20              # a PMD-mapped transparent huge page on x86-64
HPAGE_PMD_NR = HPAGE_PMD_SIZE // PAGE_SIZE

# /proc/PID/pagemap, one u64 per virtual page
PM_PRESENT = 1 << 63
PM_SWAPPED = 1 << 62
PM_FILE_OR_SHARED = 1 << 61           # file page or shared anonymous (since 3.5)
PM_EXCLUSIVE = 1 << 56                # page exclusively mapped (since 4.2)
PM_SOFT_DIRTY = 1 << 55
PM_PFN_MASK = (1 << 55) - 1           # 0 for callers without CAP_SYS_ADMIN (since 4.2)

# /proc/PID/pagemap's PAGEMAP_SCAN ioctl (6.7+, include/uapi/linux/fs.h): _IOWR('f', 16, struct
# pm_scan_arg), the arg twelve u64s, each result a struct page_region (start, end, categories)
PAGEMAP_SCAN = 0xC0606610
PAGE_IS_HUGE = 1 << 6                 # a PMD-mapped THP or hugetlb page (not a PTE-mapped one)
_PM_SCAN_ARG = struct.Struct("<12Q")
_PAGE_REGION = struct.Struct("<3Q")
_SCAN_REGIONS = 1024                  # page_region slots per ioctl; a full vector goes on from walk_end

# /proc/kpageflags, one u64 per page frame
KPF_COMPOUND_HEAD = 1 << 15
KPF_HUGE = 1 << 17                    # hugetlbfs
KPF_KSM = 1 << 21                     # merged by KSM: its mappings are every copy it replaced
KPF_THP = 1 << 22
KPF_ZERO_PAGE = 1 << 24               # the shared zero page (a read of memory never written)

# Mappings with no struct pages behind them (or not the process's own memory): never migrated and
# never a KV region. The "[vvar" prefix also covers 6.x's "[vvar_vclock]".
NO_STRUCT_PAGE_PREFIXES = ("[vdso]", "[vvar", "[vsyscall]", "[uprobes]")


@dataclasses.dataclass(frozen=True)
class Vma:
    """One line of /proc/PID/maps."""
    start: int
    end: int
    perms: str          # "rw-p"
    offset: int
    inode: int
    path: str           # "" for anonymous memory; "[heap]", "/memfd:name (deleted)", a file path

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def readable(self) -> bool:
        return self.perms[0] == "r"

    @property
    def writable(self) -> bool:
        return self.perms[1] == "w"

    @property
    def executable(self) -> bool:
        return self.perms[2] == "x"

    @property
    def shared(self) -> bool:
        return self.perms[3] == "s"

    @property
    def anonymous(self) -> bool:
        """Private anonymous memory (malloc's arenas and mmaps)."""
        return not self.path and not self.shared

    @property
    def stack(self) -> bool:
        return self.path.startswith("[stack")

    @property
    def no_struct_pages(self) -> bool:
        """[vdso], [vvar], [vsyscall], [uprobes]: move_pages has nothing to move there."""
        return self.path.startswith(NO_STRUCT_PAGE_PREFIXES)


_MAPS_LINE = re.compile(r"^([0-9a-f]+)-([0-9a-f]+)\s+(\S{4})\s+([0-9a-f]+)\s+\S+\s+(\d+)\s*(.*)$")


def parse_maps(lines: Iterable[str]) -> list[Vma]:
    out = []
    for line in lines:
        m = _MAPS_LINE.match(line)
        if m:
            out.append(Vma(int(m[1], 16), int(m[2], 16), m[3], int(m[4], 16), int(m[5]), m[6].strip()))
    return out


def read_maps(pid: int | str, default=sysfs.MISSING) -> list[Vma]:
    """``/proc/PID/maps`` as VMAs in address order (the kernel lists them sorted).
    Raises :class:`tieringd.kernel.sysfs.SysfsError` when unreadable, unless ``default`` is given."""
    lines = sysfs.read_lines(f"/proc/{pid}/maps", None)
    if lines is None:
        if default is not sysfs.MISSING:
            return default
        sysfs.read_lines(f"/proc/{pid}/maps")     # raises with the reason
    return parse_maps(lines)


@dataclasses.dataclass(frozen=True)
class NumaMapsRow:
    """One line of /proc/PID/numa_maps: a VMA's start, policy, and resident pages per node."""
    start: int
    policy: str                         # "default", "bind:2", "bind=balancing:0", …
    pages_by_node: dict[int, int]       # N<node>=<pages>, in units of page_kb
    page_kb: int                        # kernelpagesize_kB (4, or 2048 for hugetlb)


def read_numa_maps(pid: int | str) -> list[NumaMapsRow]:
    """``/proc/PID/numa_maps`` (proc(5)); [] when the process is gone or it cannot be read."""
    out = []
    for line in sysfs.read_lines(f"/proc/{pid}/numa_maps", []):
        words = line.split()
        if len(words) < 2:
            continue
        nodes, page_kb = {}, PAGE_SIZE // 1024
        for w in words[2:]:
            key, _, value = w.partition("=")
            if key[:1] == "N" and key[1:].isdigit() and value.isdigit():
                nodes[int(key[1:])] = int(value)
            elif key == "kernelpagesize_kB" and value.isdigit():
                page_kb = int(value)
        out.append(NumaMapsRow(int(words[0], 16), words[1], nodes, page_kb))
    return out


def _pid_path(pid: int) -> str:
    return "self" if pid in (0, os.getpid()) else str(pid)


def read_pagemap(pid: int, start: int, npages: int) -> np.ndarray:
    """Raw pagemap entries (uint64) of ``npages`` pages from ``start``; pages past the end of what the
    kernel returned read as 0 (not present)."""
    raw = sysfs.pread(f"/proc/{_pid_path(pid)}/pagemap", (start >> PAGE_SHIFT) * 8, npages * 8)
    out = np.zeros(npages, dtype=np.uint64)
    got = np.frombuffer(raw, dtype="<u8")
    out[:len(got)] = got
    return out


_PAGEMAP_GAP = 4096           # pages (32 KiB of pagemap): reading through a gap beats a syscall


def read_pagemap_at(pid: int, addrs: np.ndarray) -> np.ndarray:
    """Raw pagemap entries for the pages holding ``addrs`` (any order), one pread per stretch of pages
    less than ``_PAGEMAP_GAP`` apart."""
    pages = np.asarray(addrs, np.uint64) >> np.uint64(PAGE_SHIFT)
    out = np.zeros(len(pages), np.uint64)
    if len(pages) == 0:
        return out
    order = np.argsort(pages, kind="stable")
    sp = pages[order]
    brk = np.flatnonzero(np.diff(sp.astype(np.int64)) > _PAGEMAP_GAP) + 1
    for run in np.split(np.arange(len(sp)), brk):
        first, last = int(sp[run[0]]), int(sp[run[-1]])
        vals = read_pagemap(pid, first << PAGE_SHIFT, last - first + 1)
        out[order[run]] = vals[sp[run].astype(np.int64) - first]
    return out


def pmd_mapped_ranges(pid: int, start: int, end: int) -> np.ndarray | None:
    """The PMD-mapped huge pages of ``pid`` in [start, end) (page-aligned): (n, 2) uint64 rows of
    [start, end), adjacent ones merged, from one PAGEMAP_SCAN walk of the page tables. None where the
    kernel has no such ioctl (before 6.7: ENOTTY) or refuses the arguments (EINVAL); other errors
    (the process gone) raise SysfsError."""
    vec = ctypes.create_string_buffer(_PAGE_REGION.size * _SCAN_REGIONS)
    out: list[tuple[int, int]] = []
    while start < end:
        arg = bytearray(_PM_SCAN_ARG.pack(_PM_SCAN_ARG.size, 0, start, end, 0, ctypes.addressof(vec),
                                          _SCAN_REGIONS, 0, 0, PAGE_IS_HUGE, 0, PAGE_IS_HUGE))
        try:
            n = sysfs.ioctl(f"/proc/{_pid_path(pid)}/pagemap", PAGEMAP_SCAN, arg)
        except sysfs.SysfsError as e:
            if e.errno in (errno.ENOTTY, errno.EINVAL):
                return None
            raise
        for i in range(n):
            lo, hi, _ = _PAGE_REGION.unpack_from(vec, i * _PAGE_REGION.size)
            if out and out[-1][1] == lo:
                out[-1] = (out[-1][0], hi)
            else:
                out.append((lo, hi))
        walk_end = _PM_SCAN_ARG.unpack(arg)[4]
        if n < _SCAN_REGIONS or walk_end <= start:
            break
        start = walk_end
    return np.array(out, np.uint64).reshape(-1, 2)


def present(entries: np.ndarray) -> np.ndarray:
    return (entries & np.uint64(PM_PRESENT)) != 0


def pfns(entries: np.ndarray) -> np.ndarray:
    """PFNs of present pages (0 where not present or hidden from a caller without CAP_SYS_ADMIN)."""
    return np.where(present(entries), entries & np.uint64(PM_PFN_MASK), np.uint64(0))


def exclusive(entries: np.ndarray) -> np.ndarray:
    """Mapped by exactly one process (4.2+); still visible when PFNs are hidden."""
    return (entries & np.uint64(PM_EXCLUSIVE)) != 0


def file_or_shared(entries: np.ndarray) -> np.ndarray:
    """A file page or a shared anonymous page (3.5+)."""
    return (entries & np.uint64(PM_FILE_OR_SHARED)) != 0


# PFNs closer than this are read with one pread through the gap. The kernel spends about 95 ns on
# each PFN it reports (6.18, kpagecount and kpageflags alike) and a pread with its Python around it
# costs a few µs, so reading through a gap pays up to a few dozen PFNs; at 8192 PFNs, 16,384 pages
# of a populated 4 KiB pool (PFNs scattered over 8 GiB) read 70 MB of kpagecount in 340 ms.
_KPAGE_SPAN = 32


def _read_per_pfn(path: str, pfn_values: np.ndarray) -> np.ndarray:
    """One u64 per PFN from /proc/kpageflags or /proc/kpagecount (PFN 0 → 0), the file opened once."""
    pfn_values = np.asarray(pfn_values, np.uint64)
    out = np.zeros(len(pfn_values), np.uint64)
    want = np.flatnonzero(pfn_values)
    if len(want) == 0:
        return out
    order = want[np.argsort(pfn_values[want], kind="stable")]
    sp = pfn_values[order].astype(np.int64)
    brk = np.flatnonzero(np.diff(sp) > _KPAGE_SPAN) + 1
    firsts = sp[np.concatenate([[0], brk])]
    lasts = sp[np.concatenate([brk - 1, [len(sp) - 1]])]
    raw = sysfs.pread_runs(path, [(int(f) * 8, int(n) * 8) for f, n in zip(firsts, lasts - firsts + 1)])
    # one buffer of every run's words, and each wanted PFN's place in it
    vals = np.frombuffer(b"".join(raw), "<u8")
    got_words = np.array([len(r) // 8 for r in raw], np.int64)
    run_of = np.repeat(np.arange(len(firsts)), np.diff(np.concatenate([[0], brk, [len(sp)]])))
    offset_in_run = sp - firsts[run_of]
    ok = offset_in_run < got_words[run_of]
    base = np.concatenate([[0], np.cumsum(got_words)[:-1]])
    out[order[ok]] = vals[base[run_of[ok]] + offset_in_run[ok]]
    return out


def read_kpageflags(pfn_values: np.ndarray) -> np.ndarray:
    """``KPF_*`` flag words of page frames (needs CAP_SYS_ADMIN)."""
    return _read_per_pfn("/proc/kpageflags", pfn_values)


def read_kpagecount(pfn_values: np.ndarray) -> np.ndarray:
    """How many times each page frame is mapped (needs CAP_SYS_ADMIN)."""
    return _read_per_pfn("/proc/kpagecount", pfn_values).astype(np.int64)


def read_mem(pid: int, addr: int, length: int) -> bytes:
    """``length`` bytes of process ``pid``'s memory at ``addr`` (``/proc/PID/mem``: ptrace access,
    root). Fewer when the range runs past a mapping; a page not present is faulted in by the read,
    so callers read only memory they found present. Raises :class:`tieringd.kernel.sysfs.SysfsError`
    when the process is gone or the address is not mapped."""
    return sysfs.pread(f"/proc/{_pid_path(pid)}/mem", addr, length)


def read_vmstat(keys: Iterable[str] | None = None) -> dict[str, int]:
    """/proc/vmstat counters (all, or those of ``keys`` the running kernel has)."""
    raw = sysfs.read_keyed("/proc/vmstat", {})
    wanted = raw.keys() if keys is None else [k for k in keys if k in raw]
    out = {}
    for k in wanted:
        try:
            out[k] = int(raw[k])
        except ValueError:
            pass
    return out


@dataclasses.dataclass(frozen=True)
class Zone:
    """One zone of /proc/zoneinfo, in pages (mm/vmstat.c ``zoneinfo_show_print``)."""
    node: int
    name: str                   # "DMA", "DMA32", "Normal", "Movable", "Device"
    free: int
    min: int
    low: int
    high: int
    promo: int                  # the NUMA-balancing promotion watermark; ``high`` where not listed
    managed: int
    protection: tuple[int, ...]     # lowmem_reserve[]: one entry per zone of the node, in zone order


_ZONE_HEAD = re.compile(r"^Node\s+(\d+),\s+zone\s+(\S+)")
_ZONE_FIELDS = ("free", "min", "low", "high", "promo", "managed")


def parse_zoneinfo(lines: Iterable[str]) -> list[Zone]:
    """Zones in file order. Only the zone's own lines count: the per-CPU pagesets below them also
    have ``high:`` lines (with a colon and deeper indent), and 6.1 lists no ``promo`` line."""
    zones, cur = [], None

    def close():
        if cur is not None:
            f = cur["fields"]
            f.setdefault("promo", f.get("high", 0))
            values = (f.get(k, 0) for k in _ZONE_FIELDS)
            zones.append(Zone(cur["node"], cur["name"], *values, cur["protection"]))
    for line in lines:
        head = _ZONE_HEAD.match(line)
        if head:
            close()
            cur = {"node": int(head.group(1)), "name": head.group(2), "fields": {}, "protection": ()}
            continue
        if cur is None:
            continue
        words = line.split()
        if len(words) == 3 and words[:2] == ["pages", "free"]:
            cur["fields"]["free"] = int(words[2])
        elif len(words) == 2 and words[0] in _ZONE_FIELDS and words[1].isdigit():
            cur["fields"].setdefault(words[0], int(words[1]))
        elif words and words[0] == "protection:":
            cur["protection"] = tuple(int(x) for x in re.findall(r"\d+", line))
    close()
    return zones


def read_zoneinfo(default=sysfs.MISSING) -> list[Zone]:
    """``/proc/zoneinfo`` as :class:`Zone` rows. Raises :class:`tieringd.kernel.sysfs.SysfsError` when
    unreadable, unless ``default`` is given."""
    lines = sysfs.read_lines("/proc/zoneinfo", None)
    if lines is None:
        if default is not sysfs.MISSING:
            return default
        sysfs.read_lines("/proc/zoneinfo")     # raises with the reason
    return parse_zoneinfo(lines)


def read_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name, so ``fields[0]`` is the state ("R", "Z") and
    field N of proc(5) is ``fields[N - 3]``; None when the process is gone."""
    text = sysfs.read_text(f"/proc/{pid}/stat", None)
    if text is None:
        return None
    return text.rpartition(")")[2].split()


def read_numa_scan_seq(pid: int) -> int | None:
    """``mm->numa_scan_seq`` from /proc/PID/sched: how many passes NUMA balancing has completed over
    the process's address space (CONFIG_NUMA_BALANCING; /proc/PID/sched needs CONFIG_SCHED_DEBUG
    before 6.15). None when the process is gone or the kernel does not show it."""
    text = sysfs.read_text(f"/proc/{pid}/sched", None)
    m = re.search(r"^mm->numa_scan_seq\s*:\s*(\d+)\s*$", text or "", re.M)
    return int(m.group(1)) if m else None


# ---- processes: /proc/PID/{comm,status,cgroup,ksm_stat,task,exe,cmdline,root} ------------------------

def pids() -> list[int]:
    """Every process on the machine (the numeric entries of /proc), in pid order."""
    return sorted(int(os.path.basename(p)) for p in sysfs.glob("/proc/[0-9]*"))


def alive(pid: int) -> bool:
    """A /proc entry exists for ``pid`` (a zombie still has one: see :func:`read_stat`)."""
    return pid > 0 and sysfs.exists(f"/proc/{pid}")


def read_comm(pid: int | str) -> str | None:
    """The command name (``/proc/PID/comm``, 15 characters at most); None when the process is gone."""
    return sysfs.read_text(f"/proc/{pid}/comm", None)


def read_status(pid: int | str) -> dict[str, str] | None:
    """``/proc/PID/status`` as key → value text ("Uid": "0\t0\t0\t0"); None when the process is gone."""
    return sysfs.read_keyed(f"/proc/{pid}/status", None)


def read_cgroup(pid: int | str) -> list[str]:
    """Lines of ``/proc/PID/cgroup`` ("0::/system.slice/x.service" on cgroup v2); [] when gone."""
    return sysfs.read_lines(f"/proc/{pid}/cgroup", [])


def read_ksm_stat(pid: int) -> dict[str, str] | None:
    """``/proc/PID/ksm_stat`` (6.1+: ksm_rmap_items, ksm_merging_pages, later ksm_process_profit and
    ksm_mergeable) as key → value text; on 5.19, which has only ``/proc/PID/ksm_merging_pages``, that
    one key. None where the kernel shows neither, or the process is gone."""
    stat = sysfs.read_keyed(f"/proc/{pid}/ksm_stat", None)
    if stat is not None:
        return stat
    pages = sysfs.read_text(f"/proc/{pid}/ksm_merging_pages", None)
    return None if pages is None else {"ksm_merging_pages": pages}


def thread_count(pid: int) -> int:
    """Threads listed under ``/proc/PID/task`` (0 when the process is gone)."""
    return len(sysfs.listdir(f"/proc/{pid}/task", []))


def process_identity(pid: int) -> tuple[int, str, tuple[str, ...]] | None:
    """What tells one process from a later one with the same pid: (start time in clock ticks since
    boot, proc(5) stat field 22; the executable, "" when unreadable; the command line). None when
    the process is gone or a zombie."""
    fields = read_stat(pid)
    if fields is None or fields[0] in ("Z", "X") or len(fields) < 20:
        return None
    exe = sysfs.readlink(f"/proc/{pid}/exe", "")
    raw = sysfs.read_bytes(f"/proc/{pid}/cmdline", b"")
    cmdline = tuple(a.decode(errors="replace") for a in raw.split(b"\0")[:-1]) if raw else ()
    return int(fields[19]), exe, cmdline


def root_path(pid: int, path: str) -> str:
    """The real filesystem path of ``path`` as process ``pid`` sees it (through ``/proc/PID/root``:
    its mount namespace and chroot)."""
    return sysfs.path(f"/proc/{pid}/root{path}")


# ---- the machine: /proc/meminfo, /proc/self/mountinfo, /proc/config.gz, /proc/sys ---------------------

SYSCTL_DIR = "/proc/sys"


def sysctl_path(name: str) -> str:
    """The file of a sysctl named as sysctl(8) names it: "kernel.numa_balancing" →
    /proc/sys/kernel/numa_balancing."""
    return f"{SYSCTL_DIR}/{name.replace('.', '/')}"


def read_sysctl(name: str, default=sysfs.MISSING) -> str:
    return sysfs.read_text(sysctl_path(name), default)


def read_sysctl_int(name: str, default=sysfs.MISSING) -> int:
    return sysfs.read_int(sysctl_path(name), default)


def read_meminfo() -> dict[str, str]:
    """``/proc/meminfo`` as key → value text ("MemTotal": "16384 kB"); {} when unreadable."""
    return sysfs.read_keyed("/proc/meminfo", {})


def read_mountinfo() -> list[str] | None:
    """Lines of ``/proc/self/mountinfo`` (proc(5)); None when unreadable."""
    return sysfs.read_lines("/proc/self/mountinfo", None)


def read_config_gz() -> bytes | None:
    """``/proc/config.gz`` (CONFIG_IKCONFIG_PROC), still compressed; None where the kernel has none."""
    return sysfs.read_bytes("/proc/config.gz", None)
