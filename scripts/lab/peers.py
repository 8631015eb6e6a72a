# SPDX-License-Identifier: Apache-2.0
"""Guest side of figure P5's peer table: the tiering a user would run instead of tieringd, set up
around the same KV workload by ``scripts/lab/kv_loop.py --peer NAME``.

    none          no tiering: NUMA balancing off, reclaim-time demotion off
    kernel        the kernel's own tiering: NUMA balancing mode 2 (NUMA_BALANCING_MEMORY_TIERING,
                  v5.18), ``demotion_enabled`` 1 (v5.15), the promotion rate limit at its default
                  (65536 MB/s, v6.1)
    kernel-tuned  the same with the promotion rate limit at ``--promote-rate`` MB/s
    damon         DAMOS migrate_cold / migrate_hot (v6.11), the kernel's tiering recipe
                  (samples/damon/mtier.c, v6.16; damo's ``scripts/mem_tier.sh``): one kdamond per
                  node on physical addresses; node 0's demotes what went unaccessed for an aggregation
                  (young pages rejected) aiming at 0.5 % of node 0 free, node 1's promotes what was
                  accessed in ≥ 5 % of the samples (young pages only) aiming at 99.7 % of node 0
                  used; 200 MiB/s at most each, applied every second, sampling intervals tuned to
                  catch 4 % of accesses in 3 aggregations (v6.15). A kernel without a part of the
                  recipe runs the rest and :attr:`Peer.notes` says which part was missing
    memtierd      not run here: the host decides whether it can be built (scripts/bench/p5_peers.py)

Each peer: :meth:`Peer.start` borrows the kernel settings (:mod:`tieringd.kernel.knobs`, its state file
in the run folder) and starts its agent; :meth:`Peer.counters` gives bytes promoted to node 0 and
demoted from it and the agent's CPU seconds so far, read from the kernel (vmstat, DAMOS stats, the
agent threads' ``/proc`` stat); :meth:`Peer.stop` stops the agent and puts every setting back. No
move is counted by the peer itself: every byte figure is the kernel's.
"""
from __future__ import annotations

import os
import re

from tieringd.kernel import knobs, procfs, sysfs

PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 2 ** 20
U32_MAX, U64_MAX = (1 << 32) - 1, (1 << 64) - 1
DAMON = "/sys/kernel/mm/damon/admin/kdamonds"
# kswapd demotes for the kernel's tiering (and reclaims for everyone); kcompactd compacts for THP
RECLAIM_THREADS = re.compile(r"^(kswapd\d+|kcompactd\d+)$")
DAMON_THREADS = re.compile(r"^kdamond\.\d+$")
DEMOTE_COUNTERS = ("pgdemote_kswapd", "pgdemote_direct", "pgdemote_khugepaged", "pgdemote_proactive")


class PeerError(RuntimeError):
    """A peer cannot be set up on this kernel; the message says which file refused what."""


def thread_cpu_s(pattern: re.Pattern) -> float:
    """CPU seconds (user + system) of every thread whose comm matches, kernel threads included."""
    tck = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in procfs.pids():
        comm = procfs.read_comm(pid)
        if comm and pattern.match(comm):
            f = procfs.read_stat(pid) or []
            if len(f) > 12:
                total += int(f[14 - 3]) + int(f[15 - 3])     # utime, stime (proc(5))
    return total / tck


class Peer:
    name = "none"
    settings: dict[str, str | int] = {"kernel.numa_balancing": 0, "mm.numa.demotion_enabled": 0}
    agent = RECLAIM_THREADS

    def __init__(self, run_dir: str):
        self.knobs = knobs.Knobs(os.path.join(run_dir, f"knobs-{self.name}.json"))
        self.notes: list[str] = []

    def start(self) -> None:
        self.knobs.recover()
        for k, v in self.settings.items():
            if self.knobs.borrow(k, v) is None:
                self.notes.append(f"{k} absent on this kernel")

    def stop(self) -> None:
        self.knobs.restore()

    def counters(self) -> dict:
        vm = procfs.read_vmstat(("pgpromote_success", "pgmigrate_success", *DEMOTE_COUNTERS))
        return {"promoted_bytes": vm.get("pgpromote_success", 0) * PAGE,
                "demoted_bytes": sum(vm.get(k, 0) for k in DEMOTE_COUNTERS) * PAGE,
                "migrated_bytes": vm.get("pgmigrate_success", 0) * PAGE,
                "agent_cpu_s": round(thread_cpu_s(self.agent), 2)}

    def describe(self) -> dict:
        return {"peer": self.name, "settings": {k: str(v) for k, v in self.settings.items()},
                "notes": self.notes, "agent": self.agent.pattern}


