# SPDX-License-Identifier: Apache-2.0
"""What this machine offers the samplers, and why not when it does not: kernel facilities,
capabilities, BTF, tracefs, NUMA balancing, DAMON, idle page tracking, memory tiers.

Everything is read, nothing changed (``tieringctl doctor`` prints it); whether a sampler really runs
is settled by loading it (:func:`tieringd.sampling.probe_samplers`), these facts explain the answer.
"""
from __future__ import annotations

import dataclasses
import gzip
import os
import platform

from tieringd.kernel import procfs, sysfs
from tieringd.kernel.procfs import read_vmstat

TRACEFS_DIRS = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")
TRACEPOINTS = {
    "exceptions/page_fault_user": "fault sampler",
    "exceptions/page_fault_kernel": "fault sampler (kernel-mode faults on user memory)",
    "migrate/mm_migrate_pages": "migration accounting",
}
CAPS = {"CAP_SYS_PTRACE": 19, "CAP_SYS_ADMIN": 21, "CAP_SYS_NICE": 23, "CAP_PERFMON": 38, "CAP_BPF": 39}
NUMA_BALANCING_MODES = {0: "off", 1: "normal (NUMA locality)", 2: "memory tiering",
                        3: "normal + memory tiering"}
# /proc/vmstat counters of NUMA balancing and memory tiering: hint faults, the kernel's own promotions
# and demotions, and migrations of any cause (to tell them apart from the daemon's).
NUMA_BALANCING_COUNTERS = ("numa_hint_faults", "numa_hint_faults_local", "numa_pages_migrated",
                           "pgpromote_success", "pgpromote_candidate", "pgdemote_kswapd",
                           "pgdemote_direct", "pgmigrate_success", "thp_migration_success")
CONFIG_KEYS = ("CONFIG_BPF_SYSCALL", "CONFIG_DEBUG_INFO_BTF", "CONFIG_BPF_EVENTS", "CONFIG_UPROBES",
               "CONFIG_KPROBES", "CONFIG_PERF_EVENTS", "CONFIG_NUMA_BALANCING",
               "CONFIG_TRANSPARENT_HUGEPAGE", "CONFIG_DAMON_SYSFS", "CONFIG_DAMON_VADDR",
               "CONFIG_DAMON_PADDR", "CONFIG_IDLE_PAGE_TRACKING", "CONFIG_MIGRATION")


@dataclasses.dataclass
class Check:
    name: str
    ok: bool | None          # None: a fact, neither good nor bad
    detail: str

    def as_dict(self) -> dict:
        return {"check": self.name, "ok": self.ok, "detail": self.detail}


def tracefs_root() -> str | None:
    for d in TRACEFS_DIRS:
        if sysfs.is_dir(f"{d}/events"):
            return d
    return None


def tracefs_unreadable() -> str | None:
    """A tracefs mount this user cannot search: tracefs is mode 0700 (root only) unless mounted with
    ``mode=``, so a non-root ``doctor`` sees the directory but not its ``events``."""
    for d in TRACEFS_DIRS:
        if sysfs.is_dir(d) and sysfs.listdir(d, None) is None:
            return d
    return None


def effective_caps() -> dict[str, bool]:
    status = procfs.read_status("self") or {}
    eff = int(status.get("CapEff", "0"), 16)
    return {name: bool(eff >> bit & 1) for name, bit in CAPS.items()}


def kernel_config() -> dict[str, str] | None:
    """The running kernel's config (/proc/config.gz, else /boot/config-RELEASE), or None."""
    raw = procfs.read_config_gz()
    text = None
    if raw:
        try:
            text = gzip.decompress(raw).decode(errors="replace")
        except OSError:
            text = None
    if text is None:
        boot = f"/boot/config-{platform.release()}"
        if os.path.exists(boot):
            with open(boot, encoding="utf-8", errors="replace") as f:
                text = f.read()
    if text is None:
        return None
    out = {}
    for line in text.splitlines():
        if line.startswith("CONFIG_"):
            k, _, v = line.partition("=")
            out[k] = v
        elif line.startswith("# CONFIG_") and line.endswith(" is not set"):
            out[line[2:-len(" is not set")]] = "n"
    return out


def numa_balancing() -> dict:
    mode = procfs.read_sysctl_int("kernel.numa_balancing", None)
    return {
        "mode": mode,
        "mode_name": NUMA_BALANCING_MODES.get(mode, "absent (CONFIG_NUMA_BALANCING)")
        if mode is not None else "absent (CONFIG_NUMA_BALANCING)",
        # v6.1+ (memory tiering): the promotion rate limit; 0 = promote nothing
        "promote_rate_limit_MBps": procfs.read_sysctl_int(
            "kernel.numa_balancing_promote_rate_limit_MBps", None),
        "vmstat": read_vmstat(NUMA_BALANCING_COUNTERS),
    }


def memory_tiers() -> dict[str, str]:
    out = {}
    for d in sysfs.glob("/sys/devices/virtual/memory_tiering/memory_tier*"):
        out[os.path.basename(d)] = sysfs.read_text(f"{d}/nodelist", "?")
    return out


