"""``torch.distributed.checkpoint`` (DCP) over Aurora's store: each rank writes its own objects, no pickle.

Why not DCP's own file system writer: its ``.metadata`` file is a pickle and
its non-tensor items are read back with ``torch.load(weights_only=False)``;
the bucket is shared, so reading either would run whatever a writer put
there. Here DCP only plans (which rank writes which chunk of which tensor,
and on load which bytes each rank needs at its world size); the bytes are raw
tensor data in objects under the checkpoint's folder, and the layout is plain
JSON in the checkpoint record (:mod:`~workers.trainer.checkpoint`), which
lists every object's size and SHA-256. Non-tensor state never goes through DCP.

A rank's chunks are packed into parts of about ``part_bytes``
(``<attempt>/rank-00001/part-00000.bin``, each chunk 64-byte aligned), so the
copy a part needs in host memory is bounded by the part size, never by the
model: one part at a time, made once (joined from the tensors, or read from
the spool). A chunk larger than a part is recorded as several chunks of
whole rows along its first dimension, each at most a part (a layout DCP
reads at any world size, as it reads the shards of several ranks). Why: the
upload runs while the next steps train, and the store's client holds a few
copies of the object it sends; a 32,768-row embedding's fp32 chunk (and each
of AdamW's moments of it) was one 100 MB part, several hundred MB on top of
the backward pass's peak. :meth:`StoreWriter.write_data`
only lays the parts out (DCP's save returns at once); :meth:`StoreWriter.spool`
copies the live tensors' bytes into a local file at the parts' offsets, and
:meth:`StoreWriter.upload` writes the parts, from that file or from the live
tensors, whenever the caller runs them (a background thread in
:mod:`~workers.trainer.ckpt_async`).

On load each rank reads only the objects holding the bytes it needs, each
capped at its recorded size and checked against its recorded SHA-256.
"""

from __future__ import annotations

import hashlib
import math
import os
import warnings
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from aurora_store.errors import IntegrityError, ManifestError
from aurora_store.storage import Store
from workers.trainer.spool import write_at

__all__ = ["DTYPES", "ObjectEntry", "StoreReader", "StoreWriter", "parse_layout"]

PART_BYTES = 32 << 20
"""Default size of one part object (a rank's chunks are packed into parts of about this size).

Why this small: the part being uploaded is the checkpoint's only copy in process memory (0.16
bytes per parameter of a 200 M model), and below s3fs's multipart threshold (100 MiB) a part is
one request, not slices of it copied again."""
_ALIGN = 64
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
"""The tensor types a checkpoint may hold (anything else in a record is refused)."""
_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_DIMS = 8


@dataclass(frozen=True, slots=True)
class ObjectEntry:
    """One object of a checkpoint as its record lists it."""

    key: str
    bytes: int
    sha256: str


def _part_key(attempt: str, rank: int, part: int) -> str:
    return f"{attempt}/rank-{rank:05d}/part-{part:05d}.bin"


