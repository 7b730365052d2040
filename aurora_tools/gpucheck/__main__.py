"""``python3 -m aurora_tools.gpucheck``: see :mod:`aurora_tools.gpucheck.main`."""

from aurora_tools.gpucheck.main import main

raise SystemExit(main())
