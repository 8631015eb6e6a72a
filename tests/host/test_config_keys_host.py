# SPDX-License-Identifier: Apache-2.0
"""The [sampling] keys whose effect shows only with BPF programs loaded (root, BTF): the samplers are
built from the table as the daemon builds them (``open_samplers`` with its ``SamplingConfig``; the
catalog's makers), and what they count or open differs. The other keys' probes:
tests/unit/test_config_coverage.py."""
from __future__ import annotations

import ctypes
import os
from types import SimpleNamespace

import numpy as np
import pytest

from tieringd import config, settings
from tieringd.sampling import TrackedSet, open_samplers, pagefault
from tieringd.sampling.catalog import access_sampler
from tieringd.service.metrics import sampler_counters

from test_bpf_samplers import _thp_and_small_regions

pytestmark = [pytest.mark.root, pytest.mark.bpf]


def sampling(tmp_path, text: str):
    p = tmp_path / "tieringd.toml"
    p.write_text(text)
    return settings.check(config.load(str(p))).sampling


def test_sampling_migrations_false_opens_no_migration_counter(tmp_path):
    """By default the daemon's sampler set counts page migrations per reason, and its metrics export
    them (sampler "migrations"); false: no counter, nothing exported."""
    for text, counter in (("", True), ("[sampling]\nmigrations = false\n", False)):
        tracked = TrackedSet()
        try:
            with open_samplers(tracked, sampling(tmp_path, text), sources=("fault",)) as ss:
                assert ss.mode == "bpf"
                assert (ss.migrations is not None) == counter, text
                exported = {s for s, _ in sampler_counters(SimpleNamespace(samplers=ss))}
                assert ("migrations" in exported) == counter and "pagefault" in exported
        finally:
            tracked.close()


def test_sampling_thp_accounting_false_counts_faults_not_base_pages(tmp_path):
    """A first touch of every page of two THP-backed 2 MiB blocks: 512 base pages seen per block, or
    one fault per block with thp_accounting = false."""
    H = pagefault.HPAGE_PMD_SIZE
    (m, thp), _ = _thp_and_small_regions(2)
    me = os.getpid()
    counts = {}
    for text in ("", "[sampling]\nthp_accounting = false\n"):
        tracked = TrackedSet()
        s = access_sampler("fault").make(tracked, sampling(tmp_path, text))
        try:
            s.start()
            tracked.add_process(me)
            tracked.add_range(me, thp, 2 * H, H)
            for off in range(0, 2 * H, 4096):
                ctypes.c_char.from_address(thp + off).value = b"t"
            if not pagefault.pmd_thp_at(me, np.array([thp, thp + H], np.uint64)).all():
                pytest.skip("the kernel did not back the region with THPs (fragmentation?)")
            counts[text] = sorted(int(c) for c in s.read_blocks()["count"])
        finally:
            s.close()
            tracked.close()
        # MADV_DONTNEED: the next round's touches fault the pages in again
        assert ctypes.CDLL(None, use_errno=True).madvise(ctypes.c_void_p(thp), ctypes.c_size_t(2 * H), 4) == 0
    assert counts[""] == [512, 512]
    assert counts["[sampling]\nthp_accounting = false\n"] == [1, 1]
    del m
