"""The object store: a run root on any fsspec URL, with a small verb set.

``put(key, data, mode="create")`` is the one write Aurora needs: nothing
under a committed version is ever rewritten, so immutability is a *write
mode*, not a check-then-write. Backends:

- local files (``file://`` or a plain path): the bytes go to a temporary file
  in the same folder, which is then hard-linked to its name; ``link`` fails
  if the name exists, so a reader never sees a partial object and two writers
  cannot both win;
- ``s3://`` (s3fs): ``PutObject`` with ``If-None-Match: *``;
- ``memory://`` (unit tests only): a process-wide lock around exists + write.

When a create finds the key taken, the existing object is read back: the
same bytes mean our own earlier attempt succeeded (a retry whose first answer
was lost); different bytes raise :class:`VersionConflict`.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import fsspec

from aurora_store.errors import ConfigError, ObjectNotFound, StoreError, VersionConflict

__all__ = ["StoreConfig", "Store", "open_store"]

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Retries, timeouts and connection counts of a store.

    Every field has an environment variable (``AURORA_STORE_<FIELD>``, upper
    case) read by :meth:`from_env`; arguments win over the environment.
    """

    retries: int = 5
    """Attempts per operation after the first, for transient failures."""
    backoff_s: float = 0.2
    """First retry delay; doubles each attempt, with jitter."""
    backoff_max_s: float = 10.0
    """Cap on one retry delay."""
    connect_timeout_s: float = 10.0
    """TCP/TLS connect timeout (S3)."""
    read_timeout_s: float = 60.0
    """Timeout of one read on a socket (S3)."""
    max_connections: int = 32
    """Connection pool size (S3); at least the stream count you use."""

    def __post_init__(self) -> None:
        if self.retries < 0 or self.backoff_s < 0 or self.backoff_max_s < 0:
            raise ConfigError(f"StoreConfig: retries and backoff must be >= 0 ({self})")
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0 or self.max_connections < 1:
            raise ConfigError(f"StoreConfig: timeouts and max_connections must be positive ({self})")

    @classmethod
    def from_env(cls, **overrides: Any) -> StoreConfig:
        kw: dict[str, Any] = {}
        for f in cls.__dataclass_fields__.values():
            raw = os.environ.get(f"AURORA_STORE_{f.name.upper()}")
            if raw is not None:
                try:
                    kw[f.name] = int(raw) if f.type in ("int", int) else float(raw)
                except ValueError:
                    raise ConfigError(f"AURORA_STORE_{f.name.upper()}={raw!r} is not a number") from None
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)


def _transient(e: BaseException) -> bool:
    """Worth retrying: network trouble and server-side errors, not answers."""
    if isinstance(e, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError, ValueError)):
        return False
    return isinstance(e, (OSError, TimeoutError, ConnectionError))

_MEMORY_LOCK = threading.Lock()


def _protocol(fs: Any) -> str:
    p = fs.protocol
    return p[0] if isinstance(p, (tuple, list)) else p


