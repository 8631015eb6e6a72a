# SPDX-License-Identifier: Apache-2.0
"""Acceptance of the lab itself (issue 3), on real kernels in QEMU/TCG guests.

- cxl profile on every lab kernel (6.1, 6.12, 7.3): nodes 0-1 online, node1 CPU-less, HMAT figures as
  configured, memory tiers (6.12/7.3: node1 in a slower tier; 6.1: both in memory_tier4 — the case where
  classification must not trust the kernel's tiers), and a checksummed 64 MiB buffer moved node0 -> node1
  with move_pages, every page's node confirmed by a move_pages query, read back intact.
- cxl-type3 profile on 6.12: a pmem region on QEMU's CXL type-3 device, devdax, kmem: node2 below DRAM.
- pmem profile on 6.12: NVDIMM -> devdax -> system RAM via kmem = a third node in a lower tier (through
  the kernel's auto-online policy), and fsdax with ext4 mounted -o dax and a file mapped MAP_SYNC.

One boot per kernel/profile: the guest prints one JSON document, the tests assert on it host-side.
"""
from __future__ import annotations

import errno
import json

import pytest
import tieringd_lab as labmod  # scripts/lab.py, registered under this name by tests/lab/conftest.py

pytestmark = pytest.mark.lab
# Seconds one boot of this module takes here: sets the order of make test's work (tests/lab_workers.py).
LAB_GROUP_S = 40


CXL = labmod.PROFILES["cxl"]
PMEM = labmod.PROFILES["pmem"]
MOVE_BYTES = 64 << 20

# Runs in the guest with the project's venv (host root shared read-only). Uses tieringd.kernel.numa, the
# project's own move_pages binding, so this is also its first multi-node test.
_FACTS_PY = r'''
import glob, hashlib, json, mmap, os, sys
import numpy as np
from tieringd.kernel import numa

def read(p):
    with open(p) as f:
        return f.read().strip()

def node_facts():
    nodes = {}
    for d in sorted(glob.glob("/sys/devices/system/node/node[0-9]*")):
        n = int(d.rsplit("node", 1)[1])
        hmat = {}
        for f in glob.glob(d + "/access0/initiators/*_*"):
            hmat[os.path.basename(f)] = int(read(f))
        nodes[n] = {"cpulist": read(d + "/cpulist"), "hmat": hmat}
    return nodes

def tiers():
    out = {}
    for d in glob.glob("/sys/devices/virtual/memory_tiering/memory_tier*"):
        out[int(d.rsplit("memory_tier", 1)[1])] = numa_list(read(d + "/nodelist"))
    return out

def numa_list(s):
    nodes = []
    for part in filter(None, s.split(",")):
        a, _, b = part.partition("-")
        nodes += range(int(a), int(b or a) + 1)
    return nodes

def move_check(size, target):
    """Fill a buffer, move it to `target`, confirm each page's node by query, compare checksums."""
    # NUMA balancing off for this check: on Debian's 6.1 a page the scanner has just made PROT_NONE
    # (a pending hint fault) is answered -EFAULT by a move_pages query (follow_page() honoured
    # PROT_NONE there; mainline fixed it in v6.5 with FOLL_HONOR_NUMA_FAULT, commit d74943a2f3cd).
    # Seen here: 12288 of 16384 pages of a fresh buffer -EFAULT with balancing on, 0 with it off.
    with open("/proc/sys/kernel/numa_balancing", "w") as f:
        f.write("0")
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arr = np.frombuffer(buf, dtype=np.uint64)
    # distinct words on every page (cheap under TCG, unlike a random generator)
    arr[:] = np.arange(len(arr), dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    before = hashlib.sha256(buf).hexdigest()
    addrs = numa.page_addresses(arr.ctypes.data, size)
    where_before = np.array(numa.query_pages(0, addrs))
    status = np.array(numa.move_pages(0, addrs, target))
    where_after = np.array(numa.query_pages(0, addrs))
    after = hashlib.sha256(buf).hexdigest()
    return {"pages": len(addrs),
            "before_nodes": sorted(set(where_before.tolist())),
            "status_counts": {str(k): int(v) for k, v in zip(*np.unique(status, return_counts=True))},
            "thp_kb": sum(int(l.split()[1]) for l in open("/proc/self/smaps") if l.startswith("AnonHugePages")),
            "query_on_target": int((where_after == target).sum()),
            "after_nodes": sorted(set(where_after.tolist())),
            "sha_before": before, "sha_after": after}

facts = {"release": os.uname().release, "online": read("/sys/devices/system/node/online"),
         "lab_out": os.environ.get("LAB_OUT"), "cwd": os.getcwd(),
         "mounts": {l.split()[1]: l.split()[3].split(",") for l in open("/proc/self/mounts")},
         "python": [sys.prefix, os.path.dirname(os.__file__), os.path.join(os.getcwd(), "tieringd")]}
for step in sys.argv[1:]:
    kind, _, arg = step.partition("=")
    if kind == "move":
        size, target = arg.split(":")
        facts.setdefault("moves", {})[target] = move_check(int(size), int(target))
    elif kind == "kmem_node":
        facts["kmem_node"] = int(arg)
    elif kind == "fsdax":
        mnt = arg
        p = os.path.join(mnt, "kv.bin")
        fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, 4 << 20)
        # MAP_SHARED_VALIDATE | MAP_SYNC succeeds only on a DAX mapping (EOPNOTSUPP otherwise).
        m = mmap.mmap(fd, 4 << 20, flags=0x03 | 0x80000, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        m[:4096] = b"\xa5" * 4096
        m.flush()
        m.close()
        os.close(fd)
        with open(p, "rb") as f:
            head = f.read(4096)
        opts = [l.split() for l in open("/proc/self/mounts") if l.split()[1] == mnt]
        facts["fsdax"] = {"map_sync": True, "read_back": head == b"\xa5" * 4096,
                          "mount": opts[0] if opts else None}
facts["nodes"] = node_facts()
facts["tiers"] = tiers()
json.dump(facts, sys.stdout)
'''


