"""S3 (``s3://…``, ``s3a://…``) through s3fs: create with ``If-None-Match: *``.

The create-only write is :class:`~aurora_store.storage.remote.RemoteStore`'s
(``PutObject`` with ``If-None-Match: *``; ``412 Precondition Failed``
arrives as ``FileExistsError``, whatever the body of the answer says). This module adds what is S3's own: the
client's timeouts and pool size from :class:`~aurora_store.storage.base.StoreConfig`,
no listing cache (other processes write the run), one request per object,
the ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` endpoint, and the one
place where botocore's and s3fs's errors become Aurora's.
"""

from __future__ import annotations

import functools
import io
import os
from collections.abc import Callable
from typing import Any, TypeVar

from aurora_store.clock import Clock
from aurora_store.errors import StoreError
from aurora_store.storage.base import RangeNotSatisfiable, StoreConfig
from aurora_store.storage.remote import RemoteStore

__all__ = ["S3Store", "SharedBody"]

T = TypeVar("T")


class SharedBody:
    """A request body that reads ``data`` where it is: no copy of the object is made to send it.

    Why: botocore wraps a ``bytes`` body in ``io.BytesIO`` (which shares the
    bytes), and aiohttp (3.12 to at least 3.14) measures a ``BytesIO`` body
    with ``getbuffer()``, which makes the ``BytesIO`` copy the shared bytes
    first (the copy aiohttp once avoided, aio-libs/aiohttp#2129). Every PUT
    then held its object twice until it was sent: measured with 8 uploads of
    32 MiB at once to ``rclone serve s3``, 514 MiB over the baseline instead of
    the 256 MiB of data, and a Trainer's snapshot and checkpoint uploads run
    while it trains.

    To botocore this is a seekable file object (it takes the length from
    ``len()`` and reads it to compute a checksum where one is asked for); to
    s3fs's multipart upload it slices like bytes (each slice a view); to
    aiohttp it is sent by :func:`_payload_type`'s payload, as views of ``data``
    written straight to the connection. Not an ``io.IOBase`` on purpose: a
    file object would be read 256 KiB at a time on aiohttp's thread pool, and
    each piece's trip through the GIL stalls behind a training thread (a
    checkpoint's upload took four times as long beside the Trainer's steps).
    Read only: nothing is ever written through it.
    """

    def __init__(self, data: bytes | memoryview) -> None:
        _payload_type()
        self.view = memoryview(data).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def __len__(self) -> int:
        return len(self.view)

    def __getitem__(self, part: slice) -> SharedBody:
        if not isinstance(part, slice) or part.step not in (None, 1):
            raise TypeError("a request body is sliced only as [start:stop]")
        return SharedBody(self.view[part])

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence not in (io.SEEK_SET, io.SEEK_CUR, io.SEEK_END):
            raise ValueError(f"invalid whence {whence!r}")
        at = offset + (0 if whence == io.SEEK_SET else self._pos if whence == io.SEEK_CUR else len(self.view))
        if at < 0:
            raise ValueError(f"negative seek position {at}")
        self._pos = at
        return at

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = max(0, min(len(out), len(self.view) - self._pos))
        out[:n] = self.view[self._pos : self._pos + n]
        self._pos += n
        return n

    def read(self, size: int | None = -1) -> bytes:
        stop = len(self.view) if size is None or size < 0 else min(len(self.view), self._pos + size)
        out = self.view[self._pos : stop].tobytes() if stop > self._pos else b""
        self._pos = max(self._pos, stop)
        return out

    def close(self) -> None:
        """Nothing to release (the caller's bytes stay the caller's)."""


#: Bytes aiohttp is given per write of a :class:`SharedBody` (it sends them, or keeps the rest, before the next).
_WRITE_BYTES = 1 << 20


@functools.cache
def _payload_type() -> type:
    """aiohttp's payload for :class:`SharedBody` (registered once, for that type only): its bytes from where
    the body stands, written as views of the caller's bytes a piece at a time, on the event loop."""
    from aiohttp import payload

    class SharedBodyPayload(payload.Payload):
        _autoclose = True  # holds no resource

        def __init__(self, value: SharedBody, *args: Any, **kwargs: Any) -> None:
            super().__init__(value, *args, **kwargs)
            self._start = value.tell()
            self._size = max(0, len(value) - self._start)

        def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
            return self._value.view[self._start :].tobytes().decode(encoding, errors)

        async def write(self, writer: Any) -> None:
            await self.write_with_length(writer, None)

        async def write_with_length(self, writer: Any, content_length: int | None) -> None:
            view = self._value.view[self._start :]
            if content_length is not None:
                view = view[:content_length]
            for at in range(0, len(view), _WRITE_BYTES):
                await writer.write(view[at : at + _WRITE_BYTES])

    payload.register_payload(SharedBodyPayload, SharedBody)
    return SharedBodyPayload


@functools.cache
def _botocore_errors() -> Any:
    # botocore comes with s3fs; imported on the first S3 call, not with the package.
    import botocore.exceptions

    return botocore.exceptions


