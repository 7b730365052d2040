"""``Follower``: follow a run from any inference process, by the cheapest path, validated before any write.

A Follower tells the newest committed version (:meth:`Follower.latest`),
waits for a new one (:meth:`Follower.wait`: woken by the run's Redis
announcements when it has Redis, else by polling the store), and brings a
set of tensors to a version (:meth:`Follower.update`): a
``torch.nn.Module``, a mapping of tensors (Hugging Face or fused names), or
an engine with ``param_specs`` / ``apply`` / ``load_weights`` (the workers'
torch and vLLM engines). From the version it holds, the update replays the
deltas after it; from nothing, or when fewer bytes do it, it starts from
the newest snapshot bound to the chain. Every delta is fetched, checked
against its manifest's sha256 and its base's state, decoded and validated
against the target's shapes before the first element is written; the
weights reached are checked against the manifest's ``weights_digest``.

With ``mirror``, segments are read from the mirror and checked against the
manifests read at origin: a mirror can make a version slower (then the
origin is read), never different. ``trust_keys`` refuses any version not
signed by them (FORMAT.md §4.1). Outages of the store and Redis are ridden
out up to ``outage_budget_s``, like the workers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aurora_store.api.weights import Tensors, copy_into, family_of, named_tensors, tied_head
from aurora_store.apply.sink import TREE_PREFIX, FusedWeights, SplitWeights, apply_delta, digest_as
from aurora_store.codec.entries import ParamSpec
from aurora_store.codec.extract import plan_of, unfuse_weights
from aurora_store.codec.fusion import FusionPlan
from aurora_store.config import DEFAULT_STREAMS
from aurora_store.coordination.bus import Bus
from aurora_store.coordination.commit import commit_records_for
from aurora_store.coordination.records import RunRecords
from aurora_store.coordination.redisconn import connect
from aurora_store.errors import (
    BusGap,
    ChainError,
    ConfigError,
    IntegrityError,
    ObjectNotFound,
    StoreError,
    VersionNotFound,
)
from aurora_store.format.checkpoint import StagedDelta
from aurora_store.format.manifest import Manifest, manifest_key
from aurora_store.format.signing import TrustKeys, trust_from_option
from aurora_store.lineage.binding import manifest_weights_digest
from aurora_store.lineage.fetch import ManifestReader, bound_index, fetch_delta
from aurora_store.lineage.materialize import materialize
from aurora_store.lineage.plan import plan_chain, scan_versions
from aurora_store.lineage.trusted import Fact, committed_versions
from aurora_store.outage import Dependency, is_transient, outage_budget_s, riding
from aurora_store.storage import Store, open_store
from aurora_store.storage.probe import read_commit_marker

__all__ = ["Follower", "Updated"]

log = logging.getLogger("aurora.follower")


@dataclass(frozen=True, slots=True)
class Updated:
    """What one :meth:`Follower.update` did."""

    version: int
    state: str
    path: str
    """``deltas`` (replayed after the held version), ``snapshot`` (a snapshot and the deltas after it) or ``none`` (held already)."""
    deltas: int
    """Deltas applied."""
    bytes: int
    """Bytes fetched."""
    seconds: float


def _is_engine(target: Any) -> bool:
    return all(callable(getattr(target, a, None)) for a in ("param_specs", "apply", "load_weights"))


class Follower:
    """Follows one run for one set of tensors; see the module's docstring."""

    def __init__(
        self,
        store: str | Store,
        *,
        redis: str | Any | None = None,
        run: str | None = None,
        mirror: str | Store | None = None,
        trust_keys: TrustKeys | Sequence[str] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        mirror_options: Mapping[str, Any] | None = None,
        outage_budget: float | None = None,
        poll_s: float = 1.0,
        streams: int = DEFAULT_STREAMS,
    ) -> None:
        if poll_s <= 0:
            raise ConfigError(f"poll_s must be > 0, got {poll_s}")
        self.stop = threading.Event()
        self.poll_s, self.streams = poll_s, streams
        budget = outage_budget_s(outage_budget)
        self.store_dep = Dependency("the store", log, budget)
        raw = store if not isinstance(store, str) else open_store(store, dict(storage_options or {}))
        self._raw_origin = raw
        self.origin = riding(raw, self.store_dep, self.stop)
        self.mirror: Store | None = None
        if mirror is not None:
            m = mirror if not isinstance(mirror, str) else open_store(mirror, dict(mirror_options or {}))
            self.mirror = riding(m, Dependency("the mirror", log, budget), self.stop)
        self.trust = trust_keys if isinstance(trust_keys, TrustKeys) or trust_keys is None else trust_from_option(list(trust_keys))
        self.run = run or self._run_from_manifests()
        if self.trust is not None and self.run:  # a key may sign several runs: accept this one's only
            self.trust = self.trust.for_run(self.run)
        self._raw_redis: Any = None
        self.bus: Bus | None = None
        self._last_event = "$"
        if redis is not None:
            self.redis_dep = Dependency("Redis", log, budget)
            self._raw_redis = connect(redis) if isinstance(redis, str) else redis
            if self.run is None:
                raise ConfigError(f"{raw.url}: no manifest names the run yet; pass run= to follow its announcements")
            self.bus = Bus(self._raw_redis, self.run)
            self._last_event = self.redis_dep.call(lambda: self.bus.tail_id(), "read the stream's tail", self.stop)  # type: ignore[union-attr]
        marked = self.store_dep.call(lambda: read_commit_marker(raw), "read the commit marker", self.stop)
        if marked is not None and self._raw_redis is None:
            raise ConfigError(f"{raw.url} commits through Redis (FORMAT.md §1): its versions cannot be checked without redis=")
        # The commit mode is the run's for its whole life: found once, so a Redis outage later
        # does not stop the store from being read (records are read only in Redis-commit mode).
        self._commits: Any = None
        if self._raw_redis is not None and self.run:
            run_ = self.run
            self._commits = self.redis_dep.call(lambda: commit_records_for(self._raw_redis, run_), "read the commit mode", self.stop)
        self._facts: dict[tuple[str, int], Fact] = {}
        """Manifests already read by :meth:`latest` (committed manifests never change)."""
        self.version: int | None = None
        """The version the target holds (None before the first update)."""
        self.state: str | None = None

    def close(self) -> None:
        self.stop.set()

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what exists ---------------------------------------------------------------------
    def _reader(self) -> ManifestReader:
        return ManifestReader(self._raw_origin, self.trust, self._commits)

    def _run_from_manifests(self) -> str | None:
        index = self.store_dep.call(lambda: scan_versions(self._raw_origin), "list versions", self.stop)
        for kind, versions in (("delta", index.deltas), ("snapshot", index.snapshots)):
            for v in sorted(versions)[:1]:  # the root: plants sit far ahead, not in place of it
                m = ManifestReader(self._raw_origin, self.trust).get(kind, v)
                if m is not None and m.run:
                    return m.run
        return None

    def latest(self) -> int | None:
        """The newest committed version the target could be brought to (None: none yet).

        Not the newest listed: a manifest planted at ``v9999999999`` is listed too.
        The versions that count (:func:`~aurora_store.lineage.trusted.committed_versions`:
        trusted, on the chain, at or below the Trainer's head where Redis has it)
        decide; each manifest is read once over the follower's life.
        """
        ceiling: int | None = None
        if self._raw_redis is not None and self.run:
            records = RunRecords(self._raw_redis, self.run)
            ceiling = self.redis_dep.call(records.head, "read the run's head", self.stop)

        def newest() -> int | None:
            return committed_versions(self._raw_origin, self.trust, self._commits, ceiling=ceiling, cache=self._facts).head

        return self.store_dep.call(newest, "list versions", self.stop)

    def wait(self, after: int | None = None, timeout: float | None = None) -> int | None:
        """The newest version once one newer than ``after`` (default: the held one) exists; None at ``timeout`` or :meth:`close`."""
        floor = self.version if after is None else after
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.stop.is_set():
            v = self.latest()
            if v is not None and (floor is None or v > floor):
                return v
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            self._sleep(self.poll_s if left is None else min(self.poll_s, left))
        return None

    def _sleep(self, seconds: float) -> None:
        """Until the run announces something (with Redis), or ``seconds`` pass; the store is then read again."""
        if self.bus is None:
            self.stop.wait(seconds)
            return
        bus = self.bus
        try:
            events = bus.read(self._last_event, block_ms=max(1, int(seconds * 1000)))
            self.redis_dep.ok()
        except BusGap:  # trimmed past our position: the store is the truth, start from the tail
            self._last_event = self.redis_dep.call(bus.tail_id, "read the stream's tail", self.stop)
            return
        except Exception as e:  # noqa: BLE001 - Redis away: poll the store meanwhile (said once)
            if not is_transient(e):
                raise
            self.redis_dep.failed(e, "read announcements")
            self.stop.wait(seconds)
            return
        if events:
            self._last_event = events[-1].id

    def __iter__(self) -> Iterator[int]:
        """Each new version's number as it is committed (blocking; ends at :meth:`close`)."""
        last = self.version
        while not self.stop.is_set():
            v = self.wait(after=last)
            if v is None:
                return
            last = v
            yield v

    # -- updating -------------------------------------------------------------------------
    def update(self, target: Tensors | Any, version: int | None = None) -> Updated:
        """Bring ``target`` to ``version`` (default: the newest); nothing is written unless every check passed."""
        t0 = time.perf_counter()
        v = self.latest() if version is None else int(version)
        if v is None:
            raise VersionNotFound(f"{self._raw_origin.url} holds no committed version yet (wait() for one)")
        if self.version == v:
            assert self.state is not None
            return Updated(v, self.state, "none", 0, 0, 0.0)
        if self.version is not None and v < self.version:
            raise ChainError(f"the target holds v{self.version}; a Follower never goes back (asked for v{v})")
        if not _is_engine(target):
            odd = sorted({str(t.dtype) for _, t in named_tensors(target)} - {"torch.bfloat16"})
            if odd:
                raise ConfigError(
                    f"the target holds {', '.join(odd)} tensors: a version is bfloat16 bit for bit; convert it first (model.to(torch.bfloat16))"
                )
        reader = self._reader()
        index = bound_index(self.store_dep.call(lambda: scan_versions(self._raw_origin), "list versions", self.stop), reader)
        cp = plan_chain(index, v, self.version, cost=reader.cost)
        if cp.snapshot is None:
            got = self._replay(target, reader, cp.deltas)
        else:
            got = self._whole(target, v, reader)
        self.version, self.state = v, got[0]
        return Updated(v, got[0], got[1], got[2], got[3], time.perf_counter() - t0)

    def _replay(self, target: Any, reader: ManifestReader, deltas: Sequence[int]) -> tuple[str, str, int, int]:
        """Stage every delta (fetched, checked, decoded, validated), then write them in order."""
        specs, sink, plan = self._sink(target)
        staged: list[tuple[Manifest, StagedDelta]] = []
        state = self.state
        nbytes = 0
        for d in deltas:
            m = reader.get("delta", d)
            if m is None:
                raise VersionNotFound(f"delta {d}: {reader.why('delta', d) or 'not committed'}")
            got = self._fetch(d, m, specs, state)
            staged.append(got)
            state, nbytes = got[0].state, nbytes + m.total_bytes
        for _, s in staged:
            target.apply(s) if sink is None else apply_delta(s, sink)
        assert state is not None
        if staged:
            self._check_digest(target, plan, staged[-1][0])
        return state, "deltas", len(staged), nbytes

    def _fetch(self, d: int, m: Manifest, specs: Mapping[str, ParamSpec], base: str | None) -> tuple[Manifest, StagedDelta]:
        """Delta ``d``, its segments from the mirror when it has them (checked against origin's manifest), else origin."""
        if self.mirror is not None:
            try:
                return fetch_delta(self.mirror, d, specs, self.streams, expect_base_state=base, manifest=m, trust=self.trust)
            except (ObjectNotFound, IntegrityError, StoreError) as e:
                log.info("delta %d: not usable from the mirror (%s); reading origin", d, e)
        return self.store_dep.call(
            lambda: fetch_delta(self._raw_origin, d, specs, self.streams, expect_base_state=base, manifest=m, trust=self.trust),
            f"fetch delta {d}",
            self.stop,
        )

    def _whole(self, target: Any, v: int, reader: ManifestReader) -> tuple[str, str, int, int]:
        """The newest bound snapshot at or below ``v`` and the deltas after it, assembled aside, then written."""
        fused, state = self.store_dep.call(
            lambda: materialize(self._raw_origin, v, self.streams, trust=self.trust, commits=self._commits), f"materialize v{v}", self.stop
        )
        cp = plan_chain(bound_index(scan_versions(self._raw_origin), reader), v)
        nbytes = sum(reader.cost(k, x) or 0 for k, x in [("snapshot", cp.snapshot or 0), *(("delta", d) for d in cp.deltas)])
        if _is_engine(target):
            target.load_weights(fused, version=v)
        else:
            named = dict(named_tensors(target))
            fused_names = set(fused)
            if set(named) <= fused_names:
                copy_into(target, fused)
            else:
                plan = plan_of(named, tied=tied_head(target, named), family=family_of(target))
                copy_into(target, unfuse_weights(fused, plan))
        return state, "snapshot", len(cp.deltas), nbytes

    def _sink(self, target: Any) -> tuple[Mapping[str, ParamSpec], Any, FusionPlan | None]:
        """(the target's fused specs, a sink writing into it or None for an engine, its plan)."""
        if _is_engine(target):
            return target.param_specs(), None, None
        named = dict(named_tensors(target))
        plan = plan_of(named, tied=tied_head(target, named), family=family_of(target))
        sink: FusedWeights | SplitWeights = SplitWeights({n: named[n] for p in plan for n in (b.source for b in p.blocks)}, plan)
        return plan.specs(), sink, plan

    def _check_digest(self, target: Any, plan: FusionPlan | None, m: Manifest) -> None:
        where = self._raw_origin.where(manifest_key(m.kind, m.version))
        want = manifest_weights_digest(m.extra, where)
        if want is None:
            return
        if plan is None:
            # An engine: in the form the manifest names (FORMAT.md §4.1), hashed by the engine itself
            # (``verify_digest``, off any lock), else its own ``digest()`` when that is the form named.
            verify, digest = getattr(target, "verify_digest", None), getattr(target, "digest", None)
            if callable(verify):
                got = verify(want)
            else:
                got = digest() if callable(digest) and not want.startswith(TREE_PREFIX) else None
        else:
            got = digest_as(want, dict(named_tensors(target)), plan)
        if got is not None and got != want:
            self.version = self.state = None  # the target no longer holds a known version
            raise IntegrityError(
                f"{where}: the target's weights have digest {got[:19]}…, the manifest says {want[:19]}… (held weights were not those of the base?)"
            )
