#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The lab: real Debian kernels booted under QEMU/TCG with emulated memory tiers.

    lab.py fetch   [--kernel K ...] [--refresh]     download + unpack the kernels (idempotent)
    lab.py run     --profile P --kernel K [--node-mib M] [--timeout S] -- CMD...
    lab.py capture [--profile P --kernel K ...]     re-capture tests/fixtures/sysfs/<P>-<K>/
    lab.py profiles                                 print the profiles and their QEMU arguments

Kernels come from Debian's archive only, through ``apt-get download`` with private apt state under the
cache folder (``.cache/lab`` or ``$TIERINGD_LAB_CACHE``): the host's apt lists, caches and packages are
never touched. Guests are started by virtme-ng (``vng``), which shares the host root read-only over 9p,
so the project's ``.venv`` and ``build/`` work inside. The guest command's stdout, stderr and exit code
travel back through files in a ``--rwdir``; QEMU runs in its own process group and is killed by PID on
timeout, error or Ctrl-C. See docs/lab.md.

Standard library only: ``tests/lab/conftest.py`` imports this file.
"""
from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
DEFAULT_KERNEL = "6.12"
DEFAULT_PROFILE = "cxl"
# node0 holds the kernel, the initramfs and virtme-ng's tmpfs overlays: below this the guest does not
# get to the script.
MIN_NODE_MIB = 256


class LabError(RuntimeError):
    """Something in the lab failed; the message says what and what to do."""


def log(msg: str) -> None:
    print(f"lab: {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    return Path(os.environ.get("TIERINGD_LAB_CACHE") or REPO / ".cache" / "lab").resolve()


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class KernelSource:
    """Where one lab kernel comes from: a Debian suite's ``linux-image-amd64`` metapackage."""
    label: str           # what tests and `make lab KERNEL=` call it
    suite: str           # the suite whose metapackage we follow
    lines: tuple[str, ...]  # sources.list lines (only these suites are visible to apt), {mirror}/{security}

    @property
    def sources(self) -> tuple[str, ...]:
        """The lines with the host's own Debian mirror (scripts/debian_mirror.py)."""
        if str(Path(__file__).resolve().parent) not in sys.path:      # lab.py loaded by path (tests)
            sys.path.insert(0, str(Path(__file__).resolve().parent))
        import debian_mirror
        try:
            mirror, security = debian_mirror.mirrors()
        except debian_mirror.MirrorError as e:
            raise LabError(str(e)) from None
        return tuple(line.format(mirror=mirror, security=security) for line in self.lines)


KERNELS: dict[str, KernelSource] = {
    # The oldest kernel we support: memory tiers exist (6.1 added them) but HMAT does not yet place
    # nodes into tiers (that came with the abstract distance work in 6.4), so every node is tier4.
    "6.1": KernelSource("6.1", "bookworm", (
        f"deb [signed-by={KEYRING}] {{mirror}} bookworm main",
        f"deb [signed-by={KEYRING}] {{security}} bookworm-security main",
    )),
    "6.12": KernelSource("6.12", "trixie", (
        f"deb [signed-by={KEYRING}] {{mirror}} trixie main",
        f"deb [signed-by={KEYRING}] {{security}} trixie-security main",
    )),
    # Backports alone, so that its metapackage (pin 100) is the candidate rather than trixie's.
    # From 7.x the image package is split: linux-binary-VER (vmlinuz under usr/lib/modules/VER/)
    # and linux-modules-VER.
    "7.3": KernelSource("7.3", "trixie-backports", (
        f"deb [signed-by={KEYRING}] {{mirror}} trixie-backports main",
    )),
}


@dataclasses.dataclass
class Kernel:
    """An unpacked kernel in the cache."""
    label: str
    release: str       # `uname -r` in the guest, e.g. 6.12.43+deb13-amd64
    vmlinuz: Path
    moddir: Path       # .../lib/modules/<release>
    packages: list[str]

    @staticmethod
    def stamp_path(label: str) -> Path:
        return cache_dir() / "kernels" / label / "kernel.json"

    @classmethod
    def load(cls, label: str) -> "Kernel | None":
        stamp = cls.stamp_path(label)
        try:
            data = json.loads(stamp.read_text())
        except (OSError, ValueError):
            return None
        base = stamp.parent
        k = cls(label=label, release=data["release"], vmlinuz=base / data["vmlinuz"],
                moddir=base / data["moddir"], packages=data["packages"])
        if not (k.vmlinuz.is_file() and (k.moddir / "modules.dep").is_file()):
            return None
        return k

    def save(self) -> None:
        base = self.stamp_path(self.label).parent
        data = {"release": self.release, "vmlinuz": str(self.vmlinuz.relative_to(base)),
                "moddir": str(self.moddir.relative_to(base)), "packages": self.packages}
        tmp = self.stamp_path(self.label).with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(self.stamp_path(self.label))


