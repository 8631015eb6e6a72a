# SPDX-License-Identifier: Apache-2.0
"""``tieringctl heatmap --pid P``: the heat of every block of a process over time, as the daemon
computed it each tick, where each block was and how many sharers it has — in the terminal (one row
per sample, blocks across) and as a picture (``--png FILE``: heat above, node below, time along x).

Samples the daemon's ``heat`` request every ``--interval`` seconds for ``--seconds``. ``--json``:
``tieringd.heatmap/1`` (docs/json.md)."""
from __future__ import annotations

import json
import shutil
import sys
import time

import click
import numpy as np

from tieringd.cli._output import RUN_DIR_OPTION_HELP, ask, daemon_client, fail, human_bytes, need_matplotlib

SCHEMA = "tieringd.heatmap/1"
SHADES = " .:-=+*#%@"           # heat 0 → 1


def sample(client, pid: int) -> dict:
    """Every block of ``pid`` (paging through the daemon's bound on blocks per reply)."""
    offset, parts = 0, []
    while True:
        doc = ask(client, "heat", pid=pid, offset=offset)
        parts.append(doc)
        offset += doc["count"]
        if not doc["truncated"] or doc["count"] == 0:
            break
    merged = {k: [v for p in parts for v in p["blocks"][k]] for k in parts[0]["blocks"]}
    return {"blocks": merged, "blocks_total": parts[0]["blocks_total"]}


class Series:
    """Samples in time; blocks keyed by address (a region that appears later adds columns)."""

    def __init__(self) -> None:
        self.times_s: list[float] = []
        self.columns: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.sharers: dict[int, int] = {}       # as of the latest sample
        self.rows: list[tuple[dict[int, float], dict[int, int]]] = []

    def add(self, t_s: float, blocks: dict) -> None:
        heat, node = {}, {}
        sharers = blocks.get("sharers") or [1] * len(blocks["address"])     # a daemon before sharers
        for a, h, n, s, k in zip(blocks["address"], blocks["heat"], blocks["node"], blocks["size_bytes"],
                                 sharers):
            col = self.columns.setdefault(a, len(self.columns))
            self.sizes[a] = s
            self.sharers[a] = k
            heat[col], node[col] = h, n
        self.times_s.append(t_s)
        self.rows.append((heat, node))

    def matrices(self) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """(heat, node) as time × blocks in address order; NaN / -2 where a block did not exist."""
        order = sorted(self.columns, key=int)
        idx = [self.columns[a] for a in order]
        heat = np.full((len(self.rows), len(order)), np.nan)
        node = np.full((len(self.rows), len(order)), -2, np.int64)
        pos = {c: i for i, c in enumerate(idx)}
        for r, (h, n) in enumerate(self.rows):
            for c, v in h.items():
                heat[r, pos[c]] = v
            for c, v in n.items():
                node[r, pos[c]] = v
        return heat, node, order


def downsample(row: np.ndarray, width: int, how) -> np.ndarray:
    if len(row) <= width:
        return row
    edges = np.linspace(0, len(row), width + 1).astype(int)
    return np.array([how(row[a:b]) for a, b in zip(edges, edges[1:])])


def render_terminal(series: Series, width: int) -> str:
    heat, node, order = series.matrices()
    if heat.size == 0:
        return "no blocks"
    cols = min(width, heat.shape[1])
    lines = [f"heat (' ' cold … '@' hot), {heat.shape[1]} blocks" +
             (f" in {cols} columns (hottest of each)" if cols < heat.shape[1] else "") + "; time down"]
    fast = np.nanmin(node[node >= 0]) if (node >= 0).any() else 0
    for t, h, n in zip(series.times_s, heat, node):
        h = downsample(np.nan_to_num(h, nan=0.0), cols, np.max)
        levels = np.clip((h * (len(SHADES) - 1)).round().astype(int), 0, len(SHADES) - 1)
        on_fast = np.mean(n[n >= 0] == fast) if (n >= 0).any() else float("nan")
        lines.append(f"{t:6.1f}s |" + "".join(SHADES[i] for i in levels) + f"| fast {on_fast:4.0%}")
    lines.append(f"placement at the end (█ node {fast}, ░ other nodes, · no page):")
    n = node[-1]
    cells = downsample(n, cols, lambda x: fast if (x == fast).mean() >= 0.5 else
                       (-1 if (x < 0).all() else fast + 1))
    lines.append("        |" + "".join("█" if c == fast else "·" if c < 0 else "░" for c in cells) + "|")
    shared = np.array([series.sharers.get(a, 1) for a in order])
    if (shared > 1).any():
        lines.append(f"sharers at the end ({int((shared > 1).sum())} shared blocks, at most "
                     f"{int(shared.max())}; ' ' one, 2-9, + ten or more):")
        most = downsample(shared, cols, np.max)
        lines.append("        |" + "".join(" " if k <= 1 else str(k) if k < 10 else "+" for k in most) + "|")
    return "\n".join(lines)


