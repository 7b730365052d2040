"""Index encodings and the bounded zstd codec (FORMAT.md §3, aurora_store/encodings.py)."""

from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest
import zstandard
from conftest import index_ranges
from hypothesis import given
from hypothesis import strategies as st

from aurora_store.codec import encodings as enc
from aurora_store.codec import varint
from aurora_store.codec.encodings import StreamError

SPARSE = ("leb128", "bitmask", "u32", "u64")


def reference_encode(encoding: str, idx: np.ndarray, start: int, stop: int) -> bytes:
    """FORMAT.md §3, written out with plain Python loops."""
    if encoding == "leb128":
        out = bytearray()
        prev = start
        for i in idx.tolist():
            g = i - prev
            prev = i
            while True:
                b, g = g & 0x7F, g >> 7
                out.append(b | (0x80 if g else 0))
                if not g:
                    break
        return bytes(out)
    if encoding == "bitmask":
        out = bytearray((stop - start + 7) // 8)
        for i in idx.tolist():
            j = i - start
            out[j // 8] |= 1 << (j % 8)
        return bytes(out)
    width = 4 if encoding == "u32" else 8
    return b"".join(int(i).to_bytes(width, "little") for i in idx.tolist())


@pytest.mark.parametrize("encoding", SPARSE)
@given(r=index_ranges())
def test_index_round_trip(encoding: str, r: tuple[int, int, np.ndarray]) -> None:
    start, stop, idx = r
    data = enc.encode_indices(encoding, idx, start, stop)
    assert data == reference_encode(encoding, idx, start, stop)
    assert len(data) == enc.indices_size(encoding, idx, start, stop)
    assert len(data) <= enc.index_stream_bound(encoding, idx.size, start, stop)
    back = enc.decode_indices(encoding, data, start, stop, idx.size)
    assert back.dtype == np.int64
    assert np.array_equal(back, idx)


@pytest.mark.parametrize("encoding", SPARSE)
def test_index_empty(encoding: str) -> None:
    idx = np.empty(0, dtype=np.int64)
    data = enc.encode_indices(encoding, idx, 10, 30)
    assert len(data) == (3 if encoding == "bitmask" else 0)
    assert enc.decode_indices(encoding, data, 10, 30, 0).size == 0


def test_leb128_vector_from_format() -> None:
    # gaps from start 100: 198, 127, 128 -> C6 01 7F 80 01
    idx = np.array([298, 425, 553], dtype=np.int64)
    data = enc.encode_indices("leb128", idx, 100, 1000)
    assert data == bytes.fromhex("C6 01 7F 80 01")
    assert enc.decode_indices("leb128", data, 100, 1000, 3).tolist() == idx.tolist()


def test_bitmask_layout_is_lsb_first() -> None:
    idx = np.array([5, 6, 13], dtype=np.int64)  # j = 0, 1, 8
    assert enc.encode_indices("bitmask", idx, 5, 15) == bytes([0b0000_0011, 0b0000_0001])


def test_dense_has_no_index_stream() -> None:
    assert enc.encode_indices("dense", np.arange(4), 0, 4) == b""
    assert enc.indices_size("dense", np.arange(4), 0, 4) == 0


def test_u32_refuses_indices_past_two_to_the_32() -> None:
    with pytest.raises(ValueError):
        enc.encode_indices("u32", np.array([1], dtype=np.int64), 0, (1 << 32) + 1)


def test_unknown_encoding() -> None:
    with pytest.raises(ValueError):
        enc.encode_indices("rle", np.arange(3), 0, 3)
    with pytest.raises(ValueError):
        enc.indices_size("rle", np.arange(3), 0, 3)
    with pytest.raises(StreamError, match="unknown index encoding"):
        enc.decode_indices("rle", b"", 0, 3, 0)
    with pytest.raises(StreamError, match="unknown index encoding"):
        enc.index_stream_bound("rle", 3, 0, 3)


@given(
    st.integers(0, 1000),
    st.integers(1, 300),
    st.lists(st.integers(0, 299), max_size=40, unique=True),
)
def test_leb128_size_is_cheap_and_exact(start: int, span: int, offs: list[int]) -> None:
    idx = np.array(sorted(o for o in offs if o < span), dtype=np.int64) + start
    assert enc.indices_size("leb128", idx, start, start + span) == len(enc.encode_indices("leb128", idx, start, start + span))


# --- rejection of hostile index streams ---------------------------------------


def leb(*gaps: int) -> bytes:
    return varint.encode(np.array(gaps, dtype=np.uint64))


def test_leb128_first_gap_may_be_zero() -> None:
    assert enc.decode_indices("leb128", leb(0, 1, 1), 10, 20, 3).tolist() == [10, 11, 12]


def test_leb128_zero_gap_after_first_rejected() -> None:
    with pytest.raises(StreamError, match="gap of 0 at position 2"):
        enc.decode_indices("leb128", leb(1, 2, 0), 0, 100, 3)


@pytest.mark.parametrize(
    ("gaps", "stop"),
    [
        ((100,), 100),  # first gap lands on stop
        ((50, 50), 100),  # running sum lands on stop
        ((99, 1), 100),
        ((5, 200), 100),  # one gap is already past the span
        ((1 << 63,), 100),
    ],
)
def test_leb128_index_out_of_range_rejected(gaps: tuple[int, ...], stop: int) -> None:
    with pytest.raises(StreamError, match=r"\[0, 100\)"):
        enc.decode_indices("leb128", leb(*gaps), 0, stop, len(gaps))


def test_leb128_truncated_and_overlong_and_count() -> None:
    with pytest.raises(StreamError, match="truncated"):
        enc.decode_indices("leb128", b"\x01\x80", 0, 100, 2)
    with pytest.raises(StreamError, match="longer than 10"):
        enc.decode_indices("leb128", b"\x80" * 10 + b"\x00", 0, 100, 1)
    with pytest.raises(StreamError, match="above 2\\^63"):
        enc.decode_indices("leb128", b"\xff" * 9 + b"\x01", 0, 1 << 64, 1)
    with pytest.raises(StreamError, match="expected 3"):
        enc.decode_indices("leb128", leb(1, 1), 0, 100, 3)
    with pytest.raises(StreamError, match="expected 0"):
        enc.decode_indices("leb128", leb(1), 0, 100, 0)


def test_leb128_running_sum_overflow_rejected() -> None:
    # Every gap is < span, but the int64 running sum wraps past 2^63 and comes
    # back below stop: indices 2^63-2 (>= stop) and negatives must be refused.
    span = 1 << 62
    with pytest.raises(StreamError):
        enc.decode_indices("leb128", leb(*([span - 1] * 4)), 0, span, 4)


def test_bitmask_bit_past_range_rejected() -> None:
    # range of 10 elements -> 2 bytes; bit 10 (byte 1, bit 2) is past the range
    with pytest.raises(StreamError, match="past the range"):
        enc.decode_indices("bitmask", bytes([0b1, 0b100]), 0, 10, 2)


def test_bitmask_wrong_length_and_count_rejected() -> None:
    with pytest.raises(StreamError, match="expected 2"):
        enc.decode_indices("bitmask", b"\x01", 0, 10, 1)
    with pytest.raises(StreamError, match="expected 2"):
        enc.decode_indices("bitmask", b"\x01\x00\x00", 0, 10, 1)
    with pytest.raises(StreamError, match="nnz is 2"):
        enc.decode_indices("bitmask", b"\x01\x00", 0, 10, 2)


@pytest.mark.parametrize("encoding", ["u32", "u64"])
def test_absolute_not_strictly_increasing_rejected(encoding: str) -> None:
    dt = "<u4" if encoding == "u32" else "<u8"
    for bad in ([5, 5], [7, 6], [3, 9, 9]):
        data = np.array(bad, dtype=dt).tobytes()
        with pytest.raises(StreamError, match="not strictly increasing"):
            enc.decode_indices(encoding, data, 0, 100, len(bad))


@pytest.mark.parametrize("encoding", ["u32", "u64"])
def test_absolute_out_of_range_rejected(encoding: str) -> None:
    dt = "<u4" if encoding == "u32" else "<u8"
    for bad in ([9], [10, 20], [15, 25]):  # range [10, 20)
        with pytest.raises(StreamError, match=r"outside \[10, 20\)"):
            enc.decode_indices(encoding, np.array(bad, dtype=dt).tobytes(), 10, 20, len(bad))


@pytest.mark.parametrize("encoding", ["u32", "u64"])
def test_absolute_wrong_length_rejected(encoding: str) -> None:
    w = 4 if encoding == "u32" else 8
    with pytest.raises(StreamError, match=f"expected {2 * w}"):
        enc.decode_indices(encoding, b"\x00" * (2 * w + 1), 0, 100, 2)


def test_u64_index_above_two_to_the_63_rejected_not_wrapped() -> None:
    data = np.array([1 << 63], dtype="<u8").tobytes()
    with pytest.raises(StreamError, match="outside"):
        enc.decode_indices("u64", data, 0, 100, 1)


# --- zstd ---------------------------------------------------------------------


def zeros_frame(n: int, content_size: bool) -> bytes:
    """A zstd frame of ``n`` zero bytes, produced without an ``n``-byte buffer."""
    cobj = zstandard.ZstdCompressor(level=1, write_content_size=content_size).compressobj(size=n)
    chunk = bytes(1 << 20)
    parts = [cobj.compress(chunk) for _ in range(n // len(chunk))]
    parts.append(cobj.compress(bytes(n % len(chunk))))
    parts.append(cobj.flush())
    return b"".join(parts)


@pytest.fixture(scope="module")
def gib_bomb() -> bytes:
    """1 GiB of zeros in one frame that does not declare its size (~32 KiB)."""
    return zeros_frame(1 << 30, content_size=False)


def test_zstd_round_trip() -> None:
    raw = bytes(range(256)) * 40
    frame = enc.zstd_compress(raw, 3)
    assert zstandard.get_frame_parameters(frame).content_size == len(raw)
    assert enc.zstd_decompress(frame, len(raw), len(raw)) == raw
    assert enc.zstd_decompress(frame, None, 10 * len(raw)) == raw


def test_zstd_bomb_without_declared_size_rejected_cheaply(gib_bomb: bytes) -> None:
    assert len(gib_bomb) < 1 << 16
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        with pytest.raises(StreamError, match="past the bound of 4096"):
            enc.zstd_decompress(gib_bomb, None, 4096)
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Nowhere near the 1 GiB it would expand to.
    assert peak < 256 << 20, f"peak {peak} bytes"
    assert elapsed < 5.0


def test_zstd_bomb_memory_stays_near_the_bound(gib_bomb: bytes) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(StreamError):
            enc.zstd_decompress(gib_bomb, None, 4096)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"peak {peak} bytes for a 4096-byte bound"


def test_zstd_bomb_with_declared_size_rejected_from_header() -> None:
    frame = zeros_frame(1 << 30, content_size=True)
    assert zstandard.get_frame_parameters(frame).content_size == 1 << 30
    with pytest.raises(StreamError, match="declares 1073741824 bytes"):
        enc.zstd_decompress(frame, None, 4096)


def test_zstd_frame_one_byte_past_bound() -> None:
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(b"a" * 101)
    with pytest.raises(StreamError, match="bound"):
        enc.zstd_decompress(frame, None, 100)
    assert enc.zstd_decompress(frame, None, 101) == b"a" * 101


def test_zstd_corrupt_frame_rejected() -> None:
    frame = bytearray(enc.zstd_compress(bytes(range(200)) * 5, 1))
    frame[len(frame) // 2] ^= 0xFF
    frame[-1] ^= 0xFF  # checksum or last block
    with pytest.raises(StreamError, match="corrupt|truncated"):
        enc.zstd_decompress(bytes(frame), 1000, 1000)


@pytest.mark.parametrize("junk", [b"", b"\x00", b"abc", b"not a zstd frame at all"])
def test_zstd_garbage_rejected(junk: bytes) -> None:
    with pytest.raises(StreamError, match="corrupt"):
        enc.zstd_decompress(junk, None, 100)


@pytest.mark.parametrize("trailer", [b"\x00", b"junk", "frame"])
def test_zstd_trailing_bytes_rejected(trailer: bytes | str) -> None:
    frame = enc.zstd_compress(b"hello" * 10, 1)
    extra = frame if trailer == "frame" else trailer
    assert isinstance(extra, bytes)
    with pytest.raises(StreamError, match="after its frame"):
        enc.zstd_decompress(frame + extra, 50, 50)


@pytest.mark.parametrize("cut", [1, 3, 8])
def test_zstd_truncated_frame_rejected(cut: int) -> None:
    frame = enc.zstd_compress(bytes(range(256)) * 8, 1)
    with pytest.raises(StreamError, match="truncated|corrupt"):
        enc.zstd_decompress(frame[:-cut], 2048, 2048)


def test_zstd_wrong_exact_size_rejected() -> None:
    frame = enc.zstd_compress(b"x" * 64, 1)
    with pytest.raises(StreamError, match="decompresses to 64 bytes, expected 63"):
        enc.zstd_decompress(frame, 63, 100)
    with pytest.raises(StreamError, match="expected 65"):
        enc.zstd_decompress(frame, 65, 100)


def test_zstd_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        enc.zstd_decompress(b"\x00\x00\x00\x00\x00", None, 10)


def test_zstd_compress_errors_are_stream_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """zstandard's own error class never leaves encodings.py."""

    class Broken:
        def compress(self, data: object) -> bytes:
            raise zstandard.ZstdError("out of memory")

    with pytest.raises(StreamError, match="zstd compression failed"):
        enc.zstd_compress(b"abc", 1, Broken())  # type: ignore[arg-type]