class PrivateApt:
    """apt-get/apt-cache with every piece of state (sources, lists, caches) under the cache folder."""

    def __init__(self, src: KernelSource):
        self.base = cache_dir() / "apt" / src.suite
        self.src = src
        for d in ("lists/partial", "cache/archives/partial", "etc"):
            (self.base / d).mkdir(parents=True, exist_ok=True)
        self.sources = self.base / "etc" / "sources.list"
        text = "".join(line + "\n" for line in src.sources)
        if not self.sources.exists() or self.sources.read_text() != text:
            self.sources.write_text(text)

    def opts(self) -> list[str]:
        o = {
            "Dir::Etc::SourceList": str(self.sources),
            "Dir::Etc::SourceParts": "/dev/null",
            "Dir::Etc::Preferences": "/dev/null",
            "Dir::Etc::PreferencesParts": "/dev/null",
            "Dir::State::Lists": str(self.base / "lists"),
            "Dir::Cache": str(self.base / "cache"),
            "APT::Architecture": "amd64",
            "APT::Architectures": "amd64",
            # The cache folder may not be reachable by the _apt user; download as the caller.
            "APT::Sandbox::User": "root" if os.geteuid() == 0 else os.environ.get("USER", "nobody"),
            "Debug::NoLocking": "true",
        }
        out: list[str] = []
        for k, v in o.items():
            out += ["-o", f"{k}={v}"]
        return out

    def run(self, tool: str, *args: str, cwd: Path | None = None) -> str:
        cmd = [tool, "-q", *self.opts(), *args]
        p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
        if p.returncode != 0:
            raise LabError(f"{' '.join(cmd[:1] + list(args))} failed ({p.returncode}):\n{p.stderr.strip()}")
        return p.stdout

    def update(self) -> None:
        self.run("apt-get", "update")

    def depends(self, pkg: str) -> list[str]:
        out = self.run("apt-cache", "depends", "--no-recommends", "--no-suggests",
                       "--no-conflicts", "--no-breaks", "--no-replaces", "--no-enhances", pkg)
        deps = []
        for line in out.splitlines():
            m = re.match(r"\s*\|?(?:Pre)?Depends:\s+(\S+)", line)
            if m and not m.group(1).startswith("<"):
                deps.append(m.group(1))
        return deps

    def download(self, pkgs: list[str], into: Path) -> list[Path]:
        into.mkdir(parents=True, exist_ok=True)
        for old in into.glob("*.deb"):
            old.unlink()
        self.run("apt-get", "download", *pkgs, cwd=into)
        debs = sorted(into.glob("*.deb"))
        if len(debs) != len(pkgs):
            raise LabError(f"apt-get download {pkgs} left {[d.name for d in debs]}")
        return debs


def resolve_image_packages(apt: PrivateApt) -> tuple[str, list[str]]:
    """Follow linux-image-amd64 to the real image package; return (release, packages to download).

    Up to 6.x the image package (linux-image-REL) carries vmlinuz and modules. From 7.x it is empty and
    depends on linux-binary-REL (vmlinuz) and linux-modules-REL (modules)."""
    images = [d for d in apt.depends("linux-image-amd64") if re.match(r"linux-image-\d", d)]
    if len(images) != 1:
        raise LabError(f"{apt.src.suite}: linux-image-amd64 does not name one image package: {images}")
    image = images[0]
    release = image[len("linux-image-"):]
    deps = apt.depends(image)
    split = [d for d in deps if d in (f"linux-binary-{release}", f"linux-modules-{release}")]
    if split:
        if len(split) != 2:
            raise LabError(f"{image}: expected linux-binary-{release} and linux-modules-{release}, got {split}")
        # linux-base-REL carries modules.builtin/.order (modprobe must know what is built in),
        # System.map and the config.
        base = [d for d in deps if d == f"linux-base-{release}"]
        return release, split + base
    return release, [image]


def find_vmlinuz(root: Path, release: str) -> Path:
    for cand in (root / "boot" / f"vmlinuz-{release}",
                 root / "usr/lib/modules" / release / "vmlinuz",
                 root / "lib/modules" / release / "vmlinuz"):
        if cand.is_file():
            return cand
    raise LabError(f"no vmlinuz for {release} under {root}")


def fetch_kernel(label: str, refresh: bool = False) -> Kernel:
    if label not in KERNELS:
        raise LabError(f"unknown kernel {label!r}; known: {', '.join(KERNELS)}")
    if not refresh:
        k = Kernel.load(label)
        if k is not None:
            return k
    lock_path = Kernel.stamp_path(label).parent / ".lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another make/pytest may be fetching the same kernel
        if not refresh:
            k = Kernel.load(label)
            if k is not None:
                return k
        return _fetch_kernel_locked(label)


def _fetch_kernel_locked(label: str) -> Kernel:
    src = KERNELS[label]
    t0 = time.monotonic()
    apt = PrivateApt(src)
    log(f"{label}: apt-get update ({src.suite}, private lists under {apt.base})")
    apt.update()
    release, pkgs = resolve_image_packages(apt)
    if not release.startswith(label + "."):
        log(f"warning: {src.suite} now ships {release}, not {label}.x; the label '{label}' is kept")
    base = Kernel.stamp_path(label).parent
    old = Kernel.load(label)
    if old is not None and old.release == release and len(old.packages) == len(pkgs):
        return old  # --refresh found nothing newer
    log(f"{label}: apt-get download {' '.join(pkgs)}")
    debs = apt.download(pkgs, base / "debs")
    # One tree per release: a guest still running on the previous release keeps its modules.
    root = base / release
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    for deb in debs:
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    # Merged-/usr packages (7.x) put modules under usr/lib/modules; give depmod and virtme the
    # classic path too.
    if (root / "usr/lib/modules").is_dir() and not (root / "lib").exists():
        (root / "lib").symlink_to("usr/lib")
    moddir = root / "lib/modules" / release
    if not moddir.is_dir():
        raise LabError(f"{label}: no modules at {moddir}")
    # Debian's postinst runs depmod on install; we unpack only, so run it here.
    subprocess.run(["depmod", "-a", "-b", str(root), release], check=True)
    vmlinuz = find_vmlinuz(root, release)
    k = Kernel(label=label, release=release, vmlinuz=vmlinuz, moddir=moddir,
               packages=[d.name for d in debs])
    k.save()
    for deb in debs:  # the unpacked tree is what we keep
        deb.unlink()
    log(f"{label}: {release} ready in {time.monotonic() - t0:.0f} s")
    return k


