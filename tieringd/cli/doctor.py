# SPDX-License-Identifier: Apache-2.0
"""``tieringctl doctor``: what this machine offers tieringd, and why not where it does not.

Kernel facilities (BTF, tracefs, tracepoints, uprobes), capabilities, libbpf, each access sampler
(loaded and attached once, then closed: the answer is the kernel's, not a guess), the accessed-bit
fallback (DAMON, idle page tracking), NUMA balancing and memory tiers. Exit status 0 when at least one
access source runs here, 1 otherwise.
"""
from __future__ import annotations

import click

from tieringd.cli._output import emit_json, table
from tieringd.sampling import features

SCHEMA = "tieringd.doctor/1"


def _sampler_checks() -> tuple[list[features.Check], str, bool]:
    """A check per probe, the verdict, and whether any access source (BPF or fallback) runs."""
    from tieringd.sampling import Kind, probe_samplers
    probes = probe_samplers()
    checks = [features.Check(p.name, p.ok, p.detail) for p in probes]
    # the registry's own entries decide; variants (the software PMU event) are shown, not counted
    plain = [p for p in probes if p.name == p.sampler]
    sources = [p for p in plain if p.kind is Kind.SOURCE]
    fallbacks = [p for p in plain if p.kind is Kind.FALLBACK]
    bpf = [p.name for p in sources if p.ok]
    fb = [p.name for p in fallbacks if p.ok]
    if bpf:
        verdict = "BPF sampling: " + ", ".join(bpf)
    elif fb:
        verdict = (f"BPF unavailable ({sources[0].detail}); the daemon falls back to the accessed-bit "
                   f"tracker: {fb[0]}")
    else:
        verdict = "no access source can run here: " + "; ".join(
            p.detail for p in [*sources[:1], *fallbacks])
    return checks, verdict, bool(bpf or fb)


def collect() -> dict:
    sections = {
        "kernel": features.kernel_checks(),
        "capabilities": features.capability_checks(),
        "bpf": [features.libbpf_check()],
    }
    samplers, verdict, usable = _sampler_checks()
    sections["samplers"] = samplers
    sections["numa"] = features.numa_checks()
    return {"sections": sections, "verdict": verdict, "usable": usable}


def _mark(ok) -> str:
    return {True: "ok", False: "NO", None: "-"}[ok]


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (schema tieringd.doctor/1).")
def command(as_json: bool) -> None:
    """Check kernel features, capabilities, BTF, tracefs, samplers, NUMA balancing, DAMON, tiers."""
    report = collect()
    if as_json:
        emit_json(SCHEMA, {"verdict": report["verdict"], "usable": report["usable"],
                           "sections": {k: [c.as_dict() for c in v]
                                        for k, v in report["sections"].items()}})
    else:
        for name, checks in report["sections"].items():
            click.echo(f"{name}:")
            click.echo("  " + table(["check", "", "detail"],
                                    [[c.name, _mark(c.ok), c.detail] for c in checks])
                       .replace("\n", "\n  "))
            click.echo()
        click.echo(report["verdict"])
    raise SystemExit(0 if report["usable"] else 1)
