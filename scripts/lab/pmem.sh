#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Guest-side helpers for the lab's `pmem` profile (run as root inside the guest; docs/lab.md).
#
#   scripts/lab/pmem.sh kmem  [NAMESPACE]              devdax -> system RAM via kmem; prints the new node
#   scripts/lab/pmem.sh fsdax [NAMESPACE] [MOUNTPOINT]  fsdax + ext4 mounted -o dax; prints the mountpoint
#   scripts/lab/pmem.sh cxl-kmem [MEMDEV]               cxl-type3 profile: CXL pmem region -> devdax -> kmem
#
# Defaults: namespace0.0 (nv0, 1 GiB) for kmem, namespace1.0 (nv1, 512 MiB) for fsdax, /tmp/pmem.
# Both NVDIMMs sit in proximity domain 2, so the kmem memory becomes node2 (HMAT: 2000 ns, 60 GB/s).
set -euo pipefail

die() { echo "pmem.sh: $*" >&2; exit 1; }
need() { command -v "$1" >/dev/null || die "$1 is not installed (apt-get install $2)"; }

modprobe -q nd_pmem 2>/dev/null || true
modprobe -q dax_pmem 2>/dev/null || true
modprobe -q kmem 2>/dev/null || true

# Online a devdax device as system RAM (kmem); prints its NUMA node.
online_dax() {
    local dax=$1 policy=/sys/devices/system/memory/auto_online_blocks old out
    need daxctl daxctl
    # With memory auto-online on (CONFIG_MHP_DEFAULT_ONLINE_TYPE_ONLINE_AUTO, Debian 6.12+), the kernel
    # would online the new blocks itself, into a zone daxctl did not choose, and daxctl refuses
    # ("kernel policy will auto-online memory, aborting"). Turn the policy off for the reconfigure, let
    # daxctl online the blocks (ZONE_MOVABLE, so they can be offlined again), restore the policy.
    old=$(cat "$policy")
    echo offline >"$policy"
    if ! out=$(daxctl reconfigure-device --mode=system-ram "$dax" 2>&1); then
        echo "$old" >"$policy"
        die "daxctl reconfigure-device $dax: $out"
    fi
    echo "$old" >"$policy"
    cat /sys/bus/dax/devices/"$dax"/target_node
}

chardev() { sed -n 's/.*"chardev":"\(dax[0-9.]*\)".*/\1/p' | head -1; }

kmem() {
    local ns=${1:-namespace0.0} dax
    need ndctl ndctl
    dax=$(ndctl create-namespace --force --reconfig="$ns" --mode=devdax --map=dev | chardev)
    [ -n "$dax" ] || die "no dax device for $ns"
    online_dax "$dax"
}

# cxl-type3 profile: a pmem region on the CXL memdev, a devdax namespace on it, onlined via kmem.
cxl_kmem() {
    local memdev=${1:-mem0} region dax
    need cxl ndctl; need ndctl ndctl
    cxl create-region --memdevs --type=pmem --decoder=decoder0.0 --ways=1 "$memdev" >/dev/null ||
        die "cxl create-region on $memdev failed"
    region=$(ndctl list --regions | sed -n 's/.*"dev":"\(region[0-9]*\)".*/\1/p' | tail -1)
    [ -n "$region" ] || die "no nd region for the CXL region"
    dax=$(ndctl create-namespace --region="$region" --mode=devdax --map=dev | chardev)
    [ -n "$dax" ] || die "no dax device on $region"
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
    kmem)     shift; kmem "$@" ;;
    fsdax)    shift; fsdax "$@" ;;
    cxl-kmem) shift; cxl_kmem "$@" ;;
    *) echo "usage: $0 kmem [NAMESPACE] | fsdax [NAMESPACE] [MOUNTPOINT] | cxl-kmem [MEMDEV]" >&2; exit 2 ;;
esac
