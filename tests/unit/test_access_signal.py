# SPDX-License-Identifier: Apache-2.0
"""The choice of access signal against facts captured from the lab kernels and the development VM
(tests/fixtures/access_signal/, written by ``scripts/lab/kv_signal.py --facts``), and the running
signal's bookkeeping against a fake /proc and /sys tree."""
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from tieringd.kernel import sysfs, knobs
from tieringd.sampling import access_signal as sig

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "access_signal"


def facts(name: str, **change) -> sig.Facts:
    f = sig.Facts.from_dict(json.loads((FIXTURES / f"{name}.json").read_text()))
    return dataclasses.replace(f, **change)


def with_sampler(f: sig.Facts, name: str, ok: bool, why: str = "") -> sig.Facts:
    return dataclasses.replace(f, samplers={**f.samplers, name: [ok, why or f"{name} probe"]})


def settings(choice) -> dict:
    return dict(choice.settings)


def test_6_12_hint_faults_in_mode_3_with_promotion_and_demotion_off():
    c = sig.choose(facts("cxl-6.12"))
    assert c.mechanism is sig.Mechanism.HINT_FAULTS
    assert c.sources == ("fault",) and c.fallback == "none"      # no PMU under TCG
    s = settings(c)
    assert s["kernel.numa_balancing"] == 3
    assert s["kernel.numa_balancing_promote_rate_limit_MBps"] == 0
    assert s["mm.numa.demotion_enabled"] == 0
    assert all(s[name] == v for name, v in sig.SCAN_SETTINGS)
    assert c.required == ("kernel.numa_balancing",)
    assert c.bind_regions and not c.query_via_pagemap
    assert "share one tier" not in c.why


def test_6_1_one_tier_and_move_pages_blind_to_scanned_pages():
    f = facts("cxl-6.1")
    assert not f.slow_nodes_in_lower_tier                # 6.1 puts node1 in the DRAM tier
    c = sig.choose(f)
    assert c.mechanism is sig.Mechanism.HINT_FAULTS and settings(c)["kernel.numa_balancing"] == 3
    assert "share one tier" in c.why
    assert c.query_via_pagemap                           # < 6.5: move_pages answers -ENOENT


def test_the_development_vm_runs_hint_faults_too():
    c = sig.choose(facts("host-6.18"))
    assert c.mechanism is sig.Mechanism.HINT_FAULTS and not c.query_via_pagemap


def test_without_bpf_6_12_falls_back_to_damon_with_numa_balancing_off():
    f = with_sampler(facts("cxl-6.12"), "fault", False, "pagefault: the kernel refused BPF")
    c = sig.choose(f)
    assert c.mechanism is sig.Mechanism.DAMON and c.sources == () and c.fallback == "damon"
    assert settings(c)["kernel.numa_balancing"] == 0     # Debian boots NUMA machines with 1
    assert c.required == ("kernel.numa_balancing",) and not c.bind_regions
    assert dict(c.rejected)["hint-faults"].startswith("the fault sampler cannot run: pagefault")


def test_without_bpf_on_6_1_nothing_runs_and_it_says_why():
    f = with_sampler(facts("cxl-6.1"), "fault", False, "pagefault: the kernel refused BPF")
    c = sig.choose(f)
    assert c.mechanism is sig.Mechanism.NONE and c.settings == ()
    assert "hint-faults: the fault sampler cannot run" in c.why
    assert "damon: damon: DAMON sysfs interface absent" in c.why


def test_a_hardware_pmu_adds_address_samples_to_hint_faults():
    f = with_sampler(facts("cxl-6.12"), "pmu", True, "event intel-mem-loads: PEBS load latency")
    assert sig.choose(f).sources == ("fault", "pmu")
    alone = sig.choose(with_sampler(f, "fault", False, "no BPF"))
    assert alone.mechanism is sig.Mechanism.DAMON       # accessed bits before PMU-only
    assert sig.choose(f, prefer="pmu").mechanism is sig.Mechanism.PMU


