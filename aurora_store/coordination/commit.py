"""Redis-commit mode (FORMAT.md §1): versions committed by a Redis record, not a create-only write.

Why: on a store that ignores ``If-None-Match: *`` (``rclone serve s3`` and
other S3-compatible servers; :mod:`aurora_store.storage.probe` finds out)
the create-only manifest write cannot decide which of two writers of a
version wins. In the style of Delta Lake's DynamoDB log store, the decision
moves to a store that can make it atomically: before writing a manifest,
the writer records the sha256 of its bytes in Redis with ``SET NX`` (first
writer wins). A version then exists when its manifest exists *and* its
bytes match the record; readers of such a run check the record and refuse
a manifest that does not match.

Keys (all under the run's ``aurora:{run}:`` prefix, one hash slot):

- ``commit:{kind}:{version}`` (string, no TTL): ``b"sha256:<hex>\\n"``
  followed by the manifest bytes themselves, so a manifest write lost after
  the record landed (a writer killed between the two) can be completed from
  Redis (:meth:`RedisCommitLog.complete`);
- ``commit-mode`` (string, no TTL): JSON ``{"via": "redis", "since_ms": …, "adopted": …}``,
  set once by the first writer in this mode (``adopted`` turns true once the
  versions committed before the switch are recorded; absent: true). Readers that have Redis ask it
  (:func:`commit_records_for`) whether to check records; the store marker
  ``.aurora/commit.json`` (:func:`aurora_store.storage.probe.write_commit_marker`)
  tells readers without Redis that they cannot check this run.

The record is the commit point, so Redis must keep it: the mode refuses to
start on a Redis that persists nothing (:func:`require_persistence`).
Bytes read from Redis are untrusted: a record whose digest does not match
its own bytes is an error, never a commit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aurora_store.config import Switch
from aurora_store.coordination.keys import glob_escape
from aurora_store.coordination.redisconn import (
    key_prefix,
    on_master_of,
    translate_redis_errors,
    wait_for_replica,
)
from aurora_store.errors import ConfigError, CoordinationError, ObjectTooLarge, VersionConflict
from aurora_store.format.limits import MAX_MANIFEST_BYTES
from aurora_store.format.manifest import manifest_key, parse_version_dir
from aurora_store.storage import Store
from aurora_store.storage.probe import COMMIT_VIA, require_create_only, write_commit_marker

__all__ = [
    "CommitRecord",
    "RedisCommitLog",
    "TRUST_PERSISTENCE_ENV",
    "commit_records_for",
    "prepare_commit",
    "require_persistence",
]

if TYPE_CHECKING:
    from aurora_store.format.signing import TrustKeys

log = logging.getLogger("aurora.commit")

#: Set to 1 when Redis persists its data in a way ``INFO`` / ``CONFIG GET`` cannot show
#: (a managed service that hides ``CONFIG``): the persistence check then trusts the operator.
TRUST_PERSISTENCE_ENV = "AURORA_REDIS_PERSISTENT"
TRUST_PERSISTENCE = Switch(
    TRUST_PERSISTENCE_ENV, bool, False, "trust that Redis persists its data where INFO and CONFIG GET cannot show it (Redis-commit mode)"
)

_KINDS = ("delta", "snapshot")
#: Largest record accepted from Redis (a manifest of a very large model is a few MB).
_MAX_RECORD_BYTES = 64 << 20


def _stored_manifest(store: Store, kind: str, version: int) -> bytes:
    """The manifest bytes at ``kind`` ``version``, capped at the manifest limit; a larger object
    (never one a writer wrote) reads as empty, so it differs from any record."""
    try:
        return store.get_capped(manifest_key(kind, version), MAX_MANIFEST_BYTES, "the manifest limit")
    except ObjectTooLarge:
        return b""


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass(frozen=True, slots=True)
class CommitRecord:
    """One version's record: the digest of its manifest bytes, and the bytes."""

    kind: str
    version: int
    digest: str
    manifest: bytes


