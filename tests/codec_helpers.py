"""Plain helpers shared by the codec tests (no fixtures: import them).

The safetensors reader/writer here is written from the safetensors spec and
FORMAT.md, independently of ``aurora_store.format.segment``, so that tests which
forge hostile segments do not lean on the code they are testing.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from aurora_store.apply.sink import FusedWeights, SplitWeights, apply_delta
from aurora_store.codec.entries import DecodedEntry, EncodeOptions
from aurora_store.codec.extract import extract, fuse_weights
from aurora_store.codec.fusion import FusionPlan
from aurora_store.format.checkpoint import encode_segments, stage_segments
from aurora_store.format.manifest import (
    Manifest,
    SegmentRef,
    chain_state,
    content_digest,
    manifest_key,
    version_dir,
)
from aurora_store.storage import Store

Tensor = tuple[str, list[int], bytes]  # (dtype code, shape, raw bytes)

# ---------------------------------------------------------------------------
# safetensors containers


def write_safetensors(
    tensors: Iterable[tuple[str, str, list[int], bytes]],
    metadata: Mapping[str, str] | None,
) -> bytes:
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
    """A trusting reader (for valid test inputs only): metadata and tensors, in file order."""
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__", {})
    body = data[8 + n :]
    items = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    tensors = {
        name: (
            t["dtype"],
            list(t["shape"]),
            bytes(body[t["data_offsets"][0] : t["data_offsets"][1]]),
        )
        for name, t in items
    }
    return meta, tensors


def segment_entries(data: bytes) -> list[dict[str, Any]]:
    """The parsed ``aurora.entries`` of a segment."""
    return json.loads(read_safetensors(data)[0]["aurora.entries"])


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
    return write_safetensors(
        [(name, code, shape, raw) for name, (code, shape, raw) in tens.items()], meta
    )


# ---------------------------------------------------------------------------
# weights


def fuse(plan: FusionPlan, w: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fused (vLLM) view of Hugging Face weights, as fresh contiguous tensors."""
    return fuse_weights(w, plan)


def int_view(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_bit_identical(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name in want:
        g, w = got[name], want[name]
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(int_view(g), int_view(w)), f"{name}: bits differ"


def bits_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over names and bit patterns (independent of aurora_store.apply.sink)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}|{list(t.shape)}|{t.dtype}\n".encode())
        h.update(int_view(t).numpy().tobytes())
    return h.hexdigest()


class RecordingSink:
    """Wraps a sink and counts writes, to prove apply was never reached."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.writes = 0

    def specs(self) -> Any:
        return self.inner.specs()

    def device(self, param: str) -> torch.device:
        return self.inner.device(param)

    def write(self, entry: DecodedEntry, indices: Any, bits: Any) -> None:
        self.writes += 1
        self.inner.write(entry, indices, bits)


# ---------------------------------------------------------------------------
# codec round trip


def encode_delta(
    plan: FusionPlan,
    base: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    version: int = 1,
    options: EncodeOptions | None = None,
    segment_bytes: int = 16 << 20,
) -> tuple[list[tuple[str, bytes]], dict[str, dict[str, Any]]]:
    """extract -> encode_segments: ``[(name, bytes)]`` and the manifest params table."""
    params: dict[str, dict[str, Any]] = {}
    segs = [
        (f"seg-{s.index:05d}", s.data)
        for s in encode_segments(extract(plan, base, new), version, options, segment_bytes, params)
    ]
    return segs, params


def roundtrip(
    plan: FusionPlan,
    base: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    options: EncodeOptions | None = None,
    segment_bytes: int = 16 << 20,
    sink: str = "fused",
) -> tuple[dict[str, torch.Tensor], list[tuple[str, bytes]]]:
    """Encode base -> new, stage against the plan's specs, apply to a copy of base.

    Returns the updated weights (fused names for ``fused``, source names for
    ``split``) and the segments.
    """
    segs, _ = encode_delta(plan, base, new, 1, options, segment_bytes)
    staged = stage_segments(segs, 1, plan.specs())
    if sink == "fused":
        held = fuse(plan, base)
        apply_delta(staged, FusedWeights(held))
    else:
        held = {n: t.clone() for n, t in base.items()}
        apply_delta(staged, SplitWeights(held, plan))
    return held, segs


# ---------------------------------------------------------------------------
# store


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
