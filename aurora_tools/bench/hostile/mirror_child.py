"""An Actor staging once from a mirror, in a process of its own: ``python -m aurora_tools.bench.hostile.mirror_child RUN.pickle``.

What :mod:`aurora_tools.bench.hostile.mirrors` runs for each oversized object
from a mirror, so that the reader's peak resident size is its own (the
parent reads it from ``wait4``) and an address-space limit bounds it. Prints
one JSON line: the states staged, where each version came from, or the error.
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path


def fresh_actor(spec: dict) -> dict:
    """A fresh Actor of the run at ``spec``'s URLs: its real boot (model description, torch engine,
    the newest usable version) within ``timeout_s``; returns the version and state it reached."""
    import threading

    from aurora_store.clock import SYSTEM_CLOCK
    from workers.actor import Actor, ActorConfig
    from workers.common import Endpoints

    a = Actor.from_endpoints(
        Endpoints(spec["url"], spec["redis"], spec["run"]), ActorConfig(actor_id="fresh", run_poll_s=0.2), SYSTEM_CLOCK
    )
    got: dict = {}

    def boot() -> None:
        try:
            a.boot.prepare()
            got["reached"] = a.boot.reach()
        except Exception as e:  # noqa: BLE001 - reported to the parent
            got["error"] = f"{type(e).__name__}: {str(e)[:300]}"

    t = threading.Thread(target=boot, daemon=True)
    t.start()
    t.join(spec["timeout_s"])
    a.ctx.stop.set()
    t.join(30)
    reached = got.get("reached")
    return {"error": got["error"]} if "error" in got else {"reached": list(reached) if reached else None}


def main(argv: list[str]) -> int:
    import redis

    from aurora_store.testing.clock import ManualClock
    from aurora_tools.bench.hostile.workers import mirror_actor

    spec = pickle.loads(Path(argv[0]).read_bytes())  # noqa: S301 - written by the parent bench, a moment ago
    if spec.get("mode") == "fresh":
        print(json.dumps(fresh_actor(spec)))
        return 0
    run = dict(spec["run"])
    run["client"] = redis.Redis.from_url(run["redis"])
    try:
        a, rec = mirror_actor(run, spec["mirror"], mirror=spec["mirror"], mirror_grace_s=0.0)
        if spec["full_bytes"] is not None:
            a.fetcher.full_bytes = spec["full_bytes"]  # as after a bootstrap from a snapshot: catch-ups weigh a whole version
        for _ in range(4):  # the stager's loop, a few rounds (a refused catch-up replays on the next)
            a.stager.stage_once()
            if a.staged and a.staged[-1].version >= max(run["states"]):
                break
            if isinstance(a.ctx.clock, ManualClock):
                a.ctx.clock.advance(60.0)
        out = {"staged_states": [e.state for e in a.staged], "sources": rec.sources}
    except Exception as e:  # noqa: BLE001 - reported to the parent, which judges
        out = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
