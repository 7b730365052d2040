"""The Trainer's real workload: a model trained with GRPO on a task.

:class:`GrpoPolicy` is the Trainer's weights source and step source
(:mod:`~workers.trainer.sources`): it holds the fp32 master weights (sharded
with FSDP2 over several processes), the optimizer, a weightless bf16 module
for behaviour log-probabilities and evaluations (:mod:`~workers.trainer.behaviour`:
the version's own tensors are lent to it) and the KL reference only when
``kl_coef`` > 0, builds each batch's prompts from the task and
rewards each completion itself (nothing an Actor says about rewards is
trusted). The model trains in float32 and every version is its bfloat16
rounding, so the deltas are exactly what an RL run in bf16 inference would ship.
"""

from __future__ import annotations

import copy
import logging
import random
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from aurora_store.api.weights import family_of
from aurora_store.codec.fusion import FusionPlan
from aurora_store.coordination.ledger import AcceptedResult
from aurora_store.errors import ConfigError
from aurora_store.storage import Store
from workers.common import write_model_description
from workers.model import PASS_TOKENS, fusion_plan_for, hf_weights, is_tied, logprobs, pass_tokens, tiny_qwen3, warm_start
from workers.pretrained import ModelDir, build_empty, load_pretrained, read_model_dir
from workers.task import Problem, RewardRunner, Task, make_task
from workers.tokenizer import CharTokenizer, HFTokenizer
from workers.trainer.behaviour import BehaviourModel, versions_device
from workers.trainer.checkpoint import checkpoint_shapes, load_into, load_optimizer
from workers.trainer.config import TrainerConfig
from workers.trainer.evaluation import EvalResult, Evaluator
from workers.trainer.fsdp import (
    DistContext,
    broadcast_module,
    exchange,
    gather_bf16,
    grpo_epochs,
    shard_model,
)
from workers.trainer.grpo import Rollouts, grpo_batch, read_rollouts
from workers.trainer.held import VersionView, bf16_version
from workers.trainer.malloc import trim
from workers.trainer.park import VersionParking
from workers.trainer.router_loss import router_aux_coef
from workers.trainer.scheduling import Prompts, batch_prompts
from workers.trainer.sharding import (
    is_meta,
    load_hf_shards,
    materialize_module,
    materialize_sharded,
    optimizer_targets,
    params_on_meta,
    rank_state,
    tied_by_identity,
)
from workers.trainer.sources import FirstVersion

__all__ = ["GrpoPolicy"]

log = logging.getLogger("aurora.trainer")


