"""What one vLLM worker holds: the model's own parameters under fused names, their shard layouts,
and the whole-model view the Trainer's digest is taken over.

Fused experts are held under FORMAT.md §2's names (``…experts.w13_weight``, not vLLM's
``…experts.routed_experts.w13_weight``) with a layout that maps through vLLM's padding and
packing (:mod:`workers.engine.vllm_moe`); the whole-model view unpads and unpacks them.

Also the one change Aurora makes to vLLM inside a worker: on CPU, linear
layers keep multiplying by their live ``weight`` tensors
(:func:`keep_cpu_linear_on_live_weights`), so deltas written in place reach
the GEMMs. Runs only inside vLLM's worker processes (vLLM is imported here).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from aurora_store.apply.tp import (
    AnyLayout,
    ShardedWeights,
    ShardLayout,
    assemble,
    column_parallel,
    merged_column_parallel,
    qkv_parallel,
    replicated,
    row_parallel,
    vocab_parallel,
)
from aurora_store.codec.extract import spec_of
from aurora_store.codec.fusion import FusionPlan
from aurora_store.errors import ConfigError, ModelMismatchError
from aurora_store.format.checkpoint import StagedDelta
from aurora_store.format.manifest import Manifest
from aurora_store.storage import Store, open_store
from workers.engine import vllm_moe

__all__ = ["Held", "keep_cpu_linear_on_live_weights"]


# ---------------------------------------------------------------------------
# CPU GEMMs on the live weights


def keep_cpu_linear_on_live_weights() -> None:
    """Keep vLLM's CPU linear layers multiplying by their own ``weight`` tensors.

    On CPUs with AVX-512/AMX, vLLM's CPU backend repacks each linear weight
    for oneDNN or its own kernels after loading and, for linear layers,
    frees the original (``dispatch_cpu_unquantized_gemm`` in
    ``vllm/model_executor/layers/utils.py``): a delta written in place would
    never reach the packed copy, and the embedding's packed copy would keep
    serving the tied LM head. In this worker process only, every 2-D layer
    uses ``F.linear`` on its live weight instead (what vLLM itself falls
    back to where oneDNN is unavailable, as on AVX2-only CPUs).
    ``aurora_attach`` checks that every layer really does.
    """
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        import vllm.model_executor.layers.utils as vutils
    except ImportError:
        return
    original = getattr(vutils, "dispatch_cpu_unquantized_gemm", None)
    if original is None or getattr(original, "_aurora_live", False):
        return

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        w = getattr(layer, "weight", None)
        if isinstance(w, torch.Tensor) and w.ndim == 2 and not w.is_meta:
            layer.cpu_linear = _live_linear  # type: ignore[assignment]
            return
        original(layer, remove_weight)

    dispatch._aurora_live = True  # type: ignore[attr-defined]
    vutils.dispatch_cpu_unquantized_gemm = dispatch


def _live_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


_live_linear._aurora_live = True  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------
# the model's parameters, their layouts, and the whole-model view


def _layout_builder(module: torch.nn.Module, pname: str, t: torch.Tensor) -> Callable[[int], ShardLayout]:
    """How ``module``'s parameter ``pname`` is split, as a function of the rank (vLLM 0.32 layers)."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    m: Any = module
    # A layer built with disable_tp (tp_size 1) is whole on every rank.
    tp = int(getattr(m, "tp_size", 1) or 1)
    trailing = tuple(t.shape[1:])
    shape = tuple(t.shape)

    def at(r: int) -> int:
        return r if tp > 1 else 0

    if isinstance(m, VocabParallelEmbedding):
        if m.num_added_embeddings:
            raise ModelMismatchError(f"{type(m).__name__}: LoRA-added vocabulary rows are not supported")
        return lambda r: vocab_parallel(m.org_vocab_size, m.embedding_dim, tp, at(r), padded=m.num_embeddings_padded)
    if tp == 1:
        return lambda r: replicated(shape)
    if isinstance(m, QKVParallelLinear):
        return lambda r: qkv_parallel(m.head_size, m.total_num_heads, m.total_num_kv_heads, trailing, tp, r, m.v_head_size)
    if isinstance(m, MergedColumnParallelLinear):
        return lambda r: merged_column_parallel(m.output_sizes, trailing, tp, r)
    if isinstance(m, ColumnParallelLinear):
        return lambda r: column_parallel((m.output_size, *trailing), tp, r)
    if isinstance(m, RowParallelLinear) and pname == "weight":
        return lambda r: row_parallel((m.output_size, m.input_size), tp, r)
    return lambda r: replicated(shape)


