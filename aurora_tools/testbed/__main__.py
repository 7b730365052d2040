"""``python -m aurora_tools.testbed serve …``: the detached process of ``aurora testbed up --background``."""

from __future__ import annotations

import argparse
import sys

from aurora_store.errors import AuroraError
from aurora_tools.testbed.serve import serve
from aurora_tools.testbed.testbed import DEFAULT_BUCKET, DEFAULT_DIR, S3_KINDS


def _main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m aurora_tools.testbed")
    ap.add_argument("action", choices=("serve",))
    ap.add_argument("--dir", default=DEFAULT_DIR)
    ap.add_argument("--s3-port", type=int, default=0)
    ap.add_argument("--redis-port", type=int, default=0)
    ap.add_argument("--bucket", default=DEFAULT_BUCKET)
    ap.add_argument("--s3", choices=S3_KINDS, default="auto")
    args = ap.parse_args(argv)
    try:
        return serve(args.dir, args.s3_port, args.redis_port, args.bucket, background=True, s3=args.s3)
    except AuroraError as e:
        print(f"aurora testbed: error: {e}", file=sys.stderr, flush=True)
        return 1


sys.exit(_main(sys.argv[1:]))