def _guest_script(*steps: str, prelude: str = "") -> str:
    return (f"set -e\n{prelude}\n"
            f".venv/bin/python - {' '.join(steps)} <<'PYEOF'\n{_FACTS_PY}\nPYEOF\n")


def _parse(r) -> dict:
    assert r.rc == 0, f"guest script failed ({r.rc}):\n{r.stderr}\n--- dmesg tail ---\n" + \
        "\n".join(r.dmesg.splitlines()[-30:])
    facts = json.loads(r.stdout)
    facts["nodes"] = {int(k): v for k, v in facts["nodes"].items()}
    facts["tiers"] = {int(k): v for k, v in facts["tiers"].items()}
    return facts


def _tier_of(facts: dict, node: int) -> int:
    found = [t for t, nodes in facts["tiers"].items() if node in nodes]
    assert len(found) == 1, f"node{node} in tiers {found}: {facts['tiers']}"
    return found[0]


@pytest.fixture(scope="module", params=tuple(labmod.KERNELS))
def cxl(request, lab):
    r = lab.run(_guest_script(f"move={MOVE_BYTES}:1"), profile="cxl", kernel=request.param)
    facts = _parse(r)
    facts["kernel"] = request.param
    facts["out_dir"] = str(r.out_dir)
    return facts


def test_nodes_online(cxl, lab):
    assert cxl["online"] == "0-1"
    assert cxl["nodes"][0]["cpulist"] == "0-1"
    assert cxl["nodes"][1]["cpulist"] == ""  # the CXL node has memory and no CPU
    assert cxl["release"] == lab.kernel_release(cxl["kernel"])
    assert cxl["cwd"] == str(lab.repo)
    assert cxl["lab_out"] == cxl["out_dir"]


def test_python_trees_come_from_the_cached_share(cxl):
    """The venv, the standard library and tieringd/ the guest's Python runs from are the page-cached share's
    (scripts/lab.py, cached_trees): read-only, and loose caching on (6.1 names it, 6.6+ prints flags)."""
    for tree in cxl["python"]:
        opts = cxl["mounts"].get(tree)
        assert opts is not None, f"{tree} is not a mount of its own: {sorted(cxl['mounts'])}"
        assert "ro" in opts and ("loose" in opts or "cache=0xf" in opts), opts


def test_hmat_figures(cxl):
    for node in CXL.nodes:
        hmat = cxl["nodes"][node.node_id]["hmat"]
        assert hmat == {"read_latency": node.latency_ns, "write_latency": node.latency_ns,
                        "read_bandwidth": node.bandwidth_mb_s, "write_bandwidth": node.bandwidth_mb_s}, \
            f"node{node.node_id}"


