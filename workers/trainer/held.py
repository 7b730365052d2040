"""The versions a batch may still be generated on, in one full bf16 copy plus what rebuilds the older ones.

With one-step asynchrony (``max_lag`` K) a batch is sampled from a version
up to K older than the newest, and its behaviour log-probabilities must be
computed on exactly that version's bf16 weights. Holding K + 1 full copies
would cost 2 bytes per parameter each; :class:`HeldWeights` holds the newest
version in full and, for each older one, an *undo*: per tensor, the positions
whose bits changed in the next version and their old values (or, when more
than a third of a tensor changed, the old tensor itself, which costs no more
than the positions would). Applying the undos from the newest version down
gives an older version bit for bit: an element not listed did not change.

An undo starts as the old tensors themselves (nothing computed at publish
time, on the step's critical path) and is made sparse by :meth:`HeldWeights.compact`
only if it must outlive the next batch's behaviour pass: with one-step
asynchrony (K = 1) the version before the newest is read once, by that pass,
and let go before the backward pass, so the two full versions never meet the
gradients and no comparison is ever run. With K > 1 the older versions are
compacted before the backward pass; the peak holds one full version.

Views of older versions (:meth:`HeldWeights.view`) are built one tensor at a
time, when read; they are read-only (a tensor may be the held one itself).

A version made in one process (:func:`bf16_version`) is laid out in blocks of
about :data:`VERSION_BLOCK_BYTES`, each tensor a view into its block. Why: a
version lives about two steps and is freed whole (as the undo the behaviour
pass let go of), while the next backward pass allocates the gradients; tensor
by tensor, the freed version leaves holes of bf16 sizes scattered through the
heap that float32 gradients (twice the size) do not fit in, and the C
allocator keeps them: about one more version's worth of resident memory. A
freed block is a hole the gradients fit in.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

__all__ = ["VERSION_BLOCK_BYTES", "HeldWeights", "Undo", "VersionView", "bf16_version"]

VERSION_BLOCK_BYTES = 16 << 20
"""Bytes of one block of a version's tensors (a tensor larger than this is a block of its own).

