#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# fresh-check: run the README's `make test` (and with --demo first `make demo`) on a Debian 12 root built from Debian's archive, with a clean
# clone of the project, to prove that the project's own install files are enough (docs/fresh-check.md).
#
#   scripts/fresh-check.sh [--rev REV] [--root DIR] [--keep] [--reuse] [--lab-cache DIR]
#                          [--pytest-args ARGS] [--variant V] [--log FILE] [--demo]
#
#   --rev REV          the commit to check (default HEAD of this checkout; uncommitted changes are not in it)
#   --root DIR         where to build the root (default: a fresh /var/tmp/tieringd-fresh.XXXXXX)
#   --keep             leave the root (and its clone, venv, build/) for inspection
#   --reuse            DIR already holds a root from an earlier --keep: skip mmdebstrap, clone again.
#                      For developing this script only: packages installed by the last run stay.
#   --lab-cache DIR    use DIR (e.g. a checkout's .cache/lab) as TIERINGD_LAB_CACHE instead of fetching
#                      the lab kernels into the clone: saves time, but does not prove that fetch works
#   --pytest-args ARGS passed to make test as PYTEST_ARGS (e.g. tests/unit while developing)
#   --variant V        mmdebstrap variant (default: mmdebstrap's own default, what debootstrap installs);
#                      minbase is what container images hold: no kmod, no udev
#   --log FILE         the full make test output (default: next to the root, DIR.log)
#   --demo             the README's other command first: make demo on the fresh root, then make test
#
# Runs as root on the host (mmdebstrap, mounts, chroot). Exits with make test's status (2: the check
# itself failed before make test ran).
set -euo pipefail

SUITE=bookworm
# The Debian archive and security archive: the host's own apt sources (scripts/debian_mirror.py;
# TIERINGD_DEBIAN_MIRROR / TIERINGD_DEBIAN_SECURITY override them).
mirrors=$(python3 "$(dirname "$0")/debian_mirror.py") || exit 2
eval "$mirrors"
CLONE=/root/tieringd              # where a user would clone it: root's home (0700, as on Debian)

here=$(cd "$(dirname "$0")/.." && pwd)
rev=HEAD root="" keep=0 reuse=0 lab_cache="" pytest_args="" log="" variant="" demo=0

die() { echo "fresh-check: $*" >&2; exit 2; }
say() { echo "fresh-check: $*" >&2; }

while [ $# -gt 0 ]; do
    case "$1" in
        --rev) rev=$2; shift ;;
        --root) root=$2; shift ;;
        --keep) keep=1 ;;
        --reuse) reuse=1 ;;
        --lab-cache) lab_cache=$(realpath "$2"); shift ;;
        --pytest-args) pytest_args=$2; shift ;;
        --variant) variant=$2; shift ;;
        --log) log=$2; shift ;;
        --demo) demo=1 ;;
        -h|--help) sed -n '3,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument $1 (--help)" ;;
    esac
    shift
done

[ "$(id -u)" = 0 ] || die "needs root (mmdebstrap, mounts, chroot)"
commit=$(git -C "$here" rev-parse --verify "$rev^{commit}") || die "no commit $rev in $here"
if [ "$rev" = HEAD ] && [ -n "$(git -C "$here" status --porcelain --untracked-files=no)" ]; then
    say "note: $here has uncommitted changes; they are not part of the check (commit $commit)"
fi
if [ -n "$lab_cache" ] && [ ! -d "$lab_cache/kernels" ]; then
    die "--lab-cache $lab_cache has no kernels/ (scripts/lab.py fetch)"
fi
# mmdebstrap is a tool of the machine running this check, not of the project: installed here, not
# listed in scripts/apt-packages.txt.
if ! command -v mmdebstrap >/dev/null; then
    say "installing mmdebstrap on this host"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null
fi

if [ -z "$root" ]; then
    [ $reuse = 0 ] || die "--reuse needs --root DIR"
    root=$(mktemp -d /var/tmp/tieringd-fresh.XXXXXX)
    rmdir "$root"                 # mmdebstrap wants to create it
fi
root=$(realpath -m "$root")
[ "$root" != / ] || die "--root / is the host"
log=${log:-$root.log}

