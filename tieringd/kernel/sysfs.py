# SPDX-License-Identifier: Apache-2.0
"""The one module that opens files under /sys and /proc.

Everything else asks this module, so that a tree captured from another machine (or from a lab guest)
can stand in for the live one: set ``TIERINGD_FS_ROOT`` or call :func:`set_root` and every path below
is read under that prefix instead of ``/``. The idea is psutil's ``get_procfs_path`` and damo's
``_damo_fs``.

Paths passed in are always the absolute kernel paths ("/sys/devices/system/node/online"); paths
handed back (``glob``, ``realpath``) are in the same form, with the root prefix removed.
"""
from __future__ import annotations

import contextlib
import fcntl
import glob as _glob
import os
from typing import Iterator

MISSING = object()


def _absolute(root: str) -> str:
    # Absolute and symlink-free, so that realpath() results start with it and can be stripped even
    # when the root was given relative ("tests/fixtures/sysfs/cxl-6.12") or through a symlink.
    return os.path.realpath(root) if root else ""


_root = _absolute(os.environ.get("TIERINGD_FS_ROOT", "").rstrip("/"))


class SysfsError(OSError):
    """A kernel file could not be read or written; ``str()`` names the file and the reason."""


def get_root() -> str:
    """The prefix under which /sys and /proc are read ("" for the live system)."""
    return _root


def set_root(root: str | os.PathLike | None) -> None:
    global _root
    _root = _absolute(os.fspath(root).rstrip("/")) if root else ""


@contextlib.contextmanager
def root(new_root: str | os.PathLike | None) -> Iterator[None]:
    """Read from ``new_root`` for the duration of the ``with`` block."""
    old = _root
    set_root(new_root)
    try:
        yield
    finally:
        set_root(old)


def path(p: str) -> str:
    """The real filesystem path for kernel path ``p``."""
    if not p.startswith("/"):
        raise ValueError(f"kernel paths are absolute: {p!r}")
    return _root + p


def _strip(real: str) -> str:
    return real[len(_root):] if _root and real.startswith(_root) else real


def exists(p: str) -> bool:
    return os.path.exists(path(p))


def is_dir(p: str) -> bool:
    return os.path.isdir(path(p))


