"""The torch engine's FP8 serving copy: generate from block-scaled FP8 weights while deltas stay bf16 (issue 27).

With ``EngineConfig.serve_dtype = "fp8-block128"`` the engine keeps the bf16
weights deltas are written into (the state chain, the digests and settlement
name them, exactly as with bf16 serving) and, beside them, the FP8 copy of
every weight the format quantizes (:func:`aurora_store.quant.is_quantized`:
linear layers and stacked experts; never embeddings, norms, routers or the
head). :class:`Fp8Serving` keeps that copy current inside the safe point:
it reads the old bits at a prepared delta's indices before the write and
hands them, with the new ones, to :meth:`Fp8Weights.requantize_all`, whose
work follows the change (see :mod:`aurora_store.quant.block`), one weight per
thread on the CPUs the process may use: generation waits for the safe point,
so the cores have nothing else to do.

Generation reads the FP8 copy only. Each module owning a quantized
parameter gets a ``forward`` that, for the length of the call, puts in that
parameter's place the weight dequantized block by block from the FP8 bytes
and their scales (``float32(q) * scale`` in the engine's dtype), then puts
the bf16 tensor back. That is the correct route, not the fast one: a real
FP8 kernel would multiply the FP8 bytes directly; the numbers it computes
with are the same. Swapping ``module._parameters`` entries (never the
tensors' storage) is safe under the engine's lock: the weight tensors the
engine and its digest threads hold are other tensor objects on the same
storage, so a reader outside the lock still sees bf16.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from aurora_store.apply.prepared_delta import DenseWrite, PreparedDelta, SortedWrites
from aurora_store.codec.kernels.jit import compiled, readonly, use_jit
from aurora_store.errors import ModelMismatchError
from aurora_store.quant import FP8_BLOCK128, Requant, check_format, is_quantized
from aurora_store.quant.weights import Change, Fp8Weights, bf16_bits

__all__ = ["SERVE_DTYPES", "Fp8Serving", "plain_forwards", "refuse_quantized_base"]

#: What ``--serve-dtype`` may name: the held dtype itself, or a quantization format.
SERVE_DTYPES = ("bf16", FP8_BLOCK128)

_BLOCK = 128
_PLAIN_FORWARD = "_aurora_plain_forward"
# bf16 bit patterns whose exponent is all ones: infinities and NaNs, which no finite scale serves.
_EXP = np.uint16(0x7F80)


def refuse_quantized_base(model: torch.nn.Module) -> None:
    """One line, before anything is cast, for an already quantized model: the chain deltas apply to is bf16."""
    qc = getattr(getattr(model, "config", None), "quantization_config", None)
    fp8 = next(
        (f"parameter {n} is {p.dtype}" for n, p in model.named_parameters() if p.element_size() == 1 and p.is_floating_point()), None
    )
    if qc is not None or fp8 is not None:
        what = fp8 or "its config has a quantization_config"
        raise ModelMismatchError(
            f"the model is a quantized checkpoint ({what}): an Aurora chain is bf16 and lossless, "
            "so its base must be the bf16 weights (FP8 serving quantizes them itself: --serve-dtype fp8-block128)"
        )


def plain_forwards(model: torch.nn.Module) -> None:
    """Undo what an FP8 engine that held ``model`` before did to its forwards (a bf16 engine loading it after)."""
    for module in model.modules():
        if _PLAIN_FORWARD in module.__dict__:
            del module.__dict__[_PLAIN_FORWARD]
            module.__dict__.pop("forward", None)


def _check_fused(name: str, shape: tuple[int, ...]) -> None:
    """Packed experts hold gate and up rows fused; a 128-row block must not straddle them (each is quantized on its own)."""
    if name.endswith("experts.gate_up_proj") and len(shape) == 3 and (shape[1] % 2 or (shape[1] // 2) % _BLOCK):
        raise ModelMismatchError(
            f"{name}: {list(shape)} packs gate and up rows of {shape[1] / 2:g} each, not a multiple of {_BLOCK}: "
            f"a {_BLOCK}x{_BLOCK} FP8 block would straddle the two, which the FP8 layers quantize separately"
        )


class Fp8Serving:
    """A model's FP8 serving copy, the forwards that generate from it, and its upkeep at each write."""

    def __init__(self, model: torch.nn.Module, sources: Mapping[str, torch.Tensor], fmt: str = FP8_BLOCK128) -> None:
        """Quantize every weight of ``sources`` (the engine's source tensors, Hugging Face names) that ``fmt``
        quantizes, and make ``model`` generate from the copy. Raises one line (nothing changed) for a
        weight the FP8 layers cannot take or one that is not bf16."""
        self.format = check_format(fmt)
        names = [n for n, t in sources.items() if is_quantized(n, tuple(t.shape))]
        for n in names:
            _check_fused(n, tuple(sources[n].shape))
        owners: dict[torch.nn.Module, list[tuple[str, str]]] = {}
        for n in names:
            mod_name, _, attr = n.rpartition(".")
            try:
                module = model.get_submodule(mod_name)
            except AttributeError:
                module = None
            if module is None or not isinstance(module._parameters.get(attr), torch.nn.Parameter):
                raise ModelMismatchError(f"{n}: not a parameter of a module of the model; FP8 serving cannot route it")
            owners.setdefault(module, []).append((attr, n))
        self.copy = Fp8Weights.of({n: sources[n] for n in names}, fmt)
        self.stale = False
        """True after a write the copy did not follow (a raw sink): :meth:`refresh` quantizes again."""
        for module, attrs in owners.items():
            module.forward = _served(module, attrs, self.dequantized)

    @classmethod
    def serving(cls, model: torch.nn.Module, sources: Mapping[str, torch.Tensor], serve_dtype: str) -> Fp8Serving | None:
        """The FP8 copy ``serve_dtype`` asks for; None for ``bf16`` (the model's forwards then plain again)."""
        if serve_dtype == "bf16":
            plain_forwards(model)
            return None
        return cls(model, sources, serve_dtype)

    @property
    def names(self) -> list[str]:
        return list(self.copy)

    def dequantized(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """``name``'s weight as served: each FP8 byte times its block's scale, in ``like``'s dtype and device."""
        blk = self.copy.blocks[name]
        rows, cols = blk.shape[-2:]
        q = torch.from_numpy(blk.q).view(torch.float8_e4m3fn).to(torch.float32)
        s = torch.from_numpy(blk.scale_inv)
        s = s.repeat_interleave(_BLOCK, -2)[..., :rows, :].repeat_interleave(_BLOCK, -1)[..., :cols]
        return (q * s).to(device=like.device, dtype=like.dtype)

    def refresh(self, sources: Mapping[str, torch.Tensor]) -> None:
        """Quantize every weight again from scratch (after a full load, or a write the copy did not see)."""
        self.copy = Fp8Weights.of({n: sources[n] for n in self.copy}, self.format)
        self.stale = False

    def digest(self) -> str:
        """sha256 of the served FP8 weights and scales (:meth:`Fp8Weights.digest`): equal to a from-scratch
        quantization's of the held bf16 weights exactly when the copy is current."""
        return self.copy.digest()

    def write(self, prepared: PreparedDelta, tensors: Mapping[str, torch.Tensor], jit: bool | None = None) -> Requant:
        """Write ``prepared`` into the bf16 ``tensors`` and bring the FP8 copy along, incrementally.

        A quantized tensor with one sparse write (the RL case) is written by
        one compiled pass that reads each old value as it writes the new one
        (the old bits cost no second trip through memory); any other write
        of a quantized tensor has its old bits gathered first. A change that
        would put an infinite or NaN value into a quantized weight is refused
        with nothing written, bf16 or FP8: new values are checked before any
        write, XOR ones (known only once the old bits are read) right after
        their exchange, which is then undone before anything else is written.
        """
        prepared.check_live(tensors)
        count: dict[str, int] = {}
        for source in (*(d.source for d in prepared.dense), *(w.source for w in prepared.sparse)):
            count[source] = count.get(source, 0) + 1
        single = [w for w in prepared.sparse if w.source in self.copy and count[w.source] == 1]
        alone = {w.source for w in single}
        rest = dataclasses.replace(prepared, sparse=tuple(w for w in prepared.sparse if w.source not in alone))
        changes = self._changes(rest, tensors)  # gathered before any write
        for w in single:
            if not w.xor:
                _finite(w.bits.view(np.uint16), prepared.version, w.source)
        done: list[tuple[SortedWrites, np.ndarray, np.ndarray]] = []
        try:
            for w in single:
                flat = bf16_bits(tensors[w.source], w.source).reshape(-1)
                old = np.empty(w.indices.size, np.uint16)
                _exchange(flat, w.indices, w.bits.view(np.uint16), w.xor, old, jit)
                done.append((w, flat, old))
                if w.xor:
                    _finite(old ^ w.bits.view(np.uint16), prepared.version, w.source)
        except ModelMismatchError:
            for w, flat, old in done:  # every exchange undone: nothing written
                _exchange(flat, w.indices, old, False, np.empty_like(old), jit)
            raise
        rest.write(tensors, jit)
        todo: list[Change] = [
            (w.source, tensors[w.source], w.indices, old, old ^ w.bits.view(np.uint16) if w.xor else w.bits.view(np.uint16))
            for w, _flat, old in done
        ]
        todo += [(name, tensors[name], idx, old, new) for name, (idx, old, new) in changes.items()]
        return self.copy.requantize_all(todo, jit)

    def _changes(
        self, prepared: PreparedDelta, tensors: Mapping[str, torch.Tensor]
    ) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per quantized source: the changed flat indices (sorted, unique), their bits before and after."""
        writes: dict[str, list[Any]] = {}
        ordered: list[DenseWrite | SortedWrites] = [*prepared.dense, *prepared.sparse]  # the order PreparedDelta.write follows
        for w in ordered:
            if w.source in self.copy:
                writes.setdefault(w.source, []).append(w)
        out: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for name, ws in writes.items():
            flat = bf16_bits(tensors[name], name).reshape(-1)
            spans = [w.indices if hasattr(w, "indices") else np.arange(w.start, w.start + w.bits.size) for w in ws]
            if len(ws) == 1 and hasattr(ws[0], "indices"):
                idx = ws[0].indices
            else:
                idx = np.unique(np.concatenate(spans))
            old = flat[idx]
            new = old.copy()
            for w, span in zip(ws, spans, strict=True):
                pos = slice(None) if span is idx else np.searchsorted(idx, span)
                bits = w.bits.view(np.uint16)
                new[pos] = new[pos] ^ bits if w.xor else bits
            _finite(new, prepared.version, name)
            out[name] = (idx, old, new)
        return out


def _finite(bits: np.ndarray, version: int, name: str) -> None:
    if ((bits & _EXP) == _EXP).any():
        raise ModelMismatchError(
            f"delta {version}: {name}: a changed value is infinite or NaN, which FP8 block quantization cannot serve; nothing written"
        )


def _exchange_kernel(flat: Any, idx: Any, bits: Any, xor: Any, old: Any) -> None:  # compiled by numba
    for k in range(idx.size):
        i = idx[k]
        o = flat[i]
        old[k] = o
        flat[i] = o ^ bits[k] if xor else bits[k]


def _exchange(flat: np.ndarray, idx: np.ndarray, bits: np.ndarray, xor: bool, old: np.ndarray, jit: bool | None) -> None:
    """``old[k] = flat[idx[k]]``, then ``flat[idx[k]]`` = ``bits[k]`` (or ``old[k] ^ bits[k]``): one pass, compiled."""
    if use_jit(jit):
        compiled(_exchange_kernel)(flat, readonly(idx), readonly(bits), bool(xor), old)
        return
    old[:] = flat[idx]
    flat[idx] = old ^ bits if xor else bits


def _served(module: torch.nn.Module, attrs: list[tuple[str, str]], dequantized: Callable[[str, torch.Tensor], torch.Tensor]) -> Any:
    """``module``'s forward computing with the FP8 copy of its quantized parameters (``attrs``: attribute, weight name)."""
    inner = module.__dict__.get(_PLAIN_FORWARD) or module.forward
    module.__dict__[_PLAIN_FORWARD] = inner  # a second load wraps the plain forward, not the wrapper

    def forward(*args: Any, **kwargs: Any) -> Any:
        params = module._parameters
        held = {a: params[a] for a, _ in attrs}
        try:
            for a, name in attrs:
                held_t = held[a]
                assert held_t is not None
                params[a] = dequantized(name, held_t)  # type: ignore[assignment]
            return inner(*args, **kwargs)
        finally:
            params.update(held)

    return forward
