"""``aurora follow --quantize fp8-block128``: each version's directory as an FP8 block-quantized checkpoint (issue 27).

The follower still brings its bf16 skeleton to each version exactly as the
plain follower does (deltas, checked); :class:`Fp8Directory` then turns the
directory ``save_pretrained`` wrote into the FP8 form DeepSeek-V3 and
Qwen3-FP8 checkpoints use: every tensor :func:`aurora_store.quant.is_quantized`
picks becomes ``float8_e4m3fn`` with its ``<name>_scale_inv`` (float32, one
per 128 x 128 block) beside it, under the very names the plain follower
writes, and ``config.json`` gains the ``quantization_config`` those
checkpoints carry. Quantization is per saved tensor: ``save_pretrained``
writes a mixture of experts' weights one expert at a time and q, k, v,
gate and up apart, so no block ever spans a fused boundary.

Incremental like the follower: the FP8 copy of the last version is kept,
with the bf16 bits it was quantized from; the next version's changed
elements (a scan of old against new bits) go through
:meth:`Fp8Weights.requantize`, whose work follows the change. A tensor
seen for the first time (or of another shape) is quantized from scratch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from aurora_store.codec.kernels import scan_changes
from aurora_store.errors import ConfigError, ModelMismatchError
from aurora_store.quant import FP8_BLOCK128, Requant, check_format, is_quantized, quantize, scale_name
from aurora_store.quant.weights import Fp8Weights, bf16_bits

__all__ = ["QUANTIZATION_CONFIG", "Fp8Directory"]

#: What ``config.json`` says of an FP8 block-quantized checkpoint (transformers' and vLLM's ``fp8`` method).
QUANTIZATION_CONFIG: dict[str, Any] = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}

_INDEX = "model.safetensors.index.json"


class Fp8Directory:
    """Rewrites a version directory's weights in FP8, keeping the last version's copy to requantize only what changed."""

    def __init__(self, fmt: str = FP8_BLOCK128) -> None:
        self.format = check_format(fmt)
        self.copy = Fp8Weights({}, fmt)
        self._bits: dict[str, np.ndarray] = {}
        """Per quantized name: the bf16 bits (flat uint16) its FP8 copy holds the quantization of."""
        self.last = Requant()
        """What the last :meth:`convert` did (changed elements, blocks redone whole, work)."""

    def files(self, files: Mapping[str, bytes]) -> dict[str, bytes]:
        """The run's description files, ``config.json`` with the ``quantization_config`` added (written after the weights)."""
        out = dict(files)
        if "config.json" not in out:
            raise ConfigError("--quantize: the run's model description has no config.json to declare the FP8 quantization in")
        try:
            cfg = json.loads(out["config.json"])
        except ValueError:
            raise ConfigError("--quantize: the run's config.json is not JSON") from None
        if not isinstance(cfg, dict):
            raise ConfigError("--quantize: the run's config.json is not a JSON object")
        if cfg.get("quantization_config") is not None:
            raise ModelMismatchError(
                "the run's config.json already has a quantization_config: an Aurora chain is bf16, its base cannot be a quantized checkpoint"
            )
        cfg["quantization_config"] = dict(QUANTIZATION_CONFIG)
        out["config.json"] = (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()
        return out

    def convert(self, directory: str) -> Requant:
        """Rewrite every ``*.safetensors`` of ``directory`` (as ``save_pretrained`` left it) in FP8, in place."""
        from safetensors.torch import load_file, save_file

        done = Requant()
        moved: dict[str, str] = {}
        for fname in sorted(os.listdir(directory)):
            if not fname.endswith(".safetensors"):
                continue
            path = os.path.join(directory, fname)
            tensors = load_file(path)
            out: dict[str, torch.Tensor] = {}
            for name, t in tensors.items():
                if not is_quantized(name, tuple(t.shape)):
                    out[name] = t
                    continue
                done += self._update(name, t.contiguous())
                blk = self.copy.blocks[name]
                out[name] = torch.from_numpy(blk.q).view(torch.float8_e4m3fn)
                out[scale_name(name)] = torch.from_numpy(blk.scale_inv)
                moved[scale_name(name)] = fname
            save_file(out, path, metadata={"format": "pt"})
        index = os.path.join(directory, _INDEX)
        if os.path.exists(index) and moved:
            with open(index) as f:
                idx = json.load(f)
            idx.setdefault("weight_map", {}).update(moved)
            with open(index, "w") as f:
                json.dump(idx, f, indent=2, sort_keys=True)
        self.last = done
        return done

    def _update(self, name: str, t: torch.Tensor) -> Requant:
        """Bring ``name``'s FP8 copy to ``t`` (bf16): incrementally from the last version's bits, else from scratch."""
        bits = bf16_bits(t, name)
        prev = self._bits.get(name)
        if prev is None or name not in self.copy or self.copy.blocks[name].shape != tuple(t.shape):
            self.copy.blocks[name] = quantize(bits, name)
            self._bits[name] = bits.reshape(-1).copy()
            return Requant(changed=bits.size, whole_blocks=self.copy.blocks[name].blocks, work=bits.size)
        idx, new_at, old_at = scan_changes(prev, bits.reshape(-1))
        got = self.copy.requantize(name, t, idx, old_at, new_at)
        prev[idx] = new_at
        return got