def write_png(series: Series, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    heat, node, order = series.matrices()
    t = np.asarray(series.times_s)
    extent = [t[0] if len(t) else 0, t[-1] if len(t) > 1 else 1, len(order), 0]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 8), sharex=True, constrained_layout=True)
    im = ax1.imshow(heat.T, aspect="auto", interpolation="nearest", cmap="inferno", vmin=0, vmax=1,
                    extent=extent)
    ax1.set_ylabel("block (address order)")
    ax1.set_title(f"{title}: heat per block")
    fig.colorbar(im, ax=ax1, label="heat")
    nodes = sorted({int(v) for v in np.unique(node) if v >= 0})
    lut = {-2: 0, -1: 1, **{n: 2 + i for i, n in enumerate(nodes)}}
    coded = np.vectorize(lambda v: lut.get(int(v), 1))(node) if node.size else node
    palette = ["#ffffff", "#bbbbbb", "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd"][:2 + len(nodes)]
    im2 = ax2.imshow(coded.T, aspect="auto", interpolation="nearest", cmap=ListedColormap(palette),
                     vmin=-0.5, vmax=len(palette) - 0.5, extent=extent)
    cb = fig.colorbar(im2, ax=ax2, ticks=range(len(palette)))
    cb.ax.set_yticklabels(["absent", "no page"] + [f"node {n}" for n in nodes])
    ax2.set_ylabel("block (address order)")
    ax2.set_xlabel("time (s)")
    ax2.set_title("node of each block (as the mover verified)")
    fig.savefig(path, dpi=110)
    plt.close(fig)


@click.command("heatmap")
@click.option("--pid", type=click.IntRange(min=1), required=True, help="the process to show")
@click.option("--seconds", type=click.FloatRange(min=0), default=20.0, show_default=True,
              help="how long to sample")
@click.option("--interval", "interval_s", type=click.FloatRange(min=0.05), default=1.0, show_default=True,
              help="seconds between samples")
@click.option("--png", "png", type=click.Path(dir_okay=False), help="also write the picture here")
@click.option("--width", type=click.IntRange(min=10), default=None, help="terminal columns for blocks")
@click.option("--json", "as_json", is_flag=True, help=f"machine-readable output ({SCHEMA})")
@click.option("--run-dir", type=click.Path(file_okay=False), help=RUN_DIR_OPTION_HELP)
def command(pid: int, seconds: float, interval_s: float, png: str | None, width: int | None,
            as_json: bool, run_dir: str | None) -> None:
    """Heat of a process's blocks over time (terminal, --png, --json)."""
    if png:
        need_matplotlib("--png")
    series = Series()
    t0 = time.monotonic()
    with daemon_client(run_dir) as c:
        while True:
            s = sample(c, pid)
            series.add(round(time.monotonic() - t0, 3), s["blocks"])
            if not as_json and sys.stderr.isatty():
                click.echo(f"\r  {len(series.times_s)} samples, {s['blocks_total']} blocks", nl=False, err=True)
            if time.monotonic() - t0 + interval_s > seconds:
                break
            time.sleep(interval_s)
    if not as_json and sys.stderr.isatty():
        click.echo("", err=True)
    if not series.columns:
        fail(f"pid {pid} has no blocks in the daemon (is it running under `tieringctl run`? "
             f"`tieringctl regions` lists what is registered)")
    heat, node, order = series.matrices()
    if png:
        total = sum(series.sizes[a] for a in order)
        write_png(series, png, f"pid {pid}, {len(order)} blocks, {human_bytes(total)}")
    if as_json:
        click.echo(json.dumps({
            "schema": SCHEMA, "pid": pid, "interval_s": interval_s, "times_s": series.times_s,
            "blocks": {"address": order, "size_bytes": [series.sizes[a] for a in order],
                       "sharers": [series.sharers[a] for a in order]},
            "heat": [[None if np.isnan(v) else round(float(v), 4) for v in row] for row in heat],
            "node": [[int(v) if v > -2 else None for v in row] for row in node],
            "png": png}))
        return
    cols = width or max(10, shutil.get_terminal_size((100, 24)).columns - 20)
    click.echo(render_terminal(series, cols))
    if png:
        click.echo(f"picture: {png}")
