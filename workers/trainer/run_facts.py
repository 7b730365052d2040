"""What a resuming Trainer takes as fact, and from where: the head, each version's state and weights digest, the epoch.

Why: the store is shared. Anyone who can write to it can add a manifest or a
checkpoint under any free name, so the highest name in a listing is not the
run's head and the newest ``step-*`` is not the Trainer's checkpoint. The
facts come instead from:

- the committed chain of the store (:func:`aurora_store.lineage.trusted.committed_versions`):
  every manifest checked with the run's trust keys and, in Redis-commit mode,
  against its commit record; from the root, each delta on the state of the
  version before it. A far-future manifest is off the chain and ignored (named
  once), so it can neither be the head nor stop the resume; an unsigned delta
  on the head of a signed run is refused by its missing signature;
- the Trainer's fenced record in Redis (head, expected states, digest log),
  used when its head lies on that chain with the same state (a Redis of another
  run, or one that lost its data, is not);
- the Trainer's own checkpoints and versions, as it writes them.

Every epoch read on the way (a manifest's ``producer.epoch``) is an integer
below 2^53 (:func:`aurora_store.coordination.records.epoch_problem`) or the
manifest does not count.

What is left without signatures or Redis: a well-formed delta appended on the
head of an unsigned run is indistinguishable from the Trainer's own (see
:mod:`aurora_store.lineage.trusted`); the Trainer's own crash between writing a
manifest and recording it in Redis looks exactly like that, and is resumed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aurora_store.coordination.records import RunRecords, epoch_problem
from aurora_store.errors import ManifestError
from aurora_store.format.manifest import Manifest, manifest_key
from aurora_store.lineage.fetch import read_manifest
from aurora_store.lineage.trusted import committed_versions, fact_of
from aurora_store.storage import Store

if TYPE_CHECKING:
    from aurora_store.format.signing import TrustKeys
    from aurora_store.lineage.interfaces import CommitRecords

__all__ = ["RunFacts", "establish"]

log = logging.getLogger("aurora.trainer")


@dataclass(slots=True)
class RunFacts:
    """The committed versions a Trainer knows of: what binds its checkpoints (:data:`~workers.trainer.checkpoint.Binding`)."""

    head: int | None = None
    """The newest committed version (None: none known yet)."""
    states: dict[int, str] = field(default_factory=dict)
    """version -> its committed ``state``."""
    digests: dict[int, str] = field(default_factory=dict)
    """version -> its committed ``weights_digest`` (where one is known)."""
    head_epoch: int | None = None
    """``producer.epoch`` of the head's manifest (validated), None when it has none."""
    deltas: frozenset[int] = frozenset()
    """Committed versions that are deltas (the others: version 0's snapshot)."""

    def binding(self, version: int) -> tuple[str, str] | None:
        """(state, weights_digest) committed at ``version``; None when not committed or the digest is unknown."""
        if self.head is None or version > self.head:
            return None
        state, digest = self.states.get(version), self.digests.get(version)
        return (state, digest) if state is not None and digest is not None else None

    def add(self, version: int, state: str, digest: str) -> None:
        """A version this Trainer published (or continued from) itself."""
        self.states[version] = state
        self.digests[version] = digest
        self.head = version if self.head is None else max(self.head, version)


def _producer_epoch(m: Manifest, where: str) -> int | None:
    epoch = m.producer.get("epoch") if isinstance(m.producer, Mapping) else None
    if epoch is None:
        return None
    why = epoch_problem(epoch)
    if why is not None:
        raise ManifestError(where, f"producer {why}")
    return int(epoch)


def establish(store: Store, records: RunRecords, trust: TrustKeys | None, commits: CommitRecords | None) -> RunFacts:
    """The run's facts for a resume: the committed chain of ``store``, then the Trainer's record in Redis.

    Lists the store once and reads each manifest once (capped, checked); a
    listed manifest that does not count is named in one warning.
    """
    digests: dict[tuple[str, int], str] = {}
    epochs: dict[tuple[str, int], int] = {}

    def read(kind: str, version: int) -> Manifest:
        m = read_manifest(store, kind, version, trust, commits)
        where = store.where(manifest_key(kind, version))
        epoch = _producer_epoch(m, where)
        if epoch is not None:
            epochs[(kind, version)] = epoch
        d = fact_of(m, where).digest
        if d is not None:
            digests[(kind, version)] = d
        return m

    chain = committed_versions(store, trust, commits, read=read)
    if chain.ignored:
        log.warning("%s: not committed, ignored by the resume: %s", store.url, "; ".join(chain.ignored_text(10)))
    facts = RunFacts(head=chain.head, states=dict(chain.states), deltas=frozenset(chain.index.deltas))
    for v in chain.states:
        kind = "delta" if v in chain.index.deltas else "snapshot"
        if (kind, v) in digests:
            facts.digests[v] = digests[(kind, v)]
    if chain.head is not None:
        kind = "delta" if chain.head in chain.index.deltas else "snapshot"
        facts.head_epoch = epochs.get((kind, chain.head))
    _with_redis(facts, records, store)
    return facts


def _with_redis(facts: RunFacts, records: RunRecords, store: Store) -> None:
    """Add the Trainer's digest log when its record's head lies on the chain with the same state."""
    rec = records.trainer()
    head = rec.head
    if head is None:
        return
    state = records.expected_state(head) or rec.head_state
    if facts.head is None or head > facts.head or facts.states.get(head) != state:
        log.warning(
            "%s: Redis names head v%d, which is not on the store's committed chain (ending at %s) with that state: "
            "its records are not used to bind checkpoints",
            store.url,
            head,
            "nothing" if facts.head is None else f"v{facts.head}",
        )
        return
    logged, _ = records.digests()
    for v, d in logged.items():
        if v not in facts.states:
            continue
        have = facts.digests.get(v)
        if have is None:
            facts.digests[v] = d
        elif have != d:
            facts.digests.pop(v)  # two committed sources disagree: nothing is bound to this version
            log.warning("%s: version %d: the Trainer's digest log and its manifest disagree; no checkpoint binds to it", store.url, v)