class Held:
    """What one rank holds: the model's tensors under fused names, their layouts, the sink."""

    def __init__(self, model: torch.nn.Module) -> None:
        tensors: dict[str, torch.Tensor] = {}
        builders: dict[str, Callable[[int], AnyLayout]] = {}
        layouts: dict[str, AnyLayout] = {}
        dtypes: dict[str, str] = {}
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        self.tp = int(get_tensor_model_parallel_world_size())
        self.rank = int(get_tensor_model_parallel_rank())
        # named_parameters() lists a shared tensor once: a tied head is the embedding.
        for vname, p in model.named_parameters():
            mod_name, _, pname = vname.rpartition(".")
            module = model.get_submodule(mod_name)
            build: Callable[[int], AnyLayout]
            if vllm_moe.is_routed_experts(module):
                # Fused experts: FORMAT.md §2 names them one module up; vLLM pads and packs them (vllm_moe).
                name = vllm_moe.format_name(vname)
                build = vllm_moe.expert_builder(module, pname, p.data, name.rpartition(".")[0], self.rank)
            else:
                name, build = vname, _layout_builder(module, pname, p.data)
            lay = build(self.rank)
            if tuple(p.shape) != lay.local_shape or not p.data.is_contiguous():
                raise ModelMismatchError(
                    f"{name}: vLLM holds {list(p.shape)}, a {type(module).__name__} of this model should hold "
                    f"{list(lay.local_shape)} on rank {self.rank}/{self.tp} (a quantized or repacked layer "
                    "cannot take deltas)"
                )
            tensors[name], builders[name], layouts[name] = p.data, build, lay
            dtypes[name] = spec_of(p.data, name).dtype
        _check_live_gemms(model)
        self.sink = ShardedWeights(tensors, layouts, dtypes)
        self.builders = builders
        self.plan = FusionPlan.from_specs(self.sink.specs())
        self.version: int | None = None
        self.state: str | None = None
        self.stores: dict[str, Store] = {}
        self.staging: dict[int, Future[tuple[Manifest, StagedDelta]]] = {}
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aurora-stage")
        self.lock = threading.Lock()
        self.writes = 0
        """Weight writes so far, twice each (odd while one is under way): a digest hashed
        beside them (vllm_digest) speaks for a version only if this did not move."""
        self.digest_pool: ThreadPoolExecutor | None = None
        self.digest_job: Future[str | None] | None = None
        """The background hash of the held weights (vllm_digest.start), at tp=1."""

    def store(self, url: str, options: Mapping[str, Any]) -> Store:
        if url.startswith("memory://"):
            raise ConfigError(f"{url}: a memory:// store lives in another process; vLLM workers need file:// or s3://")
        s = self.stores.get(url)
        if s is None:
            s = self.stores[url] = open_store(url, dict(options))
        return s

    def whole(self) -> Mapping[str, torch.Tensor]:
        """Fused name -> the whole parameter as the Trainer holds it (lazy, one at a time)."""
        return _WholeView(self)

    def whole_at(self, name: str, dst: int = 0) -> torch.Tensor | None:
        """The whole parameter ``name`` on rank ``dst`` only (None on the others).

        Why: a digest needs each whole tensor once, by one hasher; gathering
        it to one rank moves a tensor's worth of bytes once, where an
        all-gather hands every rank the whole model. Collective under
        tensor parallelism: every rank calls it for the same names in the
        same order.
        """
        local, lay = self.sink.tensors[name], self.sink.layouts[name]
        if self.tp == 1:
            return _whole_of(local, lay)
        import torch.distributed as dist
        from vllm.distributed import get_tp_group

        # torch's own gather (vLLM's CPU shared-memory gather never returned in a test here): over the device group
        # on a GPU, over the CPU (gloo) group for CPU tensors.
        tp = get_tp_group()
        part = local.contiguous()
        group = tp.device_group if part.is_cuda else tp.cpu_group
        mine = tp.rank_in_group == dst
        parts = [torch.empty_like(part) for _ in range(self.tp)] if mine else None
        dist.gather(part, parts, dst=tp.ranks[dst], group=group)
        if parts is None:
            return None
        return assemble([(self.builders[name](r), parts[r]) for r in range(self.tp)])

    def load_whole(self, name: str, full: torch.Tensor) -> None:
        """Copy a whole parameter into this rank's shard, in place."""
        lay = self.sink.layouts[name]
        dst = self.sink.tensors[name]
        if spec_of(full, name) != self.sink.specs()[name]:
            raise ModelMismatchError(f"{name}: given {list(full.shape)} {full.dtype}, the model holds {self.sink.specs()[name]}")
        src = full.reshape(-1) if lay.is_prefix else lay.shard(full).reshape(-1)
        with torch.no_grad():
            dst.view(-1)[: src.numel()].copy_(src.to(dst.device), non_blocking=False)
            dst.view(-1)[src.numel() :].zero_()  # vocabulary padding rows, zero as vLLM's loader leaves them