def test_memory_tiers(cxl):
    t0, t1 = _tier_of(cxl, 0), _tier_of(cxl, 1)
    if cxl["kernel"] == "6.1":
        # 6.1 has memory tiers but puts every boot-time memory node in the default DRAM tier: placing
        # CPU-less nodes by their HMAT figures came later (6.10: "memory tier: create CPUless memory
        # tiers after obtaining HMAT info"). Exactly the case where tieringd must not trust the tiers.
        assert t0 == t1 == 4
    else:
        assert t0 == 4
        assert t1 > t0, "node1 (400 ns, 150 GB/s) should be in a slower tier than node0"


def test_move_pages_64mib(cxl):
    m = cxl["moves"]["1"]
    pages = MOVE_BYTES // 4096
    assert m["pages"] == pages
    assert m["before_nodes"] == [0]
    # The query is the authority on where pages are. The move's own status may say -EBUSY for a page
    # of a transparent huge page whose folio was already queued by an earlier entry of the same call
    # (seen on all three kernels: entry 1 of every 2 MiB THP); the page moved with its folio.
    assert m["query_on_target"] == pages and m["after_nodes"] == [1]
    busy = m["status_counts"].get(str(-errno.EBUSY), 0)
    assert m["status_counts"].get("1", 0) + busy == pages, m["status_counts"]
    assert busy == 0 or m["thp_kb"] > 0
    assert m["sha_after"] == m["sha_before"]


@pytest.fixture(scope="module")
def pmem(lab):
    prelude = ("N=$(scripts/lab/pmem.sh kmem)\nM=$(scripts/lab/pmem.sh fsdax)\n"
               "cat /sys/devices/system/memory/auto_online_blocks >&2")
    r = lab.run(_guest_script("kmem_node=$N", "fsdax=$M", f"move={16 << 20}:$N", prelude=prelude),
                profile="pmem", kernel="6.12")
    facts = _parse(r)
    facts["stderr"] = r.stderr
    return facts


def test_pmem_kmem_node_in_lower_tier(pmem):
    node = pmem["kmem_node"]
    assert node == 2
    assert pmem["online"] == "0-2"
    assert pmem["nodes"][2]["cpulist"] == ""
    want = PMEM.nodes[2]
    assert pmem["nodes"][2]["hmat"]["read_latency"] == want.latency_ns
    assert pmem["nodes"][2]["hmat"]["read_bandwidth"] == want.bandwidth_mb_s
    assert _tier_of(pmem, 2) > _tier_of(pmem, 1) > _tier_of(pmem, 0)
    # the helper restored the kernel's auto-online policy after daxctl
    assert pmem["stderr"].split()[-1] == "online"
    m = pmem["moves"]["2"]
    assert m["query_on_target"] == m["pages"] and m["sha_after"] == m["sha_before"]


def test_pmem_fsdax_mapped(pmem):
    fs = pmem["fsdax"]
    assert fs["map_sync"] and fs["read_back"]
    dev, mnt, fstype, opts = fs["mount"][:4]
    assert dev.startswith("/dev/pmem") and fstype == "ext4"
    assert "dax=always" in opts.split(",") or "dax" in opts.split(",")


@pytest.fixture(scope="module")
def cxl_type3(lab):
    script = ("set -e\nN=$(scripts/lab/pmem.sh cxl-kmem)\necho \"kmem_node=$N\"\n"
              "ls /sys/bus/cxl/devices\n"
              "grep . /sys/devices/virtual/memory_tiering/memory_tier*/nodelist\n")
    r = lab.run(script, profile="cxl-type3", kernel="6.12")
    assert r.rc == 0, f"{r.stderr}\n--- dmesg tail ---\n" + "\n".join(r.dmesg.splitlines()[-30:])
    return r.stdout


def test_cxl_type3_region_onlined_as_lower_tier_node(cxl_type3):
    lines = cxl_type3.split()
    assert "kmem_node=2" in lines
    # the CXL objects the topology code reads: memdev, endpoint, root decoder, the region
    for dev in ("mem0", "root0", "decoder0.0", "region0"):
        assert dev in lines, dev
    tiers = {}
    for line in lines:
        if line.startswith("/sys/devices/virtual/memory_tiering/memory_tier"):
            path, nodes = line.split(":")
            tiers[int(path.rsplit("memory_tier", 1)[1].split("/")[0])] = nodes
    node2_tier = [t for t, nodes in tiers.items() if nodes == "2"]
    # no CDAT in QEMU 7.2's device: the kmem node gets the default DAX distance, below DRAM
    assert node2_tier and node2_tier[0] > 4, tiers
