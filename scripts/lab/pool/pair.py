# SPDX-License-Identifier: Apache-2.0
"""Two lab guests at once, one memory pool: the ``pool`` profile's runner.

Both guests (hosts ``a`` and ``b``) boot the same profile side by side. Each has its own DRAM node and
vCPUs; both map one pool: an NVDIMM backed by a single host file with ``share=on`` (a fresh sparse
file per pair, removed afterwards), which each guest turns into a devdax device
(``scripts/lab/pool/guest.sh devdax``). etcd runs on the lab host's loopback; a guest reaches it only
through QEMU's user-mode networking with ``restrict=on`` and one ``guestfwd`` per member: the guest
connects to ``10.0.2.10N:2379`` and libslirp runs ``fwd.py`` for that connection, which relays it to
the member's loopback port. No bridge, tap or host network device; nothing leaves the loopback.

In each guest: ``$LAB_HOST`` (a or b), ``$LAB_PEER``, ``$LAB_SHARED`` (a host folder both guests
write, for the scripts' own barriers), ``$TIERINGD_LAB_ETCD`` (the members' guest-side addresses,
comma-separated), plus everything a single guest has (docs/lab.md).

Standard library only; ``lab`` is scripts/lab.py as a module (the caller's copy).
"""
from __future__ import annotations

import os
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
HOSTS = ("a", "b")
GUEST_ETCD_PORT = 2379
# the rc of a guest that powered itself off on purpose: its script left ``$LAB_SHARED/<host>.poweroff``
# before it (a host dying is what the pool's failure runs are about), so it never wrote an exit code
POWERED_OFF = -2


def guest_address(i: int) -> str:
    """Where a guest finds member ``i``: an address in slirp's 10.0.2.0/24 that only the forward serves."""
    return f"10.0.2.{100 + i}"


def forwarders(pair_dir: Path, endpoints: list[str]) -> tuple[str, ...]:
    """One ``guestfwd`` per member, each running a forwarder program written into ``pair_dir`` (vng
    passes QEMU's arguments through a shell unquoted: the program's path is one word)."""
    out = []
    for i, ep in enumerate(endpoints):
        host, _, port = ep.rpartition(":")
        if host not in ("127.0.0.1", "localhost") or not port.isdigit():
            raise ValueError(f"etcd endpoint {ep}: the lab forwards to the host's loopback only")
        prog = pair_dir / f"fwd-{port}"
        prog.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -S -I "
                        f"{shlex.quote(str(HERE / 'fwd.py'))} {port}\n")
        prog.chmod(0o755)
        out.append(f"tcp:{guest_address(i)}:{GUEST_ETCD_PORT}-cmd:{prog}")
    return tuple(out)


def run_pair(lab, scripts: dict[str, str], *, endpoints: list[str], profile: str = "pool",
             kernel: str | None = None, timeout_s: float = 600, out_dirs: dict[str, Path] | None = None,
             node_mib: int | None = None, on_start=None) -> dict:
    """Boot hosts a and b of ``profile`` at once, ``scripts[h]`` in each; returns {h: LabResult}.
    ``endpoints``: the etcd members' client addresses on the host's loopback. ``on_start(shared)``
    is called with the guests' barrier folder before they boot (a watcher on the lab host). A guest
    that powered itself off on purpose has rc ``POWERED_OFF``. Raises lab.LabError for the first
    guest that failed to run (the other is still waited for)."""
    prof = lab.PROFILES[profile]
    if prof.guests != 2 or not prof.shared_mib:
        raise lab.LabError(f"profile {profile} is not a two-host profile")
    kernel = kernel or lab.DEFAULT_KERNEL
    runs = lab.cache_dir() / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    pair = Path(tempfile.mkdtemp(prefix=f"{profile}-pair-{kernel}-", dir=runs))
    shared = pair / "shared"
    shared.mkdir()
    pool_file = pair / "pool.img"
    with open(pool_file, "wb") as f:
        f.truncate(prof.shared_mib << 20)       # sparse: every pair starts from zeros
    fwd = forwarders(pair, endpoints)
    etcd = ",".join(f"{guest_address(i)}:{GUEST_ETCD_PORT}" for i in range(len(endpoints)))
    results: dict = {}
    errors: dict[str, BaseException] = {}
    if on_start is not None:
        on_start(shared)

    def one(h: str) -> None:
        env = {"LAB_HOST": h, "LAB_PEER": HOSTS[1 - HOSTS.index(h)], "LAB_SHARED": str(shared),
               "TIERINGD_LAB_ETCD": etcd}
        t0 = time.monotonic()
        try:
            results[h] = lab.run(scripts[h], profile=profile, kernel=kernel, timeout_s=timeout_s,
                                 out_dir=(out_dirs or {}).get(h), node_mib=node_mib, shared_file=pool_file,
                                 guestfwd=fwd, env=env, rwdirs=(shared,))
        except lab.LabError as e:
            if (shared / f"{h}.poweroff").exists():
                results[h] = lab.LabResult(rc=POWERED_OFF, stdout="", stderr=str(e)[-2000:],
                                           wall_s=time.monotonic() - t0, out_dir=(out_dirs or {}).get(h),
                                           profile=profile, node_mib=node_mib)
            else:
                errors[h] = e
        except BaseException as e:      # noqa: BLE001 - handed to the caller's thread
            errors[h] = e
        # the guest is gone: the other guest's barriers stop waiting for it
        (shared / f"ended-{h}").write_text(str(errors[h])[:2000] if h in errors else str(results[h].rc))

    threads = [threading.Thread(target=one, args=(h,), name=f"lab-{h}") for h in HOSTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        pool_file.unlink()              # sparse, but what the guests wrote is real disk
    except OSError:
        pass
    for h in HOSTS:
        if h in errors:
            raise errors[h]
    return results
