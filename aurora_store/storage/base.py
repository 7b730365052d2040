"""The object store interface: a run root with a small verb set.

``put(key, data, mode="create")`` is the one write Aurora needs: nothing
under a committed version is ever rewritten, so immutability is a *write
mode*, not a check-then-write. Each backend (one module each: local files,
S3, memory, any other fsspec filesystem) implements :meth:`Store._create`,
the create-only write, with whatever its filesystem offers to make it atomic;
everything else is shared here over the backend's fsspec filesystem.

The promise every backend keeps: no reader observes a partially written
object, and of two writers creating one key at most one wins. When a create
finds the key taken, the existing object is read back: the same bytes mean
our own earlier attempt succeeded (a retry whose first answer was lost);
different bytes raise :class:`~aurora_store.errors.VersionConflict`.

Public methods own the guards (key validation, retries, turning "no such
file" into :class:`~aurora_store.errors.ObjectNotFound`); backends translate
their library's errors in :meth:`Store._call`, once.
"""

from __future__ import annotations

import abc
import builtins
import contextlib
import hashlib
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import fsspec

from aurora_store import config as config_env
from aurora_store.clock import SYSTEM_CLOCK, Clock
from aurora_store.config import Backoff
from aurora_store.errors import (
    AuroraError,
    ConfigError,
    ObjectNotFound,
    ObjectTooLarge,
    StoreUnavailable,
    VersionConflict,
)

__all__ = ["StoreConfig", "Store", "CallBudget", "RangeNotSatisfiable", "TEMP_PREFIX", "ENV_PREFIX"]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Environment variables of :class:`StoreConfig`: ``AURORA_STORE_<FIELD>``.
ENV_PREFIX = "AURORA_STORE_"
#: Objects whose name starts with this are a writer's temporary files: never
#: listed, never a key a reader asks for.
TEMP_PREFIX = ".tmp-"


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
    op_timeout_s: float = 600.0
    """Deadline of one whole request on an asynchronous backend (S3). The read timeout
    covers reads only: an upload into a server that accepted the connection and then
    stalled (paused, overloaded) would otherwise wait for ever. Large enough for the
    biggest object on the slowest link you run on."""

    def __post_init__(self) -> None:
        if self.retries < 0 or self.backoff_s < 0 or self.backoff_max_s < 0:
            raise ConfigError(f"StoreConfig: retries and backoff must be >= 0 ({self})")
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0 or self.max_connections < 1 or self.op_timeout_s <= 0:
            raise ConfigError(f"StoreConfig: timeouts and max_connections must be positive ({self})")

    @classmethod
    def from_env(cls, **overrides: Any) -> StoreConfig:
        """Defaults, then ``AURORA_STORE_*``, then ``overrides`` (``None`` means not given)."""
        return config_env.from_env(cls, ENV_PREFIX, **overrides)

    @property
    def backoff(self) -> Backoff:
        """The retry delays: from ``backoff_s``, doubling, capped at ``backoff_max_s``."""
        return Backoff(initial_s=min(self.backoff_s, self.backoff_max_s), max_s=self.backoff_max_s, factor=2.0)


def transient(e: BaseException) -> bool:
    """Worth retrying: network trouble and server-side errors, not answers.

    An :class:`~aurora_store.errors.AuroraError` is already an answer (a
    backend translated it, or an inner retry gave up), so it is never retried.
    """
    if isinstance(e, AuroraError):
        return False
    if isinstance(
        e,
        (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError, ValueError),
    ):
        return False
    return isinstance(e, (OSError, TimeoutError, ConnectionError))


class RangeNotSatisfiable(ValueError):
    """A backend's answer to a range that starts at or past the end of the object (HTTP 416).

    S3 answers a ranged GET of an empty object this way; :meth:`Store.get_range` turns it
    into the empty bytes a slice past the end gives. A ``ValueError``: never retried.
    """


