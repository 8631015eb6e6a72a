# SPDX-License-Identifier: Apache-2.0
"""The loop follows memory hot-plug (tieringd/daemon/loop.py with tieringd/memory/hotplug.py): a refresh
that finds a new node replaces the daemon's topology, tier lookup, tier capacities and the mover's
fallbacks, so ``status()`` shows the new tier. Before/after are the captures of one lab guest: cxl-6.12,
then pmem-6.12 after kmem onlined node 2 (the same pair as test_hotplug). The listener's socket is
opened for real where netlink allows; the uevents themselves are the lab's (test_dax_lab)."""
from __future__ import annotations

import dataclasses
import logging

import pytest

from tieringd.kernel import sysfs
from tieringd import config
from tieringd.memory import hotplug, topology
from tieringd.contracts import Tier
from tieringd.daemon import capacity
from tieringd.daemon.loop import Daemon
from tieringd.placement.heat import BlockTable
from tieringd.mover import MigrationEngine
from tieringd.placement.policy import Policy

FIX = "tests/fixtures/sysfs"


def daemon_as_started(tmp_path, text: str = "") -> Daemon:
    """A Daemon with the topology-dependent state _start builds (no signal, samplers or registry:
    those need root and BPF)."""
    p = tmp_path / "tieringd.toml"
    p.write_text(text)
    d = Daemon(config.load(str(p)), run_dir=str(tmp_path / "run"))
    s = d.settings
    d.topology = topology.discover(s.source)
    d._tier_of = capacity.tier_lookup(d.topology)
    d.table = BlockTable(s.heat)
    d.tiers = capacity.tier_specs(d.topology, d.table.node_bytes)
    d.policy = Policy(s.policy, d.tiers, d._prefetcher(s))
    d.engine = MigrationEngine(s.mover, d.topology.fallback_map())     # not started: no threads
    return d


def test_a_node_onlined_at_run_time_joins_the_daemons_tiers(repo, tmp_path):
    with sysfs.root(repo / FIX / "cxl-6.12"):
        d = daemon_as_started(tmp_path)
        before = [t["tier"] for t in d.status()["tiers"]]
        listener = hotplug.HotplugListener(d.settings.hotplug, d.settings.source,
                                           on_change=d._topology_changed)
        listener.topology = d.topology              # what _open_hotplug does
    assert before == ["dram", "cxl-dram"]
    assert int(d._tier_of[2]) == int(Tier.CXL_DRAM)   # unknown nodes: the slowest tier present
    with sysfs.root(repo / FIX / "pmem-6.12"):
        change = listener.refresh()                 # what poll(0) does once a burst is over
        status = d.status()
    assert [n.id for n in change.added] == [2]
    tiers = {t["tier"]: t for t in status["tiers"]}
    assert list(tiers) == ["dram", "cxl-dram", "pmem"]
    # 896 MiB onlined, less the 3020 pages (promo watermark) its Movable zone keeps for the kernel
    assert tiers["pmem"]["nodes"] == [2] and tiers["pmem"]["capacity_bytes"] == (896 << 20) - 3020 * 4096
    assert status["nodes"]["2"]["kernel_reserve_bytes"] == 3020 * 4096
    assert status["nodes"]["2"]["tier"] == "pmem"
    assert int(d._tier_of[2]) == int(Tier.PMEM)
    assert d.engine.fallbacks.tiers[Tier.PMEM] == (2,)          # the mover can target the tier
    assert 2 in d.engine.fallbacks.chains[0]                      # and fall back onto the node
    assert [t.tier for t in d.policy.tiers] == [Tier.DRAM, Tier.CXL_DRAM, Tier.PMEM]


def test_listen_false_and_a_missing_netlink_leave_the_daemon_without_a_listener(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, "tieringd.daemon")
    d = Daemon(config.ConfigFile(), run_dir=str(tmp_path / "run"))
    d.settings = dataclasses.replace(d.settings, hotplug=hotplug.HotplugConfig(listen=False))
    d._open_hotplug()
    assert d.hotplug is None and "[hotplug] listen = false" in caplog.text

    def no_netlink(self):
        raise OSError(93, "Protocol not supported")
    monkeypatch.setattr(hotplug.HotplugListener, "open", no_netlink)
    d2 = Daemon(config.ConfigFile(), run_dir=str(tmp_path / "run2"))
    d2._open_hotplug()
    assert d2.hotplug is None and "Protocol not supported" in caplog.text


def test_the_listener_is_a_reader_of_the_loop_and_closed_at_shutdown(repo, tmp_path):
    with sysfs.root(repo / FIX / "cxl-6.12"):
        d = daemon_as_started(tmp_path)
        d._open_hotplug()
        if d.hotplug is None:
            pytest.skip("no uevent netlink socket here (pyroute2 missing or netlink refused)")
        fd = d.hotplug.fileno()
        assert d._sel.get_key(fd).data == d._poll_hotplug
        d._poll_hotplug()                           # nothing heard: no change, no error
        assert [t["tier"] for t in d.status()["tiers"]] == ["dram", "cxl-dram"]
        listener = d.hotplug
        d._shutdown()
    assert d.hotplug is None and listener._sock is None


class SignalStandIn:
    """The access signal's life cycle as the loop drives it (start / stand_by), recorded."""

    def __init__(self):
        self.started, self.standing_by, self.calls = False, "", []

    def start(self):
        self.started, self.standing_by = True, ""
        self.calls.append("start")

    def stand_by(self, why):
        self.started, self.standing_by = False, why
        self.calls.append("stand_by")
        return []


def test_one_tier_borrows_nothing_until_a_second_tier_arrives_and_gives_back_when_it_leaves(repo, tmp_path):
    """On a one-node machine the signal stands by (no kernel setting borrowed) and says why; a node
    onlined at run time starts it; the node going away again puts the settings back."""
    with sysfs.root(repo / FIX / "host-6.18"):
        d = daemon_as_started(tmp_path)
        d.signal = SignalStandIn()
        d._follow_tiers()
        listener = hotplug.HotplugListener(d.settings.hotplug, d.settings.source, on_change=d._topology_changed)
        listener.topology = d.topology
    assert d.signal.calls == ["stand_by"] and "one tier (dram: node 0)" in d.signal.standing_by
    with sysfs.root(repo / FIX / "cxl-6.12"):
        listener.refresh()
    assert d.signal.calls == ["stand_by", "start"] and d.signal.started
    with sysfs.root(repo / FIX / "host-6.18"):
        listener.refresh()
    assert d.signal.calls == ["stand_by", "start", "stand_by"] and not d.signal.started


def test_a_signal_standing_by_binds_nothing_and_says_why(repo, tmp_path):
    import json
    from tieringd.kernel.knobs import Knobs
    from tieringd.sampling.access_signal import AccessSignal, Facts, choose
    facts = Facts.from_dict(json.loads((repo / "tests/fixtures/access_signal/cxl-6.12.json").read_text()))
    sig = AccessSignal(choose(facts), Knobs(str(tmp_path / "knobs.json")))
    assert sig.stand_by("one tier (dram: node 0): nothing to tier") == []
    assert sig.blocks_placed(7, 0x10000000, 2 << 20, [0, 0, 0]) == []
    assert sig.describe().startswith("access signal: standing by, kernel settings untouched — one tier")
    assert sig.status()["standing_by"].startswith("one tier") and sig.status()["borrowed"] == []
