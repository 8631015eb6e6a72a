# SPDX-License-Identifier: Apache-2.0
"""DAMON's sysfs interface (``/sys/kernel/mm/damon/admin``, CONFIG_DAMON_SYSFS, 5.18+): where its files
are and what a write to each does — kernel knowledge only, apart from the sampler that decides what
to monitor (:class:`tieringd.sampling.accessed.DamonSampler`), as damo keeps ``_damon_sysfs.py`` apart
from its commands. Every access goes through :mod:`tieringd.kernel.sysfs`, so a captured tree can stand in
(tests/fixtures/damon/6.12).

Layout, one kdamond ``k``: ``kdamonds/k/state`` (on, off, commands), ``kdamonds/k/contexts/0/``
with ``operations``, ``monitoring_attrs/``, ``targets/0/`` (pid, fixed regions) and ``schemes/0/``.
Writes fail with the kernel's errno (``SysfsError``); nothing here turns them into a sampler's words.

Kernel facts relied on:
- writing ``nr_kdamonds`` removes and recreates *every* kdamond directory, and is refused while any
  kdamond runs (mm/damon/sysfs.c): so nothing is touched when anyone else has a kdamond (:func:`status`);
- ``fvaddr`` (fixed virtual ranges) since 6.0; ``contexts/0/avail_operations`` since 6.1 (before it,
  the only way to know an operation set is to write it);
- a ``stat`` scheme's ``tried_regions`` directory, filled by the ``update_schemes_tried_regions``
  state command, since 6.2;
- a scheme's access-pattern ranges start as [0, 0], which matches nothing.
"""
from __future__ import annotations

from tieringd.kernel import sysfs

ADMIN = "/sys/kernel/mm/damon/admin"
KDAMONDS = f"{ADMIN}/kdamonds"
OPERATIONS = ("vaddr", "fvaddr", "paddr")
_U32_MAX = (1 << 32) - 1
_U64_MAX = (1 << 64) - 1


def kdamond_dir(k: int) -> str:
    return f"{KDAMONDS}/{k}"


def _context(k: int) -> str:
    return f"{kdamond_dir(k)}/contexts/0"


def status() -> tuple[bool, str]:
    """(usable, why) for the DAMON sysfs interface, without changing anything."""
    if not sysfs.is_dir(ADMIN):
        return False, "DAMON sysfs interface absent (CONFIG_DAMON_SYSFS, kernel 5.18+)"
    nr = sysfs.read_int(f"{KDAMONDS}/nr_kdamonds", 0)
    if nr:
        running = [k for k in range(nr) if state(k) == "on"]
        return False, (f"DAMON is in use by another tool ({nr} kdamond(s) configured"
                       + (f", {len(running)} running" if running else "")
                       + "); changing nr_kdamonds would recreate their directories")
    return True, "DAMON sysfs available"


def operations() -> set[str]:
    """The monitoring operations this kernel's DAMON offers ({"vaddr", "fvaddr", "paddr"}).

    Asked through a short-lived, never-started kdamond directory — only call it when :func:`status`
    says DAMON is free; ``contexts/0/avail_operations`` (6.1+) or, before it, trying each."""
    try:
        set_nr_kdamonds(1)
        add_context(0)
        avail = sysfs.read_text(f"{_context(0)}/avail_operations", None)
        if avail is not None:
            return set(avail.split())
        ops = set()
        for op in OPERATIONS:
            try:
                set_operations(0, op)
                ops.add(op)
            except OSError:
                pass
        return ops
    finally:
        try:
            set_nr_kdamonds(0)
        except OSError:
            pass


def set_nr_kdamonds(n: int) -> None:
    sysfs.write_text(f"{KDAMONDS}/nr_kdamonds", n)


def state(k: int) -> str:
    """"on" or "off" ("off" when the kdamond's directory is gone)."""
    return sysfs.read_text(f"{kdamond_dir(k)}/state", "off")


def set_state(k: int, value: str) -> None:
    """``on``, ``off``, or a command (``update_schemes_tried_regions``)."""
    sysfs.write_text(f"{kdamond_dir(k)}/state", value)


def stop(k: int) -> None:
    if state(k) == "on":
        set_state(k, "off")


def add_context(k: int) -> None:
    sysfs.write_text(f"{kdamond_dir(k)}/contexts/nr_contexts", 1)


def set_operations(k: int, ops: str) -> None:
    """Fails (EINVAL) when the kernel lacks that operation set."""
    sysfs.write_text(f"{_context(k)}/operations", ops)


def set_monitoring_attrs(k: int, *, sample_us: int, aggr_us: int, update_us: int,
                         min_regions: int, max_regions: int) -> None:
    attrs = f"{_context(k)}/monitoring_attrs"
    sysfs.write_text(f"{attrs}/intervals/sample_us", sample_us)
    sysfs.write_text(f"{attrs}/intervals/aggr_us", aggr_us)
    sysfs.write_text(f"{attrs}/intervals/update_us", update_us)
    sysfs.write_text(f"{attrs}/nr_regions/max", max_regions)
    sysfs.write_text(f"{attrs}/nr_regions/min", min_regions)


def set_target(k: int, pid: int, regions: list[tuple[int, int]]) -> None:
    """One target process; ``regions`` [start, end) are fixed ranges (fvaddr), none for vaddr."""
    target = f"{_context(k)}/targets/0"
    sysfs.write_text(f"{_context(k)}/targets/nr_targets", 1)
    sysfs.write_text(f"{target}/pid_target", pid)
    if regions:
        sysfs.write_text(f"{target}/regions/nr_regions", len(regions))
        for j, (start, end) in enumerate(regions):
            sysfs.write_text(f"{target}/regions/{j}/start", start)
            sysfs.write_text(f"{target}/regions/{j}/end", end)


def add_stat_scheme(k: int) -> None:
    """A ``stat`` scheme (does nothing; records the regions it was tried on) matching every region."""
    scheme = f"{_context(k)}/schemes/0"
    sysfs.write_text(f"{_context(k)}/schemes/nr_schemes", 1)
    sysfs.write_text(f"{scheme}/action", "stat")
    for rng, hi in (("sz", _U64_MAX), ("nr_accesses", _U32_MAX), ("age", _U32_MAX)):
        sysfs.write_text(f"{scheme}/access_pattern/{rng}/min", 0)
        sysfs.write_text(f"{scheme}/access_pattern/{rng}/max", hi)


def tried_regions(k: int) -> list[tuple[int, int, int]]:
    """(start, end, nr_accesses) of the scheme's regions in the latest aggregation. Raises the write's
    error when the kernel has no ``update_schemes_tried_regions`` (before 6.2)."""
    set_state(k, "update_schemes_tried_regions")
    base = f"{_context(k)}/schemes/0/tried_regions"
    out = []
    for name in sysfs.listdir(base, []):
        if not name.isdigit():
            continue
        d = f"{base}/{name}"
        try:
            out.append((sysfs.read_int(f"{d}/start"), sysfs.read_int(f"{d}/end"),
                        sysfs.read_int(f"{d}/nr_accesses")))
        except OSError:
            continue          # a region the kernel replaced while we read
    return out
