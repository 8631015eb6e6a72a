# SPDX-License-Identifier: Apache-2.0
"""The NUMA memory-policy system calls, called raw through ctypes (no libnuma at run time).

    move_pages(pid, addrs, nodes)        move pages of a process; per-page status
    query_pages(pid, addrs)              where each page is now (move_pages with nodes=NULL)
    move_pages_batch(pid, addrs, node)   the engine's form: never raises for partial progress
    migrate_pages(pid, old, new)         move everything of a process from one node set to another
    mbind(addr, length, mode, nodes)     policy (and optionally move) for a range of this process
    get_mempolicy / set_mempolicy        this thread's policy; the node of one of our pages
    set_mempolicy_home_node(...)         6.0+ (x86/arm64); NotSupportedError where missing
    thp_mask(pid, start, npages)         which pages are backed by transparent huge pages

Conventions
- Node sets are iterables of node ids; the nodemask is sized from ``/sys/devices/system/node/possible``
  (rounded up to whole 64-bit words), so it is right for every kernel's ``nr_node_ids``.
- A call that fails as a whole raises a :class:`NumaError` subclass chosen by errno, whose message names
  the call, the pid and the nodes involved. Per-page results are never raised: they are status values,
  a node id (>= 0) or a negative errno, decoded by :func:`decode_status`.
- ``move_pages`` status is only partly filled when the kernel stops early: since Linux 4.17
  ("mm, migrate: ... report the number of non-migrated pages", a49bd4d71637) a positive return value
  counts pages that were not migrated and the status of the pages in the failed run is left untouched.
  This module pre-fills status with :data:`STATUS_UNREPORTED` so such entries are recognisable; the
  only reliable way to learn where those pages are is a :func:`query_pages` afterwards (the mover does).

Kernel facts relied on (mm/migrate.c, mm/mempolicy.c, 6.1–6.18):
- ``move_pages`` allocates on the target with ``__GFP_THISNODE``: a full target fails with ENOMEM for the
  whole call (the pages moved before the failure stay moved), never with a silent spill elsewhere.
- a node without memory or outside ``MAX_NUMNODES`` fails the whole call with ENODEV; a node outside the
  target task's cpuset fails it with EACCES.
- per-page status: -ENOENT (not present: never touched or swapped), -EFAULT (zero page / no VMA),
  -EACCES (mapped by several processes; needs MPOL_MF_MOVE_ALL and CAP_SYS_NICE), -EBUSY (could not be
  isolated: busy, or a tail page of a transparent huge page already queued in the same call).
  Pinned pages (io_uring fixed buffers, RDMA, ...) fail inside migration with -EAGAIN and are
  reported only through the positive return value.
- ``get_mempolicy`` rejects ``maxnode`` < nr_node_ids with EINVAL; ``mbind``/``set_mempolicy`` read
  ``maxnode - 1`` bits (the historic off-by-one), so we pass the mask's bit count + 1 to them.
"""
from __future__ import annotations

import ctypes
import dataclasses
import enum
import errno as _errno
import os
import platform
import threading
from typing import Iterable

import numpy as np

from tieringd.kernel import procfs, sysfs
# The page and huge-page sizes are _procfs's; re-exported because callers size moves with them.
from tieringd.kernel.procfs import HPAGE_PMD_NR, HPAGE_PMD_SIZE, KPF_THP, PAGE_SHIFT, PAGE_SIZE  # noqa: F401

# --------------------------------------------------------------------------------------------------
# Constants (include/uapi/linux/mempolicy.h)
# --------------------------------------------------------------------------------------------------

MPOL_DEFAULT = 0
MPOL_PREFERRED = 1
MPOL_BIND = 2
MPOL_INTERLEAVE = 3
MPOL_LOCAL = 4
MPOL_PREFERRED_MANY = 5        # 5.15
MPOL_WEIGHTED_INTERLEAVE = 6   # 6.9

MPOL_MODE_NAMES = {MPOL_DEFAULT: "default", MPOL_PREFERRED: "preferred", MPOL_BIND: "bind",
                   MPOL_INTERLEAVE: "interleave", MPOL_LOCAL: "local",
                   MPOL_PREFERRED_MANY: "preferred-many", MPOL_WEIGHTED_INTERLEAVE: "weighted-interleave"}

