# SPDX-License-Identifier: Apache-2.0
"""Sizes as users write them, parsed one way everywhere (CLI options, config tables, the shim's
environment): suffixes are binary, as in the shim's C parser, QEMU and numactl — ``4M`` = ``4MiB`` =
``4MB`` = 4·2^20 bytes. Plain numbers are bytes (``4096``, ``0x1000``); fractions are allowed with a
suffix (``1.5G``)."""
from __future__ import annotations

import math
import re

_SHIFT = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40, "p": 50}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([kmgtp]?)(i?)(b?)\s*", re.IGNORECASE)


def parse_size(value: int | float | str, what: str = "size", minimum: int = 0) -> int:
    """Bytes for ``value``; ``ValueError`` naming ``what`` when it is not a size or is below ``minimum``."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: {value!r} is not a size")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{what}: {value!r} is not a size")
    if isinstance(value, (int, float)):
        n = int(value)
    else:
        text = str(value).strip()
        try:
            n = int(text, 0)          # 4096, 0x1000
        except ValueError:
            m = _SIZE.fullmatch(text)
            if not m or (m[3] and not m[2]):
                raise ValueError(f"{what}: {value!r} is not a size (e.g. 4096, 4M, 64MiB, 1.5G)") from None
            scaled = float(m[1]) * (1 << _SHIFT[m[2].lower()])
            if not math.isfinite(scaled):
                raise ValueError(f"{what}: {value!r} is not a size (e.g. 4096, 4M, 64MiB, 1.5G)")
            n = int(scaled)
    if n < minimum or (isinstance(value, float) and value < minimum):     # -0.5 is no size, not 0
        raise ValueError(f"{what}: must be at least {minimum} bytes, not {value!r}")
    return n
