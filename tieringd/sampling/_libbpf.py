# SPDX-License-Identifier: Apache-2.0
"""A ctypes binding of the few libbpf calls the samplers need, on the system's ``libbpf.so``.

Why ctypes on the shared library rather than an extension linked against ``libbpf.a``:

- nothing to compile at install time and no CPython ABI to match: the package stays pure Python and
  the distribution's libbpf (security fixes, the kernel features it knows) is the one used;
- the surface is small and old: every function bound here exists since libbpf 0.5 (Ubuntu 22.04) or
  earlier (the symbol version is noted next to each), and options structs are always passed as NULL,
  so no opts layout is copied into Python (their layouts grow between releases; ``sz`` guards them in
  C, but a Python copy would have to track every release);
- the price is that errors cross the boundary as errno values, handled in one place (``_check*``).

libbpf 0.x returns error-encoded pointers unless strict mode is on; ``libbpf_get_error()`` (0.0.1)
decodes both conventions, so it is used for every pointer result.

The object life cycle follows libbpf-tools: open → set rodata / map sizes / shared maps → load →
attach each program → poll → destroy, each its own step, cleanup on every path.
"""
from __future__ import annotations

import collections
import ctypes
import ctypes.util
import errno
import logging
import os
import threading
from typing import Callable, Iterator

log = logging.getLogger(__name__)

# uapi/linux/btf.h
BTF_KIND_VAR = 14
BTF_KIND_DATASEC = 15

# uapi/linux/bpf.h map flags for update
BPF_ANY = 0
BPF_NOEXIST = 1
BPF_EXIST = 2

LIBBPF_ERRNO_BASE = 4000   # libbpf's own error codes (LIBBPF_ERRNO__*) start here


class BpfError(OSError):
    """A libbpf call failed. ``errno`` is set; ``log`` holds libbpf's last messages (verifier log)."""

    def __init__(self, err: int, message: str, log_lines: list[str] | None = None):
        super().__init__(err, message)
        self.log = log_lines or []

    def __str__(self) -> str:
        text = f"{self.strerror} ({errno.errorcode.get(self.errno, self.errno)})"
        if self.log:
            text += "\n  libbpf: " + "\n  libbpf: ".join(self.log[-12:])
        return text


class LibbpfMissing(BpfError):
    pass


# ---------------------------------------------------------------------------------------------
# the library and libbpf's log

_PRINT_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_SAMPLE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)

_lib = None
_lib_path = None
_lib_lock = threading.Lock()
_libc = ctypes.CDLL(None, use_errno=True)
_log_lines: collections.deque[tuple[int, str]] = collections.deque(maxlen=400)   # (seq, line)
_log_seq = 0
ENOTSUPP = 524   # kernel-internal "operation not supported" that leaks out of bpf(2)


def _on_libbpf_print(level: int, fmt: bytes, va_list: int) -> int:
    if level >= 2:          # LIBBPF_DEBUG: hundreds of lines per load, never needed for a diagnosis
        return 0
    # va_list is an array type on x86-64 (and passed by reference on aarch64): the pointer ctypes
    # hands us is what vsnprintf() wants.
    buf = ctypes.create_string_buffer(2048)
    _libc.vsnprintf(buf, len(buf), fmt, ctypes.c_void_p(va_list))
    global _log_seq
    for line in buf.value.decode(errors="replace").rstrip("\n").splitlines():
        _log_seq += 1
        _log_lines.append((_log_seq, line))
        if level == 0:
            log.debug("libbpf: %s", line)   # warnings surface through BpfError.log when they matter
    return 0


_print_cb = _PRINT_FN(_on_libbpf_print)   # module-level: must outlive every libbpf call


