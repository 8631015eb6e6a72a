#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""``make bench``: runs every figure script ``scripts/bench/p<N>_<name>.py`` and gathers the results.

Contract for a figure script: ``python scripts/bench/pN_name.py --json OUT.json [its own options]``
writes one JSON object::

    {"figure": "P1", "title": "...", "columns": [...], "rows": [[...], ...],
     "summary": {...ratios and targets...}, "notes": "..."}

Ratios are measured side by side in the same run (never against a number from another day). This
runner writes ``results.json`` (all figures) and ``results.md`` (one table per figure) into --out.
``--only`` takes a figure id (``P5``: every ``p5_*.py``) or a script's name (``p5_peers``); ``--args
NAME='OPTIONS'`` passes options to one script, e.g. ``make bench BENCH_ARGS="--only p5_peers --args
p5_peers='--runs 3'"``.
"""
from __future__ import annotations

import argparse
import json
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def render(fig: dict) -> str:
    cols = [str(c) for c in fig["columns"]]
    rows = [["" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v)) for v in r]
            for r in fig["rows"]]
    lines = [f"### {fig['figure']}: {fig['title']}", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    if fig.get("summary"):
        lines += ["", "Summary: " + ", ".join(f"{k} = {v}" for k, v in fig["summary"].items())]
    if fig.get("notes"):
        lines += ["", fig["notes"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="build/bench")
    ap.add_argument("--only", action="append", default=[],
                    help="figure ids (P1, P2, …; P6 runs every P6 script, P6-scale one) or script names (p5_peers)")
    ap.add_argument("--args", action="append", default=[], metavar="SCRIPT=OPTIONS",
                    help="options for one figure script, e.g. p5_peers='--runs 3'")
    args = ap.parse_args()
    extra = {}
    for a in args.args:
        name, sep, opts = a.partition("=")
        if not sep:
            ap.error(f"--args {a!r}: expected SCRIPT=OPTIONS")
        extra[name.removesuffix(".py")] = shlex.split(opts)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scripts = sorted(HERE.glob("p[0-9]*_*.py"), key=lambda p: int(p.name[1:].split("_")[0]))
    if args.only:
        wanted = {o.upper() for o in args.only}
        scripts = [s for s in scripts
                   if {s.name.split("_")[0].upper(), s.stem.replace("_", "-").upper(), s.stem.upper()} & wanted]
    figures, failed = [], []
    for script in scripts:
        fig_json = out / (script.stem + ".json")
        cmd = [sys.executable, str(script), "--json", str(fig_json), *extra.get(script.stem, [])]
        print(f"bench: {' '.join(cmd)}", flush=True)
        t0 = time.monotonic()
        rc = subprocess.call(cmd)
        if rc != 0 or not fig_json.exists():
            failed.append(script.name)
            print(f"bench: {script.name} failed (exit {rc})", file=sys.stderr)
            continue
        fig = json.loads(fig_json.read_text())
        fig["command"] = " ".join(["python", f"scripts/bench/{script.name}", *extra.get(script.stem, [])])
        fig["wall_s"] = round(time.monotonic() - t0, 1)
        figures.append(fig)
        print(render(fig))
    doc = {"schema": "tieringd.bench/1", "host": {"kernel": platform.release(),
           "machine": platform.machine(), "python": platform.python_version()},
           "figures": figures, "failed": failed}
    (out / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "results.md").write_text("\n".join(render(f) for f in figures))
    print(f"bench: wrote {out}/results.json and results.md ({len(figures)} figures, {len(failed)} failed)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
