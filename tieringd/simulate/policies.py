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
blocks' state, the replay one window and what the view still has on its way.
"""
from __future__ import annotations

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