class _WholeView(Mapping[str, torch.Tensor]):
    """Whole parameters for :func:`weights_digest`: views on one rank, gathered with TP."""

    def __init__(self, held: Held) -> None:
        self.held = held

    def __getitem__(self, name: str) -> torch.Tensor:
        h = self.held
        local = h.sink.tensors[name]
        lay = h.sink.layouts[name]
        if h.tp == 1:
            return _whole_of(local, lay)
        from vllm.distributed import get_tp_group

        # Every rank calls this in the same (sorted) order: all_gather is collective.
        gathered = get_tp_group().all_gather(local.contiguous(), dim=0)
        parts = gathered.chunk(h.tp, dim=0)
        return assemble([(h.builders[name](r), parts[r]) for r in range(h.tp)])

    def __iter__(self) -> Iterator[str]:
        return iter(self.held.sink.tensors)

    def __len__(self) -> int:
        return len(self.held.sink.tensors)


def _whole_of(local: torch.Tensor, lay: AnyLayout) -> torch.Tensor:
    """The whole parameter from a single rank's tensor: a view where it is a prefix, else unpadded and unpacked."""
    if isinstance(lay, ShardLayout):
        return local.reshape(-1)[: lay.held].view(lay.global_shape)
    return local.view(lay.global_shape) if lay.is_prefix else assemble([(lay, local)])


def _check_live_gemms(model: torch.nn.Module) -> None:
    """Refuse a model whose CPU GEMMs read a packed copy instead of the weights we patch."""
    for name, mod in model.named_modules():
        fn = getattr(mod, "cpu_linear", None)
        if fn is None or getattr(fn, "_aurora_live", False):
            continue
        # vLLM's own fallback, `lambda x, weight, bias: F.linear(x, weight, bias)`, reads the live
        # weight too; its packed variants close over a handle or a packed tensor.
        code = getattr(fn, "__code__", None)
        if code is None or code.co_freevars or "linear" not in code.co_names:
            raise ModelMismatchError(
                f"{name}: vLLM's CPU backend multiplies by a repacked copy of this layer's weight; "
                "deltas written in place would not reach it (workers.engine.vllm_worker must be imported "
                "in the worker before the model loads: pass it as worker_extension_cls)"
            )
