# SPDX-License-Identifier: Apache-2.0
"""``tieringctl migrate``: move a range (or all) of a process's memory to a node or a tier, by hand —
with progress, then the counters per (source, target). ``--json``: schema ``tieringd.migrate/1``
(docs/json.md, docs/mover.md).

When the daemon runs, the move goes through it (its control socket): its engine carries it out, the
verified placement lands in its block table and its plan keeps off those ranges until the move is
done — a move made behind its back would be undone by the next plan. ``--local`` (or no daemon)
runs the same engine in this process, as before the daemon existed."""
from __future__ import annotations

import sys
import time

import click

from tieringd.kernel import procfs, sysfs, numa
from tieringd import mover
from tieringd.memory import topology
from tieringd.cli._output import emit_json, fail, human_bytes, table
from tieringd.config import ConfigError
from tieringd.contracts import FallbackMap, Priority, Tier
from tieringd.units import parse_size

SCHEMA = "tieringd.migrate/1"


def parse_range(text: str) -> tuple[int, int]:
    """"A-B" (end exclusive) or "A+LEN"; numbers in hex (0x…) or decimal, LEN may end in K/M/G."""
    t = text.strip().lower()
    try:
        if "+" in t:
            a, _, n = t.partition("+")
            start, length = int(a, 0), parse_size(n)
        else:
            a, sep, b = t.partition("-")
            if not sep:
                raise ValueError
            start, length = int(a, 0), int(b, 0) - int(a, 0)
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected START-END or START+LENGTH "
                                 "(e.g. 0x7f0000000000-0x7f0010000000 or 0x7f0000000000+256M)") from None
    if start < 0 or length <= 0:
        raise click.BadParameter(f"{text!r}: the range is empty or negative")
    return start, length


def process_ranges(pid: int) -> list[tuple[int, int]]:
    """Every mapping of ``pid`` except those without struct pages ([vdso], [vvar], [vsyscall],
    [uprobes]), as migratepages moves them."""
    return [(vma.start, vma.length) for vma in procfs.read_maps(pid) if not vma.no_struct_pages]


def parse_target(text: str) -> int | Tier:
    t = text.strip()
    if t.isdigit():
        node = int(t)
        if node not in numa.memory_nodes():
            raise click.BadParameter(f"node {node} does not exist or has no memory (nodes with memory: "
                                     f"{numa.format_nodes(numa.memory_nodes())})")
        return node
    try:
        return Tier.parse(t)
    except ValueError as e:
        raise click.BadParameter(f"{e}; or a node id") from None


def fallback_map() -> FallbackMap:
    """Where the engine may go when the target is full, from this machine's topology; a topology
    that cannot be read means no fallbacks (a move to an explicit node does not need one)."""
    try:
        return topology.discover().fallback_map()
    except (ConfigError, sysfs.SysfsError) as e:
        click.echo(f"tieringctl: no topology, so no fallback nodes: {e}", err=True)
        return FallbackMap()


def render(report: dict) -> str:
    """The table of a ``Report.to_dict()`` (the local engine's, or the daemon's answer)."""
    ps = report["counters"]["page_size"]
    rows = []
    for c in report["counters"]["pairs"]:
        failed = ", ".join(f"{k} {v}" for k, v in sorted(c["failed_pages"].items())) or "-"
        rows.append(["-" if c["source"] < 0 else c["source"], c["target"], c["requested_pages"],
                     c["moved_pages"], human_bytes(c["moved_pages"] * ps), c["already_pages"],
                     c["landed_elsewhere_pages"], c["fallback_pages"], failed])
    out = [table(["source", "target", "requested", "moved", "moved bytes", "already", "elsewhere",
                  "fallback", "failed (pages)"], rows, right={2, 3, 4, 5, 6, 7})]
    out.append("")
    out.append(f"pid {report['pid']} -> node {report['target']}: {report['requested_pages']} pages requested; "
               + ", ".join(f"{k} {v}" for k, v in report["by_reason"].items()))
    thp = report["counters"]["thp_pages_moved"]
    if thp:
        out.append(f"transparent huge pages moved: {thp // numa.HPAGE_PMD_NR} ({thp} base pages)")
    for reason, addrs in report["samples"].items():
        out.append(f"{reason}: e.g. " + " ".join(addrs))
    if report["process_exited"]:
        out.append(f"process {report['pid']} exited during the move")
    if report["error"]:
        out.append(f"error: {report['error']}")
    return "\n".join(out)


def moved_pages(report: dict) -> int:
    return sum(c["moved_pages"] for c in report["counters"]["pairs"])


def through_daemon(run_dir: str | None, pid: int, ranges: tuple[str, ...], spans, to: str,
                   priority: str, rate_mb_s: float | None, quiet: bool) -> dict | None:
    """The daemon's answer to the move, or None when no daemon runs (the caller moves locally)."""
    from tieringd.service.control import Client, ControlError, DaemonNotRunning
    try:
        client = Client(run_dir, timeout_s=None)
    except DaemonNotRunning:
        return None
    if rate_mb_s is not None:
        client.close()
        fail("--rate is for a move in this process; the daemon moves at its [mover] rates "
             "(tieringctl policy set mover.promote_rate_mb_s=…), or add --local")
    params = {"pid": pid, "to": int(to) if to.strip().isdigit() else to.strip(), "priority": priority}
    params.update({"ranges": [[a, n] for a, n in spans]} if ranges else {"all": True})
    if not quiet:
        click.echo(f"  through the daemon ({client.path}); waiting for the move to finish", err=True)
    with client:
        try:
            return client.request("migrate", **params)
        except ControlError as e:
            fail(f"the daemon refused the move: {e.message}", error_code=e.code)
    raise AssertionError("unreachable")