def get_kernel(label: str) -> Kernel:
    k = Kernel.load(label)
    if k is None:
        raise LabError(f"kernel {label} is not in the cache ({cache_dir()}); run 'make lab-kernels' "
                       f"(scripts/lab.py fetch)")
    return k


# --------------------------------------------------------------------------------------------------
# Profiles: the emulated machines
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Node:
    """One guest NUMA node, with the HMAT figures node0's CPUs see when they access its memory."""
    node_id: int
    mem_mib: int            # 0: no memory at boot (filled later, e.g. by kmem)
    cpus: str | None        # "0-1", or None for a CPU-less node
    latency_ns: int
    bandwidth_mb_s: int
    what: str


@dataclasses.dataclass(frozen=True)
class Nvdimm:
    name: str
    size_mib: int
    node_id: int            # proximity domain of the NVDIMM's address range (its kmem node)
    use: str


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    summary: str
    nodes: tuple[Node, ...]
    distances: tuple[tuple[int, int, int], ...] = ()
    nvdimms: tuple[Nvdimm, ...] = ()
    cxl_type3_mib: int = 0  # >0: one emulated CXL type-3 (persistent) device behind a CXL host bridge
    kernel_args: tuple[str, ...] = ()
    cpus: int = 2
    # >0: a memory pool several guests map at once: an NVDIMM in proximity domain ``shared_node``
    # backed by one host file with share=on (scripts/lab/pool/pair.py boots ``guests`` of them)
    shared_mib: int = 0
    shared_node: int = 1
    guests: int = 1

    @property
    def mem_mib(self) -> int:
        return sum(n.mem_mib for n in self.nodes)

    def with_node_mib(self, node_mib: int | None) -> "Profile":
        """This machine with each boot-time DRAM node (node0 with the CPUs, node1 CPU-less) sized
        ``node_mib`` MiB; nodes that start empty (kmem, CXL windows) are left alone. The default sizes
        (2 GiB each) let a 1.2 GiB pool fit in node0, which proves nothing about tiering."""
        if node_mib is None:
            return self
        if node_mib < MIN_NODE_MIB:
            raise LabError(f"--node-mib {node_mib}: a guest node needs at least {MIN_NODE_MIB} MiB")
        return dataclasses.replace(self, nodes=tuple(
            dataclasses.replace(n, mem_mib=node_mib) if n.mem_mib else n for n in self.nodes))

    def qemu_args(self, shared_file: Path | None = None, guestfwd: tuple[str, ...] = ()) -> list[str]:
        """The QEMU arguments that build this machine (added after virtme-ng's own). ``shared_file``:
        the host file behind the shared pool (``shared_mib``); ``guestfwd``: user-mode networking
        with ``restrict=on`` and these forwards (``tcp:IP:PORT-cmd:PROGRAM``), the guest's only network."""
        nvdimm = bool(self.nvdimms or self.shared_mib)
        machine = "hmat=on" + (",nvdimm=on" if nvdimm else "") + (",cxl=on" if self.cxl_type3_mib else "")
        args = ["-machine", machine]
        if nvdimm:
            extra = sum(d.size_mib for d in self.nvdimms) + self.shared_mib
            slots = len(self.nvdimms) + (1 if self.shared_mib else 0) + 2
            # NVDIMMs live in the device-memory (hotplug) area: it needs slots and room up to maxmem.
            args += ["-m", f"{self.mem_mib}M,slots={slots},"
                           f"maxmem={self.mem_mib + extra + 1024}M"]
        for n in self.nodes:
            node = f"node,nodeid={n.node_id}"
            if n.mem_mib:
                args += ["-object", f"memory-backend-ram,id=mem{n.node_id},size={n.mem_mib}M"]
                node += f",memdev=mem{n.node_id}"
            # A CPU-less node needs an initiator (the nearest CPU node) for HMAT.
            node += f",cpus={n.cpus}" if n.cpus else ",initiator=0"
            args += ["-numa", node]
        for src, dst, val in self.distances:
            args += ["-numa", f"dist,src={src},dst={dst},val={val}"]
        for n in self.nodes:
            hm = f"hmat-lb,initiator=0,target={n.node_id},hierarchy=memory"
            args += ["-numa", f"{hm},data-type=access-latency,latency={n.latency_ns}",
                     "-numa", f"{hm},data-type=access-bandwidth,bandwidth={n.bandwidth_mb_s}M"]
        for d in self.nvdimms:
            # share=off: the guest's writes stay in QEMU's private copy, so every boot starts from the
            # same (sparse, all-zero) file and concurrent guests can share it.
            args += ["-object", f"memory-backend-file,id={d.name}mem,share=off,"
                                f"mem-path={nvdimm_file(d)},size={d.size_mib}M",
                     "-device", f"nvdimm,id={d.name},memdev={d.name}mem,node={d.node_id}"]
        if self.cxl_type3_mib:
            # QEMU 7.2 (Debian 12) emulates persistent type-3 devices only (volatile came in 8.0): a
            # CXL host bridge (pxb-cxl), one root port, the device with its label storage area, and
            # a 4 GiB fixed memory window (CFMWS) the kernel turns into a NUMA node of its own.
            mem, lsa = cxl_files(self)
            args += ["-object", f"memory-backend-file,id=cxlmem0,share=off,mem-path={mem},"
                                f"size={self.cxl_type3_mib}M",
                     "-object", f"memory-backend-file,id=cxllsa0,share=off,mem-path={lsa},size=1M",
                     "-device", "pxb-cxl,bus_nr=12,bus=pcie.0,id=cxl.1",
                     "-device", "cxl-rp,port=0,bus=cxl.1,id=cxlrp0,chassis=0,slot=2",
                     "-device", "cxl-type3,bus=cxlrp0,memdev=cxlmem0,lsa=cxllsa0,id=cxl-pmem0",
                     "-machine", "cxl-fmw.0.targets.0=cxl.1,cxl-fmw.0.size=4G",
                     # Region commit flushes CPU caches (6.2+, cxl_region_invalidate_memregion) and
                     # refuses under a hypervisor: hide the CPUID hypervisor bit (TCG's WBINVD is a no-op).
                     "-cpu", "max,hypervisor=off"]
        if self.shared_mib:
            if shared_file is None:
                raise LabError(f"profile {self.name}: its shared pool needs a backing file "
                               "(scripts/lab/pool/pair.py boots it)")
            # share=on: every guest's stores land in the one host file, so the guests see each
            # other's writes (QEMU maps the file MAP_SHARED; under TCG there is no cache between).
            args += ["-object", f"memory-backend-file,id=poolmem,share=on,mem-path={shared_file},"
                                f"size={self.shared_mib}M",
                     "-device", f"nvdimm,id=pool,memdev=poolmem,node={self.shared_node}"]
        if guestfwd:
            # restrict=on: nothing reaches the host or beyond but the explicit forwards (libslirp
            # lets a restricted guest open only connections that match a guestfwd rule).
            args += ["-netdev", "user,id=lab0,restrict=on," + ",".join(f"guestfwd={g}" for g in guestfwd),
                     "-device", "virtio-net-pci,netdev=lab0"]
        return args


