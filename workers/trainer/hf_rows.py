"""Rows of a model's parameters read from its Hugging Face safetensors files, whatever names the files use.

A sharded Trainer's rank reads only its rows of each parameter
(:func:`workers.trainer.sharding.load_hf_shards`). Most parameters are saved
under the name the model holds them by; a mixture-of-experts model is not:
transformers 5 holds a layer's routed experts packed (``…experts.gate_up_proj``
``[E, 2I, H]``, ``…experts.down_proj`` ``[E, H, I]``; Mixtral's, and its
router, under ``mlp``) while checkpoints save each expert's projections on
their own (``…experts.{e}.gate_proj.weight``; Mixtral's ``w1``/``w3``/``w2``
under ``block_sparse_moe``). Both forms are blocks of the same FORMAT.md §2
tensors (:class:`~aurora_store.codec.fusion.FusionPlan`), so a range of the
packed parameter is a range of its fused tensor, which the checkpoint's plan
(:meth:`~aurora_store.codec.fusion.FusionPlan.with_experts`) splits into the
saved tensors' own rows: a rank holding experts 4..7 of a layer reads those
experts' matrices and nothing else.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import torch

from aurora_store.codec.entries import ParamSpec
from aurora_store.codec.extract import TORCH_DTYPES
from aurora_store.codec.fusion import FusionPlan
from aurora_store.errors import ConfigError, ModelMismatchError

__all__ = ["CheckpointRows"]


class CheckpointRows:
    """The safetensors files of a model directory, read by the names ``model`` holds its parameters under.

    ``model`` may be on the meta device or sharded (only names, shapes and
    dtypes are read; a tied head is listed once, as the embedding). A context
    manager: the files stay open while it is.
    """

    def __init__(self, path: str, model: torch.nn.Module) -> None:
        from safetensors import safe_open

        self.path = path
        self._stack = ExitStack()
        self._where: dict[str, Any] = {}
        for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            sf = self._stack.enter_context(safe_open(f, framework="pt"))
            for k in sf.keys():  # noqa: SIM118 - safe_open has no __iter__
                self._where.setdefault(k, sf)
        cfg = getattr(model, "config", None)
        family = getattr(cfg, "model_type", None)
        specs = {n: ParamSpec(tuple(p.shape), TORCH_DTYPES.get(p.dtype, "float32")) for n, p in model.named_parameters()}
        try:
            self._held = FusionPlan.from_specs(specs, family=family if isinstance(family, str) else None)
        except ModelMismatchError as e:
            raise ConfigError(f"--model {path}: {e}") from None
        self._saved = self._held.with_experts("per_expert")

    def __enter__(self) -> CheckpointRows:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()

    def rows(self, name: str, start: int, stop: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Rows ``start:stop`` (dim 0) of the parameter ``name`` of global ``shape``, as saved (the file's dtype).

        Read straight from the file when it holds ``name``; else from the
        tensors the checkpoint saves its elements under (per-expert
        projections, a router under another module). One line naming the
        tensor when the files hold neither.
        """
        if name in self._where:
            return self._where[name].get_slice(name)[start:stop]
        per_row = 1
        for d in shape[1:]:
            per_row *= d
        try:
            fused, block = self._held.source(name)
        except ModelMismatchError:
            raise ConfigError(f"--model {self.path}: no tensor {name!r} in its safetensors files") from None
        lo, hi = block.offset + start * per_row, block.offset + stop * per_row
        parts = list(self._parts(name, fused, lo, hi))
        out = torch.cat(parts) if len(parts) > 1 else parts[0]
        return out.view(stop - start, *shape[1:])

    def _parts(self, name: str, fused: str, lo: int, hi: int) -> Iterator[torch.Tensor]:
        """The flat elements ``lo:hi`` of ``fused``, in order, from the saved tensors that hold them."""
        if hi <= lo:
            yield torch.empty(0)
            return
        for block, b_lo, b_hi, _ in self._saved.split_range(fused, lo, hi):
            sf = self._where.get(block.source)
            if sf is None:
                raise ConfigError(f"--model {self.path}: no tensor {block.source!r} (part of {name}) in its safetensors files")
            view = sf.get_slice(block.source)
            saved = tuple(view.get_shape())
            if saved != tuple(block.spec.shape):
                raise ConfigError(f"--model {self.path}: {block.source} holds {list(saved)}, the model expects {list(block.spec.shape)}")
            per_row = block.spec.numel // block.spec.shape[0] if block.spec.shape and block.spec.shape[0] else 1
            r0, r1 = b_lo // per_row, -(-b_hi // per_row)
            flat = view[r0:r1].reshape(-1)
            yield flat[b_lo - r0 * per_row : b_hi - r0 * per_row]
