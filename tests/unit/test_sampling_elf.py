# SPDX-License-Identifier: Apache-2.0
"""Uprobe offsets from ELF symbol tables (tieringd/sampling/_elf.py), cross-checked with readelf."""
from __future__ import annotations

import subprocess

import pytest

from tieringd.sampling import _elf


def test_elf_offsets_match_readelf(repo):
    lib = repo / "build/tests/libfakecudart.so"
    if not lib.exists():
        pytest.skip("build/tests/libfakecudart.so is not built (make)")
    offs = _elf.function_offsets(lib, {"cudaMemcpyAsync", "cuMemcpyHtoD_v2", "nope"})
    assert set(offs) == {"cudaMemcpyAsync", "cuMemcpyHtoD_v2"}
    # cross-check with binutils: symbol value → file offset through the program headers
    syms = subprocess.run(["readelf", "-W", "--dyn-syms", str(lib)], capture_output=True, text=True,
                          check=True).stdout
    value = {ln.split()[7]: int(ln.split()[1], 16) for ln in syms.splitlines()
             if len(ln.split()) >= 8 and ln.split()[3] == "FUNC"}
    phdrs = subprocess.run(["readelf", "-W", "-l", str(lib)], capture_output=True, text=True,
                           check=True).stdout
    # LOAD  Offset VirtAddr PhysAddr FileSiz MemSiz Flg Align
    loads = [(int(f[1], 16), int(f[2], 16), int(f[4], 16))
             for f in (ln.split() for ln in phdrs.splitlines()) if f[:1] == ["LOAD"]]
    for sym, off in offs.items():
        v = value[sym]
        (poff, vaddr, _filesz), = [(o, va, fs) for o, va, fs in loads if va <= v < va + fs]
        assert off == v - vaddr + poff
    assert _elf.function_offsets(lib, {"definitely_not_there"}) == {}
    with pytest.raises(_elf.ElfError):
        _elf.function_offsets(repo / "README.md")
