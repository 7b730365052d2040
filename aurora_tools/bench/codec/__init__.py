"""``aurora bench codec``: delta size, extraction, encode and apply rates, side by side.

One run builds a Qwen3-shaped bf16 model (Qwen3-0.6B's dimensions, or a
Qwen3-like shape scaled to ``--params``), takes one RL-like optimizer step
(:class:`~aurora_tools.synthetic.shapes.MasterWeights`) and measures, on that single
delta:

- density: changed elements / all elements;
- bytes per changed element, values included, for the paper's encoding
  (``leb128``: LEB128 gaps + raw new values), the naive baselines (``u32``,
  ``u64``: absolute indices + raw values), ``xor_zstd`` (LEB128 gaps, XOR
  values, zstd), ``auto`` (format 1's choice, ``EncodeOptions(format=1)``,
  smallest per entry: what ``--format 1`` writes), ``auto_v2`` (the
  writers' default, format 2, docs/FORMAT.md §3.1: also Rice-coded gaps and
  Huffman/zstd byte planes of the values) and ``zstd_u32`` (zstd level 1 over the
  naive u32 payload of each parameter: what a general-purpose compressor
  makes of the naive format);
- extraction time and scan rate (bytes of base + new weights read per
  second), next to this machine's copy bandwidth over the same bytes, and the
  same for extraction and ``auto`` encoding together;
- encode and decode+apply rates (changed elements per second;
  ``stage_segments`` + ``apply_delta`` into :class:`FusedWeights`), for
  format 1 and format 2 in the same run, on wall time and on this process's
  CPU time (the nearer per-core figure on a busy machine, see
  :class:`~.measure.Clock`);
- losslessness: every encoded delta is applied to a copy of the base and the
  result compared bit for bit with the new weights;
- the same sizes on real deltas of the demo's model (:mod:`.real`: a few
  SGD steps on the Trainer's built-in tiny Qwen3 at hidden 256; keys
  ``real_delta`` and ``real_delta_band``), with the compiled kernels;
- which kernels ran (:func:`aurora_store.codec.kernels.path`: numba's compiled
  kernels, ``jit``, or their numpy twins), and extraction and ``auto``
  decode+apply on *both* paths side by side, checked to agree bit for bit.

All timed work runs on one thread (``torch.set_num_threads(1)``; numba's
kernels are serial): the figures are per core, and they do not swing with
other load on a small box the way multi-threaded OpenMP kernels do. Timed
sections report the best of ``DEFAULT_REPS`` repetitions; the kernels are
compiled (or loaded from numba's cache) before any timing. The model is
built with one warm-up step first, so the measured delta is a steady-state
step (version v -> v+1). (The first step off a freshly built master used to
carry an initialization artifact, about 0.2% of elements changing even at
lr 0, from masters placed outside their bf16 rounding cell at exact powers
of two; :class:`~aurora_tools.synthetic.shapes.MasterWeights` no longer does that,
but a steady-state step is still what is measured.)

A benchmark is a program, not a test: targets are reported, never asserted.

The parts: :mod:`.measure` (timing, kernel paths, copies and bit-for-bit
checks), :mod:`.benchmark` (the encodings compared, :func:`run`),
:mod:`.report` (the table and ``main``). Model sizes (``--params``) come from
:func:`aurora_tools.synthetic.shapes.shape_for_params`.
"""

from __future__ import annotations

from aurora_tools.bench.codec.benchmark import (
    AUTO_V2_LIMIT,
    DEFAULT_LR,
    DEFAULT_REPS,
    DENSITY_BAND,
    VARIANTS,
    CodecReport,
    run,
)
from aurora_tools.bench.codec.report import format_table, main

__all__ = [
    "AUTO_V2_LIMIT",
    "DEFAULT_LR",
    "DEFAULT_REPS",
    "DENSITY_BAND",
    "VARIANTS",
    "CodecReport",
    "format_table",
    "run",
    "main",
]