def require_persistence(client: Any, run: str | None = None) -> str:
    """How ``client``'s Redis persists its data (``"aof"`` or ``"rdb"``), or :class:`ConfigError`.

    Why: in Redis-commit mode a version is committed by its Redis record; a
    Redis that restarts empty forgets which manifest won, and a second
    writer could then commit a different one. Append-only files
    (``appendonly yes``) keep every record; RDB snapshots (``save`` rules)
    keep all but the last minutes. ``AURORA_REDIS_PERSISTENT=1`` skips the
    check for a Redis that persists in a way these commands do not show.
    """
    if TRUST_PERSISTENCE.get():
        return "trusted"
    at = on_master_of(client, key_prefix(run)) if run else {}  # on a cluster: the run's master
    with translate_redis_errors("check Redis persistence"):
        info = client.info("persistence", **at)
    if str(info.get("aof_enabled", "0")) == "1":
        return "aof"
    save = ""
    try:
        with translate_redis_errors("check Redis persistence"):
            got = client.config_get("save", **at)
        raw = got.get("save", got.get(b"save", "")) if isinstance(got, dict) else ""
        save = raw.decode() if isinstance(raw, bytes) else str(raw)
    except CoordinationError as e:
        # CONFIG refused (an ACL user without it, a managed service): we cannot tell.
        raise ConfigError(
            f"--commit-via redis needs a Redis that persists its data: appendonly is off and the save rules "
            f"cannot be read ({e}); turn on appendonly (appendonly yes), or set {TRUST_PERSISTENCE_ENV}=1 if "
            "this Redis persists its data in another way"
        ) from None
    if save.strip():
        return "rdb"
    raise ConfigError(
        "--commit-via redis needs a Redis that persists its data (the commit records are the commit point), "
        "but this one has appendonly off and no save rules; start it with --appendonly yes "
        f"(or CONFIG SET appendonly yes), or set {TRUST_PERSISTENCE_ENV}=1 if it persists in another way"
    )