def _signatures(lib) -> None:
    vp, i, u32, sz, cp = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_size_t, ctypes.c_char_p
    sigs = {
        # name: (restype, argtypes)                                          symbol version
        "libbpf_set_print": (vp, [_PRINT_FN]),                                # 0.0.1
        "libbpf_get_error": (ctypes.c_long, [vp]),                            # 0.0.1
        "libbpf_num_possible_cpus": (i, []),                                  # 0.0.5
        "bpf_object__open_file": (vp, [cp, vp]),                              # 0.0.6
        "bpf_object__load": (i, [vp]),                                        # 0.0.1
        "bpf_object__close": (None, [vp]),                                    # 0.0.1
        "bpf_object__btf": (vp, [vp]),                                        # 0.0.2
        "bpf_object__find_map_by_name": (vp, [vp, cp]),                       # 0.0.1
        "bpf_object__find_program_by_name": (vp, [vp, cp]),                   # 0.0.7
        "bpf_map__name": (cp, [vp]),                                          # 0.0.1
        "bpf_map__fd": (i, [vp]),                                             # 0.0.1
        "bpf_map__key_size": (u32, [vp]),                                     # 0.1.0
        "bpf_map__value_size": (u32, [vp]),                                   # 0.1.0
        "bpf_map__type": (i, [vp]),                                           # 0.1.0
        "bpf_map__set_max_entries": (i, [vp, u32]),                           # 0.1.0
        "bpf_map__reuse_fd": (i, [vp, i]),                                    # 0.0.1
        "bpf_map__initial_value": (vp, [vp, ctypes.POINTER(sz)]),             # 0.5.0
        "bpf_program__set_autoload": (i, [vp, ctypes.c_bool]),                # 0.1.0
        "bpf_program__name": (cp, [vp]),                                      # 0.0.7
        "bpf_program__attach": (vp, [vp]),                                    # 0.0.7
        "bpf_program__attach_perf_event": (vp, [vp, i]),                      # 0.0.4
        "bpf_program__attach_uprobe": (vp, [vp, ctypes.c_bool, i, cp, sz]),   # 0.0.4
        "bpf_link__destroy": (i, [vp]),                                       # 0.0.4
        "bpf_map_update_elem": (i, [i, vp, vp, ctypes.c_uint64]),             # 0.0.1
        "bpf_map_lookup_elem": (i, [i, vp, vp]),                              # 0.0.1
        "bpf_map_delete_elem": (i, [i, vp]),                                  # 0.0.1
        "bpf_map_get_next_key": (i, [i, vp, vp]),                             # 0.0.1
        "bpf_map_lookup_and_delete_batch": (i, [i, vp, vp, vp, vp, ctypes.POINTER(u32), vp]),  # 0.0.7
        "btf__find_by_name_kind": (ctypes.c_int32, [vp, cp, u32]),            # 0.0.6
        "btf__type_by_id": (vp, [vp, u32]),                                   # 0.0.1
        "btf__name_by_offset": (cp, [vp, u32]),                               # 0.0.1
        "ring_buffer__new": (vp, [i, _SAMPLE_FN, vp, vp]),                    # 0.0.9
        "ring_buffer__poll": (i, [vp, i]),                                    # 0.0.9
        "ring_buffer__consume": (i, [vp]),                                    # 0.0.9
        "ring_buffer__epoll_fd": (i, [vp]),                                   # 0.3.0
        "ring_buffer__free": (None, [vp]),                                    # 0.0.9
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    # Map iteration changed name in 0.6 (bpf_object__next_map); 1.0 dropped the old bpf_map__next.
    if hasattr(lib, "bpf_object__next_map"):
        lib.bpf_object__next_map.restype, lib.bpf_object__next_map.argtypes = vp, [vp, vp]
    else:
        lib.bpf_map__next.restype, lib.bpf_map__next.argtypes = vp, [vp, vp]


def libbpf():
    """The loaded library (raises :class:`LibbpfMissing` with the names tried)."""
    global _lib, _lib_path
    with _lib_lock:
        if _lib is not None:
            return _lib
        names = [os.environ.get("TIERINGD_LIBBPF"), "libbpf.so.1", "libbpf.so.0",
                 ctypes.util.find_library("bpf")]
        tried = []
        for name in filter(None, names):
            tried.append(name)
            try:
                lib = ctypes.CDLL(name, use_errno=True)
                _signatures(lib)
            except (OSError, AttributeError) as e:
                log.debug("libbpf candidate %s: %s", name, e)
                continue
            lib.libbpf_set_print(_print_cb)
            _lib, _lib_path = lib, name
            return lib
        raise LibbpfMissing(errno.ENOENT, "libbpf is not installed (tried " + ", ".join(tried)
                            + "); Debian/Ubuntu: apt-get install libbpf1 (or libbpf0)")


def library_info() -> dict:
    """Which libbpf is in use (for ``tieringctl doctor``)."""
    lib = libbpf()
    info = {"library": _lib_path}
    if hasattr(lib, "libbpf_major_version"):          # 0.6.0
        lib.libbpf_major_version.restype = ctypes.c_uint32
        lib.libbpf_minor_version.restype = ctypes.c_uint32
        info["version"] = f"{lib.libbpf_major_version()}.{lib.libbpf_minor_version()}"
    return info


def _mark() -> int:
    return _log_seq


def _log_since(mark: int) -> list[str]:
    return [line for seq, line in list(_log_lines) if seq > mark]


def _err_text(err: int) -> str:
    if err >= LIBBPF_ERRNO_BASE:
        return f"libbpf error {err}"
    return os.strerror(err)


def _check_ptr(ptr, what: str, mark: int | None = None):
    lib = libbpf()
    if ptr:
        err = -lib.libbpf_get_error(ptr)
        if err == 0:
            return ptr
    else:
        err = ctypes.get_errno() or errno.EINVAL
    raise BpfError(err, f"{what}: {_err_text(err)}", _log_since(mark) if mark is not None else None)


def _check_rc(rc: int, what: str, mark: int | None = None) -> int:
    if rc >= 0:
        return rc
    err = -rc if rc != -1 else (ctypes.get_errno() or errno.EINVAL)
    raise BpfError(err, f"{what}: {_err_text(err)}", _log_since(mark) if mark is not None else None)


# ---------------------------------------------------------------------------------------------
# objects, maps, programs, links

class BtfType(ctypes.Structure):
    _fields_ = [("name_off", ctypes.c_uint32), ("info", ctypes.c_uint32), ("size", ctypes.c_uint32)]


class BtfVarSecinfo(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint32), ("offset", ctypes.c_uint32), ("size", ctypes.c_uint32)]


