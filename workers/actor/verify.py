"""Weights verified by digest, outside the Actor's safe point.

The safe point checks each version's state (the chain, the Trainer's record)
and then only writes. Whether the engine's weights really are that
version's bits is checked here, in a thread of its own, against the
``weights_digest`` the version's record carries (FORMAT.md §4.1, in the form
it names): its delta manifest's (or, for a whole version, its chain's
last), else the Trainer's record in Redis (``digest:trainer``). Which
versions: ``--verify-every`` (:attr:`~workers.actor.config.ActorConfig.verify_every`);
by default every version that carries a digest. The hash is the engine's
(:class:`~workers.engine.VerifyingEngine`): it runs while the engine
generates, and a vLLM engine under tensor parallelism hashes each whole
tensor once, on one rank.

Never wrong about which weights produced a rollout: until a version due for
verification has passed, nothing generated on it is settled
(:meth:`Verifier.vouch`, which :class:`~workers.actor.vouched.VouchedLedger`
asks before each settlement). Generation goes on meanwhile; the settlement of
a batch waits only when hashing takes longer than generating it.

A version whose weights are not its record's: the results generated on it
are refused (never sent; the Actor's leases go back to the pool at once), its
real digest is recorded (``digest:actors``), and at the next safe point the
Actor reaches the run again from the store (the boot's way in) and verifies
what it reached whatever the cadence (:meth:`workers.actor.safepoint.SafePoint.activate`).
Wrong weights twice in a row stop the Actor with
:class:`~aurora_store.errors.ModelMismatchError`: an engine that cannot hold
the bits it is given must not generate.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

from aurora_store.apply.sink import TREE_PREFIX
from aurora_store.errors import AuroraError
from aurora_store.lineage.binding import manifest_weights_digest
from workers.actor.context import ActorContext
from workers.engine import VerifyingEngine

__all__ = ["Job", "Verifier", "record_digest_of"]

log = logging.getLogger("aurora.actor")

_DIGEST = re.compile(r"^(?:tree-)?sha256:[0-9a-f]{64}$")


def record_digest_of(manifest: Any) -> str | None:
    """The ``weights_digest`` a manifest carries; None when it carries none (or a malformed one, logged)."""
    if manifest is None:
        return None
    try:
        return manifest_weights_digest(manifest.extra, f"{manifest.kind} {manifest.version}")
    except AuroraError as e:
        log.warning("%s; its weights are not verified against it", e)
        return None


@dataclass(slots=True)
class Job:
    """One active version to verify (or to let go, when it is not due or carries no digest)."""

    version: int
    state: str
    digest: str | None
    """From the version's manifest; None: the Trainer's record in Redis is read."""
    forced: bool
    """Verified whatever the cadence (the version reached again after a failure)."""
    started: bool = False
    done: bool = False
    passed: bool = True
    actual: str | None = None


class Verifier:
    """The Actor's verify thread (:meth:`run`) and the settlement gate (:meth:`vouch`)."""

    def __init__(self, ctx: ActorContext) -> None:
        self.ctx = ctx
        self._cond = threading.Condition()
        self._job: Job | None = None
        self._last: int | None = None
        """The version last verified."""
        self._owed = False
        """A version due for verification was left before its hash ended: the next one with a digest is verified."""
        self._failure: Job | None = None
        self.failures_in_row = 0
        self._said_unverifiable = False
        self._running = False
        """Whether the verify thread runs: without it (parts driven by hand) nothing is verified, nor waited for."""

    # -- the main thread ----------------------------------------------------------------
    def activated(self, version: int, state: str, digest: str | None, forced: bool = False) -> None:
        """The engine now holds ``version`` (a safe point, bootstrap, a reload): verify it if it is due."""
        with self._cond:
            old = self._job
            if old is not None and not old.done:
                self._owed = True  # superseded before it was verified (nothing on it was settled: vouch waited)
            self._job = Job(version, state, digest, forced)
            self._cond.notify_all()

    def vouch(self, version: int, state: str) -> bool:
        """Whether results generated on ``version`` may be settled; waits while it is being verified.

        False for a version whose weights failed verification, and for one
        still unverified when the Actor stops (its leases go back to the pool).
        """
        with self._cond:
            while True:
                job, failed = self._job, self._failure
                if failed is not None and (failed.version, failed.state) == (version, state):
                    return False
                if job is None or (job.version, job.state) != (version, state):
                    return True  # not the version being verified: one that was not due, or passed
                if job.done:
                    return job.passed
                if self.ctx.stop.is_set():
                    return False  # stopping with its verification unfinished
                if not self._running:
                    return True  # no verify thread (parts driven by hand): nothing is verified
                self._cond.wait(0.2)

    def take_failure(self) -> Job | None:
        """The version whose weights failed verification, once (the safe point acts on it)."""
        with self._cond:
            f, self._failure = self._failure, None
            return f

    # -- the verify thread --------------------------------------------------------------
    def begin(self) -> None:
        """The verify thread is about to start: from now on settlements wait for it (before the first claim)."""
        with self._cond:
            self._running = True

    def run(self) -> None:
        """The verify thread: each version the safe point activates, checked if due, until ``stop``."""
        c = self.ctx
        self.begin()
        try:
            while not c.stop.is_set():
                with self._cond:
                    job = self._job
                    if job is None or job.started:
                        self._cond.wait(0.2)
                        continue
                    job.started = True
                self.check(job)
        finally:
            with self._cond:
                self._running = False
                self._cond.notify_all()

    def check(self, job: Job) -> None:
        """Verify ``job`` if it is due and its record carries a digest; settle its verdict either way."""
        c = self.ctx
        expected = job.digest or self._recorded(job.version)
        if expected is None or not self._due(job):
            self._finish(job, None)
            return
        t0 = time.perf_counter()
        actual = self._hash(expected)
        seconds = time.perf_counter() - t0
        if actual is None:  # a write began meanwhile, or this engine cannot compute that form
            with self._cond:
                self._owed = True
            self._finish(job, None)
            return
        ok = actual == expected
        c.stats.verifications.append((job.version, seconds, ok))
        me = c.cfg.actor_id
        c.redis_call(partial(c.records.record_digest, me, job.version, actual), "record a digest")
        if ok:
            c.holding.verified = (job.version, actual)
            log.info("%s verified v%d by digest in %.3fs (outside the safe point)", me, job.version, seconds)
        else:
            log.error(
                "%s: the weights of v%d are not its record's (digest %s…, the record says %s…): "
                "its results are not settled; reaching the run again from the store",
                me,
                job.version,
                actual[:23],
                expected[:23],
            )
        self._finish(job, actual, ok)

    def _finish(self, job: Job, actual: str | None, ok: bool = True) -> None:
        with self._cond:
            job.done, job.passed, job.actual = True, ok, actual
            if actual is not None and job is self._job:
                self._last, self._owed = job.version, False
                if ok:
                    self.failures_in_row = 0
                else:
                    self.failures_in_row += 1
                    self._failure = job
            self._cond.notify_all()

    def _due(self, job: Job) -> bool:
        every = self.ctx.cfg.verify_every
        if job.forced:
            return True
        if every == 0:
            return False
        if self._owed or every is None or every <= 1 or self._last is None:
            return True
        return job.version - self._last >= every

    def _recorded(self, version: int) -> str | None:
        """The digest the Trainer recorded for ``version`` in Redis (untrusted bytes: one of FORMAT §4.1's forms, else None)."""
        c = self.ctx
        raw = c.redis_call(lambda: c.redis.hget(c.keys.trainer_digests, str(version)), "read the Trainer's digest")
        text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else raw
        return text if isinstance(text, str) and _DIGEST.fullmatch(text) else None

    def _hash(self, expected: str) -> str | None:
        """The engine's weights in ``expected``'s form; None when that cannot be known now."""
        c = self.ctx
        engine = c.engine
        if isinstance(engine, VerifyingEngine):
            return engine.verify_digest(expected)
        got = None
        if not expected.startswith(TREE_PREFIX):
            with c.holding.weights:  # an engine of another kind hashes under the weights lock
                got = c.engine.digest()
        if got is None or not _DIGEST.fullmatch(got):  # a tree digest asked for, or an engine that hashes nothing
            if not self._said_unverifiable:
                self._said_unverifiable = True
                log.warning(
                    "%s: this engine cannot compute a digest of the form %s; its weights are not verified", c.cfg.actor_id, expected[:12]
                )
            return None
        return got