# Mode flags, OR'ed into the mode of set_mempolicy/mbind.
MPOL_F_NUMA_BALANCING = 1 << 13  # 5.19
MPOL_F_RELATIVE_NODES = 1 << 14
MPOL_F_STATIC_NODES = 1 << 15
MPOL_MODE_FLAGS = MPOL_F_STATIC_NODES | MPOL_F_RELATIVE_NODES | MPOL_F_NUMA_BALANCING

# get_mempolicy flags.
MPOL_F_NODE = 1 << 0
MPOL_F_ADDR = 1 << 1
MPOL_F_MEMS_ALLOWED = 1 << 2

# mbind / move_pages flags.
MPOL_MF_STRICT = 1 << 0
MPOL_MF_MOVE = 1 << 1
MPOL_MF_MOVE_ALL = 1 << 2

# A status value no kernel writes: marks move_pages entries the kernel left untouched.
STATUS_UNREPORTED = -(1 << 30)

# --------------------------------------------------------------------------------------------------
# System call numbers: x86_64 has its own table; arm64 and riscv64 use asm-generic/unistd.h.
# --------------------------------------------------------------------------------------------------

_SYSCALLS = {
    "x86_64": {"mbind": 237, "set_mempolicy": 238, "get_mempolicy": 239, "migrate_pages": 256,
               "move_pages": 279, "set_mempolicy_home_node": 450},
    "generic": {"mbind": 235, "get_mempolicy": 236, "set_mempolicy": 237, "migrate_pages": 238,
                "move_pages": 239, "set_mempolicy_home_node": 450},
}
_ARCH = platform.machine()
SYSCALL_NR = _SYSCALLS["x86_64" if _ARCH == "x86_64" else "generic"]
if _ARCH not in ("x86_64", "aarch64", "arm64", "riscv64"):  # pragma: no cover - not our machines
    SYSCALL_NR = {}

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------

class NumaError(OSError):
    """A NUMA system call failed as a whole. ``errno`` is set; ``call`` names the system call."""

    def __init__(self, err: int, message: str, call: str = ""):
        super().__init__(err, message)
        self.call = call

    def __str__(self) -> str:
        return self.strerror or super().__str__()


class ProcessGoneError(NumaError, ProcessLookupError):
    """ESRCH: the process does not exist (or exited during the call)."""


class NumaPermissionError(NumaError, PermissionError):
    """EPERM: moving another user's process needs CAP_SYS_PTRACE (a PTRACE_MODE_READ_REALCREDS check since
    Linux 4.13); MPOL_MF_MOVE_ALL needs CAP_SYS_NICE."""


class NodeUnavailableError(NumaError):
    """ENODEV: a node that does not exist or has no memory."""


class NodeNotAllowedError(NumaError):
    """EACCES (move_pages): the node is outside the target process's cpuset (``mems_allowed``)."""


class TargetFullError(NumaError):
    """ENOMEM: the target node has no free memory left (pages moved before that stay moved)."""


class BadAddressError(NumaError):
    """EFAULT: a range that is not mapped (mbind) or an argument array the kernel cannot read."""


class InvalidArgumentError(NumaError):
    """EINVAL: a bad mode, flag, alignment or nodemask — or the process has no mm (a zombie)."""


class NotSupportedError(NumaError):
    """ENOSYS: the kernel has no such call (CONFIG_NUMA=n, or a call newer than the kernel)."""


_ERRNO_CLASS = {
    _errno.ESRCH: ProcessGoneError, _errno.EPERM: NumaPermissionError, _errno.ENODEV: NodeUnavailableError,
    _errno.EACCES: NodeNotAllowedError, _errno.ENOMEM: TargetFullError, _errno.EFAULT: BadAddressError,
    _errno.EINVAL: InvalidArgumentError, _errno.ENOSYS: NotSupportedError,
}