class BpfMap:
    def __init__(self, obj: "BpfObject", ptr: int):
        self._obj = obj
        self._ptr = ptr
        self.name = libbpf().bpf_map__name(ptr).decode()

    # -- before load
    @property
    def key_size(self) -> int:
        return libbpf().bpf_map__key_size(self._ptr)

    @property
    def value_size(self) -> int:
        return libbpf().bpf_map__value_size(self._ptr)

    @property
    def type(self) -> int:
        return libbpf().bpf_map__type(self._ptr)

    def set_max_entries(self, n: int) -> None:
        _check_rc(libbpf().bpf_map__set_max_entries(self._ptr, n), f"map {self.name}: max_entries={n}")

    def reuse_fd(self, fd: int) -> None:
        """Use an existing kernel map (shared between objects) instead of creating one at load."""
        _check_rc(libbpf().bpf_map__reuse_fd(self._ptr, fd), f"map {self.name}: reuse fd {fd}")

    def check_sizes(self, key_type=None, value_type=None) -> None:
        """The Python mirror of a struct must have the size the object's BTF gives the map."""
        for what, t, size in (("key", key_type, self.key_size), ("value", value_type, self.value_size)):
            if t is None:
                continue
            mine = t.itemsize if hasattr(t, "itemsize") else ctypes.sizeof(t)
            if mine != size:
                raise BpfError(errno.EPROTO, f"map {self.name}: {what} is {size} bytes in the BPF "
                               f"object but {mine} in {getattr(t, '__name__', t)} — .h and .py disagree")

    # -- after load
    @property
    def fd(self) -> int:
        fd = libbpf().bpf_map__fd(self._ptr)
        if fd < 0:
            raise BpfError(errno.EBADF, f"map {self.name} has no fd (object not loaded)")
        return fd

    def update(self, key, value, flags: int = BPF_ANY) -> None:
        map_update(self.fd, key, value, flags, self.name)

    def lookup(self, key, value_type):
        return map_lookup(self.fd, key, value_type, self.name)

    def delete(self, key) -> bool:
        return map_delete(self.fd, key, self.name)

    def keys(self, key_type) -> Iterator:
        lib = libbpf()
        prev, cur = None, key_type()
        while True:
            rc = lib.bpf_map_get_next_key(self.fd, ctypes.byref(prev) if prev is not None else None,
                                          ctypes.byref(cur))
            if rc < 0:
                return
            yield cur
            prev, cur = cur, key_type()

    def drain(self, key_size: int, value_size: int, chunk: int = 4096) -> tuple[bytes, bytes, int]:
        """Reads and deletes every entry: (keys, values, n) as packed bytes. Uses the batch call
        (kernel 5.6+); older kernels fall back to get_next_key + lookup + delete."""
        lib = libbpf()
        keys_out, vals_out, total = [], [], 0
        kbuf = (ctypes.c_char * (key_size * chunk))()
        vbuf = (ctypes.c_char * (value_size * chunk))()
        in_b = (ctypes.c_char * max(key_size, 8))()
        out_b = (ctypes.c_char * max(key_size, 8))()
        first = True
        while True:
            count = ctypes.c_uint32(chunk)
            rc = lib.bpf_map_lookup_and_delete_batch(self.fd, None if first else in_b, out_b, kbuf,
                                                     vbuf, ctypes.byref(count), None)
            err = 0 if rc >= 0 else (-rc if rc != -1 else ctypes.get_errno())
            if rc < 0 and err not in (errno.ENOENT,):
                if first and err in (errno.EINVAL, errno.EOPNOTSUPP, ENOTSUPP):
                    return self._drain_slow(key_size, value_size)
                _check_rc(rc, f"map {self.name}: lookup_and_delete_batch")
            n = count.value
            if n:
                keys_out.append(bytes(kbuf[:key_size * n]))
                vals_out.append(bytes(vbuf[:value_size * n]))
                total += n
            if err == errno.ENOENT:
                break
            ctypes.memmove(in_b, out_b, len(in_b))
            first = False
        return b"".join(keys_out), b"".join(vals_out), total

    def _drain_slow(self, key_size: int, value_size: int) -> tuple[bytes, bytes, int]:
        lib = libbpf()
        key_t = ctypes.c_char * key_size
        val = (ctypes.c_char * value_size)()
        keys = list(self.keys(key_t))
        ks, vs = [], []
        for k in keys:
            if lib.bpf_map_lookup_elem(self.fd, ctypes.byref(k), ctypes.byref(val)) == 0:
                lib.bpf_map_delete_elem(self.fd, ctypes.byref(k))
                ks.append(bytes(k))
                vs.append(bytes(val))
        return b"".join(ks), b"".join(vs), len(ks)


