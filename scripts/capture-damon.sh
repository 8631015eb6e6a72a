#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Captures the DAMON sysfs tree as tieringd's DamonSampler leaves it (one kdamond, fvaddr over a
# workload's range, a "stat" scheme with open access-pattern ranges, tried_regions updated), into
# tests/fixtures/damon/<release>/ for tests/unit/test_sampling.py. Run inside a lab guest:
#   python scripts/lab.py run --profile cxl --kernel 6.12 -- bash scripts/capture-damon.sh
set -uo pipefail
A=/sys/kernel/mm/damon/admin
[ -d $A ] || { echo "capture-damon: no DAMON sysfs on $(uname -r)" >&2; exit 1; }
out=${LAB_OUT:-/tmp}/damon-$(uname -r)
build/tests/skewed_touch --mode read --seconds 30 --blocks 8 --block-size 1048576 --touches 64 > $out.wl &
sleep 1
pid=$(sed -n '1s/.*"pid": \([0-9]*\).*/\1/p' $out.wl); base=$(sed -n '1s/.*"base": \([0-9]*\).*/\1/p' $out.wl)
w() { echo "$2" > "$A/$1" || echo "capture-damon: write $1 <- $2 failed" >&2; }
w kdamonds/nr_kdamonds 1
w kdamonds/0/contexts/nr_contexts 1
C=kdamonds/0/contexts/0
w $C/operations fvaddr
w $C/monitoring_attrs/intervals/sample_us 5000
w $C/monitoring_attrs/intervals/aggr_us 100000
w $C/monitoring_attrs/intervals/update_us 1000000
w $C/monitoring_attrs/nr_regions/max 1000
w $C/monitoring_attrs/nr_regions/min 10
w $C/targets/nr_targets 1
w $C/targets/0/pid_target $pid
w $C/targets/0/regions/nr_regions 1
w $C/targets/0/regions/0/start $base
w $C/targets/0/regions/0/end $((base + 8 * 1048576))
w $C/schemes/nr_schemes 1
w $C/schemes/0/action stat
for r in sz nr_accesses age; do
    w $C/schemes/0/access_pattern/$r/min 0
    [ $r = sz ] && max=18446744073709551615 || max=4294967295
    w $C/schemes/0/access_pattern/$r/max $max
done
w kdamonds/0/state on
sleep 3
w kdamonds/0/state update_schemes_tried_regions
mkdir -p $out
( cd $A && find . -type f | sort | while read -r f; do
    mkdir -p "$out/$(dirname "$f")"
    cat "$f" > "$out/$f" 2>/dev/null || true
done )
echo "$pid $base" > $out/WORKLOAD
w kdamonds/0/state off
w kdamonds/nr_kdamonds 0
kill %1
tar -C "$(dirname $out)" -czf $out.tgz "$(basename $out)"
echo "captured $(find $out -type f | wc -l) files into $out.tgz"
