"""Does this store honour create-only writes? Ask it, once per run root and process.

Why: every Aurora version is committed by a create-only manifest write
(FORMAT.md §1). On AWS S3, MinIO, moto and local files a second create of a
key is refused; some S3-compatible servers (``rclone serve s3``, older
gateways) silently ignore ``If-None-Match: *`` and overwrite, so a second,
different publish of a version would replace its manifest and nobody would
notice. A writer therefore probes the store before it publishes and
refuses to publish where the promise does not hold, unless it commits
through Redis instead (FORMAT §1, Redis-commit mode;
:mod:`aurora_store.coordination.commit`).

The probe writes one small key under the run root,
``.aurora/probe/<random>``, create-only, then writes *different* bytes to
the same key, create-only again. A store that honours create-only refuses
the second write (:class:`~aurora_store.errors.VersionConflict` after the
read-back); one that ignores the condition accepts it. A server that
rejects the conditional request outright (an error answer, not a 412) does
not honour it either. The key is deleted afterwards (best effort; garbage
collection ignores ``.aurora/``).

The answer is cached in this process per store URL: a Trainer probes once
at start, a CLI command once per invocation (four small requests). It is
never read from the store itself: a cached "yes" planted in the bucket
would turn the check off.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from dataclasses import dataclass

from aurora_store.errors import (
    AuroraError,
    ConfigError,
    ObjectNotFound,
    StoreError,
    StoreUnavailable,
    VersionConflict,
)
from aurora_store.storage.base import Store

__all__ = [
    "COMMIT_VIA",
    "CreateOnly",
    "PROBE_PREFIX",
    "probe_create_only",
    "require_create_only",
    "forget_probes",
    "COMMIT_MARKER_KEY",
    "write_commit_marker",
    "read_commit_marker",
]

log = logging.getLogger("aurora.store")

#: Where probe keys go, relative to the run root (never a version folder).
PROBE_PREFIX = ".aurora/probe/"
#: Store marker of a run in Redis-commit mode (FORMAT §1): advisory, for readers without Redis.
COMMIT_MARKER_KEY = ".aurora/commit.json"
#: How a writer may commit versions: the store's create-only write, or Redis (FORMAT §1).
COMMIT_VIA = ("store", "redis")

_cache: dict[str, CreateOnly] = {}
_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class CreateOnly:
    """What the probe found."""

    store: str
    """The run root's URL."""
    honoured: bool
    """True when a second, different create of one key was refused."""
    detail: str
    """One line: what the server did with the second write."""


def probe_create_only(store: Store, *, refresh: bool = False) -> CreateOnly:
    """Whether ``store`` refuses a second, different create of one key (cached per URL).

    Raises :class:`~aurora_store.errors.StoreUnavailable` when the store
    cannot be reached (after its retries), and the store's own
    :class:`~aurora_store.errors.StoreError` when even a plain write is
    refused (access denied): then nothing can be published anyway, and the
    caller reports that error.
    """
    with _lock:
        hit = _cache.get(store.url)
    if hit is not None and not refresh:
        return hit
    token = uuid.uuid4().hex
    key = f"{PROBE_PREFIX}{token}"
    try:
        try:
            store.put(key, f"aurora create-only probe {token} first\n".encode(), mode="create")
        except StoreUnavailable:
            raise
        except StoreError as e:
            # An answer, not an outage. If a plain write of the key works, the server refuses
            # the conditional write itself (400 / 501 for an unknown header): publishing
            # create-only cannot work there. If it does not, no write works (access denied):
            # say that instead.
            try:
                store.put(key, b"aurora create-only probe (plain write)\n", mode="overwrite")
            except StoreError:
                raise e from None
            out = CreateOnly(store.url, False, f"the server refuses a create-only write ({e})")
        else:
            try:
                store.put(key, f"aurora create-only probe {token} second\n".encode(), mode="create")
            except VersionConflict:
                out = CreateOnly(store.url, True, "a second create of the probe key was refused")
            else:
                out = CreateOnly(store.url, False, "a second, different create of the probe key replaced the first")
    finally:
        try:
            store.delete(key)
        except (AuroraError, OSError) as e:  # a leftover probe key is harmless
            log.debug("could not delete the probe key %s: %s", store.where(key), e)
    with _lock:
        _cache[store.url] = out
    log.info("store %s: create-only writes %s (%s)", store.url, "honoured" if out.honoured else "NOT honoured", out.detail)
    return out


def forget_probes() -> None:
    """Drop every cached probe answer (tests; a process that was told its store changed)."""
    with _lock:
        _cache.clear()


def require_create_only(store: Store, commit_via: str = "store") -> CreateOnly | None:
    """Before publishing: the probe's answer, or :class:`~aurora_store.errors.ConfigError` (one line).

    ``commit_via="redis"`` skips the probe (the Redis record is the commit
    point; the caller checks Redis) and returns None. With ``"store"``, a
    store that does not honour create-only writes is refused with a message
    naming it and the way out.
    """
    if commit_via not in COMMIT_VIA:
        raise ConfigError(f"--commit-via must be one of {', '.join(COMMIT_VIA)}, got {commit_via!r}")
    if commit_via == "redis":
        return None
    found = probe_create_only(store)
    if not found.honoured:
        raise ConfigError(
            f"{store.url} does not honour create-only writes ({found.detail}): publishing there could "
            "silently replace a committed version; use a store with conditional writes (AWS S3, MinIO, local "
            "files), or commit through Redis with --commit-via redis --redis URL --run NAME"
        )
    return found


def write_commit_marker(store: Store, run: str) -> None:
    """Mark the run root as committed through Redis (``.aurora/commit.json``).

    Advisory: anyone who can write the store can remove it, so a reader
    that has the run's Redis asks Redis (its ``commit-mode`` key) instead;
    the marker lets a reader *without* Redis (``aurora verify URL``) say
    that it cannot check this run's manifests against their records.
    """
    data = json.dumps({"commit_via": "redis", "run": run}, sort_keys=True).encode() + b"\n"
    store.put(COMMIT_MARKER_KEY, data, mode="overwrite")


def read_commit_marker(store: Store) -> str | None:
    """The run name of the store's Redis-commit marker, or None when the run commits in the store."""
    try:
        raw = store.get_range(COMMIT_MARKER_KEY, 0, 4096)  # a few dozen bytes; never more than this read
    except ObjectNotFound:
        return None
    try:
        got = json.loads(raw)
    except ValueError:
        return "?"
    run = got.get("run") if isinstance(got, dict) and got.get("commit_via") == "redis" else None
    return str(run) if run is not None else None
