# SPDX-License-Identifier: Apache-2.0
"""The ``tieringd`` service loop: registry → samplers → heat → policy → mover, every tick.

The loop itself is a later issue; the entry point exists so packaging and install paths are fixed now.
"""
from __future__ import annotations

import sys


def main() -> int:
    sys.stderr.write("tieringd: the service loop is not built yet; use tieringctl for reports\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