class GrpoPolicy:
    """GRPO over ``cfg.task`` with ``cfg.model`` (or the built-in tiny Qwen3); see the module's docstring.

    The model exists once :meth:`first_version` (a fresh run) or
    :meth:`restore` (a resumed one) ran; ``storage_options`` reach the task's data files.
    """

    def __init__(self, cfg: TrainerConfig, ctx: DistContext, storage_options: Mapping[str, Any]) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.tokenizer: CharTokenizer | HFTokenizer = CharTokenizer()
        """The built-in model's; ``--model``'s own once the model is built."""
        self.model_dir: ModelDir | None = read_model_dir(cfg.model) if cfg.model else None
        self.task: Task = make_task(
            cfg.task,
            cfg.data,
            cfg.eval_data,
            seed=cfg.seed,
            difficulty=cfg.difficulty,
            storage_options=dict(storage_options),
            holdout=cfg.eval_size,
        )
        if self.model_dir is None and cfg.task in ("gsm8k", "math"):
            raise ConfigError(
                f"--task {cfg.task} needs --model DIR: the built-in tiny model's character tokenizer knows only the arithmetic alphabet"
            )
        self.rewards = RewardRunner(self.task, cfg.reward_timeout_s)
        """Scores every completion in a child process, each call bounded by ``reward_timeout_s``."""
        self.rng = random.Random(cfg.seed)
        """Kept in checkpoints (a resumed run continues its sequence)."""
        self.problems: dict[str, Problem] = {}
        """prompt id -> its problem (the answer stays here)."""
        self.model: Any = None
        """The fp32 master (a Hugging Face causal LM)."""
        self.behavior: BehaviourModel | None = None
        """The weightless bf16 module behaviour log-probs and evaluations run on (rank 0)."""
        self.reference: torch.nn.Module | None = None
        """The warm-started weights, frozen, for the KL term (``kl_coef`` > 0)."""
        self.opt: torch.optim.Optimizer | None = None
        self.plan: FusionPlan | None = None
        """What is shipped: the bf16 weights' fusion plan."""
        self.followers_joined = False
        """Whether the other ranks wait for :func:`~workers.trainer.fsdp.exchange` messages."""
        self.evaluator: Evaluator | None = None
        self.restoring = False
        """Whether the model is being built for a resume (its weights then come from the checkpoint)."""
        self.router_aux_coef = 0.0
        """Weight of a mixture-of-experts model's router auxiliary loss (:mod:`~workers.trainer.router_loss`)."""
        self.parking = VersionParking()
        self.parkable: Callable[[], list[torch.Tensor]] = list
        """What :attr:`parking` may park during the update (:mod:`~workers.trainer.park`; set by the Trainer, which holds the version)."""
        self.readers_paused: Callable[[], AbstractContextManager[None]] = nullcontext
        """Entered while something is parked: the version's other readers wait (a background snapshot)."""

    @property
    def family(self) -> str:
        """The model's family (``built-in`` for the tiny Qwen3), as checkpoints record it."""
        return self.model_dir.family if self.model_dir is not None else "built-in"

    # -- the model -----------------------------------------------------------------
    def build_model(self) -> None:
        """The fp32 master: ``--model``'s checkpoint (its tokenizer with it), or the built-in tiny Qwen3."""
        md = self.model_dir
        if md is not None:
            if self.ctx.sharded:
                # On the meta device: each rank allocates and reads only its own shard (_shard), so no
                # rank ever holds the whole model in fp32, not even while it loads.
                with params_on_meta():
                    self.model = build_empty(md.path, torch.float32)
            else:
                self.model = load_pretrained(md.path, torch.float32)
            self.tokenizer = HFTokenizer.from_dir(md.path, model_vocab=int(self.model.config.vocab_size))
            log.info(
                "model: %s (%s, %.1f M parameters), tokenizer of %d ids%s",
                md.path,
                md.family,
                sum(p.numel() for p in self.model.parameters()) / 1e6,
                self.tokenizer.vocab_size,
                ", chat template" if self.tokenizer.chat_template else "",
            )
        else:
            self.model = tiny_qwen3(
                self.tokenizer.vocab_size,
                seed=self.cfg.seed,
                dtype=torch.float32,
                head_dim=self.cfg.head_dim,
                hidden=self.cfg.tiny_hidden,
                intermediate=self.cfg.tiny_intermediate,
            )
        if not self.ctx.sharded:
            torch.nn.Module.to(self.model, self.ctx.device)

    def prepare_training(self) -> None:
        """After the master weights are final: the behaviour copy, sharding, the optimizer, the plan."""
        self.model.train()
        self.router_aux_coef = router_aux_coef(self.model, self.cfg.router_aux_loss_coef)
        # The module behaviour log-probs and evaluations run on: bf16 as the Actors run it, with no
        # weights of its own (the version's held tensors are lent to it while it computes).
        self.behavior = BehaviourModel(self.model, self.ctx.device)
        tied = tied_by_identity(self.model) if is_meta(self.model) else is_tied(hf_weights(self.model))
        if self.ctx.sharded:
            self._shard()
        self.opt = self.cfg.make_optimizer(self.model.parameters())
        self.followers_joined = self.ctx.sharded
        # The plan describes what is shipped: the bf16 weights (the fp32 master is the Trainer's own).
        # (Built from the behaviour module's meta tensors: shapes and dtypes only, nothing allocated.)
        self.plan = fusion_plan_for(hf_weights(self.behavior.module), tied=tied, family=family_of(self.model))

    def _shard(self) -> None:
        """FSDP2 over the ranks. A model built on the meta device (``--model``) gets only this rank's
        shard, read from the model's safetensors (on resume the checkpoint's shard is loaded instead);
        the built-in one is built whole on every rank and takes rank 0's (warm-started) weights."""
        if not is_meta(self.model):
            torch.nn.Module.to(self.model, self.ctx.device)
            broadcast_module(self.model)
            shard_model(self.model, self.ctx)
            return
        md = self.model_dir
        assert md is not None
        restoring = self.restoring
        materialize_sharded(self.model, self.ctx, None if restoring else (lambda m: load_hf_shards(m, md.path)))
        if self.reference is not None and is_meta(self.reference):
            # The KL reference stays whole on rank 0: the warm start's weights, or the checkpoint's.
            self.reference = (
                materialize_module(self.reference, self.ctx.device)
                if restoring
                else load_pretrained(md.path, torch.float32).eval().requires_grad_(False)
            )

    @property
    def params(self) -> int:
        """Parameters of the model (tied ones once); 0 before it is built."""
        return sum(p.numel() for p in self.model.parameters()) if self.model is not None else 0

    @property
    def tokens_per_pass(self) -> int:
        """Tokens per forward/backward pass when ``micro_batch`` is 0: activations near 1 byte per parameter,
        of the rank's share of the model when sharded (each rank's budget is the model's over the ranks:
        measured with ``aurora bench trainer --params 2e8 --nproc 2``, a pass sized for the whole model kept
        about 0.8 bytes per parameter of activations on every rank, at the update's peak)."""
        cfg = getattr(self.model, "config", None)

        def get(name: str) -> int:
            return int(getattr(cfg, name, 0) or 0)

        hidden, layers = get("hidden_size"), get("num_hidden_layers")
        if not hidden or not layers:
            return PASS_TOKENS
        heads = get("num_attention_heads")
        head_dim = get("head_dim") or (hidden // heads if heads else 0)
        kv_heads = get("num_key_value_heads") or heads
        return pass_tokens(
            hidden,
            layers,
            self.params // max(1, self.ctx.world),
            self.cfg.activation_checkpointing,
            intermediate_size=get("intermediate_size") or None,
            q_width=heads * head_dim or None,
            kv_width=kv_heads * head_dim or None,
            vocab=get("vocab_size"),
        )

    def versions_device(self) -> torch.device | None:
        """Where the bf16 versions live (``versions_on``); None before the model is built."""
        if self.model is None:
            return None
        return versions_device(self.cfg.versions_on, self.ctx.device, self.params, world=self.ctx.world)

    def bf16_weights(self) -> dict[str, torch.Tensor]:
        """The bf16 rounding of the master weights, where :meth:`versions_device` says (gathered one parameter
        at a time when sharded; in one process, in blocks: :func:`~workers.trainer.held.bf16_version`)."""
        dev = self.versions_device() or self.ctx.device
        named = list(self.model.named_parameters(remove_duplicate=False))
        if not self.ctx.sharded:
            return bf16_version(named, dev)
        return gather_bf16(named, DistContext(self.ctx.rank, self.ctx.world, dev))

    def _write_model_description(self, store: Store) -> Any:
        """``model/`` in the run root: what an Actor builds the model and its tokenizer from (FORMAT.md §1)."""
        md = self.model_dir
        if md is not None:
            return write_model_description(store, md.files["config.json"], md.files.get("tokenizer.json"), md.files)
        assert isinstance(self.tokenizer, CharTokenizer)
        gen = self.model.generation_config.to_json_string().encode("utf-8")
        return write_model_description(store, self.model.config.to_json_string(), self.tokenizer.to_json(), {"generation_config.json": gen})

    # -- WeightsSource -------------------------------------------------------------
    def first_version(self, store: Store) -> FirstVersion:
        """Warm start (the built-in model starts from random weights), the reference, the optimizer; the description."""
        self.build_model()
        warm = self.task.warm_start_problems(2000, seed=self.cfg.seed + 1) if self.model_dir is None else []
        if warm and self.cfg.warm_start_steps > 0:
            # A short supervised phase gives GRPO some rewarded samples. A user's checkpoint is version 0 as it is.
            assert isinstance(self.tokenizer, CharTokenizer)
            rep = warm_start(self.model, self.tokenizer, warm, steps=self.cfg.warm_start_steps, seed=self.cfg.seed)
            log.info("warm start: %d steps in %.1fs, loss %.3f -> %.3f", rep.steps, rep.seconds, rep.first_loss, rep.last_loss)
        self.reference = copy.deepcopy(self.model).eval().requires_grad_(False) if self.cfg.kl_coef > 0 else None
        self.prepare_training()
        weights = self.bf16_weights()
        assert self.plan is not None
        return FirstVersion(weights, self.plan, self._write_model_description(store))

    # -- StepSource ----------------------------------------------------------------
    def prompts(self, step: int) -> Prompts:
        """(prompt id, payload) of batch ``step``; the answers stay here."""
        prompts, problems = batch_prompts(step, self.cfg.batch, self.cfg.seed, self.task, self.tokenizer, self.cfg.max_new_tokens)
        self.problems.update(problems)
        return prompts

    def rollouts(self, results: Mapping[str, AcceptedResult]) -> Rollouts:
        return read_rollouts(results, self.problems, self.tokenizer, self.cfg.group, self.cfg.max_new_tokens, self.rewards)

    def weights(self) -> dict[str, torch.Tensor]:
        return self.bf16_weights()

    def train(self, rollouts: Rollouts, behaviour: Mapping[str, torch.Tensor]) -> None:
        """One GRPO step: clipped ratio against ``behaviour``, optional KL to the reference.

        The newest version is parked (:mod:`~workers.trainer.park`) during the update, and already
        during the behaviour pass when that pass reads only an older version's own tensors (one-step
        asynchrony): the two full versions then never meet the behaviour pass either. Traced with
        ``aurora bench trainer --params 2e8 --nproc 2``: rank 0's behaviour pass (its shard and two
        versions) came within 0.2 GB of the update's peak, the next to go once that peak was cut."""
        assert self.opt is not None and self.behavior is not None
        early = isinstance(behaviour, VersionView) and not behaviour.reads_newest
        with self.parking.parked(self.parkable() if early else [], self.readers_paused):
            self._train(rollouts, behaviour, late=not early)

    def _train(self, rollouts: Rollouts, behaviour: Mapping[str, torch.Tensor], late: bool) -> None:
        assert self.opt is not None and self.behavior is not None
        batch = grpo_batch(
            rollouts.prompts,
            rollouts.completions,
            rollouts.rewards,
            self.cfg.group,
            self.tokenizer.pad_id,
            self.behavior,
            behaviour,
            self.reference,
            self.cfg.micro_batch,
            self.tokens_per_pass,
        )
        release = getattr(behaviour, "release", None)
        if callable(release):
            release()  # an older version's rebuilt tensors are not needed for the backward pass
        # What the behaviour pass and the older version left free in the heap goes back to the system
        # before the backward pass (the step's peak), and the gradients after the update (workers.trainer.malloc).
        trim()
        if batch is not None:
            batch.checkpointing = self.cfg.activation_checkpointing
            batch.router_aux_coef = self.router_aux_coef
        if self.ctx.sharded:
            exchange(("train", batch.to("cpu")) if batch is not None else ("skip", None), self.ctx)
        if batch is not None:
            with self.parking.parked(self.parkable() if late else [], self.readers_paused):
                grpo_epochs(self.model, self.opt, batch, self.ctx, self.cfg.epochs, self.cfg.clip, self.cfg.kl_coef, logprobs)
            trim()

    # -- evaluation, checkpoints -------------------------------------------------------
    def evaluate(self, v: int, weights: Mapping[str, torch.Tensor]) -> EvalResult:
        """Held-out accuracy of version ``v`` (its bf16 ``weights``)."""
        if self.evaluator is None:
            assert self.behavior is not None
            self.evaluator = Evaluator(
                self.task,
                self.tokenizer,
                self.rewards,
                self.behavior,
                self.cfg.eval_size,
                self.cfg.max_new_tokens,
            )
        return self.evaluator.run(v, weights)

    def checkpoint_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """What a resumed run restores, this rank's part and live (written while the next step's forward and
        backward run, :mod:`~workers.trainer.ckpt_async`): the master and the optimizer (its metadata apart;
        DTensor shards when sharded), and on rank 0 the reference and torch's RNG."""
        assert self.opt is not None
        tensors, opt_meta = rank_state(self.model, self.opt)
        if self.ctx.leader:
            if self.reference is not None:
                tensors.update({f"reference.{n}": p.detach() for n, p in self.reference.state_dict().items()})
            tensors["rng.torch"] = torch.get_rng_state()
        return tensors, opt_meta

    def restore(self, store: Store, step: int, rec: Mapping[str, Any]) -> None:
        """The master, reference and optimizer of the checkpoint before ``step`` (``rec``: its checked
        record), each rank reading its own shard whatever the world size that wrote it; ready to train.

        Every rank calls it together when sharded (:func:`~workers.trainer.trainer.follow` mirrors
        it). The model is built once: a checkpoint that does not fit is loaded over by the next one.
        """
        if self.model is None:
            self.restoring = True
            self.build_model()
            built: Any = self.model
            self.reference = copy.deepcopy(built).eval().requires_grad_(False) if self.cfg.kl_coef > 0 else None
            self.prepare_training()
        assert self.opt is not None
        shapes = checkpoint_shapes(store, step, rec)
        state, _ = rank_state(self.model, None)
        state.update(optimizer_targets(self.opt, shapes))
        if self.reference is not None and any(n.startswith("reference.") for n in shapes):
            state.update({f"reference.{n}": p.detach() for n, p in self.reference.state_dict().items()})
        if self.ctx.leader and "rng.torch" in shapes:
            state["rng.torch"] = torch.empty(shapes["rng.torch"][0], dtype=shapes["rng.torch"][1])
        load_into(store, step, rec, state, sharded=self.ctx.sharded)
        load_optimizer(self.opt, {n: t for n, t in state.items() if n.startswith("opt.")}, rec["meta"].get("optimizer") or {})
        if "rng.torch" in state:
            torch.set_rng_state(state["rng.torch"])

    def close(self, release: bool = True) -> None:
        """Stop the reward runner; release the other ranks (only once they wait for messages:
        before that they wait in another collective and a message would not match it).

        ``release`` False (the run failed): no message is sent, as the other ranks may be
        inside any collective; they end when this rank's process does (:func:`~workers.trainer.fsdp.abandon`)."""
        self.rewards.close()
        if self.followers_joined and release:
            exchange(("stop", None), self.ctx)
