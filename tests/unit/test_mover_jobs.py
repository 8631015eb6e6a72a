# SPDX-License-Identifier: Apache-2.0
"""Requests, jobs and the kernel seam of the mover (tieringd/mover/jobs.py)."""
import pytest

from tieringd.kernel import sysfs
from tieringd.contracts import Move, Priority
from tieringd.mover.counters import Report
from tieringd.mover.jobs import PF_EXITING, Job, Kernel, MoveRequest, Ticket

PS = 4096


def test_a_policy_move_becomes_a_request():
    r = MoveRequest.from_move(Move(7, 0x1000, 2 * PS, 0, 1, Priority.PROMOTE))
    assert (r.pid, r.ranges, r.target, r.priority) == (7, [(0x1000, 2 * PS)], 1, Priority.PROMOTE)


def test_a_report_is_done_when_its_job_and_retries_are_over():
    rep = Report(7, 1, Priority.DEMOTE)
    t = Ticket(rep)
    job = Job(7, 1, [], Priority.DEMOTE, [(0, 3 * PS)], rep, [t])
    assert job.npages() == 3 and not job.started
    job.live[0] += 1                        # a retry shares the report
    job.finish(1.0)
    assert not t.done()
    with pytest.raises(TimeoutError, match="pid 7 still running"):
        t.wait(0)
    job.finish(2.0)
    assert t.wait(0) is rep and rep.finished == 2.0


@pytest.mark.parametrize("state, flags, gone", [("S", 0, False), ("Z", 0, True), ("R", PF_EXITING, True),
                                                ("R", 0x400040, False)])
def test_process_gone_reads_state_and_pf_exiting_from_proc_stat(tmp_path, state, flags, gone):
    (tmp_path / "proc/42").mkdir(parents=True)
    # the command name may hold spaces and parentheses: fields count from the last ')'
    (tmp_path / "proc/42/stat").write_text(f"42 (a (b) c) {state} 1 42 42 0 -1 {flags} 0 0 0 0\n")
    with sysfs.root(tmp_path):
        assert Kernel.process_gone(42) is gone
        assert Kernel.process_gone(43) is True          # no such process