class KernelTiering(Peer):
    name = "kernel"
    settings = {"kernel.numa_balancing": 2, "mm.numa.demotion_enabled": 1}


class KernelTieringTuned(Peer):
    name = "kernel-tuned"

    def __init__(self, run_dir: str, promote_rate_mb_s: int):
        super().__init__(run_dir)
        self.settings = {**KernelTiering.settings,
                         "kernel.numa_balancing_promote_rate_limit_MBps": promote_rate_mb_s}


class DamonTiering(Peer):
    name = "damon"
    settings = {"kernel.numa_balancing": 0, "damon_stat.enabled": "N"}
    agent = DAMON_THREADS
    # (monitored node, action, target node, nr_accesses range, quota goal metric, goal in bp, young filter allows)
    SCHEMES = ((0, "migrate_cold", 1, (0, 0), "node_mem_free_bp", 50, False),
               (1, "migrate_hot", 0, (1, U32_MAX), "node_mem_used_bp", 9970, True))

    def start(self) -> None:
        super().start()
        if not sysfs.is_dir(DAMON):
            raise PeerError("DAMON sysfs interface absent (CONFIG_DAMON_SYSFS)")
        _write(f"{DAMON}/nr_kdamonds", len(self.SCHEMES))
        for k, scheme in enumerate(self.SCHEMES):
            self._kdamond(k, *scheme)
        for k in range(len(self.SCHEMES)):
            _write(f"{DAMON}/{k}/state", "on")

    def _kdamond(self, k: int, node: int, action: str, target_nid: int, accesses: tuple[int, int],
                 metric: str, goal_bp: int, allow_young: bool) -> None:
        ctx = f"{DAMON}/{k}/contexts/0"
        _write(f"{DAMON}/{k}/contexts/nr_contexts", 1)
        _write(f"{ctx}/operations", "paddr")
        iv = f"{ctx}/monitoring_attrs/intervals"
        for f, v in (("sample_us", 5000), ("aggr_us", 100_000), ("update_us", 1_000_000)):
            _write(f"{iv}/{f}", v)          # DAMON's defaults: 5 % of accesses = 1 of 20 samples
        if sysfs.is_dir(f"{iv}/intervals_goal"):                 # v6.15
            for f, v in (("access_bp", 400), ("aggrs", 3), ("min_sample_us", 5000),
                         ("max_sample_us", 10_000_000)):
                _write(f"{iv}/intervals_goal/{f}", v)
        elif k == 0:
            self.notes.append("no monitoring intervals auto-tuning (v6.15): DAMON's default intervals")
        start, end = node_phys_range(node)
        _write(f"{ctx}/targets/nr_targets", 1)
        _write(f"{ctx}/targets/0/regions/nr_regions", 1)
        _write(f"{ctx}/targets/0/regions/0/start", start)
        _write(f"{ctx}/targets/0/regions/0/end", end)
        s = f"{ctx}/schemes/0"
        _write(f"{ctx}/schemes/nr_schemes", 1)
        _write(f"{s}/action", action)
        _write(f"{s}/target_nid", target_nid)
        for rng, lo, hi in (("sz", PAGE, U64_MAX), ("nr_accesses", *accesses), ("age", 0, U32_MAX)):
            _write(f"{s}/access_pattern/{rng}/min", lo)
            _write(f"{s}/access_pattern/{rng}/max", hi)
        _write(f"{s}/apply_interval_us", 1_000_000)
        for f, v in (("ms", 0), ("bytes", 200 * MIB), ("reset_interval_ms", 1000)):
            _write(f"{s}/quotas/{f}", v)
        for f, v in (("sz_permil", 0), ("nr_accesses_permil", 100), ("age_permil", 100)):
            _write(f"{s}/quotas/weights/{f}", v)
        self._goal(s, metric, goal_bp)
        self._young_filter(s, allow_young)

    def _goal(self, s: str, metric: str, goal_bp: int) -> None:
        if not sysfs.exists(f"{s}/quotas/goals/nr_goals"):
            self.notes.append("no DAMOS quota goals")
            return
        _write(f"{s}/quotas/goals/nr_goals", 1)
        g = f"{s}/quotas/goals/0"
        try:
            sysfs.write_text(f"{g}/target_metric", metric)
        except OSError:
            # node_mem_{used,free}_bp and the goal's nid: v6.16. Without them the scheme runs on its
            # access pattern and quota alone
            _write(f"{s}/quotas/goals/nr_goals", 0)
            self.notes.append(f"no {metric} quota goal (v6.16): thresholds not auto-tuned")
            return
        _write(f"{g}/target_value", goal_bp)
        _write(f"{g}/nid", 0)

    def _young_filter(self, s: str, allow_young: bool) -> None:
        # ops_filters (v6.15) holds the page-level filters; before it, filters. "allow" is v6.14:
        # before it a filter only rejects, so "allow young" is "reject what is not young"
        base = f"{s}/ops_filters" if sysfs.is_dir(f"{s}/ops_filters") else f"{s}/filters"
        _write(f"{base}/nr_filters", 1)
        f = f"{base}/0"
        try:
            _write(f"{f}/type", "young")
        except PeerError:
            _write(f"{base}/nr_filters", 0)
            self.notes.append("no young page filter")
            return
        if sysfs.exists(f"{f}/allow"):
            _write(f"{f}/matching", "Y")
            _write(f"{f}/allow", "Y" if allow_young else "N")
        else:
            _write(f"{f}/matching", "N" if allow_young else "Y")

    def stop(self) -> None:
        try:
            for k in range(len(self.SCHEMES)):
                if sysfs.read_text(f"{DAMON}/{k}/state", "off") == "on":
                    sysfs.write_text(f"{DAMON}/{k}/state", "off")
            sysfs.write_text(f"{DAMON}/nr_kdamonds", 0)
        finally:
            super().stop()

    def counters(self) -> dict:
        out = super().counters()
        applied = []
        for k in range(len(self.SCHEMES)):
            try:
                sysfs.write_text(f"{DAMON}/{k}/state", "update_schemes_stats")
                applied.append(sysfs.read_int(f"{DAMON}/{k}/contexts/0/schemes/0/stats/sz_applied"))
            except OSError:
                applied.append(0)       # not started yet, or already stopped
        out["demoted_bytes"], out["promoted_bytes"] = applied
        out["agent_cpu_s"] = round(out["agent_cpu_s"] + thread_cpu_s(RECLAIM_THREADS), 2)
        return out


def _write(path: str, value) -> None:
    try:
        sysfs.write_text(path, value)
    except OSError as e:
        raise PeerError(f"{path}: writing {value!r} refused: {e.strerror or e}") from None


def node_phys_range(node: int) -> tuple[int, int]:
    """[start, end) of the node's memory blocks in physical address space (as damo's --numa_node)."""
    size = int(sysfs.read_text("/sys/devices/system/memory/block_size_bytes"), 16)
    blocks = [int(m.group(1)) for d in sysfs.listdir(f"/sys/devices/system/node/node{node}")
              if (m := re.fullmatch(r"memory(\d+)", d))]
    if not blocks:
        raise PeerError(f"node {node} has no memory blocks")
    return min(blocks) * size, (max(blocks) + 1) * size


NAMES = ("none", "kernel", "kernel-tuned", "damon")


def make(name: str, run_dir: str, promote_rate_mb_s: int) -> Peer:
    if name == "kernel-tuned":
        return KernelTieringTuned(run_dir, promote_rate_mb_s)
    return {"none": Peer, "kernel": KernelTiering, "damon": DamonTiering}[name](run_dir)
