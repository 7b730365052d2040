"""Any other fsspec filesystem: create with the filesystem's conditional write.

``pipe_file(path, data, mode="create")`` asks the server itself to refuse
the write if the key exists (S3's ``PutObject`` with ``If-None-Match: *``);
the filesystem reports that as ``FileExistsError``. A retry after a lost
answer meets our own object that way, and the read-back of
:meth:`~aurora_store.storage.base.Store._same_or_conflict` finds the same
bytes.
"""

from __future__ import annotations

from aurora_store.storage.base import Store

__all__ = ["RemoteStore"]


class RemoteStore(Store):
    """A run root on an fsspec filesystem that supports ``mode="create"``."""

    def _create(self, key: str, path: str, data: bytes) -> None:
        try:
            self._retry(f"put {self.where(key)}", lambda: self.fs.pipe_file(path, self.upload_body(data), mode="create", **self._deadline))
        except FileExistsError:
            self._same_or_conflict(key, data)
