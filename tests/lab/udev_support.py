# SPDX-License-Identifier: Apache-2.0
"""A systemd-udevd for the lab guests. Guests share the host root (virtme-ng), so the udevd they can
run is the host's: Debian's ``udev`` package (scripts/apt-packages.txt should list it; virtme-ng's init
then starts it in every guest). Until it does, the lab tests unpack that package — the version that
matches the host's systemd, whose libsystemd-shared it links — into build/lab-udev/ and start it from
there in the guest (apt-get download + dpkg-deb -x: nothing is installed on the host)."""
from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
UNPACKED = REPO / "build" / "lab-udev"
SYSTEM_UDEVD = ("/lib/systemd/systemd-udevd", "/usr/lib/systemd/systemd-udevd")


def ensure_udevd() -> str:
    """Path of a systemd-udevd the guest can run (raises RuntimeError saying what to install)."""
    for p in SYSTEM_UDEVD:
        if os.access(p, os.X_OK):
            return p
    udevd = UNPACKED / "systemd-udevd"
    if os.access(udevd, os.X_OK):
        return str(udevd)
    version = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "systemd"], capture_output=True,
                             text=True).stdout.strip()
    if not version:
        raise RuntimeError("no udev and no systemd package to match: apt-get install udev")
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run(["apt-get", "download", f"udev={version}"], cwd=tmp, capture_output=True, text=True)
        debs = list(Path(tmp).glob("udev_*.deb"))
        if r.returncode or not debs:
            raise RuntimeError(f"apt-get download udev={version} failed: {r.stderr.strip()[-300:]} "
                               "(or: apt-get install udev)")
        UNPACKED.mkdir(parents=True, exist_ok=True)
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(UNPACKED)], check=True)
    # systemd-udevd is udevadm under another name (the package's link is absolute: /bin/udevadm).
    if udevd.is_symlink() or udevd.exists():
        udevd.unlink()
    udevd.symlink_to("bin/udevadm")
    return str(udevd)
