"""A second copy of the weights, written while generating and swapped in at the safe point.

With ``EngineConfig.activation = "swap"`` (or ``"auto"`` and the memory for
it), :class:`~workers.engine.torch_engine.TorchEngine` keeps a spare copy of
its weights. Preparing a delta on the held version (the stager, while the
main thread generates) brings the spare to that version, writes the delta
into it and hashes it; the safe point then only points the model's
parameters at the spare (a few hundred pointer assignments), and the old
weights become the spare, one version behind. The next preparation replays
onto it the deltas activated since (each costs a scatter, never a copy), so
in steady state a version costs two scatters and a hash, all off the
critical path, and a safe point costs nothing that grows with the model.

Everything that could leave the spare not equal to "held weights plus this
delta" makes it unusable rather than wrong: a write into the held weights
while the spare was being prepared (the held weights' write counter moved),
a full load (``load_weights``), a delta the spare never saw. Unusable means
the safe point writes in place instead (the prepared form is the same), and
the next preparation starts the spare again from a full copy.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping

import torch

from aurora_store.apply.prepared_delta import PreparedDelta

__all__ = ["SpareWeights", "available_memory", "swap_fits"]

log = logging.getLogger("aurora.engine")

_REPLAY = 8
"""Activated deltas kept for the spare to replay (beyond them: a full copy)."""


def available_memory(device: torch.device) -> int | None:
    """Bytes the device can still hand out (``MemAvailable`` on the host, free memory on CUDA); None if unknown."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, RuntimeError, ValueError):
        return None
    return None


def swap_fits(weights_bytes: int, device: torch.device) -> bool:
    """``auto``'s rule: a spare is kept when, after it, as much memory as the weights themselves is still free."""
    free = available_memory(device)
    return free is not None and free >= 2 * weights_bytes


class SpareWeights:
    """The spare copy (source name -> tensor) and what it holds; used by the engine only.

    ``lock`` is held while the spare is written (the stager) and tried,
    never waited for, at the safe point: a safe point that finds the spare
    busy writes in place.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tensors: dict[str, torch.Tensor] | None = None
        self.version: int | None = None
        """The version the spare holds; None: unknown (a full copy is needed)."""
        self.ready: tuple[PreparedDelta, int] | None = None
        """(delta, held weights' write counter it was prepared on): the spare is those weights plus it."""
        self.activated: deque[PreparedDelta] = deque(maxlen=_REPLAY)
        """Deltas written into (or swapped into) the held weights, oldest first, for the spare to replay."""

    def forget(self) -> None:
        """The held weights were replaced (a full load): nothing of the spare's history applies."""
        self.version, self.ready = None, None
        self.activated.clear()

    def note_activated(self, prepared: PreparedDelta) -> None:
        self.activated.append(prepared)

    def prepare_into(
        self,
        prepared: PreparedDelta,
        held: Mapping[str, torch.Tensor],
        seq: Callable[[], int],
        digest: Callable[[Mapping[str, torch.Tensor]], str],
    ) -> bool:
        """Make the spare the held weights (at ``prepared.base_version``) plus ``prepared``; sets its digest.

        ``seq()`` reads the held weights' write counter: the spare is kept only
        if no write into the held weights began or ended meanwhile. Call
        with :attr:`lock` held. False: the spare is not ready (the safe point
        writes in place).
        """
        start = seq()
        if start % 2:
            return False
        self.ready = None
        try:
            if not self._bring_to(prepared.base_version, held):
                return False
            self.version = None  # being written: unknown until done
            assert self.tensors is not None
            prepared.write(self.tensors)
            d = digest(self.tensors)
        except BaseException:
            self.version = None
            raise
        if seq() != start:
            self.version = None  # the held weights moved under us: the spare matches nothing known
            return False
        self.version = prepared.version
        self.ready = (prepared, start)
        prepared.digest, prepared.digest_basis = d, start
        return True

    def _bring_to(self, version: int, held: Mapping[str, torch.Tensor]) -> bool:
        """Replay activated deltas onto the spare up to ``version``, or copy the held weights."""
        while self.activated and self.version is not None and self.activated[0].version <= self.version:
            self.activated.popleft()  # the spare has it already
        if self.tensors is not None and self.version is not None and self.version <= version:
            todo = [p for p in list(self.activated) if self.version < p.version <= version]
            chain = [p.version for p in todo]
            if chain == list(range(self.version + 1, version + 1)) and all(p.base_version == p.version - 1 for p in todo):
                for p in todo:
                    self.version = None
                    p.write(self.tensors)
                    self.version = p.version
                return True
        with torch.no_grad():
            if (
                self.tensors is None
                or set(self.tensors) != set(held)
                or any(
                    self.tensors[n].shape != t.shape or self.tensors[n].dtype != t.dtype or self.tensors[n].device != t.device
                    for n, t in held.items()
                )
            ):
                self.tensors = {n: torch.empty_like(t, memory_format=torch.contiguous_format) for n, t in held.items()}
                log.info(
                    "engine: keeping a spare copy of the weights (%d MiB) for swap activation",
                    sum(t.numel() * t.element_size() for t in held.values()) >> 20,
                )
            for n, t in held.items():
                self.tensors[n].copy_(t)
        self.version = version
        return True

    def take(self, prepared: PreparedDelta, seq: int) -> dict[str, torch.Tensor] | None:
        """At the safe point: the spare's tensors when they are the held weights (at ``seq``) plus ``prepared``.

        The caller swaps them in and hands the old weights back with :meth:`give`.
        """
        if self.ready is None or self.ready[0] is not prepared or self.ready[1] != seq or self.tensors is None:
            return None
        out, self.tensors, self.ready = self.tensors, None, None
        return out

    def give(self, old: dict[str, torch.Tensor], version: int) -> None:
        """The weights just swapped out: the spare now, at ``version``."""
        self.tensors, self.version = old, version
