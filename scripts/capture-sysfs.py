#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Snapshot the subset of /sys and /proc that tieringd reads, as a fixture tree.

    scripts/capture-sysfs.py OUTDIR            # e.g. tests/fixtures/sysfs/host-6.18

The tree mirrors the kernel paths (OUTDIR/sys/..., OUTDIR/proc/...), so that
``TIERINGD_FS_ROOT=OUTDIR tieringctl numa`` reads it as if it were the live machine.

What is kept:
  - /sys/devices/system/node: node dirs (cpulist, meminfo, distance, numastat, vmstat, hugepages,
    access0/access1 HMAT figures and initiator/target links, memory_side_cache), has_* masks;
  - /sys/devices/virtual/memory_tiering (memory_tierN/nodelist);
  - /sys/bus/{dax,nd,cxl}: device and driver links, and the device directories they point to, with
    each ancestor directory's own attributes (so a dax device shows that it sits on an nd region, a
    CXL region or an hmem platform device);
  - /sys/kernel/mm/{numa,mempolicy}, /sys/devices/system/memory/{block_size_bytes,auto_online_blocks},
    /sys/devices/system/cpu/{online,possible};
  - /proc/meminfo, /proc/vmstat, /proc/zoneinfo, /proc/buddyinfo, the NUMA sysctls, and the lines of
    /proc/self/mountinfo that matter here (dax mounts, pmem devices, pseudo filesystems).

Symlinks are recreated with their (relative) sysfs targets, so ``os.path.realpath`` under OUTDIR
lands on the captured device directory. Unreadable, write-only, binary or large files are left out
(listed in OUTDIR/capture.json). Git keeps no empty directories, so an empty one gets a ``.keep``
file; readers should glob for the names they expect (``dax*``), not list everything.