# Figures from the brief's table: local DRAM 400 GB/s, 70-100 ns; CXL DRAM one hop 120-200 GB/s,
# 200-500 ns; CXL PMem 40-80 GB/s, 1-3 us. (The kernel shows MB/s; QEMU's "M" suffix is MiB/s but it
# writes the figure it is given, so 400000M reads back as 400000.)
_DRAM = Node(0, 2048, "0-1", 100, 400_000, "local DRAM, both vCPUs")
_CXL = Node(1, 2048, None, 400, 150_000, "CXL DRAM: CPU-less")
_PMEM = Node(2, 0, None, 2000, 60_000, "CXL PMem: memory-less until the NVDIMM is onlined via kmem")
_POOL = Node(1, 0, None, 400, 150_000, "the CXL pool behind a switch: memory-less, its NVDIMM shared "
             "by every guest of the pair")

PROFILES: dict[str, Profile] = {
    "cxl": Profile(
        "cxl", "node0 = vCPUs + DRAM, node1 = CPU-less DRAM with CXL latency/bandwidth (HMAT)",
        nodes=(_DRAM, _CXL), distances=((0, 1, 20),)),
    "pmem": Profile(
        "pmem", "cxl + two file-backed NVDIMMs in proximity domain 2: nv0 for devdax -> kmem "
                "(node2, a lower tier), nv1 for fsdax with a filesystem mounted -o dax",
        nodes=(_DRAM, _CXL, _PMEM), distances=((0, 1, 20), (0, 2, 30), (1, 2, 25)),
        nvdimms=(Nvdimm("nv0", 1024, 2, "devdax -> system RAM (kmem)"),
                 Nvdimm("nv1", 512, 2, "fsdax, ext4 -o dax"))),
    "cxl-type3": Profile(
        "cxl-type3", "cxl + QEMU's emulated CXL type-3 memory device (persistent, 512 MiB) behind a "
                     "CXL host bridge with a 4 GiB fixed memory window: real /sys/bus/cxl paths",
        nodes=(_DRAM, _CXL), distances=((0, 1, 20),), cxl_type3_mib=512,
        # QEMU 7.2's type-3 device has no usable event-log interrupt; since 6.3 cxl_pci fails the probe
        # when MSI is there but the event IRQ setup fails ("Failed to get interrupt for event Info
        # log"), and skips event processing when there is no MSI at all.
        kernel_args=("pci=nomsi",)),
    "pool": Profile(
        "pool", "two hosts at once (a and b), each node0 = vCPUs + DRAM, both mapping one 1 GiB "
                "memory pool (an NVDIMM in proximity domain 1, one host file with share=on, devdax "
                "in each guest); etcd on the lab host's loopback through user-mode networking "
                "(restrict=on, guestfwd) only",
        nodes=(dataclasses.replace(_DRAM, mem_mib=1024), _POOL), distances=((0, 1, 20),),
        shared_mib=1024, shared_node=1, guests=2),
}


def cxl_files(p: Profile) -> tuple[Path, Path]:
    d = cache_dir() / "cxl"
    return d / f"type3-{p.cxl_type3_mib}M.img", d / "type3-lsa-1M.img"


def nvdimm_file(d: Nvdimm) -> Path:
    return cache_dir() / "nvdimm" / f"{d.name}-{d.size_mib}M.img"


def prepare_nvdimm_files(profile: Profile) -> None:
    files = [(nvdimm_file(d), d.size_mib) for d in profile.nvdimms]
    if profile.cxl_type3_mib:
        mem, lsa = cxl_files(profile)
        files += [(mem, profile.cxl_type3_mib), (lsa, 1)]
    for f, size_mib in files:
        if not f.exists() or f.stat().st_size != size_mib << 20:
            f.parent.mkdir(parents=True, exist_ok=True)
            with open(f, "wb") as fh:
                fh.truncate(size_mib << 20)  # sparse: costs no disk


