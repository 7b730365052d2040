"""A run at a glance, read from Redis: Trainer head, Relays, Actors, open steps.

:func:`collect_status` reads (never writes) the keys of docs/PROTOCOL.md and
docs/WORKERS.md (the Trainer's through :mod:`~aurora_store.coordination.records`) into one JSON-able dict; :func:`render` turns it into a few
aligned tables. ``aurora status`` is the command-line glue. Actors are those with a record
(live, or departed within the ledger's ``departed_ttl_s``), never every id
that ever joined.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from aurora_store.coordination.decode import as_int, as_str
from aurora_store.coordination.evals import read_evals
from aurora_store.coordination.keys import RunKeys
from aurora_store.coordination.ledger import Ledger, LedgerLost
from aurora_store.coordination.records import RunRecords, TrainerRecord
from aurora_store.coordination.redisconn import server_time_ms, translate_redis_errors

__all__ = ["collect_status", "render"]


# Another process wrote these keys: the display decodes leniently and shows what it can.
@translate_redis_errors("status")
def collect_status(redis: Any, run: str, now_ms: int | None = None) -> dict[str, Any]:
    """Everything ``aurora status`` shows, as one JSON-able dict.

    ``now_ms``: the reference clock (default: the Redis server's ``TIME``,
    the clock heartbeats are stamped with). Ages are in seconds.
    """
    keys = RunKeys(run)
    ledger = Ledger(redis, run)
    if now_ms is None:
        now_ms = server_time_ms(redis, keys.fence)

    # Trainer
    th = RunRecords(redis, run, ledger).trainer()
    trainer: dict[str, Any] | None = None
    if th != TrainerRecord():
        published = th.published_ms
        trainer = {
            "head": th.head,
            "head_state": th.head_state or "",
            "published_ms": published,
            "published_age_s": None if published is None else round((now_ms - published) / 1000.0, 3),
            "step": th.step,
            "status": th.status,
        }
        # Present once a Trainer with the recovery features wrote them.
        if th.unreturned is not None:
            trainer["unreturned"] = th.unreturned
        # Whether the Trainer signs its manifests (FORMAT.md §4.1), and with which key.
        if th.signed is not None:
            trainer["signed"] = th.signed
            trainer["key_id"] = (th.key_id or "")[:64] or None
        epoch = as_int(redis.get(keys.epoch), lenient=True)
        if epoch is not None:
            trainer["epoch"] = epoch
        evals = read_evals(redis, keys)
        if evals:
            v = max(evals)
            trainer["eval"] = {
                "version": v,
                "accuracy": evals[v]["accuracy"],
                "problems": as_int(evals[v].get("problems"), lenient=True),
                "evaluations": len(evals),
            }

    # Relays
    relays = []
    for key in sorted({as_str(k, "replace") for k in redis.scan_iter(match=keys.relay_pattern, count=500)}):
        mirror = redis.get(key)
        if mirror is None:
            continue  # expired between SCAN and GET
        pttl = int(redis.pttl(key))
        relays.append(
            {
                "region": keys.relay_region(key),
                "mirror": as_str(mirror, "replace"),
                "ttl_s": None if pttl < 0 else round(pttl / 1000.0, 3),
            }
        )

    # Actors
    actors = []
    for a in ledger.actors():
        actors.append(
            {
                "id": a.actor,
                "region": a.region,
                "engine": a.engine,
                "status": a.status,
                "active": a.active,
                "staged": a.staged,
                "tau": a.tau,
                "leases": a.leases,
                "settled": a.settled,
                "heartbeat_ms": a.heartbeat_ms,
                "heartbeat_age_s": round((now_ms - a.heartbeat_ms) / 1000.0, 3) if a.heartbeat_ms else None,
                "quarantined": list(a.quarantined),
            }
        )

    # Open steps
    steps = []
    for v in ledger.open_steps():
        try:
            st = ledger.step_status(v)
        except LedgerLost:
            continue  # closed between the listing and the read
        steps.append(
            {
                "step": v,
                "version": ledger.step_version(v),
                "total": st.total,
                "leased": st.leased,
                "settled": st.settled,
                "pending": st.pending,
                "expired": st.expired,
                "rejected": st.rejected,
            }
        )

    return {"run": run, "now_ms": now_ms, "trainer": trainer, "relays": relays, "actors": actors, "steps": steps}


def _age(s: float | None) -> str:
    if s is None:
        return "-"
    if abs(s) < 120:
        return f"{s:.1f}s"
    if abs(s) < 7200:
        return f"{s / 60:.1f}m"
    return f"{s / 3600:.1f}h"


def _v(x: Any) -> str:
    return "-" if x is None else str(x)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    out = [indent + "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    for r in rows:
        out.append(indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return out


def render(status: dict[str, Any]) -> str:
    """The tables ``aurora status`` prints."""
    now = status["now_ms"]
    lines = [f"run {status['run']}  at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now / 1000))} (Redis clock)"]
    t = status.get("trainer")
    if t is None:
        lines.append("Trainer: none yet (no trainer hash)")
    else:
        state = f" (state {t['head_state'][:19]}…)" if t.get("head_state") else ""
        pub = "-"
        if t.get("published_ms") is not None:
            when = time.strftime("%H:%M:%S", time.localtime(t["published_ms"] / 1000))
            pub = f"{when}, {_age(t['published_age_s'])} ago"
        extra = "".join(f", {k} {t[k]}" for k in ("epoch", "unreturned") if t.get(k) is not None)
        if "signed" in t:
            extra += f", signed by key {t.get('key_id')}" if t["signed"] else ", unsigned"
        lines.append(f"Trainer: head v{_v(t['head'])}{state} published {pub}; status {_v(t['status'])}, step {_v(t['step'])}{extra}")
        ev = t.get("eval")
        if ev:
            lines.append(
                f"  eval: accuracy {ev['accuracy']:.3f} on v{ev['version']} ({_v(ev['problems'])} held-out problems; {ev['evaluations']} evaluation(s) recorded)"
            )

    relays = status.get("relays", [])
    lines.append(f"Relays ({len(relays)}):")
    if relays:
        lines += _table(
            ["region", "mirror", "ttl left"],
            [[r["region"], r["mirror"], "no ttl" if r["ttl_s"] is None else _age(r["ttl_s"])] for r in relays],
        )

    actors = status.get("actors", [])
    lines.append(f"Actors ({len(actors)}, {sum(a['status'] == 'alive' for a in actors)} alive):")
    if actors:
        lines += _table(
            ["id", "region", "engine", "status", "active", "staged", "tau tok/s", "leases", "settled", "heartbeat"],
            [
                [
                    a["id"],
                    a["region"],
                    a["engine"],
                    a["status"],
                    _v(a["active"]),
                    _v(a["staged"]),
                    f"{a['tau']:.1f}",
                    str(a["leases"]),
                    str(a["settled"]),
                    "-" if a["heartbeat_age_s"] is None else f"{_age(a['heartbeat_age_s'])} ago",
                ]
                for a in actors
            ],
        )
        # Versions refused as invalid (a corrupted object, a bad mirror): the operator's to repair.
        bad: dict[int, list[str]] = {}
        for a in actors:
            for v in a.get("quarantined") or ():
                bad.setdefault(int(v), []).append(a["id"])
        for v, who in sorted(bad.items()):
            lines.append(f"  quarantined: v{v} ({', '.join(who)}): failed validation; retried with back-off (repair the object at origin)")

    steps = status.get("steps", [])
    lines.append(f"Open steps ({len(steps)}):")
    if steps:
        lines += _table(
            ["step", "version", "total", "leased", "settled", "pending", "expired", "rejected"],
            [
                [str(s["step"]), _v(s["version"]), *(str(s[k]) for k in ("total", "leased", "settled", "pending", "expired", "rejected"))]
                for s in steps
            ],
        )
    if t is None and not relays and not actors and not steps:
        lines.append(f"(nothing of run {status['run']!r} in this Redis: is the run name right, has the Trainer started?)")
    return "\n".join(lines)