def kernel_checks() -> list[Check]:
    checks = [Check("kernel", None, f"Linux {platform.release()} {platform.machine()}")]
    btf = sysfs.exists("/sys/kernel/btf/vmlinux")
    checks.append(Check("BTF", btf, "/sys/kernel/btf/vmlinux present (CO-RE relocations)" if btf
                        else "no /sys/kernel/btf/vmlinux: the kernel lacks CONFIG_DEBUG_INFO_BTF, "
                             "CO-RE objects cannot load"))
    tfs = tracefs_root()
    hidden = None if tfs else tracefs_unreadable()
    checks.append(Check("tracefs", tfs is not None, f"mounted at {tfs}" if tfs else
                        f"mounted at {hidden}, which only root may read: run doctor as root" if hidden
                        else "not mounted: mount -t tracefs nodev /sys/kernel/tracing"))
    unknown = "unknown (tracefs not readable by this user)" if hidden else "unknown (tracefs not mounted)"
    for tp, why in TRACEPOINTS.items():
        present = tfs is not None and sysfs.is_dir(f"{tfs}/events/{tp}")
        checks.append(Check(f"tracepoint {tp}", present if tfs else None,
                            why if present else (f"missing ({why} unavailable)" if tfs else unknown)))
    up = sysfs.read_int("/sys/bus/event_source/devices/uprobe/type", None)
    checks.append(Check("uprobes", up is not None, "uprobe PMU present (DMA-copy sampler)" if up
                        is not None else "no uprobe PMU (CONFIG_UPROBES / CONFIG_UPROBE_EVENTS)"))
    kp = sysfs.read_int("/sys/bus/event_source/devices/kprobe/type", None)
    checks.append(Check("kprobes", None, "available" if kp is not None else
                        "not available (CONFIG_KPROBES off): tracepoints and uprobes only"))
    cfg = kernel_config()
    if cfg is not None:
        facts = ", ".join(f"{k[7:]}={cfg.get(k, 'n')}" for k in CONFIG_KEYS)
        checks.append(Check("kernel config", None, facts))
    return checks


def capability_checks() -> list[Check]:
    caps = effective_caps()
    bpf_ok = caps["CAP_BPF"] or caps["CAP_SYS_ADMIN"]
    perf_ok = caps["CAP_PERFMON"] or caps["CAP_SYS_ADMIN"]
    out = [Check("CAP_BPF", bpf_ok, "held" if caps["CAP_BPF"] else
                 ("via CAP_SYS_ADMIN" if caps["CAP_SYS_ADMIN"] else "missing: BPF programs cannot load")),
           Check("CAP_PERFMON", perf_ok, "held" if caps["CAP_PERFMON"] else
                 ("via CAP_SYS_ADMIN" if caps["CAP_SYS_ADMIN"] else
                  "missing: tracing programs and perf events cannot attach")),
           Check("CAP_SYS_ADMIN", caps["CAP_SYS_ADMIN"], "held" if caps["CAP_SYS_ADMIN"] else
                 "missing: PFNs in pagemap (THP accounting, idle page tracking) are hidden"),
           # move_pages(2) of another user's process is a PTRACE_MODE_READ_REALCREDS check since
           # Linux 4.13 (197e7e521384), not CAP_SYS_NICE; CAP_SYS_NICE is MPOL_MF_MOVE_ALL's alone
           Check("CAP_SYS_PTRACE", caps["CAP_SYS_PTRACE"], "held" if caps["CAP_SYS_PTRACE"] else
                 "missing: move_pages(2) and /proc/PID/maps of other users' processes are refused"),
           Check("CAP_SYS_NICE", caps["CAP_SYS_NICE"], "held" if caps["CAP_SYS_NICE"] else
                 "missing: [mover] move_shared (MPOL_MF_MOVE_ALL: pages other processes map too) "
                 "is refused")]
    unpriv = procfs.read_sysctl_int("kernel.unprivileged_bpf_disabled", None)
    if unpriv is not None:
        out.append(Check("unprivileged_bpf_disabled", None, str(unpriv)))
    paranoid = procfs.read_sysctl_int("kernel.perf_event_paranoid", None)
    if paranoid is not None:
        out.append(Check("perf_event_paranoid", None, str(paranoid)))
    return out


def numa_checks() -> list[Check]:
    nb = numa_balancing()
    out = [Check("numa_balancing", None, f"{nb['mode']} = {nb['mode_name']}" if nb["mode"] is not None
                 else nb["mode_name"])]
    if nb["promote_rate_limit_MBps"] is not None:
        lim = nb["promote_rate_limit_MBps"]
        out.append(Check("promote rate limit", None,
                         f"{lim} MB/s" + (" (kernel promotes nothing: hint faults without "
                                          "kernel promotion)" if lim == 0 else "")))
    if nb["vmstat"]:
        out.append(Check("vmstat", None, ", ".join(f"{k}={v}" for k, v in nb["vmstat"].items())))
    tiers = memory_tiers()
    out.append(Check("memory tiers", None, ", ".join(f"{k}: nodes {v}" for k, v in tiers.items())
                     if tiers else "none (no /sys/devices/virtual/memory_tiering: single tier or < 6.1)"))
    thp = sysfs.read_text("/sys/kernel/mm/transparent_hugepage/enabled", None)
    if thp is not None:
        out.append(Check("THP", None, thp))
    return out


def libbpf_check() -> Check:
    """The system's libbpf.so, which every BPF sampler loads through (:mod:`tieringd.sampling._libbpf`)."""
    from tieringd.sampling import _libbpf
    try:
        info = _libbpf.library_info()
    except OSError as e:
        return Check("libbpf", False, str(e).splitlines()[0])
    return Check("libbpf", True, f"{info['library']}" + (f" (version {info['version']})" if "version" in info else ""))
