# SPDX-License-Identifier: Apache-2.0
"""scripts/debian_mirror.py: the lab and the fresh-root check download from the Debian mirror the
host's own apt sources name (deb822 .sources and one-line .list files), or from an override; a host
whose sources name no Debian archive gets one line saying what to set."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import debian_mirror  # noqa: E402

DEB822 = """\
Types: deb
# a snapshot comment
URIs: http://mirror.example.internal/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://mirror.example.internal/debian-security
Suites: bookworm-security
Components: main

Types: deb
Enabled: no
URIs: http://disabled.example.internal/debian
Suites: bookworm
Components: main
"""


def apt(tmp_path, files: dict[str, str]) -> str:
    for name, text in files.items():
        p = tmp_path / "etc" / "apt" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return str(tmp_path)


def test_deb822_sources_give_the_archive_and_the_security_archive(tmp_path):
    root = apt(tmp_path, {"sources.list.d/debian.sources": DEB822,
                          "sources.list.d/other.sources": "Types: deb\nURIs: https://x.example/apt\n"
                                                           "Suites: nodistro\nComponents: main\n"})
    assert debian_mirror.mirrors(root, env={}) == ("http://mirror.example.internal/debian",
                                                   "http://mirror.example.internal/debian-security")


def test_one_line_sources_with_options_and_comments(tmp_path):
    root = apt(tmp_path, {"sources.list": "# deb http://old.example/debian buster main\n"
                                          "deb [arch=amd64 signed-by=/k.gpg] http://corp.example/deb/ bookworm main\n"
                                          "deb http://corp.example/sec bookworm-security main\n"})
    assert debian_mirror.mirrors(root, env={}) == ("http://corp.example/deb", "http://corp.example/sec")


def test_no_security_entry_takes_the_archive_hosts_security_path(tmp_path):
    root = apt(tmp_path, {"sources.list": "deb http://corp.example/debian trixie main\n"})
    assert debian_mirror.mirrors(root, env={}) == ("http://corp.example/debian", "http://corp.example/debian-security")


def test_overrides_win_and_a_host_without_debian_is_told_what_to_set(tmp_path):
    root = apt(tmp_path, {"sources.list.d/n.sources": "Types: deb\nURIs: https://x.example/apt\nSuites: nodistro\n"})
    with pytest.raises(debian_mirror.MirrorError, match="TIERINGD_DEBIAN_MIRROR"):
        debian_mirror.mirrors(root, env={})
    env = {"TIERINGD_DEBIAN_MIRROR": "http://m.example/debian", "TIERINGD_DEBIAN_SECURITY": "http://m.example/sec"}
    assert debian_mirror.mirrors(root, env=env) == ("http://m.example/debian", "http://m.example/sec")
