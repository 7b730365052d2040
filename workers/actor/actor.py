"""An Actor: bootstrap, stage in the background, activate at safe points, generate, settle.

Three threads (docs/WORKERS.md):

- main: at each safe point (between batches) activate staged versions that
  an open step or a Commit asks for; claim leases of steps on the active
  version; generate; settle with (active version, its state digest);
- stager: follow announcements (the region's Relay mirror while its
  heartbeat key exists, else origin), fetch + verify + decode the next delta
  on top of the newest staged state, keep it staged;
- heartbeat: report active and staged versions every ``heartbeat_s``.

A delta is accepted only on top of the base it declares
(``expect_base_state``); a version that fails validation is never staged,
so it can never be applied. SIGTERM is a graceful leave.

Every wait of these loops (polls, back-off, the mirror's grace, the Relay
wait) is timed on the Actor's ``clock``, so tests step through them with a
:class:`~aurora_store.testing.clock.ManualClock` instead of sleeping.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from typing import Any

from aurora_store.clock import SYSTEM_CLOCK, Clock
from aurora_store.coordination.bus import COMMIT, SEGMENT, Bus, BusGap
from aurora_store.coordination.ledger import Lease, Ledger
from aurora_store.coordination.redisconn import connect
from aurora_store.errors import AuroraError, VersionNotFound
from aurora_store.format.checkpoint import StagedDelta
from aurora_store.lineage.fetch import fetch_delta, materialize
from aurora_store.lineage.plan import scan_versions
from aurora_store.storage import Store, open_store
from workers.actor.config import ActorConfig, ActorStats
from workers.common import (
    Endpoints,
    RunKeys,
    read_model_description,
    record_activation,
    record_digest,
)
from workers.engine import RemoteStaged, StoreStaging, make_engine

__all__ = ["Actor"]

log = logging.getLogger("aurora.actor")


class Actor:
    """One Actor of a run; :meth:`run` until ``stop`` is set. ``clock`` times every wait of its loops."""

    def __init__(self, ep: Endpoints, cfg: ActorConfig, clock: Clock = SYSTEM_CLOCK) -> None:
        self.ep = ep
        self.cfg = cfg
        self.clock = clock
        self.origin: Store = open_store(ep.store, dict(ep.storage_options))
        self.redis = connect(ep.redis)
        # Room for the stager's longest blocking read, and as much again for the reply.
        self.bus_redis = connect(ep.redis, block_s=2 * cfg.stage_block_ms / 1000)
        self.ledger = Ledger(self.redis, ep.run)
        self.bus = Bus(self.bus_redis, ep.run)
        self.keys = RunKeys(ep.run)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.staged: deque[tuple[StagedDelta | RemoteStaged, str, float]] = deque()
        """(delta, its state, seconds it took to stage) in version order."""
        self.staged_version = -1
        self.staged_state = ""
        self.commit_seen = -1
        self.stats = ActorStats()
        self._mirror: tuple[str, Store] | None = None
        self._missing_since: dict[int, float] = {}
        """version -> when the stager first found it missing from the region's mirror."""
        self._relay_progress: dict[int, float] = {}
        """version -> when the region's Relay last announced a segment of it."""
        self._mirror_behind = False

    # -- bootstrap ----------------------------------------------------------------
    def wait_for_version(self, version: int) -> None:
        """Join only once the run's head reaches ``version`` (a node that becomes available later)."""
        while not self.stop.is_set():
            head = self.redis.hget(self.keys.trainer, "head")
            if head is not None and int(head) >= version:
                return
            self.clock.wait(self.stop, self.cfg.join_poll_s)

    def prepare(self) -> None:
        """Build the engine from the run's model description (no weights yet)."""
        model, self.tokenizer = read_model_description(self.origin)
        self.engine = make_engine(self.cfg.engine, self.tokenizer)
        self.engine.load(model)

    def bootstrap(self) -> None:
        if not hasattr(self, "engine"):
            self.prepare()
        index = scan_versions(self.origin)
        if index.latest is None:
            raise AuroraError(f"{self.origin.url}: no version to bootstrap from")
        t0 = time.perf_counter()
        if isinstance(self.engine, StoreStaging):  # its workers read the store themselves
            _, state = self.engine.bootstrap_from_store(self.origin, self.ep.storage_options, index.latest, self.cfg.streams)
        else:
            tensors, state = materialize(self.origin, index.latest, self.cfg.streams)
            self.engine.load_weights(tensors, version=index.latest)
        self.active, self.active_state = index.latest, state
        self.staged_version, self.staged_state = index.latest, state
        record_digest(self.redis, self.keys, self.cfg.actor_id, self.active, self.engine.digest())
        log.info("%s bootstrapped at v%d in %.2fs", self.cfg.actor_id, self.active, time.perf_counter() - t0)
        self.ledger.register(self.cfg.actor_id, self.cfg.region, self.cfg.engine)
        self._heartbeat()

    def _heartbeat(self) -> None:
        ok = self.ledger.heartbeat(self.cfg.actor_id, active=self.active, staged=self.staged_version, active_state=self.active_state)
        if not ok and not self.stop.is_set():
            # Reaped (we were silent too long) or Redis lost its state: join again.
            log.warning("%s: heartbeat refused; registering again", self.cfg.actor_id)
            self.ledger.register(self.cfg.actor_id, self.cfg.region, self.cfg.engine)
            self.ledger.heartbeat(self.cfg.actor_id, active=self.active, staged=self.staged_version, active_state=self.active_state)

    def _heartbeat_loop(self) -> None:
        while not self.clock.wait(self.stop, self.cfg.heartbeat_s):
            try:
                self._heartbeat()
            except Exception as e:  # noqa: BLE001 - keep beating through Redis hiccups
                log.warning("heartbeat failed: %s", e)

    # -- staging --------------------------------------------------------------------
    def _poll(self) -> tuple[str | None, int | None, int | None]:
        """The region's Relay mirror URL (None while no Relay heartbeats), the run's head and commit: one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.get(self.keys.relay(self.cfg.region))
        pipe.hmget(self.keys.trainer, "head", "commit")
        url, (head, commit) = pipe.execute()
        return (url.decode() if url else None), _int_or_none(head), _int_or_none(commit)

    def _source(self, relay_url: str | None) -> tuple[Store, str | None]:
        """The region's mirror while its Relay heartbeats, else origin."""
        if relay_url:
            if self._mirror is None or self._mirror[0] != relay_url:
                self._mirror = (relay_url, open_store(relay_url))
            return self._mirror[1], self.cfg.region
        return self.origin, None

    def _fetch_delta(self, store: Store, version: int) -> tuple[Any, StagedDelta | RemoteStaged]:
        if isinstance(self.engine, StoreStaging):
            opts = self.ep.storage_options if store is self.origin else {}
            return self.engine.stage_from_store(store, opts, version, self.staged_state, self.cfg.streams)
        return fetch_delta(store, version, self.engine.param_specs(), self.cfg.streams, expect_base_state=self.staged_state)

    def _stage_available(self, polled: tuple[str | None, int | None] | None = None) -> None:
        """Stage every delta after ``staged_version`` that is committed, in order.

        ``polled`` is (Relay mirror URL, head) from a :meth:`_poll` just made.
        Each version is read by its manifest key directly (no listing: on a
        far link every request is a round trip), from the region's mirror
        when a Relay heartbeats, else from origin.

        The mirror may lag: origin is the truth, once the Relay had its chance.
        A version the mirror lacks is read from origin after it has been
        missing ``mirror_grace_s`` with no sign of the Relay copying it (each
        segment the Relay announces for it restarts the wait). A mirror that
        missed the grace once (a Relay that died and whose key has not expired
        yet, or one slower than the run) is skipped without waiting until it
        has a version first again: a grace per version would keep this Actor
        one grace behind the run for as long as the key lives.
        """
        relay_url, head = polled if polled is not None else self._poll()[:2]
        mirror, region = self._source(relay_url)
        v = self.staged_version + 1
        store = mirror
        while not self.stop.is_set() and (head is None or v <= head):
            t0 = time.perf_counter()
            try:
                m, staged = self._fetch_delta(store, v)
            except VersionNotFound:
                if store is self.origin:
                    return  # not committed (yet)
                if not self._mirror_behind:
                    now = self.clock.monotonic()
                    since = max(self._missing_since.setdefault(v, now), self._relay_progress.get(v, 0.0))
                    if now - since < self.cfg.mirror_grace_s:
                        return
                    log.warning("mirror of region %s lacks v%d after %.1fs; reading from origin until it catches up", region, v, self.cfg.mirror_grace_s)
                    self._mirror_behind = True
                store = self.origin
                continue
            except AuroraError as e:
                if store is not self.origin:
                    log.warning("stage v%d from mirror failed (%s); trying origin", v, e)
                    store = self.origin
                    continue
                log.error("stage v%d failed: %s", v, e)
                return
            from_mirror = store is not self.origin
            if from_mirror and self._mirror_behind:
                log.info("mirror of region %s caught up (v%d); reading from it again", region, v)
                self._mirror_behind = False
            with self.lock:
                self.staged.append((staged, m.state, time.perf_counter() - t0))
                self.staged_version, self.staged_state = v, m.state
            for d in (self._missing_since, self._relay_progress):
                for old in [k for k in d if k <= v]:
                    del d[old]
            self._on_staged(v, m.total_bytes, time.perf_counter() - t0, from_mirror)
            v += 1
            store = mirror  # the next version: the region's copy first, again

    def _on_staged(self, version: int, nbytes: int, seconds: float, from_mirror: bool) -> None:
        """Called in the stager thread after each version is staged (benchmarks record it)."""

    def _wait_for_relay(self) -> None:
        """``relay_wait_s``: give the region's Relay that long to appear before staging from origin."""
        if self.cfg.relay_wait_s <= 0:
            return
        deadline = self.clock.monotonic() + self.cfg.relay_wait_s
        while not self.stop.is_set() and self.clock.monotonic() < deadline:
            if self.redis.exists(self.keys.relay(self.cfg.region)):
                return
            self.clock.wait(self.stop, self.cfg.join_poll_s)
        if not self.stop.is_set():
            log.warning("no Relay for region %s after %.0fs; staging from origin", self.cfg.region, self.cfg.relay_wait_s)

    def _stager_loop(self) -> None:
        self._wait_for_relay()
        last = "$"
        region = None
        polled: tuple[str | None, int | None, int | None] | None = None
        retry = self.cfg.stager_retry.delays()
        while not self.stop.is_set():
            try:
                url, head, commit = polled or self._poll()
                new_region = self.cfg.region if url else None
                if new_region != region or last == "$":
                    # Source changed (Relay up or down): start from the newest entry.
                    last = self.bus.tail_id(new_region)
                    region = new_region
                    self._stage_available((url, head))
                events = self.bus.read(last, block_ms=self.cfg.stage_block_ms, region=region)
                now = self.clock.monotonic()
                for ev in events:
                    last = ev.id
                    if ev.type == COMMIT:
                        self.commit_seen = max(self.commit_seen, ev.version)
                    elif ev.type == SEGMENT and region is not None:
                        self._relay_progress[ev.version] = now  # the Relay is copying it
                polled = url, head, commit = self._poll()
                # Announcements are hints: a silent stream (a Relay that just died,
                # before its key expires) must not stop us from staging what exists,
                # nor from activating what the Trainer committed.
                if commit is not None:
                    self.commit_seen = max(self.commit_seen, commit)
                if events or (head is not None and head > self.staged_version):
                    self._stage_available((url, head))
                retry = self.cfg.stager_retry.delays()
            except BusGap:
                last = "$"
            except Exception as e:  # noqa: BLE001 - the stager must survive store/Redis trouble
                log.warning("stager: %s: %s", type(e).__name__, e)
                self.clock.wait(self.stop, next(retry))
                last, polled = "$", None

    # -- safe point -------------------------------------------------------------------
    def _wanted_version(self) -> int:
        """The version to run next.

        Stay on the active version while an open step generated on it has
        prompts not yet accepted (a lease that expires comes back to the pool
        and needs someone on this version); then move to the newest version
        that a step or a Commit asks for. With one-step asynchrony this is
        exactly: finish batch b+1 on v_b, then activate v_b+1 for batch b+2.
        """
        needed: list[int] = []
        for _, sv, left in self.ledger.open_step_info():
            if not left:
                continue
            if sv == self.active:
                return self.active
            if sv > self.active:
                needed.append(sv)
        # The oldest version an open step still needs comes first: skipping it
        # would strand that step's prompts on a version nobody holds.
        return min(needed) if needed else max(self.active, self.commit_seen)

    def _activate(self) -> None:
        """Between batches: apply staged deltas up to the version the run needs."""
        while self.active < self._wanted_version():
            with self.lock:
                if not self.staged or self.staged[0][0].base_version != self.active:
                    # Drop anything that does not continue the active version.
                    while self.staged and self.staged[0][0].version <= self.active:
                        self.staged.popleft()
                    if not self.staged or self.staged[0][0].base_version != self.active:
                        return
                staged, state, stage_s = self.staged.popleft()
            t0 = time.perf_counter()
            self.engine.apply(staged)
            self.active, self.active_state = staged.version, state
            act_s = time.perf_counter() - t0
            self.stats.activations.append((self.active, stage_s, act_s))
            record_digest(self.redis, self.keys, self.cfg.actor_id, self.active, self.engine.digest())
            record_activation(self.redis, self.keys, self.cfg.actor_id, self.active, stage_s, act_s)
            self._heartbeat()
            log.info("%s activated v%d (staged in %.3fs, applied in %.4fs)", self.cfg.actor_id, self.active, stage_s, act_s)

    # -- work -------------------------------------------------------------------------
    def _work_once(self) -> bool:
        for s, sv, _ in self.ledger.open_step_info():
            if sv != self.active:
                continue
            status, leases = self.ledger.claim(self.cfg.actor_id, s, self.cfg.claim)
            if status == "not_alive":
                self._heartbeat()
                return False
            if leases:
                self._generate_and_settle(leases)
                return True
        return False

    def _generate_and_settle(self, leases: list[Lease]) -> None:
        prompts = [json.loads(le.payload)["ids"] for le in leases]
        group = leases[0].group
        t0 = time.perf_counter()
        gen = self.engine.generate(prompts, group, self.cfg.max_new_tokens, seed=self.cfg.seed ^ leases[0].token, temperature=self.cfg.temperature)
        if self.cfg.slowdown > 1:
            self.clock.wait(self.stop, gen.seconds * (self.cfg.slowdown - 1))
        gen_s = time.perf_counter() - t0
        items = []
        for le, comps in zip(leases, gen.completions, strict=True):
            body = {
                "completions": [list(c.token_ids) for c in comps],
                "texts": [c.text for c in comps],
                "new_tokens": sum(len(c.token_ids) for c in comps),
                "gen_s": gen_s / len(leases),
            }
            items.append((le, self.active, self.active_state, json.dumps(body).encode()))
        for st in self.ledger.settle_many(self.cfg.actor_id, items):
            if st.accepted:
                self.stats.settled += 1
            else:
                self.stats.rejected[st.reason] = self.stats.rejected.get(st.reason, 0) + 1
        self.stats.tokens += gen.new_tokens

    def run(self) -> ActorStats:
        self.bootstrap()
        threads = [threading.Thread(target=f, daemon=True, name=n) for f, n in ((self._heartbeat_loop, "heartbeat"), (self._stager_loop, "stager"))]
        for t in threads:
            t.start()
        try:
            idle = self.cfg.idle.delays()
            while not self.stop.is_set():
                self._activate()
                if self._work_once():
                    idle = self.cfg.idle.delays()
                else:
                    # Back off while there is nothing to do: idle Actors polling
                    # Redis steal CPU from whoever shares the machine.
                    self.clock.wait(self.stop, next(idle))
        finally:
            self.stop.set()
            if hasattr(self.engine, "close"):  # an engine with processes of its own (vLLM)
                self.engine.close()
            released = self.ledger.leave(self.cfg.actor_id)
            log.info("%s left: %d settled, %d prompt(s) released, rejections %s", self.cfg.actor_id, self.stats.settled, released, self.stats.rejected)
        return self.stats


def _int_or_none(x: Any) -> int | None:
    return None if x is None else int(x)