@click.command("migrate")
@click.option("--pid", type=int, required=True, help="process whose memory moves")
@click.option("--range", "ranges", multiple=True, metavar="A-B",
              help="address range START-END or START+LENGTH (repeatable)")
@click.option("--all", "all_", is_flag=True, help="every mapping of the process")
@click.option("--to", "to", required=True, metavar="NODE|TIER", help="node id, or tier: dram, cxl-dram, pmem")
@click.option("--rate", "rate_mb_s", type=click.FloatRange(min=0, min_open=True), default=None,
              help="bandwidth budget in MB/s (default: unlimited)")
@click.option("--batch-pages", type=click.IntRange(min=1, max=1 << 20), default=4096, show_default=True,
              help="pages per move_pages call (a local move's; the daemon uses its [mover] batch_pages)")
@click.option("--priority", type=click.Choice(["promote", "prefetch", "demote"]), default="demote",
              show_default=True, help="which budget and queue position the move takes")
@click.option("--json", "as_json", is_flag=True, help=f"machine-readable output ({SCHEMA})")
@click.option("--quiet", "-q", is_flag=True, help="no progress lines")
@click.option("--local", is_flag=True, help="move in this process even when the daemon runs")
@click.option("--run-dir", type=click.Path(file_okay=False),
              help="the daemon's run directory (default $TIERINGD_RUN_DIR or /run/tieringd)")
def command(pid: int, ranges: tuple[str, ...], all_: bool, to: str, rate_mb_s: float | None,
            batch_pages: int, priority: str, as_json: bool, quiet: bool, local: bool,
            run_dir: str | None) -> None:
    """Move memory of process PID to a node or tier — through the daemon when it runs (--local: in
    this process). Another user's process needs root (CAP_SYS_PTRACE since Linux 4.13). Every
    page's node is verified afterwards; pages that could not move are counted by reason (target
    full, pinned, shared, not present ...)."""
    if bool(ranges) == all_:
        fail("give either --range A-B (one or more) or --all")
    if not procfs.alive(pid):
        fail(f"no process {pid}")
    try:
        target = parse_target(to)
        spans = [parse_range(r) for r in ranges] if ranges else process_ranges(pid)
    except click.BadParameter as e:
        fail(e.message)
    except sysfs.SysfsError as e:
        fail(str(e))
    if not local:
        t0 = time.monotonic()
        answer = through_daemon(run_dir, pid, ranges, spans, to, priority, rate_mb_s, quiet or as_json)
        if answer is not None:
            show(answer["report"], answer["request"], time.monotonic() - t0, as_json)
            return
    prio = Priority[priority.upper()]
    last = [0.0]

    def progress(rep: mover.Report) -> None:
        now = time.monotonic()
        if quiet or now - last[0] < 0.5:
            return
        last[0] = now
        by = rep.by_reason()
        done = sum(by.values())
        click.echo(f"  {done}/{rep.requested_pages} pages, {human_bytes(rep.moved_pages * numa.PAGE_SIZE)} "
                   f"moved", err=True)

    config = mover.MoverConfig(batch_pages=batch_pages, promote_rate_mb_s=rate_mb_s or 0,
                               demote_rate_mb_s=rate_mb_s or 0, workers=1)
    engine = mover.MigrationEngine(config, fallback_map(), on_progress=progress)
    t0 = time.monotonic()
    ticket = engine.submit(mover.MoveRequest(pid, spans, target, prio))
    engine.run_until_idle()
    report = ticket.wait(0)
    elapsed = time.monotonic() - t0
    show(report.to_dict(), {"pid": pid, "ranges": [[hex(a), n] for a, n in spans], "to": to,
                            "rate_mb_s": rate_mb_s, "batch_pages": batch_pages, "priority": priority,
                            "via": "local"}, elapsed, as_json)


def summary_line(moved_bytes: int, elapsed_s: float, by_daemon: bool) -> str:
    """The amount in binary units as the table shows it, the rate in MB/s as ``--rate`` and the
    ``*_rate_mb_s`` settings take it (both named, so the two never read as one unit)."""
    line = f"{human_bytes(moved_bytes)} moved in {elapsed_s:.2f} s"
    if elapsed_s > 0 and moved_bytes:
        line += f" ({moved_bytes / 1e6 / elapsed_s:.1f} MB/s)"
    return line + (" by the daemon" if by_daemon else "")


def show(report: dict, request: dict, elapsed: float, as_json: bool) -> None:
    if as_json:
        emit_json(SCHEMA, {"request": request, "elapsed_s": round(elapsed, 6), "report": report})
    else:
        click.echo(render(report))
        click.echo(summary_line(moved_pages(report) * report["counters"]["page_size"], elapsed,
                                request.get("via") == "daemon"))
    if report["error"]:
        sys.exit(1)