def test_7_3_like_6_12_and_damon_needs_damon_stat_off():
    f = facts("cxl-7.3")
    assert f.slow_nodes_in_lower_tier and not f.sampler("migrations")[0]
    c = sig.choose(f)
    assert c.mechanism is sig.Mechanism.HINT_FAULTS and settings(c)["kernel.numa_balancing"] == 3
    # Debian's 7.x boots with DAMON_STAT running (exclusive kdamond): DAMON must borrow it off
    assert f.settings["damon_stat.enabled"] and not facts("cxl-6.12").settings.get("damon_stat.enabled")
    d = sig.choose(f, prefer="damon")
    assert d.mechanism is sig.Mechanism.DAMON and settings(d)["damon_stat.enabled"] == "N"
    assert "damon_stat.enabled" in d.required


def test_prefer_damon_where_it_exists():
    c = sig.choose(facts("cxl-6.12"), prefer="damon")
    assert c.mechanism is sig.Mechanism.DAMON
    c = sig.choose(facts("cxl-6.1"), prefer="damon")
    assert c.mechanism is sig.Mechanism.HINT_FAULTS and "damon" in dict(c.rejected)


def test_old_kernels_and_kernels_without_numa_balancing():
    f = facts("cxl-6.12", release="5.15.0-91-generic")
    c = sig.choose(f)
    assert c.mechanism is sig.Mechanism.DAMON
    assert "predates mbind(MPOL_F_NUMA_BALANCING)" in dict(c.rejected)["hint-faults"]
    f = facts("cxl-6.12", release="5.19.0", settings={
        **facts("cxl-6.12").settings, "kernel.numa_balancing_promote_rate_limit_MBps": False})
    s = settings(sig.choose(f))
    assert s["kernel.numa_balancing"] == 3 and "kernel.numa_balancing_promote_rate_limit_MBps" not in s
    off = facts("cxl-6.12", numa_balancing=None,
                settings={**facts("cxl-6.12").settings, "kernel.numa_balancing": False})
    c = sig.choose(off)
    assert c.mechanism is sig.Mechanism.DAMON and "kernel.numa_balancing" not in settings(c)
    assert "CONFIG_NUMA_BALANCING" in dict(c.rejected)["hint-faults"]


# --------------------------------------------------------------------------------------------------
# the running signal, against a fake tree

NB = "/proc/sys/kernel/numa_balancing"
RATE = "/proc/sys/kernel/numa_balancing_promote_rate_limit_MBps"
DBG = "/sys/kernel/debug/sched/numa_balancing"


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "root"
    files = {NB: "1", RATE: "65536", "/sys/kernel/mm/numa/demotion_enabled": "false",
             f"{DBG}/scan_delay_ms": "1000", f"{DBG}/scan_period_min_ms": "1000",
             f"{DBG}/scan_period_max_ms": "60000", f"{DBG}/scan_size_mb": "256",
             "/sys/devices/system/memory/block_size_bytes": "8000000"}
    for path, value in files.items():
        f = root / path.lstrip("/")
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(value + "\n")
    for node, blocks in ((0, range(0, 8)), (1, range(8, 16))):   # 128 MiB memory blocks
        for b in blocks:
            (root / f"sys/devices/system/node/node{node}/memory{b}").mkdir(parents=True)
    with sysfs.root(root):
        yield tmp_path


def test_start_borrows_describes_and_stop_restores(tree):
    s = sig.AccessSignal(sig.choose(facts("cxl-6.12")), knobs.Knobs(tree / "knobs.json"))
    s.start()
    assert sysfs.read_text(NB) == "3" and sysfs.read_text(RATE) == "0"
    assert sysfs.read_text(f"{DBG}/scan_period_max_ms") == "500"
    text = s.describe()
    assert text.startswith("access signal: hint faults")
    assert "kernel.numa_balancing 1→3" in text and "numa_balancing_promote_rate_limit_MBps 65536→0" in text
    assert "demotion_enabled" not in text                 # already off: nothing borrowed
    st = s.status()
    assert st["mechanism"] == "hint-faults" and len(st["borrowed"]) == 5
    s.stop()
    assert sysfs.read_text(NB) == "1" and sysfs.read_text(f"{DBG}/scan_period_max_ms") == "60000"
    assert not (tree / "knobs.json").exists()


