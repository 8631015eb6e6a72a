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
ACCESS_SOURCES = ("fault", "pmu", "dma", "damon", "idle-page")


def _libbpf_check() -> features.Check:
    from tieringd.sampling import _libbpf
    try:
        info = _libbpf.library_info()
    except OSError as e:
        return features.Check("libbpf", False, str(e).splitlines()[0])
    return features.Check("libbpf", True, f"{info['library']}" +
                          (f" (version {info['version']})" if "version" in info else ""))


def _sampler_checks() -> tuple[list[features.Check], str]:
    from tieringd.sampling import probe_samplers
    probes = probe_samplers()
    checks = [features.Check(name, ok, why) for name, (ok, why) in probes.items()]
    bpf = [n for n in ("fault", "pmu", "dma") if probes.get(n, (False,))[0]]
    fb = [n for n in ("damon", "idle-page") if probes.get(n, (False,))[0]]
    if bpf:
        verdict = "BPF sampling: " + ", ".join(bpf)
    elif fb:
        why = probes["fault"][1]
        verdict = f"BPF unavailable ({why}); the daemon falls back to the accessed-bit tracker: {fb[0]}"
    else:
        verdict = "no access source can run here: " + "; ".join(
            probes[n][1] for n in ("fault", "damon", "idle-page") if n in probes)
    return checks, verdict


def collect() -> dict:
    sections = {
        "kernel": features.kernel_checks(),
        "capabilities": features.capability_checks(),
        "bpf": [_libbpf_check()],
    }
    samplers, verdict = _sampler_checks()
    sections["samplers"] = samplers
    sections["numa"] = features.numa_checks()
    usable = any(c.ok for c in samplers if c.name in ACCESS_SOURCES)
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
