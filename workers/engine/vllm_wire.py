"""What crosses ``collective_rpc`` between the vLLM engine and its workers: plain msgpack types only.

Replies are ``{"ok": value}`` or ``{"error": wire}`` with ``wire`` from
:func:`aurora_store.errors.error_to_wire`: an exception raised in a worker
would reach the engine as a bare string. Deltas decoded in the engine's
process travel as :func:`encode_entries` (arrays as bytes).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from aurora_store.codec.entries import DecodedEntry, ParamSpec
from aurora_store.errors import AuroraError, error_to_wire
from aurora_store.format.checkpoint import StagedDelta

__all__ = ["decode_entries", "encode_entries", "reply"]

log = logging.getLogger("aurora.vllm_worker")


def reply(fn: Callable[[], Any]) -> dict[str, Any]:
    """``{"ok": fn()}``, or ``{"error": error_to_wire(e)}`` (never raises).

    An Aurora error keeps its class and fields across the process boundary
    (the engine rebuilds it with :func:`~aurora_store.errors.error_from_wire`);
    any other error is logged here, with its traceback, and comes back as an
    :class:`~aurora_store.errors.EngineError` naming its class.
    """
    try:
        return {"ok": fn()}
    except AuroraError as e:
        return {"error": error_to_wire(e)}
    except Exception as e:  # noqa: BLE001 - reported to the caller, which raises it
        log.exception("aurora worker call failed")
        return {"error": error_to_wire(e)}


def encode_entries(staged: StagedDelta) -> dict[str, Any]:
    """A staged delta as plain types for ``collective_rpc`` (arrays as bytes)."""
    return {
        "version": staged.version,
        "base_version": staged.base_version,
        "entries": [
            [
                e.param,
                list(e.spec.shape),
                e.spec.dtype,
                e.start,
                e.stop,
                e.nnz,
                None if e.indices is None else e.indices.astype("<i8").tobytes(),
                e.bits.dtype.str,
                e.bits.tobytes(),
                e.values,
            ]
            for e in staged.entries
        ],
    }


def decode_entries(wire: Mapping[str, Any]) -> StagedDelta:
    """Inverse of :func:`encode_entries`."""
    import numpy as np

    entries = []
    for param, shape, dtype, start, stop, nnz, idx, bits_dtype, bits, values in wire["entries"]:
        entries.append(
            DecodedEntry(
                param,
                ParamSpec(tuple(shape), dtype),
                int(start),
                int(stop),
                int(nnz),
                None if idx is None else np.frombuffer(idx, dtype="<i8").copy(),
                np.frombuffer(bits, dtype=bits_dtype).copy(),
                values,
            )
        )
    return StagedDelta(int(wire["version"]), int(wire["base_version"]), tuple(entries))
