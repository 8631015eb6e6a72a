#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Kill trials: ``kill -9`` of tieringd at random points of its ticks, in one lab guest, every byte
of a KV workload verified after each restart.

    python scripts/reliability/kill_trials.py [--json OUT] [--quick] [--seed S] [--trials N] [--kernel 6.12]

One boot of the lab's ``cxl`` profile (DRAM nodes 1 GiB) runs ``scripts/lab/kill_trials.py``: the
daemon and ``kv_workload`` (a 256 MiB pool of checksummed KV blocks under ``tieringctl run``); then
N trials (100), each a SIGKILL while moves are in flight (a ``migrate`` of the whole workload between
the nodes) or at a random time of the daemon's own ticks, a restart, the regions waited for, and the
workload's SIGUSR1 verification of its whole pool; then, in the same boot, the fault cases
(``scripts/lab/fault_cases.py``), whose records the ``faults`` part reads. Figures: trials, bytes verified, bytes lost (the
goal: 0), kills that found moves in flight, regions re-learnt and how long re-learning took after
the kill (median and longest: figures, not checks).

The part needs the lab (a cached 6.12 kernel, virtme-ng, QEMU) and root: without them it is
skipped, with the reason. ``--quick`` skips it too: one boot and its trials take many minutes under
TCG, more than the short form inside ``make test`` may spend.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, arguments, result, seed_of, skip_unless_root, write  # noqa: E402

sys.path.insert(0, str(REPO / "scripts" / "lab"))
from loop_report import lab_module  # noqa: E402

TITLE = "kill -9 of tieringd in its ticks, restart, every byte verified (lab)"
NODE_MIB = 1024


def missing(kernel: str) -> str | None:
    """Why the lab cannot run here, or None."""
    lab = lab_module()
    if lab.Kernel.load(kernel) is None:
        return f"lab kernel {kernel} is not in {lab.cache_dir()} (make lab-kernels)"
    if not shutil.which("qemu-system-x86_64"):
        return "QEMU (qemu-system-x86_64) is not installed (scripts/apt-packages.txt)"
    try:
        lab.vng_path()
    except lab.LabError as e:
        return str(e)
    if not (REPO / "build" / "tests" / "kv_workload").exists():
        return "build/tests/kv_workload is not built (make)"
    return None


def main() -> int:
    ap = arguments(__doc__)
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--kernel", default="6.12")
    args = ap.parse_args()
    skipped = skip_unless_root(args, "kill-trials", TITLE, "trials")
    if skipped is not None:
        return skipped
    why = "skipped: the quick form boots no lab guest (the trials take many minutes)" if args.quick else None
    why = why or (f"skipped: {m}" if (m := missing(args.kernel)) else None)
    if why:
        print(f"kill-trials: {why}", flush=True)
        return write(args, result("kill-trials", TITLE, tried=0, unit="trials", ok=True, notes=why))
    seed = seed_of(args, "kill-trials")
    out_dir = REPO / "build" / "reliability" / "kill-trials"
    shutil.rmtree(out_dir, ignore_errors=True)
    script = (f".venv/bin/python scripts/lab/kill_trials.py --out $LAB_OUT --trials {args.trials} "
              f"--seed {seed} --faults > $LAB_OUT/guest.out 2> $LAB_OUT/guest.err")
    lab = lab_module()
    # a safety net: a trial takes 10-30 s of a TCG guest on this kind of machine
    r = lab.run(script, profile="cxl", kernel=args.kernel, timeout_s=600 + 120 * args.trials,
                out_dir=out_dir, node_mib=NODE_MIB)
    print(f"kill-trials: guest rc {r.rc}, boot {r.boot_s:.1f} s, wall {r.wall_s:.0f} s; output in {out_dir}", flush=True)
    try:
        doc = json.loads((out_dir / "kill_trials.json").read_text())
    except (OSError, ValueError):
        err = (out_dir / "guest.err").read_text(errors="replace")[-1500:] if (out_dir / "guest.err").exists() else ""
        return write(args, result("kill-trials", TITLE, tried=0, unit="trials", ok=False, crashes=1, seed=seed,
                                  notes=f"the guest wrote no record (rc {r.rc}): {err} {r.stderr[-500:]}"))
    s = doc["summary"]
    end = doc.get("end") or {}
    wrong = [f"trial {t['trial']}: regions not all back ({t['regions_relearnt']} of {doc.get('regions')})"
             for t in doc["trials"] if not t["regions_back"]]
    wrong += [f"trial {t['trial']}: verify {t['verify']}" for t in doc["trials"] if not (t["verify"] or {}).get("ok")]
    if not end.get("ok") or doc.get("workload_rc") != 0:
        wrong.append(f"the workload's end: rc {doc.get('workload_rc')}, {end}: {doc.get('workload_stderr', '')[-300:]}")
    if doc.get("daemon_rc") != 0:
        wrong.append(f"the last daemon exited with {doc.get('daemon_rc')}")
    if doc.get("settings_after") != doc.get("settings_before"):
        wrong.append(f"kernel settings not restored: {doc.get('settings_before')} → {doc.get('settings_after')}")
    tracebacks = [f"{log.name}: a traceback" for log in sorted(out_dir.glob("daemon-*.log"))
                  if "Traceback" in log.read_text(errors="replace")]
    wrong += tracebacks
    if s["trials"] != args.trials:
        wrong.append(f"{s['trials']} of {args.trials} trials ran")
    figures = {**s, "kernel": doc.get("release"), "regions": doc.get("regions"), "guest_wall_s": round(r.wall_s),
               "boot_s": r.boot_s, "end": end}
    print(f"kill-trials: {s['trials']} trials, {s['bytes_verified']:,} bytes verified, {s['bytes_lost']} lost, "
          f"{s['kills_with_moves_in_flight']} kills with moves in flight, {s['regions_relearnt']} regions re-learnt "
          f"(median {s['relearn_s_median']} s after the kill, longest {s['relearn_s_max']} s)", flush=True)
    for w in wrong[:10]:
        print(f"kill-trials: {w}", flush=True)
    return write(args, result("kill-trials", TITLE, tried=s["trials"], unit="trials", ok=not wrong and r.rc == 0,
                              bytes_lost=s["bytes_lost"], crashes=len(tracebacks), seed=seed, figures=figures, cases=wrong[:20]))


if __name__ == "__main__":
    sys.exit(main())
