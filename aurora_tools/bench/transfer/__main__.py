"""``python -m aurora_tools.bench.transfer``: the same as ``aurora bench transfer``."""

from __future__ import annotations

import argparse

from aurora_tools.bench.transfer.options import add_arguments
from aurora_tools.bench.transfer.report import main

ap = argparse.ArgumentParser(prog="aurora bench transfer")
add_arguments(ap)
raise SystemExit(main(ap.parse_args()))
