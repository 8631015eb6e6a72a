# SPDX-License-Identifier: Apache-2.0
"""A pool host as a process of its own, for the host tests that kill it with SIGKILL: the pool agent
and the DAX-remap tier opened as the daemon opens them (``pool.tier.open_tier``), demand held on its
log, heartbeats every third of the lease's TTL until the process is killed.

    pool_host_proc.py ENDPOINTS DEVICE HOST --demand-bytes N [--ttl-s 4] [--extent-bytes 2097152]

It prints one JSON line once it is a member holding its demand (its extents, its lease), then one
per heartbeat; it never leaves the pool by itself (no revoke): only SIGKILL ends it, as a crash would.
The process view points at a captured guest (tests/fixtures/sysfs), as in the tests in one process.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(TESTS.parent), str(TESTS)]      # this checkout's tieringd, and tests/paths.py

from paths import REPO  # noqa: E402
from tieringd.kernel import sysfs  # noqa: E402
from tieringd.pool.settings import PoolConfig  # noqa: E402
from tieringd.pool.tier import open_tier  # noqa: E402
from tieringd.shim.pmemlog import LogFull, SegmentState  # noqa: E402
from tieringd.shim.remap import DaxConfig  # noqa: E402

MACHINE = REPO / "tests/fixtures/sysfs/cxl-6.12"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("endpoints")
    ap.add_argument("device")
    ap.add_argument("host")
    ap.add_argument("--demand-bytes", type=int, required=True)
    ap.add_argument("--ttl-s", type=int, default=4)
    ap.add_argument("--extent-bytes", type=int, default=2 << 20)
    args = ap.parse_args(argv)
    cfg = PoolConfig(endpoints=tuple(args.endpoints.split(",")), prefix="/t/pool/", device=args.device,
                     host=args.host, lease_ttl_s=args.ttl_s, extent_bytes=args.extent_bytes)
    cfg.validate()
    with sysfs.root(MACHINE):
        tier, agent = open_tier(cfg, DaxConfig(), None, None, {}, start=False)
    log, held = tier.log, []
    announced = False
    while True:                         # until SIGKILL
        t0 = time.monotonic()
        while log.live_bytes + args.extent_bytes <= min(log.capacity_bytes, args.demand_bytes):
            try:
                held.append(log.allocate(args.extent_bytes, 1, len(held) * args.extent_bytes))
            except LogFull:
                break
        agent.beat()
        mine = [i for i, st in enumerate(tier.segment_states()) if i and st != SegmentState.FOREIGN]
        ready = agent.member.state == "member" and log.live_bytes >= args.demand_bytes
        if ready or announced:
            announced = True
            print(json.dumps({"host": args.host, "extents": mine, "lease": agent.member.lease,
                              "live_bytes": log.live_bytes, "state": agent.member.state}), flush=True)
        time.sleep(max(agent.heartbeat_s - (time.monotonic() - t0), 0.05))


if __name__ == "__main__":
    sys.exit(main())
