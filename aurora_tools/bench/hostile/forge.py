"""Builders of hostile (and valid) versions, shared by ``aurora bench hostile`` and the tests.

Everything here writes bytes into a store the way someone with write access
but no key could: segments forged from the safetensors spec (independently of
``aurora_store.format.segment``, so a forgery does not lean on the reader it
attacks), manifests that match those bytes so they get past the sha256 check
and reach the segment reader, decode bombs, oversized headers and manifests.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch
import zstandard

from aurora_store.codec import varint
from aurora_store.codec.entries import PAPER, EncodeOptions, encode_entry
from aurora_store.codec.extract import extract, spec_of
from aurora_store.codec.fusion import FusionPlan
from aurora_store.format.manifest import (
    Manifest,
    SegmentRef,
    chain_state,
    content_digest,
    manifest_key,
    version_dir,
)
from aurora_store.format.segment import encode_segment
from aurora_store.storage import LocalStore, Store

__all__ = [
    "Tensor",
    "write_safetensors",
    "read_safetensors",
    "rewrite_segment",
    "publish_raw_delta",
    "zeros_frame",
    "dense_entry",
    "segment",
    "bomb_one_param",
    "bomb_many_params",
    "BIG",
    "CountingStore",
    "TwoFacedStore",
    "model",
    "valid_segment",
    "raw_params",
    "M_CHANGED",
    "Mut",
    "ZSTD_ONLY",
    "NAIVE_U32",
    "BITMASK",
    "DENSE_XOR",
    "DELETE",
    "frame",
    "zeros_bomb",
    "leb",
    "set_tensor",
    "set_field",
    "retype_val",
    "shorten_val",
    "lengthen_val",
    "flip_in",
    "bit_past_range",
    "drop_tensor",
    "not_object",
    "SEGMENT_MUTATIONS",
    "mutated_segment",
    "hostile_segment",
]

Tensor = tuple[str, list[int], bytes]  # (dtype code, shape, raw bytes)


# --- safetensors containers ------------------------------------------------------


def write_safetensors(tensors: Iterable[tuple[str, str, list[int], bytes]], metadata: Mapping[str, str] | None) -> bytes:
    """(name, dtype code, shape, bytes) in the order given -> a safetensors file."""
    header: dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    body: list[bytes] = []
    off = 0
    for name, code, shape, raw in tensors:
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        body.append(raw)
        off += len(raw)
    hj = json.dumps(header).encode("utf-8")
    hj += b" " * (-len(hj) % 8)
    return struct.pack("<Q", len(hj)) + hj + b"".join(body)


def read_safetensors(data: bytes) -> tuple[dict[str, str], dict[str, Tensor]]:
    """A trusting reader (for valid inputs only): metadata and tensors, in file order."""
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__", {})
    body = data[8 + n :]
    items = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    return meta, {name: (t["dtype"], list(t["shape"]), bytes(body[t["data_offsets"][0] : t["data_offsets"][1]])) for name, t in items}


def rewrite_segment(
    data: bytes,
    entries: Callable[[list[dict[str, Any]]], None] | None = None,
    tensors: Callable[[dict[str, Tensor]], None] | None = None,
    metadata: Callable[[dict[str, str]], None] | None = None,
) -> bytes:
    """Re-serialize a valid segment after mutating its entries, tensors or metadata in place."""
    meta, tens = read_safetensors(data)
    ents = json.loads(meta["aurora.entries"])
    if entries is not None:
        entries(ents)
    if tensors is not None:
        tensors(tens)
    meta["aurora.entries"] = json.dumps(ents)
    if metadata is not None:
        metadata(meta)
    return write_safetensors([(name, code, shape, raw) for name, (code, shape, raw) in tens.items()], meta)


def publish_raw_delta(
    store: Store,
    version: int,
    base_state: str,
    segments: list[bytes],
    params: Mapping[str, Mapping[str, Any]],
    attempt: str = "0123456789abcdef",
) -> Manifest:
    """Commit arbitrary segment bytes as delta ``version`` with a manifest that
    matches them (sizes, sha256, state chain): hostile bytes then get past the
    integrity checks and reach the segment reader."""
    refs = []
    vdir = version_dir("delta", version)
    for i, data in enumerate(segments):
        rel = f"{attempt}/seg-{i:05d}.safetensors"
        store.put(f"{vdir}/{rel}", data)
        refs.append(SegmentRef(rel, len(data), hashlib.sha256(data).hexdigest()))
    m = Manifest(
        kind="delta",
        run="test",
        version=version,
        segments=tuple(refs),
        params={k: dict(v) for k, v in params.items()},
        state=chain_state(base_state, content_digest(refs)),
        base_version=version - 1,
        base_state=base_state,
    )
    store.put(manifest_key("delta", version), m.to_bytes())
    return m


# --- decode bombs ------------------------------------------------------------------

BIG = 1 << 20  # elements of one "large" parameter: 2 MiB of bf16


def zeros_frame(nbytes: int) -> bytes:
    """A few dozen bytes that decode to ``nbytes`` zero bytes (content size declared)."""
    return zstandard.ZstdCompressor(level=19, write_content_size=True).compress(bytes(nbytes))


def dense_entry(i: int, param: str, start: int, stop: int, numel: int = BIG) -> dict[str, Any]:
    return {
        "param": param,
        "shape": [numel],
        "dtype": "bfloat16",
        "start": start,
        "stop": stop,
        "nnz": stop - start,
        "encoding": "dense",
        "val": f"{i}.val",
        "val_codec": "zstd",
    }


def segment(entries: list[dict[str, Any]], frames: list[bytes], version: int = 1) -> bytes:
    meta = {
        "aurora.format": "1",
        "aurora.kind": "delta",
        "aurora.version": str(version),
        "aurora.base_version": str(version - 1),
        "aurora.entries": json.dumps(entries),
    }
    return write_safetensors([(f"{i}.val", "U8", [len(f)], f) for i, f in enumerate(frames)], meta)


def bomb_one_param(n: int) -> bytes:
    """``n`` dense entries, each a ~100-byte frame that decodes to all of ``big``: 2 MiB each."""
    frame = zeros_frame(2 * BIG)
    return segment([dense_entry(i, "big", 0, BIG) for i in range(n)], [frame] * n)


def bomb_many_params(n: int) -> bytes:
    """``n`` dense entries for ``n`` different parameters: no overlap, 2 MiB each."""
    frame = zeros_frame(2 * BIG)
    return segment([dense_entry(i, f"p{i}", 0, BIG) for i in range(n)], [frame] * n)


# --- a store that counts what it reads ----------------------------------------------


class CountingStore(LocalStore):
    """A real local store that counts reads of segment and shard objects.

    The counters live on the class so that a store opened anywhere during a
    run (by URL) shares them; reset them before each measurement.
    """

    segment_reads = 0
    read: list[str] = []

    def get(self, key: str) -> bytes:
        if not key.endswith("manifest.json") and key.startswith(("deltas/", "snapshots/")):
            type(self).segment_reads += 1
            type(self).read.append(key)
        return super().get(key)

    def get_capped(self, key: str, limit: int, what: str = "") -> bytes:
        if not key.endswith("manifest.json") and key.startswith(("deltas/", "snapshots/")):
            type(self).segment_reads += 1
            type(self).read.append(key)
        return super().get_capped(key, limit, what)

    @classmethod
    def reset(cls) -> None:
        cls.segment_reads = 0
        cls.read = []


# --- a store that changes its answer -------------------------------------------------


class TwoFacedStore:
    """A store that answers the first read of ``key`` truly and every later one with ``later``.

    What a mirror under someone else's control can do between the Actor's
    check and its workers' read.
    """

    def __init__(self, inner: Store, key: str, later: bytes) -> None:
        self.inner, self.key, self.later, self.reads = inner, key, later, 0

    def get(self, key: str, *a: Any, **kw: Any) -> bytes:
        if key == self.key:
            self.reads += 1
            if self.reads > 1:
                return self.later
        return self.inner.get(key, *a, **kw)

    def get_capped(self, key: str, *a: Any, **kw: Any) -> bytes:
        if key == self.key:
            self.reads += 1
            if self.reads > 1:
                return self.later
        return self.inner.get_capped(key, *a, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


# --- per-entry hostile segments (FORMAT.md §3, "A reader must reject ...") ---------

M_CHANGED = [3, 10, 50, 51, 100]  # flat indices of "m" that change


def model() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A three-parameter model and its next step: ``f`` (float32), ``m`` and ``w`` (bf16)."""
    g = torch.Generator().manual_seed(5)
    base = {
        "f": torch.randn(40, generator=g).float(),
        "m": torch.randn(8, 16, generator=g).bfloat16(),
        "w": torch.randn(64, generator=g).bfloat16(),
    }
    new = {n: t.clone() for n, t in base.items()}
    new["f"][[1, 30]] += 1
    new["m"].view(-1)[M_CHANGED] += 0.25
    return base, new