def test_a_required_setting_the_kernel_lacks_fails_start_and_restores_the_rest(tree):
    choice = dataclasses.replace(sig.choose(facts("cxl-6.12")),
                                 required=("kernel.numa_balancing", "numa_balancing.scan_period_max_ms"))
    (Path(sysfs.path(f"{DBG}/scan_period_max_ms"))).unlink()
    s = sig.AccessSignal(choice, knobs.Knobs(tree / "knobs.json"))
    with pytest.raises(sig.AccessSignalError, match="numa_balancing.scan_period_max_ms"):
        s.start()
    assert sysfs.read_text(NB) == "1" and sysfs.read_text(RATE) == "65536"


def test_an_optional_setting_the_kernel_lacks_is_named(tree):
    (Path(sysfs.path(f"{DBG}/scan_delay_ms"))).unlink()
    with sig.AccessSignal(sig.choose(facts("cxl-6.12")), knobs.Knobs(tree / "k.json")) as s:
        assert "not on this kernel: numa_balancing.scan_delay_ms" in s.describe()
    assert sysfs.read_text(NB) == "1"


def test_start_after_a_crash_restores_first_and_says_so(tree):
    state = tree / "knobs.json"
    crashed = sig.AccessSignal(sig.choose(facts("cxl-6.12")), knobs.Knobs(state))
    crashed.start()
    saved = json.loads(state.read_text())
    saved["pid"] = 999_999_999                            # kill -9: the file stays, the pid is gone
    state.write_text(json.dumps(saved))
    s = sig.AccessSignal(sig.choose(facts("cxl-6.12")), knobs.Knobs(state))
    s.start()
    assert "restored after an earlier run: " in s.describe()
    assert "kernel.numa_balancing 1→3" in s.describe()    # the original is the boot's 1, not 3
    s.stop()
    assert sysfs.read_text(NB) == "1"


def test_blocks_are_bound_to_the_node_they_are_on_in_runs():
    s = sig.AccessSignal(sig.choose(facts("cxl-6.12")), knobs.Knobs("/nonexistent/k.json"))
    mib2 = 2 << 20
    base = 0x7F0000000000
    binds = s.blocks_placed(42, base, mib2, [0, 0, 1, 1, 1, -1, 0])
    assert binds == [sig.Bind(42, base, 2 * mib2, 0), sig.Bind(42, base + 2 * mib2, 3 * mib2, 1),
                     sig.Bind(42, base + 6 * mib2, mib2, 0)]
    assert s.bound_blocks() == 6
    # the mover verified blocks 2 and 3 on node0; block 5 got populated on node1
    binds = s.blocks_placed(42, base, mib2, [0, 0, 0, 0, 1, 1, 0])
    assert binds == [sig.Bind(42, base + 2 * mib2, 2 * mib2, 0), sig.Bind(42, base + 5 * mib2, mib2, 1)]
    assert s.blocks_placed(42, base, mib2, [0, 0, 0, 0, 1, 1, 0]) == []    # nothing changed
    s.bind_failed(sig.Bind(42, base + 2 * mib2, 2 * mib2, 0), "EBUSY (pinned)")
    assert s.bind_failures == 1 and "EBUSY" in s.last_bind_error
    assert s.blocks_placed(42, base, mib2, [0, 0, 0, 0, 1, 1, 0]) == [
        sig.Bind(42, base + 2 * mib2, 2 * mib2, 0)]                          # asked again
    s.process_exited(42)
    assert s.bound_blocks() == 0


def test_damon_and_pmu_bind_nothing():
    c = sig.choose(facts("cxl-6.12"), prefer="damon")
    s = sig.AccessSignal(c, knobs.Knobs("/nonexistent/k.json"))
    assert s.blocks_placed(1, 0x200000, 2 << 20, [0, 1]) == []


def test_node_of_pfns_reads_the_memory_blocks(tree):
    block_pages = 0x8000000 // 4096
    pfns = np.array([0, 5, block_pages * 3 + 7, block_pages * 8, block_pages * 15 + 1, block_pages * 40],
                    np.uint64)
    assert sig.node_of_pfns(pfns).tolist() == [-1, 0, 0, 1, 1, -1]
