"""``python -m aurora_tools.bench.ledger``: the same program as ``aurora bench ledger``."""

from __future__ import annotations

import argparse

from aurora_tools.bench.ledger import add_arguments, main

if __name__ == "__main__":  # pragma: no cover - `aurora bench ledger` is the entry point
    ap = argparse.ArgumentParser(prog="aurora bench ledger")
    add_arguments(ap)
    raise SystemExit(main(ap.parse_args()))
