"""Hashes with one field per (who, version), trimmed to their newest versions.

The weight digests and activation timings workers publish
(``digest:trainer``, ``digest:actors``, ``activations``; docs/WORKERS.md)
would grow by a field per version per Actor for the whole run. Each write
here also scores the field by its version in a zset beside the hash
(:meth:`~aurora_store.coordination.keys.RunKeys.index`) and, in the same
script, deletes the fields older than the newest ``keep`` versions, so the
hash stays a plain hash its readers ``HGETALL`` while its size stays bounded.
"""

from __future__ import annotations

from typing import Any

from aurora_store.coordination.keys import RunKeys
from aurora_store.coordination.ledger.core import LedgerConfig
from aurora_store.coordination.ledger.scripts import RECORD_VERSIONED
from aurora_store.coordination.redisconn import translate_redis_errors

__all__ = ["record_versioned", "default_keep_versions"]


def default_keep_versions() -> int:
    """``AURORA_LEDGER_KEEP_VERSIONS`` (default 1000): versions a per-version hash keeps."""
    return LedgerConfig.from_env().keep_versions


@translate_redis_errors("record_versioned")
def record_versioned(redis: Any, keys: RunKeys, key: str, field: str, value: Any, version: int, keep: int | None = None) -> int:
    """``HSET key field value``, indexed by ``version``; trims to the newest ``keep`` versions (0: all).

    Returns the number of fields trimmed. ``keep`` None: :func:`default_keep_versions`.
    """
    n = default_keep_versions() if keep is None else keep
    return int(redis.register_script(RECORD_VERSIONED)(keys=[key, keys.index(key)], args=[field, value, int(version), int(n)]))
