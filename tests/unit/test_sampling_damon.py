# SPDX-License-Identifier: Apache-2.0
"""The DAMON fallback (tieringd/sampling/accessed.py's DamonSampler on tieringd/sampling/_damon_sysfs.py)
against the sysfs tree captured in the 6.12 lab guest (tests/fixtures/damon/6.12)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tieringd.kernel import sysfs
from tieringd.contracts import ACCESS_DELTA_DTYPE
from tieringd.sampling import _damon_sysfs, accessed
from tieringd.sampling import tracking as tr

def _damon_tree(root: Path, fixtures_dir: Path) -> tuple[Path, int, int]:
    """The captured 6.12 DAMON sysfs tree (tests/fixtures/damon/6.12/README), writable, as the kernel
    shows it once nr_kdamonds=1 and nr_contexts=1 were written; (admin dir, pid, base)."""
    captured = fixtures_dir / "damon/6.12"
    admin = root / "sys/kernel/mm/damon/admin"
    shutil.copytree(captured / "admin", admin)
    (admin / "kdamonds/nr_kdamonds").write_text("0\n")
    (root / "proc").mkdir(exist_ok=True)
    pid, base = map(int, (captured / "WORKLOAD").read_text().split())
    return admin, pid, base


def test_damon_sampler_writes_only_files_the_kernel_has(tmp_path, fixtures_dir, monkeypatch):
    admin, pid, base = _damon_tree(tmp_path, fixtures_dir)
    before = {p.relative_to(admin) for p in admin.rglob("*") if p.is_file()}
    monkeypatch.setattr(accessed, "kernel_config", lambda: None)
    t = tr.TrackedSet()
    t.add_process(pid)
    t.add_range(pid, base, 8 << 20, 1 << 20)
    with sysfs.root(tmp_path):
        s = accessed.DamonSampler(t)
        s.start()
        after = {p.relative_to(admin) for p in admin.rglob("*") if p.is_file()}
        assert after == before, "the sampler wrote a file the 6.12 DAMON sysfs does not have"
        ctx = admin / "kdamonds/0/contexts/0"
        assert (ctx / "operations").read_text() == "fvaddr"      # avail_operations lists it
        assert (ctx / "targets/0/pid_target").read_text() == str(pid)
        assert (ctx / "targets/0/regions/0/start").read_text() == str(base)
        assert (ctx / "targets/0/regions/0/end").read_text() == str(base + (8 << 20))
        assert (ctx / "schemes/0/action").read_text() == "stat"
        assert (ctx / "schemes/0/access_pattern/sz/max").read_text() == str(2**64 - 1)
        assert (admin / "kdamonds/0/state").read_text() == "on"
        (admin / "kdamonds/0/state").write_text("on")
        regions = s.regions(0)
        d = s.read_deltas()
    assert (admin / "kdamonds/0/state").read_text() == "update_schemes_tried_regions"
    # the captured regions tile the range and were all idle at capture time: no rows
    assert len(regions) == 11 and all(nr == 0 for _, _, nr in regions)
    assert min(r[0] for r in regions) == base and max(r[1] for r in regions) == base + (8 << 20)
    assert d.dtype == ACCESS_DELTA_DTYPE and len(d) == 0


def test_damon_refuses_a_kdamond_someone_else_configured(tmp_path, fixtures_dir):
    admin, _, _ = _damon_tree(tmp_path, fixtures_dir)
    (admin / "kdamonds/nr_kdamonds").write_text("1\n")
    (admin / "kdamonds/0/state").write_text("on\n")
    with sysfs.root(tmp_path):
        ok, why = _damon_sysfs.status()
        assert not ok and "in use by another tool" in why and "1 running" in why
        with pytest.raises(accessed.SamplerUnavailable, match="in use by another tool"):
            accessed.DamonSampler(tr.TrackedSet()).start()
    assert (admin / "kdamonds/nr_kdamonds").read_text() == "1\n"   # untouched
