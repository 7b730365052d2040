"""Shipping a version: extract the delta, encode and publish it cut-through, announce it.

Each segment is announced the moment it is durable in the store (a Relay
copies it before the version's manifest exists); the version is announced
once its manifest is written. ``transfer`` chooses what moves: the sparse
delta (Aurora), a full snapshot per version (the broadcast baselines), or
nothing at all (the ideal baseline: the version exists only as an
announcement).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from aurora_store.codec.extract import extract
from aurora_store.codec.fusion import FusionPlan
from aurora_store.coordination.bus import SEGMENT, Bus
from aurora_store.lineage.publish import (
    PublishConfig,
    SegmentEvent,
    publish_delta,
    publish_snapshot,
)
from aurora_store.storage import Store
from workers.trainer.crash import crash_point

if TYPE_CHECKING:
    from aurora_store.format.signing import Signer

__all__ = ["Published", "announce_segments", "publish_version", "unshipped_state"]


def unshipped_state(v: int) -> str:
    """``state`` of a version announced but never shipped (``transfer="none"``)."""
    return "sha256:" + hashlib.sha256(f"unshipped:{v}".encode()).hexdigest()


def announce_segments(bus: Bus) -> Callable[[SegmentEvent], None]:
    """An ``on_segment`` callback that announces each durable segment on the run's stream."""

    def announce(ev: SegmentEvent) -> None:
        bus.announce(SEGMENT, ev.version, index=ev.index, key=ev.key, bytes=ev.bytes, sha256=ev.sha256)

    return announce


@dataclass(frozen=True, slots=True)
class Published:
    """What shipping one version did."""

    state: str
    """The version's ``state`` digest."""
    kind: str
    """``delta``, ``snapshot`` or ``none`` (announced only)."""
    nbytes: int = 0
    """Bytes written to the store."""
    changed: int = 0
    """Elements that changed (deltas only)."""


def publish_version(
    store: Store,
    run: str,
    v: int,
    step: int,
    transfer: str,
    plan: FusionPlan,
    old: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    base_state: str,
    config: PublishConfig,
    bus: Bus,
    snapshot_tensors: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    producer: Mapping[str, Any] | None = None,
    weights_digest: str | None = None,
    signer: Signer | None = None,
    commit: Callable[[str, int, bytes], None] | None = None,
) -> Published:
    """Ship version ``v`` (made by ``step``) from ``old`` -> ``new`` as ``transfer`` says.

    ``snapshot_tensors`` turns bf16 weights into the fused tensors a snapshot
    holds. The version is not announced here (the caller records its head first).
    ``weights_digest`` (of ``new``) goes into a delta's manifest: it binds a
    snapshot published at ``v`` afterwards (FORMAT.md §4.1). ``signer`` signs
    the manifest (FORMAT.md §4.1; None: unsigned).
    """
    producer = {"step": step, **(producer or {})}
    if transfer == "delta":
        announce = announce_segments(bus)

        def on_segment(ev: SegmentEvent) -> None:
            announce(ev)
            crash_point("segment", v)

        m = publish_delta(
            store, run, v, extract(plan, old, new), base_state, config, on_segment=on_segment, producer=producer, weights_digest=weights_digest,
            signer=signer, commit=commit,
        )
        return Published(m.state, "delta", m.total_bytes, m.nnz)
    if transfer == "full":
        m = publish_snapshot(store, run, v, snapshot_tensors(new), None, config, producer=producer, signer=signer, commit=commit)
        return Published(m.state, "snapshot", m.total_bytes)
    # Nothing moves: the version exists only as an announcement.
    return Published(unshipped_state(v), "none")
