"""Decoding an untrusted entry: every field validated, the streams
decompressed within their bounds, plain arrays returned ready to apply.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from aurora_store.codec import encodings as enc
from aurora_store.codec import v2
from aurora_store.codec.encodings import DTYPES, StreamError
from aurora_store.codec.entry_types import DecodedEntry, ParamSpec

__all__ = ["MAX_NUMEL", "Claim", "decode_entry", "decoded_cost"]


_INT_FIELDS = ("start", "stop", "nnz")
#: Flat indices are int64 on every path; no parameter may have more elements.
MAX_NUMEL = 1 << 63


def _field(meta: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in meta:
        raise StreamError(f"missing field {name!r}")
    v = meta[name]
    if not isinstance(v, kind) or isinstance(v, bool):
        raise StreamError(f"field {name!r} has type {type(v).__name__}")
    return v


#: ``claim(param, start, stop, nnz, cost)``: called once an entry's metadata is
#: valid and before any of its streams is decompressed; ``cost`` is the bytes
#: the decoded entry will hold (values, plus int64 indices unless dense). It
#: raises :class:`StreamError` to refuse the entry (an overlap, a budget spent).
Claim = Callable[[str, int, int, int, int], None]


def decoded_cost(spec: ParamSpec, encoding: str, start: int, stop: int, nnz: int) -> int:
    """Bytes a decoded entry holds: its values, and int64 indices unless dense."""
    width = DTYPES[spec.dtype].width
    if encoding == "dense":
        return (stop - start) * width
    return nnz * (width + 8)


def decode_entry(
    meta: Mapping[str, Any],
    tensor: Callable[[str], tuple[str, tuple[int, ...], memoryview]],
    model: Mapping[str, ParamSpec] | None,
    claim: Claim | None = None,
    fmt: int = 1,
) -> DecodedEntry:
    """Validate one entry's metadata and streams; raises :class:`StreamError`.

    ``tensor(name)`` returns (safetensors dtype code, shape, bytes) of a tensor
    of the segment, raising :class:`StreamError` if there is none. ``model``
    maps fused names to specs; when given, the entry must match it.
    ``claim`` (see :data:`Claim`) lets a caller bound a whole version: it
    sees the entry before a byte of it is decompressed. ``fmt`` is the
    segment's format: format 2's ``rice`` encoding and ``planes`` codec are
    refused in a format-1 segment.
    """
    if not isinstance(meta, Mapping):
        raise StreamError("entry is not a JSON object")
    param = _field(meta, "param", str)
    start, stop, nnz = (_field(meta, f, int) for f in _INT_FIELDS)
    raw_shape = _field(meta, "shape", list)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in raw_shape):
        raise StreamError(f"shape {raw_shape!r} is not a list of non-negative integers")
    dtype = _field(meta, "dtype", str)
    if dtype not in DTYPES:
        raise StreamError(f"unknown dtype {dtype!r}")
    spec = ParamSpec(tuple(raw_shape), dtype)
    if model is not None:
        have = model.get(param)
        if have is None:
            raise StreamError(f"the model has no parameter {param!r}")
        if have != spec:
            raise StreamError(
                f"parameter {param!r} is {list(spec.shape)} {spec.dtype} in the delta, {list(have.shape)} {have.dtype} in the model"
            )
    numel = spec.numel
    if numel >= MAX_NUMEL:
        raise StreamError(f"shape {list(spec.shape)} has {numel} elements, more than 2^63 - 1")
    if not 0 <= start < stop <= numel:
        raise StreamError(f"range [{start}, {stop}) is not inside [0, {numel})")
    span = stop - start
    if not 0 <= nnz <= span:
        raise StreamError(f"nnz {nnz} impossible for a range of {span} elements")
    encoding = _field(meta, "encoding", str)
    if encoding in v2.FORMAT2_INDEX_ENCODINGS and fmt < 2:
        raise StreamError(f"encoding {encoding!r} needs a format-2 segment, this one is format {fmt}")
    if encoding not in enc.INDEX_ENCODINGS + v2.FORMAT2_INDEX_ENCODINGS:
        raise StreamError(f"unknown encoding {encoding!r}")
    values = meta.get("values", "new")
    if values not in enc.VALUE_MODES:
        raise StreamError(f"unknown values mode {values!r}")
    idx_codec = meta.get("idx_codec", "none")
    val_codec = meta.get("val_codec", "none")
    for name, c in (("idx_codec", idx_codec), ("val_codec", val_codec)):
        if name == "val_codec" and c in v2.FORMAT2_CODECS and fmt < 2:
            raise StreamError(f"val_codec {c!r} needs a format-2 segment, this one is format {fmt}")
        if c not in enc.CODECS + (v2.FORMAT2_CODECS if name == "val_codec" else ()):
            raise StreamError(f"unknown {name} {c!r}")
    if encoding == "rice" and idx_codec != "none":
        raise StreamError(f"idx_codec {idx_codec!r} with encoding 'rice' (only 'none' is allowed)")
    info = DTYPES[dtype]
    if claim is not None:
        claim(param, start, stop, nnz, decoded_cost(spec, encoding, start, stop, nnz))

    count = span if encoding == "dense" else nnz
    indices: np.ndarray | None = None
    if encoding != "dense":
        idx_name = _field(meta, "idx", str)
        code, shape, data = tensor(idx_name)
        if code != "U8" or len(shape) != 1:
            raise StreamError(f"index tensor {idx_name!r} must be a 1-D U8 tensor, is {code} {list(shape)}")
        if encoding == "rice":
            indices = v2.decode_rice(data, start, stop, nnz)
        else:
            bound = enc.index_stream_bound(encoding, nnz, start, stop)
            if idx_codec == "zstd":
                exact = None if encoding == "leb128" else bound
                data = memoryview(enc.zstd_decompress(data, exact, bound))
            elif len(data) > bound:
                raise StreamError(f"index stream of {len(data)} bytes exceeds its bound {bound}")
            indices = enc.decode_indices(encoding, data, start, stop, nnz)

    val_name = _field(meta, "val", str)
    code, shape, data = tensor(val_name)
    width = info.width
    if val_codec == "planes":
        if code != "U8" or len(shape) != 1:
            raise StreamError(f"value tensor {val_name!r} with planes must be a 1-D U8 tensor, is {code} {list(shape)}")
        bits = v2.decode_planes(data, count, width).astype(info.bits, copy=False)
    else:
        if val_codec == "zstd":
            if code != "U8" or len(shape) != 1:
                raise StreamError(f"value tensor {val_name!r} with zstd must be a 1-D U8 tensor, is {code} {list(shape)}")
            data = memoryview(enc.zstd_decompress(data, count * width, count * width))
        else:
            want = info.st_code if values == "new" else info.bits_code
            if code != want:
                raise StreamError(f"value tensor {val_name!r} has dtype {code}, expected {want}")
            if tuple(shape) != (count,):
                raise StreamError(f"value tensor {val_name!r} has shape {list(shape)}, expected [{count}]")
        if len(data) != count * width:
            raise StreamError(f"value stream holds {len(data)} bytes, expected {count * width}")
        bits = np.frombuffer(data, dtype=info.bits.newbyteorder("<")).astype(info.bits, copy=False)
    if indices is None and values == "xor":
        changed = int(np.count_nonzero(bits))
        if changed != nnz:
            raise StreamError(f"dense xor stream changes {changed} elements, nnz is {nnz}")
    return DecodedEntry(param, spec, start, stop, nnz, indices, bits, values)