Below glibc's largest mmap threshold (32 MiB): a block comes from the heap and goes back to it,
never back to the system (which a later block would have to fault in again, page by page)."""
_ALIGN_ELEMENTS = 32  # 64 bytes of bf16: each view starts on a cache line

_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


@dataclass(frozen=True, slots=True)
class Undo:
    """How one tensor of version v becomes its value at v - 1."""

    index: torch.Tensor | None
    """Flat positions that changed (int32 when they fit); None: ``old`` is the whole tensor."""
    old: torch.Tensor
    """Their values at v - 1 (or the whole tensor at v - 1)."""
    final: bool = True
    """False for a whole old tensor not yet compared with its next version (:meth:`HeldWeights.compact`)."""

    @property
    def nbytes(self) -> int:
        return self.old.numel() * self.old.element_size() + (0 if self.index is None else self.index.numel() * self.index.element_size())

    @staticmethod
    def between(old: torch.Tensor, new: torch.Tensor) -> Undo:
        """What takes ``new`` back to ``old`` (same shape and dtype), sized by the changed elements."""
        if old.shape != new.shape or old.dtype != new.dtype:
            raise ValueError(f"versions differ in shape or dtype: {list(old.shape)} {old.dtype} vs {list(new.shape)} {new.dtype}")
        old = old.to(new.device)
        bits = _BITS.get(new.dtype)
        a, b = old.reshape(-1), new.reshape(-1)
        changed = (a.view(bits) != b.view(bits)) if bits is not None else (a != b)
        nnz = int(changed.sum())
        n = a.numel()
        idx_size = 4 if n < 2**31 else 8
        if nnz * (idx_size + new.element_size()) >= n * new.element_size():
            if old.untyped_storage().nbytes() > old.numel() * old.element_size():
                old = old.clone()  # a view into a version's block would keep the whole block alive
            return Undo(None, old)  # dense: the old tensor is no bigger than its changed positions
        index = changed.nonzero().view(-1)
        del changed
        if idx_size == 4:
            index = index.to(torch.int32)
        return Undo(index, a.index_select(0, index.long()).clone())

    def apply(self, t: torch.Tensor, owned: bool) -> tuple[torch.Tensor, bool]:
        """``t`` at the version before; ``owned``: ``t`` may be written (else a copy is made first)."""
        if self.index is None:
            return self.old, False
        if not self.index.numel():
            return t, owned
        if not owned:
            t = t.clone()
        t.view(-1).index_copy_(0, self.index.long(), self.old)
        return t, True


class HeldWeights(Mapping[int, Mapping[str, torch.Tensor]]):
    """version -> its bf16 weights (HF names), for the newest version and the undos below it.

    ``held[newest]`` is the dict given to :meth:`hold`; ``held[v]`` for an
    older ``v`` is a :class:`VersionView`. Tied names (one tensor under two
    names) share one undo.
    """

    def __init__(self) -> None:
        self.newest: int | None = None
        self.weights: dict[str, torch.Tensor] = {}
        self.undos: dict[int, dict[str, Undo]] = {}
        """v -> the undo taking version v's tensors back to v - 1 (present while v - 1 is held)."""
        self.alias: dict[str, str] = {}
        """A name -> the first name of its tensor (tied weights)."""

    # -- Mapping ---------------------------------------------------------------
    def __getitem__(self, v: int) -> Mapping[str, torch.Tensor]:
        if v == self.newest:
            return self.weights
        if v not in self:
            raise KeyError(v)
        return self.view(v)

    def __iter__(self) -> Iterator[int]:
        if self.newest is None:
            return iter(())
        return iter(range(self.oldest, self.newest + 1))

    def __len__(self) -> int:
        return 0 if self.newest is None else self.newest - self.oldest + 1

    def __contains__(self, v: object) -> bool:
        return self.newest is not None and isinstance(v, int) and self.oldest <= v <= self.newest

    @property
    def oldest(self) -> int:
        """The oldest version that can be rebuilt (the newest when no undo is held)."""
        assert self.newest is not None
        v = self.newest
        while v in self.undos:
            v -= 1
        return v

    # -- holding -----------------------------------------------------------------
    def hold(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """Make ``version`` the newest; the one before it stays reachable through an undo (its old
        tensors, until :meth:`compact`).

        The same version again replaces its weights (a resumed run's head); a
        version that does not follow the newest drops every older one.
        """
        if self.newest is not None and version == self.newest + 1:
            self.undos[version] = self._undo(self.weights, weights)
        elif version != self.newest:
            self.undos.clear()
        self.newest, self.weights = version, weights
        self.alias = _aliases(weights)

    def forget_before(self, version: int) -> None:
        """Drop what rebuilds versions older than ``version`` (never the newest)."""
        for v in [v for v in self.undos if v - 1 < version]:
            del self.undos[v]

    def view(self, version: int) -> VersionView:
        """Version ``version``'s tensors, each rebuilt when read (read-only)."""
        if version not in self:
            raise KeyError(version)
        assert self.newest is not None
        return VersionView(version, self.weights, [self.undos[v] for v in range(self.newest, version, -1)], self.alias)

    @property
    def nbytes(self) -> int:
        """Bytes of the held tensors (the newest version once per storage, and every undo)."""
        seen: set[int] = set()
        total = 0
        for t in self.weights.values():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total + sum(u.nbytes for undo in self.undos.values() for u in undo.values())

    def compact(self) -> None:
        """Make every undo still held as whole old tensors as small as the elements that changed.

        Walks from the newest version down, each undo compared with the version
        above it; a tensor the next version shares (the same storage) needs no comparison.
        """
        if self.newest is None or self.newest not in self.undos:
            return
        oldest = self.oldest
        for name in list(self.undos[self.newest]):
            t = self.weights[name]  # version w's tensor, from the newest down, one tensor at a time
            for w in range(self.newest, oldest, -1):
                u = self.undos[w][name]
                if u.final:
                    t, _ = u.apply(t, owned=False)
                    continue
                if u.old.data_ptr() == t.data_ptr():  # the same storage: nothing changed
                    self.undos[w][name] = Undo(torch.zeros(0, dtype=torch.int32, device=t.device), t.new_zeros(0))
                else:
                    self.undos[w][name] = Undo.between(u.old, t)
                t = u.old

    def _undo(self, old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> dict[str, Undo]:
        if set(old) != set(new):
            raise ValueError(f"versions name different tensors: {sorted(set(old) ^ set(new))[:3]}")
        alias = _aliases(new)
        out = {}
        for n in new:
            if alias[n] != n:
                continue
            if old[n].shape != new[n].shape or old[n].dtype != new[n].dtype:
                raise ValueError(
                    f"{n}: versions differ in shape or dtype: {list(old[n].shape)} {old[n].dtype} vs {list(new[n].shape)} {new[n].dtype}"
                )
            out[n] = Undo(None, old[n].to(new[n].device), final=False)
        return out


class VersionView(Mapping[str, torch.Tensor]):
    """An older version's weights, rebuilt from the newest one tensor by tensor (read-only)."""

    def __init__(self, version: int, newest: Mapping[str, torch.Tensor], undos: list[dict[str, Undo]], alias: Mapping[str, str]) -> None:
        self.version = version
        self._newest: Mapping[str, torch.Tensor] = newest
        self._undos = undos
        self._alias = alias

    def __getitem__(self, name: str) -> torch.Tensor:
        key = self._alias.get(name, name)
        t, owned = self._newest[key], False
        for undo in self._undos:
            t, owned = undo[key].apply(t, owned)
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self._newest)

    def __len__(self) -> int:
        return len(self._newest)

    def release(self) -> None:
        """Let go of the held tensors (what the view read from is freed once nobody else holds it)."""
        self._newest, self._undos = {}, []

    @property
    def reads_newest(self) -> bool:
        """Whether reading this view reads the newest version's bytes (a view of the newest itself
        does). Not when every undo on the way is whole old tensors (one-step asynchrony before
        :meth:`HeldWeights.compact`): the newest version may then be parked while the view is read
        (:mod:`~workers.trainer.park`)."""
        return not self._undos or any(u.index is not None for undo in self._undos for u in undo.values())


def _aliases(weights: Mapping[str, torch.Tensor]) -> dict[str, str]:
    first: dict[tuple[torch.device, int, tuple[int, ...]], str] = {}
    out: dict[str, str] = {}
    for n, t in weights.items():
        out[n] = first.setdefault((t.device, t.data_ptr(), tuple(t.shape)), n)
    return out


def bf16_version(named: Iterable[tuple[str, torch.Tensor]], device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """The bf16 rounding of each named tensor (one process: nothing is gathered), on ``device``
    (default: where each tensor is), laid out in blocks of about :data:`VERSION_BLOCK_BYTES`
    (see the module's docstring); tied names (one tensor twice) share one copy, as in the model.
    Each tensor is a contiguous view; the rounding is ``Tensor.to(torch.bfloat16)``'s."""
    unique: list[torch.Tensor] = []
    first: dict[tuple[torch.device, int, tuple[int, ...]], int] = {}
    names: list[tuple[str, int]] = []
    for name, t in named:
        key = (t.device, t.data_ptr(), tuple(t.shape))
        if key not in first:
            first[key] = len(unique)
            unique.append(t.detach())
        names.append((name, first[key]))
    copies: list[torch.Tensor] = [torch.empty(0)] * len(unique)
    block: list[int] = []
    used = 0
    for i, t in enumerate(unique):
        n = _padded(t)
        if block and (used + n > VERSION_BLOCK_BYTES // 2 or _where(t, device) != _where(unique[block[0]], device)):
            _fill(block, unique, copies, device)
            block, used = [], 0
        block.append(i)
        used += n
    if block:
        _fill(block, unique, copies, device)
    return {name: copies[i] for name, i in names}


def _padded(t: torch.Tensor) -> int:
    return -(-t.numel() // _ALIGN_ELEMENTS) * _ALIGN_ELEMENTS


def _where(t: torch.Tensor, device: torch.device | str | None) -> torch.device:
    return torch.device(device) if device is not None else t.device


def _fill(group: list[int], unique: list[torch.Tensor], copies: list[torch.Tensor], device: torch.device | str | None) -> None:
    """One block for the tensors ``group`` indexes: each rounded into its view."""
    sizes = [_padded(unique[i]) for i in group]
    block = torch.empty(sum(sizes), dtype=torch.bfloat16, device=_where(unique[group[0]], device))
    at = 0
    for i, size in zip(group, sizes, strict=True):
        src = unique[i]
        view = block[at : at + src.numel()].view(src.shape)
        view.copy_(src)
        copies[i] = view
        at += size
