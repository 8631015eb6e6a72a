# SPDX-License-Identifier: Apache-2.0
"""The policies the simulator compares, by name and kind, and the replay that runs them side by side.

- ``transparent`` (model.py: the same mover budget and the same view of the accesses for all):
  ``tieringd`` (the real policy), ``lru``, ``arc``, ``lfu`` (their kernel-side forms: a shadow cache
  ranks, the tick moves);
- ``reference``: the demand caches ``demand-lru``, ``demand-arc``, ``demand-lfu`` (a miss moves the
  block at the access, no budget) and static ``first-fit``;
- ``bound``: ``belady`` (MIN with bypass: no policy that holds at most the fast tier's capacity there
  has more hits).

:func:`replay` reads the spooled stream once and hands each window to every run: the runs hold their
blocks' state, the replay one window and what the view still has on its way. With ``jobs`` it shares
the runs out among processes (a trace of a hundred million accesses is minutes of CPU per run).
"""
from __future__ import annotations

import os
import pickle
from typing import Callable, Sequence

import numpy as np

from tieringd.placement.heat import HeatConfig
from tieringd.placement.policy import PolicyConfig
from tieringd.simulate import transparent
from tieringd.simulate.caches import SHADOWS
from tieringd.simulate.demand import BeladyRun, DemandRun
from tieringd.simulate.expand import Accesses
from tieringd.simulate.layout import Layout
from tieringd.simulate.model import TransparentModel, View

KIND = {"tieringd": "transparent", "lru": "transparent", "arc": "transparent", "lfu": "transparent",
        "demand-lru": "reference", "demand-arc": "reference", "demand-lfu": "reference",
        "first-fit": "reference", "belady": "bound"}
POLICIES = tuple(KIND)
DEFAULT_POLICIES = ("tieringd", "lru", "arc", "demand-lru", "demand-arc", "belady")


def make_run(name: str, acc: Accesses, layout: Layout, model: TransparentModel, heat: HeatConfig | None = None,
             policy_cfg: PolicyConfig | None = None, record: bool = False):
    """One policy's run over ``acc`` at one layout (not started: :func:`replay` drives it)."""
    if name not in KIND:
        raise ValueError(f"unknown policy {name!r}: one of {', '.join(POLICIES)}")
    if name == "belady":
        return BeladyRun(name, acc, layout, record)
    if KIND[name] == "reference":
        return DemandRun(name, acc, layout, record)
    cfg = policy_cfg or PolicyConfig()
    if name == "tieringd":
        def factory(mem):
            return transparent.TieringdPlanner(acc, layout, heat or HeatConfig(), cfg, model, mem)
    else:
        def factory(mem):
            return transparent.ShadowPlanner(SHADOWS[name], acc, layout, cfg, mem)
    return transparent.TransparentRun(name, acc, layout, factory, model, record)


def replay(acc: Accesses, runs: Sequence, view_model: TransparentModel | None = None,
           progress: Callable[[int], None] | None = None, jobs: int = 1) -> None:
    """Every run over the stream, window by window, side by side; with ``jobs`` > 1 the runs are
    shared out among that many processes (forked: each reads the spool itself, and sends its runs'
    tallies back), the runs' states living in theirs."""
    groups = _share_out(runs, jobs)
    if len(groups) <= 1:
        return _replay(acc, runs, view_model, progress)
    if any(isinstance(r, BeladyRun) for r in runs):
        # written once, before the fork: each process indexing it itself truncated the file under the
        # others' reads, and Belady's runs read zeros as next uses on a loaded machine
        acc.spool.index_next_use()
    children = []
    for group in groups[1:]:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:                                    # the child: its runs, then their tallies
            os.close(r)
            code = 1
            try:
                _replay(acc, group, view_model, None)
                with os.fdopen(w, "wb") as out:
                    pickle.dump([run.tally for run in group], out)
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        children.append((pid, r, group))
    share = len(runs) / len(groups[0])                 # the parent reports for everyone
    _replay(acc, groups[0], view_model, (lambda n: progress(int(n * share))) if progress else None)
    for pid, r, group in children:
        with os.fdopen(r, "rb") as inp:
            data = inp.read()
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0 or not data:
            raise RuntimeError(f"a simulation process ({', '.join(run.name for run in group)}) failed")
        for run, tally in zip(group, pickle.loads(data)):
            run.tally = tally


_COST = {"arc": 4, "lfu": 4, "tieringd": 3, "belady": 3, "demand-lru": 2, "demand-arc": 2, "demand-lfu": 2,
         "lru": 1, "first-fit": 1}                   # CPU per access, roughly (a coding-agent trace)


def _share_out(runs: Sequence, jobs: int) -> list[list]:
    """Runs in ``jobs`` groups of about equal cost (the costliest first, each to the lightest group)."""
    groups: list[list] = [[] for _ in range(max(1, min(jobs, len(runs))))]
    load = [0] * len(groups)
    for run in sorted(runs, key=lambda r: -_COST.get(r.name, 2)):
        k = load.index(min(load))
        groups[k].append(run)
        load[k] += _COST.get(run.name, 2)
    return [g for g in groups if g]


def _replay(acc: Accesses, runs: Sequence, view_model: TransparentModel | None = None,
            progress: Callable[[int], None] | None = None) -> None:
    """Every run over the stream, window by window, side by side. The transparent runs share one
    view of the accesses (``view_model``'s delay, sampling and seed)."""
    transparent_runs = [r for r in runs if isinstance(r, transparent.TransparentRun)]
    if transparent_runs and view_model is None:
        raise ValueError("transparent runs need the view's model")
    view = View(view_model) if transparent_runs else None
    last_access = np.full(acc.nblocks, -1, np.int64)      # per block: its latest access so far
    next_use = any(isinstance(r, BeladyRun) for r in runs)
    for w in acc.windows(next_use=next_use):
        prev = last_access[w.block]
        last_access[w.block] = np.arange(w.lo, w.hi)
        first = prev < 0
        seen = view.deliver(w, first) if view is not None else None
        for r in runs:
            if isinstance(r, transparent.TransparentRun):
                r.window(w, prev, seen)
            else:
                r.window(w, first)
        if progress is not None:
            progress(len(w.block) * len(runs))
