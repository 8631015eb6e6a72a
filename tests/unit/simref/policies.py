# SPDX-License-Identifier: Apache-2.0
"""The policies the simulator compares, by name and kind.

- ``transparent`` (model.py: the same mover budget and the same view of the accesses for all):
  ``tieringd`` (the real policy), ``lru``, ``arc``, ``lfu`` (their kernel-side forms: a shadow cache
  ranks, the tick moves);
- ``reference``: the demand caches ``demand-lru``, ``demand-arc``, ``demand-lfu`` (a miss moves the
  block at the access, no budget) and static ``first-fit``;
- ``bound``: ``belady`` (MIN with bypass: no policy that holds at most the fast tier's capacity there
  has more hits).
"""
from __future__ import annotations

from tieringd.placement.heat import HeatConfig
from tieringd.placement.policy import PolicyConfig
from simref import demand, transparent
from simref.expand import Accesses
from simref.layout import Layout, Outcome
from simref.model import Observed, TransparentModel, observe

KIND = {"tieringd": "transparent", "lru": "transparent", "arc": "transparent", "lfu": "transparent",
        "demand-lru": "reference", "demand-arc": "reference", "demand-lfu": "reference",
        "first-fit": "reference", "belady": "bound"}
POLICIES = tuple(KIND)
DEFAULT_POLICIES = ("tieringd", "lru", "arc", "demand-lru", "demand-arc", "belady")


def run_policy(name: str, acc: Accesses, layout: Layout, model: TransparentModel, heat: HeatConfig | None = None,
               policy_cfg: PolicyConfig | None = None, progress=None, observed: Observed | None = None) -> Outcome:
    """One policy over ``acc``; ``observed`` (model.observe) may be passed in to share it between runs."""
    if name not in KIND:
        raise ValueError(f"unknown policy {name!r}: one of {', '.join(POLICIES)}")
    if KIND[name] != "transparent":
        return demand.run_reference(name, acc, layout, progress)
    cfg = policy_cfg or PolicyConfig()
    seen = observed if observed is not None else observe(acc, model)
    if name == "tieringd":
        def factory(mem):
            return transparent.TieringdPlanner(acc, layout, heat or HeatConfig(), cfg, model, mem)
    else:
        def factory(mem):
            return transparent.ShadowPlanner(demand.CACHES[name], acc, layout, cfg, mem)
    return transparent.run(acc, layout, factory, model, seen, progress)
