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

import contextlib
import hashlib
import os
import threading
import uuid
from typing import Any

import fsspec

from .errors import ObjectNotFound, StoreError, VersionConflict

__all__ = ["Store", "open_store"]

_MEMORY_LOCK = threading.Lock()


def _protocol(fs: Any) -> str:
    p = fs.protocol
    return p[0] if isinstance(p, (tuple, list)) else p


class Store:
    """Objects under one run root, addressed by keys relative to it."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        opts = dict(storage_options or {})
        # fsspec caches filesystem instances globally; a fresh one per store
        # keeps credentials and event loops of different stores apart.
        opts.setdefault("skip_instance_cache", True)
        self.url = url
        self.fs, root = fsspec.core.url_to_fs(url, **opts)
        self.root = root.rstrip("/")
        self.protocol = _protocol(self.fs)

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
            self._pipe(path, data, "overwrite")
            return
        if self.protocol in ("file", "local"):
            self._put_local_exclusive(path, data)
        elif self.protocol == "memory":
            with _MEMORY_LOCK:
                if self.fs.exists(path):
                    self._same_or_conflict(key, data)
                    return
                self._pipe(path, data, "overwrite")
        else:
            try:
                self._pipe(path, data, "create")
            except FileExistsError:
                self._same_or_conflict(key, data)
            except OSError as e:
                # s3fs maps 412 Precondition Failed to a generic OSError on some versions.
                if "PreconditionFailed" in type(e).__name__ or getattr(e, "errno", None) == 412:
                    self._same_or_conflict(key, data)
                else:
                    raise StoreError(f"{self.where(key)}: write failed: {e}") from e

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
            return bytes(self.fs.cat_file(self._path(key)))
        except FileNotFoundError:
            raise ObjectNotFound(f"{self.where(key)}: no such object") from None

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        try:
            return bytes(self.fs.cat_file(self._path(key), start=start, end=stop))
        except FileNotFoundError:
            raise ObjectNotFound(f"{self.where(key)}: no such object") from None

    def exists(self, key: str) -> bool:
        return bool(self.fs.exists(self._path(key)))

    def size(self, key: str) -> int:
        try:
            return int(self.fs.size(self._path(key)))
        except FileNotFoundError:
            raise ObjectNotFound(f"{self.where(key)}: no such object") from None

    def list(self, prefix: str = "") -> list[str]:
        """Every key under ``prefix`` (recursively), sorted, relative to the root."""
        base = self._path(prefix.rstrip("/")) if prefix else self.root
        try:
            found = self.fs.find(base)
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

    def list_dirs(self, prefix: str) -> list[str]:
        """Names of the immediate sub-folders of ``prefix``."""
        try:
            entries = self.fs.ls(self._path(prefix.rstrip("/")), detail=True)
        except FileNotFoundError:
            return []
        return sorted(
            os.path.basename(e["name"].rstrip("/")) for e in entries if e.get("type") == "directory"
        )

    def delete(self, key: str) -> None:
        """Remove an object (garbage collection only)."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(key))


def open_store(url: str, storage_options: dict[str, Any] | None = None) -> Store:
    """A :class:`Store` for a run root URL (``s3://…``, ``file://…``, a path, ``memory://…``)."""
    return Store(url, storage_options)
