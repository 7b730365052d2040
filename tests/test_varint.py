"""LEB128 varints (FORMAT.md §3, aurora_store/varint.py)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import uint64_arrays
from hypothesis import given
from hypothesis import strategies as st

from aurora_store.codec import varint
from aurora_store.codec.varint import VarintError


def py_encode(v: int) -> bytes:
    """Reference encoder: the textbook loop."""
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


@pytest.mark.parametrize(
    ("value", "encoded"),
    [
        (0, "00"),
        (1, "01"),
        (127, "7F"),
        (128, "80 01"),
        (198, "C6 01"),
        (300, "AC 02"),
        (16383, "FF 7F"),
        (16384, "80 80 01"),
        ((1 << 63) - 1, "FF FF FF FF FF FF FF FF 7F"),
        (1 << 63, "80 80 80 80 80 80 80 80 80 01"),
    ],
)
def test_vectors(value: int, encoded: str) -> None:
    want = bytes.fromhex(encoded)
    got = varint.encode(np.array([value], dtype=np.uint64))
    assert got == want
    assert varint.encoded_size(np.array([value], dtype=np.uint64)) == len(want)
    assert varint.decode(want).tolist() == [value]


def test_two_to_the_63_is_ten_bytes() -> None:
    enc = varint.encode(np.array([1 << 63], dtype=np.uint64))
    assert len(enc) == varint.MAX_VARINT_BYTES == 10


def test_concatenated_stream() -> None:
    vals = [198, 0, 127, 128, 1 << 63, 5]
    data = b"".join(py_encode(v) for v in vals)
    assert varint.encode(np.array(vals, dtype=np.uint64)) == data
    assert varint.decode(data, expected_count=len(vals)).tolist() == vals


def test_empty() -> None:
    assert varint.encode(np.empty(0, dtype=np.uint64)) == b""
    assert varint.encoded_size(np.empty(0, dtype=np.uint64)) == 0
    out = varint.decode(b"", expected_count=0)
    assert out.dtype == np.uint64 and out.size == 0


def test_signed_input_accepted_when_non_negative_and_refused_when_negative() -> None:
    assert varint.encode(np.array([198], dtype=np.int64)) == b"\xc6\x01"
    with pytest.raises(ValueError):
        varint.encode(np.array([1, -1], dtype=np.int64))


def test_decode_accepts_uint8_array() -> None:
    arr = np.frombuffer(b"\xc6\x01\x7f", dtype=np.uint8)
    assert varint.decode(arr).tolist() == [198, 127]


@given(uint64_arrays(max_size=200))
def test_round_trip_property(values: np.ndarray) -> None:
    data = varint.encode(values)
    assert len(data) == varint.encoded_size(values)
    assert data == b"".join(py_encode(int(v)) for v in values)
    back = varint.decode(data, expected_count=values.size)
    assert back.dtype == np.uint64
    assert np.array_equal(back, values)


@given(st.lists(st.integers(0, 1 << 63), max_size=50))
def test_decode_matches_reference_on_reference_bytes(values: list[int]) -> None:
    data = b"".join(py_encode(v) for v in values)
    assert varint.decode(data).tolist() == values


# --- rejection ---------------------------------------------------------------


@pytest.mark.parametrize("data", [b"\x80", b"\xc6", b"\x01\xff\xff", b"\x7f\x80\x80\x80"])
def test_truncated_varint_rejected(data: bytes) -> None:
    with pytest.raises(VarintError, match="truncated"):
        varint.decode(data)


def test_truncated_offset_points_at_last_varint() -> None:
    with pytest.raises(VarintError) as ei:
        varint.decode(b"\x01\x02\x80\x80")
    assert ei.value.offset == 2


def test_longer_than_ten_bytes_rejected() -> None:
    # 11 bytes even though the value (0) would fit: overlong is refused by length.
    data = b"\x80" * 10 + b"\x00"
    with pytest.raises(VarintError, match="longer than 10 bytes"):
        varint.decode(data)
    with pytest.raises(VarintError) as ei:
        varint.decode(b"\x05" + data)
    assert ei.value.offset == 1


@pytest.mark.parametrize(
    "data",
    [
        b"\x81" + b"\x80" * 8 + b"\x01",  # 2^63 + 1
        b"\xff" * 9 + b"\x01",  # 2^64 - 1
        b"\x80" * 9 + b"\x02",  # 2^64 (tenth byte carries more than bit 63)
        b"\x80" * 9 + b"\x7f",
    ],
)
def test_value_above_two_to_the_63_rejected(data: bytes) -> None:
    with pytest.raises(VarintError, match="above 2\\^63"):
        varint.decode(data)


def test_ten_byte_max_value_accepted() -> None:
    assert varint.decode(b"\x80" * 9 + b"\x01").tolist() == [1 << 63]
    # A non-canonical (zero-padded) 10-byte varint is still one value.
    assert varint.decode(b"\x85" + b"\x80" * 8 + b"\x00").tolist() == [5]


@pytest.mark.parametrize("expected", [0, 1, 3])
def test_count_mismatch_rejected(expected: int) -> None:
    data = py_encode(1) + py_encode(300)
    with pytest.raises(VarintError, match="expected"):
        varint.decode(data, expected_count=expected)


def test_count_mismatch_on_empty_stream() -> None:
    with pytest.raises(VarintError):
        varint.decode(b"", expected_count=1)


def test_non_uint8_array_refused() -> None:
    with pytest.raises(TypeError):
        varint.decode(np.array([1, 2], dtype=np.int32))


def test_varint_error_is_value_error_with_offset() -> None:
    with pytest.raises(ValueError) as ei:
        varint.decode(b"\x01\x80")
    assert isinstance(ei.value, VarintError)
    assert ei.value.offset == 1
    assert "at byte 1" in str(ei.value)
