# SPDX-License-Identifier: Apache-2.0
"""The probes of tests/unit/test_config_coverage.py: one small function per configuration key that
sets the key away from its default and shows the daemon's part that reads it doing something else.

A probe is registered with ``@probe("table", "key")``; its docstring says what it shows, so the probe
modules (keys_*.py beside this one) read as the list of what each key does. A probe gets a
:class:`Ctx`: a fresh temporary directory, the repository, and builders for the daemon's parts as
``Daemon._start`` builds them (from a captured machine where the topology matters). A key whose effect
needs root and BPF names its probe in tests/host/ instead (:func:`host_probe`)."""
from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Callable

from tieringd import config
from tieringd.daemon.loop import Daemon
from tieringd.kernel import sysfs
from tieringd.settings import Settings

from test_daemon_hotplug import FIX, daemon_as_started

PROBES: dict[tuple[str, str], "Callable[[Ctx], None] | HostProbe"] = {}


@dataclasses.dataclass(frozen=True)
class HostProbe:
    """A key whose effect needs root and BPF: its probe is the test ``name`` of ``path`` (run by
    ``make test``, where a missing facility fails rather than skips)."""
    path: str
    name: str
    doc: str


def probe(table: str, key: str):
    def register(fn: Callable[["Ctx"], None]) -> Callable[["Ctx"], None]:
        assert (table, key) not in PROBES, f"[{table}] {key} has two probes"
        PROBES[(table, key)] = fn
        return fn
    return register


def host_probe(table: str, key: str, path: str, name: str, doc: str) -> None:
    assert (table, key) not in PROBES, f"[{table}] {key} has two probes"
    PROBES[(table, key)] = HostProbe(path, name, doc)


@dataclasses.dataclass
class Ctx:
    tmp: Path
    repo: Path
    _n: itertools.count = dataclasses.field(default_factory=itertools.count)

    def dir(self) -> Path:
        """A new directory of its own (a probe often builds the default and the changed setting)."""
        d = self.tmp / f"case{next(self._n)}"
        d.mkdir()
        return d

    def file(self, text: str) -> config.ConfigFile:
        p = self.dir() / "tieringd.toml"
        p.write_text(text)
        return config.load(str(p))

    def settings(self, text: str = "") -> Settings:
        return Settings.from_config(self.file(text))

    def daemon(self, text: str = "", machine: str = "cxl-6.12") -> Daemon:
        """A Daemon with what ``_start`` builds from the topology (tests/unit/test_daemon_hotplug.py),
        on a captured machine."""
        with sysfs.root(self.machine(machine)):
            return daemon_as_started(self.dir(), text)

    def bare_daemon(self, text: str = "") -> Daemon:
        """A Daemon as constructed, nothing started (its settings, its builders)."""
        d = self.dir()
        p = d / "tieringd.toml"
        p.write_text(text)
        return Daemon(config.load(str(p)), run_dir=str(d / "run"))

    def machine(self, name: str) -> Path:
        return self.repo / FIX / name