_HINTS = {
    _errno.ESRCH: "no such process",
    _errno.EPERM: "operation not permitted (moving another user's pages needs CAP_SYS_PTRACE; "
                  "MPOL_MF_MOVE_ALL needs CAP_SYS_NICE)",
    _errno.ENODEV: "node does not exist or has no memory",
    _errno.EACCES: "node is not allowed by the process's cpuset",
    _errno.ENOMEM: "target node is full",
    _errno.EFAULT: "bad address",
    _errno.EINVAL: "invalid argument",
    _errno.ENOSYS: "not supported by this kernel",
    _errno.E2BIG: "too many pages",
}


def _raise(call: str, err: int, what: str, nodes: Iterable[int] = ()) -> None:
    cls = _ERRNO_CLASS.get(err, NumaError)
    hint = _HINTS.get(err, os.strerror(err))
    absent = sorted(set(int(n) for n in nodes) - set(memory_nodes()))
    if err == _errno.EINVAL and absent:
        # mbind/set_mempolicy say EINVAL for a node without memory; name the real cause.
        cls, hint = NodeUnavailableError, f"node {format_nodes(absent)} does not exist or has no memory"
    if err == _errno.ENODEV or cls is NodeUnavailableError:
        hint += f" (nodes with memory: {format_nodes(memory_nodes()) or 'none'})"
    raise cls(err, f"{call}({what}): {hint} [{_errno.errorcode.get(err, err)}]", call)


def _call(name: str, *args) -> int:
    nr = SYSCALL_NR.get(name)
    if nr is None:
        raise NotSupportedError(_errno.ENOSYS, f"{name}: no system call number for {_ARCH}", name)
    ctypes.set_errno(0)
    ret = _syscall(ctypes.c_long(nr), *args)
    if ret < 0:
        return -ctypes.get_errno()
    return ret


# --------------------------------------------------------------------------------------------------
# Nodes and nodemasks
# --------------------------------------------------------------------------------------------------

def _node_list(which: str) -> list[int]:
    return sysfs.parse_list(sysfs.read_text(f"/sys/devices/system/node/{which}", ""))


def possible_nodes() -> list[int]:
    return _node_list("possible") or [0]


def online_nodes() -> list[int]:
    return _node_list("online") or [0]


def memory_nodes() -> list[int]:
    """Nodes with memory (N_MEMORY): the only valid move_pages targets."""
    return _node_list("has_memory") or online_nodes()


def format_nodes(nodes: Iterable[int]) -> str:
    return sysfs.format_list(nodes)


_mask_bits_cache: int | None = None
_mask_lock = threading.Lock()


