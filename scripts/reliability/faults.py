#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Faults under the mover: the records of the fault cases the ``kill-trials`` part's guest ran after
its trials, in the same boot (``scripts/lab/fault_cases.py``: a full target node, memory blocks
offlined under the mover, a workload that exits mid-move, a workload that forks and execs mid-move,
control clients that vanish mid-reply).

    python scripts/reliability/faults.py [--json OUT] [--quick] [--seed S]

It boots nothing: it reads ``build/reliability/kill-trials/kill_trials.json``, so it runs after
``kill-trials`` (``run.py``'s order) and is skipped, with the reason, when that part did not boot a
guest in this run (``--quick``, no lab) or the guest ran no fault case. A case holds when the
workload verified every byte afterwards, the daemon was alive and answering, and the case itself
raised nothing.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, arguments, result, write  # noqa: E402

TITLE = "faults under the mover (lab, the kill trials' boot)"
RECORD = REPO / "build" / "reliability" / "kill-trials" / "kill_trials.json"


def main() -> int:
    args = arguments(__doc__).parse_args()
    trials = REPO / "build" / "reliability" / "kill-trials.json"
    ran = not args.quick and trials.exists() and RECORD.exists() and \
        RECORD.stat().st_mtime >= trials.stat().st_mtime - 7200
    try:
        doc = json.loads(RECORD.read_text()) if ran else {}
    except (OSError, ValueError):
        doc = {}
    cases = doc.get("faults") or []
    if not cases:
        why = "skipped: the kill trials' guest ran no fault case in this run (the quick form, or no lab)"
        print(f"faults: {why}", flush=True)
        return write(args, result("faults", TITLE, tried=0, unit="faults", ok=True, notes=why))
    for c in cases:
        print(f"faults: {c['case']}: {'ok' if c['ok'] else 'FAILED'}: "
              f"{json.dumps({k: v for k, v in c.items() if k not in ('case', 'ok')}, default=str)[:600]}", flush=True)
    wrong = [f"{c['case']}: {c.get('error') or c.get('verify') or c}" for c in cases if not c["ok"]]
    return write(args, result("faults", TITLE, tried=len(cases), unit="faults", ok=not wrong,
                              bytes_lost=sum(c.get("bytes_lost") or 0 for c in cases),
                              crashes=sum(1 for c in cases if not c.get("daemon_alive")), seed=doc.get("seed"),
                              figures={c["case"]: c for c in cases}, cases=wrong))


if __name__ == "__main__":
    sys.exit(main())
