"""Steps, leases, claims and settlement: the jobs of the run.

The Trainer creates a step (its prompts, assigned per the scheduler's
quotas or left in the pool: one script, so a repeat is a no-op), Actors
claim leases on them and settle results
(:data:`~aurora_store.coordination.ledger.scripts.SETTLE` is the settlement
predicate), and the Trainer collects what was accepted, by prompt id, and
closes the step: it seals it (from then on a settle answers ``closed``),
reads what came in meanwhile, and drops its keys, leaving a tombstone.
Claims and settlement themselves are :mod:`.leases`.

Every Actor's credential can write a step's keys, so what :meth:`StepBook.poll`
reads is checked against what the settle script writes (a record that
parses, names its prompt, matches its ``done`` entry and proves its lease's
secret); the rest is handed back as ``rejected`` for the Trainer to count and
take out (:meth:`StepBook.reoffer`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from aurora_store.coordination.decode import as_int, as_str
from aurora_store.coordination.ledger.core import LedgerCore, _ms
from aurora_store.coordination.ledger.records import (
    AcceptedResult,
    ClosedStep,
    StepPoll,
    StepStatus,
    accepted_from_redis,
    proves_claim,
    step_status_from_hash,
)
from aurora_store.coordination.redisconn import (
    is_cluster_client,
    server_time_ms,
    translate_redis_errors,
)
from aurora_store.errors import ConfigError, LedgerLost, StepExists

if TYPE_CHECKING:
    from aurora_store.coordination.ledger.records import ActorRecord

__all__ = ["StepBook", "step_identity"]

_STEP_PARTS = ("prompts", "pool", "lease", "exp", "done", "results", "results:payload", "assignees")
TRAINER_MARK = "trainer|0"
"""The ``done`` value of a prompt the Trainer marked settled itself (``MARK_SETTLED``)."""
_MARK_CHUNK = 1000


def step_identity(version: int, state: str, ids: Iterable[str]) -> str:
    """What makes two creations of a step the same one: its version, state and prompt ids (any order)."""
    h = hashlib.sha256(f"{version}\n{state}\n".encode())
    for p in sorted(ids):
        h.update(p.encode())
        h.update(b"\n")
    return h.hexdigest()[:32]


class StepBook(LedgerCore):
    """The steps of the run (``steps`` zset, ``step:{v}…`` keys)."""

    if TYPE_CHECKING:
        # From the registry, beside which Ledger composes this class.
        def actors(self) -> list[ActorRecord]: ...
        def _liveness(self) -> tuple[list[str], list[tuple[str | None, int]]]: ...

    # -- keys of one step ----------------------------------------------------------
    def _assignees(self, v: int) -> list[str]:
        return sorted(as_str(a) for a in self.r.smembers(self.k_step(v, "assignees")))

    def _step_keys(self, v: int, assignees: Sequence[str]) -> list[str]:
        """Every key of step ``v`` but its hash: the parts and the assigned lists."""
        return [self.k_step(v, x) for x in _STEP_PARTS] + [self.k_assigned(v, a) for a in assignees]

    # -- Trainer ---------------------------------------------------------------
    @translate_redis_errors("Ledger.ensure_fence")
    def ensure_fence(self) -> None:
        """Start fencing tokens above any a previous Redis could have issued.

        After Redis lost its state, the counter starts again from the current
        time in microseconds, which is larger than any token handed out
        before (tokens grow by one per lease), so a stale lease never matches.
        ``CREATE_STEP`` does the same inside its script.
        """
        self.r.set(self.k_fence, self.server_time_ms() * 1000, nx=True)

    @translate_redis_errors("Ledger.create_step")
    def create_step(
        self,
        v: int,
        state: str,
        prompts: Sequence[tuple[str, bytes]],
        quotas: Mapping[str, int],
        group: int,
        lease_ms: int,
        version: int | None = None,
        *,
        epoch: int | None = None,
    ) -> str:
        """Create the jobs of step ``v``: each prompt assigned to an Actor per ``quotas``.

        ``version`` is the policy version the rollouts must be generated on
        (default ``v``); with one-step asynchrony two batches may share a
        version, so the step id and the version are separate. Prompts beyond
        the quotas (or all, with no quotas) go to the shared pool.

        One script creates the whole step, so running it again (redis-py
        retrying after a timeout, the Trainer re-issuing after a lost answer)
        changes nothing and returns ``"exists"``; a first creation returns
        ``"created"``. A step under this id with other prompts, version or
        state raises :class:`~aurora_store.errors.StepExists`. To re-create a
        step Redis lost, call again with the prompts not collected yet.
        ``epoch``: the Trainer's; refused with
        :class:`~aurora_store.errors.FencedOut` under a newer one.
        """
        if lease_ms <= 0 or group <= 0:
            raise ConfigError(f"step {v}: lease_ms and group must be positive")
        ids = [p for p, _ in prompts]
        if len(set(ids)) != len(ids) or any("|" in p for p in ids):
            raise ConfigError(f"step {v}: prompt ids must be unique and contain no '|'")
        if sum(quotas.values()) > len(ids):
            raise ConfigError(f"step {v}: quotas sum to {sum(quotas.values())}, only {len(ids)} prompts")
        gen_version = v if version is None else version
        # Quotas of Actors that are not registered and alive would strand their
        # prompts (nobody else can claim an assignment); they go to the pool. The
        # script checks again, for an Actor that leaves between this read and it.
        wanted = {a: n for a, n in quotas.items() if n > 0}
        if wanted:
            # Statuses alone (not actors(), which also counts every lease of every open step).
            ids, live = self._liveness()
            alive = {a for a, (status, _hb) in zip(ids, live, strict=True) if status == "alive"}
            wanted = {a: n for a, n in wanted.items() if a in alive}
        order = sorted(wanted)
        keys = [
            self.k_step(v),
            self.k_step(v, "prompts"),
            self.k_step(v, "pool"),
            self.k_steps,
            self.k_epoch,
            self.k_fence,
            self.k_step(v, "assignees"),
            *(self.k_assigned(v, a) for a in order),
            *(self.k_actor(a) for a in order),
        ]
        args: list[Any] = [
            str(v),
            str(gen_version),
            state,
            group,
            lease_ms,
            step_identity(gen_version, state, ids),
            self._fence_arg(epoch),
            self._now(),
            _ms(self.config.step_ttl_s),
            len(prompts),
        ]
        for p, body in prompts:
            args += [p, body]
        for a in order:
            args += [a, wanted[a]]
        for _attempt in range(2):
            res = self._fenced(self._scripts.create_step(keys=keys, args=args), epoch, f"create step {v}")
            answer = as_str(res[0])
            if answer in ("created", "exists"):
                return answer
            if answer == "sealed":
                # Closed but its keys not dropped yet (a Trainer stopped between the two).
                self.drop_step(v, epoch=epoch)
                continue
            raise StepExists(f"step {v} of run {self.run!r} already has other jobs (identity {as_str(res[1])})")
        raise StepExists(f"step {v} of run {self.run!r}: could not replace its closed tombstone")

    @translate_redis_errors("Ledger.step_exists")
    def step_exists(self, v: int) -> bool:
        """Whether step ``v`` is open (a closed step's tombstone does not count)."""
        ver, closed = self.r.hmget(self.k_step(v), "version", "closed")
        return ver is not None and closed is None

    @translate_redis_errors("Ledger.step_version")
    def step_version(self, v: int) -> int | None:
        """Version the rollouts of step ``v`` must be generated on (None: no such open step)."""
        x, closed = self.r.hmget(self.k_step(v), "version", "closed")
        return None if x is None or closed is not None else int(x)

    @translate_redis_errors("Ledger.open_step_info")
    def open_step_info(self) -> list[tuple[int, int, int]]:
        """(step, version, unsettled prompts) of every open step, in one round trip."""
        steps = self.open_steps()
        if not steps:
            return []
        pipe = self.r.pipeline(transaction=False)
        for v in steps:
            pipe.hmget(self.k_step(v), "version", "total", "settled", "closed")
        out = []
        for v, (ver, total, settled, closed) in zip(steps, pipe.execute(), strict=True):
            if ver is not None and total is not None and closed is None:
                out.append((v, int(ver), int(total) - int(settled or 0)))
        return out

    @translate_redis_errors("Ledger.unsettled")
    def unsettled(self, v: int) -> int | None:
        """Prompts of step ``v`` not accepted yet (pending or leased); None: no such open step."""
        total, settled, closed = self.r.hmget(self.k_step(v), "total", "settled", "closed")
        if total is None or closed is not None:
            return None
        return int(total) - int(settled or 0)

    @translate_redis_errors("Ledger.step_status")
    def step_status(self, v: int) -> StepStatus:
        """Counts of step ``v``; :class:`~aurora_store.errors.LedgerLost` when it is gone or dropped."""
        h = self.r.hgetall(self.k_step(v))
        if not h or b"dropped" in h:
            raise LedgerLost(f"step {v} of run {self.run!r} is not in the ledger")
        assignees = self._assignees(v)
        pipe = self.r.pipeline(transaction=False)
        pipe.llen(self.k_step(v, "pool"))
        pipe.hlen(self.k_step(v, "lease"))
        for a in assignees:
            pipe.llen(self.k_assigned(v, a))
        pool, leased, *assigned = pipe.execute()
        return step_status_from_hash(v, h, leased=int(leased), pending=int(pool) + sum(int(x) for x in assigned))

    @translate_redis_errors("Ledger.poll")
    def poll(self, v: int, have: Collection[str] = ()) -> StepPoll:
        """Where step ``v`` stands, with every accepted result whose prompt is not in ``have``.

        Results are read by prompt id (the ``done`` hash), so a write Redis
        lost or reordered (an AOF-everysec restart, a failover) cannot hide
        another one. Raises :class:`~aurora_store.errors.LedgerLost` when the
        step is gone (Redis lost it, or its keys expired) or was dropped.
        """
        return self._poll(v, have)

    @translate_redis_errors("Ledger.collect")
    def collect(self, v: int, have: Collection[str] = ()) -> list[AcceptedResult]:
        """Every accepted result of step ``v`` whose prompt is not in ``have``, in order of acceptance."""
        return self._poll(v, have).results

    def _poll(self, v: int, have: Collection[str]) -> StepPoll:
        # On a cluster TIME cannot ride in the transaction (it has no key): it is read
        # from the run's master after it, which only makes ``now`` a little later.
        cluster = is_cluster_client(self.r)
        pipe = self.r.pipeline(transaction=True)
        pipe.hmget(self.k_step(v), "total", "settled", "created_ms", "closed", "dropped")
        pipe.hgetall(self.k_step(v, "done"))
        if self.clock is None and not cluster:
            pipe.time()
        out = pipe.execute()
        (total, settled, created, closed, dropped), done = out[0], out[1]
        if total is None or dropped is not None:
            raise LedgerLost(f"step {v} of run {self.run!r} is not in the ledger")
        if self.clock is not None:
            now = int(self.clock())
        elif cluster:
            now = server_time_ms(self.r, self.k_step(v))
        else:
            now = int(out[2][0]) * 1000 + int(out[2][1]) // 1000
        by = {as_str(p, "replace"): as_str(d, "replace") for p, d in done.items()}
        new = sorted(p for p in by if p not in have)
        results: list[AcceptedResult] = []
        rejected: list[tuple[str, str, str]] = []
        if new:
            pipe = self.r.pipeline(transaction=True)
            pipe.hmget(self.k_step(v, "results"), new)
            pipe.hmget(self.k_step(v, "results:payload"), new)
            heads, payloads = pipe.execute()
            for p, h, b in zip(new, heads, payloads, strict=True):
                why = None
                if h is None or b is None:
                    # A prompt the Trainer marked settled itself has no result: it holds that one already.
                    why = None if by[p] == TRAINER_MARK else "no_result"
                elif (r := accepted_from_redis(h, b, p)) is None:
                    why = "malformed"
                elif by[p] != f"{r.actor}|{r.token}" or not proves_claim(r.witness, r.claim):
                    why = "unproven"  # not what SETTLE writes: no proof of the lease's secret
                else:
                    results.append(r)
                if why:
                    rejected.append((p, why, by[p]))
            results.sort(key=lambda r: (r.seq, r.settled_ms, r.prompt))
        return StepPoll(
            results=results,
            accepted=frozenset(by),
            total=as_int(total, 0, lenient=True) or 0,
            settled=as_int(settled, 0, lenient=True) or 0,
            created_ms=as_int(created, 0, lenient=True) or 0,
            now_ms=now,
            closed=closed is not None,
            rejected=rejected,
        )

    @translate_redis_errors("Ledger.reoffer")
    def reoffer(self, v: int, entries: Iterable[tuple[str, str, bool]], *, epoch: int | None = None) -> int:
        """Take results the Trainer refused out of step ``v``: ``(prompt, done value, offer again)`` each.

        Each prompt whose ``done`` entry still reads that value loses it (and its
        result); with ``offer again`` (a prompt of the Trainer's batch) its lease
        is dropped too (a forged ``done`` entry answered its holder
        ``already_settled``) and it goes back to the pool, so an honest Actor
        does it. A prompt settled anew meanwhile is left alone. Returns the
        prompts cleared.
        """
        flat: list[str] = [self._fence_arg(epoch)]
        for p, value, again in entries:
            flat += [p, value, "1" if again else ""]
        if len(flat) == 1:
            return 0
        keys = [
            self.k_step(v),
            self.k_step(v, "done"),
            self.k_step(v, "results"),
            self.k_step(v, "results:payload"),
            self.k_step(v, "lease"),
            self.k_step(v, "exp"),
            self.k_step(v, "pool"),
            self.k_epoch,
            *(self.k_assigned(v, a) for a in self._assignees(v)),
        ]
        res = self._fenced(self._scripts.reoffer(keys=keys, args=flat), epoch, f"re-offer prompts of step {v}")
        return int(res[1])

    @translate_redis_errors("Ledger.mark_settled")
    def mark_settled(self, v: int, prompts: Iterable[str], *, epoch: int | None = None) -> int:
        """Tell the ledger the Trainer holds results of ``prompts`` (of step ``v``); returns how many it lacked.

        For a Redis that lost a settlement the Trainer had already collected
        (an AOF-everysec restart, a failover): each such prompt is marked
        settled, its lease dropped and its queued copies removed, so nobody
        does it again. Prompts the step does not hold are ignored.
        """
        ids = list(prompts)
        if not ids:
            return 0
        keys = [
            self.k_step(v),
            self.k_step(v, "prompts"),
            self.k_step(v, "lease"),
            self.k_step(v, "exp"),
            self.k_step(v, "done"),
            self.k_step(v, "pool"),
            self.k_epoch,
            *(self.k_assigned(v, a) for a in self._assignees(v)),
        ]
        n = 0
        for i in range(0, len(ids), _MARK_CHUNK):
            res = self._fenced(
                self._scripts.mark_settled(keys=keys, args=[self._fence_arg(epoch), *ids[i : i + _MARK_CHUNK]]), epoch, f"mark step {v}"
            )
            n += int(res[1])
        return n

    @translate_redis_errors("Ledger.touch_steps")
    def touch_steps(self) -> int:
        """Refresh the TTL of every open step's keys (``step_ttl_s``); returns the steps touched.

        The Trainer calls it while it waits on its batches (``collect_batch``
        does), so only the steps of a Trainer that stopped expire.
        """
        ttl = _ms(self.config.step_ttl_s)
        steps = self.open_steps()
        if ttl <= 0 or not steps:
            return 0
        pipe = self.r.pipeline(transaction=False)
        for v in steps:
            pipe.smembers(self.k_step(v, "assignees"))
        members = pipe.execute()
        pipe = self.r.pipeline(transaction=False)
        for v, who in zip(steps, members, strict=True):
            for k in (self.k_step(v), *self._step_keys(v, sorted(as_str(a) for a in who))):
                pipe.pexpire(k, ttl)
        pipe.pexpire(self.k_steps, ttl)
        pipe.pexpire(self.k_fence, ttl)
        pipe.execute()
        return len(steps)

    @translate_redis_errors("Ledger.seal_step")
    def seal_step(self, v: int, *, epoch: int | None = None) -> tuple[int, int] | None:
        """Close step ``v`` to settlement: from now on a settle answers ``closed``, nothing is leased.

        Returns the ledger's (total, settled) at the seal, None when there is
        no such step. Idempotent. The results stay readable (:meth:`poll`)
        until :meth:`drop_step`.
        """
        res = self._fenced(
            self._scripts.seal_step(keys=[self.k_step(v), self.k_steps, self.k_epoch], args=[str(v), self._fence_arg(epoch), self._now()]),
            epoch,
            f"close step {v}",
        )
        if as_str(res[0]) == "no_step":
            return None
        return int(res[1]), int(res[2])

    @translate_redis_errors("Ledger.drop_step")
    def drop_step(self, v: int, *, epoch: int | None = None, unreturned: int | None = None) -> None:
        """Delete the keys of step ``v`` but a tombstone (``closed_ttl_s``) saying it closed. Idempotent.

        ``unreturned``: prompts the Trainer closed the batch without, kept in
        the tombstone for ``aurora status``.
        """
        keys = [self.k_step(v), self.k_steps, self.k_epoch, *self._step_keys(v, self._assignees(v))]
        args = [
            str(v),
            self._fence_arg(epoch),
            _ms(self.config.closed_ttl_s) or 1,
            "" if unreturned is None else str(unreturned),
            self._now(),
        ]
        self._fenced(self._scripts.drop_step(keys=keys, args=args), epoch, f"close step {v}")

    @translate_redis_errors("Ledger.close_step")
    def close_step(self, v: int, *, epoch: int | None = None, have: Collection[str] = ()) -> ClosedStep:
        """Seal step ``v``, read the results not in ``have`` that came in before the seal, and drop it.

        The three phases are separate calls, each safe to repeat; a caller
        that must not lose a result (the Trainer) runs them itself
        (``collect_batch``) and keeps what :meth:`poll` returns before
        dropping. On a step already closed or gone: nothing to return.
        """
        sealed = self.seal_step(v, epoch=epoch)
        if sealed is None:
            return ClosedStep([], 0, 0)
        try:
            results = self._poll(v, have).results
        except LedgerLost:  # dropped already: closed before
            return ClosedStep([], *sealed)
        self.drop_step(v, epoch=epoch, unreturned=max(0, sealed[0] - sealed[1]))
        return ClosedStep(results, *sealed)