def raw_params() -> dict[str, dict[str, Any]]:
    """The manifest params table matching :func:`valid_segment`."""
    return {
        "f": {"shape": [40], "dtype": "float32", "nnz": 2},
        "m": {"shape": [8, 16], "dtype": "bfloat16", "nnz": 5},
    }


def valid_segment(target: EncodeOptions, version: int = 1) -> bytes:
    """Entry 0: ``f`` (paper encoding); entry 1: ``m`` with the target options."""
    base, new = model()
    plan = FusionPlan.from_specs({n: spec_of(t, n) for n, t in base.items()})
    deltas = {d.name: d for d in extract(plan, base, new)}
    entries = []
    for name, opts in (("f", PAPER), ("m", target)):
        d = deltas[name]
        entries.append(encode_entry(d.name, d.spec, 0, d.spec.numel, d.indices, d.new_bits, d.old_bits, opts, d.read_new_range))
    return encode_segment(entries, version, version - 1)


Mut = Callable[[list[Any], dict[str, Tensor]], None]
ZSTD_ONLY = EncodeOptions(index_encodings=("leb128",), value_modes=("new",), codecs=("zstd",))
NAIVE_U32 = EncodeOptions(index_encodings=("u32",), codecs=("none",), value_modes=("new",))
BITMASK = EncodeOptions(index_encodings=("bitmask",), codecs=("none",), value_modes=("new",))
DENSE_XOR = EncodeOptions(index_encodings=("dense",), value_modes=("xor",), codecs=("none",))
DELETE = object()  # a value for :func:`set_field`: remove the field


