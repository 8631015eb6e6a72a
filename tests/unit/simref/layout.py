# SPDX-License-Identifier: Apache-2.0
"""The simulated memory (tiers and their capacities) and what a policy's run leaves behind."""
from __future__ import annotations

import dataclasses

import numpy as np

from tieringd.contracts import Tier


@dataclasses.dataclass(frozen=True)
class Layout:
    tiers: tuple[Tier, ...]                 # fastest first
    capacity_blocks: tuple[float, ...]      # per tier; the last may be inf


@dataclasses.dataclass
class Outcome:
    served: np.ndarray          # int8 per access: index into Layout.tiers
    hit: np.ndarray             # bool per access
    migrated_bytes: float