# --------------------------------------------------------------------------------------------------
# Runner
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class LabResult:
    rc: int
    stdout: str
    stderr: str
    wall_s: float           # host wall time of the whole run: boot + command + shutdown
    out_dir: Path           # the guest's $LAB_OUT, on the host
    dmesg: str = ""         # the guest's kernel log after the command
    kernel_release: str = ""
    profile: str = ""
    boot_s: float = 0.0     # guest uptime when the script started (kernel + init + module loading)
    node_mib: int | None = None   # the DRAM node size asked for (None: the profile's own)


# One host thread runs all of a TCG guest's vCPUs, round robin (QEMU's default on x86 is one thread per
# vCPU, MTTCG). Alone, a guest is as fast either way (signal 6.1: 146.9 s single, 149 s MTTCG). Two side
# by side, as make test runs them, MTTCG puts four vCPU threads on the host's two cores: a vCPU spinning
# on a lock whose holder's thread is not running burns the core its holder needs, and two guests took
# longer than the same two one after the other (417 s against 345 s; dax and service 10 min each).
TCG_OPTS = ["-accel", "tcg,thread=single"]


def kvm_wanted() -> bool:
    """TCG unless TIERINGD_LAB_KVM=1 and /dev/kvm is usable: nested KVM hangs on the machines this
    project is built on, so it is opt-in."""
    if os.environ.get("TIERINGD_LAB_KVM") != "1":
        return False
    return os.access("/dev/kvm", os.R_OK | os.W_OK)


def vng_path() -> Path:
    for cand in (Path(sys.executable).parent / "vng", REPO / ".venv" / "bin" / "vng"):
        if cand.exists():
            return cand
    found = shutil.which("vng")
    if found:
        return Path(found)
    raise LabError("virtme-ng (vng) is not installed: make venv")


# Runs in the guest as root (virtme-ng's init runs it through /bin/sh). It runs the user's script with
# bash, stdout/stderr into files, then writes the exit code last (atomically), so a missing rc file means
# the guest never finished.
_GUEST_WRAPPER = r"""
R={rw}
cd {cwd} || exit 99
export LAB_OUT={out} LAB_PROFILE={profile} LAB_KERNEL={kernel} PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
# numpy's AVX2 (x86-64-v3) sort kernels return wrong orders under QEMU's TCG (numpy 2.4, QEMU 7.2:
# argsort of 16 random integers wrong every time, of 1000 in 60 % of tries; np.sort is right): the
# block table's np.unique(return_inverse=True) then credits samples to the wrong blocks. The guests
# run numpy's baseline kernels.
export NPY_DISABLE_CPU_FEATURES="X86_V3 X86_V4 AVX512_ICL AVX512_SPR"
# Guest-side setup every test can rely on: the kernel modules of the lab devices, tracefs.
for m in {modules}; do modprobe -q $m 2>/dev/null; done
mountpoint -q /sys/kernel/tracing || mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null
{net}
cut -d' ' -f1 /proc/uptime >$R/boot_s
{cached}
bash $R/script.sh </dev/null >$R/stdout 2>$R/stderr
echo $? >$R/rc.tmp
dmesg >$R/dmesg 2>/dev/null
sync
mv $R/rc.tmp $R/rc
sync
"""

# The Python trees every guest runs from, read through a second 9p share of the host root that the
# guest page-caches (cache=loose), bound over the originals. virtme-ng's root share is cache=none (its
# initramfs mounts it with fixed options): every stat and read of an import, and every font read by
# FreeType, is a virtio round trip, each one slow under TCG. Measured on cxl/6.12, 2026-12-02:
# ``import numpy, tieringd.daemon`` 7.7-9.6 s → 3.9-6.4 s, ``tieringctl --help`` 15.4 s → 7.3-10.2 s,
# one ``heatmap --png`` picture 85 s → 8-12 s (docs/lab.md). Read-only trees only: nothing the host
# writes while a guest runs is read through the cache, and the runs folder (--rwdir) is never under it.
CACHED_TAG = "labcached"
CACHED_MOUNT = "/run/lab-cached"


def cached_trees() -> tuple[str, ...]:
    """The venv, the interpreter's standard library and the project's package, where they exist."""
    trees = (REPO / ".venv", Path(sysconfig.get_path("stdlib")), REPO / "tieringd")
    return tuple(str(t.resolve()) for t in trees if t.is_dir())


def _cached_mounts(trees: tuple[str, ...]) -> str:
    """Wrapper lines that mount the cached share and bind each tree; a failure leaves the plain share."""
    if not trees:
        return ""
    binds = " && ".join(f"mount --bind {shlex.quote(CACHED_MOUNT + t)} {shlex.quote(t)}" for t in trees)
    return (f"mkdir -p {CACHED_MOUNT} && mount -t 9p -o trans=virtio,version=9p2000.L,access=any,"
            f"msize=512000,cache=loose,ro {CACHED_TAG} {CACHED_MOUNT} && {binds} "
            f"|| echo 'lab: cached Python trees not mounted; imports read the plain share' >&2")


NVDIMM_MODULES = ("nfit", "nd_pmem", "dax_pmem", "device_dax", "kmem")
CXL_MODULES = ("cxl_acpi", "cxl_port", "cxl_pci", "cxl_mem", "cxl_pmem", "nd_pmem", "dax_pmem",
               "device_dax", "kmem")


def guest_modules(p: Profile) -> tuple[str, ...]:
    """Modules loaded before the script (udev would load most, but not before the script starts)."""
    mods: tuple[str, ...] = ()
    if p.nvdimms or p.shared_mib:
        mods += NVDIMM_MODULES
    if p.cxl_type3_mib:
        mods += tuple(m for m in CXL_MODULES if m not in mods)
    return mods


