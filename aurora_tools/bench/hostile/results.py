"""Attacks through results written to the store (issue 25): an Actor's own folder is all it can point at.

An Actor settles a result too large for the ledger as a reference to an
object under its own ``results/<actor id>/`` (``aurora_store/lineage/results.py``).
Each case runs the real Trainer over :class:`~aurora_tools.bench.hostile.ledger.Recorder`
with an Actor that holds its leases honestly (its own credential, its own
secret) but settles hostile references: to an object planted in another
Actor's folder, to one of the Trainer's own objects, to its own object with
other bytes than the hash it settled, to its own object filed under another
step, to an object larger than a result may be (its reference honest about
it). Refused: the Trainer finishes its steps and hands the workload no byte
of :data:`MARK` (nothing settled is trained on); the tampered object is
never read past the size its reference records, the oversized one not at all.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from aurora_tools.bench.hostile.cases import Case, Context, Result
from aurora_tools.bench.hostile.ledger import MARK, RUN, STEPS, Recorder, acl_server, claim_every_step, drive

__all__ = ["RESULTS_CASES"]

Settle = Callable[[Any, str, int, int], bytes]
"""``settle(store, actor, step, token)``: the payload the Actor settles for one lease (after planting what it likes)."""


def _actor(url: str, store_url: str, settle: Settle, work: Recorder, stop: threading.Event) -> None:
    """An Actor (``a0``, the Actor's Redis user) that claims every step's leases and settles what ``settle`` makes."""
    from aurora_store.storage import open_store

    store = open_store(store_url)

    def settle_all(ledger: Any, b: int, v: int, state: str, leases: list[Any]) -> None:
        for lease in leases:
            ledger.settle("a0", lease, v, state, settle(store, "a0", b, lease.token))

    claim_every_step(url, work, stop, settle_all)


def _run(ctx: Context, name: str, settle: Settle) -> dict[str, Any]:
    """The real Trainer over :class:`Recorder` with the Actor settling ``settle``'s payloads."""
    from workers.common import Endpoints
    from workers.trainer import TrainerConfig
    from workers.trainer.trainer import Trainer

    srv = acl_server(ctx)
    work = Recorder()
    store_url = f"file://{ctx.dir(name)}/run"
    cfg = TrainerConfig(steps=STEPS, batch=2, group=2, checkpoint_every=0, eval_every=0, snapshot_every=0, poll_s=0.02)
    tr = Trainer(Endpoints(store_url, srv["urls"]["trainer"], RUN), cfg, steps=work, weights=work)
    stop = threading.Event()
    out: dict[str, Any] = {"work": work, "error": None, "logs": None, "trainer": tr}
    actor = threading.Thread(target=_actor, args=(srv["urls"]["actor"], store_url, settle, work, stop), daemon=True)
    drive(tr, actor, stop, out)
    if tr.batches.results is not None:
        tr.batches.results.close()
    return out


def _judge(res: Result, out: dict[str, Any], what: str, reason: str) -> None:
    """Refused: every step ran, nothing planted reached the workload, and the reader refused for ``reason``."""
    work: Recorder = out["work"]
    absorbed = [p for p in work.payloads if MARK in p]
    reader = out["trainer"].batches.results
    refused = dict(reader.refused) if reader is not None else {}
    if absorbed:
        res.outcome, res.applied = "applied", True
        res.how = f"the Trainer handed the workload {len(absorbed)} planted result(s)"
    elif out["error"] is not None:
        e = out["error"]
        res.traceback = not type(e).__module__.startswith("aurora_store")
        res.outcome, res.how = "failed", f"the Trainer stopped: {type(e).__name__}: {str(e)[:120]}"
    elif out["logs"] is None or len(out["logs"]) != STEPS:
        res.outcome, res.how = "failed", f"the Trainer finished {len(out['logs'] or [])} of {STEPS} steps"
    elif not refused:
        res.outcome, res.how = "failed", "nothing was refused, yet nothing planted was absorbed: the case did not run"
    elif reason not in refused:
        res.outcome, res.how = "failed", f"refused {refused}, never for {reason}: not the check this case is about"
    else:
        res.outcome, res.how = "refused", f"{what}; {STEPS} steps, refused {refused}"


def _ref(key: str, data: bytes) -> bytes:
    from aurora_store.lineage.results import reference_payload

    return reference_payload(key, data)


def _other_actors_folder(ctx: Context, res: Result) -> None:
    """Plant MARK under another Actor's folder (as if its credential leaked) and settle a reference to it."""
    from aurora_store.lineage.results import result_key

    def settle(store: Any, actor: str, step: int, token: int) -> bytes:
        key = result_key("victim", step, token)
        store.put(key, MARK)
        return _ref(key, MARK)

    _judge(res, _run(ctx, "results-foreign", settle), "a reference into results/victim/ settled by a0", "foreign_key")


def _trainer_object(ctx: Context, res: Result) -> None:
    """A reference outside ``results/``, sized and hashed right: the model description, or an object planted under ``metrics/``."""

    def settle(store: Any, actor: str, step: int, token: int) -> bytes:
        try:
            data = store.get_capped("model/config.json", 1 << 20)
        except Exception:  # noqa: BLE001 - no description in this workload: plant one where the Trainer writes
            data = MARK
            store.put("metrics/planted.json", data, mode="overwrite")
            return _ref("metrics/planted.json", data)
        return _ref("model/config.json", data)

    _judge(res, _run(ctx, "results-trainer-object", settle), "a reference outside results/", "foreign_key")


def _tampered(ctx: Context, res: Result) -> None:
    """The Actor's own object, rewritten after the settle with MARK (and made a gigabyte-sized claim's worth larger)."""
    from aurora_store.lineage.results import result_key

    def settle(store: Any, actor: str, step: int, token: int) -> bytes:
        key = result_key(actor, step, token)
        honest = b'{"honest": 1}' * 8
        store.put(key, MARK + honest[len(MARK) :] + b"x" * (4 << 20), mode="overwrite")  # other bytes, far larger
        return _ref(key, honest)

    _judge(res, _run(ctx, "results-tampered", settle), "a0's own object with other bytes than it settled", "hash_mismatch")


def _oversized(ctx: Context, res: Result) -> None:
    """The Actor's own object of 1 MiB, far more than a result of this run may hold; its reference says so, hash and all."""
    from aurora_store.lineage.results import result_key

    def settle(store: Any, actor: str, step: int, token: int) -> bytes:
        key = result_key(actor, step, token)
        data = MARK + b"x" * ((1 << 20) - len(MARK))
        store.put(key, data)
        return _ref(key, data)

    _judge(res, _run(ctx, "results-oversized", settle), "a0's own object, larger than a result may be", "too_large")


def _another_step(ctx: Context, res: Result) -> None:
    """The Actor's own object, honest bytes and hash, filed under a step other than the one settled
    (a batch's object read by another, or kept by retention for the wrong batch)."""
    from aurora_store.lineage.results import result_key

    def settle(store: Any, actor: str, step: int, token: int) -> bytes:
        key = result_key(actor, step + 1000, token)
        store.put(key, MARK)
        return _ref(key, MARK)

    _judge(res, _run(ctx, "results-another-step", settle), "a0's own object under another step's folder", "wrong_step")


def _valid(ctx: Context, res: Result) -> None:
    """Control: results through the store, honest, are absorbed."""

    def settle(store: Any, actor: str, step: int, token: int) -> bytes:
        from aurora_store.lineage.results import write_result

        return write_result(store, actor, step, token, b'{"honest": 1}')

    out = _run(ctx, "results-valid", settle)
    work: Recorder = out["work"]
    reader = out["trainer"].batches.results
    got = sum(p == b'{"honest": 1}' for p in work.payloads)
    if out["error"] is None and out["logs"] is not None and len(out["logs"]) == STEPS and got and reader is not None and not reader.refused:
        res.outcome, res.how = "accepted", f"{STEPS} steps, {got} results read from the store and absorbed"
    else:
        res.outcome, res.how = "failed", f"error {out['error']!r}, {got} results absorbed"


RESULTS_CASES = [
    Case("results:reference-into-another-actors-folder", "ledger", "refuse", _other_actors_folder, quick=True),
    Case("results:reference-to-a-trainer-object", "ledger", "refuse", _trainer_object),
    Case("results:tampered-own-object", "ledger", "refuse", _tampered),
    Case("results:oversized-own-object", "ledger", "refuse", _oversized),
    Case("results:own-object-of-another-step", "ledger", "refuse", _another_step),
    Case("valid:results-through-the-store-absorbed", "control", "accept", _valid),
]