# ---------------------------------------------------------------------------------------------------
# Cleanup on every exit path: processes still running in the root (QEMU of an interrupted lab test),
# then every mount under it, then the root itself unless --keep. Nothing is deleted while anything is
# still mounted below the root (the bind-mounted /dev or lab cache would be deleted with it).
# ---------------------------------------------------------------------------------------------------
mounted=0 rc_file="" demo_rc_file=""
in_root_pids() {
    local p r
    for p in /proc/[0-9]*; do
        r=$(readlink "$p/root" 2>/dev/null) || continue
        [ "$r" = "$root" ] && echo "${p#/proc/}"
    done
    return 0
}
mounts_below() { awk -v r="$root" '$5 == r || index($5, r "/") == 1 {print $5}' /proc/self/mountinfo; }
cleanup() {
    local rc=$? pids
    trap - EXIT INT TERM
    [ -z "$rc_file" ] || rm -f "$rc_file" "$demo_rc_file"
    if [ $mounted = 1 ]; then
        pids=$(in_root_pids)
        if [ -n "$pids" ]; then
            say "stopping processes left in the root: $(echo $pids)"
            kill -TERM $pids 2>/dev/null || true
            sleep 2
            pids=$(in_root_pids)
            [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
        fi
        umount -R "$root" 2>/dev/null || umount -R -l "$root" 2>/dev/null || true
    fi
    if [ -n "$(mounts_below)" ]; then
        say "still mounted below $root, NOT deleting it:"; mounts_below >&2
    elif [ $keep = 1 ]; then
        say "root kept: $root (chroot $root; the clone is $CLONE)"
    elif [ -d "$root" ]; then
        rm -rf --one-file-system "$root"
    fi
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

t_start=$(date +%s)
# ---------------------------------------------------------------------------------------------------
# 1. The root: Debian 12 as mmdebstrap's default variant makes it (Essential, required and important
#    packages, apt), with the suites a Debian 12 installation uses.
# ---------------------------------------------------------------------------------------------------
if [ $reuse = 1 ]; then
    [ -x "$root/usr/bin/apt-get" ] || die "--reuse: $root holds no root"
    say "reusing $root (not a fresh root: packages from earlier runs stay)"
else
    say "mmdebstrap $SUITE $root (${variant:-default} variant)"
    mmdebstrap --quiet ${variant:+--variant="$variant"} "$SUITE" "$root" \
        "deb $MIRROR $SUITE main" "deb $MIRROR $SUITE-updates main" "deb $SECURITY $SUITE-security main"
    # Package scripts must not start services in a chroot (a udevd started there would act on the
    # host's devices): the usual policy-rc.d of chroot builders. A booted machine has none.
    printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
    chmod 755 "$root/usr/sbin/policy-rc.d"
fi
t_root=$(date +%s)

# ---------------------------------------------------------------------------------------------------
# 2. A clean clone of the commit: what a user gets, without this checkout's untracked or ignored files
#    (.venv, build/, .cache/).
# ---------------------------------------------------------------------------------------------------
rm -rf --one-file-system "$root$CLONE"
git clone --quiet --no-checkout --no-hardlinks "$here" "$root$CLONE"
git -C "$root$CLONE" checkout --quiet --detach "$commit"
say "clone of $(git -C "$here" log -1 --format='%h %s' "$commit" | cut -c1-80) at $CLONE"
# --lab-cache: the kernels go where the clone keeps them (.cache/lab), as hard links (cp -al: no
# copy; the cache's files are only read, depmod writes new files). Not a bind mount: the lab guest
# sees the root through 9p, and a mount inside it (under /var, which the guest overlays) is invisible
# there — modprobe in the guest found no modules (nfit, cxl_*), and every pmem test failed.
if [ -n "$lab_cache" ]; then
    mkdir -p "$root$CLONE/.cache"
    cp -al "$lab_cache" "$root$CLONE/.cache/lab" 2>/dev/null || cp -a "$lab_cache" "$root$CLONE/.cache/lab"
    rm -rf "$root$CLONE/.cache/lab/runs"
    say "lab kernels from $lab_cache (not fetched: this run does not prove lab.py fetch)"
fi

# ---------------------------------------------------------------------------------------------------
# 3. What a booted Debian 12 has mounted: /proc, /sys with tracefs, debugfs, bpffs and cgroup2, /dev
#    with its own devpts and shm, /run a tmpfs. The root is first made a private mount of its own, so
#    nothing mounted below it propagates to the host and umount -R cannot touch the host's mounts.
# ---------------------------------------------------------------------------------------------------
mount --bind "$root" "$root"
mount --make-private "$root"
mounted=1
mount -t proc proc "$root/proc"
mount -t sysfs sysfs "$root/sys"          # /sys/kernel/btf/vmlinux comes with sysfs
mount -t tracefs tracefs "$root/sys/kernel/tracing"
mount -t debugfs debugfs "$root/sys/kernel/debug"
mount -t bpf bpf "$root/sys/fs/bpf"
mount -t cgroup2 cgroup2 "$root/sys/fs/cgroup"
mount --bind /dev "$root/dev"
mount -t devpts devpts "$root/dev/pts" -o newinstance,ptmxmode=0666,mode=620,gid=5
mount -t tmpfs shm "$root/dev/shm" -o mode=1777,nosuid,nodev
mount -t tmpfs run "$root/run" -o mode=755,nosuid,nodev
mkdir -p "$root/run/lock"
cp /etc/resolv.conf "$root/etc/resolv.conf"   # the chroot shares the host's network namespace

env=(HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8
     TERM=dumb DEBIAN_FRONTEND=noninteractive)
# This host's network may intercept TLS with a CA of its own (/usr/local/share/ca-certificates): pip,
# which trusts only its bundled certificates, is given the host's bundle. A machine on an ordinary
# network needs nothing of the kind.
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    mkdir -p "$root/run/fresh-check"
    cp /etc/ssl/certs/ca-certificates.crt "$root/run/fresh-check/ca.crt"
    env+=(PIP_CERT=/run/fresh-check/ca.crt)
    say "pip gets this host's CA bundle (PIP_CERT): local CAs in /usr/local/share/ca-certificates"
fi

# ---------------------------------------------------------------------------------------------------
# 4. The README: make is not in a fresh Debian 12 (priority optional), so it is the one package a user
#    installs by hand; make test installs everything else.
# ---------------------------------------------------------------------------------------------------
in_root() { chroot "$root" /usr/bin/env -i "${env[@]}" "$@"; }
steps="make test${pytest_args:+ PYTEST_ARGS='$pytest_args'}"
[ $demo = 0 ] || steps="make demo; $steps"
say "in the root: apt-get install make; cd $CLONE && $steps"
say "full output: $log"
# In the background, waited for: a signal to this script then runs the cleanup at once (bash runs traps
# only between commands), which stops what runs in the root by PID.
rc_file=$(mktemp) demo_rc_file=$(mktemp)
{
    set +e
    in_root sh -c 'command -v make >/dev/null || { apt-get update -qq && apt-get install -y -qq --no-install-recommends make >/dev/null; }'
    if [ $demo = 1 ]; then          # make demo on the fresh root: its set-up is its own (make setup all lab-kernels)
        in_root sh -c "cd $CLONE && exec make demo"
        echo $? >"$demo_rc_file"
    fi
    in_root sh -c "cd $CLONE && exec make test${pytest_args:+ PYTEST_ARGS=\"\$1\"}" sh "$pytest_args"
    echo $? >"$rc_file"
} 2>&1 | tee "$log" &
wait $! || true
rc=$(cat "$rc_file")
rc=${rc:-2}
t_end=$(date +%s)

# ---------------------------------------------------------------------------------------------------
# 5. Summary: the short test summary, the lab's per-boot times, pytest's last line, and the phases' times.
# ---------------------------------------------------------------------------------------------------
echo
echo "=== fresh-check summary ($SUITE root, ${variant:-default} variant, commit ${commit:0:12}) ==="
# from the first of pytest's closing sections to its last line ("N passed, M failed in S s")
summary=$(awk '/^=+ (short test summary info|lab) =+$/ {p=1} p' "$log" | grep -v '^$' || true)
[ -n "$summary" ] || summary=$(grep -E '^=+ .* in [0-9.]+s' "$log" | tail -1 || true)
echo "${summary:-(no pytest summary: make test stopped before the tests, see the log)}"
if [ $demo = 1 ]; then
    demo_rc=$(cat "$demo_rc_file" 2>/dev/null)
    [ "${demo_rc:-2}" = 0 ] || [ "$rc" != 0 ] || rc=1      # a failed demo fails the check
    echo "make demo exit status: ${demo_rc:-?}; its closing lines:"
    awk '/^demo: booting/ {p=1} p' "$log" | grep -E '^(node0 share|migrated|workload|kernel settings|demo: done)' || true
fi
printf 'times: root %ss, make test %ss (install + build + lab kernels + tests), total %ss\n' \
    $((t_root - t_start)) $((t_end - t_root)) $((t_end - t_start))
echo "make test exit status: $rc"
exit "$rc"
