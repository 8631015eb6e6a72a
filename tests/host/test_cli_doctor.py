# SPDX-License-Identifier: Apache-2.0
"""``tieringctl doctor`` on this machine: which samplers load and attach, and, without the BPF
capabilities, why not and what the daemon falls back to."""
from __future__ import annotations

import json
import subprocess

import pytest

from sampling_support import cli

pytestmark = [pytest.mark.root, pytest.mark.bpf]


def test_doctor_reports_samplers():
    r = cli("doctor", "--json")
    doc = json.loads(r.stdout)
    assert doc["schema"] == "tieringd.doctor/1" and r.returncode == 0 and doc["usable"]
    samplers = {c["check"]: c for c in doc["sections"]["samplers"]}
    assert samplers["fault"]["ok"] and samplers["dma"]["ok"] and samplers["migrations"]["ok"]
    assert samplers["pmu (software page faults)"]["ok"]
    if not samplers["pmu"]["ok"]:
        assert "no data-address PMU" in samplers["pmu"]["detail"]
    assert doc["verdict"].startswith("BPF sampling: fault")
    kernel = {c["check"]: c for c in doc["sections"]["kernel"]}
    assert kernel["BTF"]["ok"] and kernel["tracefs"]["ok"]


def test_without_bpf_the_cli_says_why_and_falls_back_where_it_can():
    if subprocess.run(["setpriv", "--version"], capture_output=True).returncode != 0:
        pytest.skip("setpriv (util-linux) is not installed")
    r = cli("doctor", "--json", drop_caps=True)
    doc = json.loads(r.stdout)
    samplers = {c["check"]: c for c in doc["sections"]["samplers"]}
    assert not samplers["fault"]["ok"]
    assert "refused BPF" in samplers["fault"]["detail"] and "CAP_BPF" in samplers["fault"]["detail"]
    fallback = [n for n in ("damon", "idle-page") if samplers[n]["ok"]]
    if fallback:
        assert r.returncode == 0 and f"falls back to the accessed-bit tracker: {fallback[0]}" in doc["verdict"]
    else:     # this machine: CONFIG_DAMON_VADDR and CONFIG_IDLE_PAGE_TRACKING are off
        assert r.returncode == 1 and doc["verdict"].startswith("no access source can run here")
        assert "not built in" in samplers["damon"]["detail"] + samplers["idle-page"]["detail"]


def _kernel_checks_as(uid: int) -> dict:
    """features.kernel_checks() in a child that dropped to ``uid`` (the module is already imported, so
    the child needs no access to the interpreter or the checkout)."""
    import os
    from tieringd.sampling import features
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                         # the child: drop root, check, write, exit
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            checks = {c.name: c.as_dict() for c in features.kernel_checks()}
            os.write(w, json.dumps(checks).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    os.waitpid(pid, 0)
    return json.loads(text)


def test_non_root_doctor_says_tracefs_is_root_only_not_unmounted():
    from tieringd.sampling import features
    if features.tracefs_root() is None:
        pytest.skip("tracefs is not mounted on this machine")
    checks = _kernel_checks_as(65534)
    tracefs = checks["tracefs"]
    if tracefs["ok"]:
        pytest.skip("tracefs is mounted readable by everyone here (mode=)")
    assert "only root may read: run doctor as root" in tracefs["detail"], tracefs
    assert "not mounted" not in tracefs["detail"]
    assert checks["tracepoint exceptions/page_fault_user"]["detail"] == \
        "unknown (tracefs not readable by this user)"
