"""The Actor's side of a step: claiming leases and settling them.

Every Actor logs in as one Redis user, which can read every lease. So a
lease is bound to a secret its claimer draws (one per lease,
:func:`~aurora_store.coordination.ledger.records.new_claim_secret`): the
claim stores only a hash of it, the settle presents it, and the settle
script refuses a secret whose hash is not the lease's (``stale_token``).
The secret lives in the :class:`~aurora_store.coordination.ledger.records.Lease`
the claim returns (out of its ``repr``) and in the SETTLE call's arguments,
nowhere else: not in Redis, not in a log line, not in an exception.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from redis.exceptions import NoScriptError

from aurora_store.coordination.decode import as_str
from aurora_store.coordination.ledger.core import LedgerCore
from aurora_store.coordination.ledger.records import Lease, Settlement, claim_hash, new_claim_secret
from aurora_store.coordination.ledger.scripts import SETTLE_MANY
from aurora_store.coordination.redisconn import translate_redis_errors

__all__ = ["LeaseBook"]


class LeaseBook(LedgerCore):
    """Claims and settlements of the run's steps (the Actor's calls)."""

    def _settle_keys(self, actor: str, v: int) -> list[str]:
        return [
            self.k_step(v),
            self.k_step(v, "lease"),
            self.k_step(v, "exp"),
            self.k_step(v, "done"),
            self.k_step(v, "results"),
            self.k_step(v, "pool"),
            self.k_actor(actor),
            self.k_step(v, "results:payload"),
        ]

    @translate_redis_errors("Ledger.claim")
    def claim(self, actor: str, v: int, n: int) -> tuple[str, list[Lease]]:
        """Lease up to ``n`` prompts of step ``v``: own assignments first, then the pool.

        Returns (status, leases); status is ``ok``, ``no_step``, ``closed``,
        ``not_alive`` or ``not_on_version`` (the Actor must activate ``v``
        first). A settled or already leased prompt found in a list again (a
        partial loss repeated a write) is dropped, never leased twice. Each
        lease carries the secret that settles it (drawn here, one per lease).
        """
        if n <= 0:
            return "ok", []
        drawn = [new_claim_secret() for _ in range(n)]
        res = self._scripts.claim(
            keys=[
                self.k_step(v),
                self.k_assigned(v, actor),
                self.k_step(v, "pool"),
                self.k_step(v, "lease"),
                self.k_step(v, "exp"),
                self.k_fence,
                self.k_actor(actor),
                self.k_step(v, "prompts"),
                self.k_step(v, "done"),
            ],
            args=[actor, n, self._now(), *(claim_hash(x) for x in drawn)],
        )
        status = as_str(res[0])
        if status != "ok" or len(res) <= 2:
            return status, []
        # The script answers the step's state, group and version with the leases (one round trip).
        state, group, version = as_str(res[2] or b""), int(res[3] or 1), int(res[4] or v)
        leases = [
            Lease(as_str(res[i]), int(res[i + 1]), version, state, group, int(res[i + 2]), bytes(res[i + 3]), step=v, secret=drawn[k])
            for k, i in enumerate(range(5, len(res), 4))
        ]
        return status, leases

    @translate_redis_errors("Ledger.settle")
    def settle(self, actor: str, lease: Lease, version: int, state: str, payload: bytes) -> Settlement:
        """Report the result of a lease, generated on ``version`` with weights ``state``.

        Only the claimer's own ``lease`` (with its secret) is accepted; a lease
        rebuilt from what Redis shows answers ``stale_token``.
        """
        keys = self._settle_keys(actor, lease.step_id)
        args = [actor, lease.prompt, str(lease.token), str(version), state, payload, self._now(), lease.secret]
        reason, now = self._scripts.settle(keys=keys, args=args)
        return Settlement(lease.prompt, as_str(reason), int(now))

    @translate_redis_errors("Ledger.settle_many")
    def settle_many(self, actor: str, items: Iterable[tuple[Lease, int, str, bytes]]) -> list[Settlement]:
        """Several settlements in one round trip: one ``SETTLE_MANY`` script per step in the batch.

        Each result is judged as :meth:`settle` would judge it, in order (a
        lease twice in one batch: the second answers ``duplicate``); the
        results of one step are settled by one script, so atomically together.
        """
        items = list(items)
        if not items:
            return []
        by_step: dict[int, list[int]] = {}
        for i, (lease, _version, _state, _payload) in enumerate(items):
            by_step.setdefault(lease.step_id, []).append(i)
        calls: list[tuple[list[int], list[Any]]] = []
        for v, idx in by_step.items():
            keys = self._settle_keys(actor, v)
            args: list[Any] = [actor, self._now()]
            for i in idx:
                lease, version, state, payload = items[i]
                args += [lease.prompt, str(lease.token), str(version), state, payload, lease.secret]
            calls.append((idx, [self._scripts.settle_many.sha, len(keys), *keys, *args]))
        # One step (the usual case): a plain EVALSHA, without a pipeline's bookkeeping (on a
        # cluster, a pipeline costs a second round trip). Several: EVALSHA queued directly, since
        # a pipeline carrying Script objects makes redis-py send SCRIPT EXISTS first; through
        # execute_command, as redis-py's cluster pipeline refuses pipe.evalsha().
        for _attempt in range(2):
            if len(calls) == 1:
                try:
                    out = [self.r.evalsha(*calls[0][1])]
                except NoScriptError as e:
                    out = [e]
            else:
                pipe = self.r.pipeline(transaction=False)
                for _idx, cmd in calls:
                    pipe.execute_command("EVALSHA", *cmd)
                out = pipe.execute(raise_on_error=False)
            if not any(isinstance(r, NoScriptError) for r in out):
                break
            # Redis lost its script cache (restart): nothing ran, so load and repeat.
            self.r.script_load(SETTLE_MANY)
        settlements: list[Settlement | None] = [None] * len(items)
        for (idx, _cmd), r in zip(calls, out, strict=True):
            if isinstance(r, Exception):
                raise r
            now = int(r[0])
            for i, reason in zip(idx, r[1:], strict=True):
                settlements[i] = Settlement(items[i][0].prompt, as_str(reason), now)
        return [s for s in settlements if s is not None]
