#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The Debian mirror this machine already uses, read from its own apt sources.

The lab (scripts/lab.py: Debian's kernels for the guests) and the fresh-root check
(scripts/fresh-check.sh: a Debian 12 root built from Debian's archive) download from Debian. They take
the archive and the security archive from the host's apt configuration — deb822 ``*.sources`` files
(sources.list(5), "DEB822-STYLE FORMAT") and one-line ``sources.list`` entries — so that a machine
behind its company's mirror uses that mirror, and nothing in the tree names a mirror host.

    TIERINGD_DEBIAN_MIRROR=URI, TIERINGD_DEBIAN_SECURITY=URI   override what the sources say
    APT_ROOT=DIR                                               read DIR/etc/apt instead of /etc/apt

``python3 scripts/debian_mirror.py`` prints ``MIRROR=… SECURITY=…`` lines for a shell to eval.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import sys

# Debian's release codenames: an entry serving one of these (or its -updates) is the archive.
CODENAMES = ("buster", "bullseye", "bookworm", "trixie", "forky", "duke", "sid", "stable", "testing",
             "unstable", "oldstable")


class MirrorError(Exception):
    """The host's apt sources name no Debian archive (and no override is set)."""


@dataclasses.dataclass(frozen=True)
class Entry:
    uri: str
    suites: tuple[str, ...]


def _deb822(text: str) -> list[Entry]:
    """Stanzas of a ``.sources`` file (blank-line separated; ``#`` comments; ``Enabled: no`` off)."""
    out = []
    for stanza in text.split("\n\n"):
        fields: dict[str, str] = {}
        key = None
        for line in stanza.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            if line[0] in " \t" and key:                    # a continuation line
                fields[key] += " " + line.strip()
                continue
            key, _, value = line.partition(":")
            key = key.strip().lower()
            fields[key] = value.strip()
        if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes").lower() == "no":
            continue
        out += [Entry(uri.rstrip("/"), tuple(fields.get("suites", "").split()))
                for uri in fields.get("uris", "").split()]
    return out


def _one_line(text: str) -> list[Entry]:
    """``deb [options] URI SUITE COMPONENT…`` lines of a ``.list`` file."""
    out = []
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if not words or words[0] != "deb":
            continue
        words = words[1:]
        if words and words[0].startswith("["):
            while words and not words[0].endswith("]"):
                words.pop(0)
            words = words[1:]
        if len(words) >= 2:
            out.append(Entry(words[0].rstrip("/"), (words[1],)))
    return out


def host_entries(apt_root: str = "") -> list[Entry]:
    base = f"{apt_root.rstrip('/')}/etc/apt"
    entries = []
    for path in [f"{base}/sources.list", *sorted(glob.glob(f"{base}/sources.list.d/*.list"))]:
        if os.path.isfile(path):
            entries += _one_line(open(path, encoding="utf-8", errors="replace").read())
    for path in sorted(glob.glob(f"{base}/sources.list.d/*.sources")):
        entries += _deb822(open(path, encoding="utf-8", errors="replace").read())
    return entries


def _is_archive(e: Entry) -> bool:
    return any(s.split("-")[0] in CODENAMES and not s.endswith("-security") for s in e.suites)


def _is_security(e: Entry) -> bool:
    return any(s.split("/")[0].endswith("-security") or s.endswith("/updates") for s in e.suites)


def mirrors(apt_root: str | None = None, env: dict | None = None) -> tuple[str, str]:
    """(archive URI, security URI): the overrides, else the host's first Debian entries. A host
    without a security entry takes the archive's host with ``-security`` appended to its path, as
    Debian's own mirrors lay it out."""
    env = os.environ if env is None else env
    entries = host_entries(env.get("APT_ROOT", "") if apt_root is None else apt_root)
    archive = env.get("TIERINGD_DEBIAN_MIRROR") or next((e.uri for e in entries if _is_archive(e)), None)
    if not archive:
        raise MirrorError("the host's apt sources (/etc/apt/sources.list, sources.list.d/*.list and "
                          "*.sources) name no Debian archive: set TIERINGD_DEBIAN_MIRROR=URI "
                          "(and TIERINGD_DEBIAN_SECURITY=URI)")
    security = env.get("TIERINGD_DEBIAN_SECURITY") or next((e.uri for e in entries if _is_security(e)), None) \
        or archive + "-security"
    return archive, security


def main() -> int:
    try:
        archive, security = mirrors()
    except MirrorError as e:
        print(f"debian_mirror: {e}", file=sys.stderr)
        return 1
    print(f"MIRROR={archive}\nSECURITY={security}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