def nodemask_bits() -> int:
    """Bits in our nodemasks: the highest possible node + 1, rounded up to whole 64-bit words."""
    global _mask_bits_cache
    with _mask_lock:
        if _mask_bits_cache is None:
            highest = max(possible_nodes())
            _mask_bits_cache = max(64, (highest + 1 + 63) // 64 * 64)
        return _mask_bits_cache


def _grow_mask() -> int:
    """EINVAL from get_mempolicy can mean our mask is smaller than the kernel's nr_node_ids (a sysfs
    root pointing at another machine's tree); double it and let the caller retry."""
    global _mask_bits_cache
    with _mask_lock:
        _mask_bits_cache = min((_mask_bits_cache or 64) * 2, 1 << 15)
        return _mask_bits_cache


def make_nodemask(nodes: Iterable[int], bits: int | None = None):
    """A ctypes array of unsigned longs with the bits of ``nodes`` set."""
    bits = bits or nodemask_bits()
    words = (ctypes.c_ulong * (bits // 64))()
    for n in nodes:
        n = int(n)
        if n < 0 or n >= bits:
            raise NodeUnavailableError(_errno.ENODEV, f"node {n} is outside the possible nodes "
                                       f"({format_nodes(possible_nodes())})", "nodemask")
        words[n // 64] |= 1 << (n % 64)
    return words


def parse_nodemask(words) -> list[int]:
    out = []
    for i, w in enumerate(words):
        w = int(w)
        while w:
            low = w & -w
            out.append(i * 64 + low.bit_length() - 1)
            w ^= low
    return out


# --------------------------------------------------------------------------------------------------
# Per-page status
# --------------------------------------------------------------------------------------------------

class PageResult(enum.Enum):
    """What one move_pages status value says about one page."""
    ON_NODE = "on-node"             # status >= 0: the page is on that node
    NOT_PRESENT = "not-present"     # -ENOENT: never touched, swapped out, or a device page
    REFUSED = "refused"             # -EBUSY/-EAGAIN: could not be isolated/migrated now (busy, pinned)
    TARGET_FULL = "target-full"     # -ENOMEM: no memory on the target
    FAULT = "fault"                 # -EFAULT: zero page or not a mapped address
    SHARED = "shared"               # -EACCES: mapped by several processes (needs MPOL_MF_MOVE_ALL)
    NODE_INVALID = "node-invalid"   # -ENODEV / -EINVAL in a status slot (older kernels)
    IO_ERROR = "io-error"           # -EIO / -EHWPOISON
    UNREPORTED = "unreported"       # the kernel stopped before writing this slot
    OTHER = "other"


_STATUS_RESULT = {
    -_errno.ENOENT: PageResult.NOT_PRESENT, -_errno.EBUSY: PageResult.REFUSED,
    -_errno.EAGAIN: PageResult.REFUSED, -_errno.ENOMEM: PageResult.TARGET_FULL,
    -_errno.EFAULT: PageResult.FAULT, -_errno.EACCES: PageResult.SHARED,
    -_errno.ENODEV: PageResult.NODE_INVALID, -_errno.EINVAL: PageResult.NODE_INVALID,
    -_errno.EIO: PageResult.IO_ERROR, -getattr(_errno, "EHWPOISON", 133): PageResult.IO_ERROR,
    STATUS_UNREPORTED: PageResult.UNREPORTED,
}


@dataclasses.dataclass(frozen=True)
class PageStatus:
    """One decoded status value: ``node`` when the page is on a node, else ``errno``."""
    value: int
    result: PageResult
    node: int | None
    errno: int | None

    def __str__(self) -> str:
        if self.node is not None:
            return f"node {self.node}"
        if self.result is PageResult.UNREPORTED:
            return "unreported"
        return f"{self.result.value} ({_errno.errorcode.get(self.errno, self.errno)})"


def decode_status(value: int) -> PageStatus:
    value = int(value)
    if value >= 0:
        return PageStatus(value, PageResult.ON_NODE, value, None)
    result = _STATUS_RESULT.get(value, PageResult.OTHER)
    return PageStatus(value, result, None, None if value == STATUS_UNREPORTED else -value)


def status_counts(status: Iterable[int]) -> dict[str, int]:
    """Counts by "node N" / result name, for reports: {"node 1": 510, "not-present": 2}."""
    out: dict[str, int] = {}
    values, counts = np.unique(np.asarray(list(status) if not isinstance(status, np.ndarray) else status,
                                          dtype=np.int64), return_counts=True)
    for v, c in zip(values.tolist(), counts.tolist()):
        key = f"node {v}" if v >= 0 else decode_status(v).result.value
        out[key] = out.get(key, 0) + int(c)
    return out


# --------------------------------------------------------------------------------------------------
# move_pages
# --------------------------------------------------------------------------------------------------

def _as_addrs(addrs) -> np.ndarray:
    arr = np.ascontiguousarray(addrs, dtype=np.uint64)
    if arr.ndim != 1:
        raise ValueError("addresses must be a flat sequence")
    return arr


def _ptr(arr: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(arr.ctypes.data)


def _raw_move_pages(pid: int, addrs: np.ndarray, nodes: np.ndarray | None, status: np.ndarray,
                    flags: int) -> int:
    """The system call itself: returns the kernel's value (>= 0) or -errno."""
    return _call("move_pages", ctypes.c_long(pid), ctypes.c_ulong(len(addrs)), _ptr(addrs),
                 _ptr(nodes) if nodes is not None else ctypes.c_void_p(None), _ptr(status),
                 ctypes.c_long(flags))


def _describe(pid: int, n: int, nodes=None) -> str:
    s = f"pid={pid}, {n} pages"
    if nodes is not None:
        uniq = sorted(set(np.asarray(nodes).tolist()))
        s += f", to node{'s' if len(uniq) != 1 else ''} {format_nodes(uniq)}"
    return s


def _nodes_array(nodes, n: int) -> np.ndarray:
    if isinstance(nodes, (int, np.integer)):
        return np.full(n, int(nodes), dtype=np.int32)
    arr = np.ascontiguousarray(nodes, dtype=np.int32)
    if arr.shape != (n,):
        raise ValueError(f"{len(arr)} nodes for {n} addresses")
    return arr


def query_pages_array(pid: int, addrs) -> np.ndarray:
    """Where each page is: node id, or -errno (-ENOENT: not present, -EFAULT: no mapping / zero page)."""
    a = _as_addrs(addrs)
    status = np.full(len(a), STATUS_UNREPORTED, dtype=np.int32)
    if len(a) == 0:
        return status
    ret = _raw_move_pages(pid, a, None, status, 0)
    if ret < 0:
        _raise("move_pages", -ret, _describe(pid, len(a)) + ", query")
    return status


def query_pages(pid: int, addrs) -> list[int]:
    """``move_pages(pid, n, addrs, NULL, status, 0)``: list of node ids / negative errnos. pid 0 = us."""
    return query_pages_array(pid, addrs).tolist()


@dataclasses.dataclass
class BatchResult:
    """One ``move_pages`` call as the mover sees it.

    ``not_migrated`` is the kernel's positive return value (pages it tried and failed to move, plus
    those it never got to); ``error`` is an errno for calls that failed as a whole after possibly
    moving some pages (ENOMEM: target full). Status entries the kernel did not write hold
    :data:`STATUS_UNREPORTED`.
    """
    status: np.ndarray
    not_migrated: int = 0
    error: int = 0

    @property
    def complete(self) -> bool:
        return self.error == 0 and self.not_migrated == 0


# Whole-call errors after which some pages may still have moved: reported, never raised.
_PARTIAL_ERRORS = {_errno.ENOMEM, _errno.EBUSY, _errno.EAGAIN}


def move_pages_batch(pid: int, addrs, nodes, flags: int = MPOL_MF_MOVE) -> BatchResult:
    """Move pages; ``nodes`` is one node for all or one per address.

    Raises only for errors that mean nothing could be done (no such process, bad node, permission);
    a full target (ENOMEM) or pages that would not move come back in the result.
    """
    a = _as_addrs(addrs)
    status = np.full(len(a), STATUS_UNREPORTED, dtype=np.int32)
    if len(a) == 0:
        return BatchResult(status)
    n = _nodes_array(nodes, len(a))
    ret = _raw_move_pages(pid, a, n, status, flags)
    if ret >= 0:
        return BatchResult(status, not_migrated=ret)
    if -ret in _PARTIAL_ERRORS:
        return BatchResult(status, error=-ret)
    _raise("move_pages", -ret, _describe(pid, len(a), n))
    raise AssertionError("unreachable")


def move_pages(pid: int, addrs, nodes=None, flags: int = MPOL_MF_MOVE) -> list[int]:
    """``move_pages(2)``. ``nodes=None`` queries; an int moves every page to that node; a sequence gives
    one node per page. Returns the status list (node id, -errno, or :data:`STATUS_UNREPORTED` for
    pages the kernel stopped before). Raises a :class:`NumaError` subclass when the call fails as a
    whole — including :class:`TargetFullError` (the pages moved before the failure stay moved)."""
    if nodes is None:
        return query_pages(pid, addrs)
    a = _as_addrs(addrs)
    r = move_pages_batch(pid, a, nodes, flags)
    if r.error:
        _raise("move_pages", r.error, _describe(pid, len(a), _nodes_array(nodes, len(a))))
    return r.status.tolist()


def page_addresses(start: int, length: int) -> np.ndarray:
    """The page-aligned addresses covering [start, start+length)."""
    first = start & ~(PAGE_SIZE - 1)
    end = (start + length + PAGE_SIZE - 1) & ~(PAGE_SIZE - 1)
    return np.arange(first, end, PAGE_SIZE, dtype=np.uint64)


# --------------------------------------------------------------------------------------------------
# migrate_pages, mbind, get/set_mempolicy, set_mempolicy_home_node
# --------------------------------------------------------------------------------------------------

def migrate_pages(pid: int, old_nodes: Iterable[int], new_nodes: Iterable[int]) -> int:
    """Move all pages of ``pid`` on ``old_nodes`` to ``new_nodes``; returns pages that could not be moved."""
    old, new = list(old_nodes), list(new_nodes)
    bits = nodemask_bits()
    ret = _call("migrate_pages", ctypes.c_long(pid), ctypes.c_ulong(bits + 1),
                make_nodemask(old, bits), make_nodemask(new, bits))
    if ret < 0:
        _raise("migrate_pages", -ret, f"pid={pid}, {format_nodes(old)} -> {format_nodes(new)}", old + new)
    return ret


def mbind(addr: int, length: int, mode: int, nodes: Iterable[int] = (), flags: int = 0) -> None:
    """Set the policy of [addr, addr+length) of this process (addr page-aligned). With MPOL_MF_MOVE
    existing pages are moved too; MPOL_MF_STRICT makes pages that cannot be moved an EIO error."""
    nodes = list(nodes)
    bits = nodemask_bits()
    mask = make_nodemask(nodes, bits) if nodes else None
    ret = _call("mbind", ctypes.c_ulong(addr), ctypes.c_ulong(length), ctypes.c_ulong(mode),
                mask if mask is not None else ctypes.c_void_p(None),
                ctypes.c_ulong(bits + 1 if mask is not None else 0), ctypes.c_uint(flags))
    if ret < 0:
        _raise("mbind", -ret, f"{addr:#x}+{length:#x}, mode={_mode_name(mode)}, nodes={format_nodes(nodes)}",
               nodes)


def set_mempolicy(mode: int, nodes: Iterable[int] = ()) -> None:
    """This thread's policy for new allocations (MPOL_DEFAULT with no nodes resets it)."""
    nodes = list(nodes)
    bits = nodemask_bits()
    mask = make_nodemask(nodes, bits) if nodes else None
    ret = _call("set_mempolicy", ctypes.c_long(mode), mask if mask is not None else ctypes.c_void_p(None),
                ctypes.c_ulong(bits + 1 if mask is not None else 0))
    if ret < 0:
        _raise("set_mempolicy", -ret, f"mode={_mode_name(mode)}, nodes={format_nodes(nodes)}", nodes)


@dataclasses.dataclass(frozen=True)
class MemPolicy:
    mode: int          # MPOL_* without the mode flags
    mode_flags: int    # MPOL_F_STATIC_NODES | MPOL_F_RELATIVE_NODES | MPOL_F_NUMA_BALANCING
    nodes: tuple[int, ...]

    @property
    def mode_name(self) -> str:
        return _mode_name(self.mode)


def _mode_name(mode: int) -> str:
    name = MPOL_MODE_NAMES.get(mode & ~MPOL_MODE_FLAGS, str(mode & ~MPOL_MODE_FLAGS))
    for flag, fname in ((MPOL_F_STATIC_NODES, "static"), (MPOL_F_RELATIVE_NODES, "relative"),
                        (MPOL_F_NUMA_BALANCING, "numa-balancing")):
        if mode & flag:
            name += f"|{fname}"
    return name


def _get_mempolicy(addr: int | None, flags: int) -> tuple[int, list[int]]:
    for _ in range(4):
        bits = nodemask_bits()
        mode = ctypes.c_int(0)
        mask = (ctypes.c_ulong * (bits // 64))()
        ret = _call("get_mempolicy", ctypes.byref(mode), mask, ctypes.c_ulong(bits + 1),
                    ctypes.c_ulong(addr or 0), ctypes.c_ulong(flags))
        if ret == -_errno.EINVAL and bits < (1 << 15) and not (flags & MPOL_F_NODE and addr):
            _grow_mask()
            continue
        if ret < 0:
            where = f"addr={addr:#x}, " if addr else ""
            _raise("get_mempolicy", -ret, f"{where}flags={flags:#x}")
        return mode.value, parse_nodemask(mask)
    raise InvalidArgumentError(_errno.EINVAL, "get_mempolicy: the kernel rejected every nodemask size",
                               "get_mempolicy")


def get_mempolicy(addr: int | None = None) -> MemPolicy:
    """This thread's policy, or with ``addr`` the policy that governs that address of this process."""
    mode, nodes = _get_mempolicy(addr, MPOL_F_ADDR if addr is not None else 0)
    return MemPolicy(mode & ~MPOL_MODE_FLAGS, mode & MPOL_MODE_FLAGS, tuple(nodes))


def node_of_address(addr: int) -> int:
    """The node holding the page at ``addr`` of this process (faulting it in if needed)."""
    mode, _ = _get_mempolicy(addr, MPOL_F_NODE | MPOL_F_ADDR)
    return mode


def mems_allowed() -> list[int]:
    """Nodes this thread may allocate from (its cpuset)."""
    return _get_mempolicy(None, MPOL_F_MEMS_ALLOWED)[1]


_home_node_supported: bool | None = None


def has_set_mempolicy_home_node() -> bool:
    """Probed once with an invalid flag: EINVAL means the call exists, ENOSYS that it does not."""
    global _home_node_supported
    if _home_node_supported is None:
        try:
            ret = _call("set_mempolicy_home_node", ctypes.c_ulong(0), ctypes.c_ulong(0),
                        ctypes.c_ulong(0), ctypes.c_ulong(1 << 31))
        except NotSupportedError:
            ret = -_errno.ENOSYS
        _home_node_supported = ret != -_errno.ENOSYS
    return _home_node_supported


def set_mempolicy_home_node(addr: int, length: int, home_node: int, flags: int = 0) -> None:
    """Prefer ``home_node`` within an MPOL_BIND / MPOL_PREFERRED_MANY range (Linux 5.17+, c6018b4b2549)."""
    ret = _call("set_mempolicy_home_node", ctypes.c_ulong(addr), ctypes.c_ulong(length),
                ctypes.c_ulong(home_node), ctypes.c_ulong(flags))
    if ret < 0:
        _raise("set_mempolicy_home_node", -ret, f"{addr:#x}+{length:#x}, home node {home_node}",
               [home_node])


# --------------------------------------------------------------------------------------------------
# Transparent huge pages (pagemap + kpageflags; PFNs are visible only with CAP_SYS_ADMIN)
# --------------------------------------------------------------------------------------------------

def thp_mask(pid: int, start: int, npages: int) -> np.ndarray | None:
    """For each page of [start, start + npages pages): is it part of a transparent huge page?

    None when this cannot be known (no PFNs without CAP_SYS_ADMIN, no /proc/kpageflags). A THP shows in
    pagemap as 512 present, physically contiguous, 512-aligned PFNs; each candidate's head is then
    confirmed with KPF_THP in /proc/kpageflags — one flag word per huge page, not per base page.
    """
    if npages <= 0:
        return np.zeros(0, dtype=bool)
    lo = start & ~(HPAGE_PMD_SIZE - 1)
    hi = (start + npages * PAGE_SIZE + HPAGE_PMD_SIZE - 1) & ~(HPAGE_PMD_SIZE - 1)
    try:
        pm = procfs.read_pagemap(pid, lo, (hi - lo) // PAGE_SIZE)
    except sysfs.SysfsError:
        return None
    present = procfs.present(pm)
    pfn = procfs.pfns(pm).astype(np.int64)
    if present.any() and not pfn[present].any():
        return None  # PFNs hidden: not CAP_SYS_ADMIN
    blocks = len(pm) // HPAGE_PMD_NR
    pfn_b = pfn.reshape(blocks, HPAGE_PMD_NR)
    present_b = present.reshape(blocks, HPAGE_PMD_NR)
    contiguous = (present_b.all(axis=1)
                  & (pfn_b[:, 0] % HPAGE_PMD_NR == 0)
                  & (pfn_b == pfn_b[:, :1] + np.arange(HPAGE_PMD_NR)).all(axis=1))
    mask_b = np.zeros(blocks, dtype=bool)
    heads = np.flatnonzero(contiguous)
    try:
        flags = procfs.read_kpageflags(pfn_b[heads, 0].astype(np.uint64))
    except sysfs.SysfsError:
        return None
    mask_b[heads] = (flags & np.uint64(KPF_THP)) != 0
    first = (start - lo) // PAGE_SIZE
    return np.repeat(mask_b, HPAGE_PMD_NR)[first:first + npages]
