"""The quantization formats, and which weights of a model a format quantizes.

One format today, ``fp8-block128`` (docs/issue 27, the same as vLLM's online
block FP8 quantization and the checkpoints DeepSeek-V3 and Qwen3-FP8 ship):

- blocks of 128 x 128 over a weight's last two dimensions; edge blocks hold
  only the elements that exist; a stack of experts ``[E, rows, cols]`` is
  blocked per expert;
- per block, ``amax`` = the largest ``|x|`` in float32 (from the bf16
  values), then ``max(amax, 1e-4)``; ``scale = amax / 448`` in float32,
  stored as ``weight_scale_inv`` (float32, ``[ceil(rows/128), ceil(cols/128)]``,
  with the experts' dimension in front for a stack);
- ``q = float32(x) * float32(1 / scale)``, cast to ``float8_e4m3fn`` rounding
  to nearest, ties to even (the product never exceeds 448 in magnitude).

Quantized: the weights of linear layers, fused ones (``qkv_proj``,
``gate_up_proj``) and stacked experts included; never embeddings, norms,
routers or the output head. The decision is by Hugging Face naming, the
one convention every model here follows, so the Actor, the follower and the
benchmark pick the same tensors.
"""

from __future__ import annotations

import re

from aurora_store.errors import ConfigError, ModelMismatchError

__all__ = [
    "FP8_BLOCK128",
    "FORMATS",
    "SCALE_SUFFIX",
    "check_format",
    "is_quantized",
    "scale_name",
    "scale_shape",
    "blocks_of",
]

FP8_BLOCK128 = "fp8-block128"
#: Every quantization format a ``--serve-dtype`` or ``--quantize`` may name.
FORMATS = (FP8_BLOCK128,)
#: A quantized weight ``<name>`` travels with its scales as ``<name>_scale_inv``.
SCALE_SUFFIX = "_scale_inv"

# Never quantized, whatever their shape: embeddings, the output head, norms,
# and the routers of mixtures of experts (``mlp.gate`` in Qwen-MoE and
# DeepSeek, ``block_sparse_moe.gate`` in Mixtral, ``router`` elsewhere).
_NEVER = re.compile(
    r"(^|\.)(embed_tokens|embeddings?|wte|wpe|lm_head)(\.|$)"
    r"|norm[^.]*\.weight$"
    r"|(^|\.)(mlp|block_sparse_moe|moe)\.gate\.weight$"
    r"|(^|\.)(router|shared_expert_gate)(\.|$)"
)


def check_format(name: str) -> str:
    """``name`` when it is a known quantization format, else a one-line :class:`ConfigError`."""
    if name not in FORMATS:
        raise ConfigError(f"unknown quantization format {name!r}: known ones are {', '.join(FORMATS)}")
    return name


def is_quantized(name: str, shape: tuple[int, ...]) -> bool:
    """Whether ``fp8-block128`` quantizes this weight: a linear layer's 2-D ``.weight``, or a 3-D stack of experts."""
    if _NEVER.search(name):
        return False
    if len(shape) == 2:
        return name.endswith(".weight")
    return len(shape) == 3 and ".experts." in f".{name}"


def scale_name(name: str) -> str:
    """The name of ``name``'s scales in a checkpoint (``...weight`` -> ``...weight_scale_inv``)."""
    return name + SCALE_SUFFIX


def blocks_of(shape: tuple[int, ...], name: str = "weight") -> tuple[int, int, int]:
    """(experts, rows, cols) of a 2-D weight or a 3-D stack; a clear error for any other shape."""
    if len(shape) == 2:
        e, (r, c) = 1, shape
    elif len(shape) == 3:
        e, r, c = shape
    else:
        raise ModelMismatchError(f"{name}: block FP8 quantizes 2-D weights and 3-D stacks of experts, not shape {list(shape)}")
    if min(e, r, c) <= 0:
        raise ModelMismatchError(f"{name}: cannot quantize an empty weight of shape {list(shape)}")
    return e, r, c


def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of ``weight_scale_inv`` for a weight of ``shape``: ``[ceil(rows/128), ceil(cols/128)]``, experts in front."""
    e, r, c = blocks_of(shape)
    s = (-(-r // 128), -(-c // 128))
    return s if len(shape) == 2 else (e, *s)
