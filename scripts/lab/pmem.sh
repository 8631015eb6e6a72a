#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Guest-side helpers for the lab's `pmem` profile (run as root inside the guest; docs/lab.md).
#
#   scripts/lab/pmem.sh kmem  [NAMESPACE]              devdax -> system RAM (tieringctl dax online); prints the node
#   scripts/lab/pmem.sh fsdax [NAMESPACE] [MOUNTPOINT]  fsdax + ext4 mounted -o dax; prints the mountpoint
#   scripts/lab/pmem.sh devdax [NAMESPACE]              devdax only (udev/the listener may online it); prints daxX.Y
#   scripts/lab/pmem.sh cxl-kmem [MEMDEV]               cxl-type3 profile: CXL pmem region -> devdax -> kmem
#   scripts/lab/pmem.sh cxl-devdax [MEMDEV]             the same, not onlined; prints daxX.Y
#
# Defaults: namespace0.0 (nv0, 1 GiB) for kmem, namespace1.0 (nv1, 512 MiB) for fsdax, /tmp/pmem.
# Both NVDIMMs sit in proximity domain 2, so the kmem memory becomes node2 (HMAT: 2000 ns, 60 GB/s).
set -euo pipefail

die() { echo "pmem.sh: $*" >&2; exit 1; }
need() { command -v "$1" >/dev/null || die "$1 is not installed (apt-get install $2)"; }

repo=$(cd "$(dirname "$0")/../.." && pwd)
tieringctl=$repo/.venv/bin/tieringctl
[ -x "$tieringctl" ] || die "$tieringctl is missing (make install)"

modprobe -q nd_pmem 2>/dev/null || true
modprobe -q dax_pmem 2>/dev/null || true
modprobe -q kmem 2>/dev/null || true

# Online a devdax device as system RAM (kmem); prints its NUMA node. The same path as the udev rules
# (udev/60-tieringd.rules): kmem bound with the kernel's auto-online policy held at "offline" (Debian's
# 6.12+ kernels are built with CONFIG_MHP_DEFAULT_ONLINE_TYPE_ONLINE_AUTO: the kernel would online the
# blocks itself, into a zone of its choosing, and daxctl reconfigure-device refuses with "kernel policy
# will auto-online memory, aborting"), then every block onlined ZONE_MOVABLE, the policy restored.
online_dax() {
    local dax=$1
    # Where udev runs, its rule may be onlining the device right now: let it finish first.
    if [ -S /run/udev/control ] && command -v udevadm >/dev/null; then udevadm settle --timeout=60 || true; fi
    "$tieringctl" dax online "$dax" >/dev/null || die "tieringctl dax online $dax failed"
    cat /sys/bus/dax/devices/"$dax"/target_node
}

chardev() { sed -n 's/.*"chardev":"\(dax[0-9.]*\)".*/\1/p' | head -1; }

# A devdax namespace (not onlined); prints the dax device.
devdax() {
    local ns=${1:-namespace0.0} dax
    need ndctl ndctl
    dax=$(ndctl create-namespace --force --reconfig="$ns" --mode=devdax --map=dev | chardev)
    [ -n "$dax" ] || die "no dax device for $ns"
    echo "$dax"
}

kmem() {
    local dax
    dax=$(devdax "$@")
    online_dax "$dax"
}

# cxl-type3 profile: a pmem region on the CXL memdev and a devdax namespace on it (not onlined);
# prints the dax device.
cxl_devdax() {
    local memdev=${1:-mem0} region dax
    need cxl ndctl; need ndctl ndctl
    cxl create-region --memdevs --type=pmem --decoder=decoder0.0 --ways=1 "$memdev" >/dev/null ||
        die "cxl create-region on $memdev failed"
    region=$(ndctl list --regions | sed -n 's/.*"dev":"\(region[0-9]*\)".*/\1/p' | tail -1)
    [ -n "$region" ] || die "no nd region for the CXL region"
    dax=$(ndctl create-namespace --region="$region" --mode=devdax --map=dev | chardev)
    [ -n "$dax" ] || die "no dax device on $region"
    echo "$dax"
}

cxl_kmem() {
    local dax
    dax=$(cxl_devdax "$@")
    online_dax "$dax"
}

fsdax() {
    local ns=${1:-namespace1.0} mnt=${2:-/tmp/pmem} dev
    need ndctl ndctl; need mkfs.ext4 e2fsprogs
    dev=/dev/$(ndctl create-namespace --force --reconfig="$ns" --mode=fsdax --map=dev |
               sed -n 's/.*"blockdev":"\([a-z0-9.]*\)".*/\1/p')
    [ -b "$dev" ] || die "no block device for $ns"
    mkfs.ext4 -q -F -b 4096 "$dev"
    mkdir -p "$mnt"
    mount -o dax "$dev" "$mnt"
    echo "$mnt"
}

case "${1:-}" in
    kmem)       shift; kmem "$@" ;;
    devdax)     shift; devdax "$@" ;;
    fsdax)      shift; fsdax "$@" ;;
    cxl-kmem)   shift; cxl_kmem "$@" ;;
    cxl-devdax) shift; cxl_devdax "$@" ;;
    *) echo "usage: $0 kmem|devdax [NAMESPACE] | fsdax [NAMESPACE] [MOUNTPOINT] | cxl-kmem|cxl-devdax [MEMDEV]" >&2
       exit 2 ;;
esac
