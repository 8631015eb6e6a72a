# SPDX-License-Identifier: Apache-2.0
"""What every figure script does last: the figure as indented JSON, to --json's file or to stdout."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def write_figure(fig: dict, path: str | None) -> None:
    text = json.dumps(fig, indent=2) + "\n"
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    else:
        sys.stdout.write(text)
