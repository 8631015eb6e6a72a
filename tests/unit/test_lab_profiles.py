# SPDX-License-Identifier: Apache-2.0
"""scripts/lab.py's machine descriptions (no guest is booted here)."""
from pathlib import Path

import pytest

from lab_workers import load_lab_module


@pytest.fixture(scope="module")
def lab():
    return load_lab_module()


def backends(args):
    return [a for a in args if a.startswith("memory-backend-ram")]


def test_node_mib_sizes_both_dram_nodes_and_nothing_else(lab):
    cxl = lab.PROFILES["cxl"]
    assert cxl.with_node_mib(None) is cxl
    sized = cxl.with_node_mib(1024)
    assert [n.mem_mib for n in sized.nodes] == [1024, 1024] and sized.mem_mib == 2048
    assert backends(sized.qemu_args()) == ["memory-backend-ram,id=mem0,size=1024M",
                                           "memory-backend-ram,id=mem1,size=1024M"]
    assert [n.mem_mib for n in cxl.nodes] == [2048, 2048]          # the default is unchanged
    pmem = lab.PROFILES["pmem"].with_node_mib(1024)
    assert [n.mem_mib for n in pmem.nodes] == [1024, 1024, 0]      # node2 is onlined later (kmem)
    args = pmem.qemu_args()
    assert f"{pmem.mem_mib}M,slots=4,maxmem={2048 + 1536 + 1024}M" in args


def test_node_mib_too_small_is_refused(lab):
    with pytest.raises(lab.LabError, match="at least 256 MiB"):
        lab.PROFILES["cxl"].with_node_mib(128)


def test_run_takes_node_mib_on_the_command_line(lab, monkeypatch):
    seen = {}

    def fake_run(script, **kw):
        seen.update(kw)
        return lab.LabResult(rc=0, stdout="", stderr="", wall_s=1.0, out_dir=Path("/tmp"))
    monkeypatch.setattr(lab, "run", fake_run)
    monkeypatch.setattr(lab, "prune_runs", lambda: None)
    monkeypatch.setattr(lab.signal, "signal", lambda *a: None)   # main() traps SIGTERM
    assert lab.main(["run", "--kernel", "6.12", "--node-mib", "1024", "--", "true"]) == 0
    assert seen["node_mib"] == 1024 and seen["kernel"] == "6.12" and seen["profile"] == "cxl"


def test_a_vng_that_never_reached_the_guest_script_is_retried_and_a_guest_that_ran_is_not(lab, tmp_path):
    # CI, cxl/7.3: vng exit 255 after 5.3 s, empty log, no boot_s: the host failed.
    assert lab.host_failed(tmp_path, 255)
    (tmp_path / "boot_s").write_text("4.2\n")       # the wrapper ran: the guest booted
    assert not lab.host_failed(tmp_path, 255)       # ... and then died: the test's failure
    assert lab.host_failed(tmp_path, -9)            # vng killed by a signal: the host's
    (tmp_path / "rc").write_text("1\n")             # the script finished: never retried
    assert not lab.host_failed(tmp_path, -9)


def test_the_cached_trees_bind_each_tree_and_fall_back_to_the_plain_share(lab):
    lines = lab._cached_mounts(("/srv/a b", "/srv/c"))
    assert "cache=loose,ro labcached /run/lab-cached" in lines
    assert "mount --bind '/run/lab-cached/srv/a b' '/srv/a b'" in lines
    assert "mount --bind /run/lab-cached/srv/c /srv/c" in lines
    assert lines.endswith("|| echo 'lab: cached Python trees not mounted; imports read the plain share' >&2")
    assert lab._cached_mounts(()) == ""


def test_a_checkout_the_guests_cannot_see_is_refused_with_the_reason(lab, tmp_path):
    """virtme-ng mounts an empty tmpfs on /var/tmp in the guest: a clone there boots, finds no
    checkout and exits 255 with an empty log, unless lab.py says why first."""
    with pytest.raises(lab.LabError, match=r"under /var/tmp, which the lab's guests see as an empty tmpfs"):
        lab.check_visible_in_guest(Path("/var/tmp/tieringd-clone/tieringd"))
    lab.check_visible_in_guest(tmp_path)          # /tmp is the host's own in the guest: allowed
    lab.check_visible_in_guest(Path("/work/tieringd"))
