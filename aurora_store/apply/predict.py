"""The weights digest a prepared delta will leave, computed before it is written.

:func:`predicted_digest` reads the weights while they still hold the base,
through small scratch buffers that get the writes of their range before
they are hashed, so an engine can report its digest right after the safe
point instead of hashing every weight there.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Mapping

import numpy as np
import torch

from aurora_store.apply.prepared_delta import DenseWrite, PreparedDelta, SortedWrites
from aurora_store.apply.write_kernel import write_sorted
from aurora_store.codec.extract import bits_view
from aurora_store.codec.fusion import FusionPlan
from aurora_store.errors import ModelMismatchError

__all__ = ["predicted_digest"]

_CHUNK = 1 << 19  # elements per scratch buffer (1 MiB of bf16: stays in cache while it is patched and hashed)


def predicted_digest(
    prepared: PreparedDelta,
    tensors: Mapping[str, torch.Tensor],
    plan: FusionPlan,
    jit: bool | None = None,
) -> str | None:
    """``weights_digest(tensors, plan)`` as it will be once ``prepared`` is written; ``tensors`` unchanged.

    Reads every weight once, through a scratch buffer that gets the writes of
    its range before it is hashed: the digest of FORMAT.md §4.1 without
    writing the weights. None where it cannot be predicted here (weights on
    an accelerator, a big-endian host): the caller hashes after writing.
    """
    if sys.byteorder != "little" or any(t.device.type != "cpu" for t in tensors.values()):
        return None
    prepared.check_live(tensors)
    sparse: dict[str, list[SortedWrites]] = {}
    for w in prepared.sparse:
        sparse.setdefault(w.source, []).append(w)
    dense: dict[str, list[DenseWrite]] = {}
    for d in prepared.dense:
        dense.setdefault(d.source, []).append(d)
    h = hashlib.sha256()
    scratch: dict[int, np.ndarray] = {}
    for name in sorted(plan.params):
        p = plan.params[name]
        h.update(f"{name}|{list(p.spec.shape)}|{p.spec.dtype}\n".encode())
        for b in p.blocks:
            t = tensors[b.source]
            flat = bits_view(t.detach().contiguous()).numpy()
            flat = flat.view(np.dtype(f"u{flat.dtype.itemsize}"))
            ws, ds = sparse.get(b.source, ()), dense.get(b.source, ())
            if not ws and not ds:
                h.update(flat.data.cast("B"))
                continue
            buf = scratch.setdefault(flat.dtype.itemsize, np.empty(_CHUNK, dtype=flat.dtype))
            for lo in range(0, flat.size, _CHUNK):
                hi = min(flat.size, lo + _CHUNK)
                part = buf[: hi - lo]
                np.copyto(part, flat[lo:hi])
                for d in ds:
                    a, z = max(lo, d.start), min(hi, d.start + d.bits.size)
                    if z > a:
                        seg = d.bits[a - d.start : z - d.start]
                        if d.xor:
                            np.bitwise_xor(part[a - lo : z - lo], seg, out=part[a - lo : z - lo])
                        else:
                            part[a - lo : z - lo] = seg
                for w in ws:
                    klo, khi = (int(x) for x in np.searchsorted(w.indices, (lo, hi)))
                    if not write_sorted(part, lo, w.indices, w.bits, klo, khi, w.xor, jit):
                        raise ModelMismatchError(f"delta {prepared.version}: an index is outside {b.source}")
                h.update(part.data.cast("B"))
    return "sha256:" + h.hexdigest()