# The guest's one network interface (user-mode networking, restrict=on): a fixed address in slirp's
# 10.0.2.0/24, no route beyond it; the guestfwd addresses are in that network.
_GUEST_NET = r"""modprobe -q virtio_net 2>/dev/null
ip link set lo up
IF=$(ls /sys/class/net | grep -vx lo | head -n1)
[ -n "$IF" ] && ip link set "$IF" up && ip addr add 10.0.2.15/24 dev "$IF" || echo "lab: no network interface" >&2
"""


def _env_lines(env: dict[str, str]) -> str:
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in children.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    """Kill vng and everything under it (QEMU) by PID, then the process group for good measure."""
    pids = _descendants(proc.pid) + [proc.pid]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _boot(cmd: list[str], env: dict, log_path: Path, timeout_s: float, what: str) -> int:
    """Run vng to completion; kill it and QEMU by PID on timeout or any exception."""
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                env=env, cwd=REPO, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            raise LabError(f"{what}: guest did not finish in {timeout_s:.0f} s (killed); "
                           f"log: {log_path}\n{_tail(log_path)}") from None
        except BaseException:  # KeyboardInterrupt, SystemExit from SIGTERM: never leave QEMU behind
            _kill_tree(proc)
            raise
        finally:
            if proc.poll() is None or _descendants(proc.pid):
                _kill_tree(proc)


def host_failed(rw: Path, returncode: int) -> bool:
    """Did vng fail on the host rather than the guest fail? True when the guest left no exit code
    and either vng was killed by a signal or the guest never reached the wrapper's first write
    (``boot_s``). Seen in CI: vng exit 255 after 5.3 s with an empty log, between two good boots of
    the same profile and kernel — a clock (the old "< 5 s" rule) cannot tell that from a guest
    that booted and died, the wrapper's own mark can. A guest that ran the script is never
    retried: its failure is the test's."""
    if (rw / "rc").exists():
        return False
    return returncode < 0 or not (rw / "boot_s").exists()


# virtme-ng's init mounts a fresh tmpfs on these in the guest (virtme/guest/virtme-init, 1.42), so a
# checkout below one of them is not there: the guest cannot change into it and vng exits 255 with
# nothing in its log.
GUEST_HIDDEN_DIRS = ("/var/tmp", "/var/log", "/run", "/dev/shm")


def check_visible_in_guest(path: Path) -> None:
    """Raise LabError when the guests cannot see ``path`` (the checkout: they run it over 9p)."""
    real = str(Path(path).resolve())
    for hidden in GUEST_HIDDEN_DIRS:
        if real == hidden or real.startswith(hidden + "/"):
            raise LabError(f"the checkout {real} is under {hidden}, which the lab's guests see as an "
                           "empty tmpfs (virtme-ng mounts one there): clone it elsewhere, e.g. under "
                           "your home or /srv")


def run(script: str, profile: str = DEFAULT_PROFILE, kernel: str = DEFAULT_KERNEL,
        timeout_s: float = 300, out_dir: Path | None = None, cpus: int | None = None,
        append: tuple[str, ...] = (), node_mib: int | None = None, shared_file: Path | None = None,
        guestfwd: tuple[str, ...] = (), env: dict[str, str] | None = None,
        rwdirs: tuple[Path, ...] = ()) -> LabResult:
    """Boot a fresh guest of ``profile`` on ``kernel``, run ``script`` (bash, as root, cwd = the repo)
    and return its exit code, stdout, stderr. ``$LAB_OUT`` in the guest is ``out_dir`` on the host
    (a fresh folder when not given). ``node_mib`` sizes the DRAM nodes (:meth:`Profile.with_node_mib`).
    ``shared_file``, ``guestfwd``, ``env`` and ``rwdirs`` (host folders the guest may write) are what
    a guest of a pair needs (scripts/lab/pool/pair.py). Raises LabError when the guest does not finish
    in ``timeout_s`` or never ran the script."""
    if profile not in PROFILES:
        raise LabError(f"unknown profile {profile!r}; known: {', '.join(PROFILES)}")
    check_visible_in_guest(REPO)
    prof = PROFILES[profile].with_node_mib(node_mib)
    k = get_kernel(kernel)
    prepare_nvdimm_files(prof)
    runs = cache_dir() / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    rw = Path(tempfile.mkdtemp(prefix=f"{profile}-{kernel}-", dir=runs))
    if out_dir is None:
        out = rw / "out"
        out.mkdir()
    else:
        out = Path(out_dir).resolve()
        out.mkdir(parents=True, exist_ok=True)  # shared with the guest by its own --rwdir below
    (rw / "script.sh").write_text(script)
    (rw / "wrapper.sh").write_text(_GUEST_WRAPPER.format(
        rw=shlex.quote(str(rw)), out=shlex.quote(str(out)), cwd=shlex.quote(str(REPO)), profile=profile, kernel=kernel,
        modules=" ".join(guest_modules(prof)), cached=_cached_mounts(cached_trees()),
        net=(_GUEST_NET if guestfwd else "") + _env_lines(env or {})))
    # the cached share first: a device added after the profile's lands on its last bus (pxb-cxl for
    # cxl-type3, which takes bridges only)
    qemu_opts = ["-virtfs", f"local,path=/,mount_tag={CACHED_TAG},security_model=none,readonly=on,"
                 "multidevs=remap"] + prof.qemu_args(shared_file, guestfwd)
    for tok in qemu_opts:  # vng joins --qemu-opts into a shell command line unquoted
        if shlex.quote(tok) != tok:
            raise LabError(f"QEMU argument needs quoting, which vng cannot pass: {tok!r}")
    cmd = [str(vng_path()), "--run", str(k.vmlinuz), "--user", "root", "--force-9p",
           "--disable-microvm", "--cwd", str(REPO), "--cpus", str(cpus or prof.cpus),
           "--memory", f"{prof.mem_mib}M", "--rwdir", str(rw)]
    if out_dir is not None:
        cmd += ["--rwdir", str(out)]
    for d in rwdirs:
        cmd += ["--rwdir", str(d)]
    if not kvm_wanted():
        cmd.append("--disable-kvm")
        qemu_opts += TCG_OPTS
    for a in prof.kernel_args + tuple(append):
        cmd += ["--append", a]
    cmd += ["--qemu-opts=" + " ".join(qemu_opts), "--exec", f"sh {shlex.quote(str(rw / 'wrapper.sh'))}"]
    env = dict(os.environ)
    env["PATH"] = f"{vng_path().parent}:{env.get('PATH', '/usr/bin:/bin')}"
    t0 = time.monotonic()
    for attempt in (1, 2):
        log_path = rw / f"vng-{attempt}.log"
        t_boot = time.monotonic()
        returncode = _boot(cmd, env, log_path, timeout_s, f"{profile}/{kernel}")
        if attempt == 2 or not host_failed(rw, returncode):
            break
        log(f"{profile}/{kernel}: vng exited {returncode} after {time.monotonic() - t_boot:.1f} s "
            "before the guest ran its script; retrying once")
    wall = time.monotonic() - t0
    rc_file = rw / "rc"
    if not rc_file.exists():
        raise LabError(f"{profile}/{kernel}: the guest never finished the script (vng exit "
                       f"{returncode}); log: {log_path}\n{_tail(log_path)}")
    return LabResult(rc=int(rc_file.read_text().strip() or "-1"),
                     stdout=_read(rw / "stdout"), stderr=_read(rw / "stderr"), wall_s=wall,
                     out_dir=out, dmesg=_read(rw / "dmesg"), kernel_release=k.release,
                     profile=profile, boot_s=float(_read(rw / "boot_s").strip() or 0),
                     node_mib=node_mib)


