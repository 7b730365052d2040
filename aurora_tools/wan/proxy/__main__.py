"""``python -m aurora_tools.wan.proxy``: one proxy in the foreground (prints its address), or ``--selftest``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys

from aurora_tools.wan.profile import LinkProfile
from aurora_tools.wan.proxy.tcp import Proxy, parse_address


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m aurora_tools.wan.proxy", description="A seeded asyncio TCP proxy that makes a loopback hop look like a WAN link."
    )
    ap.add_argument("--listen", type=parse_address, default=("127.0.0.1", 0))
    ap.add_argument("--upstream", type=parse_address)
    ap.add_argument("--rate-mbit", type=float, default=None)
    ap.add_argument("--delay-ms", type=float, default=0.0, help="one way; RTT is twice this")
    ap.add_argument("--jitter-ms", type=float, default=0.0)
    ap.add_argument("--stall-prob", type=float, default=0.0, help="per MiB per direction")
    ap.add_argument("--stall-ms", type=float, default=500.0)
    ap.add_argument("--reset-prob", type=float, default=0.0, help="per connection")
    ap.add_argument("--truncate-prob", type=float, default=0.0, help="per connection")
    ap.add_argument("--loss-prob", type=float, default=0.0, help="per MiB per direction")
    ap.add_argument("--loss-pause-ms", type=float, default=200.0)
    ap.add_argument("--window-bytes", type=int, default=LinkProfile().window_bytes)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--selftest", action="store_true", help="measure throughput; print a table and JSON")
    ap.add_argument("--json", action="store_true", help="with --selftest: JSON only")
    args = ap.parse_args(argv)
    if args.selftest:
        # The self-test measures the proxy (and the netns testbed built on it): it is a program of
        # its own, run as one, so that the proxy never imports what imports the proxy.
        return subprocess.call([sys.executable, "-m", "aurora_tools.wan.selftest", *(["--json"] if args.json else [])])
    if args.upstream is None:
        ap.error("--upstream is required (or --selftest)")
    profile = LinkProfile(
        rate_mbit=args.rate_mbit,
        delay_ms=args.delay_ms,
        jitter_ms=args.jitter_ms,
        stall_prob=args.stall_prob,
        stall_ms=args.stall_ms,
        reset_prob=args.reset_prob,
        truncate_prob=args.truncate_prob,
        loss_prob=args.loss_prob,
        loss_pause_ms=args.loss_pause_ms,
        window_bytes=args.window_bytes,
        seed=args.seed,
    )

    async def serve() -> None:
        proxy = Proxy(args.upstream, profile, listen=args.listen)
        host, port = await proxy.start()
        print(f"{host}:{port}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            print(json.dumps(proxy.stats().as_dict()), file=sys.stderr, flush=True)
            await proxy.close()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
