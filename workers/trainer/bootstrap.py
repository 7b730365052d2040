"""How a Trainer starts: a fresh run's version 0, or resume from its newest checkpoint; and the checkpoints.

A fresh run takes the next epoch, makes version 0 (published as a snapshot,
or a base every Actor builds), issues the first ``max_lag + 1`` batches on
it and saves the first checkpoint. A resumed one takes an epoch above any
before it, restores the GRPO policy from the checkpoint, continues the chain
after the newest committed version (materialized from the store: the chain
neither forks nor gaps) and reuses the batches the ledger still holds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from aurora_store.apply.sink import digest_as, tree_weights_digest
from aurora_store.clock import Clock
from aurora_store.codec.extract import unfuse_weights
from aurora_store.coordination.bus import COMMIT, Bus
from aurora_store.coordination.commit import commit_records_for
from aurora_store.coordination.ledger import Ledger
from aurora_store.coordination.records import RunRecords
from aurora_store.errors import ConfigError, IntegrityError, ManifestError, ObjectNotFound
from aurora_store.format.manifest import manifest_key, new_attempt_id
from aurora_store.format.signing import Signer, TrustKeys, trust_from_option
from aurora_store.lineage.materialize import materialize
from aurora_store.lineage.plan import VersionIndex, scan_versions
from aurora_store.options import trust_key_paths
from aurora_store.storage import Store
from workers.common import model_files_listed
from workers.trainer.batches import BatchBook
from workers.trainer.checkpoint import (
    Checkpoint,
    CheckpointRecord,
    bound_checkpoints,
    checkpoint_folder,
    checkpoint_key,
    commit_checkpoint,
    prune_checkpoints,
    read_checkpoint,
    unbound_reason,
)
from workers.trainer.ckpt_async import Checkpointer
from workers.trainer.ckpt_store import ObjectEntry
from workers.trainer.config import TrainerConfig
from workers.trainer.fsdp import DistContext
from workers.trainer.policy import GrpoPolicy
from workers.trainer.run_facts import RunFacts, establish
from workers.trainer.sharding import tell
from workers.trainer.sources import WeightsSource
from workers.trainer.versions import VersionPublisher

__all__ = ["Bootstrap"]

log = logging.getLogger("aurora.trainer")


class Bootstrap:
    """Starts a Trainer's run (fresh or resumed) over its parts, and saves its checkpoints.

    ``grpo``: the GRPO workload, None under another one (which neither
    resumes nor checkpoints); ``evaluate(v)`` scores version ``v`` when due.
    """

    def __init__(
        self,
        store: Store,
        cfg: TrainerConfig,
        ctx: DistContext,
        run: str,
        ledger: Ledger,
        bus: Bus,
        records: RunRecords,
        versions: VersionPublisher,
        batches: BatchBook,
        weights_source: WeightsSource,
        grpo: GrpoPolicy | None,
        signer: Signer | None,
        evaluate: Callable[[int], None],
        stop: threading.Event,
        clock: Clock,
    ) -> None:
        self.store = store
        self.cfg = cfg
        self.ctx = ctx
        self.run = run
        self.ledger = ledger
        self.bus = bus
        self.records = records
        self.versions = versions
        self.batches = batches
        self.weights_source = weights_source
        self.grpo = grpo
        self.signer = signer
        self.evaluate = evaluate
        self.stop = stop
        self.clock = clock
        self.resumed_from: int | None = None
        """Step of the checkpoint the run resumed from (None: a fresh run)."""
        self.trust: TrustKeys | None = _run_keys(signer)
        """The run's keys: a signed run's checkpoints and versions count only when signed by them."""
        self.facts = RunFacts()
        """The committed versions known (established at resume, then this Trainer's own): what binds checkpoints."""
        self.checkpointer = Checkpointer(store, checkpoint_folder, ctx.rank, ctx.sharded)
        """Writes this rank's part of each checkpoint while training goes on (``checkpointer.wait_s``: the time steps waited)."""

    @property
    def epoch(self) -> int:
        return self.records.epoch or 0

    def producer(self, step: int) -> dict[str, Any]:
        """``producer`` of the manifests the Trainer writes: the step and the epoch (FORMAT.md §4)."""
        return {"step": step, "epoch": self.epoch}

    # -- epochs: one Trainer at a time ---------------------------------------------
    def enter_epoch(self, epoch: int) -> None:
        """Take ``epoch`` in Redis; a newer Trainer holding a higher one fences this one out."""
        self.records.enter_epoch(epoch)
        # `aurora status` says whether the run is signed, and by which key (a resumed
        # Trainer may sign with a new one).
        self.records.record_identity(self.signer is not None, self.signer.key_id if self.signer else "")

    def check_redis(self) -> None:
        """Refuse a Redis that may evict the ledger's keys (its message says how to fix it)."""
        if self.ledger.check_memory_policy() == "unknown":
            log.warning(
                "Redis does not say its maxmemory-policy (INFO refused): make sure it is noeviction, or steps and leases may vanish"
            )

    def wait_for_actors(self) -> None:
        """Hold the first batch until ``min_actors`` Actors are alive (their engines may take minutes to start)."""
        want = self.cfg.min_actors
        if want <= 0:
            return
        t0 = time.perf_counter()
        said = 0.0
        while not self.stop.is_set():
            alive = sum(a.status == "alive" for a in self.ledger.actors())
            if alive >= want:
                log.info("%d Actor(s) alive after %.1fs: the first batch goes out", alive, time.perf_counter() - t0)
                return
            if time.perf_counter() - said >= self.cfg.progress_s:
                log.info("waiting for %d Actor(s) before the first batch (%d alive)", want, alive)
                said = time.perf_counter()
            self.clock.wait(self.stop, self.cfg.poll_s * 4)

    # -- start ----------------------------------------------------------------------
    def start_fresh(self) -> None:
        """A fresh run: the next epoch, version 0, the first batches, the first checkpoint."""
        if scan_versions(self.store).latest is not None:
            raise ConfigError(f"{self.store.url} already holds versions of a run: pass --resume to continue it, or use a fresh run root")
        self.check_redis()
        # A fresh run root; a Redis that still holds an epoch for this run name (an older run
        # of the same name) is outranked, not obeyed: this Trainer is the run now.
        self.enter_epoch((self.records.stored_epoch() or 0) + 1)
        t0 = time.perf_counter()
        if self.grpo is not None:
            tell(self.ctx, ("fresh",))  # the other ranks build the model and take rank 0's weights
        first = self.weights_source.first_version(self.store)
        self.records.forget_states()  # expected states an older run of this name left are not ours
        self.versions.start(first.plan, first.model_files)
        if first.base_state is None:
            nbytes = self.versions.publish_first(first.weights, self.producer(0))
            log.info("v0 snapshot published (%d bytes) in %.1fs total setup", nbytes, time.perf_counter() - t0)
        else:
            self.versions.full_bytes = sum(x.numel() * x.element_size() for x in first.weights.values())
            self.versions.continue_from(0, first.base_state, first.weights, "base", tree_weights_digest(first.weights, first.plan))
            log.info("v0: a base every Actor builds (%d bytes), ready in %.1fs", self.versions.full_bytes, time.perf_counter() - t0)
        self.evaluate(0)
        self.wait_for_actors()
        for b in range(self.cfg.max_lag + 1):
            self.batches.create(b, 0)
        self.checkpoint(0)

    def _policy(self, what: str) -> GrpoPolicy:
        if self.grpo is None:
            raise ConfigError(f"{what} needs the GRPO workload (this Trainer runs another)")
        return self.grpo

    def identity(self) -> dict[str, Any]:
        """The knobs a resumed run must share with the one it continues."""
        c = self.cfg
        family = self.grpo.family if self.grpo is not None else "built-in"
        return {
            "seed": c.seed,
            "batch": c.batch,
            "group": c.group,
            "head_dim": c.head_dim,
            "max_lag": c.max_lag,
            "difficulty": c.difficulty,
            "transfer": c.transfer,
            "task": c.task,
            "model": family,
            "tiny": [c.tiny_hidden, c.tiny_intermediate],
        }

    def checkpoint(self, step: int, final: bool = False) -> None:
        """Start saving what a restarted Trainer needs to run ``step`` next (docs/WORKERS.md), when one is due.

        Called after every version (every rank learns from rank 0 whether one is
        due). Each rank writes its part in the background from the live tensors;
        the record is committed before the next ``optimizer.step()`` changes them
        (:mod:`~workers.trainer.ckpt_async`), or now when ``final`` (the run ends).
        """
        every = self.cfg.checkpoint_every
        due = every > 0 and step % every == 0 and self.grpo is not None
        attempt = new_attempt_id() if due else None
        tell(self.ctx, ("checkpoint", step, attempt, final))
        if self.grpo is None or attempt is None:
            return
        t0 = time.perf_counter()
        tensors, opt_meta = self.grpo.checkpoint_tensors()
        assert self.grpo.opt is not None
        self.checkpointer.attach(self.grpo.opt)
        book = self.batches
        meta = {
            "run": self.run,
            "config": self.identity(),
            "optimizer": opt_meta,
            "lr": self.cfg.lr,
            "rng": _jsonable(self.grpo.rng.getstate()),
            "tau": book.tau,
            "completion_ms": book.completion_ms[-200:],
            "accepted_twice": book.counts.accepted_twice,
            "accepted_wrong_version": book.counts.accepted_wrong_version,
            "unreturned": book.counts.unreturned,
            "full_bytes": self.versions.full_bytes,
        }
        state, digest = self._binding_of(step)
        ck = Checkpoint(step=step, epoch=self.epoch, meta=meta, state=state, weights_digest=digest, run=self.run)

        def commit(objects: list[ObjectEntry], layout: Any) -> None:
            nbytes = commit_checkpoint(self.store, ck, objects, layout, world=self.ctx.world, signer=self.signer)
            # Bound to this run's committed states, a checkpoint is this run's history whatever run name it
            # recorded (a run root copied under a new name resumes): the name is not checked.
            gone = prune_checkpoints(self.store, self.cfg.keep_checkpoints, self.facts.binding, self.trust)
            log.info(
                "checkpoint before step %d: %d bytes from %d rank(s), committed %.2fs after it began%s",
                step,
                nbytes,
                self.ctx.world,
                time.perf_counter() - t0,
                f", pruned {gone}" if gone else "",
            )

        self.checkpointer.begin(step, attempt, tensors, commit)
        if final:
            self.checkpointer.finish()

    def _binding_of(self, step: int) -> tuple[str | None, str | None]:
        """The state and weights digest of version ``step``, which the checkpoint before ``step`` binds to."""
        weights, plan = self.versions.held.get(step), self.versions.plan
        state = self.versions.states.get(step)
        if not self.cfg.weight_transfer or weights is None or plan is None or state is None:
            return None, None  # versions are not shipped: nothing to bind to (such a run is not resumed)
        digest = self.versions.digest_of(step)  # hashed at publishing: the delta of a checkpoint's version carries it
        if digest is None:
            return None, None
        self.facts.add(step, state, digest)
        return state, digest

    def resume(self) -> int:
        """Continue the run in the store from its newest bound checkpoint; returns the step to run next.

        Nothing is taken from a bare listing (docs/WORKERS.md "Checkpoint and
        resume"): the head is the end of the committed chain (trust keys,
        commit records, the Trainer's record in Redis; :mod:`~workers.trainer.run_facts`),
        and the checkpoint is the newest one bound to a committed version whose
        tensors make that version's weights. The master weights and optimizer
        come from it; versions published after it already exist, so the next
        version is a delta against the head, materialized from the store (the
        chain neither forks nor gaps). Open steps are reused (their settled
        results count); missing ones are created again.
        """
        index = scan_versions(self.store)
        if index.latest is None:
            log.info("--resume: %s holds no version yet; starting a fresh run", self.store.url)
            self.start_fresh()
            return 0
        pol = self._policy("--resume")
        commits = commit_records_for(self.records.redis, self.run)
        self.facts = facts = establish(self.store, self.records, self.trust, commits)
        head = facts.head
        if head is None:
            raise ConfigError(
                f"{self.store.url} holds versions but none is committed"
                f"{' and signed by the run key' if self.trust is not None else ''}: it cannot be resumed"
            )
        if commits is None:
            _refuse_planted_next(self.store, index, head)
        ck = self._load_bound(pol, facts)
        if ck is None:
            tell(self.ctx, ("stop", None))
            raise ConfigError(
                f"{self.store.url} holds versions but no usable Trainer checkpoint bound to a committed version "
                f"(up to v{head}): it cannot be resumed"
            )
        self.check_redis()
        # The epoch from trusted places only (each an integer below 2^53, or refused): Redis's fence,
        # the bound checkpoint, and the head's manifest when it is verified (signed, or matched by its
        # commit record) or Redis lost its epoch; an unverified manifest never raises it otherwise.
        stored = self.records.stored_epoch()
        verified = self.trust is not None or commits is not None or stored is None
        self.enter_epoch(max(ck.epoch, stored or 0, (facts.head_epoch or 0) if verified else 0) + 1)
        t0 = time.perf_counter()
        pol.rng.setstate(_tuples(ck.meta["rng"]))
        book = self.batches
        book.tau = {str(k): float(v) for k, v in dict(ck.meta.get("tau", {})).items()}
        book.completion_ms = [float(x) for x in ck.meta.get("completion_ms", [])]
        book.counts.accepted_twice = int(ck.meta.get("accepted_twice", 0))
        book.counts.accepted_wrong_version = int(ck.meta.get("accepted_wrong_version", 0))
        book.counts.unreturned = int(ck.meta.get("unreturned", 0))
        self.versions.full_bytes = int(ck.meta.get("full_bytes", 0))
        # The versions batches still open were generated on, from the store (checked like every reader's).
        K = self.cfg.max_lag
        plan = pol.plan
        assert plan is not None
        for v in range(max(0, head - K), head + 1):
            fused, state = materialize(self.store, v, self.cfg.streams, trust=self.trust, commits=commits)
            self.versions.hold(v, state, {n: t.to(torch.bfloat16) for n, t in unfuse_weights(fused, plan).items()})
        published = self.versions.held[head]
        listed, _ = model_files_listed(self.store)
        model_files = list(listed.values()) if listed is not None else None
        digest = facts.digests.get(head)  # as committed (its form too); not hashed again
        self.resumed_from = ck.step
        self.versions.start(plan, model_files)
        self.versions.continue_from(head, self.versions.states[head], published, "delta" if head in facts.deltas else "snapshot", digest)
        # Steps: reuse what the ledger still holds, create what it lost, drop what is done.
        for b in self.ledger.open_steps():
            if b < head:
                self.ledger.close_step(b, epoch=self.epoch)
        for b in range(head, min(head + K + 1, self.cfg.steps)):
            book.reopen(b, self.ledger.step_version(b), self.versions.held, head)
        if head >= 1:
            self.bus.announce(COMMIT, head)
            self.records.record_commit(head)
        log.info(
            "resumed epoch %d from the checkpoint before step %d; head v%d (%d version(s) since it) in %.1fs",
            self.epoch,
            ck.step,
            head,
            head - ck.step,
            time.perf_counter() - t0,
        )
        return head

    def _load_bound(self, pol: GrpoPolicy, facts: RunFacts) -> Checkpoint | None:
        """Restore ``pol`` from the newest bound checkpoint (:func:`bound_checkpoints`) that reads back whole
        and makes its version's committed weights; older ones are tried after one that fails. Every rank
        loads its own shard (rank 0 sends each candidate's checked record). None: none is usable."""
        for head in bound_checkpoints(self.store, facts.binding, self.trust):
            try:
                rec, head = read_checkpoint(self.store, head.step, self.trust)
                why = unbound_reason(head, facts.binding)
            except (IntegrityError, ManifestError, ObjectNotFound) as e:
                why = str(e)
            if why is None:
                made = dict(rec["meta"].get("config") or {})
                if made != self.identity():
                    tell(self.ctx, ("stop", None))
                    raise ConfigError(f"--resume: the run was made with {made}, this Trainer has {self.identity()}; use the same settings")
                tell(self.ctx, ("load", head.step, rec))
                why = self._restored(pol, head, rec)
            if why is None:
                tell(self.ctx, ("resumed",))
                return Checkpoint(head.step, head.epoch, {}, dict(rec["meta"]), head.state, head.weights_digest, head.run)
            log.warning("%s is unusable (%s); trying an older one", self.store.where(checkpoint_key(head.step)), why)
        return None

    def _restored(self, pol: GrpoPolicy, head: CheckpointRecord, rec: dict[str, Any]) -> str | None:
        """Restore ``pol`` from a bound checkpoint (every rank its shard); why it must not be used, or None.

        Its record's binding is a claim: the weights its tensors make must be
        the committed weights of its version (a copy with other tensors and
        recomputed hashes fails here in an unsigned run).
        """
        try:
            pol.restore(self.store, head.step, rec)
        except (IntegrityError, ManifestError, ObjectNotFound) as e:
            return str(e)
        except (RuntimeError, KeyError, ValueError, TypeError) as e:  # the optimizer's load_state_dict
            return f"its tensors do not fit this model: {str(e)[:200]}"
        assert pol.plan is not None
        got = digest_as(head.weights_digest or "", pol.bf16_weights(), pol.plan)  # in the form it was recorded in
        if got != head.weights_digest:
            return f"its tensors make weights {got[:19]}…, not the committed {str(head.weights_digest)[:19]}… of version {head.step}"
        return None


def _refuse_planted_next(store: Store, index: VersionIndex, head: int) -> None:
    """Stop, naming it, when a manifest that is not committed sits where the next version goes.

    The Trainer's next publish writes ``v{head + 1}`` create-only; an object already
    there (planted, or left by a writer that is not this run's) would make that
    write conflict, which must not read as a newer Trainer's fence. In Redis-commit
    mode the record decides and the manifest is overwritten, so nothing is refused.
    """
    nxt = head + 1
    for kind, listed in (("delta", index.deltas), ("snapshot", index.snapshots)):
        if nxt in listed:
            raise ConfigError(
                f"{store.where(manifest_key(kind, nxt))}: an object that is not a committed version of this run "
                f"sits where the Trainer publishes v{nxt} next (the committed head is v{head}): "
                "an operator must inspect and remove it, then resume"
            )


def _run_keys(signer: Signer | None) -> TrustKeys | None:
    """The keys a signed run's versions and checkpoints are checked with: the Trainer's own, and those
    of ``AURORA_TRUST_KEYS`` (a resumed Trainer signing with a new key still reads what the old one signed).
    None: an unsigned run, whose readers check no signature."""
    if signer is None:
        return None
    more = trust_from_option(trust_key_paths(None))
    return signer.trust() | more if more is not None else signer.trust()


def _jsonable(x: Any) -> Any:
    """Tuples as lists, recursively (``random.Random.getstate()`` for JSON)."""
    return [_jsonable(i) for i in x] if isinstance(x, (tuple, list)) else x


def _tuples(x: Any) -> Any:
    """The inverse of :func:`_jsonable` for ``random.Random.setstate``."""
    return tuple(_tuples(i) for i in x) if isinstance(x, list) else x
