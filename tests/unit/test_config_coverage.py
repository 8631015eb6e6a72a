# SPDX-License-Identifier: Apache-2.0
"""Every documented configuration key is live: for each key of each table of ``settings.TABLES`` a
probe (tests/unit/keys_*.py, registered in tests/unit/keyprobe.py) sets it away from its default
and shows the daemon's part that reads it doing something else — the policy's plan, the mover's
engine, the samplers the daemon opens, the CONFIG record to shims, the control socket, the metrics
endpoint, the lifecycle watcher, the block sizer, the heat of a block, the DAX tier's log, the
hot-plug policy, the topology. A key added to a table without a probe fails here, by name; so does a
probe of a key that no longer exists. The keys covered are the keys docs/configuration.md counts."""
from __future__ import annotations

import ast
import dataclasses
import re

import pytest

from tieringd import settings

import keys_heat  # noqa: F401  (each module registers its probes)
import keys_io  # noqa: F401
import keys_memory  # noqa: F401
import keys_policy  # noqa: F401
import keys_pool  # noqa: F401
import keys_service  # noqa: F401
import keys_sharing  # noqa: F401
from keyprobe import PROBES, Ctx, HostProbe

DOC_COUNT = re.compile(r"^(\d+) tables, (\d+) keys, generated from the code", re.M)


def documented_keys() -> list[tuple[str, str]]:
    return [(name, f.name) for name, (cls, _) in settings.TABLES.items() for f in dataclasses.fields(cls) if f.init]


def test_every_key_of_every_table_has_a_probe():
    missing = [f"[{t}] {k}" for t, k in documented_keys() if (t, k) not in PROBES]
    assert not missing, ("keys without a probe (add one to tests/unit/keys_*.py showing what the key "
                         "changes in the daemon): " + ", ".join(missing))


def test_every_probe_is_of_a_key_that_exists():
    stale = [f"[{t}] {k}" for t, k in PROBES if (t, k) not in documented_keys()]
    assert not stale, "probes of keys no table has: " + ", ".join(stale)


def test_the_keys_covered_are_the_keys_the_reference_counts(repo):
    m = DOC_COUNT.search((repo / "docs" / "configuration.md").read_text())
    assert m, "docs/configuration.md states how many tables and keys it documents"
    tables, keys = int(m[1]), int(m[2])
    assert len({t for t, _ in PROBES}) == tables == len(settings.TABLES)
    assert len(PROBES) == keys == len(documented_keys())


@pytest.mark.parametrize("table, key", documented_keys(), ids=[f"{t}.{k}" for t, k in documented_keys()])
def test_the_key_changes_what_the_daemon_does(table, key, tmp_path, repo):
    p = PROBES.get((table, key))
    if p is None:
        pytest.fail(f"[{table}] {key} has no probe")
    if isinstance(p, HostProbe):
        tree = ast.parse((repo / p.path).read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert p.name in names, f"[{table}] {key}: {p.path} has no test {p.name}"
        return
    assert p.__doc__, f"[{table}] {key}: say in the probe's docstring what it shows"
    p(Ctx(tmp_path, repo))