def _as_bytes(data: Any) -> bytes:
    """``data`` as ``bytes``, copied only when it is not bytes already (a manifest is read once, not twice)."""
    return data if type(data) is bytes else bytes(data)


class CallBudget:
    """A deadline shared by every call a store makes while it is armed: the bound on one
    attempt at something spread over many requests (a version read from a mirror).

    Why: a store's own bound is per request (its timeouts, times its retries); a mirror that
    answers slowly, or with errors, would cost that for every object of a version. Armed, each
    call checks the time left before it starts, and an asynchronous backend's request is cut
    at it (:attr:`Store._deadline`); spent, calls raise
    :class:`~aurora_store.errors.StoreUnavailable` at once. Thread-safe: one thread arms it,
    the store's download threads read it.
    """

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock: Clock = clock or SYSTEM_CLOCK
        self._until: float | None = None
        self._seconds = 0.0

    def arm(self, seconds: float) -> None:
        """From now, calls have ``seconds`` in all."""
        self._seconds = seconds
        self._until = self.clock.monotonic() + seconds

    def disarm(self) -> None:
        """Calls are bounded by the store's own timeouts only."""
        self._until = None

    @contextlib.contextmanager
    def armed(self, seconds: float) -> Any:
        """:meth:`arm` for the length of a ``with`` block."""
        self.arm(seconds)
        try:
            yield self
        finally:
            self.disarm()

    def left(self) -> float | None:
        """Seconds left (0 or less: spent); None when not armed."""
        until = self._until
        return None if until is None else until - self.clock.monotonic()

    @property
    def seconds(self) -> float:
        """What the last :meth:`arm` gave."""
        return self._seconds


def protocol_of(fs: Any) -> str:
    """The main protocol name of an fsspec filesystem (``"file"``, ``"s3"`` …)."""
    p = fs.protocol
    return str(p[0] if isinstance(p, (tuple, list)) else p)


