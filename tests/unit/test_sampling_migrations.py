# SPDX-License-Identifier: Apache-2.0
"""The migration counter's reason names (tieringd/sampling/migrations.py), from the tracepoint format."""
from __future__ import annotations

from tieringd.kernel import sysfs
from tieringd.sampling import migrations


def test_migrate_reason_names_from_format(tmp_path):
    fmt = tmp_path / "sys/kernel/tracing/events/migrate/mm_migrate_pages"
    fmt.mkdir(parents=True)
    (fmt / "format").write_text(
        'print fmt: "nr=%lu reason=%s", REC->succeeded, __print_symbolic(REC->reason, '
        '{0, "compaction"}, {5, "numa_misplaced"}, {11, "future_reason"})\n')
    with sysfs.root(tmp_path):
        names = migrations.reason_names()
    assert names[5] == "numa_misplaced" and names[11] == "future_reason" and names[8] == "demotion"
    with sysfs.root(tmp_path / "none"):
        assert migrations.reason_names() == migrations.DEFAULT_REASONS