class StoreWriter(StorageWriter):
    """Lays out one rank's chunks into part objects; :meth:`upload` writes them.

    ``folder``: the checkpoint's folder in ``store``; ``attempt``: the same on
    every rank (chosen by rank 0), so a retried checkpoint never mixes with one
    left half-written. After ``dcp.save`` the coordinator's :attr:`layout`
    holds the JSON table of every tensor's chunks.
    """

    def __init__(self, store: Store, folder: str, attempt: str, rank: int, part_bytes: int = PART_BYTES) -> None:
        super().__init__()
        self.store = store
        self.folder = folder
        self.attempt = attempt
        self.rank = rank
        self.part_bytes = max(1, part_bytes)
        self.parts: list[list[tuple[int, torch.Tensor]]] = []
        """part -> [(offset in the part, tensor)], the tensors being the live ones."""
        self.part_sizes: list[int] = []
        self.layout: dict[str, Any] | None = None

    # -- StorageWriter ------------------------------------------------------------
    def reset(self, checkpoint_id: Any = None) -> None:
        self.parts, self.part_sizes, self.layout = [], [], None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        return None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results: list[WriteResult] = []
        size = 0
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raise TypeError(f"{item.index.fqn}: only tensors go into a checkpoint's objects (non-tensor state belongs in its record)")
            t = planner.resolve_data(item)
            assert isinstance(t, torch.Tensor)
            t = t.detach()
            pieces = []
            for row, piece in _row_pieces(t, self.part_bytes):
                n = piece.numel() * piece.element_size()
                if not self.parts or (size and size + n > self.part_bytes):
                    self.parts.append([])
                    self.part_sizes.append(0)
                    size = 0
                at = size
                self.parts[-1].append((at, piece))
                size = -(-(at + n) // _ALIGN) * _ALIGN
                self.part_sizes[-1] = at + n
                pieces.append({"row": row, "rows": int(piece.shape[0]) if piece.dim() else 0, "object": self._key(), "at": at})
            storage = pieces[0] if len(pieces) == 1 else {"pieces": pieces}
            results.append(WriteResult(index=item.index, size_in_bytes=t.numel() * t.element_size(), storage_data=storage))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _key(self) -> str:
        """Key of the part being filled."""
        return _part_key(self.attempt, self.rank, len(self.parts) - 1)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        where: dict[tuple[str, tuple[int, ...]], Any] = {}
        for rank_results in results:
            for r in rank_results:
                where[(r.index.fqn, tuple(r.index.offset or ()))] = r.storage_data
        layout: dict[str, Any] = {}
        for name, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                raise TypeError(f"{name}: only tensors go into a checkpoint's objects")
            chunks = []
            for c in md.chunks:
                st = where[(name, tuple(c.offsets))]
                if "pieces" not in st:
                    chunks.append({"offsets": list(c.offsets), "sizes": list(c.sizes), "object": st["object"], "at": st["at"]})
                    continue
                for p in st["pieces"]:  # a chunk larger than a part: its rows, piece by piece
                    offsets = [c.offsets[0] + p["row"], *c.offsets[1:]]
                    chunks.append({"offsets": offsets, "sizes": [p["rows"], *c.sizes[1:]], "object": p["object"], "at": p["at"]})
            layout[name] = {"dtype": _NAMES[md.properties.dtype], "size": list(md.size), "chunks": chunks}
        self.layout = layout

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def storage_meta(self) -> None:
        return None

    # -- the bytes ----------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of this rank's parts (what :meth:`spool` writes, and the upload)."""
        return sum(self.part_sizes)

    def _offsets(self) -> list[int]:
        out, at = [], 0
        for size in self.part_sizes:
            out.append(at)
            at += size
        return out

    def spool(self, fd: int) -> None:
        """Copy every part's bytes from the live tensors into the file ``fd``, part ``i`` at the sum
        of the sizes of the parts before it (alignment gaps written as zeros): after this returns,
        the tensors may change and :meth:`upload` reads the file instead. OSError as the file's."""
        for base, items in zip(self._offsets(), self.parts, strict=True):
            end = 0
            for at, t in items:
                if at > end:
                    write_at(fd, bytes(at - end), base + end)
                data = _raw(t)
                write_at(fd, data, base + at)
                end = at + len(data)

    def upload(self, stopped: Callable[[], bool] = lambda: False, spool: int | None = None) -> list[ObjectEntry]:
        """Write this rank's parts create-only, one at a time; their entries (size, SHA-256).

        ``spool``: the file :meth:`spool` filled (the tensors may have changed since); None:
        read from the tensors as they are now (the caller keeps them unchanged until this returns).
        """
        out = []
        for i, (base, size) in enumerate(zip(self._offsets(), self.part_sizes, strict=True)):
            if stopped():
                raise RuntimeError("stopped before the checkpoint was written")
            data = _read_all(spool, size, base) if spool is not None else self._joined(i)
            key = _part_key(self.attempt, self.rank, i)
            self.store.put(f"{self.folder}/{key}", data, mode="create")
            out.append(ObjectEntry(key, len(data), hashlib.sha256(data).hexdigest()))
            del data
        return out

    def _joined(self, i: int) -> bytes:
        """Part ``i`` from the live tensors, made in one copy (the alignment gaps as zeros)."""
        pieces: list[Any] = []
        end = 0
        for at, t in self.parts[i]:
            if at > end:
                pieces.append(bytes(at - end))
            data = _raw(t)
            pieces.append(data)
            end = at + len(data)
        return b"".join(pieces)


def _row_pieces(t: torch.Tensor, part_bytes: int) -> list[tuple[int, torch.Tensor]]:
    """``t`` as (first row, rows) pieces of at most ``part_bytes`` along its first dimension (at least
    one row each); ``[(0, t)]`` when it fits in a part or has no rows to split."""
    n = t.numel() * t.element_size()
    if n <= part_bytes or t.dim() < 1 or t.shape[0] < 2:
        return [(0, t)]
    row_bytes = max(1, n // int(t.shape[0]))
    step = max(1, part_bytes // row_bytes)
    return [(i, t[i : i + step]) for i in range(0, int(t.shape[0]), step)]


def _raw(t: torch.Tensor) -> memoryview:
    """A tensor's bytes as they are in memory (no copy for a contiguous host tensor; a device one is copied to the host)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if not flat.numel():
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data.cast("B")


def _read_all(fd: int, size: int, at: int) -> bytes:
    data = os.pread(fd, size, at)  # one read, unless the part is over the kernel's 2 GiB a call
    pieces = [data]
    got = len(data)
    while got < size:
        more = os.pread(fd, size - got, at + got)
        if not more:  # the file ends early: the spool was cut short under us
            raise OSError(f"checkpoint spool: {got} of {size} bytes at offset {at}")
        pieces.append(more)
        got += len(more)
    return data if len(pieces) == 1 else b"".join(pieces)


def _ints(x: Any, n: int | None, what: str) -> list[int]:
    if not isinstance(x, list) or (n is not None and len(x) != n) or len(x) > _MAX_DIMS:
        raise ValueError(f"{what} must be a list of {n if n is not None else 'at most 8'} integers")
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 48 for i in x):
        raise ValueError(f"{what} must hold non-negative integers")
    return x


def parse_layout(tensors: Any, objects: Mapping[str, ObjectEntry]) -> tuple[Metadata, dict[MetadataIndex, tuple[str, int, int]]]:
    """A record's ``tensors`` table as DCP metadata, checked (ValueError naming what is wrong).

    Every chunk lies inside its tensor and inside an object the record lists;
    the chunks of a tensor do not overlap and cover it whole (DCP would leave
    an uncovered part of a tensor unwritten, silently).
    """
    if not isinstance(tensors, dict):
        raise ValueError("tensors must be an object")
    sd_md: dict[str, Any] = {}
    storage: dict[MetadataIndex, tuple[str, int, int]] = {}
    for name, t in tensors.items():
        if not isinstance(t, dict) or t.get("dtype") not in DTYPES or not isinstance(t.get("chunks"), list):
            raise ValueError(f"tensor {name!r:.80}: dtype or chunks missing or unknown")
        dtype = DTYPES[t["dtype"]]
        size = _ints(t.get("size"), None, f"tensor {name!r:.80} size")
        elsize = torch.empty((), dtype=dtype).element_size()
        chunks = []
        boxes: list[tuple[list[int], list[int]]] = []
        total = 0
        for c in t["chunks"]:
            if not isinstance(c, dict) or not isinstance(c.get("object"), str) or c["object"] not in objects:
                raise ValueError(f"tensor {name!r:.80}: a chunk names no object of the record")
            offsets = _ints(c.get("offsets"), len(size), f"tensor {name!r:.80} chunk offsets")
            sizes = _ints(c.get("sizes"), len(size), f"tensor {name!r:.80} chunk sizes")
            if any(o + s > d for o, s, d in zip(offsets, sizes, size, strict=True)):
                raise ValueError(f"tensor {name!r:.80}: a chunk lies outside the tensor")
            at = c.get("at")
            nbytes = math.prod(sizes) * elsize
            if not isinstance(at, int) or isinstance(at, bool) or at < 0 or at + nbytes > objects[c["object"]].bytes:
                raise ValueError(f"tensor {name!r:.80}: a chunk lies outside its object")
            for o2, s2 in boxes:
                if all(a < b + sb and b < a + sa for a, sa, b, sb in zip(offsets, sizes, o2, s2, strict=True)) and nbytes:
                    raise ValueError(f"tensor {name!r:.80}: two chunks overlap")
            boxes.append((offsets, sizes))
            total += math.prod(sizes)
            chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            storage[MetadataIndex(name, offsets)] = (c["object"], at, nbytes)
        if total != math.prod(size):
            raise ValueError(f"tensor {name!r:.80}: its chunks do not cover it")
        sd_md[name] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size), chunks)
    return Metadata(state_dict_metadata=sd_md), storage


class StoreReader(StorageReader):
    """Reads the chunks a rank's state dict needs, each object capped at its recorded size and hashed.

    ``metadata`` and ``storage``: :func:`parse_layout` of the record; ``objects``:
    its objects by key; ``where`` names the record in errors.
    """

    def __init__(
        self,
        store: Store,
        folder: str,
        metadata: Metadata,
        storage: Mapping[MetadataIndex, tuple[str, int, int]],
        objects: Mapping[str, ObjectEntry],
    ) -> None:
        super().__init__()
        self.store = store
        self.folder = folder
        self.metadata = metadata
        self.storage = storage
        self.objects = objects

    def reset(self, checkpoint_id: Any = None) -> None:
        return None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        return None

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def _object(self, key: str) -> bytes:
        entry = self.objects[key]
        path = f"{self.folder}/{key}"
        data = self.store.get_capped(path, entry.bytes, "the size the checkpoint record lists")
        if len(data) != entry.bytes or hashlib.sha256(data).hexdigest() != entry.sha256:
            raise IntegrityError(f"{self.store.where(path)}: size or SHA-256 differs from the checkpoint record")
        return data

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_object: dict[str, list[Any]] = defaultdict(list)
        for item in plan.items:
            if item.storage_index not in self.storage:
                raise ManifestError(self.store.where(self.folder), f"no stored chunk for {item.storage_index.fqn!r:.80}")
            by_object[self.storage[item.storage_index][0]].append(item)
        for key in sorted(by_object):
            data = self._object(key)
            for item in by_object[key]:
                _, at, nbytes = self.storage[item.storage_index]
                md = self.metadata.state_dict_metadata[item.storage_index.fqn]
                assert isinstance(md, TensorStorageMetadata)
                chunk = next(c for c in md.chunks if c.offsets == item.storage_index.offset)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # a read-only buffer: only copied from
                    src = (
                        torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=at) if nbytes else torch.empty(0, dtype=torch.uint8)
                    )
                src = src.view(md.properties.dtype).reshape(chunk.sizes)
                for dim, (off, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                    src = src.narrow(dim, off, length)
                target = planner.resolve_tensor(item).detach()
                if target.shape != src.shape:
                    raise ManifestError(
                        self.store.where(self.folder), f"{item.dest_index.fqn!r:.80}: stored shape differs from the model's"
                    )
                target.copy_(src)
                planner.commit_tensor(item, target)
            del data
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut
