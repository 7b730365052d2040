"""The object store: a run root on any fsspec URL, behind one small interface.

:class:`Store` (:mod:`~aurora_store.storage.base`) is the interface and the
create-only promise; one module per backend implements it:

- :mod:`~aurora_store.storage.local`: local files (``file://…`` or a plain
  path), temporary file + hard link;
- :mod:`~aurora_store.storage.s3`: S3 through s3fs, ``If-None-Match: *``;
- :mod:`~aurora_store.storage.memory`: ``memory://`` (tests and demos);
- :mod:`~aurora_store.storage.remote`: any other fsspec filesystem whose
  ``pipe_file`` supports ``mode="create"``.

:func:`open_store` picks the backend from the URL. Every backend passes the
conformance suite in :mod:`aurora_store.testing.store`.
"""

from __future__ import annotations

from typing import Any

from fsspec.utils import get_protocol

from aurora_store.clock import Clock
from aurora_store.storage.base import ENV_PREFIX, TEMP_PREFIX, Store, StoreConfig
from aurora_store.storage.local import LocalStore
from aurora_store.storage.memory import MemoryStore
from aurora_store.storage.remote import RemoteStore
from aurora_store.storage.s3 import S3Store

__all__ = [
    "Store",
    "StoreConfig",
    "open_store",
    "LocalStore",
    "S3Store",
    "MemoryStore",
    "RemoteStore",
    "ENV_PREFIX",
    "TEMP_PREFIX",
]

_BACKENDS: dict[str, type[Store]] = {
    "file": LocalStore,
    "local": LocalStore,
    "memory": MemoryStore,
    "s3": S3Store,
    "s3a": S3Store,
}


def open_store(
    url: str,
    storage_options: dict[str, Any] | None = None,
    config: StoreConfig | None = None,
    clock: Clock | None = None,
) -> Store:
    """A :class:`Store` for a run root URL (``s3://…``, ``file://…``, a path, ``memory://…``).

    ``storage_options`` go to fsspec; ``config`` defaults to
    :meth:`StoreConfig.from_env`; ``clock`` is what retries wait on.
    """
    backend = _BACKENDS.get(get_protocol(url), RemoteStore)
    return backend(url, storage_options, config, clock)