class RedisCommitLog:
    """The commit records of one run: implements :class:`~aurora_store.lineage.interfaces.CommitRecords`.

    ``client`` is a redis-py client (bytes responses); it may be wrapped to
    ride out outages (:mod:`aurora_store.outage`): every write here is
    idempotent, so a retry after a lost answer is safe.
    """

    def __init__(self, client: Any, run: str) -> None:
        self.client = client
        self.run = run
        self._prefix = key_prefix(run)

    def __repr__(self) -> str:
        return f"RedisCommitLog(run={self.run!r})"

    # -- keys ------------------------------------------------------------------
    def key(self, kind: str, version: int) -> str:
        """``aurora:{run}:commit:{kind}:{version}``."""
        if kind not in _KINDS or version < 0:
            raise ValueError(f"no commit record for {kind} {version}")
        return f"{self._prefix}commit:{kind}:{version}"

    @property
    def mode_key(self) -> str:
        """``aurora:{run}:commit-mode``."""
        return f"{self._prefix}commit-mode"

    # -- reading ---------------------------------------------------------------
    def record(self, kind: str, version: int) -> CommitRecord | None:
        """The record of ``kind`` ``version``, checked against itself; None if there is none."""
        key = self.key(kind, version)
        with translate_redis_errors("read a commit record"):
            raw = self.client.get(key)
        if raw is None:
            return None
        return _parse_record(kind, version, bytes(raw), key)

    def commit_record(self, kind: str, version: int) -> str | None:
        """``"sha256:<hex>"`` of the recorded manifest bytes, or None (the CommitRecords Protocol)."""
        rec = self.record(kind, version)
        return None if rec is None else rec.digest

    def enabled(self) -> bool:
        """Whether this run commits through Redis (its ``commit-mode`` key says so)."""
        with translate_redis_errors("read the commit mode"):
            raw = self.client.get(self.mode_key)
        if raw is None:
            return False
        try:
            return bool(json.loads(bytes(raw)).get("via") == "redis")
        except (ValueError, AttributeError):
            raise CoordinationError(f"{self.mode_key} holds no commit mode (malformed)") from None

    # -- writing ---------------------------------------------------------------
    def commit(self, kind: str, version: int, data: bytes) -> bool:
        """Record ``data`` as the manifest of ``kind`` ``version``: the commit point.

        True when this call wrote the record, False when an equal record was
        already there (our own earlier attempt, whose answer was lost).
        :class:`~aurora_store.errors.VersionConflict` when another writer's
        manifest won.
        """
        key = self.key(kind, version)
        digest = _digest(data)
        for _ in range(3):  # a record deleted between SET and GET (an operator): decide again
            with translate_redis_errors("write a commit record"):
                won = self.client.set(key, digest.encode() + b"\n" + data, nx=True)
                if won:
                    wait_for_replica(self.client, key)  # on a cluster: the record survives a failover
            if won:
                return True
            have = self.record(kind, version)
            if have is None:
                continue
            if have.digest != digest:
                raise VersionConflict(
                    f"{kind} {version} of run {self.run!r} is already committed in Redis with another manifest "
                    f"({have.digest[:19]}…, ours {digest[:19]}…)"
                )
            with translate_redis_errors("write a commit record"):
                wait_for_replica(self.client, key)  # our earlier attempt's record, maybe not replicated yet
            return False
        raise CoordinationError(f"{key}: the commit record keeps disappearing")

    def publish_callback(self) -> Callable[[str, int, bytes], None]:
        """The ``commit`` argument of :func:`~aurora_store.lineage.publish.publish_delta` /
        ``publish_snapshot``: records the manifest before the store write."""

        def commit(kind: str, version: int, data: bytes) -> None:
            self.commit(kind, version, data)

        return commit

    def enable(self, store: Store, trust: TrustKeys | None = None) -> list[tuple[str, int, str]]:
        """Put the run in Redis-commit mode (idempotent), before its first publish in this mode.

        Sets the ``commit-mode`` key (first writer wins) and writes the store
        marker for readers without Redis. Returns the manifests listed that
        have no record and are left so (kind, version, why): readers refuse
        them.

        What is recorded (issue 24: the writer must never commit what someone
        planted in the bucket): only when this call switches the run to
        Redis-commit mode (the mode key says ``"adopted": false`` until it is
        done, so a switch cut short is finished by the next start), the
        versions the store-commit rule counts are recorded: the chain from the
        root (:mod:`aurora_store.lineage.trusted`), at or below the head of
        the Trainer's fenced record when there is one, signed by ``trust``
        when given. Every other manifest listed is named in one warning and
        left unrecorded for an operator to inspect and delete. A run already
        in the mode records nothing here: from then on only
        :meth:`commit`, called by a writer for the manifest it is about to
        write, makes a record.
        """
        from aurora_store.coordination.records import RunRecords
        from aurora_store.lineage.trusted import committed_versions

        mode = json.dumps({"via": "redis", "since_ms": int(time.time() * 1000), "adopted": False}).encode()
        with translate_redis_errors("set the commit mode"):
            self.client.set(self.mode_key, mode, nx=True)
        if not self.enabled():
            raise ConfigError(f"run {self.run!r}: {self.mode_key} names another commit mode")
        write_commit_marker(store, self.run)
        if self._adopted():
            return []
        head = RunRecords(self.client, self.run).head()
        counted = committed_versions(store, trust, None, head)
        for version in sorted(counted.index.deltas | counted.index.snapshots):
            for kind in ("delta", "snapshot"):
                if counted.counts(kind, version) and self.record(kind, version) is None:
                    self.commit(kind, version, store.get_capped(manifest_key(kind, version), MAX_MANIFEST_BYTES, "the manifest limit"))
                    log.info("recorded the existing manifest of %s %d in Redis (switching to Redis-commit mode)", kind, version)
        left = [(k, v, why) for k, v, why in counted.ignored if self.record(k, v) is None]
        if left:
            log.warning(
                "run %r: %d manifest(s) in %s are not on the run's chain and were NOT recorded (readers refuse them; "
                "inspect and delete them if nobody published them): %s",
                self.run,
                len(left),
                store.url,
                "; ".join(f"{k} {v}: {why}" for k, v, why in left[:10]) + (" …" if len(left) > 10 else ""),
            )
        with translate_redis_errors("set the commit mode"):
            self.client.set(self.mode_key, json.dumps({"via": "redis", "since_ms": self._since_ms(), "adopted": True}).encode())
        return left

    def _mode(self) -> dict[str, Any]:
        with translate_redis_errors("read the commit mode"):
            raw = self.client.get(self.mode_key)
        try:
            doc = json.loads(bytes(raw)) if raw is not None else {}
        except ValueError:
            doc = {}
        return doc if isinstance(doc, dict) else {}

    def _adopted(self) -> bool:
        """Whether the run's store-committed versions were recorded (a mode key from before the flag: yes)."""
        return self._mode().get("adopted", True) is not False

    def _since_ms(self) -> int:
        since = self._mode().get("since_ms")
        return since if isinstance(since, int) and not isinstance(since, bool) else int(time.time() * 1000)

    def complete(self, store: Store, verify_existing: bool = False) -> list[tuple[str, int]]:
        """Write, from their records, manifests the store lacks; returns the versions written.

        Why: a writer killed after its record landed and before its manifest
        write left a committed version without a manifest; its segments are
        in the store (they are written before the record). A writer calls
        this at start, so a resumed Trainer finds that version committed
        instead of conflicting with its record. ``verify_existing`` also
        reads every manifest that exists and rewrites the ones whose bytes
        differ from their record (a stray writer replaced them, or a write
        was torn): one capped read per version.

        A record whose manifest is absent at a version older than the newest
        manifest listed of its kind is history retention collected (its
        objects are gone too): it is not written back.
        """
        listed = set(_listed_manifests(store))
        newest: dict[str, int] = {}
        for kind, version in listed:
            newest[kind] = max(version, newest.get(kind, -1))
        done: list[tuple[str, int]] = []
        for kind, version in self._recorded():
            present = (kind, version) in listed
            if not present and version < newest.get(kind, -1):
                continue  # collected by retention, not a lost write
            rec = self.record(kind, version)
            if rec is None:
                continue
            if present and (not verify_existing or _digest(_stored_manifest(store, kind, version)) == rec.digest):
                continue
            store.put(manifest_key(kind, version), rec.manifest, mode="overwrite")
            log.warning(
                "%s %d: %s its manifest from the Redis commit record",
                kind,
                version,
                "rewrote" if present else "completed",
            )
            done.append((kind, version))
        return done

    def _recorded(self) -> list[tuple[str, int]]:
        pattern = glob_escape(self._prefix) + "commit:*"
        out: list[tuple[str, int]] = []
        with translate_redis_errors("list commit records"):
            for raw in self.client.scan_iter(match=pattern, count=500):
                name = (raw.decode() if isinstance(raw, bytes) else str(raw))[len(self._prefix) + len("commit:") :]
                kind, _, v = name.partition(":")
                if kind in _KINDS and v.isdigit():
                    out.append((kind, int(v)))
        return sorted(out, key=lambda kv: (kv[1], kv[0]))


