"""Shipping a version the baselines' way: a full snapshot per version, or nothing at all.

Deltas (Aurora's way) go through the public API's
:class:`aurora_store.Publisher`, which extracts, encodes, uploads and
announces each segment the moment it is durable; this module keeps the
broadcast baselines of ``aurora bench wan`` (``transfer="full"``) and the
ideal one (``"none"``: the version exists only as an announcement).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from aurora_store.codec.fusion import FusionPlan
from aurora_store.coordination.bus import Bus
from aurora_store.lineage.publish import (
    PublishConfig,
    publish_snapshot,
)
from aurora_store.storage import Store

if TYPE_CHECKING:
    from aurora_store.format.signing import Signer

__all__ = ["Published", "publish_version", "unshipped_state"]


def unshipped_state(v: int) -> str:
    """``state`` of a version announced but never shipped (``transfer="none"``)."""
    return "sha256:" + hashlib.sha256(f"unshipped:{v}".encode()).hexdigest()


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
    producer: Mapping[str, Any] | None = None,
    weights_digest: str | None = None,
    signer: Signer | None = None,
    commit: Callable[[str, int, bytes], None] | None = None,
) -> Published:
    """Ship version ``v`` (made by ``step``) from ``old`` -> ``new`` as ``transfer`` says.

    A snapshot's shards are fused from ``new`` as they are written (no fused copy
    of the version). The version is not announced here (the caller records its head first).
    ``weights_digest`` (of ``new``) goes into a delta's manifest: it binds a
    snapshot published at ``v`` afterwards (FORMAT.md §4.1). ``signer`` signs
    the manifest (FORMAT.md §4.1; None: unsigned).
    """
    producer = {"step": step, **(producer or {})}
    if transfer == "delta":
        raise ValueError("deltas are published through aurora_store.Publisher (the Trainer's self.publisher)")
    if transfer == "full":
        m = publish_snapshot(store, run, v, new, None, config, producer=producer, signer=signer, commit=commit, plan=plan)
        return Published(m.state, "snapshot", m.total_bytes)
    # Nothing moves: the version exists only as an announcement.
    return Published(unshipped_state(v), "none")
