"""Format 2 against its text (../shared/FORMAT.md §3.1), both ways.

- Bytes built by hand from the text (its two worked examples among them)
  are decoded by the project's reader, and the text's refusals are refused.
- The project's writer (the default options, format 2) is read by a second,
  minimal reader written here from the text alone, sharing no code with
  ``aurora_store``: if the writer drifts from the text, that reader stops
  reproducing the new weights.
- ``format=1`` (``--format 1``) writes segments that a format-1 reader
  reads; the format-1 reader from the text is tests/test_interop.py's.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pytest
import torch
import zstandard
from codec_helpers import encode_delta, fuse, int_view

from aurora_store.codec import v2
from aurora_store.codec.entries import EncodeOptions
from aurora_store.codec.extract import plan_of, spec_of
from aurora_store.codec.fusion import FusionPlan
from aurora_store.codec.kernels import huffman
from aurora_store.errors import EntryError, SegmentError, StreamError
from aurora_store.format.segment import decode_segment
from aurora_tools.synthetic.shapes import QWEN3_TINY, MasterWeights, make_weights

# ---------------------------------------------------------------------------
# A minimal reader of §3 and §3.1, from the text alone


class Violation(Exception):
    pass


WIDTH = {"bfloat16": 2, "float16": 2, "float32": 4}
UINT = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


def bits_lsb_first(data: bytes) -> np.ndarray:
    """Stream bit i is bit i mod 8 of byte i div 8."""
    return np.unpackbits(np.frombuffer(data, np.uint8), bitorder="little")


def read_rice(stream: bytes, start: int, stop: int, n: int) -> list[int]:
    if len(stream) > 5 + 8 * n + -(-56 * n // 8) + -(-33 * n // 8) or len(stream) < 5:
        raise Violation("rice stream size")
    k = stream[0]
    (e,) = struct.unpack_from("<I", stream, 1)
    if k > 56 or e > n:
        raise Violation("k or E")
    escaped = list(struct.unpack_from(f"<{e}Q", stream, 5))
    pos = 5 + 8 * e
    rem_len = -(-n * k // 8)
    if len(stream) < pos + rem_len:
        raise Violation("short")
    rem_bits = bits_lsb_first(stream[pos : pos + rem_len])
    if rem_bits[n * k :].any():
        raise Violation("pad bit")
    unary = stream[pos + rem_len :]
    if n == 0:
        if len(stream) != 5:
            raise Violation("n = 0 is the header alone")
        return []
    ones = np.flatnonzero(bits_lsb_first(unary))
    if ones.size != n or ones[-1] // 8 != len(unary) - 1:
        raise Violation("unary plane")
    zeros = np.diff(ones, prepend=-1) - 1
    out, prev = [], None
    for j in range(n):
        q = int(zeros[j])
        if q > 32:
            raise Violation("run over 32")
        if q == 32:
            if not escaped:
                raise Violation("no escape left")
            q = escaped.pop(0)
            if q >= 1 << (63 - k):
                raise Violation("escape too large")
        r = sum(int(rem_bits[j * k + b]) << b for b in range(k))
        g = (q << k) | r
        i = start + g if prev is None else prev + g + 1
        if i >= stop:
            raise Violation("index past stop")
        out.append(i)
        prev = i
    if escaped:
        raise Violation("escapes unused")
    return out


def read_huffman(payload: bytes, count: int) -> list[int]:
    if len(payload) < 32:
        raise Violation("truncated table")
    symbols = [s for s in range(256) if payload[s // 8] >> (s % 8) & 1]
    nbytes = (len(symbols) + 1) // 2
    if len(payload) < 32 + nbytes:
        raise Violation("truncated table")
    nibbles = [x for b in payload[32 : 32 + nbytes] for x in (b & 15, b >> 4)]
    if len(symbols) % 2 and nibbles[-1]:
        raise Violation("spare nibble")
    lengths = dict(zip(symbols, nibbles[: len(symbols)], strict=True))
    if any(not 1 <= ln <= 12 for ln in lengths.values()):
        raise Violation("length")
    if sum(2.0**-ln for ln in lengths.values()) > 1:
        raise Violation("over-full")
    # RFC 1951 §3.2.2
    bl_count = [0] * 14
    for ln in lengths.values():
        bl_count[ln] += 1
    next_code, code = [0] * 14, 0
    for bits in range(1, 14):
        code = (code + bl_count[bits - 1]) << 1
        next_code[bits] = code
    table = {}
    for s in sorted(lengths):
        ln = lengths[s]
        table[(ln, next_code[ln])] = s
        next_code[ln] += 1
    stream = bits_lsb_first(payload[32 + nbytes :])
    out, pos = [], 0
    for _ in range(count):
        c = ln = 0
        while (ln, c) not in table:
            if ln == 12 or pos >= stream.size:
                raise Violation("no code")
            c, ln, pos = (c << 1) | int(stream[pos]), ln + 1, pos + 1
        out.append(table[(ln, c)])
    if -(-pos // 8) != len(payload) - 32 - nbytes or stream[pos:].any():
        raise Violation("bits after the last code")
    return out


def read_zstd(raw: bytes, size: int | None, bound: int) -> bytes:
    d = zstandard.ZstdDecompressor().decompressobj()
    out = d.decompress(raw)
    if not d.eof or d.unused_data or len(out) > bound or (size is not None and len(out) != size):
        raise Violation("zstd frame")
    return out


def read_planes(stream: bytes, count: int, w: int) -> np.ndarray:
    if len(stream) > w * (5 + count):
        raise Violation("planes size")
    planes, pos = [], 0
    for _ in range(w):
        if pos + 5 > len(stream):
            raise Violation("fewer records")
        method, n = struct.unpack_from("<BI", stream, pos)
        payload = stream[pos + 5 : pos + 5 + n]
        if len(payload) != n:
            raise Violation("record past the stream")
        pos += 5 + n
        if method == 0 and n == count:
            plane = list(payload)
        elif method == 1 and n == 1:
            plane = [payload[0]] * count
        elif method == 2:
            plane = read_huffman(payload, count)
        elif method == 3:
            plane = list(read_zstd(payload, count, count))
        else:
            raise Violation("record")
        planes.append(np.array(plane, dtype=np.uint64))
    if pos != len(stream):
        raise Violation("bytes after the last record")
    out = np.zeros(count, np.uint64)
    for p, plane in enumerate(planes):
        out |= plane << np.uint64(8 * p)
    return out.astype(UINT[w])


def read_entry(e: dict[str, Any], tensors: dict[str, tuple[str, list[int], bytes]], fmt: str) -> tuple[np.ndarray, np.ndarray, str]:
    start, stop, nnz, w = e["start"], e["stop"], e["nnz"], WIDTH[e["dtype"]]
    enc, idx_codec, val_codec = e["encoding"], e.get("idx_codec", "none"), e.get("val_codec", "none")
    if fmt == "1" and (enc == "rice" or val_codec == "planes"):
        raise Violation("format-2 entry in a format-1 segment")
    if enc == "dense":
        idx, count = np.arange(start, stop), stop - start
    else:
        code, shape, raw = tensors[e["idx"]]
        if code != "U8" or len(shape) != 1:
            raise Violation("idx tensor")
        if enc == "rice":
            if idx_codec != "none":
                raise Violation("rice with a codec")
            idx = np.array(read_rice(raw, start, stop, nnz), dtype=np.int64)
        else:
            bound = {"leb128": 10 * nnz, "bitmask": -(-(stop - start) // 8), "u32": 4 * nnz, "u64": 8 * nnz}[enc]
            if idx_codec == "zstd":
                raw = read_zstd(raw, None if enc == "leb128" else bound, bound)
            if enc == "leb128":
                gaps, value, shift = [], 0, 0
                for b in raw:
                    value |= (b & 0x7F) << shift
                    shift += 7
                    if not b & 0x80:
                        gaps.append(value)
                        value, shift = 0, 0
                idx = start + np.cumsum(np.array(gaps, dtype=np.int64))
            elif enc == "bitmask":
                idx = start + np.flatnonzero(bits_lsb_first(raw)[: stop - start])
            else:
                idx = np.frombuffer(raw, "<u4" if enc == "u32" else "<u8").astype(np.int64)
        count = nnz
    code, shape, raw = tensors[e["val"]]
    if val_codec == "planes":
        if code != "U8" or len(shape) != 1:
            raise Violation("planes tensor")
        vals = read_planes(raw, count, w)
    else:
        if val_codec == "zstd":
            raw = read_zstd(raw, count * w, count * w)
        vals = np.frombuffer(raw, UINT[w])
    if idx.size != count or vals.size != count:
        raise Violation("count")
    return idx, vals, e.get("values", "new")


def read_segment_into(data: bytes, weights: dict[str, np.ndarray]) -> tuple[str, list[dict[str, Any]]]:
    (n,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__")
    body = data[8 + n :]
    tensors = {k: (t["dtype"], t["shape"], body[t["data_offsets"][0] : t["data_offsets"][1]]) for k, t in header.items()}
    fmt = meta["aurora.format"]
    if fmt not in ("1", "2") or meta["aurora.kind"] != "delta":
        raise Violation("format or kind")
    entries = json.loads(meta["aurora.entries"])
    for e in entries:
        idx, vals, mode = read_entry(e, tensors, fmt)
        flat = weights[e["param"]]
        if mode == "xor":
            flat[idx] ^= vals
        else:
            flat[idx] = vals
    return fmt, entries


# ---------------------------------------------------------------------------
# Hand-built bytes, decoded by the project's reader

RICE_K6 = bytes.fromhex("06 00000000 805000 23")
RICE_K2 = bytes.fromhex("02 01000000 3100000000000000 18 0300000004")
PLANES_EXAMPLE = bytes.fromhex("00 04000000 01030101 00 04000000 00000080")
HUFFMAN_RECORD = bytes.fromhex("02 23000000 8a" + "00" * 31 + "2102 64")


def test_the_texts_examples_read_by_the_project() -> None:
    for stream in (RICE_K6, RICE_K2):
        assert read_rice(stream, 100, 400, 3) == [100, 103, 301]
        assert v2.decode_rice(stream, 100, 400, 3).tolist() == [100, 103, 301]
    # The writer picks the smallest k: either example's k is exact.
    assert v2.encode_rice(np.array([100, 103, 301]), 100, 6) == RICE_K6
    assert v2.encode_rice(np.array([100, 103, 301]), 100, 2) == RICE_K2
    assert v2.decode_planes(PLANES_EXAMPLE, 4, 2).tolist() == [1, 3, 1, 0x8001]
    assert read_planes(PLANES_EXAMPLE, 4, 2).tolist() == [1, 3, 1, 0x8001]
    assert v2.encode_planes(np.array([1, 3, 1, 0x8001], np.uint16), 2) == PLANES_EXAMPLE
    assert len(HUFFMAN_RECORD) == 40
    payload = HUFFMAN_RECORD[5:]
    assert read_huffman(payload, 5) == [1, 1, 3, 1, 7]
    assert huffman.huffman_decode(np.frombuffer(payload, np.uint8), 5).tolist() == [1, 1, 3, 1, 7]
    assert huffman.huffman_encode(np.array([1, 1, 3, 1, 7], np.uint8)) == payload
    # ... and the text's reason a writer stores it raw: over the bound of a 5-element stream.
    with pytest.raises(StreamError):
        v2.decode_planes(HUFFMAN_RECORD + bytes.fromhex("01 01000000 00"), 5, 2)
    assert v2.decode_rice(bytes(5), 0, 10, 0).size == 0
    assert v2.decode_planes(bytes.fromhex("00 00000000 00 00000000"), 0, 2).size == 0


def _container(meta: dict[str, str], tensors: list[tuple[str, str, bytes]]) -> bytes:
    header: dict[str, Any] = {"__metadata__": meta}
    off = 0
    for name, code, raw in tensors:
        header[name] = {"dtype": code, "shape": [len(raw)], "data_offsets": [off, off + len(raw)]}
        off += len(raw)
    hj = json.dumps(header).encode()
    hj += b" " * (-len(hj) % 8)
    return struct.pack("<Q", len(hj)) + hj + b"".join(t[2] for t in tensors)


def _hand_segment(fmt: str = "2", stream: bytes = RICE_K2) -> bytes:
    entry = {
        "param": "w",
        "shape": [20, 20],
        "dtype": "bfloat16",
        "start": 100,
        "stop": 400,
        "nnz": 3,
        "encoding": "rice",
        "idx": "0.idx",
        "val": "0.val",
        "values": "xor",
        "val_codec": "planes",
    }
    meta = {"aurora.format": fmt, "aurora.kind": "delta", "aurora.version": "5", "aurora.base_version": "4"}
    meta["aurora.entries"] = json.dumps([entry])
    planes = bytes.fromhex("00 03000000 010301 01 01000000 00")
    return _container(meta, [("0.val", "U8", planes), ("0.idx", "U8", stream)])


def test_a_hand_built_segment_is_read_by_the_project() -> None:
    seg = decode_segment(_hand_segment(), "seg-h", {"w": spec_of(torch.zeros(20, 20, dtype=torch.bfloat16))})
    (e,) = seg.entries
    assert (seg.version, seg.base_version, e.values) == (5, 4, "xor")
    assert e.indices is not None and e.indices.tolist() == [100, 103, 301]
    assert e.bits.tolist() == [1, 3, 1]
    weights = {"w": np.zeros(400, np.uint16)}
    assert read_segment_into(_hand_segment(), weights)[0] == "2"
    assert np.flatnonzero(weights["w"]).tolist() == [100, 103, 301]


def test_a_format_1_segment_may_not_carry_format_2() -> None:
    with pytest.raises(EntryError, match="needs a format-2 segment"):
        decode_segment(_hand_segment("1"), "seg-h")
    with pytest.raises(SegmentError, match="this reader knows '1'"):
        decode_segment(_hand_segment("2"), "seg-h", formats=("1",))
    with pytest.raises(Violation):
        read_segment_into(_hand_segment("1"), {"w": np.zeros(400, np.uint16)})


# Each a stream the text says a reader refuses (indices 100, 103, 301 in [100, 400) unless noted).
RICE_REFUSED = {
    "over the bound": (RICE_K6 + bytes(60), 400),
    "under 5 bytes": (bytes(4), 400),
    "k above 56": (bytes([57]) + RICE_K6[1:], 400),
    "E above n": (bytes.fromhex("06 04000000") + RICE_K6[5:], 400),
    "too short for the remainder plane": (RICE_K6[:6], 400),
    "a set pad bit": (bytes.fromhex("06 00000000 8050f0 23"), 400),
    "fewer one bits": (bytes.fromhex("06 00000000 805000 03"), 400),
    "more one bits": (bytes.fromhex("06 00000000 805000 63"), 400),
    "a byte after the last one": (RICE_K6 + b"\x00", 400),
    "a run over 32 zero bits": (bytes.fromhex("02 01000000 3100000000000000 18 0300000008"), 400),
    "an escape with none left": (bytes.fromhex("02 00000000 18 0300000004"), 400),
    "escapes left unused": (bytes.fromhex("02 02000000 3100000000000000 3100000000000000 18 0300000004"), 400),
    "an escaped quotient of 2^(63-k)": (bytes.fromhex("02 01000000 0000000000000020 18 0300000004"), 400),
    "an index at stop": (RICE_K6, 301),
}


@pytest.mark.parametrize("case", list(RICE_REFUSED))
def test_rice_refusals_of_the_text(case: str) -> None:
    stream, stop = RICE_REFUSED[case]
    with pytest.raises(StreamError):
        v2.decode_rice(stream, 100, stop, 3)
    with pytest.raises(Violation):
        read_rice(stream, 100, stop, 3)


def _huff_planes(table: str, body: str) -> bytes:
    payload = bytes.fromhex(table + body)
    rec = struct.pack("<BI", 2, len(payload)) + payload
    return rec + bytes.fromhex("01 01000000 00")


# Planes of 40 elements of width 2 (bound 2 * 45 = 90 bytes): plane 0 as given, plane 1 constant 0.
HUFF_OK_TABLE = "8a" + "00" * 31 + "2102"
HUFF_OK_BODY = "64" + "00" * 5  # 1, 1, 3, 1, 7, then 35 codes `0` (symbol 1): 40 codes in 42 bits
PLANES_REFUSED = {
    "over the bound": bytes.fromhex("00 28000000") + bytes(40) + bytes.fromhex("01 01000000 00") + bytes(50),
    "fewer records": bytes.fromhex("00 28000000") + bytes(40),
    "a record past the stream": bytes.fromhex("00 28000000") + bytes(40) + bytes.fromhex("01 02000000 00"),
    "bytes after the last record": bytes.fromhex("00 28000000") + bytes(40) + bytes.fromhex("01 01000000 00 00"),
    "an unknown method": bytes.fromhex("04 01000000 00 01 01000000 00"),
    "raw of L != count": bytes.fromhex("00 27000000") + bytes(39) + bytes.fromhex("01 01000000 00"),
    "constant of L != 1": bytes.fromhex("01 02000000 0000 01 01000000 00"),
    "a length above 12": _huff_planes("8a" + "00" * 31 + "d102", HUFF_OK_BODY),
    "a length of 0": _huff_planes("8a" + "00" * 31 + "2100", HUFF_OK_BODY),
    "a non-zero spare nibble": _huff_planes("8a" + "00" * 31 + "2112", HUFF_OK_BODY),
    "an over-full code": _huff_planes("8a" + "00" * 31 + "1101", HUFF_OK_BODY),
    "a truncated table": _huff_planes("8a" + "00" * 31 + "21", ""),
    "a pattern that is no code": _huff_planes("02" + "00" * 31 + "02", "03" + "00" * 9),  # symbol 1 is `00`
    "fewer codes than count": _huff_planes(HUFF_OK_TABLE, "64" + "00" * 3),
    "set bits after the last code": _huff_planes(HUFF_OK_TABLE, "64" + "00" * 4 + "08"),
    "bytes after the last code": _huff_planes(HUFF_OK_TABLE, HUFF_OK_BODY + "00"),
    "zstd of another size": bytes.fromhex("03")
    + struct.pack("<I", len(zstandard.ZstdCompressor().compress(bytes(39))))
    + zstandard.ZstdCompressor().compress(bytes(39))
    + bytes.fromhex("01 01000000 00"),
}


def test_the_huffman_case_base_is_valid() -> None:
    good = _huff_planes(HUFF_OK_TABLE, HUFF_OK_BODY)
    want = [1, 1, 3, 1, 7] + [1] * 35
    assert v2.decode_planes(good, 40, 2).tolist() == want
    assert read_planes(good, 40, 2).tolist() == want


@pytest.mark.parametrize("case", list(PLANES_REFUSED))
def test_planes_refusals_of_the_text(case: str) -> None:
    stream = PLANES_REFUSED[case]
    with pytest.raises(StreamError):
        v2.decode_planes(stream, 40, 2)
    with pytest.raises(Violation):
        read_planes(stream, 40, 2)


# ---------------------------------------------------------------------------
# The project's writer, read by the reader above


@pytest.fixture(scope="module")
def steps() -> tuple[FusionPlan, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    w = make_weights(QWEN3_TINY, seed=3)
    plan = plan_of(w, tied=False)
    return plan, w, MasterWeights(w, seed=3).step(lr=2e-6)


def as_bits(t: torch.Tensor) -> np.ndarray:
    return int_view(t).reshape(-1).numpy().view(UINT[t.element_size()]).copy()


ONLY_V2 = EncodeOptions(index_encodings=("rice",), value_modes=("xor",), codecs=("planes",))
ONLY_V2_NEW = EncodeOptions(index_encodings=("rice",), value_modes=("new",), codecs=("planes",))


@pytest.mark.parametrize("opts", [EncodeOptions(), ONLY_V2, ONLY_V2_NEW], ids=["default", "rice-planes-xor", "rice-planes-new"])
def test_the_writers_format_2_read_from_the_text(steps, opts: EncodeOptions) -> None:
    plan, base, new = steps
    segs, params = encode_delta(plan, base, new, 7, opts, segment_bytes=8192)
    held = {n: as_bits(t) for n, t in fuse(plan, base).items()}
    want = {n: as_bits(t) for n, t in fuse(plan, new).items()}
    kinds: set[tuple[str, str]] = set()
    for _, data in segs:
        fmt, entries = read_segment_into(data, held)
        assert fmt == "2"
        kinds |= {(e["encoding"], e.get("val_codec", "none")) for e in entries}
        for e in entries:
            if e["encoding"] == "rice":
                assert "idx_codec" not in e or e["idx_codec"] == "none"
    assert ("rice", "planes") in kinds
    for n in want:
        assert np.array_equal(held[n], want[n]), n


def test_the_writers_streams_keep_the_texts_writer_rules() -> None:
    rng = np.random.default_rng(5)
    # Geometric gaps and a few huge ones (escapes): k near log2(mean gap * ln 2), escapes only q >= 32.
    gaps = rng.geometric(0.01, 5000) - 1
    gaps[::997] += 1 << 30
    idx = np.cumsum(gaps + 1) - 1 + 17
    stream = v2.encode_rice(idx, 17)
    k = stream[0]
    assert abs(k - np.log2(np.mean(gaps) * np.log(2))) < 2 or k == 0
    (e,) = struct.unpack_from("<I", stream, 1)
    assert all(q >= 32 for q in struct.unpack_from(f"<{e}Q", stream, 5))
    assert read_rice(stream, 17, int(idx[-1]) + 1, idx.size) == idx.tolist()
    assert v2.encode_rice(np.empty(0, np.int64), 0)[1:] == bytes(4)
    # Planes: a bf16 XOR stream of one-ulp carries, and the empty stream.
    masks = (1 << rng.geometric(0.5, 3000).clip(max=14)) - 1
    masks[::50] |= 0x8000
    planes = v2.encode_planes(masks.astype(np.uint16), 2)
    assert read_planes(planes, masks.size, 2).tolist() == masks.tolist()
    assert v2.encode_planes(np.empty(0, np.uint16), 2) == bytes.fromhex("00 00000000 00 00000000")
