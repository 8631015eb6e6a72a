# SPDX-License-Identifier: Apache-2.0
"""``tieringctl``: one click module per subcommand, registered in SUBCOMMANDS.

Each module in this package named below exposes ``command`` (a ``click.Command``). The reports of
the running daemon (status, top, regions, heatmap, stats, policy) talk to it over its control socket
(tieringd/control.py); the others need no daemon. Shell completion is click's:
``eval "$(_TIERINGCTL_COMPLETE=bash_source tieringctl)"`` (docs/service.md).
"""
from __future__ import annotations

import importlib

import click

from tieringd import __version__

# Module names under tieringd.cli, in the order ``--help`` lists them.
SUBCOMMANDS = [
    "numa",
    "tiers",
    "probe",
    "doctor",
    "sample",
    "run",
    "migrate",
    "simulate",
    "status",
    "top",
    "regions",
    "heatmap",
    "stats",
    "policy",
    "tune",
    "dax",
]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="tieringctl")
def main() -> None:
    """Report and steer tiered memory (DRAM, CXL DRAM, PMem) for LLM KV caches."""


for _name in SUBCOMMANDS:
    main.add_command(importlib.import_module(f"{__name__}.{_name}").command)
