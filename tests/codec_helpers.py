"""Plain helpers shared by the codec tests (no fixtures: import them).

The safetensors reader/writer and ``publish_raw_delta`` come from
``aurora_tools.bench.hostile.forge`` (one copy for the bench and the tests),
written from the safetensors spec and FORMAT.md, independently of
``aurora_store.format.segment``, so that tests which forge hostile segments do
not lean on the code they are testing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch

from aurora_store.apply.sink import FusedWeights, SplitWeights, apply_delta
from aurora_store.codec.entries import DecodedEntry, EncodeOptions
from aurora_store.codec.extract import extract, fuse_weights
from aurora_store.codec.fusion import FusionPlan
from aurora_store.format.checkpoint import encode_segments, stage_segments
from aurora_tools.bench.hostile.forge import (  # noqa: F401  (re-exported to the tests)
    Tensor,
    publish_raw_delta,
    read_safetensors,
    rewrite_segment,
    write_safetensors,
)

# ---------------------------------------------------------------------------
# safetensors containers


def segment_entries(data: bytes) -> list[dict[str, Any]]:
    """The parsed ``aurora.entries`` of a segment."""
    return json.loads(read_safetensors(data)[0]["aurora.entries"])


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
    segs = [(f"seg-{s.index:05d}", s.data) for s in encode_segments(extract(plan, base, new), version, options, segment_bytes, params)]
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
