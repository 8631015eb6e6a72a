# SPDX-License-Identifier: Apache-2.0
"""``tieringctl top``: per process, bytes on each tier, how hot its blocks are, how many are shared
(SHARED: blocks with more than one sharer / the most sharers of one), how fast they move —
refreshed like top(1). ``-d SECONDS`` between frames, ``-n N`` frames, ``-p PID`` (repeatable), as
procps' top; ``-b`` (or output that is not a terminal) prints frames one after another as plain text.
Rates are measured between two frames (the first frame shows "-"). The ``HEAT`` columns are bytes
of the process's blocks per heat band — the policy's thresholds, e.g. ``HEAT>=0.8``, ``HEAT0.5-0.8``
(0.5 ≤ heat < 0.8), ``HEAT<0.2`` — so that they add up to its DRAM + CXL-DRAM + PMEM bytes (and any
not yet placed); heat is a number in [0, 1] with no unit (docs/heat-policy.md). ``--json``: one
``tieringd.top/1`` document per frame (default one frame; docs/json.md)."""
from __future__ import annotations

import itertools
import sys
import time

import click

from tieringd.cli._output import RUN_DIR_OPTION_HELP, ask, daemon_client, human_bytes, table
from tieringd.cli.regions import shared_text

SCHEMA = "tieringd.top/1"
TIERS = ("dram", "cxl-dram", "pmem")
CLEAR = "\033[H\033[2J"


def moved_bytes(p: dict) -> float:
    m = p.get("moves") or {}
    return float(m.get("promoted_bytes", 0)) + float(m.get("demoted_bytes", 0))


def frame(procs: dict, status: dict, before: dict | None, dt: float | None, pids: tuple[int, ...]) -> dict:
    """One ``tieringd.top/1`` document: the processes' report plus rates since the previous frame."""
    prev = {p["pid"]: p for p in (before or {}).get("processes", [])}
    rows = []
    for p in procs["processes"]:
        if pids and p["pid"] not in pids:
            continue
        q = prev.get(p["pid"])
        rate = None
        promo = demo = None
        if q is not None and dt:
            rate = (moved_bytes(p) - moved_bytes(q)) / dt
            pm, qm = p.get("moves") or {}, q.get("moves") or {}
            promo = (pm.get("promoted_bytes", 0) - qm.get("promoted_bytes", 0)) / dt
            demo = (pm.get("demoted_bytes", 0) - qm.get("demoted_bytes", 0)) / dt
        rows.append({**p, "moved_bytes_per_s": rate, "promoted_bytes_per_s": promo,
                     "demoted_bytes_per_s": demo})
    return {"schema": SCHEMA, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "interval_s": dt,
            "heat_bands": procs["heat_bands"], "processes": rows,
            "managed_bytes_by_tier": status["managed_bytes_by_tier"],
            "ticks": status["ticks"], "mover": status["mover"],
            "signal": (status.get("signal") or {}).get("mechanism")}


def rate(v: float | None) -> str:
    return "-" if v is None else human_bytes(v) + "/s"


def band_columns(bands: list[str]) -> list[str]:
    """The daemon's band names (">=0.8", ">=0.5", ">=0.2", "<0.2", hottest first) as column headers
    that say each band's range: HEAT>=0.8, HEAT0.5-0.8, HEAT0.2-0.5, HEAT<0.2."""
    out = []
    for i, b in enumerate(bands):
        upper = bands[i - 1][2:] if i > 0 and bands[i - 1].startswith(">=") else None
        if b.startswith(">=") and upper is not None:
            out.append(f"HEAT{b[2:]}-{upper}")
        else:
            out.append(f"HEAT{b}")
    return out


LEGEND = ("HEAT: bytes of blocks by heat (HEATa-b: a <= heat < b); heat is in [0, 1], no unit: "
          "1 = just read, often, near the decode position, shared")


def render(doc: dict) -> str:
    t = doc["ticks"]
    by_tier = doc["managed_bytes_by_tier"]
    n = len(doc["processes"])
    head = (f"tieringd top - {doc['time'][11:19]}  {n} process{'' if n == 1 else 'es'}, signal {doc['signal']}, "
            f"tick p50 {t['p50_ms']:.1f} ms p99 {t['p99_ms']:.1f} ms, mover {doc['mover']['pending_jobs']} "
            f"pending\nmanaged: " + ", ".join(f"{k} {human_bytes(by_tier.get(k, 0))}" for k in TIERS)
            + "\n" + LEGEND)
    bands = doc["heat_bands"]
    rows = []
    for p in sorted(doc["processes"], key=lambda p: -p["bytes_by_tier"].get("dram", 0)):
        total = sum(p["bytes_by_tier"].values()) or 1
        rows.append([p["pid"], (p["comm"] or "?")[:15], p["regions"],
                     *(human_bytes(p["bytes_by_tier"].get(k, 0)) for k in TIERS),
                     f"{100 * p['bytes_by_tier'].get('dram', 0) / total:.0f}%",
                     *(human_bytes(b) for b in p["heat"]["bytes"]),
                     shared_text(p.get("shared_blocks", 0), p.get("max_sharers", 0)),
                     rate(p["moved_bytes_per_s"])])
    headers = ["PID", "COMMAND", "REGIONS", "DRAM", "CXL-DRAM", "PMEM", "FAST%",
               *band_columns(bands), "SHARED", "MOVED/s"]
    return head + "\n\n" + table(headers, rows, right=set(range(2, len(headers))))


@click.command("top")
@click.option("-d", "--delay", "delay_s", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              help="seconds between frames")
@click.option("-n", "--iterations", type=click.IntRange(min=1), default=None,
              help="frames to show, then exit (default: until Ctrl-C; 1 with --json)")
@click.option("-p", "--pid", "pids", type=int, multiple=True, help="only these processes (repeatable)")
@click.option("-b", "--batch", is_flag=True, help="plain frames one after another (automatic when not a terminal)")
@click.option("--json", "as_json", is_flag=True, help=f"one {SCHEMA} document per frame")
@click.option("--run-dir", type=click.Path(file_okay=False), help=RUN_DIR_OPTION_HELP)
def command(delay_s: float, iterations: int | None, pids: tuple[int, ...], batch: bool, as_json: bool,
            run_dir: str | None) -> None:
    """Per process: bytes per tier, heat of its blocks, bytes moved per second."""
    import json
    if iterations is None and as_json:
        iterations = 1
    interactive = not batch and not as_json and sys.stdout.isatty()
    before, t_before = None, None
    with daemon_client(run_dir) as c:
        try:
            for i in itertools.count():
                now = time.monotonic()
                procs, status = ask(c, "processes"), ask(c, "status")
                doc = frame(procs, status, before, None if t_before is None else now - t_before, pids)
                before, t_before = procs, now
                if as_json:
                    click.echo(json.dumps(doc))
                else:
                    click.echo((CLEAR if interactive else ("\n" if i else "")) + render(doc))
                if iterations is not None and i + 1 >= iterations:
                    return
                time.sleep(delay_s)
        except KeyboardInterrupt:
            return