def _read(p: Path) -> str:
    try:
        return p.read_text(errors="replace")
    except OSError:
        return ""


def _tail(p: Path, n: int = 30) -> str:
    return "\n".join(_read(p).splitlines()[-n:])


def prune_runs(keep: int = 20, min_age_s: float = 3 * 3600) -> None:
    """Run folders (script, outputs, logs) are kept for post-mortems: the latest ``keep``, and any
    younger than ``min_age_s`` (another process may be using it: runs are not locked)."""
    runs = cache_dir() / "runs"
    if not runs.is_dir():
        return
    with open(runs / ".prune.lock", "w") as lock:
        try:  # make test's two workers start together: one prunes, the other need not wait for it
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return
        now = time.time()
        aged = sorted((mtime, d) for d in runs.iterdir() if (mtime := _mtime(d)) is not None)
        for mtime, d in aged[:-keep] if keep else aged:
            if now - mtime > min_age_s:
                shutil.rmtree(d, ignore_errors=True)


def _mtime(run_dir: Path) -> float | None:
    """A run folder's mtime, or None if it is not one (or has just been removed)."""
    try:
        st = run_dir.stat()
    except FileNotFoundError:
        return None
    return st.st_mtime if stat.S_ISDIR(st.st_mode) else None


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------

def cmd_fetch(args: argparse.Namespace) -> int:
    for label in args.kernel or list(KERNELS):
        k = fetch_kernel(label, refresh=args.refresh)
        if args.verbose:
            log(f"{label}: {k.release} ({k.vmlinuz})")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise LabError("nothing to run: lab.py run --profile P --kernel K -- CMD...")
    # One word is a shell command line (make lab CMD='a | b'); several are an argv.
    script = command[0] if len(command) == 1 else shlex.join(command)
    prune_runs()
    if PROFILES[args.profile].guests > 1:
        return _run_pair(args, script)
    r = run(script + "\n", profile=args.profile, kernel=args.kernel, timeout_s=args.timeout,
            node_mib=args.node_mib)
    sys.stdout.write(r.stdout)
    sys.stderr.write(r.stderr)
    sized = f", DRAM nodes {args.node_mib} MiB" if args.node_mib else ""
    log(f"{args.profile}/{args.kernel} ({r.kernel_release}{sized}): exit {r.rc} in {r.wall_s:.1f} s "
        f"(guest booted in {r.boot_s:.1f} s)")
    return r.rc


def _run_pair(args: argparse.Namespace, script: str) -> int:
    """A two-host profile: the command in both guests at once, an etcd cluster on the loopback for
    them (scripts/lab/pool/pair.py); each guest's output is printed under its host's name."""
    sys.path.insert(0, str(REPO / "scripts" / "lab" / "pool"))
    import etcdcluster
    import pair
    with tempfile.TemporaryDirectory(prefix="lab-etcd-") as d:
        try:
            etcd = etcdcluster.EtcdCluster(Path(d)).start()
        except etcdcluster.EtcdError as e:
            raise LabError(str(e)) from None
        try:
            results = pair.run_pair(sys.modules[__name__], {h: script + "\n" for h in pair.HOSTS},
                                    endpoints=etcd.endpoints, profile=args.profile, kernel=args.kernel,
                                    timeout_s=args.timeout, node_mib=args.node_mib)
        finally:
            etcd.stop()
    for h, r in results.items():
        print(f"==== host {h}: exit {r.rc} in {r.wall_s:.1f} s (guest booted in {r.boot_s:.1f} s)")
        sys.stdout.write(r.stdout)
        sys.stderr.write(r.stderr)
    return max(r.rc for r in results.values())


