#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# Guest side of the pool profile (scripts/lab/pool/pair.py): the shared pool as devdax in each host,
# and barriers between the two guests through $LAB_SHARED.
#
#   guest.sh devdax            host a: namespace0.0 -> devdax (struct pages in DRAM: --map=mem);
#                              host b: waits for a, then re-probes the namespace, whose info block a
#                              wrote on the shared media. Prints the device (/dev/dax0.0).
#   guest.sh mark NAME         this host reached NAME
#   guest.sh wait NAME [S]     until the peer reached NAME (or failed), at most S seconds (default 600)
set -u
cmd=${1:?usage: guest.sh devdax | mark NAME | wait NAME [S]}
S=${LAB_SHARED:?not a pool guest}

mark() { echo "$(date +%s.%N)" >"$S/$LAB_HOST.$1"; }

wait_peer() {
	local name=$1 limit=${2:-600} t=0
	while [ ! -e "$S/$LAB_PEER.$name" ]; do
		if [ -e "$S/ended-$LAB_PEER" ] || [ -e "$S/$LAB_PEER.failed" ]; then
			echo "guest.sh: host $LAB_PEER ended or failed before '$name'" >&2; return 1
		fi
		[ "$t" -ge "$((limit * 10))" ] && { echo "guest.sh: host $LAB_PEER never reached '$name'" >&2; return 1; }
		sleep 0.1; t=$((t + 1))
	done
}

case $cmd in
devdax)
	# --map=mem: the kernel keeps the struct pages of the device in each host's own DRAM. With --map=dev
	# it would write them into the device's reserved area, and two hosts would overwrite each other's.
	if [ "$LAB_HOST" = a ]; then
		ndctl create-namespace --force --reconfig=namespace0.0 --mode=devdax --map=mem >/dev/null || { mark failed; exit 1; }
		sync
		mark devdax
	else
		wait_peer devdax || exit 1
		ndctl disable-namespace namespace0.0 >/dev/null && ndctl enable-namespace namespace0.0 >/dev/null \
			|| { mark failed; exit 1; }
	fi
	dev=$(ls -d /sys/bus/dax/devices/dax0.* 2>/dev/null | head -n1)
	[ -n "$dev" ] || { echo "guest.sh: no devdax device on host $LAB_HOST" >&2; mark failed; exit 1; }
	echo "/dev/${dev##*/}"
	;;
mark) mark "${2:?name}" ;;
wait) wait_peer "${2:?name}" "${3:-600}" ;;
*) echo "guest.sh: unknown command $cmd" >&2; exit 2 ;;
esac