class S3Store(RemoteStore):
    """A run root under an S3 bucket (any S3-protocol server)."""

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        config: StoreConfig | None = None,
        clock: Clock | None = None,
    ) -> None:
        super().__init__(url, storage_options, config, clock)
        if hasattr(self.fs, "retries"):
            # We retry whole operations ourselves, with back-off; keep s3fs's own short.
            self.fs.retries = 1

    def upload_body(self, data: bytes) -> Any:
        """``data`` as a :class:`SharedBody`: sent as views of these bytes, never copied whole."""
        return SharedBody(data)

    def _options(self, opts: dict[str, Any]) -> dict[str, Any]:
        ck = dict(opts.pop("config_kwargs", {}) or {})
        ck.setdefault("connect_timeout", self.config.connect_timeout_s)
        ck.setdefault("read_timeout", self.config.read_timeout_s)
        ck.setdefault("max_pool_connections", self.config.max_connections)
        # botocore retries each request up to 5 times by itself (legacy mode), each
        # waiting out the read timeout: against a paused server one call then takes
        # minutes before our own retries (and the outage log line) even begin.
        # One attempt per call: the back-off is ours (StoreConfig, aurora_store.outage).
        ck.setdefault("retries", {"total_max_attempts": 1})
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
        return opts

    def _read_range(self, path: str, start: int, stop: int) -> bytes:
        """A ranged GET whose body is read no further than the range.

        Why: s3fs reads a response's whole body, and a server (a hostile mirror)
        may ignore ``Range`` and send an object of any size. The body is read in
        pieces up to ``stop - start`` bytes, then the connection is dropped.
        """
        import aiohttp
        from fsspec.asyn import sync
        from s3fs.core import _error_wrapper, version_id_kw

        fs = self.fs
        bucket, key, vers = fs.split_path(path)
        want = stop - start

        async def read() -> bytes:
            resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{stop - 1}", **version_id_kw(vers))
            body = resp["Body"]
            try:
                # BytesIO hands its buffer over without a copy: the peak is the range plus one piece.
                out = io.BytesIO()
                while out.tell() < want:
                    try:
                        chunk = await body.read(min(want - out.tell(), 4 << 20))
                    except aiohttp.ClientError as e:  # the connection broke mid-body: retried like any
                        raise ConnectionError(f"{type(e).__name__}: {e}") from e
                    if not chunk:
                        break
                    out.write(chunk)
                return out.getvalue()
            finally:
                body.close()

        data: bytes = sync(fs.loop, _error_wrapper, read, retries=fs.retries, **self._deadline)
        return data

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """Translate botocore's and s3fs's errors, once.

        - ``FileNotFoundError`` / ``FileExistsError`` (s3fs's 404 and 412) stay
          builtins: the verbs turn them into ``ObjectNotFound`` and the
          create-only read-back;
        - connection trouble and timeouts become (or stay) ``ConnectionError``
          / ``TimeoutError``, and plain ``OSError`` (s3fs's mapping of 5xx and
          unknown codes): retried, then ``StoreError``;
        - everything else (access denied, bad request, no credentials) is an
          answer retrying will not change: ``StoreError`` at once.
        """
        errors = _botocore_errors()
        try:
            return fn()
        except (errors.HTTPClientError, errors.ConnectionError) as e:  # refused, reset, timeouts
            raise ConnectionError(f"{type(e).__name__}: {e}") from e
        except errors.ClientError as e:  # a response s3fs did not translate itself
            from s3fs.errors import translate_boto_error

            raise _classify(what, translate_boto_error(e)) from e
        except errors.BotoCoreError as e:
            raise StoreError(f"{what}: {type(e).__name__}: {e}") from e
        except (OSError, ValueError) as e:
            out = _classify(what, e)
            if out is e:
                raise
            raise out from e


def _status_412(e: BaseException) -> bool:
    """``e`` (or an error it was translated from) is an HTTP 412 Precondition Failed answer.

    Why: s3fs turns a 412 into ``FileExistsError`` only when the body's
    ``Condition`` names ``If-None-Match`` (AWS does; many S3-compatible
    servers send another body, or none, and botocore then reports the code
    ``"412"``); otherwise it becomes a plain ``OSError`` that looks transient.
    The status code is the answer, whatever the body says.
    """
    return _has_status(e, 412, ("PreconditionFailed", "412"))


def _has_status(e: BaseException, status: int, codes: tuple[str, ...]) -> bool:
    """``e``, or an error it was translated from, carries an S3 answer of HTTP ``status`` or an error code in ``codes``."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        response = getattr(cur, "response", None)
        if isinstance(response, dict):
            meta = response.get("ResponseMetadata") or {}
            err = response.get("Error") or {}
            if meta.get("HTTPStatusCode") == status or err.get("Code") in codes:
                return True
        cur = cur.__cause__ or cur.__context__
    return False


def _classify(what: str, e: BaseException) -> BaseException:
    """The error to raise for an (s3fs-translated) error ``e``."""
    if _has_status(e, 416, ("InvalidRange", "416")):
        # A range past the end (any range of an empty object): an answer, not an outage.
        return RangeNotSatisfiable(f"{what}: 416 Range Not Satisfiable")
    if not isinstance(e, FileExistsError) and _status_412(e):
        if what.startswith("put "):
            # Our only conditional request is the create-only put: 412 means "the key exists",
            # and the verb reads it back (our earlier attempt, or a VersionConflict).
            return FileExistsError(f"{what}: 412 Precondition Failed (the key exists)")
        return StoreError(f"{what}: 412 Precondition Failed")
    if isinstance(e, (PermissionError, IsADirectoryError, NotADirectoryError, ValueError)):
        return StoreError(f"{what}: {type(e).__name__}: {e}")
    if isinstance(e, OSError):
        # Not found, exists, connection, timeout, and s3fs's EIO for 5xx and
        # codes it does not know: the verbs and the retry loop handle these.
        return e
    return StoreError(f"{what}: {type(e).__name__}: {e}")