def frame(raw: bytes, content_size: bool = True) -> bytes:
    """One zstd frame of ``raw`` (declaring its size unless told not to)."""
    return zstandard.ZstdCompressor(write_content_size=content_size).compress(raw)


def zeros_bomb(n: int) -> bytes:
    """A frame of ``n`` zero bytes that does not declare its size: only decoding finds out."""
    cobj = zstandard.ZstdCompressor(level=1, write_content_size=False).compressobj()
    parts = [cobj.compress(bytes(1 << 20)) for _ in range(n >> 20)]
    return b"".join([*parts, cobj.flush()])


def leb(*gaps: int) -> bytes:
    return varint.encode(np.array(gaps, dtype=np.uint64))


def set_tensor(name: str, data: Callable[[], bytes] | bytes, code: str = "U8") -> Mut:
    """Replace tensor ``name`` with ``data`` (a callable is called only when the mutation runs)."""

    def mut(ents: list[Any], tens: dict[str, Tensor]) -> None:
        raw = data() if callable(data) else data
        width = {"U8": 1, "BF16": 2, "F16": 2, "U16": 2}[code]
        tens[name] = (code, [len(raw) // width], raw)

    return mut


def set_field(**kw: Any) -> Mut:
    """Set (or, with :data:`DELETE`, remove) fields of entry 1."""

    def mut(ents: list[Any], tens: dict[str, Tensor]) -> None:
        for k, v in kw.items():
            if v is DELETE:
                del ents[1][k]
            else:
                ents[1][k] = v

    return mut


def retype_val(code: str) -> Mut:
    def mut(ents: list[Any], tens: dict[str, Tensor]) -> None:
        _, shape, raw = tens["1.val"]
        tens["1.val"] = (code, shape, raw)

    return mut


def shorten_val(ents: list[Any], tens: dict[str, Tensor]) -> None:
    code, shape, raw = tens["1.val"]
    tens["1.val"] = (code, [shape[0] - 1], raw[:-2])


def lengthen_val(ents: list[Any], tens: dict[str, Tensor]) -> None:
    code, shape, raw = tens["1.val"]
    tens["1.val"] = (code, [shape[0] + 1], raw + b"\x00\x00")


def flip_in(name: str, pos: int) -> Mut:
    def mut(ents: list[Any], tens: dict[str, Tensor]) -> None:
        code, shape, raw = tens[name]
        b = bytearray(raw)
        b[pos] ^= 0xFF
        tens[name] = (code, shape, bytes(b))

    return mut


def bit_past_range(ents: list[Any], tens: dict[str, Tensor]) -> None:
    ents[1]["stop"] = 124  # range [0, 124) still needs 16 bytes; bit 126 lies past it
    code, shape, raw = tens["1.idx"]
    b = bytearray(raw)
    b[126 // 8] |= 1 << (126 % 8)
    tens["1.idx"] = (code, shape, bytes(b))


def drop_tensor(name: str) -> Mut:
    def mut(ents: list[Any], tens: dict[str, Tensor]) -> None:
        del tens[name]

    return mut


def not_object(ents: list[Any], tens: dict[str, Tensor]) -> None:
    ents[1] = ["m"]


#: name -> (encoding of entry 1, mutation, what the refusal must say): a subset
#: of tests/test_hostile_segments.py's cases, one per kind of check.
SEGMENT_MUTATIONS: dict[str, tuple[EncodeOptions, Mut, str]] = {
    "zstd-bomb-values": (ZSTD_ONLY, set_tensor("1.val", lambda: zeros_bomb(64 << 20)), "past the bound"),
    "zstd-declares-too-much": (ZSTD_ONLY, set_tensor("1.val", lambda: frame(bytes(1 << 20))), "declares 1048576 bytes"),
    "zstd-corrupt": (ZSTD_ONLY, flip_in("1.val", 6), "corrupt|truncated"),
    "zstd-trailing": (ZSTD_ONLY, set_tensor("1.val", lambda: frame(bytes(10)) + b"\x00"), "after its frame"),
    "unknown-codec": (PAPER, set_field(val_codec="brotli"), "unknown val_codec"),
    "unknown-encoding": (PAPER, set_field(encoding="rle"), "unknown encoding"),
    "truncated-varint": (PAPER, set_tensor("1.idx", leb(3, 7, 40, 1) + b"\xb1"), "truncated"),
    "varint-over-10-bytes": (PAPER, set_tensor("1.idx", b"\x83" + b"\x80" * 9 + b"\x00" + leb(7, 40, 1, 49)), "longer than 10 bytes"),
    "varint-above-2^63": (PAPER, set_tensor("1.idx", b"\xff" * 9 + b"\x01" + leb(7, 40, 1, 49)), "above 2"),
    "zero-gap": (PAPER, set_tensor("1.idx", leb(3, 7, 40, 0, 50)), "gap of 0"),
    "index-out-of-range": (PAPER, set_tensor("1.idx", leb(3, 7, 40, 1, 77)), "outside"),
    "nnz-too-large": (PAPER, set_field(nnz=6), "expected 6"),
    "value-dtype": (PAPER, retype_val("F16"), "expected BF16"),
    "value-too-short": (PAPER, shorten_val, "expected \\[5\\]"),
    "unknown-parameter": (PAPER, set_field(param="model.nope.weight"), "no parameter"),
    "wrong-shape": (PAPER, set_field(shape=[16, 8]), "in the model"),
    "range-past-numel": (PAPER, set_field(stop=129), "is not inside"),
    "missing-field": (PAPER, set_field(nnz=DELETE), "missing field"),
    "bool-is-not-int": (PAPER, set_field(stop=True), "has type bool"),
    "missing-val-tensor": (PAPER, drop_tensor("1.val"), "which the segment lacks"),
    "bitmask-bit-past-range": (BITMASK, bit_past_range, "past the range"),
    "u32-not-increasing": (NAIVE_U32, set_tensor("1.idx", np.array([3, 10, 51, 50, 100], "<u4").tobytes()), "not strictly increasing"),
    "dense-xor-count": (DENSE_XOR, set_field(nnz=3), "nnz is 3"),
    "entry-not-object": (PAPER, not_object, "not a JSON object"),
}


def mutated_segment(target: EncodeOptions, mutate: Mut) -> bytes:
    """The valid two-entry segment (entry 1 encoded with ``target``) after ``mutate``."""
    state: dict[str, Any] = {}

    def ents(e: list[Any]) -> None:
        state["e"] = e

    def tens(t: dict[str, Tensor]) -> None:
        mutate(state["e"], t)

    return rewrite_segment(valid_segment(target), entries=ents, tensors=tens)


def hostile_segment(name: str) -> bytes:
    """The valid two-entry segment with the named mutation applied to entry 1."""
    target, mutate, _ = SEGMENT_MUTATIONS[name]
    return mutated_segment(target, mutate)
