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

REPO = Path(__file__).resolve().parents[2]
BPF = REPO / "bpf"

# header → the Python module that mirrors its constants
MIRRORS = {"tracking.h": tr, "migrations.h": migrations, "pagefault.h": pagefault, "dmacopy.h": dmacopy}


def header_defines(header: Path) -> list[str]:
    """Names of the object-like macros a header defines (its include guard left out)."""
    return [n for n in re.findall(r"^#define[ \t]+(\w+)[ \t]+\S", header.read_text(), re.M)
            if not n.startswith("__")]


@pytest.fixture(scope="module")
def compiled_defines(tmp_path_factory) -> dict[str, dict[str, int]]:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (make install brings gcc)")
    out = {}
    tmp = tmp_path_factory.mktemp("bpf-headers")
    for header in MIRRORS:
        names = header_defines(BPF / header)
        src = tmp / f"{header}.c"
        src.write_text("#include <stdio.h>\n#include <linux/types.h>\n"
                       f'#include "{header}"\nint main(void) {{\n'
                       + "".join(f'    printf("{n} %lld\\n", (long long)({n}));\n' for n in names)
                       + "    return 0;\n}\n")
        exe = tmp / f"{header}.out"
        subprocess.run([cc, "-std=gnu11", "-I", str(BPF), "-o", str(exe), str(src)], check=True)
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


def test_the_pagefault_and_dmacopy_constants_are_checked():
    # the two headers whose constants were copied by hand without a check (issue 12)
    assert set(header_defines(BPF / "pagefault.h")) == {"PF_ERR_PROT", "PF_ERR_WRITE", "PF_ERR_USER",
                                                         "PF_ERR_INSTR"}
    assert set(header_defines(BPF / "dmacopy.h")) == {"DMA_API_CUDA_MEMCPY", "DMA_API_CU_HTOD",
                                                       "DMA_API_CU_DTOH", "DMA_DIR_READ", "DMA_DIR_WRITE",
                                                       "DMA_MAX_BLOCKS"}
