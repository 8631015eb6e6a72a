#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The reliability suite (``make reliability``): every part in turn, then one table.

    python scripts/reliability/run.py [--out build/reliability] [--quick] [--seed S] [--only PART]

Each part is its own script (``scripts/reliability/PART.py``) run as a child with ``--json``; its
output goes to ``OUT/PART.log``, its record to ``OUT/PART.json``, and the whole run to
``OUT/summary.json``. A part that needs what this machine lacks (root) says so in its record and is
counted as skipped, not passed. ``--seed S`` hands every part the same seed (each prints its own
otherwise, so that any one replays). Exit status: 0 when every part that ran held.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

# (part, script): the order they run in, quickest first so that a broken daemon shows early
PARTS = (("access", "access.py"), ("fuzz-config", "fuzz_config.py"), ("fuzz-registry", "fuzz_registry.py"),
         ("fuzz-control", "fuzz_control.py"), ("load", "load.py"),
         ("kill-trials", "kill_trials.py"), ("faults", "faults.py"))
COLUMNS = ("part", "tried", "bytes lost", "crashes", "refused", "let through", "seconds", "result")


def run_part(part: str, script: str, out: Path, args: argparse.Namespace) -> dict:
    record = out / f"{part}.json"
    record.unlink(missing_ok=True)
    argv = [sys.executable, str(HERE / script), "--json", str(record)]
    argv += ["--quick"] if args.quick else []
    argv += ["--seed", str(args.seed)] if args.seed is not None else []
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    with open(out / f"{part}.log", "w") as log:
        print(f"reliability: {part} … (log: {out / f'{part}.log'})", flush=True)
        rc = subprocess.run(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    seconds = time.monotonic() - t0
    try:
        doc = json.loads(record.read_text())
    except (OSError, ValueError):
        # the part itself failed before it could say anything: that is a crash of the suite's part
        tail = (out / f"{part}.log").read_text(errors="replace")[-600:]
        doc = {"part": part, "tried": 0, "unit": "", "bytes_lost": 0, "crashes": 1, "refused": 0,
               "let_through": 0, "ok": False, "notes": f"exited {rc} without a record: {tail}"}
    doc["seconds"] = round(seconds, 1)
    doc["exit"] = rc
    doc["skipped"] = doc.get("tried", 0) == 0 and str(doc.get("notes", "")).startswith("skipped")
    return doc


def table(docs: list[dict]) -> str:
    rows = [COLUMNS]
    for d in docs:
        verdict = "skipped" if d["skipped"] else ("ok" if d["ok"] and d["exit"] == 0 else "FAILED")
        rows.append((d["part"], f"{d['tried']:,} {d.get('unit', '')}".strip(), str(d["bytes_lost"]),
                     str(d["crashes"]), str(d["refused"]), str(d["let_through"]), f"{d['seconds']:.0f}", verdict))
    ran = [d for d in docs if not d["skipped"]]
    rows.append(("total", f"{sum(d['tried'] for d in ran):,}", str(sum(d["bytes_lost"] for d in ran)),
                 str(sum(d["crashes"] for d in ran)), str(sum(d["refused"] for d in ran)),
                 str(sum(d["let_through"] for d in ran)), f"{sum(d['seconds'] for d in docs):.0f}",
                 "ok" if all(d["ok"] and d["exit"] == 0 for d in ran) else "FAILED"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "build" / "reliability"), help="logs and JSON go here")
    ap.add_argument("--quick", action="store_true", help="the short form: fewer inputs per part")
    ap.add_argument("--seed", type=int, default=None, help="one seed for every part (replay)")
    ap.add_argument("--only", action="append", choices=[p for p, _ in PARTS], help="run only this part")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    docs = [run_part(p, s, out, args) for p, s in PARTS if not args.only or p in args.only]
    wall = time.monotonic() - t0
    for d in docs:
        if d["skipped"] or not (d["ok"] and d["exit"] == 0):
            print(f"reliability: {d['part']}: {'skipped' if d['skipped'] else 'FAILED'}: "
                  f"{d.get('notes') or d.get('cases', [])[:3]} (seed {d.get('seed')})", flush=True)
    text = table(docs)
    print(text)
    print(f"reliability: {wall:.0f} s in all ({'quick' if args.quick else 'full'}); records in {out}")
    ok = all(d["ok"] and d["exit"] == 0 for d in docs if not d["skipped"])
    summary = {"schema": "tieringd.reliability-summary/1", "quick": args.quick, "wall_s": round(wall, 1),
               "ok": ok, "host": platform.node(), "kernel": platform.release(), "uid": os.geteuid(),
               "parts": docs, "table": text}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