class Rodata:
    """The object's ``const volatile`` settings, by name, set between open and load."""

    def __init__(self, obj: "BpfObject"):
        lib = libbpf()
        self._map = next((m for m in obj.maps.values() if m.name.endswith(".rodata")), None)
        self.vars: dict[str, tuple[int, int]] = {}
        if self._map is None:
            return
        btf = lib.bpf_object__btf(obj._ptr)
        sec_id = lib.btf__find_by_name_kind(btf, b".rodata", BTF_KIND_DATASEC) if btf else -1
        if sec_id < 0:
            return
        t = BtfType.from_address(lib.btf__type_by_id(btf, sec_id))
        vlen = t.info & 0xFFFF
        base = lib.btf__type_by_id(btf, sec_id) + ctypes.sizeof(BtfType)
        for i in range(vlen):
            si = BtfVarSecinfo.from_address(base + i * ctypes.sizeof(BtfVarSecinfo))
            vt = BtfType.from_address(lib.btf__type_by_id(btf, si.type))
            if (vt.info >> 24) & 0x1F != BTF_KIND_VAR:
                continue
            name = lib.btf__name_by_offset(btf, vt.name_off).decode()
            self.vars[name] = (si.offset, si.size)

    def __setitem__(self, name: str, value) -> None:
        if name not in self.vars:
            raise KeyError(f"no const volatile {name!r} in the object (has: {', '.join(self.vars)})")
        off, size = self.vars[name]
        data = bytes(value) if isinstance(value, ctypes.Structure) else \
            int(value).to_bytes(size, "little", signed=int(value) < 0)
        if len(data) != size:
            raise ValueError(f"{name} is {size} bytes, got {len(data)}")
        psize = ctypes.c_size_t()
        ptr = libbpf().bpf_map__initial_value(self._map._ptr, ctypes.byref(psize))
        if not ptr or off + size > psize.value:
            raise BpfError(errno.EINVAL, f"cannot set {name}: rodata image unavailable")
        ctypes.memmove(ptr + off, data, size)

    def __getitem__(self, name: str) -> int:
        off, size = self.vars[name]
        psize = ctypes.c_size_t()
        ptr = libbpf().bpf_map__initial_value(self._map._ptr, ctypes.byref(psize))
        return int.from_bytes(ctypes.string_at(ptr + off, size), "little")