def _parse_record(kind: str, version: int, raw: bytes, key: str) -> CommitRecord:
    if len(raw) > _MAX_RECORD_BYTES:
        raise CoordinationError(f"{key}: commit record of {len(raw)} bytes is larger than any manifest")
    head, sep, data = raw.partition(b"\n")
    digest = head.decode("ascii", "replace")
    if not sep or not digest.startswith("sha256:") or len(digest) != 71:
        raise CoordinationError(f"{key}: malformed commit record")
    if _digest(data) != digest:
        raise CoordinationError(f"{key}: commit record's manifest bytes do not match its digest (damaged)")
    return CommitRecord(kind, version, digest, data)


def _listed_manifests(store: Store) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for kind in _KINDS:
        for key in store.list(f"{kind}s"):
            parts = key.split("/")
            if len(parts) == 3 and parts[2] == "manifest.json":
                v = parse_version_dir(parts[1])
                if v is not None:
                    out.append((kind, v))
    return out


def commit_records_for(client: Any, run: str) -> RedisCommitLog | None:
    """The run's commit records if it is in Redis-commit mode, else None (readers: pass it to
    :func:`~aurora_store.lineage.fetch.read_manifest` / ``ManifestReader``)."""
    log_ = RedisCommitLog(client, run)
    return log_ if log_.enabled() else None


def prepare_commit(store: Store, client: Any, run: str | None, commit_via: str) -> Callable[[str, int, bytes], None] | None:
    """Everything a writer checks before its first publish; returns the ``commit`` callback.

    - ``commit_via="store"``: probe the store (:func:`~aurora_store.storage.probe.require_create_only`);
      refuse a store that does not honour create-only writes; None (publish as always).
    - ``"redis"``: needs ``client`` and ``run``; check Redis persists its data,
      put the run in Redis-commit mode, complete manifests whose write was
      lost, and return the callback that records each manifest first.

    Raises :class:`~aurora_store.errors.ConfigError` with one line naming
    the store or Redis and the way out.
    """
    if commit_via not in COMMIT_VIA:
        raise ConfigError(f"--commit-via must be one of {', '.join(COMMIT_VIA)}, got {commit_via!r}")
    if commit_via == "store":
        require_create_only(store)
        return None
    if client is None or not run:
        raise ConfigError("--commit-via redis needs --redis URL and --run NAME (the commit records live in the run's Redis)")
    how = require_persistence(client, run)
    commits = RedisCommitLog(client, run)
    commits.enable(store)
    done = commits.complete(store, verify_existing=True)
    log.info("run %r commits through Redis (persistence: %s)%s", run, how, f"; completed {done}" if done else "")
    return commits.publish_callback()
