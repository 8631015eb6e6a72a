# SPDX-License-Identifier: Apache-2.0
"""Acceptance of the mover (issue 4) on real kernels, one guest boot per kernel (profile ``pmem``:
node0 DRAM + CPUs, node1 CPU-less "CXL" DRAM, node2 the NVDIMM onlined through dax/kmem).

In that one boot the guest half of this file (``python tests/lab/test_mover_lab.py --guest``) runs:

1. round trip: a child holds a 256 MiB checksummed buffer on node0; the engine moves it to node1 and
   back; after each move a move_pages query puts every page on the target, the checksum is intact, the
   engine's moved counters equal the pages and the /proc/vmstat ``pgmigrate_success`` delta, and the
   placement the engine handed on (``on_landed``, ``Report.landed()``) is the query's, page by page;
2. pinned: a 16 MiB buffer registered with io_uring (IORING_REGISTER_BUFFERS pins it long-term) cannot
   move: reported as pinned after the back-off retries, every page still on node0, data intact;
3. target full: a hog fills node1 to within 48 MiB; a 128 MiB move to node1 overflows: ENOMEM is
   reported (``target-full``) and the overflow goes to the fallback node (node2, the slower pmem tier
   ``Topology.fallback_nodes(1)`` names); nothing raises; the reported placement matches the query;
4. exit mid-move: a child is SIGKILLed while the engine moves its 384 MiB; the engine reports
   ``process-exited`` and then moves another process's buffer normally.

The guest prints one JSON document; the tests below assert on it host-side.
"""
from __future__ import annotations

import json
import sys

import pytest

KERNELS = ("6.1", "6.12")
MIB = 1 << 20

# ------------------------------------------------------------------------------------------------
# Guest side (runs inside the lab guest as root; host root shared read-only, cwd = repo root)
# ------------------------------------------------------------------------------------------------

# A process holding a buffer: allocated on NODE (mbind, then the policy is reset so that it does not
# constrain anything later), filled with a pattern, checksummed; optionally pinned through io_uring.
# Answers "check" on stdin with the checksum comparison; any other line (or EOF) ends it.
CHILD = r'''
import ctypes, json, mmap, os, sys, zlib
import numpy as np
from tieringd.kernel import numa

size, node, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
arr = np.frombuffer(buf, dtype=np.uint64)
addr = arr.ctypes.data
numa.mbind(addr, size, numa.MPOL_BIND, [node])
if mode == "hog":
    arr[::512] = 1                       # one write per 4 KiB page is enough to fault it in
else:
    step = 1 << 20
    for i in range(0, len(arr), step):
        n = min(step, len(arr) - i)
        arr[i:i + n] = (np.arange(i, i + n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(size)
numa.mbind(addr, size, numa.MPOL_DEFAULT)
crc = zlib.crc32(buf) if mode != "hog" else 0
pinned = None
if mode == "pin":
    # io_uring_setup(2) + io_uring_register(2, IORING_REGISTER_BUFFERS): a FOLL_LONGTERM pin of every
    # page of the buffer, held until the ring is closed. Syscall numbers are the same on all arches.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    params = (ctypes.c_char * 120)()
    fd = libc.syscall(ctypes.c_long(425), ctypes.c_uint(4), params)
    if fd < 0:
        pinned = "io_uring_setup: " + os.strerror(ctypes.get_errno())
    else:
        iov = (ctypes.c_uint64 * 2)(addr, size)
        rc = libc.syscall(ctypes.c_long(427), ctypes.c_int(fd), ctypes.c_uint(0), iov, ctypes.c_uint(1))
        pinned = True if rc == 0 else "io_uring_register: " + os.strerror(ctypes.get_errno())
print(json.dumps({"pid": os.getpid(), "addr": addr, "size": size, "crc": crc, "pinned": pinned}), flush=True)
for line in sys.stdin:
    if line.strip() != "check":
        break
    print(json.dumps({"crc_ok": zlib.crc32(buf) == crc}), flush=True)
'''


