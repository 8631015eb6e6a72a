# SPDX-License-Identifier: Apache-2.0
"""`make install` / `make uninstall` into a temporary prefix, and the unit as systemd reads it
(`systemd-analyze verify` on the installed unit, whose ExecStart then exists)."""
import os
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.root


def make(repo, target: str, prefix) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", target, f"PREFIX={prefix}",
                           f"SYSCONFDIR={prefix}/etc", "TIERINGD_GROUP=", f"UDEV_RULES_DIR={prefix}/udev"],
                          cwd=repo, capture_output=True, text=True, timeout=900)


CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "TIERINGD_CONFIG")}


def files(root) -> set[str]:
    out = set()
    for d, _, names in os.walk(root):
        if "/lib/tieringd/venv" in d:
            continue
        out |= {os.path.relpath(os.path.join(d, n), root) for n in names}
    return out


def test_install_puts_everything_in_place_and_uninstall_takes_it_away(repo, tmp_path):
    prefix = tmp_path / "prefix"
    build_rules = repo / "build/udev/60-tieringd.rules"
    rules_before = build_rules.read_text()
    r = make(repo, "install", prefix)
    assert r.returncode == 0, r.stdout + r.stderr
    # the checkout's own rule (its venv's Python, what the lab installs) is not the installed one's
    assert build_rules.read_text() == rules_before
    if shutil.which("udevadm"):
        assert f'RUN+="{prefix}/lib/tieringd/venv/bin/python -m' in (prefix / "udev/60-tieringd.rules").read_text()
    got = files(prefix)
    for f in ("bin/tieringd", "bin/tieringctl", "lib/tieringd/libtieringd-shim.so",
              "lib/tieringd/bpf/pagefault.bpf.o", "lib/systemd/system/tieringd.service",
              "etc/tieringd/tieringd.toml", "share/tieringd/tieringd.toml",
              "share/bash-completion/completions/tieringctl", "share/doc/tieringd/service.md"):
        assert f in got, f"{f} not installed; {sorted(got)}"
    unit = (prefix / "lib/systemd/system/tieringd.service").read_text()
    assert f"ExecStart={prefix}/bin/tieringd --config {prefix}/etc/tieringd/tieringd.toml" in unit
    # the installed programs run from their own venv, not from this checkout
    out = subprocess.run([prefix / "bin/tieringd", "--check-config", prefix / "etc/tieringd/tieringd.toml"],
                         capture_output=True, text=True, cwd=tmp_path, env=CLEAN_ENV)
    assert out.returncode == 0 and out.stdout.endswith(": ok (topology, shim, sampling, heat, sharing, "
                                                       "policy, prefetch, blocksize, mover, control, metrics, "
                                                       "lifecycle, hotplug, dax, pool: given; the rest default)\n"), out
    loc = subprocess.run([prefix / "lib/tieringd/venv/bin/python", "-c", "import tieringd; print(tieringd.__file__)"],
                         capture_output=True, text=True, cwd=tmp_path, env=CLEAN_ENV).stdout
    assert loc.startswith(str(prefix / "lib/tieringd/venv/")), loc
    # under any PREFIX the installed package finds its own BPF objects and shim
    where = subprocess.run([prefix / "lib/tieringd/venv/bin/python", "-c",
                            "from tieringd.sampling.base import bpf_object_path; from tieringd.cli.run import find_shim; "
                            "print(bpf_object_path('pagefault')); print(find_shim(None))"],
                           capture_output=True, text=True, cwd=tmp_path, env=CLEAN_ENV)
    assert where.stdout.split() == [str(prefix / "lib/tieringd/bpf/pagefault.bpf.o"),
                                    str(prefix / "lib/tieringd/libtieringd-shim.so")], where
    if shutil.which("systemd-analyze"):
        v = subprocess.run(["systemd-analyze", "verify", prefix / "lib/systemd/system/tieringd.service"],
                           capture_output=True, text=True)
        assert v.returncode == 0 and v.stderr == "", v.stderr
    # a second install keeps a changed configuration; uninstall keeps it too, and removes the rest
    conf = prefix / "etc/tieringd/tieringd.toml"
    conf.write_text("[mover]\nworkers = 1\n")
    assert make(repo, "install", prefix).returncode == 0
    assert conf.read_text() == "[mover]\nworkers = 1\n"
    r = make(repo, "uninstall", prefix)
    assert r.returncode == 0 and "KEEP" in r.stdout
    assert files(prefix) == {"etc/tieringd/tieringd.toml"}
    conf.unlink()
    assert make(repo, "install", prefix).returncode == 0
    assert make(repo, "uninstall", prefix).returncode == 0
    assert files(prefix) == set()


def test_the_shipped_unit_verifies(repo, tmp_path):
    """The unit as shipped (paths pointed at a stand-in executable: verify wants ExecStart to exist)."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    (tmp_path / "bin").mkdir()
    exe = tmp_path / "bin/tieringd"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    unit = (repo / "systemd/tieringd.service").read_text().replace("/usr/local", str(tmp_path))
    (tmp_path / "tieringd.service").write_text(unit)
    v = subprocess.run(["systemd-analyze", "verify", tmp_path / "tieringd.service"], capture_output=True, text=True)
    assert v.returncode == 0 and v.stderr == "", v.stderr
    for line in ("Type=notify", "RuntimeDirectory=tieringd", "RuntimeDirectoryPreserve=yes", "WatchdogSec=",
                 "NoNewPrivileges=yes", "ExecReload=/bin/kill -HUP $MAINPID"):
        assert line in unit
    caps = next(l for l in unit.splitlines() if l.startswith("CapabilityBoundingSet=")).split("=", 1)[1].split()
    assert set(caps) == {"CAP_SYS_ADMIN", "CAP_BPF", "CAP_PERFMON", "CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH",
                         "CAP_SYS_NICE", "CAP_NET_ADMIN"}
    for cap in caps:        # each one is explained in the unit
        assert f"# - {cap}" in unit or f", {cap}:" in unit or f"- CAP_BPF, CAP_PERFMON:" in unit
