# SPDX-License-Identifier: Apache-2.0
"""Guest side of the pool profile's first proof: one host writes random bytes into the shared devdax
device, the other reads them back; both reach etcd through the forward, and nothing else on the host.

    device_check.py write DEV OFFSET_MIB MIB    -> {"md5": …}    random bytes at that offset
    device_check.py read DEV OFFSET_MIB MIB     -> {"md5": …}
    device_check.py net HOST_PORT               -> {"etcd": …, "host_loopback": …}

``net``: puts and reads a key through the first member's forward (``$TIERINGD_LAB_ETCD``), then tries
the lab host's loopback port directly through slirp's gateway (10.0.2.2): with ``restrict=on`` that
connection must fail, although the member listens there.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import socket
import subprocess
import sys

MiB = 1 << 20


def _map(dev: str, off_mib: int, mib: int) -> mmap.mmap:
    fd = os.open(dev, os.O_RDWR)
    try:
        return mmap.mmap(fd, mib * MiB, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=off_mib * MiB)
    finally:
        os.close(fd)


def net(host_port: int) -> dict:
    from etcd3gw.client import Etcd3Client
    h, p = os.environ["TIERINGD_LAB_ETCD"].split(",")[0].split(":")
    c = Etcd3Client(host=h, port=int(p), timeout=30)
    me = os.environ["LAB_HOST"]
    c.put(f"lab/hello/{me}", me)
    out = {"etcd": [v.decode() for v in c.get(f"lab/hello/{me}")]}
    # a default route through slirp's gateway: without restrict=on, 10.0.2.2:PORT is the host's loopback
    subprocess.run(["ip", "route", "add", "default", "via", "10.0.2.2"], check=False, capture_output=True)
    try:
        with socket.create_connection(("10.0.2.2", host_port), timeout=10):
            out["host_loopback"] = "connected"
    except OSError as e:
        out["host_loopback"] = f"refused: {e.strerror or e}"
    return out


def main(argv: list[str]) -> int:
    cmd = argv[1]
    if cmd == "net":
        print(json.dumps(net(int(argv[2]))))
        return 0
    dev, off, mib = argv[2], int(argv[3]), int(argv[4])
    m = _map(dev, off, mib)
    if cmd == "write":
        data = os.urandom(mib * MiB)
        m[:] = data          # (msync on devdax is EINVAL: there is no page cache to write back)
    print(json.dumps({"md5": hashlib.md5(m[:]).hexdigest()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
