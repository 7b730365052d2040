"""The Actor's work: claim leases of a step on the active version, generate, settle.

A lease is claimed only for a step generated on the active version whose
state is the one this Actor holds; completions are settled with (active
version, its state), idempotently per (Actor, lease token).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from aurora_store import metrics
from aurora_store.coordination.ledger import Lease
from aurora_store.errors import AuroraError, OutageTooLong, StoreError
from aurora_store.lineage.results import ResultRefused, parse_reference, results_prefix, write_result
from aurora_store.outage import is_transient, riding
from workers.actor.context import ActorContext

__all__ = ["MAX_NEW_TOKENS_LIMIT", "WorkLoop"]

log = logging.getLogger("aurora.actor")

MAX_NEW_TOKENS_LIMIT = 32768
"""Most tokens per completion an Actor generates, whatever a prompt's payload asks (Redis is not trusted)."""


class WorkLoop:
    """Claims, generation and settlement for one Actor (the main thread's work between safe points).

    ``heartbeat`` reports at once (a claim refused because the ledger no
    longer knows this Actor registers it again).
    """

    def __init__(self, ctx: ActorContext, heartbeat: Callable[[], None]) -> None:
        self.ctx = ctx
        self.heartbeat = heartbeat
        self._state_refused: tuple[int, int] | None = None
        """(step, active version) last refused for its state: logged once."""
        self._bad_said: int | None = None
        """Step whose malformed leases were last logged."""

    def work_once(self) -> bool:
        """Claim leases of one open step on the active version, generate and settle them; False when there was none."""
        c, h = self.ctx, self.ctx.holding
        ledger = riding(c.ledger, c.redis_dep, c.stop)
        for s, sv, _ in ledger.open_step_info():
            if sv != h.active or not self.step_state_held(s):
                continue
            status, leases = ledger.claim(c.cfg.actor_id, s, c.cfg.claim)
            metrics.active().claimed(c.cfg.actor_id, c.cfg.region, len(leases))
            if status == "not_alive":
                c.redis_call(self.heartbeat, "heartbeat")
                return False
            if leases:
                self.generate_and_settle(leases)
                return True
        return False

    def _say_bad(self, leases: list[Lease]) -> None:
        """Log leases refused for their prompt or group size: once per step."""
        step = leases[0].step_id
        if self._bad_said == step:
            return
        self._bad_said = step
        log.error(
            "%s: step %d: %d lease(s) carry a prompt or group size the Trainer does not write (prompt %r…): "
            "not generating them; they expire and go back to the pool",
            self.ctx.cfg.actor_id,
            step,
            len(leases),
            leases[0].prompt[:64],
        )

    def step_state_held(self, step: int) -> bool:
        """Whether step ``step`` asks for the state this Actor holds: never claim a lease for another one."""
        c, h = self.ctx, self.ctx.holding
        raw = c.redis_call(lambda: c.redis.hget(c.keys.step(step), "state"), "read a step's state")
        want = raw.decode("ascii", "replace") if isinstance(raw, bytes) else raw
        if want is None or want == h.active_state:
            return True
        if self._state_refused != (step, h.active):
            self._state_refused = (step, h.active)
            log.error(
                "%s: step %d asks for state %s… on v%d, this Actor holds %s…: not claiming",
                c.cfg.actor_id,
                step,
                str(want)[:19],
                h.active,
                h.active_state[:19],
            )
        return False

    def generate_and_settle(self, leases: list[Lease]) -> None:
        c, h, cfg = self.ctx, self.ctx.holding, self.ctx.cfg
        # Prompts and group sizes are read from Redis, which every Actor's credential can write:
        # a lease whose prompt is not what the Trainer writes is left to expire, never generated.
        parsed = [(le, prompt_body(le.payload) if 1 <= le.group <= MAX_GROUP else None) for le in leases]
        if any(body is None for _, body in parsed):
            self._say_bad([le for le, body in parsed if body is None])
        good = [(le, body) for le, body in parsed if body is not None]
        if not good:
            return
        leases, bodies = [le for le, _ in good], [body for _, body in good]
        prompts = [b["ids"] for b in bodies]
        group = leases[0].group
        t0 = time.perf_counter()
        gen = c.engine.generate(
            prompts, group, max_new_tokens(bodies, cfg.max_new_tokens), seed=cfg.seed ^ leases[0].token, temperature=cfg.temperature
        )
        if cfg.slowdown > 1:
            c.clock.wait(c.stop, gen.seconds * (cfg.slowdown - 1))
        gen_s = time.perf_counter() - t0
        items = []
        for le, comps in zip(leases, gen.completions, strict=True):
            body = {
                "completions": [list(x.token_ids) for x in comps],
                "texts": [x.text for x in comps],
                "new_tokens": sum(len(x.token_ids) for x in comps),
                "gen_s": gen_s / len(leases),
            }
            items.append((le, h.active, h.active_state, self.settled_payload(le, json.dumps(body).encode())))
        # Settling is idempotent per (Actor, lease token): a retry after a lost answer
        # reads ``duplicate`` for what the first attempt already settled.
        answers = c.redis_call(lambda: c.ledger.settle_many(cfg.actor_id, items), "settle")
        for st, (_, _, _, payload) in zip(answers, items, strict=False):
            metrics.active().settled(cfg.actor_id, cfg.region, st.reason)
            if st.accepted or st.reason == "duplicate":
                c.stats.settled += 1
            else:
                c.stats.rejected[st.reason] = c.stats.rejected.get(st.reason, 0) + 1
                self.forget_result(payload)
        c.stats.tokens += gen.new_tokens
        metrics.active().generated(cfg.actor_id, cfg.region, len(leases), gen.new_tokens, gen_s)

    def settled_payload(self, lease: Lease, data: bytes) -> bytes:
        """What the ledger settles for result ``data``: itself, or when larger than the threshold a reference to it in the store.

        Why: at real sizes a step's results are hundreds of MB, too much for
        one Redis node; the store takes them, under this Actor's own
        ``results/<actor id>/`` folder (:mod:`aurora_store.lineage.results`).
        The write rides out a store outage like every other store call.
        """
        c = self.ctx
        if len(data) <= max(0, c.cfg.result_inline_max_bytes):
            return data
        try:
            ref = c.store_call(lambda: write_result(c.origin, c.cfg.actor_id, lease.step_id, lease.token, data), "write a result")
        except (OSError, AuroraError) as e:
            if is_transient(e) or isinstance(e, OutageTooLong):
                raise
            raise StoreError(
                f"{c.cfg.actor_id}: cannot write a {len(data)}-byte result under {results_prefix(c.cfg.actor_id)} in the run root "
                f"({type(e).__name__}: {str(e)[:200]}): give this Actor's store credential that folder (docs/SECURITY.md) "
                f"or raise --result-inline-max-bytes above its results"
            ) from None
        c.stats.results_through_store += 1
        return ref

    def forget_result(self, payload: bytes) -> None:
        """Delete the object a refused settle referred to (best effort: retention removes what is left)."""
        try:
            ref = parse_reference(payload)
        except ResultRefused:
            return
        if ref is None:
            return
        try:
            self.ctx.origin.delete(ref.key)
        except Exception as e:  # noqa: BLE001 - a leftover costs only its bytes until retention
            log.debug("%s: could not delete %s: %s", self.ctx.cfg.actor_id, ref.key, e)


MAX_GROUP = 1024
"""Most completions per prompt an Actor generates, whatever a step says (Redis is not trusted)."""
MAX_PROMPT_IDS = 1 << 20
"""Longest prompt (token ids) an Actor takes from a lease."""


def prompt_body(payload: bytes) -> dict[str, Any] | None:
    """A lease's prompt as the Trainer writes it (a JSON object whose ``ids`` are token ids); None otherwise."""
    try:
        body = json.loads(payload)
    except (ValueError, RecursionError):
        return None
    if not isinstance(body, dict):
        return None
    ids = body.get("ids")
    if not isinstance(ids, list) or not 0 < len(ids) <= MAX_PROMPT_IDS:
        return None
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 31 for t in ids):
        return None
    return body


def max_new_tokens(bodies: list[Any], default: int) -> int:
    """The completion length the Trainer accepts, as its payloads say (the smallest, bounded); ``default`` when they say none."""
    asked = [b.get("max_new_tokens") for b in bodies if isinstance(b, dict)]
    ok = [int(n) for n in asked if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_NEW_TOKENS_LIMIT]
    return min(ok) if ok and len(ok) == len(bodies) else default
