"""An S3 upload reads its object where it is (``SharedBody``): no whole copy per PUT.

The copy this prevents comes from the libraries (botocore wraps ``bytes`` in
``io.BytesIO``; aiohttp's ``getbuffer()`` on it copies the shared bytes). Here
the body and the payload aiohttp sends it with; end to end, against a real S3
server, in tests/test_rclone_s3.py (``test_a_put_allocates_far_less_than_its_object``).
"""

from __future__ import annotations

import asyncio
import io
import os

import pytest

from aurora_store.storage.s3 import SharedBody


def test_reads_seeks_and_slices_without_copying_the_source() -> None:
    data = bytes(range(256)) * 40
    body = SharedBody(data)
    assert len(body) == len(data) and body.readable() and body.seekable()
    assert body.read(10) == data[:10] and body.tell() == 10
    buf = bytearray(7)
    assert body.readinto(buf) == 7 and bytes(buf) == data[10:17]
    assert body.read() == data[17:] and body.read(5) == b"" and body.readinto(bytearray(3)) == 0
    assert body.seek(-4, io.SEEK_END) == len(data) - 4 and body.read() == data[-4:]
    assert body.seek(3) == 3 and body.seek(2, io.SEEK_CUR) == 5 and body.read(1) == data[5:6]
    with pytest.raises(ValueError):
        body.seek(-1)
    part = body[100:300]  # what s3fs's multipart upload does to its data
    assert isinstance(part, SharedBody) and len(part) == 200 and part.read() == data[100:300]
    assert part.view.obj is data  # a view of the caller's bytes, not a copy
    with pytest.raises(TypeError):
        body[::2]
    assert SharedBody(memoryview(data)[5:9]).read() == data[5:9]


def test_aiohttp_sends_it_as_views_from_where_it_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiohttp.payload import get_payload

    import aurora_store.storage.s3 as s3

    monkeypatch.setattr(s3, "_WRITE_BYTES", 1000)
    data = os.urandom(4500)
    body = SharedBody(data)
    body.seek(100)  # where botocore leaves it after reading it for a checksum and seeking back
    payload = get_payload(body)
    assert type(payload).__name__ == "SharedBodyPayload" and payload.size == 4400

    class Writer:
        def __init__(self) -> None:
            self.chunks: list[memoryview] = []

        async def write(self, chunk: memoryview) -> None:
            self.chunks.append(chunk)

    for limit, want in ((None, data[100:]), (2500, data[100:2600])):
        w = Writer()
        asyncio.run(payload.write_with_length(w, limit))  # type: ignore[arg-type]  # only write() is used
        assert b"".join(w.chunks) == want and max(len(c) for c in w.chunks) == 1000
        assert all(isinstance(c, memoryview) and c.obj is data for c in w.chunks)  # views, never copies
