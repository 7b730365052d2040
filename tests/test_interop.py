"""Interop: segments are plain safetensors files, and a reader written from
FORMAT.md alone (below, sharing no code with aurora_store) decodes them.

This is the guard on the wire format: if the writer drifts from FORMAT.md,
the independent reader stops reproducing the new weights.
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

from aurora_store.codec.entries import NAIVE, PAPER, EncodeOptions
from aurora_store.codec.extract import plan_of, spec_of
from aurora_store.codec.fusion import FusionPlan
from aurora_tools.synthetic.shapes import QWEN3_TINY, MasterWeights, make_weights

# ---------------------------------------------------------------------------
# An independent FORMAT.md reader


WIDTH = {"bfloat16": 2, "float16": 2, "float32": 4}
BITS: dict[int, np.dtype[Any]] = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
VALUE_CODE = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


class FormatViolation(Exception):
    pass


def read_container(data: bytes) -> tuple[dict[str, str], dict[str, tuple[str, list[int], bytes]]]:
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n].decode("utf-8"))
    meta = header.pop("__metadata__")
    body = data[8 + n :]
    tensors = {}
    for name, t in header.items():
        a, b = t["data_offsets"]
        tensors[name] = (t["dtype"], t["shape"], body[a:b])
    return meta, tensors


def leb128_gaps(stream: bytes) -> list[int]:
    out, value, shift, length = [], 0, 0, 0
    for byte in stream:
        value |= (byte & 0x7F) << shift
        shift += 7
        length += 1
        if length > 10:
            raise FormatViolation("varint longer than 10 bytes")
        if not byte & 0x80:
            out.append(value)
            value, shift, length = 0, 0, 0
    if length:
        raise FormatViolation("trailing bytes")
    return out


def stream_bytes(tensors: dict[str, Any], name: str, codec: str, size: int | None, bound: int) -> bytes:
    code, shape, raw = tensors[name]
    if codec == "none":
        return raw
    if codec != "zstd" or code != "U8":
        raise FormatViolation(f"codec {codec} / {code}")
    out = zstandard.ZstdDecompressor().decompressobj().decompress(raw)
    if len(out) > bound or (size is not None and len(out) != size):
        raise FormatViolation("zstd size")
    return out


def decode_entry(e: dict[str, Any], tensors: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, str]:
    start, stop, nnz = e["start"], e["stop"], e["nnz"]
    width = WIDTH[e["dtype"]]
    enc = e["encoding"]
    if enc == "dense":
        idx = np.arange(start, stop)
        count = stop - start
    else:
        bound = {
            "leb128": 10 * nnz,
            "bitmask": (stop - start + 7) // 8,
            "u32": 4 * nnz,
            "u64": 8 * nnz,
        }[enc]
        raw = stream_bytes(tensors, e["idx"], e.get("idx_codec", "none"), None if enc == "leb128" else bound, bound)
        if enc == "leb128":
            pos, positions = start, []
            for k, g in enumerate(leb128_gaps(raw)):
                if k and g == 0:
                    raise FormatViolation("zero gap")
                pos += g
                positions.append(pos)
            idx = np.array(positions, dtype=np.int64)
        elif enc == "bitmask":
            idx = np.array(
                [start + j for j in range(stop - start) if raw[j // 8] >> (j % 8) & 1],
                dtype=np.int64,
            )
        else:
            w = 4 if enc == "u32" else 8
            idx = np.array(
                [int.from_bytes(raw[k : k + w], "little") for k in range(0, len(raw), w)],
                dtype=np.int64,
            )
        count = nnz
    if idx.size != count or (idx.size and (idx.min() < start or idx.max() >= stop)):
        raise FormatViolation("indices")
    mode = e.get("values", "new")
    vraw = stream_bytes(tensors, e["val"], e.get("val_codec", "none"), count * width, count * width)
    if e.get("val_codec", "none") == "none":
        want = VALUE_CODE[e["dtype"]] if mode == "new" else {2: "U16", 4: "U32"}[width]
        if tensors[e["val"]][0] != want:
            raise FormatViolation("value dtype")
    vals = np.frombuffer(vraw, dtype=BITS[width])
    if vals.size != count:
        raise FormatViolation("value count")
    return idx, vals, mode


def independent_apply(segment: bytes, weights: dict[str, np.ndarray]) -> int:
    meta, tensors = read_container(segment)
    assert meta["aurora.format"] == "1" and meta["aurora.kind"] == "delta"
    int(meta["aurora.version"]), int(meta["aurora.base_version"])
    n = 0
    for e in json.loads(meta["aurora.entries"]):
        flat = weights[e["param"]]
        assert list(flat.shape) == [int(np.prod(e["shape"]))]
        idx, vals, mode = decode_entry(e, tensors)
        if mode == "new":
            flat[idx] = vals
        else:
            flat[idx] ^= vals
        n += e["nnz"]
    return n


def as_bits(t: torch.Tensor) -> np.ndarray:
    return int_view(t).reshape(-1).numpy().view(BITS[t.element_size()]).copy()


# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def steps() -> tuple[FusionPlan, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    w = make_weights(QWEN3_TINY, seed=11)
    plan = plan_of(w, tied=False)
    new = MasterWeights(w, seed=11).step(lr=2e-6)
    return plan, w, new


# Format 1 throughout (``format=1``, what ``--format 1`` writes): the reader above knows only
# format 1. Format 2's reader from the text is tests/test_format2_conformance.py.
OPTS = {
    "paper": PAPER,
    "auto": EncodeOptions(format=1),
    "naive": NAIVE,
    "bitmask-xor-zstd": EncodeOptions(index_encodings=("bitmask",), value_modes=("xor",), codecs=("zstd",), format=1),
    "dense": EncodeOptions(index_encodings=("dense",), format=1),
}


@pytest.mark.parametrize("opt", list(OPTS))
def test_independent_reader_reproduces_new_weights(steps, opt: str) -> None:
    plan, base, new = steps
    segs, params = encode_delta(plan, base, new, 7, OPTS[opt], segment_bytes=8192)
    assert len(segs) > 1
    held = {n: as_bits(t) for n, t in fuse(plan, base).items()}
    want = {n: as_bits(t) for n, t in fuse(plan, new).items()}
    assert any(not np.array_equal(held[n], want[n]) for n in held)
    total = sum(independent_apply(d, held) for _, d in segs)
    assert total == sum(p["nnz"] for p in params.values())
    for n in want:
        assert np.array_equal(held[n], want[n]), n


def test_paper_segment_layout(steps) -> None:
    plan, base, new = steps
    segs, _ = encode_delta(plan, base, new, 3, PAPER)
    meta, tensors = read_container(segs[0][1])
    assert meta["aurora.version"] == "3" and meta["aurora.base_version"] == "2"
    for e in json.loads(meta["aurora.entries"]):
        assert e["encoding"] == "leb128"
        assert e.get("values", "new") == "new" and "idx_codec" not in e and "val_codec" not in e
        assert tensors[e["idx"]][0] == "U8" and tensors[e["val"]][0] == "BF16"
        assert tensors[e["val"]][1] == [e["nnz"]]
        assert set(e) >= {
            "param",
            "shape",
            "dtype",
            "start",
            "stop",
            "nnz",
            "encoding",
            "idx",
            "val",
        }
        assert 0 <= e["start"] < e["stop"] <= int(np.prod(e["shape"]))


def test_readable_by_safetensors_torch(steps, tmp_path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load

    plan, base, new = steps
    segs, _ = encode_delta(plan, base, new, 1, EncodeOptions(), segment_bytes=8192)
    for i, (_, data) in enumerate(segs):
        loaded = load(data)
        path = tmp_path / f"seg-{i}.safetensors"
        path.write_bytes(data)
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
            keys = set(f.keys())
            entries = json.loads(meta["aurora.entries"])
            for e in entries:
                for name in (e.get("idx"), e["val"]):
                    if name is None:
                        continue
                    assert name in keys
                    t = f.get_tensor(name)
                    assert torch.equal(t, loaded[name])
                    assert t.dim() == 1
        assert meta["aurora.format"] == "2" and meta["aurora.kind"] == "delta"  # the writers' default
        _, mine = read_container(data)
        for name, (_code, shape, raw) in mine.items():
            assert list(loaded[name].shape) == shape
            assert loaded[name].contiguous().view(torch.uint8).numpy().tobytes() == raw


def test_readable_by_safetensors_numpy() -> None:
    from safetensors.numpy import load

    base = {"f": torch.randn(300).float()}
    new = {"f": base["f"].clone()}
    new["f"][::7] += 1
    plan = FusionPlan.from_specs({"f": spec_of(base["f"])})
    for opts in (NAIVE, EncodeOptions(value_modes=("xor",), codecs=("none",), format=1), EncodeOptions(format=1)):
        segs, _ = encode_delta(plan, base, new, 1, opts)
        (seg,) = [d for _, d in segs]
        arrays = load(seg)
        entries = json.loads(read_container(seg)[0]["aurora.entries"])
        (e,) = entries
        assert arrays[e["val"]].ndim == 1
        held = {"f": as_bits(base["f"])}
        independent_apply(seg, held)
        assert np.array_equal(held["f"], as_bits(new["f"]))


def test_independent_reader_rejects_what_the_library_rejects() -> None:
    """The reference reader is not vacuous: it refuses FORMAT.md violations too."""
    with pytest.raises(FormatViolation):
        leb128_gaps(b"\x80" * 11)
    with pytest.raises(FormatViolation):
        leb128_gaps(b"\x01\x80")
    assert leb128_gaps(bytes.fromhex("C6 01 7F 80 01")) == [198, 127, 128]
