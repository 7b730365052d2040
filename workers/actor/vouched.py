"""The Actor's ledger: a result is settled only once the weights that generated it are vouched for.

:class:`VouchedLedger` is the run's :class:`~aurora_store.coordination.ledger.Ledger`
with one difference: before a result goes to Redis, ``vouch(version, state)``
says whether the weights it was generated on may be trusted
(:meth:`workers.actor.verify.Verifier.vouch`: it waits while they are being
verified by digest). A result that is not vouched for is never sent; its
answer is :data:`UNVERIFIED`, and its lease goes back to the pool. Why
here rather than in the work loop: every path that settles goes through the
ledger, whatever form its payload takes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from aurora_store.coordination.ledger import Ledger
from aurora_store.coordination.ledger.records import Lease, Settlement

__all__ = ["UNVERIFIED", "VouchedLedger"]

UNVERIFIED = "unverified_weights"
"""The answer to a result generated on weights that failed verification (never sent to the ledger)."""

Vouch = Callable[[int, str], bool]


class VouchedLedger(Ledger):
    """A :class:`Ledger` whose settlements wait for ``vouch`` (None: every result is sent, as the plain ledger does)."""

    vouch: Vouch | None = None

    def settle(self, actor: str, lease: Lease, version: int, state: str, payload: bytes) -> Settlement:
        if self.vouch is not None and not self.vouch(version, state):
            return Settlement(lease.prompt, UNVERIFIED, 0)
        return super().settle(actor, lease, version, state, payload)

    def settle_many(self, actor: str, items: Iterable[tuple[Lease, int, str, bytes]]) -> list[Settlement]:
        items = list(items)
        if self.vouch is None:
            return super().settle_many(actor, items)
        verdict: dict[tuple[int, str], bool] = {}
        for _, version, state, _ in items:
            if (version, state) not in verdict:
                verdict[(version, state)] = self.vouch(version, state)
        sent = [it for it in items if verdict[(it[1], it[2])]]
        answers = iter(super().settle_many(actor, sent) if sent else [])
        return [next(answers) if verdict[(v, s)] else Settlement(le.prompt, UNVERIFIED, 0) for le, v, s, _ in items]
