#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Figure P8: DAX-remap throughput vs move_pages to the kmem node of the same kind of NVDIMM.

Side by side in one lab guest (profile ``pmem``: nv0 onlined through kmem as node 2, nv1 fsdax on
/tmp/pmem — two identical emulated NVDIMMs in proximity domain 2), idle pools of N MiB, 4 KiB pages
(THP off for both):

- ``demote``/``promote``: ``tieringd.shim.remap.DaxTier`` remaps a memfd pool of a shim process onto the
  log file on fsdax and back (write-protect + pwrite + MAP_FIXED; post-copy with UFFDIO_COPY);
- ``move to pmem``/``move back``: ``tieringd.mover.MigrationEngine`` moves an anonymous pool of the
  same size to node 2 and back to node 0 (move_pages with its verification queries).

Each is timed ``--rounds`` times; the figure keeps the median, in MiB/s and in seconds per GiB, and
the ratios remap / move_pages. Under QEMU/TCG the absolute figures are emulation figures — only the
ratios, measured in the same boot, mean something.

    python scripts/bench/p8_dax_remap.py --json build/bench/p8_dax_remap.json [--mib 256] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def guest(mib: int, rounds: int) -> dict:
    import threading

    from tieringd.shim import registry, remap
    from tieringd.mover import MigrationEngine, MoveRequest

    node = int(subprocess.run(["scripts/lab/pmem.sh", "kmem", "namespace0.0"], check=True, capture_output=True,
                              text=True).stdout.split()[-1])
    mnt = subprocess.run(["scripts/lab/pmem.sh", "fsdax", "namespace1.0", "/tmp/pmem"], check=True,
                         capture_output=True, text=True).stdout.split()[-1]
    run = Path("/tmp/p8-run")
    reg = registry.Registry(str(run)).start()
    stop = threading.Event()
    threading.Thread(target=reg.serve, args=(stop, 0.05), daemon=True).start()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TIERINGD_", "LD_PRELOAD"))}
    shim = {"LD_PRELOAD": str(REPO / "build/libtieringd-shim.so"), "TIERINGD_RUN_DIR": str(run), "TIERINGD_THP": "0"}

    def pool(backing: str, register: str) -> tuple[subprocess.Popen, int, int]:
        p = subprocess.Popen([str(REPO / "build/tests/dax_writers"), str(mib), "0"],
                             env={**base, **shim, "TIERINGD_BACKING": backing, "TIERINGD_REGISTER": register},
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        words = p.stdout.readline().split()
        p.stdout.readline()
        return p, int(words[1], 16), int(words[2])

    mem, m_start, m_len = pool("memfd", "1")
    anon, a_start, a_len = pool("anon", "0")
    deadline = time.monotonic() + 120
    while not reg.regions(mem.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    # The pool and two segments: a promoted extent's segment is free again at once (nv1's fsdax
    # namespace is 512 MiB, ext4 on it has about 480 MiB free).
    tier = remap.DaxTier(reg, remap.DaxConfig(path=f"{mnt}/tieringd/kv.log", size_bytes=(mib + 64) * MIB,
                                               segment_bytes=32 * MIB)).open({})
    engine = MigrationEngine()
    times: dict[str, list[float]] = {"demote": [], "promote": [], "move to pmem": [], "move back": []}
    for _ in range(rounds):
        for key, call in (("demote", tier.demote), ("promote", tier.promote)):
            rep = call(mem.pid, m_start, m_len)
            assert rep.ok, rep
            times[key].append(rep.seconds)
        for key, target in (("move to pmem", node), ("move back", 0)):
            t0 = time.monotonic()
            ticket = engine.submit(MoveRequest(anon.pid, [(a_start, a_len)], target))
            engine.run_until_idle()
            rep = ticket.wait(0)
            times[key].append(time.monotonic() - t0)
            assert rep.moved_pages >= a_len // 4096 - 16, rep.to_dict()
    ok = [p.communicate("stop\n", timeout=600)[0].startswith("ok ") for p in (mem, anon)]
    tier.close()
    stop.set()
    reg.close()
    return {"mib": mib, "node": node, "times": times, "intact": all(ok),
            "release": os.uname().release}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=False)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kernel", default="6.12")
    ap.add_argument("--guest", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.guest:
        print(json.dumps(guest(args.mib, args.rounds)))
        return 0
    cmd = [sys.executable, str(REPO / "scripts" / "lab.py"), "run", "--profile", "pmem", "--kernel", args.kernel,
           "--timeout", "2400", "--", f".venv/bin/python scripts/bench/p8_dax_remap.py --guest --mib {args.mib} "
           f"--rounds {args.rounds}"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if r.returncode:
        print(f"p8_dax_remap: lab run failed (exit {r.returncode}):\n{r.stderr[-2000:]}", file=sys.stderr)
        return 1
    g = json.loads(r.stdout.strip().splitlines()[-1])
    med = {k: statistics.median(v) for k, v in g["times"].items()}
    mb_s = {k: g["mib"] / v for k, v in med.items()}
    rows = [[k, round(mb_s[k], 1), round(med[k] * 1024 / g["mib"], 2)] for k in med]
    fig = {
        "figure": "P8", "title": f"DAX remap vs move_pages, idle {g['mib']} MiB pools, 4 KiB pages "
                                 f"(lab pmem, kernel {g['release']}, medians of {args.rounds})",
        "columns": ["operation", "MiB/s", "s per GiB"],
        "rows": rows,
        "summary": {"demote_vs_move_to_pmem": round(mb_s["demote"] / mb_s["move to pmem"], 2),
                    "promote_vs_move_back": round(mb_s["promote"] / mb_s["move back"], 2),
                    "every_word_intact": g["intact"]},
        "notes": "Remap: memfd pool of a shim process onto the log file on fsdax (nv1) and back; move_pages: "
                 f"anonymous pool to node {g['node']} (kmem, nv0) and back, through the mover. QEMU/TCG: ratios only.",
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(fig, indent=2))
    print(json.dumps(fig, indent=1))
    return 0 if g["intact"] else 1


if __name__ == "__main__":
    sys.exit(main())
