# SPDX-License-Identifier: Apache-2.0
"""A real inference engine under the shim and the daemon: llama.cpp's server (llama-cpp-python,
unmodified, built by scripts/lab/engine_env.py) with the project's own tiny model
(scripts/lab/tiny_gguf.py) and a 1.17 GiB KV cache — more than node 0 of the sized lab holds free —
in one guest (cxl, DRAM nodes 1 GiB, 6.12), through the same guest script as figure P5-engine
(scripts/lab/kv_engine.py). Outcomes only:

- the server answers the same requests with the same tokens bare and under ``tieringctl run`` with
  tieringd running (greedy decoding; every token of the model is one ASCII character, so equal
  texts are equal tokens);
- tieringd registered the server's KV buffer: a region of the server's pid at least as large as
  the KV cache the model implies.

The engine is a 20-minute build on 2 cores and not part of ``make test``'s set-up: without it (``make
engine``) these tests skip, also under TIERINGD_REQUIRE_ALL.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from paths import REPO

sys.path.insert(0, str(REPO / "scripts" / "lab"))
import engine_env  # noqa: E402

pytestmark = pytest.mark.lab
LAB_GROUP_S = 600
NODE_MIB = 1024
REQUESTS = 12


@pytest.fixture(scope="module")
def engine(lab, tmp_path_factory):
    ok, why = engine_env.check()
    if not ok:
        pytest.skip(f"{why}; make engine builds it (about 20 minutes on 2 cores)")
    model = tmp_path_factory.mktemp("engine") / "tiny.gguf"
    subprocess.run([str(engine_env.PYTHON), str(REPO / "scripts" / "lab" / "tiny_gguf.py"), str(model)], check=True)
    script = (f".venv/bin/python scripts/lab/kv_engine.py --out $LAB_OUT --model {model} --condition plain "
              f"--condition tieringd --requests {REQUESTS} > $LAB_OUT/kv_engine.out 2>&1")
    r = lab.run(script, profile="cxl", kernel="6.12", timeout_s=2400, node_mib=NODE_MIB)
    try:
        out = json.loads((r.out_dir / "engine.json").read_text())
    except (OSError, ValueError):
        out = None
    if r.rc != 0 or out is None or len(out.get("conditions", [])) < 2:
        log = "\n".join((r.out_dir / n).read_text()[-3000:] for n in ("kv_engine.out", "server-tieringd.log",
                                                                       "daemon.log") if (r.out_dir / n).exists())
        pytest.fail(f"kv_engine rc {r.rc}\n{log}\n{r.stderr[-2000:]}", pytrace=False)
    return out


def _condition(engine, name: str) -> dict:
    c = next(c for c in engine["conditions"] if c["condition"] == name)
    assert not c.get("error"), c["error"]
    return c


def test_the_engines_tokens_are_the_same_with_and_without_shim_and_daemon(engine):
    bare = [q["text"] for q in _condition(engine, "plain")["requests"]]
    tiered = [q["text"] for q in _condition(engine, "tieringd")["requests"]]
    assert len(bare) == len(tiered) == REQUESTS
    assert any(t.strip() for t in bare), "the model answered nothing: the comparison would be empty"
    assert tiered == bare


def test_tieringd_registers_the_engines_kv_buffer(engine):
    c = _condition(engine, "tieringd")
    assert c["kv_buffer"]["start"], "no mapping of the KV cache's size in the server"
    regions = c["regions"]
    assert any(r["length"] >= engine["kv_bytes"] for r in regions), \
        f"no region of the server covers its {engine['kv_bytes']} B KV cache: {[r['length'] for r in regions]}"
