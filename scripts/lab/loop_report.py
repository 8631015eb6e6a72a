# SPDX-License-Identifier: Apache-2.0
"""Host side of the closed-loop runs: boot the sized lab, run scripts/lab/kv_loop.py in it, and turn
its ``loop.json`` into figures — one row per run, the node-0 share over time as a terminal table and
a PNG. Used by scripts/bench/p5_loop.py (figure P5) and scripts/demo.py (``make demo``).

    from loop_report import boot_loop, run_row, timeline_rows
    out = boot_loop("6.12", seconds=80, runs=3, layouts=("scattered", "front"), out_dir=Path("…"))
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NODE_MIB = 1024          # node0 1 GiB with the CPUs, node1 1 GiB CPU-less: a 1.2 GiB pool cannot fit
MIB = 2 ** 20


def lab_module():
    """scripts/lab.py as a module (it is a script, not a package), registered as ``tieringd_lab``: the
    one loader, tests/lab_workers.py uses it too."""
    name = "tieringd_lab"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / "lab.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod          # dataclasses need the module registered while it executes
        spec.loader.exec_module(mod)
    return sys.modules[name]


def boot_loop(kernel: str, *, seconds: float, runs: int, layouts: tuple[str, ...], out_dir: Path,
              no_daemon: bool = False, timeout_s: float | None = None, before: str = "",
              extra_args: tuple[str, ...] = ()) -> dict:
    """One guest (``cxl``, DRAM nodes NODE_MIB): kv_loop.py with tieringd (or without, a baseline).
    ``before``: guest shell lines run first; ``extra_args``: more kv_loop.py options (``--peer …``). Returns its loop.json; raises RuntimeError with the guest's log tail when it produced none."""
    lab = lab_module()
    args = [".venv/bin/python", "scripts/lab/kv_loop.py", "--out", "$LAB_OUT", "--seconds", str(seconds),
            "--runs", str(runs), *(x for layout in layouts for x in ("--layout", layout))]
    if no_daemon:
        args.append("--no-daemon")
    args += extra_args
    script = before + " ".join(args) + " > $LAB_OUT/kv_loop.out 2>&1\n"
    per_run_s = seconds + 120                  # fill (~40 s under TCG), verify, the daemon's checks
    timeout_s = timeout_s or 300 + per_run_s * runs * len(layouts)
    r = lab.run(script, profile="cxl", kernel=kernel, timeout_s=timeout_s, out_dir=out_dir,
                node_mib=NODE_MIB)
    path = Path(out_dir) / "loop.json"
    if not path.exists():
        tail = ((Path(out_dir) / "kv_loop.out").read_text()[-3000:]
                if (Path(out_dir) / "kv_loop.out").exists() else r.stderr[-3000:])
        raise RuntimeError(f"lab {kernel}: no loop.json (guest exit {r.rc}):\n{tail}")
    out = json.loads(path.read_text())
    out["lab"] = {"kernel": kernel, "rc": r.rc, "wall_s": round(r.wall_s, 1), "boot_s": round(r.boot_s, 1)}
    return out


def _moves(run: dict) -> tuple[dict, dict]:
    return ((run.get("daemon_before") or {}).get("moves") or {},
            (run.get("daemon_after") or {}).get("moves") or {})


def run_row(run: dict) -> dict:
    """One run's figures: the node-0 share over the second half (mean and minimum of its reports),
    bytes intact, bytes the daemon promoted/demoted during the run, failed pages by reason, ticks
    (count and overruns during the run; p50/p99 over the daemon's recent ticks at the run's end),
    the daemon's CPU seconds during the run, and how long the exited workload's regions took to
    leave the daemon's tables."""
    m0, m1 = _moves(run)
    t0 = ((run.get("daemon_before") or {}).get("ticks")) or {}
    t1 = ((run.get("daemon_after") or {}).get("ticks")) or {}
    failed = {k: v - (m0.get("failed_pages") or {}).get(k, 0) for k, v in (m1.get("failed_pages") or {}).items()}
    end = run.get("end") or {}
    reports = run.get("reports") or []
    return {
        "layout": run["layout"], "run": run.get("run", 0),
        "share_first": reports[0]["node0_share"] if reports else None,
        "share_mean_2nd_half": _round(run.get("share_mean_second_half")),
        "share_min_2nd_half": _round(run.get("share_min_second_half")),
        "bytes_intact": bool(end.get("ok")) and run.get("rc") == 0,
        "promoted_mib": round(((m1.get("promoted_bytes") or 0) - (m0.get("promoted_bytes") or 0)) / MIB, 1),
        "demoted_mib": round(((m1.get("demoted_bytes") or 0) - (m0.get("demoted_bytes") or 0)) / MIB, 1),
        "failed_pages": {k: v for k, v in failed.items() if v},
        "ticks": (t1.get("count") or 0) - (t0.get("count") or 0),
        "overruns": (t1.get("overruns") or 0) - (t0.get("overruns") or 0),
        "tick_p50_ms": _round(t1.get("p50_ms"), 1), "tick_p99_ms": _round(t1.get("p99_ms"), 1),
        "daemon_cpu_s": run.get("daemon_cpu_s"),
        "exit_to_removed_s": run.get("exit_to_removed_s"),
        "decode_steps": sum(r.get("steps", 0) for r in reports),
    }


def _round(x, n: int = 3):
    return None if x is None else round(float(x), n)


def timeline_rows(run: dict) -> list[dict]:
    """Per workload report: time, node-0 share of the touched blocks, and the daemon's cumulative
    promoted/demoted MiB since the run began."""
    base_p = ((run.get("daemon_before") or {}).get("moves") or {}).get("promoted_bytes") or 0
    base_d = ((run.get("daemon_before") or {}).get("moves") or {}).get("demoted_bytes") or 0
    daemon_at = {round(x["t_s"], 1): (x.get("daemon") or {}).get("moves") or {} for x in run.get("timeline", [])}
    rows = []
    for r in run.get("reports") or []:
        m = daemon_at.get(round(r["t_s"], 1), {})
        rows.append({"t_s": round(r["t_s"], 1), "share": r["node0_share"],
                     "touched": r["touched_blocks"], "on_node0": r["blocks_on_node0"],
                     "promoted_mib": round(((m.get("promoted_bytes") or base_p) - base_p) / MIB, 1),
                     "demoted_mib": round(((m.get("demoted_bytes") or base_d) - base_d) / MIB, 1)})
    return rows


def ascii_timeline(run: dict, width: int = 40) -> str:
    lines = [f"{'t (s)':>6}  {'node0 share':<{width + 7}} {'promoted':>9} {'demoted':>8}"]
    for x in timeline_rows(run):
        bar = "#" * round(x["share"] * width)
        lines.append(f"{x['t_s']:6.1f}  {bar:<{width}} {x['share']:.3f} {x['promoted_mib']:6.1f} MiB "
                     f"{x['demoted_mib']:5.1f} MiB")
    return "\n".join(lines)


def plot(runs: list[tuple[str, dict]], path: Path, title: str) -> None:
    """Node-0 share over time, one line per (label, run) (Agg: no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for label, run in runs:
        rows = timeline_rows(run)
        ax.plot([x["t_s"] for x in rows], [x["share"] for x in rows], marker="o", label=label)
    ax.set_xlabel("time since the workload's fill (s)")
    ax.set_ylabel("share of touched blocks on node 0")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
