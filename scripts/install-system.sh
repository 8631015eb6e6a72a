#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs the Debian packages listed in scripts/apt-packages.txt that are missing, and prepares
# the kernel interfaces the tests use. Idempotent: a second run installs nothing and takes a second.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

mapfile -t wanted < <(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$here/apt-packages.txt" | awk '{print $1}')
missing=()
for p in "${wanted[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "install-system: missing packages (${missing[*]}) and not root: run 'make setup' as root" >&2
        exit 1
    fi
    echo "install-system: apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# BPF tracepoint attach needs tracefs; some machines boot without it mounted.
if [ "$(id -u)" = 0 ] && [ ! -e /sys/kernel/tracing/events ]; then
    mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null || \
        echo "install-system: could not mount tracefs; BPF tracepoint tests will say why they skip" >&2
fi
exit 0