class Link:
    def __init__(self, ptr: int, what: str):
        self._ptr = ptr
        self.what = what

    def destroy(self) -> None:
        if self._ptr:
            libbpf().bpf_link__destroy(self._ptr)
            self._ptr = None

    def __repr__(self) -> str:
        return f"<Link {self.what}{'' if self._ptr else ' (destroyed)'}>"


class BpfProgram:
    def __init__(self, obj: "BpfObject", ptr: int, name: str):
        self._obj = obj
        self._ptr = ptr
        self.name = name

    def set_autoload(self, on: bool) -> None:
        _check_rc(libbpf().bpf_program__set_autoload(self._ptr, on), f"program {self.name}: autoload")

    def attach(self) -> Link:
        """Attach by the program's section (tracepoints)."""
        m = _mark()
        ptr = libbpf().bpf_program__attach(self._ptr)
        return Link(_check_ptr(ptr, f"attach {self.name}", m), self.name)

    def attach_perf_event(self, pfd: int) -> Link:
        """Attach to an open perf event; on success libbpf owns ``pfd`` (closed on destroy)."""
        m = _mark()
        ptr = libbpf().bpf_program__attach_perf_event(self._ptr, pfd)
        return Link(_check_ptr(ptr, f"attach {self.name} to perf event", m), f"{self.name}@perf{pfd}")

    def attach_uprobe(self, binary: str, offset: int, pid: int = -1, retprobe: bool = False) -> Link:
        """Attach at a file offset (computed by the caller from the ELF symbol table, so that
        libbpf < 0.8, which cannot resolve symbol names, works too)."""
        m = _mark()
        ptr = libbpf().bpf_program__attach_uprobe(self._ptr, retprobe, pid, os.fsencode(binary), offset)
        return Link(_check_ptr(ptr, f"attach {self.name} to {binary}+{offset:#x}", m),
                    f"{self.name}@{os.path.basename(binary)}+{offset:#x}")


class BpfObject:
    """One ``.bpf.o``: open in the constructor, then configure, ``load()``, attach, ``close()``."""

    def __init__(self, path: str | os.PathLike):
        lib = libbpf()
        self.path = os.fspath(path)
        if not os.path.exists(self.path):
            raise BpfError(errno.ENOENT, f"{self.path} does not exist (build it: make)")
        m = _mark()
        self._ptr = _check_ptr(lib.bpf_object__open_file(os.fsencode(self.path), None),
                               f"open {self.path}", m)
        self.loaded = False
        self.maps: dict[str, BpfMap] = {}
        prev = None
        while True:
            if hasattr(lib, "bpf_object__next_map"):
                ptr = lib.bpf_object__next_map(self._ptr, prev)
            else:
                ptr = lib.bpf_map__next(prev, self._ptr)
            if not ptr:
                break
            bm = BpfMap(self, ptr)
            self.maps[bm.name] = bm
            prev = ptr
        self.rodata = Rodata(self)

    def map(self, name: str) -> BpfMap:
        try:
            return self.maps[name]
        except KeyError:
            raise KeyError(f"{os.path.basename(self.path)} has no map {name!r}") from None

    def program(self, name: str) -> BpfProgram:
        ptr = libbpf().bpf_object__find_program_by_name(self._ptr, name.encode())
        if not ptr:
            raise KeyError(f"{os.path.basename(self.path)} has no program {name!r}")
        return BpfProgram(self, ptr, name)

    def load(self) -> None:
        m = _mark()
        _check_rc(libbpf().bpf_object__load(self._ptr), f"load {os.path.basename(self.path)}", m)
        self.loaded = True

    def close(self) -> None:
        if self._ptr:
            libbpf().bpf_object__close(self._ptr)
            self._ptr = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