class Store:
    """Objects under one run root, addressed by keys relative to it."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, config: StoreConfig | None = None) -> None:
        self.config = config or StoreConfig.from_env()
        opts = dict(storage_options or {})
        # fsspec caches filesystem instances globally; a fresh one per store
        # keeps credentials and event loops of different stores apart.
        opts.setdefault("skip_instance_cache", True)
        if url.startswith(("s3://", "s3a://")):
            ck = dict(opts.pop("config_kwargs", {}) or {})
            ck.setdefault("connect_timeout", self.config.connect_timeout_s)
            ck.setdefault("read_timeout", self.config.read_timeout_s)
            ck.setdefault("max_pool_connections", self.config.max_connections)
            opts["config_kwargs"] = ck
            # Other processes write the run: a cached listing would hide their versions.
            opts.setdefault("use_listings_cache", False)
            # s3fs's default (10) turns every whole-object get into HEAD + ranged
            # GETs: an extra round trip per segment. We stripe across objects
            # ourselves (PublishConfig.streams), so one request per object.
            opts.setdefault("max_concurrency", 1)
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            if endpoint and "endpoint_url" not in opts.get("client_kwargs", {}):
                opts.setdefault("client_kwargs", {})["endpoint_url"] = endpoint
        self.url = url
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **opts)
        except (ImportError, ValueError, TypeError) as e:
            raise ConfigError(f"cannot open store {url!r}: {e}") from None
        self.root = root.rstrip("/")
        self.protocol = _protocol(self.fs)
        if hasattr(self.fs, "retries"):
            # We retry whole operations ourselves, with backoff; keep s3fs's own short.
            self.fs.retries = 2

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn``, retrying transient failures with jittered exponential backoff."""
        delay = self.config.backoff_s
        for attempt in range(self.config.retries + 1):
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - classified right below
                if not _transient(e) or attempt == self.config.retries:
                    if _transient(e):
                        raise StoreError(f"{what}: failed after {attempt + 1} attempts: {type(e).__name__}: {e}") from e
                    raise
                log.warning("%s: %s: %s (retry %d/%d)", what, type(e).__name__, e, attempt + 1, self.config.retries)
                time.sleep(min(self.config.backoff_max_s, delay) * (0.5 + random.random()))
                delay *= 2
        raise AssertionError("unreachable")

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    # ------------------------------------------------------------------
    def _path(self, key: str) -> str:
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"store key {key!r} must be relative and stay under the run root")
        return f"{self.root}/{key}" if self.root else key

    def where(self, key: str) -> str:
        """A human-readable name for ``key`` (URL of the object)."""
        return f"{self.url.rstrip('/')}/{key}"

    def put(self, key: str, data: bytes, mode: str = "create") -> None:
        """Write an object. ``mode="create"`` never replaces different bytes."""
        if mode not in ("create", "overwrite"):
            raise ValueError(f"mode must be 'create' or 'overwrite', got {mode!r}")
        path = self._path(key)
        if mode == "overwrite":
            self._retry(f"put {self.where(key)}", lambda: self._pipe(path, data, "overwrite"))
            return
        if self.protocol in ("file", "local"):
            self._retry(f"put {self.where(key)}", lambda: self._put_local_exclusive(path, data))
        elif self.protocol == "memory":
            with _MEMORY_LOCK:
                if self.fs.exists(path):
                    self._same_or_conflict(key, data)
                    return
                self._pipe(path, data, "overwrite")
        else:
            try:
                # A retry after a lost answer meets our own object: 412, then
                # the read-back below finds the same bytes.
                self._retry(f"put {self.where(key)}", lambda: self._pipe(path, data, "create"))
            except FileExistsError:  # s3fs's translation of 412 Precondition Failed
                self._same_or_conflict(key, data)

    def _pipe(self, path: str, data: bytes, mode: str) -> None:
        if mode == "create":
            self.fs.pipe_file(path, data, mode="create")
        else:
            self.fs.pipe_file(path, data)

    def _put_local_exclusive(self, path: str, data: bytes) -> None:
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".tmp-{uuid.uuid4().hex}")
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            self._same_or_conflict(os.path.relpath(path, self.root) if self.root else path, data)
        finally:
            os.unlink(tmp)

    def _same_or_conflict(self, key: str, data: bytes) -> None:
        have = self.get(key)
        if hashlib.sha256(have).digest() != hashlib.sha256(data).digest():
            raise VersionConflict(self.where(key))

    # ------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        try:
            return self._retry(f"get {self.where(key)}", lambda: bytes(self.fs.cat_file(self._path(key))))
        except FileNotFoundError:
            raise ObjectNotFound(f"{self.where(key)}: no such object") from None

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` of an object."""
        if not 0 <= start <= stop:
            raise ValueError(f"bad range [{start}, {stop})")
        try:
            return self._retry(f"get {self.where(key)}", lambda: bytes(self.fs.cat_file(self._path(key), start=start, end=stop)))
        except FileNotFoundError:
            raise ObjectNotFound(f"{self.where(key)}: no such object") from None

    def exists(self, key: str) -> bool:
        return self._retry(f"exists {self.where(key)}", lambda: bool(self.fs.exists(self._path(key))))

    def size(self, key: str) -> int:
        try:
            return int(self.fs.size(self._path(key)))
        except FileNotFoundError:
            raise ObjectNotFound(f"{self.where(key)}: no such object") from None

    def modified(self, key: str) -> float | None:
        """Last-modified time (POSIX seconds), when the backend reports one."""
        try:
            info = self._retry(f"info {self.where(key)}", lambda: self.fs.info(self._path(key)))
        except FileNotFoundError:
            return None
        for f in ("LastModified", "mtime", "created"):
            t = info.get(f)
            if t is None:
                continue
            return float(t.timestamp()) if hasattr(t, "timestamp") else float(t)
        return None

    def list(self, prefix: str = "") -> list[str]:
        """Every key under ``prefix`` (recursively), sorted, relative to the root."""
        base = self._path(prefix.rstrip("/")) if prefix else self.root
        try:
            found = self._retry(f"list {self.where(prefix)}", lambda: self.fs.find(base))
        except FileNotFoundError:
            return []
        root = self.root + "/" if self.root else ""
        out = []
        for p in found:
            p = p if not root or p.startswith(root) else "/" + p  # memory:// paths come back rooted
            rel = p[len(root) :] if root and p.startswith(root) else p
            if os.path.basename(rel).startswith(".tmp-"):
                continue
            out.append(rel)
        return sorted(out)

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        """Names of the immediate sub-folders of ``prefix``."""
        try:
            entries = self._retry(f"list {self.where(prefix)}", lambda: self.fs.ls(self._path(prefix.rstrip("/")), detail=True))
        except FileNotFoundError:
            return []
        return sorted(
            os.path.basename(e["name"].rstrip("/")) for e in entries if e.get("type") == "directory"
        )

    def delete(self, key: str) -> None:
        """Remove an object (garbage collection only)."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(key))


def open_store(url: str, storage_options: dict[str, Any] | None = None, config: StoreConfig | None = None) -> Store:
    """A :class:`Store` for a run root URL (``s3://…``, ``file://…``, a path, ``memory://…``)."""
    return Store(url, storage_options, config)
