#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""P5-engine: the closed loop under a real inference engine — llama.cpp's server, unmodified.

In the sized lab (cxl, DRAM nodes 1 GiB), one guest per kernel runs scripts/lab/kv_engine.py: the
server of llama-cpp-python (built by scripts/lab/engine_env.py) with the project's own tiny model
(scripts/lab/tiny_gguf.py, written into build/engine/) and a KV cache of 307 200 cells (1.17 GiB,
more than node 0 holds free), first bare (``plain``: the reference answers), then under ``tieringctl
run`` with no tiering, the kernel's tiering and tieringd, each for --seconds of requests (a shared
system prompt, six rotating conversations). Per condition: the node-0 share of the KV pages the
engine read in each report period (mean over the second half, and its lowest report), requests
served, whether every answer equals the bare run's answer to the same request, the bytes moved,
and — for tieringd — whether it registered the KV buffer.

    python scripts/bench/p5_engine.py --json build/bench/p5_engine.json [--kernel 6.12] [--seconds 240]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lab"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _figure import write_figure  # noqa: E402
from loop_report import NODE_MIB, REPO, lab_module  # noqa: E402

import engine_env  # noqa: E402

MODEL = REPO / "build" / "engine" / "tiny.gguf"
CONDITIONS = ("plain", "none", "kernel", "tieringd")
COLUMNS = ["kernel", "condition", "requests", "share 2nd half", "lowest report", "first report",
           "answers = bare run", "KV registered", "promoted MiB", "demoted MiB", "agent CPU s"]
MIB = 2 ** 20


def write_model() -> None:
    MODEL.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(engine_env.PYTHON), str(REPO / "scripts" / "lab" / "tiny_gguf.py"), str(MODEL)],
                   check=True)


def boot(kernel: str, seconds: float, out_dir: Path) -> dict:
    lab = lab_module()
    conds = " ".join(f"--condition {c}" for c in CONDITIONS)
    script = (f".venv/bin/python scripts/lab/kv_engine.py --out $LAB_OUT --model {MODEL} {conds} "
              f"--seconds {seconds:g} > $LAB_OUT/kv_engine.out 2>&1\n")
    r = lab.run(script, profile="cxl", kernel=kernel, timeout_s=900 + 2 * seconds * len(CONDITIONS),
                out_dir=out_dir, node_mib=NODE_MIB)
    path = out_dir / "engine.json"
    if not path.exists():
        log = out_dir / "kv_engine.out"
        raise RuntimeError(f"lab {kernel}: no engine.json (guest exit {r.rc}):\n"
                           + (log.read_text()[-3000:] if log.exists() else r.stderr[-3000:]))
    return json.loads(path.read_text())


def rows_of(kernel: str, eng: dict) -> list[list]:
    conds = {c["condition"]: c for c in eng["conditions"]}
    ref = [q["text"] for q in conds.get("plain", {}).get("requests", [])]
    rows = []
    for name in CONDITIONS:
        c = conds.get(name)
        if c is None or c.get("error"):
            rows.append([kernel, name, 0, None, None, None, None, None, None, None, (c or {}).get("error")])
            continue
        texts = [q["text"] for q in c.get("requests", [])]
        n = min(len(texts), len(ref))
        reps = [r for r in c.get("reports", []) if r.get("node0_share") is not None]
        half = [r["node0_share"] for r in reps if r["t_s"] > (reps[-1]["t_s"] / 2 if reps else 0)]
        promoted = demoted = cpu = None
        if c.get("peer_counters"):
            b, a = c["peer_counters"]
            promoted = round((a["promoted_bytes"] - b["promoted_bytes"]) / MIB, 1)
            demoted = round((a["demoted_bytes"] - b["demoted_bytes"]) / MIB, 1)
            cpu = round(a["agent_cpu_s"] - b["agent_cpu_s"], 2)
        elif c.get("moves"):
            promoted = round((c["moves"].get("promoted_bytes") or 0) / MIB, 1)
            demoted = round((c["moves"].get("demoted_bytes") or 0) / MIB, 1)
            cpu = c.get("daemon_cpu_s")
        registered = (any(r["length"] >= eng["kv_bytes"] for r in c.get("regions", []))
                      if name == "tieringd" else None)
        rows.append([kernel, name, len(texts), round(statistics.mean(half), 3) if half else None,
                     round(min(half), 3) if half else None, reps[0]["node0_share"] if reps else None,
                     (texts[:n] == ref[:n] and n > 0) if name != "plain" else None, registered,
                     promoted, demoted, cpu])
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--kernel", action="append", help="lab kernels (default 6.12)")
    ap.add_argument("--seconds", type=float, default=240, help="requests per condition for this long")
    ap.add_argument("--from", dest="from_", action="append", default=[], metavar="ENGINE_JSON")
    a = ap.parse_args()
    engines = []
    if a.from_:
        engines = [(json.loads(Path(p).read_text()).get("kernel", "?"), json.loads(Path(p).read_text()))
                   for p in a.from_]
    else:
        ok, why = engine_env.check()
        if not ok:
            print(f"p5_engine: {why}", file=sys.stderr)
            return 1
        write_model()
        for kernel in a.kernel or ["6.12"]:
            with tempfile.TemporaryDirectory(prefix=f"p5engine-{kernel}-") as tmp:
                eng = boot(kernel, a.seconds, Path(tmp))
            eng["kernel"] = kernel
            keep = REPO / "build" / "bench" / "p5_engine"
            keep.mkdir(parents=True, exist_ok=True)
            (keep / f"{kernel}.json").write_text(json.dumps(eng))
            engines.append((kernel, eng))
    rows = [row for kernel, eng in engines for row in rows_of(kernel, eng)]
    write_figure({
        "figure": "P5-engine",
        "title": "llama.cpp's server under the loop: node-0 share of the KV pages it reads "
                 f"({a.seconds:g} s of requests per condition, lab cxl, DRAM nodes 1 GiB, 1.17 GiB KV cache)",
        "columns": COLUMNS, "rows": rows,
        "summary": {"kernels": sorted({e.get("release", "?") for _, e in engines})},
        "notes": ("plain: the server bare (the reference answers; its share is not taken under the "
                  "kernel's boot settings). none / kernel: under tieringctl run without the daemon, "
                  "NUMA balancing off / mode 2 with demotion. Answers compared request by request, "
                  "greedy decoding. QEMU/TCG: shares and bytes are meaningful, times are not."),
    }, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
