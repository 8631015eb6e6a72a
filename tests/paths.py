# SPDX-License-Identifier: Apache-2.0
"""Where the repository and its build outputs are, for every test module (one definition; pytest puts
``tests/`` on ``sys.path`` because ``tests/conftest.py`` lives there)."""
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUILD = REPO / "build"
LAB_SCRIPTS = REPO / "scripts" / "lab"   # loop_report.py, kv_loop.py: the lab's host and guest helpers
SHIM_SO = BUILD / "libtieringd-shim.so"
