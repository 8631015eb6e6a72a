# SPDX-License-Identifier: Apache-2.0
"""Python side of ``bpf/pmusample.bpf.c``: data-address samples from a perf event, per (pid, block).

The BPF program is attached to one event per online CPU, opened system-wide (pid -1) so that one set
of events serves every tracked process; the kernel-side filter keeps tracked tgids and ranges. Which
event: :func:`tieringd.sampling._perf.resolve_event` (PEBS, IBS, or the software page-fault event that
tests use on machines without a PMU). CPUs brought online later are not sampled until restart.
"""
from __future__ import annotations

import os

from tieringd.contracts import SampleSource

from . import _perf
from .base import BpfSampler, SamplerUnavailable, explain_bpf_error


class PmuSampler(BpfSampler):
    tool = "pmusample"
    source = SampleSource.PMU

    def __init__(self, tracked, *, event: str = "auto", sample_period: int | None = None, **kw):
        super().__init__(tracked, **kw)
        self.event_name = event
        self.sample_period = sample_period
        self.event: _perf.PmuEvent | None = None

    def open(self) -> None:
        try:
            self.event = _perf.resolve_event(self.event_name, self.sample_period)
        except OSError as e:
            raise SamplerUnavailable(f"pmusample: {e.strerror}") from e
        super().open()

    def attach(self) -> None:
        prog = self.obj.program("pmu_sample")
        for cpu in _perf.online_cpus():
            try:
                fd = _perf.perf_event_open(self.event.attr, -1, cpu)
            except OSError as e:
                raise SamplerUnavailable(f"pmusample: {self.event.name} on CPU {cpu}: "
                                         f"{e.strerror}") from e
            try:
                self.links.append(prog.attach_perf_event(fd))   # the link owns fd from here on
            except OSError as e:
                os.close(fd)
                raise SamplerUnavailable(explain_bpf_error(e, "pmusample")) from e
