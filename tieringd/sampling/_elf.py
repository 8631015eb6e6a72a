# SPDX-License-Identifier: Apache-2.0
"""Function symbol → file offset in an ELF64 shared object, for uprobes.

libbpf ≥ 0.8 resolves a symbol name itself (``bpf_program__attach_uprobe_opts`` with ``func_name``);
older ones (Ubuntu 22.04: 0.5) take a file offset only. Resolving here keeps one code path for both and
lets the loader skip a library that does not export the symbol without trying an attach.
"""
from __future__ import annotations

import mmap
import os
import struct

SHT_SYMTAB, SHT_DYNSYM = 2, 11
STT_FUNC, STT_GNU_IFUNC = 2, 10
PT_LOAD = 1


class ElfError(ValueError):
    pass


def function_offsets(path: str | os.PathLike, names: set[str] | None = None) -> dict[str, int]:
    """{symbol: file offset} for defined function symbols (``names`` only, if given), from .dynsym
    and .symtab. Versioned names ("cudaMemcpy@@libcudart.so.12") are reported without the version."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 64:
            raise ElfError(f"{path}: not an ELF file")
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            # cheap pre-filter at C speed: a file that does not contain any of the names as bytes
            # cannot define them (most libraries a process maps)
            if names is not None and not any(m.find(n.encode()) != -1 for n in names):
                return {}
            return _parse(m, os.fspath(path), names)


def _parse(m, path: str, names: set[str] | None) -> dict[str, int]:
    if m[:4] != b"\x7fELF":
        raise ElfError(f"{path}: not an ELF file")
    if m[4] != 2 or m[5] != 1:
        raise ElfError(f"{path}: only 64-bit little-endian ELF is supported")
    e_phoff, e_shoff = struct.unpack_from("<QQ", m, 0x20)
    e_phentsize, e_phnum, e_shentsize, e_shnum = struct.unpack_from("<HHHH", m, 0x36)
    loads = []
    for i in range(e_phnum):
        p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz = struct.unpack_from(
            "<IIQQQQ", m, e_phoff + i * e_phentsize)
        if p_type == PT_LOAD:
            loads.append((p_vaddr, p_filesz, p_offset))
    sections = []
    for i in range(e_shnum):
        sections.append(struct.unpack_from("<IIQQQQII", m, e_shoff + i * e_shentsize))
    out: dict[str, int] = {}
    for sh_name, sh_type, _fl, _addr, sh_offset, sh_size, sh_link, _info in sections:
        if sh_type not in (SHT_DYNSYM, SHT_SYMTAB) or sh_link >= len(sections):
            continue
        str_off = sections[sh_link][4]
        for j in range(sh_size // 24):
            st_name, st_info, _other, st_shndx, st_value, _sz = struct.unpack_from(
                "<IBBHQQ", m, sh_offset + j * 24)
            if st_shndx == 0 or (st_info & 0xF) not in (STT_FUNC, STT_GNU_IFUNC) or not st_value:
                continue
            end = m.find(b"\0", str_off + st_name)
            name = m[str_off + st_name:end].decode(errors="replace").split("@", 1)[0]
            if (names is not None and name not in names) or name in out:
                continue
            for vaddr, filesz, offset in loads:
                if vaddr <= st_value < vaddr + filesz:
                    out[name] = st_value - vaddr + offset
                    break
    return out