Standard library only, Python >= 3.7: it runs inside the lab guests too.
"""
import argparse
import datetime
import json
import os
import platform
import re
import shutil
import stat
import sys

SYS_SRC = "/"                 # prefix of the live tree (tests point it elsewhere)
MAX_FILE = 64 * 1024          # larger files are left out
MAX_DEPTH = 6                 # recursion into a device subtree
MAX_ENTRIES = 400             # entries per directory before the rest is left out

# Never read these (side effects, binary, or big): PCI config space and BARs, firmware upload
# interfaces, trigger files, the kernel's per-node memory block links.
SKIP_NAMES = re.compile(
    r"^(config|rom|vpd|remove|rescan|reset|resource\d+(_wc)?|CDAT|data|loading|"
    r"trigger_.*|compact|reclaim|new_id|remove_id|bind|unbind|uevent_seqnum)$")
SKIP_DIRS = re.compile(r"^(power|firmware|firmware_node|msi_irqs|wakeup\d*|iommu|iommu_group|"
                       r"consumer:.*|supplier:.*|queue|mq|trace|integrity|holders|slaves|bdi)$")
NODE_NOISE = re.compile(r"^(memory\d+|cpu\d+)$")    # nodeN/memoryM, nodeN/cpuM links
CAPTURE_LINK_TARGETS = ("/sys/devices/", "/sys/bus/")

# Mounts that tieringd looks at; the rest of the host's mount table is left out.
MOUNT_FSTYPES = {"proc", "sysfs", "tracefs", "debugfs", "bpf", "cgroup2", "hugetlbfs", "devtmpfs"}

ROOT_FILES = [
    "/proc/meminfo", "/proc/vmstat", "/proc/zoneinfo", "/proc/buddyinfo", "/proc/version",
    "/proc/sys/kernel/osrelease",
    "/proc/sys/kernel/numa_balancing", "/proc/sys/kernel/numa_balancing_promote_rate_limit_MBps",
    "/proc/sys/vm/zone_reclaim_mode",
    "/sys/devices/system/memory/block_size_bytes", "/sys/devices/system/memory/auto_online_blocks",
    "/sys/devices/system/cpu/online", "/sys/devices/system/cpu/possible",
    "/sys/devices/system/cpu/present",
]
# Directories copied recursively (their symlinks are recreated and, when they point into
# /sys/devices or /sys/bus, followed).
ROOT_TREES = [
    "/sys/devices/system/node",
    "/sys/devices/virtual/memory_tiering",
    "/sys/kernel/mm/numa",
    "/sys/kernel/mm/mempolicy",
    "/sys/bus/dax",
    "/sys/bus/nd",
    "/sys/bus/cxl",
]


class Capture:
    def __init__(self, src, out):
        self.src = src.rstrip("/")
        self.out = out
        self.files = 0
        self.links = 0
        self.skipped = []          # [kernel path, reason]
        self.done_dirs = set()     # kernel paths of directories already copied recursively
        self.attr_dirs = set()     # kernel paths whose own attributes were copied
        self.pending = []          # kernel directories to copy recursively (link targets)
        self.missing = []          # ROOT_TREES / ROOT_FILES absent on this machine

    # -- paths ---------------------------------------------------------------------------------
    def live(self, kpath):
        return self.src + kpath if self.src else kpath

    def dest(self, kpath):
        return os.path.join(self.out, kpath.lstrip("/"))

    def skip(self, kpath, reason):
        self.skipped.append([kpath, reason])

    # -- copying -------------------------------------------------------------------------------
    def copy_file(self, kpath, st=None):
        name = os.path.basename(kpath)
        if SKIP_NAMES.match(name):
            return
        try:
            st = st or os.lstat(self.live(kpath))
        except OSError as e:
            self.skip(kpath, e.strerror)
            return
        if not stat.S_ISREG(st.st_mode):
            return
        if not st.st_mode & 0o444:
            return                                   # write-only attribute
        if st.st_size > MAX_FILE and not kpath.startswith("/proc/"):
            self.skip(kpath, "larger than %d bytes" % MAX_FILE)
            return
        try:
            with open(self.live(kpath), "rb") as f:
                data = f.read(MAX_FILE + 1)
        except OSError as e:
            self.skip(kpath, e.strerror or str(e))
            return
        if len(data) > MAX_FILE:
            self.skip(kpath, "larger than %d bytes" % MAX_FILE)
            return
        if b"\0" in data:
            self.skip(kpath, "binary")
            return
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            self.skip(kpath, "binary")
            return
        d = self.dest(kpath)
        os.makedirs(os.path.dirname(d), exist_ok=True)
        with open(d, "wb") as f:
            f.write(data)
        self.files += 1

    def copy_link(self, kpath, follow):
        try:
            target = os.readlink(self.live(kpath))
        except OSError as e:
            self.skip(kpath, e.strerror)
            return
        d = self.dest(kpath)
        os.makedirs(os.path.dirname(d), exist_ok=True)
        if os.path.lexists(d):
            os.unlink(d)
        if os.path.isabs(target):
            # sysfs links are relative; an absolute one would point out of the fixture tree
            target = os.path.relpath(target, os.path.dirname(kpath))
        os.symlink(target, d)
        self.links += 1
        if follow:
            resolved = os.path.normpath(os.path.join(os.path.dirname(kpath), target))
            if resolved.startswith(CAPTURE_LINK_TARGETS) and os.path.isdir(self.live(resolved)):
                self.pending.append(resolved)

    def copy_attrs(self, kpath):
        """The regular files (and driver/subsystem links) directly in ``kpath``."""
        if kpath in self.attr_dirs or kpath in self.done_dirs:
            return
        self.attr_dirs.add(kpath)
        try:
            names = sorted(os.listdir(self.live(kpath)))
        except OSError as e:
            self.skip(kpath, e.strerror)
            return
        os.makedirs(self.dest(kpath), exist_ok=True)
        for name in names[:MAX_ENTRIES]:
            p = kpath.rstrip("/") + "/" + name
            try:
                st = os.lstat(self.live(p))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                self.copy_file(p, st)
            elif stat.S_ISLNK(st.st_mode) and name in ("driver", "subsystem"):
                self.copy_link(p, follow=False)

    def copy_tree(self, kpath, depth=0, in_node_dir=False):
        if kpath in self.done_dirs:
            return
        self.done_dirs.add(kpath)
        try:
            names = sorted(os.listdir(self.live(kpath)))
        except OSError as e:
            self.skip(kpath, e.strerror)
            return
        os.makedirs(self.dest(kpath), exist_ok=True)
        if len(names) > MAX_ENTRIES:
            self.skip(kpath, "%d entries, kept the first %d" % (len(names), MAX_ENTRIES))
            names = names[:MAX_ENTRIES]
        node_dir = re.search(r"/sys/devices/system/node/node\d+$", kpath) is not None
        for name in names:
            p = kpath.rstrip("/") + "/" + name
            try:
                st = os.lstat(self.live(p))
            except OSError:
                continue
            if stat.S_ISLNK(st.st_mode):
                if node_dir and NODE_NOISE.match(name):
                    continue
                # follow device links out of the bus directories; others are kept as plain links
                follow = name not in ("subsystem", "driver", "module", "firmware_node", "port",
                                      "iommu", "iommu_group", "of_node")
                follow = follow and (kpath.startswith("/sys/bus/") or name.startswith("dax")
                                     or kpath.startswith("/sys/devices/virtual/memory_tiering"))
                self.copy_link(p, follow=follow)
            elif stat.S_ISDIR(st.st_mode):
                if SKIP_DIRS.match(name):
                    continue
                if depth + 1 > MAX_DEPTH:
                    self.skip(p, "deeper than %d levels" % MAX_DEPTH)
                    continue
                self.copy_tree(p, depth + 1)
            elif stat.S_ISREG(st.st_mode):
                self.copy_file(p, st)

    def copy_device(self, kpath):
        """A device directory a bus link points to: its subtree, and its ancestors' attributes."""
        parent = os.path.dirname(kpath)
        while parent not in ("/sys/devices", "/sys", "/", ""):
            self.copy_attrs(parent)
            parent = os.path.dirname(parent)
        self.copy_tree(kpath, depth=1)

    # -- special files ------------------------------------------------------------------------
    def copy_mountinfo(self):
        kpath = "/proc/self/mountinfo"
        try:
            with open(self.live(kpath), encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()
        except OSError as e:
            self.missing.append(kpath)
            self.skip(kpath, e.strerror)
            return
        kept = []
        for line in lines:
            pre, sep, post = line.partition(" - ")
            fields, tail = pre.split(), post.split()
            if not sep or len(fields) < 6 or len(tail) < 3:
                continue
            mountpoint, mount_opts = fields[4], fields[5]
            fstype, source, super_opts = tail[0], tail[1], tail[2]
            opts = set(mount_opts.split(",")) | set(super_opts.split(","))
            if (fstype in MOUNT_FSTYPES or mountpoint == "/" or "dax" in opts
                    or any(o.startswith("dax=") for o in opts) or source.startswith("/dev/pmem")
                    or fstype == "tmpfs" and mountpoint == "/dev/shm"):
                kept.append(line)
        d = self.dest(kpath)
        os.makedirs(os.path.dirname(d), exist_ok=True)
        with open(d, "w", encoding="utf-8") as f:
            f.write("\n".join(kept) + ("\n" if kept else ""))
        self.files += 1

    def run(self):
        for kpath in ROOT_FILES:
            if os.path.exists(self.live(kpath)):
                self.copy_file(kpath)
            else:
                self.missing.append(kpath)
        self.copy_mountinfo()
        for kpath in ROOT_TREES:
            if os.path.isdir(self.live(kpath)):
                self.copy_tree(kpath)
            else:
                self.missing.append(kpath)
        while self.pending:
            kpath = self.pending.pop(0)
            if kpath.startswith("/sys/bus/"):
                self.copy_tree(kpath)
            else:
                self.copy_device(kpath)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", help="fixture directory to create (its sys/ and proc/ are replaced)")
    ap.add_argument("--source", default="/", help=argparse.SUPPRESS)   # tests: capture a tree
    ap.add_argument("--label", default="", help="free text recorded in capture.json (lab profile)")
    args = ap.parse_args(argv)

    out = os.path.abspath(args.outdir)
    for sub in ("sys", "proc"):
        if os.path.isdir(os.path.join(out, sub)):
            shutil.rmtree(os.path.join(out, sub))
    os.makedirs(out, exist_ok=True)
    cap = Capture("" if args.source == "/" else os.path.abspath(args.source), out)
    cap.run()
    for dirpath, dirnames, filenames in os.walk(out):
        if not dirnames and not filenames:            # git keeps no empty directories
            open(os.path.join(dirpath, ".keep"), "w").close()

    manifest = {
        "schema": "tieringd.sysfs-capture/1",
        "captured": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "kernel": platform.release() if args.source == "/" else None,
        "machine": platform.machine(),
        "label": args.label,
        "files": cap.files,
        "links": cap.links,
        "missing": cap.missing,
        "skipped": cap.skipped[:200],
        "skipped_total": len(cap.skipped),
    }
    with open(os.path.join(out, "capture.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    print("captured %d files, %d links into %s (%d left out, %d absent)"
          % (cap.files, cap.links, out, len(cap.skipped), len(cap.missing)), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
