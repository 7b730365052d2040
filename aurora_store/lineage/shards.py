"""Snapshot shards built straight from the weights: one safetensors file at a time, no fused copy.

Why: a snapshot used to be written from ``fuse_weights`` (a fused copy of the
whole version, 2 bytes per bf16 parameter) through ``safetensors.torch.save``
(which copies every tensor into a ``bytes`` of its own, then all of them into
the file's bytes): three versions' worth of memory beside the one the writer
holds, on a thread that runs while the Trainer's next step does. Here each
shard's file is laid out first (header, then where each tensor's bytes go),
and the tensors, fused or not, are copied once, block by block, straight into
the one buffer that becomes the object; the next shard is built only when an
upload slot is free. What a snapshot holds beside the weights is then the
shards being uploaded, each at most ``shard_bytes`` (one file is a whole
object to the store), never a fused copy.

The bytes are those ``safetensors.torch.save`` writes (version 0.8; checked in
``tests/test_snapshot_shards.py``): an 8-byte little-endian header length, the
header as compact JSON (``__metadata__`` first, then the tensors in the order
their data follows: by dtype, widest first as safetensors ranks them, then by
name), padded with spaces to a multiple of 8, then the tensors' raw bytes in
C order. One difference, on purpose: safetensors writes the metadata members
in an order that varies from call to call (a Rust hash map); here they follow
the mapping given, so a retry of the same attempt writes the same bytes.
"""

from __future__ import annotations

import io
import json
import struct
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from aurora_store.codec.extract import spec_of
from aurora_store.codec.fusion import FusionPlan

__all__ = ["ReadGate", "ShardTensor", "shard_file", "shard_groups", "snapshot_tensors"]

_ST_DTYPE = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
"""Manifest dtype -> safetensors' name."""
_ST_RANK = {"F32": 0, "BF16": 1, "F16": 2}
"""Where safetensors puts each dtype's data: wider (and, at equal width, later in its enum) first."""


@dataclass(frozen=True, slots=True)
class ShardTensor:
    """One tensor of a snapshot under its fused name, and the source tensors whose bytes make it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    """As in a manifest's ``params`` (``bfloat16``, ``float16``, ``float32``)."""
    parts: tuple[torch.Tensor, ...]
    """Source tensors whose C-order bytes, one after the other, are this tensor's (one: unfused)."""
    nbytes: int


def snapshot_tensors(tensors: Mapping[str, torch.Tensor], plan: FusionPlan | None = None) -> list[ShardTensor]:
    """The tensors a snapshot of ``tensors`` holds, sorted by name; nothing is copied.

    ``plan`` None: ``tensors`` are already under fused names. Else they are under
    source names and each fused tensor is the concatenation of its blocks, as
    :func:`~aurora_store.codec.extract.fuse_weights` makes it (a tied head the plan
    dropped is not written).
    """
    out: list[ShardTensor] = []
    if plan is None:
        for name in sorted(tensors):
            t = tensors[name].detach()
            out.append(ShardTensor(name, tuple(t.shape), spec_of(t, name).dtype, (t,), t.numel() * t.element_size()))
        return out
    for p in sorted(plan, key=lambda p: p.name):
        parts = tuple(tensors[b.source].detach() for b in p.blocks)
        dtypes = {spec_of(t, b.source).dtype for t, b in zip(parts, p.blocks, strict=True)}
        if len(dtypes) != 1:
            raise ValueError(f"{p.name}: its blocks differ in dtype ({sorted(dtypes)})")
        # One block keeps its tensor's own shape (fuse_weights clones it); blocks are concatenated flat.
        shape = tuple(parts[0].shape) if len(parts) == 1 else tuple(p.spec.shape)
        nbytes = sum(t.numel() * t.element_size() for t in parts)
        out.append(ShardTensor(p.name, shape, dtypes.pop(), parts, nbytes))
    return out


def shard_groups(items: Sequence[ShardTensor], shard_bytes: int) -> Iterator[list[ShardTensor]]:
    """``items`` (sorted by name) cut into shards: a new one starts when the next tensor would take the
    current past ``shard_bytes`` (a tensor larger than that is a shard of its own). Yields one empty
    list when there are no tensors (the shards are numbered from 0 either way)."""
    shard: list[ShardTensor] = []
    size = 0
    for it in items:
        if shard and size + it.nbytes > shard_bytes:
            yield shard
            shard, size = [], 0
        shard.append(it)
        size += it.nbytes
    yield shard


def _header(items: Sequence[ShardTensor], metadata: Mapping[str, str]) -> tuple[bytes, list[tuple[ShardTensor, int]]]:
    """The safetensors header (padded) and where each tensor's data starts, relative to the data."""
    order = sorted(items, key=lambda it: (_ST_RANK[_ST_DTYPE[it.dtype]], it.name))
    head: dict[str, object] = {"__metadata__": dict(metadata)}
    placed: list[tuple[ShardTensor, int]] = []
    at = 0
    for it in order:
        head[it.name] = {"dtype": _ST_DTYPE[it.dtype], "shape": list(it.shape), "data_offsets": [at, at + it.nbytes]}
        placed.append((it, at))
        at += it.nbytes
    text = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, placed


def shard_file(items: Sequence[ShardTensor], metadata: Mapping[str, str]) -> bytes:
    """The safetensors file of one shard, built in the one buffer the returned ``bytes`` is (see the module)."""
    head, placed = _header(items, metadata)
    total = len(head) + sum(it.nbytes for it in items)
    buf = io.BytesIO()
    buf.seek(total - 1)
    buf.write(b"\0")  # one allocation of the whole file; getvalue() below hands it over without a copy
    with buf.getbuffer() as view:
        view[: len(head)] = head
        dst = torch.frombuffer(view, dtype=torch.uint8)
        base = len(head)
        for it, at in placed:
            pos = base + at
            for part in it.parts:
                n = part.numel() * part.element_size()
                if n:
                    src = part.cpu().contiguous().reshape(-1).view(torch.uint8)  # a copy only of a part not so already
                    dst[pos : pos + n].copy_(src)
                    pos += n
        del dst
    return buf.getvalue()


class ReadGate:
    """Lets the weights' owner take their memory away for a while from under a snapshot being written.

    The snapshot's thread reads the weights only inside :meth:`reading` (one
    shard file built at a time, a copy at memory speed); the owner, inside
    :meth:`paused`, knows nobody reads them: it waits for the shard being
    built, and the next waits until it leaves. A Trainer parks the version
    it publishes this way (its pages handed back to the system during the
    update, ``workers/trainer/park.py``) even while that version's snapshot
    is uploading: the snapshot pauses, and its uploads in flight go on.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._pauses = 0
        self._waiting = 0

    def state(self) -> tuple[int, int, int]:
        """(readers inside, pauses inside or waiting to be, readers waiting for the pauses to end)."""
        with self._cond:
            return self._readers, self._pauses, self._waiting

    @contextmanager
    def reading(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            self._cond.wait_for(lambda: self._pauses == 0)
            self._waiting -= 1
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextmanager
    def paused(self) -> Iterator[None]:
        with self._cond:
            self._pauses += 1
            self._cond.wait_for(lambda: self._readers == 0)
        try:
            yield
        finally:
            with self._cond:
                self._pauses -= 1
                self._cond.notify_all()