def read_text(p: str, default=MISSING) -> str:
    """The file's contents with surrounding whitespace stripped; ``default`` if it cannot be read."""
    try:
        with open(path(p), encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError as e:
        if default is not MISSING:
            return default
        raise SysfsError(e.errno, f"cannot read {p}: {e.strerror}") from None


def read_int(p: str, default=MISSING) -> int:
    text = read_text(p, None)
    if text is None:
        if default is not MISSING:
            return default
        read_text(p)  # raises with the reason
    try:
        return int(text, 0)
    except ValueError:
        if default is not MISSING:
            return default
        raise SysfsError(0, f"{p}: not an integer: {text[:40]!r}") from None


def read_lines(p: str, default=MISSING) -> list[str]:
    text = read_text(p, None)
    if text is None:
        if default is not MISSING:
            return default
        read_text(p)
    return text.splitlines()


def read_keyed(p: str, default=MISSING) -> dict[str, str]:
    """Files of ``key value`` lines (/proc/vmstat) or ``key: value`` lines (/proc/meminfo)."""
    lines = read_lines(p, None)
    if lines is None:
        if default is not MISSING:
            return default
        read_lines(p)
    out = {}
    for line in lines:
        key, _, value = line.replace(":", " ", 1).partition(" ")
        if key:
            out[key] = value.strip()
    return out


def pread(p: str, offset: int, size: int) -> bytes:
    """Binary read at an offset: /proc/PID/pagemap, /proc/kpagecount, /proc/kpageflags."""
    try:
        fd = os.open(path(p), os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise SysfsError(e.errno, f"cannot open {p}: {e.strerror}") from None
    try:
        return os.pread(fd, size, offset)
    except OSError as e:
        raise SysfsError(e.errno, f"cannot read {p} at {offset:#x}: {e.strerror}") from None
    finally:
        os.close(fd)


def pread_runs(p: str, runs: list[tuple[int, int]]) -> list[bytes]:
    """Binary reads of (offset, size) runs of one file, opened once: per-PFN files read at many
    scattered places (/proc/kpagecount), where an open per read would cost more than the read."""
    try:
        fd = os.open(path(p), os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise SysfsError(e.errno, f"cannot open {p}: {e.strerror}") from None
    try:
        return [os.pread(fd, size, offset) for offset, size in runs]
    except OSError as e:
        raise SysfsError(e.errno, f"cannot read {p}: {e.strerror}") from None
    finally:
        os.close(fd)


def ioctl(p: str, request: int, arg: bytearray) -> int:
    """ioctl(2) on ``p`` opened read-only (/proc/PID/pagemap's PAGEMAP_SCAN): ``arg`` is passed by
    address and holds what the kernel wrote back; returns the ioctl's value."""
    try:
        fd = os.open(path(p), os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise SysfsError(e.errno, f"cannot open {p}: {e.strerror}") from None
    try:
        return fcntl.ioctl(fd, request, arg, True)
    except OSError as e:
        raise SysfsError(e.errno, f"ioctl {request:#x} on {p}: {e.strerror}") from None
    finally:
        os.close(fd)


def read_bytes(p: str, default=MISSING) -> bytes:
    """A whole binary file (/proc/config.gz)."""
    try:
        with open(path(p), "rb") as f:
            return f.read()
    except OSError as e:
        if default is not MISSING:
            return default
        raise SysfsError(e.errno, f"cannot read {p}: {e.strerror}") from None


def pwrite(p: str, offset: int, data: bytes) -> None:
    """Binary write at an offset: /sys/kernel/mm/page_idle/bitmap (8-byte words)."""
    try:
        fd = os.open(path(p), os.O_WRONLY | os.O_CLOEXEC)
    except OSError as e:
        raise SysfsError(e.errno, f"cannot open {p} for writing: {e.strerror}") from None
    try:
        os.pwrite(fd, data, offset)
    except OSError as e:
        raise SysfsError(e.errno, f"cannot write {p} at {offset:#x}: {e.strerror}") from None
    finally:
        os.close(fd)


def write_text(p: str, value: str | int) -> None:
    try:
        with open(path(p), "w", encoding="utf-8") as f:
            f.write(str(value))
    except OSError as e:
        raise SysfsError(e.errno, f"cannot write {value!r} to {p}: {e.strerror}") from None


def listdir(p: str, default=MISSING) -> list[str]:
    """Sorted entries of a directory."""
    try:
        return sorted(os.listdir(path(p)))
    except OSError as e:
        if default is not MISSING:
            return default
        raise SysfsError(e.errno, f"cannot list {p}: {e.strerror}") from None


def glob(pattern: str) -> list[str]:
    """Sorted kernel paths matching ``pattern``."""
    return sorted(_strip(m) for m in _glob.glob(path(pattern)))


def readlink(p: str, default=MISSING) -> str:
    """The raw target of a symlink (sysfs links are relative: ``../../bus/dax/drivers/kmem``)."""
    try:
        return os.readlink(path(p))
    except OSError as e:
        if default is not MISSING:
            return default
        raise SysfsError(e.errno, f"cannot read link {p}: {e.strerror}") from None


def realpath(p: str) -> str:
    """The kernel path ``p`` resolves to, symlinks followed inside the root."""
    return _strip(os.path.realpath(path(p)))


def parse_list(text: str) -> list[int]:
    """Kernel list format ("0-3,8,10-11", as in cpulist and nodelist files) → sorted integers."""
    out: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            out.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
        except ValueError:
            raise ValueError(f"not a kernel list: {text!r}") from None
    return sorted(set(out))


def format_list(values) -> str:
    """The inverse of :func:`parse_list`: [0, 1, 2, 5] → "0-2,5"."""
    vals = sorted(set(values))
    parts, i = [], 0
    while i < len(vals):
        j = i
        while j + 1 < len(vals) and vals[j + 1] == vals[j] + 1:
            j += 1
        parts.append(str(vals[i]) if i == j else f"{vals[i]}-{vals[j]}")
        i = j + 1
    return ",".join(parts)
