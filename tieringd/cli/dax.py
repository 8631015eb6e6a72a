# SPDX-License-Identifier: Apache-2.0
"""``tieringctl dax list|online|offline DEV``: DAX devices as system RAM (docs/dax.md).

``online`` binds a devdax device to kmem and onlines its memory blocks (ZONE_MOVABLE unless
``--zone``), handling the kernel's auto-online policy; ``offline`` first moves the pages of its node
to other nodes through the mover, then offlines the blocks, and refuses with the reason when it
cannot. ``hotplug`` is what the udev rules run (udev/60-tieringd.rules). ``--json``: schema
``tieringd.dax/1`` (docs/json.md)."""
from __future__ import annotations

import os

import click

from tieringd.kernel import sysfs
from tieringd.memory import dax, hotplug
from tieringd.cli._output import emit_json, fail, human_bytes, table
from tieringd.config import ConfigError, load

SCHEMA = "tieringd.dax/1"


def _render(devs: list[dax.DaxDeviceState]) -> str:
    if not devs:
        return "no dax devices"
    rows = []
    for d in devs:
        online = [b for b in d.blocks if b.state == "online"]
        zones = sorted({b.zone for b in online if b.zone})
        rows.append([d.name, human_bytes(d.size_bytes), d.mode, d.origin, d.parent or "-",
                     "-" if d.target_node is None else d.target_node,
                     f"{len(online)}/{len(d.blocks)}" if d.blocks else "-", ",".join(zones) or "-"])
    return table(["dev", "size", "mode", "origin", "on", "node", "blocks online", "zone"], rows, right={1, 5})


@click.group("dax")
def command() -> None:
    """DAX devices as system RAM: list, online (kmem, movable), offline (pages moved away first)."""


def _need_root(what: str) -> None:
    """Onlining and offlining memory writes sysfs files only root may write: say so before touching
    anything, rather than half-way through with the kernel's EACCES."""
    if os.geteuid() != 0:
        fail(f"dax {what} needs root: it changes which memory the whole machine uses (this is uid "
             f"{os.geteuid()})", error_code="forbidden")


@command.command("list")
@click.option("--json", "as_json", is_flag=True, help=f"machine-readable output (schema {SCHEMA})")
def list_cmd(as_json: bool) -> None:
    """Every dax device, its mode and the state of its memory blocks."""
    try:
        devs = dax.devices()
    except (sysfs.SysfsError, ConfigError) as e:
        fail(str(e))
    if as_json:
        emit_json(SCHEMA, {"devices": [d.to_dict() for d in devs]})
    else:
        click.echo(_render(devs))


@command.command("online")
@click.argument("dev")
@click.option("--zone", type=click.Choice(sorted(dax.ZONES)), default="movable", show_default=True,
              help="movable: the memory can be offlined again; normal: kernel allocations may use it")
@click.option("--json", "as_json", is_flag=True, help=f"machine-readable output (schema {SCHEMA})")
def online_cmd(dev: str, zone: str, as_json: bool) -> None:
    """Bind DEV to kmem and online its memory."""
    _need_root("online")
    try:
        rep = dax.online(dev, zone)
    except (dax.DaxError, sysfs.SysfsError) as e:
        fail(str(e))
    if as_json:
        emit_json(SCHEMA, {"online": rep.to_dict()})
        return
    click.echo(f"{dev}: node {rep.node}, {len(rep.onlined)} blocks onlined ({zone}), "
               f"{len(rep.already)} already online" + (", kmem bound" if rep.bound else ""))
    if rep.failed:
        fail("; ".join(f"memory{k}: {v}" for k, v in sorted(rep.failed.items())))


@command.command("offline")
@click.argument("dev")
@click.option("--timeout-s", type=float, default=60.0, show_default=True,
              help="give up on a memory block that does not go offline in this time")
@click.option("--release", is_flag=True, help="then hand the device back to device_dax (devdax mode)")
@click.option("--json", "as_json", is_flag=True, help=f"machine-readable output (schema {SCHEMA})")
def offline_cmd(dev: str, timeout_s: float, release: bool, as_json: bool) -> None:
    """Move the pages of DEV's node away (through the mover), then offline its memory blocks."""
    _need_root("offline")
    try:
        rep = dax.offline(dev, timeout_s=timeout_s, release=release)
    except (dax.DaxError, sysfs.SysfsError) as e:
        fail(str(e))
    if as_json:
        emit_json(SCHEMA, {"offline": rep.to_dict()})
        return
    left = ", ".join(f"{n} {k}" for k, n in rep.left_pages.items())
    click.echo(f"{dev}: node {rep.node} offline; {rep.moved_pages} pages of {rep.processes} processes moved "
               f"to nodes {sysfs.format_list(rep.targets)}" + (f" (left to the kernel: {left})" if left else "")
               + f"; {len(rep.offlined)} blocks offlined" + (", device back to devdax" if rep.released else ""))


@command.command("hotplug", hidden=True)
@click.argument("kind", type=click.Choice(["dax", "memory", "cxl"]))
@click.argument("name")
def hotplug_cmd(kind: str, name: str) -> None:
    """The [hotplug] policy for a new dax device, memory block or CXL region (what udev runs)."""
    try:
        cfg = load()
    except ConfigError as e:
        fail(str(e))
    raise SystemExit(hotplug.udev_event(kind, name, cfg))
