# SPDX-License-Identifier: Apache-2.0
"""bpf/*.h are the single source of what the BPF programs and their Python loaders share.

Structs are mirrored in ctypes and checked against the maps' BTF at load time (BpfSampler.open);
here they are compared field by field with the headers. Constants (#define) leave no trace in a
.bpf.o — the preprocessor consumes them before BTF is written — so no load-time check can see them:
every #define of each header is compiled with the system's C compiler and compared with the Python
module that copies it, as tests/unit/test_protocol.py does for shim/protocol.h."""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tieringd.sampling import dmacopy, migrations, pagefault
from tieringd.sampling import tracking as tr

# header → the Python module that mirrors its constants
MIRRORS = {"tracking.h": tr, "migrations.h": migrations, "pagefault.h": pagefault, "dmacopy.h": dmacopy}


def header_defines(header: Path) -> list[str]:
    """Names of the object-like macros a header defines (its include guard left out)."""
    return [n for n in re.findall(r"^#define[ \t]+(\w+)[ \t]+\S", header.read_text(), re.M)
            if not n.startswith("__")]


@pytest.fixture(scope="module")
def bpf_dir(repo) -> Path:
    return repo / "bpf"


@pytest.fixture(scope="module")
def compiled_defines(tmp_path_factory, bpf_dir) -> dict[str, dict[str, int]]:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (make setup brings gcc)")
    out = {}
    tmp = tmp_path_factory.mktemp("bpf-headers")
    for header in MIRRORS:
        names = header_defines(bpf_dir / header)
        src = tmp / f"{header}.c"
        src.write_text("#include <stdio.h>\n#include <linux/types.h>\n"
                       f'#include "{header}"\nint main(void) {{\n'
                       + "".join(f'    printf("{n} %lld\\n", (long long)({n}));\n' for n in names)
                       + "    return 0;\n}\n")
        exe = tmp / f"{header}.out"
        subprocess.run([cc, "-std=gnu11", "-I", str(bpf_dir), "-o", str(exe), str(src)], check=True)
        text = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
        out[header] = {name: int(value) for name, value in (ln.split() for ln in text.splitlines())}
    return out


@pytest.mark.parametrize("header", MIRRORS)
def test_every_header_constant_is_mirrored_with_its_value(header, compiled_defines):
    module = MIRRORS[header]
    c = compiled_defines[header]
    assert c, f"no constants found in bpf/{header}"
    py = {name: getattr(module, name, None) for name in c}
    assert py == c, f"bpf/{header} and {module.__name__} disagree"


def test_the_pagefault_and_dmacopy_constants_are_checked(bpf_dir):
    # the two headers whose constants were copied by hand without a check (issue 12)
    assert set(header_defines(bpf_dir / "pagefault.h")) == {"PF_ERR_PROT", "PF_ERR_WRITE", "PF_ERR_USER",
                                                         "PF_ERR_INSTR", "PF_EXTRA_PROT_MASK",
                                                         "PF_EXTRA_WRITE_SHIFT"}
    assert set(header_defines(bpf_dir / "dmacopy.h")) == {"DMA_API_CUDA_MEMCPY", "DMA_API_CU_HTOD",
                                                       "DMA_API_CU_DTOH", "DMA_DIR_READ", "DMA_DIR_WRITE",
                                                       "DMA_MAX_BLOCKS"}


_C_TYPES = {"__u8": 1, "__u16": 2, "__u32": 4, "__u64": 8, "__s32": 4, "__s64": 8}


def c_struct_fields(header: Path, name: str) -> list[tuple[str, int]]:
    """(field, size) of ``struct name`` in a bpf/*.h header (fixed-width types only, by design)."""
    text = header.read_text()
    m = re.search(r"struct\s+" + name + r"\s*\{(.*?)\};", text, re.S)
    assert m, f"struct {name} not in {header.name}"
    body = re.sub(r"/\*.*?\*/", "", m.group(1), flags=re.S)
    fields = []
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        ctype, field = decl.split()
        fields.append((field, _C_TYPES[ctype]))
    return fields


@pytest.mark.parametrize("header,cname,pytype", [
    ("tracking.h", "tracked_pid", tr.TrackedPid),
    ("tracking.h", "range_key", tr.RangeKey),
    ("tracking.h", "range_val", tr.RangeVal),
    ("tracking.h", "block_key", tr.BlockKey),
    ("tracking.h", "block_val", tr.BlockVal),
    ("tracking.h", "control", tr.Control),
    ("tracking.h", "sample_event", tr.SampleEvent),
    ("migrations.h", "migrate_stat", migrations.MigrateStat),
])
def test_python_mirrors_match_the_headers(header, cname, pytype, bpf_dir):
    c = c_struct_fields(bpf_dir / header, cname)
    py = [(n, ctypes.sizeof(t)) for n, t in pytype._fields_]
    assert py == c
    assert ctypes.sizeof(pytype) == sum(s for _, s in c)


def test_stat_names_match_the_header(bpf_dir):
    # (the #define constants are compiled and compared above)
    text = (bpf_dir / "tracking.h").read_text()
    stats = re.search(r"enum tracking_stat \{(.*?)\};", text, re.S).group(1)
    names = [n.lower().removeprefix("stat_") for n in re.findall(r"^\s*(STAT_\w+)", stats, re.M)]
    assert names[:-1] == tr.STAT_NAMES and names[-1] == "_max"
    assert np.dtype(tr.BLOCK_KEY_DTYPE).itemsize == ctypes.sizeof(tr.BlockKey)
