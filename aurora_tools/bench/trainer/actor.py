"""A stand-in Actor: settles every open batch with random completions of a fixed length.

Why not the real Actor: generating with a 0.2-1 B model on this machine's
CPUs would take minutes per batch and the Actor's own model would share
the memory being measured. The Trainer cannot tell: it leases, collects,
parses and rewards these results as any Actor's (same ledger calls, same
payload), and the batch of step b+1 is ready while step b trains, as with
one-step asynchrony and Actors that keep up.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["synthetic_actor"]


@contextmanager
def synthetic_actor(
    redis_url: str, run: str, vocab: int, tokens: int, seed: int = 0, actor: str = "bench-actor", poll_s: float = 0.02
) -> Iterator[dict[str, int]]:
    """Run the stand-in in a thread while the block runs; yields its counters (``settled``, ``errors``).

    Completions are ``tokens`` ids drawn uniformly from ``[0, vocab)``.
    """
    from aurora_store.coordination.ledger import Ledger
    from aurora_store.coordination.redisconn import connect

    client = connect(redis_url)
    ledger = Ledger(client, run)
    stop = threading.Event()
    counts = {"settled": 0, "errors": 0}
    rng = random.Random(seed)

    def payload(group: int) -> bytes:
        comps = [[rng.randrange(vocab) for _ in range(tokens)] for _ in range(group)]
        return json.dumps({"completions": comps, "gen_s": 0.01}).encode()

    def loop() -> None:
        registered = False
        beat = 0.0
        active = -1
        while not stop.wait(poll_s):
            try:
                if not registered:
                    ledger.register(actor, region="bench", engine="bench")
                    registered = True
                    beat, active = 0.0, -1
                if time.monotonic() - beat > 1.0:
                    on = active if active >= 0 else None
                    registered = ledger.heartbeat(actor, active=on, staged=on)
                    beat = time.monotonic()
                for b, v, unsettled in ledger.open_step_info():
                    if unsettled <= 0:
                        continue
                    if v != active:
                        if not ledger.heartbeat(actor, active=v, staged=v):
                            registered = False
                            break
                        active, beat = v, time.monotonic()
                    status, leases = ledger.claim(actor, b, 64)
                    if status != "ok" or not leases:
                        continue
                    res = ledger.settle_many(actor, [(le, le.version, le.state, payload(le.group)) for le in leases])
                    counts["settled"] += sum(1 for s in res if s.accepted)
            except Exception:  # noqa: BLE001 - a stand-in rides out whatever the run does (Redis restarting, a step closing)
                counts["errors"] += 1
                time.sleep(poll_s)

    t = threading.Thread(target=loop, name=f"bench-actor-{run}", daemon=True)
    t.start()
    try:
        yield counts
    finally:
        stop.set()
        t.join(10)
        client.close()