# The sysfs fixture trees the topology unit tests read (tests/fixtures/sysfs/<profile>-<kernel>/),
# each with the guest-side preparation that makes it interesting.
CAPTURES: dict[tuple[str, str], str] = {
    ("cxl", "6.1"): "",
    ("cxl", "6.12"): "",
    ("cxl", "7.3"): "",
    # nv0 onlined as node2 through kmem, nv1 as fsdax mounted -o dax: every DAX flavour at once.
    ("pmem", "6.12"): "scripts/lab/pmem.sh kmem >/dev/null\nscripts/lab/pmem.sh fsdax >/dev/null\n",
    # A CXL pmem region on the emulated type-3 device, onlined via kmem: real /sys/bus/cxl paths.
    ("cxl-type3", "6.12"): "scripts/lab/pmem.sh cxl-kmem >/dev/null\n",
}
FIXTURES = REPO / "tests" / "fixtures" / "sysfs"


def capture(profile: str, kernel: str, dest_root: Path = FIXTURES, timeout_s: float = 600) -> Path:
    """Boot ``profile``/``kernel``, prepare it, run scripts/capture-sysfs.py inside and replace
    ``dest_root/<profile>-<kernel>`` with the captured tree."""
    name = f"{profile}-{kernel}"
    prep = CAPTURES.get((profile, kernel), "")
    script = (f"set -e\n{prep}python3 scripts/capture-sysfs.py --label 'lab {name}' \"$LAB_OUT/tree\"\n")
    r = run(script, profile=profile, kernel=kernel, timeout_s=timeout_s)
    if r.rc != 0:
        raise LabError(f"capture {name} failed ({r.rc}):\n{r.stdout}{r.stderr}")
    dest = dest_root / name
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(r.out_dir / "tree", dest, symlinks=True)
    return dest


def cmd_capture(args: argparse.Namespace) -> int:
    if not (REPO / "scripts" / "capture-sysfs.py").exists():
        raise LabError("scripts/capture-sysfs.py is missing")
    wanted = [(p, k) for p, k in CAPTURES
              if (not args.profile or p in args.profile) and (not args.kernel or k in args.kernel)]
    if not wanted:
        raise LabError(f"no capture matches; known: {', '.join(f'{p}/{k}' for p, k in CAPTURES)}")
    prune_runs()
    for profile, kernel in wanted:
        t0 = time.monotonic()
        dest = capture(profile, kernel)
        size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file() and not f.is_symlink())
        log(f"{profile}/{kernel}: {dest.relative_to(REPO)} ({size >> 10} KiB) in "
            f"{time.monotonic() - t0:.0f} s")
    return 0


def cmd_profiles(args: argparse.Namespace) -> int:
    for p in PROFILES.values():
        print(f"{p.name}: {p.summary}")
        for n in p.nodes:
            print(f"  node{n.node_id}: {n.mem_mib} MiB, cpus {n.cpus or '-'}, "
                  f"{n.latency_ns} ns, {n.bandwidth_mb_s} MB/s  ({n.what})")
        for d in p.nvdimms:
            print(f"  {d.name}: {d.size_mib} MiB NVDIMM, proximity domain {d.node_id}: {d.use}")
        if p.shared_mib:
            print(f"  pool: {p.shared_mib} MiB NVDIMM in proximity domain {p.shared_node}, one host file "
                  f"share=on, mapped by {p.guests} guests at once")
        if args.verbose:
            shared = Path("PAIR_DIR/pool.img") if p.shared_mib else None
            fwd = ("tcp:10.0.2.100:2379-cmd:PAIR_DIR/fwd-PORT",) if p.guests > 1 else ()
            print("  qemu: " + " ".join(p.qemu_args(shared, fwd)))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lab.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="download and unpack the lab kernels (idempotent)")
    f.add_argument("--kernel", action="append", choices=list(KERNELS))
    f.add_argument("--refresh", action="store_true", help="check the archive for a newer release")
    f.add_argument("-v", "--verbose", action="store_true")
    f.set_defaults(func=cmd_fetch)
    r = sub.add_parser("run", help="run a command in a fresh guest and print its output")
    r.add_argument("--profile", default=DEFAULT_PROFILE, choices=list(PROFILES))
    r.add_argument("--kernel", default=DEFAULT_KERNEL, choices=list(KERNELS))
    r.add_argument("--timeout", type=float, default=600, help="seconds (default 600)")
    r.add_argument("--node-mib", type=int, metavar="MIB",
                   help="size of each boot-time DRAM node (node0 with the CPUs, node1 CPU-less); "
                        "default: the profile's (2048)")
    r.add_argument("command", nargs=argparse.REMAINDER)
    r.set_defaults(func=cmd_run)
    c = sub.add_parser("capture", help="re-capture the sysfs fixture trees under tests/fixtures/sysfs")
    c.add_argument("--profile", action="append", choices=list(PROFILES))
    c.add_argument("--kernel", action="append", choices=list(KERNELS))
    c.set_defaults(func=cmd_capture)
    p = sub.add_parser("profiles", help="describe the profiles")
    p.add_argument("-v", "--verbose", action="store_true", help="also print the QEMU arguments")
    p.set_defaults(func=cmd_profiles)
    args = ap.parse_args(argv)

    def _terminate(signum, frame):  # SIGTERM unwinds like Ctrl-C, so run() kills its QEMU
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        return args.func(args)
    except LabError as e:
        log(f"error: {e}")
        return 2
    except KeyboardInterrupt:
        log("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