def _guest(kmem_node: str) -> dict:
    import os
    import signal
    import subprocess
    import time

    from tieringd import mover
    from tieringd.kernel import numa
    from tieringd.memory import topology
    from tieringd.contracts import Priority

    out: dict = {"release": os.uname().release, "kmem_node": None if kmem_node == "none" else int(kmem_node)}
    children = []

    def spawn(size: int, node: int, mode: str = "-") -> dict:
        p = subprocess.Popen([sys.executable, "-c", CHILD, str(size), str(node), mode],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        info = json.loads(p.stdout.readline())
        info["proc"] = p
        children.append(p)
        return info

    def crc_ok(c: dict) -> bool:
        c["proc"].stdin.write("check\n")
        c["proc"].stdin.flush()
        return json.loads(c["proc"].stdout.readline())["crc_ok"]

    def where(c: dict) -> dict:
        return numa.status_counts(numa.query_pages_array(c["pid"], numa.page_addresses(c["addr"], c["size"])))

    def node_free(n: int) -> int:
        from tieringd.kernel import sysfs
        for line in sysfs.read_lines(f"/sys/devices/system/node/node{n}/meminfo"):
            if "MemFree:" in line:
                return int(line.split()[-2]) * 1024
        return 0

    def req(c: dict, node: int, prio=Priority.DEMOTE) -> mover.MoveRequest:
        return mover.MoveRequest(c["pid"], [(c["addr"], c["size"])], node, prio)

    topo = topology.discover()
    out["tiers"] = {n.id: n.tier.label for n in topo.nodes}
    out["fallbacks_of_1"] = topo.fallback_nodes(1)
    fallbacks = topo.fallback_map()         # the engine is handed it; it never looks topology up
    landed: list = []                       # what on_landed handed on (rows of every batch)

    def engine(**config) -> mover.MigrationEngine:
        return mover.MigrationEngine(mover.MoverConfig(**config), fallbacks, on_landed=landed.append)

    def landed_vs_query(c: dict, rows) -> dict:
        """The placement the engine reported for the buffer, page by page, against a fresh query."""
        import numpy as np
        addrs = numa.page_addresses(c["addr"], c["size"])
        now = numa.query_pages_array(c["pid"], addrs)
        seen = np.full(len(addrs), -1, np.int64)
        for r in rows[rows["pid"] == c["pid"]]:
            i = (int(r["start"]) - c["addr"]) // numa.PAGE_SIZE
            seen[i:i + int(r["npages"])] = int(r["node"])
        return {"pages": int((seen >= 0).sum()), "differ": int((seen != now).sum())}

    def handed_on():
        import numpy as np

        from tieringd.contracts import LANDED_DTYPE
        rows = np.concatenate(landed) if landed else np.zeros(0, LANDED_DTYPE)
        landed.clear()
        return rows

    # 1. round trip node0 -> node1 -> node0, 256 MiB
    a = spawn(256 * MIB, 0)
    out["roundtrip"] = {"pages": a["size"] // numa.PAGE_SIZE, "before": where(a), "moves": []}
    with engine(batch_pages=512, workers=2) as eng:
        for target, prio in ((1, Priority.DEMOTE), (0, Priority.PROMOTE)):
            handed_on()
            v0 = mover.vmstat_snapshot()
            t0 = time.monotonic()
            rep = eng.submit(req(a, target, prio)).wait(900)
            elapsed = time.monotonic() - t0
            v1 = mover.vmstat_snapshot()
            out["roundtrip"]["moves"].append({
                "target": target, "by_reason": rep.by_reason(), "moved_pages": rep.moved_pages,
                "pairs": {f"{s}->{d}": c.moved_pages for (s, d), c in rep.counters.pairs.items()},
                "thp_pages_moved": rep.counters.thp_pages_moved, "error": rep.error,
                "vmstat_delta": mover.vmstat_delta(v0, v1), "where": where(a), "crc_ok": crc_ok(a),
                "landed": landed_vs_query(a, rep.landed()), "landed_callback": landed_vs_query(a, handed_on()),
                "elapsed_s": round(elapsed, 2)})
    a["proc"].stdin.close()
    a["proc"].wait()

    # 2. pinned pages: refused, retried with back-off, reported as pinned, left intact
    p = spawn(16 * MIB, 0, "pin")
    eng = engine(batch_pages=512, max_retries=3, retry_backoff_s=0.05)
    ticket = eng.submit(req(p, 1))
    eng.run_until_idle()
    rep = ticket.wait(0)
    out["pinned"] = {"pin": p["pinned"], "pages": p["size"] // numa.PAGE_SIZE, "by_reason": rep.by_reason(),
                     "retried_pages": eng.counters.retried_pages, "samples": len(rep.samples.get("pinned", [])),
                     "where": where(p), "crc_ok": crc_ok(p), "error": rep.error,
                     "landed": landed_vs_query(p, rep.landed())}
    p["proc"].stdin.close()
    p["proc"].wait()

    # 3. target almost full: overflow -> ENOMEM -> fallback node, nothing raises
    hog = spawn(max(node_free(1) - 48 * MIB, 0), 1, "hog")
    b = spawn(128 * MIB, 0)
    free1 = node_free(1)
    eng = engine(batch_pages=512)
    try:
        t = eng.submit(req(b, 1))
        eng.run_until_idle()
        rep = t.wait(0)
        out["full"] = {"node1_free_before": free1, "pages": b["size"] // numa.PAGE_SIZE,
                       "fallbacks": rep.fallbacks, "by_reason": rep.by_reason(), "error": rep.error,
                       "target_full_samples": len(rep.samples.get("target-full", [])),
                       "events": [e["event"] + (f":{e.get('node')}" if "node" in e else "") for e in eng.events],
                       "where": where(b), "crc_ok": crc_ok(b), "landed": landed_vs_query(b, rep.landed()),
                       "raised": None}
    except Exception as e:   # the acceptance: nothing raises
        out["full"] = {"raised": f"{type(e).__name__}: {e}"}
    for c in (hog, b):
        c["proc"].stdin.close()
        c["proc"].wait()

    # 4. the process exits in the middle of a large move; the engine carries on with another
    c, d = spawn(384 * MIB, 0), spawn(8 * MIB, 0)
    killed = {}

    def progress(r: mover.Report) -> None:
        if r.pid == c["pid"] and not killed and r.moved_pages >= 8192:
            os.kill(c["pid"], signal.SIGKILL)     # not reaped: a zombie first, then gone
            killed["at_moved_pages"] = r.moved_pages

    with mover.MigrationEngine(mover.MoverConfig(batch_pages=512, workers=2), fallbacks,
                               on_progress=progress) as eng:
        rc = eng.submit(req(c, 1)).wait(900)
        rd = eng.submit(req(d, 1)).wait(300)
        out["exit"] = {"pages": c["size"] // numa.PAGE_SIZE, "killed": killed, "process_exited": rc.process_exited,
                       "by_reason": rc.by_reason(), "error": rc.error,
                       "processes_exited": eng.counters.processes_exited,
                       "events": [e["event"] for e in eng.events if e["pid"] == c["pid"]],
                       "other": {"by_reason": rd.by_reason(), "where": where(d), "crc_ok": crc_ok(d)}}
    for ch in children:
        if ch.poll() is None:
            ch.kill()
        ch.wait()
    return out


if __name__ == "__main__" and sys.argv[1:2] == ["--guest"]:
    json.dump(_guest(sys.argv[2] if len(sys.argv) > 2 else "none"), sys.stdout)
    sys.exit(0)


# ------------------------------------------------------------------------------------------------
# Host side
# ------------------------------------------------------------------------------------------------

pytestmark = pytest.mark.lab
# Seconds one boot of this module takes here: sets the order of make test's work (tests/lab_workers.py).
LAB_GROUP_S = 90


GUEST_SCRIPT = """set -e
echo 0 > /proc/sys/kernel/numa_balancing
N=$(scripts/lab/pmem.sh kmem 2>"$LAB_OUT/kmem.err") || N=none
.venv/bin/python tests/lab/test_mover_lab.py --guest "$N"
"""


@pytest.fixture(scope="module", params=KERNELS)
def guest(request, lab) -> dict:
    r = lab.run(GUEST_SCRIPT, profile="pmem", kernel=request.param, timeout_s=1500)
    assert r.rc == 0, f"guest failed ({r.rc}):\n{r.stderr[-3000:]}\n--- dmesg ---\n" + \
        "\n".join(r.dmesg.splitlines()[-30:])
    facts = json.loads(r.stdout)
    facts["kernel"] = request.param
    return facts


def test_roundtrip_256mib_every_page_verified_counters_match_vmstat(guest):
    rt = guest["roundtrip"]
    pages = rt["pages"]
    assert pages == 256 * MIB // 4096
    assert rt["before"] == {"node 0": pages}
    for m in rt["moves"]:
        target = m["target"]
        assert m["error"] is None
        assert m["where"] == {f"node {target}": pages}, m        # the query is the authority
        assert m["crc_ok"]
        assert m["by_reason"] == {"moved": pages}
        assert m["moved_pages"] == pages
        assert m["pairs"] == {f"{1 - target}->{target}": pages}
        # move_pages migrations are counted in pgmigrate_success, one per base page (a THP as 512)
        assert m["vmstat_delta"]["pgmigrate_success"] == pages, m["vmstat_delta"]
        assert m["vmstat_delta"].get("pgmigrate_fail", 0) == 0
        # THP folios the engine saw (pagemap + kpageflags) are the ones the kernel migrated whole
        assert m["thp_pages_moved"] == m["vmstat_delta"].get("thp_migration_success", 0) * 512
        # the placement handed on (report and on_landed) is the query's, page by page
        assert m["landed"] == m["landed_callback"] == {"pages": pages, "differ": 0}, m


def test_pinned_pages_reported_and_left_intact(guest):
    pin = guest["pinned"]
    pages = pin["pages"]
    assert pin["pin"] is True, f"could not pin: {pin['pin']}"
    assert pin["error"] is None
    assert pin["by_reason"] == {"pinned": pages}
    assert pin["retried_pages"] == 3 * pages          # max_retries back-off rounds
    assert pin["samples"] > 0
    assert pin["where"] == {"node 0": pages}
    assert pin["landed"] == {"pages": pages, "differ": 0}      # reported where they stayed
    assert pin["crc_ok"]


def test_target_full_overflow_goes_to_fallback_and_nothing_raises(guest):
    full = guest["full"]
    assert full["raised"] is None
    assert full["error"] is None
    pages = full["pages"]
    by = full["by_reason"]
    assert full["crc_ok"]
    assert full["landed"] == {"pages": pages, "differ": 0}   # node1 and the fallback node, page by page
    assert by.get("moved", 0) > 0, by                   # what fitted landed on node1
    assert full["target_full_samples"] > 0              # and the overflow was reported as ENOMEM
    if guest["kmem_node"] is not None:
        assert full["fallbacks"] == [guest["kmem_node"]] == guest["fallbacks_of_1"]
        assert by.get("fallback", 0) > 0 and by["moved"] + by["fallback"] == pages, by
        assert f"fallback:{guest['kmem_node']}" in full["events"]
        assert set(full["where"]) == {"node 1", f"node {guest['kmem_node']}"}
        assert full["where"]["node 1"] == by["moved"]
    else:   # no kmem node on this kernel: nowhere slower to go, the overflow stays where it was
        assert by["moved"] + by["target-full"] == pages, by


def test_process_exit_mid_move_is_reported_and_engine_carries_on(guest):
    ex = guest["exit"]
    assert ex["killed"], "the child was never killed: the move finished before 8192 pages?"
    assert ex["process_exited"] and ex["error"] is None
    assert ex["processes_exited"] == 1
    assert "process-exited" in ex["events"]
    by = ex["by_reason"]
    assert by.get("process-exited", 0) > 0 and by.get("moved", 0) >= ex["killed"]["at_moved_pages"]
    assert sum(by.values()) == ex["pages"]
    other = ex["other"]
    assert other["by_reason"] == {"moved": 8 * MIB // 4096}
    assert other["where"] == {"node 1": 8 * MIB // 4096} and other["crc_ok"]