class Store(abc.ABC):
    """Objects under one run root, addressed by keys relative to it.

    Open one with :func:`aurora_store.storage.open_store`, which picks the
    backend from the URL. ``fs`` (the fsspec filesystem) and ``root`` (the
    run root's path on it) are public for tools that clean up after a run.
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        config: StoreConfig | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.url = url
        self.config = config or StoreConfig.from_env()
        self.clock: Clock = clock or SYSTEM_CLOCK
        opts = dict(storage_options or {})
        # fsspec caches filesystem instances globally; a fresh one per store
        # keeps credentials and event loops of different stores apart.
        opts.setdefault("skip_instance_cache", True)
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **self._options(opts))
        except (ImportError, ValueError, TypeError) as e:
            from aurora_store.redact import redact_text, redact_url

            raise ConfigError(f"cannot open store {redact_url(url)!r}: {redact_text(str(e))}") from None
        self.root = root.rstrip("/")
        self.protocol = protocol_of(self.fs)
        self._never = threading.Event()  # waited on for back-off delays; never set
        self.budget: CallBudget | None = None
        """A deadline over many calls (a mirror's time for one version), when one is set."""

    def _options(self, opts: dict[str, Any]) -> dict[str, Any]:
        """The fsspec options this backend opens its filesystem with."""
        return opts

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    # ------------------------------------------------------------------
    # The backend's part

    @abc.abstractmethod
    def _create(self, key: str, path: str, data: bytes) -> None:
        """Write ``data`` at ``path`` only if nothing is there, atomically.

        Calls :meth:`_same_or_conflict` when the key is taken; retries its own
        transient failures (:meth:`_retry`).
        """

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """One call into the backend's library. Backends whose library raises
        its own exception classes translate them here: into builtin
        ``FileNotFoundError``/``FileExistsError`` (which the verbs turn into
        answers), ``ConnectionError``/``TimeoutError`` (retried), or an
        :class:`~aurora_store.errors.StoreError`."""
        return fn()

    # ------------------------------------------------------------------
    # Shared machinery

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn``, retrying transient failures with the config's back-off."""
        delays = self.config.backoff.delays()
        for attempt in range(self.config.retries + 1):
            self._check_budget(what)
            try:
                return self._call(what, fn)
            except Exception as e:  # noqa: BLE001 - classified right below
                if not transient(e):
                    raise
                if attempt == self.config.retries:
                    raise StoreUnavailable(f"{what}: failed after {attempt + 1} attempts: {type(e).__name__}: {e}") from e
                log.debug("%s: %s: %s (retry %d/%d)", what, type(e).__name__, e, attempt + 1, self.config.retries)
                self.clock.wait(self._never, next(delays))
        raise AssertionError("unreachable")

    def _check_budget(self, what: str) -> None:
        """Raise :class:`~aurora_store.errors.StoreUnavailable` when the armed :attr:`budget` is spent."""
        left = self.budget.left() if self.budget is not None else None
        if left is not None and left <= 0:
            assert self.budget is not None
            raise StoreUnavailable(f"{what}: no answer within {self.budget.seconds:g}s")

    @property
    def _deadline(self) -> dict[str, float]:
        """Keyword arguments that bound one call of an asynchronous fsspec filesystem
        (fsspec's ``sync`` takes ``timeout``, cancels the request and raises a
        ``TimeoutError``, which is retried); nothing for a synchronous one. An armed
        :attr:`budget` shortens it to the time left."""
        if not getattr(self.fs, "async_impl", False):
            return {}
        left = self.budget.left() if self.budget is not None else None
        return {"timeout": self.config.op_timeout_s if left is None else max(0.001, min(self.config.op_timeout_s, left))}

    def _path(self, key: str) -> str:
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"store key {key!r} must be relative and stay under the run root")
        return f"{self.root}/{key}" if self.root else key

    def _same_or_conflict(self, key: str, data: bytes) -> None:
        """The create of ``key`` found an object: fine if it holds ``data``.

        Read capped one byte past ``len(data)``: an object planted there may be of any size,
        and one larger than ours is not ours.
        """
        try:
            have = self.get_capped(key, len(data))
        except ObjectTooLarge:
            raise VersionConflict(self.where(key)) from None
        if hashlib.sha256(have).digest() != hashlib.sha256(data).digest():
            raise VersionConflict(self.where(key))

    def upload_body(self, data: bytes) -> Any:
        """What the filesystem's ``pipe_file`` is given to write ``data`` (one per attempt): ``data`` itself
        here; a backend whose client would copy it whole says otherwise (:class:`~aurora_store.storage.s3.S3Store`)."""
        return data

    def _missing(self, key: str) -> ObjectNotFound:
        return ObjectNotFound(f"{self.where(key)}: no such object")

    # ------------------------------------------------------------------
    # Verbs

    def where(self, key: str) -> str:
        """A human-readable name for ``key`` (URL of the object)."""
        return f"{self.url.rstrip('/')}/{key}"

    def put(self, key: str, data: bytes, mode: str = "create") -> None:
        """Write an object. ``mode="create"`` never replaces different bytes."""
        if mode not in ("create", "overwrite"):
            raise ValueError(f"mode must be 'create' or 'overwrite', got {mode!r}")
        path = self._path(key)
        if mode == "overwrite":
            self._retry(f"put {self.where(key)}", lambda: self.fs.pipe_file(path, self.upload_body(data), **self._deadline))
            return
        self._create(key, path, data)

    def get(self, key: str) -> bytes:
        """The whole object, whatever its size: only for objects this process wrote or trusts.

        Anything another writer (or a mirror) could have put there is read with
        :meth:`get_capped`.
        """
        path = self._path(key)
        try:
            return self._retry(f"get {self.where(key)}", lambda: _as_bytes(self.fs.cat_file(path, **self._deadline)))
        except FileNotFoundError:
            raise self._missing(key) from None

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` of an object (fewer past its end, like a slice).

        One ranged request: S3 sends only the range; a local file is read from
        ``start`` for at most ``stop - start`` bytes.
        """
        if not 0 <= start <= stop:
            raise ValueError(f"bad range [{start}, {stop})")
        if start == stop:
            return b""
        path = self._path(key)
        try:
            return self._retry(f"get {self.where(key)}", lambda: self._read_range(path, start, stop))
        except FileNotFoundError:
            raise self._missing(key) from None
        except RangeNotSatisfiable:
            return b""  # the object ends before ``start`` (an empty object, on S3)

    def _read_range(self, path: str, start: int, stop: int) -> bytes:
        """One attempt at bytes ``[start, stop)`` of ``path``; a backend whose server could send
        more than it was asked for (S3) reads no more than that from the wire."""
        return _as_bytes(self.fs.cat_file(path, start=start, end=stop, **self._deadline))

    def get_capped(self, key: str, limit: int, what: str = "") -> bytes:
        """The whole object, refused if it holds more than ``limit`` bytes.

        Why: every object is untrusted, and its size is known before it is read
        (a manifest's limit, the size its manifest lists). It is read as one range
        of ``limit + 1`` bytes, so an object of any size costs at most that much
        memory and transfer, and the byte past the limit proves it too large.
        Raises :class:`~aurora_store.errors.ObjectTooLarge` (naming the object,
        the limit and ``what`` the limit is) or :class:`~aurora_store.errors.ObjectNotFound`.
        """
        if limit < 0:
            raise ValueError(f"limit {limit} must be >= 0")
        data = self.get_range(key, 0, limit + 1)
        if len(data) > limit:
            raise ObjectTooLarge(self.where(key), limit, what)
        return data

    def exists(self, key: str) -> bool:
        path = self._path(key)
        return self._retry(f"exists {self.where(key)}", lambda: bool(self.fs.exists(path, **self._deadline)))

    def size(self, key: str) -> int:
        path = self._path(key)
        self._check_budget(f"size {self.where(key)}")
        try:
            return int(self._call(f"size {self.where(key)}", lambda: self.fs.size(path, **self._deadline)))
        except FileNotFoundError:
            raise self._missing(key) from None

    def modified(self, key: str) -> float | None:
        """Last-modified time (POSIX seconds), when the backend reports one."""
        path = self._path(key)
        try:
            info = self._retry(f"info {self.where(key)}", lambda: self.fs.info(path, **self._deadline))
        except FileNotFoundError:
            return None
        for f in ("LastModified", "mtime", "created"):
            t = info.get(f)
            if t is None:
                continue
            return float(t.timestamp()) if hasattr(t, "timestamp") else float(t)
        return None

    def list(self, prefix: str = "") -> builtins.list[str]:
        """Every key under ``prefix`` (recursively), sorted, relative to the root.

        Temporary files (:data:`TEMP_PREFIX`) are never listed.
        """
        base = self._path(prefix.rstrip("/")) if prefix else self.root
        try:
            found = self._retry(f"list {self.where(prefix)}", lambda: self.fs.find(base, **self._deadline))
        except FileNotFoundError:
            return []
        root = self.root + "/" if self.root else ""
        out = []
        for p in found:
            p = p if not root or p.startswith(root) else "/" + p  # memory:// paths come back rooted
            rel = p[len(root) :] if root and p.startswith(root) else p
            if os.path.basename(rel).startswith(TEMP_PREFIX):
                continue
            out.append(rel)
        return sorted(out)

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        """Names of the immediate sub-folders of ``prefix``."""
        path = self._path(prefix.rstrip("/"))
        try:
            entries = self._retry(f"list {self.where(prefix)}", lambda: self.fs.ls(path, detail=True, **self._deadline))
        except FileNotFoundError:
            return []
        return sorted(os.path.basename(e["name"].rstrip("/")) for e in entries if e.get("type") == "directory")

    def delete(self, key: str) -> None:
        """Remove an object (garbage collection only); a missing one is fine."""
        path = self._path(key)
        with contextlib.suppress(FileNotFoundError):
            self._call(f"delete {self.where(key)}", lambda: self.fs.rm_file(path, **self._deadline))
