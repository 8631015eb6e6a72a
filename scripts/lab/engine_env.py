#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The real inference engine for the lab: llama.cpp through llama-cpp-python, in a venv of its own.

    engine_env.py            build what is missing, then print the engine's python
    engine_env.py --check    print the engine's python, or why there is none (exit 1); builds nothing

llama-cpp-python is built from its PyPI source for generic x86-64: no AVX, FMA, F16C or BMI2, since
the lab's QEMU/TCG guests emulate what the host CPU has only in part (numpy's AVX2 sort is already
wrong there, docs/lab.md), and the wheel must run on any x86-64 machine that has the cache. ggml's
own thread pool rather than OpenMP (no spinning OpenMP workers under TCG). Building takes 8
CPU-minutes (19 minutes of wall on the shared 2-core build machine), once: the wheel is kept in
``.cache/engine/wheels/`` and the venv in ``.cache/engine/venv/`` (the guests run it over the read-only 9p root, as they run ``.venv``). The
venv holds the engine, its OpenAI-compatible server (the ``server`` extra) and ``gguf``, with which
the project writes its own model (scripts/lab/tiny_gguf.py): nothing is downloaded at run time. The
pins are in scripts/lab/engine-requirements.txt; the project's ``.venv`` is not touched.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENGINE = REPO / ".cache" / "engine"
WHEELS = ENGINE / "wheels"
VENV = ENGINE / "venv"
PYTHON = VENV / "bin" / "python"
REQUIREMENTS = Path(__file__).resolve().parent / "engine-requirements.txt"
CMAKE_ARGS = " ".join(f"-D{k}={v}" for k, v in (
    ("GGML_NATIVE", "OFF"), ("GGML_SSE42", "OFF"), ("GGML_AVX", "OFF"), ("GGML_AVX2", "OFF"),
    ("GGML_BMI2", "OFF"), ("GGML_FMA", "OFF"), ("GGML_F16C", "OFF"), ("GGML_AVX512", "OFF"),
    ("GGML_OPENMP", "OFF"), ("GGML_BACKEND_DL", "OFF"), ("LLAVA_BUILD", "OFF"),
    ("LLAMA_BUILD_TESTS", "OFF"), ("LLAMA_BUILD_EXAMPLES", "OFF"), ("LLAMA_BUILD_TOOLS", "OFF"),
    ("LLAMA_BUILD_SERVER", "OFF")))


def pins() -> dict[str, str]:
    """name → requirement line, from engine-requirements.txt."""
    out = {}
    for line in REQUIREMENTS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            out[line.split("==")[0].split("[")[0]] = line
    return out


def wheel() -> Path | None:
    version = pins()["llama-cpp-python"].split("==")[1]
    found = sorted(WHEELS.glob(f"llama_cpp_python-{version}-*.whl"))
    return found[-1] if found else None


def check() -> tuple[bool, str]:
    if not PYTHON.exists():
        return False, f"no engine venv at {VENV} (run scripts/lab/engine_env.py)"
    p = subprocess.run([str(PYTHON), "-c", "import llama_cpp, gguf, uvicorn; print(llama_cpp.__version__)"],
                       capture_output=True, text=True)
    if p.returncode != 0:
        return False, f"engine venv incomplete: {(p.stderr.strip().splitlines() or ['?'])[-1]}"
    return True, str(PYTHON)


def build() -> None:
    WHEELS.mkdir(parents=True, exist_ok=True)
    req = pins()["llama-cpp-python"]
    if wheel() is None:
        print(f"engine_env: building {req} for generic x86-64 (about 20 minutes on 2 cores)", file=sys.stderr)
        env = dict(os.environ, CMAKE_ARGS=CMAKE_ARGS, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-binary", "llama-cpp-python",
                        "-w", str(WHEELS), req.split("[")[0]], env=env, check=True)
    if not PYTHON.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    others = [line for name, line in pins().items() if name != "llama-cpp-python"]
    extras = req.split("[")[1].split("]")[0] if "[" in req else ""
    target = f"llama-cpp-python[{extras}] @ {wheel().as_uri()}" if extras else str(wheel())
    subprocess.run([str(PYTHON), "-m", "pip", "install", "--quiet", target, *others], check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="build nothing; say whether the engine is there")
    a = ap.parse_args()
    ok, what = check()
    if not ok and not a.check:
        build()
        ok, what = check()
    print(what, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
