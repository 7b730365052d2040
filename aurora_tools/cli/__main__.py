"""``python -m aurora_tools.cli …``: the ``aurora`` console script (used by the demo's and benchmarks' child processes)."""

from __future__ import annotations

import sys

from aurora_tools.cli.main import main

sys.exit(main())
