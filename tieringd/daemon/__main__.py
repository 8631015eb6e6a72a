# SPDX-License-Identifier: Apache-2.0
"""``python -m tieringd.daemon``: the same as the ``tieringd`` console script."""
import sys

from tieringd.daemon import main

sys.exit(main())
