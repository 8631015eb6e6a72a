# SPDX-License-Identifier: Apache-2.0
"""``tieringctl``: one click module per subcommand, registered in SUBCOMMANDS.

Each module in this package named below exposes ``command`` (a ``click.Command``). The reports of
the running daemon (status, top, regions, heatmap, stats, policy) talk to it over its control socket
(tieringd/service/control.py); the others need no daemon. Shell completion is click's:
``eval "$(_TIERINGCTL_COMPLETE=bash_source tieringctl)"`` (docs/service.md).
"""
from __future__ import annotations

import importlib

import click

from tieringd import __version__

# Module names under tieringd.cli; each module's ``command`` has the module's name. ``--help`` lists
# them sorted (click's order).
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
    "pool",
]


class LazyGroup(click.Group):
    """A group that imports a subcommand's module only when that subcommand is looked up (click's
    documented lazy-loading pattern): ``tieringctl status`` loads the control client, not the
    simulator, the samplers and topology discovery. All of them at once cost 0.25 s of imports on
    the build machine and several seconds in a TCG lab guest, paid by every invocation."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in SUBCOMMANDS:
            return None
        return importlib.import_module(f"{__name__}.{name}").command

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["tieringctl.argv"] = list(args)
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context):
        """A usage error of a subcommand run with ``--json`` is also a ``tieringd.error/1`` document
        on stdout (tieringd/cli/_output.py); click then prints its usual message and exits 2."""
        try:
            return super().invoke(ctx)
        except click.ClickException as e:
            from tieringd.cli._output import emit_usage_error
            emit_usage_error(e, ctx.meta.get("tieringctl.argv", []))
            raise


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="tieringctl")
def main() -> None:
    """Report and steer tiered memory (DRAM, CXL DRAM, PMem) for LLM KV caches."""
