"""The weights digest inside vLLM's workers, off the Actor's safe point (FORMAT.md §4.1).

Runs in the worker processes (imported by :mod:`workers.engine.vllm_worker`). The
tensors hashed are FORMAT.md §2's: fused experts as the Trainer holds them, unpadded
and unpacked from vLLM's kernel layout (``Held.whole``, ``Held.whole_at``).

- tp=1: the rank holds every whole tensor, so :func:`start` hands the hash
  to a background thread of the worker and returns at once: the model
  generates meanwhile (reads only; hashlib and the device-to-host copies
  release the GIL), and the tree form hashes its leaves in threads. A
  weight write that begins before the hash ends (``Held.writes`` moved)
  voids the result: it would speak for no version.
- tensor parallelism: the leaves are whole tensors, which no rank holds.
  :func:`gathered` runs in the RPC on every rank: each tensor in turn is
  gathered to rank 0 only (``gather``: the other ranks send their shard
  once; nobody receives the whole model) and streamed there to its hasher,
  a bounded number of leaves in flight in threads. Collectives cannot leave
  vLLM's worker thread, so this runs between two model steps, never in the
  safe point; rank 0 answers the digest, the others None.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

from aurora_store.apply.sink import TREE_PREFIX, digest_as
from aurora_store.codec.extract import bits_view

if TYPE_CHECKING:
    from workers.engine.vllm_params import Held

__all__ = ["gathered", "result", "start"]

_CHUNK = 1 << 24
"""Elements copied to the host per step of one tensor's hash."""


def start(h: Held, expected: str) -> None:
    """tp=1: hash the held weights in ``expected``'s form in a background thread (one at a time)."""
    if h.digest_job is not None and not h.digest_job.done():
        return  # one under way: its answer (or None, if a write raced it) comes first
    if h.digest_pool is None:
        h.digest_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aurora-digest")
    h.digest_job = h.digest_pool.submit(_local, h, expected)


def result(h: Held, wait_s: float) -> dict[str, object] | None:
    """``{"digest": str | None}`` once the hash :func:`start` began is done (None: a write raced it); None while it runs."""
    job = h.digest_job
    if job is None:
        return {"digest": None}
    try:
        got = job.result(timeout=wait_s)
    except TimeoutError:
        return None
    return {"digest": got}


def _local(h: Held, expected: str) -> str | None:
    seq = h.writes
    if seq % 2:
        return None
    got = digest_as(expected, h.whole(), h.plan)
    return got if h.writes == seq else None


def gathered(h: Held, expected: str) -> str | None:
    """Under tensor parallelism: every tensor gathered to rank 0 in turn and hashed there; rank 0's answer."""
    names = sorted(h.plan.params)
    tree = expected.startswith(TREE_PREFIX)
    me = h.rank == 0
    stream = hashlib.sha256()
    width = max(1, os.cpu_count() or 1)
    pending: deque[tuple[str, Future[str]]] = deque()
    leaves: dict[str, str] = {}
    with ThreadPoolExecutor(width if tree else 1, thread_name_prefix="aurora-digest") as pool:
        for name in names:
            p = h.plan.params[name]
            whole = [h.whole_at(b.source) for b in p.blocks]  # collective: every rank, same order
            if not me:
                continue
            tensors = [t for t in whole if t is not None]
            if not tree:
                stream.update(f"{name}|{list(p.spec.shape)}|{p.spec.dtype}\n".encode())
                for t in tensors:
                    _update(stream, t)
                continue
            pending.append((name, pool.submit(_leaf, tensors)))
            while len(pending) > width:  # bounded: gathered tensors wait for their hasher, not pile up
                n, f = pending.popleft()
                leaves[n] = f.result()
        for n, f in pending:
            leaves[n] = f.result()
    if not me:
        return None
    if not tree:
        return "sha256:" + stream.hexdigest()
    top = hashlib.sha256()
    for name in names:
        p = h.plan.params[name]
        top.update(f"{name}|{list(p.spec.shape)}|{p.spec.dtype}|{leaves[name]}\n".encode())
    return TREE_PREFIX + top.hexdigest()


def _leaf(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        _update(h, t)
    return h.hexdigest()


def _update(h: hashlib._Hash, t: torch.Tensor) -> None:
    """``t``'s raw little-endian bytes in C order into ``h``, a chunk at a time (FORMAT.md §4.1)."""
    flat = bits_view(t.detach().contiguous())
    for lo in range(0, flat.numel(), _CHUNK):
        chunk = flat[lo : lo + _CHUNK].cpu().numpy()
        if chunk.dtype.byteorder == ">" or (chunk.dtype.byteorder == "=" and sys.byteorder == "big"):
            chunk = chunk.astype(chunk.dtype.newbyteorder("<"))
        h.update(np.ascontiguousarray(chunk).view(np.uint8).data)