def _enoent(rc: int) -> bool:
    return rc == -errno.ENOENT or (rc == -1 and ctypes.get_errno() == errno.ENOENT)


def map_update(fd: int, key, value, flags: int = BPF_ANY, name: str = "map") -> None:
    """bpf_map_update_elem on a map fd (maps shared between objects are held by fd)."""
    _check_rc(libbpf().bpf_map_update_elem(fd, ctypes.byref(key), ctypes.byref(value), flags),
              f"{name}: update")


def map_lookup(fd: int, key, value_type, name: str = "map"):
    value = value_type()
    rc = libbpf().bpf_map_lookup_elem(fd, ctypes.byref(key), ctypes.byref(value))
    if _enoent(rc):
        return None
    _check_rc(rc, f"{name}: lookup")
    return value


def map_delete(fd: int, key, name: str = "map") -> bool:
    rc = libbpf().bpf_map_delete_elem(fd, ctypes.byref(key))
    if _enoent(rc):
        return False
    _check_rc(rc, f"{name}: delete")
    return True


def possible_cpus() -> int:
    n = libbpf().libbpf_num_possible_cpus()
    if n <= 0:
        raise BpfError(-n or errno.EINVAL, "cannot count possible CPUs")
    return n


class RingBuffer:
    """libbpf's ring buffer over one ``BPF_MAP_TYPE_RINGBUF`` map.

    ``callback(record)`` receives a copy of each record as ``record_type`` (a ctypes struct). The
    C callback is kept alive by this object; an exception raised by ``callback`` stops the poll and
    is re-raised from :meth:`poll` / :meth:`consume` (ctypes would otherwise print and drop it).
    :meth:`fileno` is the epoll fd for the daemon's own poll loop.
    """

    def __init__(self, rb_map: BpfMap, callback: Callable, record_type):
        self._callback = callback
        self._type = record_type
        self._exc: BaseException | None = None
        self._c_cb = _SAMPLE_FN(self._on_sample)     # kept alive as long as the ring buffer
        m = _mark()
        self._ptr = _check_ptr(libbpf().ring_buffer__new(rb_map.fd, self._c_cb, None, None),
                               f"ring buffer on {rb_map.name}", m)

    def _on_sample(self, _ctx, data, size) -> int:
        try:
            if size < ctypes.sizeof(self._type):
                raise BpfError(errno.EPROTO, f"ring buffer record of {size} bytes, expected "
                               f"{ctypes.sizeof(self._type)}")
            self._callback(self._type.from_buffer_copy(ctypes.string_at(data, ctypes.sizeof(self._type))))
            return 0
        except BaseException as e:  # noqa: BLE001 — re-raised after the C call returns
            self._exc = e
            return -1

    def _after(self, rc: int, what: str) -> int:
        if self._exc is not None:
            exc, self._exc = self._exc, None
            raise exc
        if rc < 0 and -rc != errno.EINTR:
            _check_rc(rc, what)
        return max(rc, 0)

    def poll(self, timeout_ms: int = 0) -> int:
        """Waits up to ``timeout_ms`` and handles what arrived; returns the number of records."""
        return self._after(libbpf().ring_buffer__poll(self._ptr, timeout_ms), "ring_buffer__poll")

    def consume(self) -> int:
        return self._after(libbpf().ring_buffer__consume(self._ptr), "ring_buffer__consume")

    def fileno(self) -> int:
        return libbpf().ring_buffer__epoll_fd(self._ptr)

    def close(self) -> None:
        if self._ptr:
            libbpf().ring_buffer__free(self._ptr)
            self._ptr = None
