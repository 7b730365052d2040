"""The knobs of a training run (:class:`TrainerConfig`); defaults are the CPU demo's."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aurora_store.codec.encode_options import DEFAULT_FORMAT, FORMAT_ENV
from aurora_store.codec.entries import EncodeOptions
from aurora_store.config import (
    DEFAULT_STREAMS,
    SEGMENT_MIB_ENV,
    STREAMS_ENV,
    from_env,
    option,
)
from aurora_store.coordination.scheduler import SchedulerConfig
from aurora_store.errors import ConfigError
from aurora_store.lineage.publish import ENCODE_ENV_PREFIX, PublishConfig, encode_options_from_env
from aurora_store.options import SIGN_KEY_ENV
from aurora_store.outage import DEFAULT_OUTAGE_BUDGET_S, OUTAGE_BUDGET_ENV
from aurora_store.storage.probe import COMMIT_VIA

if TYPE_CHECKING:
    import torch

__all__ = ["ENV_PREFIX", "ENCODE_ENV_PREFIX", "OPTIMIZERS", "TRANSFERS", "TrainerConfig", "encode_options_from_env"]

ENV_PREFIX = "AURORA_TRAINER_"
"""Prefix of the Trainer's environment variables (``AURORA_TRAINER_STEPS`` …);
``streams`` is ``AURORA_STREAMS``, shared with every publisher."""

TRANSFERS = ("delta", "full", "none")
"""How a version may be shipped (:attr:`TrainerConfig.transfer`)."""

OPTIMIZERS = ("sgd", "adamw")
"""The Trainer's optimizers (:attr:`TrainerConfig.optimizer`)."""


@dataclass(frozen=True, slots=True)
class TrainerConfig:
    """Knobs of a training run (defaults: the CPU demo)."""

    steps: int = option(20, metavar="N", help="optimizer steps: versions published after v0")
    """Optimizer steps (versions published after v0)."""
    batch: int = option(32, metavar="N", help="prompts per step")
    """Prompts per batch."""
    group: int = option(8, metavar="N", help="completions per prompt, the GRPO group")
    """Completions per prompt (GRPO group)."""
    max_new_tokens: int = option(16, metavar="N", help="longest completion an Actor may return")
    """Longest completion an Actor may return; longer ones are rejected as malformed. 16 fits the
    arithmetic task's worked answer to a two-digit sum (" 9+8=17\\n#### 17" and ``eos``)."""
    optimizer: str = option("sgd", choices=OPTIMIZERS, help="sgd (with momentum) or adamw")
    """``sgd`` (with :attr:`momentum`) or ``adamw``. SGD's step scales with the gradient, so the
    many elements with small gradients stay on their bf16 value and a delta stays sparse; AdamW
    moves every element by about ``lr`` per step, which on the tiny model crosses a bf16
    rounding boundary almost everywhere unless ``lr`` is too small to learn (docs/BENCHMARKS.md,
    "The demo's regime")."""
    lr: float = option(2e-2, metavar="LR", help="learning rate of --optimizer")
    """Learning rate of :attr:`optimizer`."""
    momentum: float = option(0.7, flag=None, help="SGD momentum (ignored by AdamW)")
    """SGD momentum (ignored by AdamW)."""
    clip: float = option(0.2, flag=None, help="PPO-style ratio clip")
    """PPO-style ratio clip."""
    epochs: int = option(2, flag=None, help="passes over each batch")
    """Passes over each batch (the ratio moves away from 1 after the first)."""
    kl_coef: float = option(0.0, metavar="C", help="weight of the KL to the reference model, 0: none kept")
    """Weight of the KL to the warm-started reference (0: no reference kept)."""
    router_aux_loss_coef: float | None = option(
        None,
        metavar="C",
        help="weight of a mixture-of-experts model's router load-balancing loss (0: off)",
        default_text="the model config's router_aux_loss_coef",
    )
    """Weight of the router's auxiliary (load-balancing) loss of a mixture-of-experts model, as
    the model defines it (transformers' ``aux_loss`` with ``output_router_logits``), added to the
    GRPO loss of every forward pass in proportion to its completion tokens. Like transformers, the
    loss is taken over one forward's tokens, so its value (unlike the GRPO term's) depends on how
    a batch is split into passes (``micro_batch``) and ranks. None (the default): the model
    config's ``router_aux_loss_coef``; 0: the loss is not computed. Refused (> 0) for a model
    without a router."""
    snapshot_every: int = option(10, metavar="N", help="a full snapshot every N versions, for late joiners")
    """Write a full snapshot every N versions (late joiners start there)."""
    digest_every: int = option(
        0, metavar="N", help="also record the weights digest of every N-th version (0: only snapshot and checkpoint versions)"
    )
    """Hash every N-th version too, so Actors verify their weights that often (``--verify-every``).
    0, the default, hashes only where something binds to the digest: version 0, snapshots and
    checkpoint versions (FORMAT.md §4.1); a tree digest of 8 B parameters costs seconds."""
    warm_start_steps: int = option(85, flag=None, help="supervised steps before RL (the built-in tiny model)")
    """Supervised steps before RL: enough for some rewarded samples (about a third of the
    sampled answers on the demo's model), not more."""
    difficulty: int = option(1, flag=None, help="difficulty of the generated arithmetic problems")
    """Difficulty of the generated problems (:func:`workers.task.make_problems`)."""
    tiny_hidden: int = option(64, flag=None, help="width of the built-in tiny model")
    """Width of the built-in tiny model (no ``--model``); ``aurora demo`` trains 256 (1.3 M parameters)."""
    tiny_intermediate: int = option(192, flag=None, help="MLP width of the built-in tiny model")
    """MLP width of the built-in tiny model; ``aurora demo`` trains 768."""
    head_dim: int = option(16, flag=None, help="attention head size of the built-in tiny model")
    """Attention head size of the tiny policy model; vLLM's CPU attention needs >= 32 (``aurora demo --engine vllm``)."""
    seed: int = option(0, metavar="N", help="seeds the model, the problems and every batch's sampling")
    """Seeds the model, the problems and the sampling of every batch."""
    model: str | None = option(
        None,
        metavar="DIR",
        help="local Hugging Face causal-LM directory: version 0 is that checkpoint",
        default_text="the built-in tiny model",
    )
    """A local Hugging Face causal-LM directory (config, safetensors weights, tokenizer files,
    generation config) of a family the fusion map supports (Llama, Qwen2, Qwen3, Mistral):
    version 0 is that checkpoint, bit for bit. None: the built-in tiny Qwen3 and its character
    tokenizer (the demo's), warm-started on the arithmetic task."""
    task: str = option("arithmetic", metavar="NAME", help="arithmetic, gsm8k, math or package.module:factory")
    """The task (prompts and rewards): ``arithmetic``, ``gsm8k``, ``math``, or a custom
    ``package.module:factory`` (:mod:`workers.task`)."""
    data: str | None = option(
        None, metavar="FILE", help="training problems: JSON lines or Parquet, local or s3:// (gsm8k and math need it)"
    )
    """Training problems of the task: a JSON-lines or Parquet file, local or an ``s3://`` URL
    (required by ``gsm8k`` and ``math``; ``arithmetic`` generates its own)."""
    eval_data: str | None = option(None, metavar="FILE", help="held-out problems", default_text="a held-out slice of --data")
    """Held-out problems scored by :attr:`eval_every`; None: a held-out slice of :attr:`data`
    (``eval_size`` problems, never trained on), or generated ones for ``arithmetic``."""
    eval_every: int = option(5, metavar="N", help="score the held-out set every N versions, 0 never")
    """Score the held-out set (greedy, one completion per prompt) every N versions, and version
    0; the accuracy is recorded with the version it was measured on. 0: never."""
    eval_size: int = option(64, metavar="N", help="held-out problems per evaluation")
    """Held-out problems scored at each evaluation (the first ones of the set)."""
    reward_timeout_s: float = option(5.0, metavar="S", help="bound on one reward call; slower answers score 0")
    """Wall-clock bound of one reward call (off the main thread); an answer that takes longer scores 0."""
    min_actors: int = option(0, metavar="N", help="hold the first batch until N Actors are alive (0: start at once)")
    """Before the first batch, wait until this many Actors are alive in the ledger (a fleet whose
    engines take a minute to start, vLLM's, gets the run from its first step); 0: start at once."""
    device: str = option("cpu", metavar="DEV", help="cpu, cuda or cuda:N, single-process Trainer")
    """Where the single-process Trainer holds its weights and trains: ``cpu``, ``cuda`` or
    ``cuda:N`` (env ``AURORA_TRAINER_DEVICE``). Sharded runs (``--nproc``, ``torchrun``) use
    one device per rank instead."""
    micro_batch: int = option(0, metavar="N", help="sequences per forward/backward pass (gradients accumulate); 0: sized to the model")
    """Sequences per forward and backward pass on each rank; the gradients of the passes
    accumulate into exactly the whole batch's (the loss is normalised by the batch's token
    count), so this trades speed for memory and changes nothing else. 0 (the default) takes
    as many sequences as keep activations near one byte per parameter (at least 64 MiB; about
    14 x ``hidden_size`` x layers float32 values per token, 1 x with :attr:`activation_checkpointing`:
    :func:`workers.model.pass_tokens`), at least one, so they do not grow with ``batch`` x
    ``group``; the CPU demo's batch fits in a few passes. Behaviour and reference
    log-probabilities use it too."""
    activation_checkpointing: bool = option(False, help="recompute each decoder layer's activations in the backward pass")
    """Keep only each decoder layer's input in the forward pass and recompute the rest in the
    backward pass (Hugging Face gradient checkpointing, non-reentrant): about a third more
    compute for activations that no longer grow with the number of layers."""
    versions_on: str = option(
        "auto",
        choices=("auto", "device", "host"),
        help="where the bf16 versions (published one, behaviour policy) live: device, host, or auto (host when the device is short)",
    )
    """Where the Trainer keeps the bf16 version it published (what the next delta is taken
    against and behaviour log-probabilities are computed from): ``device`` (extraction runs
    there, fastest), ``host`` (saves 2 bytes per parameter of device memory; each behaviour or
    evaluation pass copies the weights to the device while it runs), or ``auto``: ``host`` when
    the device is a GPU with less than 20 bytes of memory per parameter (fp32 master,
    gradient and AdamW state take 16; with N ranks, 4 + 16/N), else ``device``. On the CPU the
    two are the same memory."""
    streams: int = option(DEFAULT_STREAMS, env=STREAMS_ENV, metavar="S", help="concurrent uploads per published version")
    """Concurrent uploads per published version (env ``AURORA_STREAMS``)."""
    segment_bytes: int | None = option(
        None, flag=None, env=SEGMENT_MIB_ENV, scale=1 << 20, help="target segment size of a delta, in MiB", default_text="adaptive"
    )
    """Target segment size of a published delta; None (the default, as for every publisher)
    adapts it to each delta (:func:`aurora_store.lineage.publish.segment_bytes_for`).
    Env ``AURORA_SEGMENT_MIB``, in MiB."""
    format: int = option(
        DEFAULT_FORMAT,
        env=FORMAT_ENV,
        metavar="N",
        help="segment format of published deltas: 2 (rice gaps, planes values), or 1 for readers that know only format 1",
    )
    """Segment format of the published deltas (FORMAT.md §3.1): 2, the default, or 1 for Actors,
    Relays and readers that know only format 1. Env ``AURORA_FORMAT``, shared by every publisher."""
    heartbeat_timeout_s: float = option(8.0, flag=None, help="an Actor silent this long is marked gone and its work released")
    """An Actor silent this long is marked gone and its work released."""
    progress_s: float = option(30.0, flag=None, help="while a batch is not complete, log its progress this often")
    """While a batch is not complete, log its progress this often (the Trainer waits as long as it
    takes: leases expire back to the pool and live Actors redo the work)."""
    poll_s: float = option(0.05, flag=None, help="pause between two reads of a batch's results")
    """Pause between two reads of a batch's results while it is not complete."""
    weight_transfer: bool = option(True, flag=None, help="off: versions are trained but never shipped (aurora bench e2e's ideal)")
    """False: the "ideal" baseline of ``aurora bench e2e``: versions are trained but never
    shipped, every batch is generated on v0, so the weight path costs nothing."""
    transfer: str = option(
        "delta", flag=None, choices=TRANSFERS, help="how each version is shipped: delta, full or none (benchmark baselines)"
    )
    """How each version is shipped (``aurora bench wan`` baselines): ``delta`` (sparse delta,
    Aurora), ``full`` (a full snapshot every version), ``none`` (nothing moves: the version
    and its state are only announced; Actors of the synthetic workload advance for free)."""
    max_lag: int = option(1, metavar="K", help="batch b is generated on version b-K; 0: synchronous training")
    """Lag bound K: batch b is generated on version max(0, b - K). 1 is one-step asynchrony;
    2 and 4 are the full-broadcast baselines that hide transfer behind K batches; 0 is
    synchronous (on-policy) training, each batch generated on the version just published:
    the parity baseline of ``aurora bench e2e --parity``."""
    resume: bool = option(
        False,
        help="continue the run in --store from its newest checkpoint (a fresh run if it holds no version yet); "
        "the resumed Trainer takes a new epoch and fences out any older one",
    )
    """Continue the run in the store from its newest checkpoint (a fresh run if it holds
    no version yet): ``aurora trainer --resume``, safe to pass on every start."""
    checkpoint_every: int = option(5, metavar="N", help="save a Trainer checkpoint every N steps, 0 never")
    """Save a Trainer checkpoint (master weights, optimizer, RNG, scheduler estimates) to the
    run root every N steps, and before step 0; 0 never (a run that cannot be resumed)."""
    keep_checkpoints: int = option(2, metavar="N", help="checkpoints kept")
    """Checkpoints kept; older ones are deleted after each new one."""
    keep_snapshots: int = option(3, metavar="K", help="retention: keep the newest K snapshots and what follows them, 0 keeps everything")
    """Retention run by the Trainer after each snapshot: keep the newest K snapshots and every
    version after the oldest of them (and whatever live Actors and Relays hold); 0 keeps all."""
    outage_budget_s: float = option(
        DEFAULT_OUTAGE_BUDGET_S,
        env=OUTAGE_BUDGET_ENV,
        metavar="S",
        help="give up (exit 1, one line) once Redis or the store has been unreachable this long",
    )
    """How long Redis or the store may be unreachable before the Trainer gives up (env
    ``AURORA_OUTAGE_BUDGET_S``, shared by every worker)."""
    min_batch_fraction: float = option(
        1.0, metavar="F", help="close a batch with this fraction of its prompts in once --batch-deadline-s passed"
    )
    """A batch may close once this fraction of its prompts is in and ``batch_deadline_s`` has
    passed; 1.0 (the default) waits for every prompt (expired leases go back to the pool)."""
    batch_deadline_s: float | None = option(None, metavar="S", help="seconds after which a batch may close short")
    """Seconds after a batch's creation from which it may close with ``min_batch_fraction``
    of its prompts in; None: no deadline. Late results are refused (reason ``closed``)."""
    sign_key: str | None = option(
        None,
        env=SIGN_KEY_ENV,
        metavar="FILE",
        help="sign every manifest with this key: Ed25519 private key PEM (aurora keygen) or an hmac-sha256 secret file of >= 32 bytes",
        default_text="none: unsigned",
    )
    """Sign every manifest with this key file (FORMAT.md §4.1): an Ed25519 private key PEM
    (``aurora keygen``) or an hmac-sha256 secret of >= 32 bytes. None: unsigned. Env ``AURORA_SIGN_KEY``.
    A resumed Trainer may sign with a new key once readers trust both."""
    sign_key_id: str | None = option(
        None,
        flag="--key-id",
        env=False,
        metavar="NAME",
        help="key id of an hmac-sha256 --sign-key",
        default_text="first 16 hex digits of the secret's sha256",
    )
    """Key id of an hmac-sha256 ``sign_key`` (default: derived from the secret)."""
    commit_via: str = option(
        "store",
        choices=COMMIT_VIA,
        help="store: commit each version by its create-only manifest write, after checking that the store honours "
        "create-only writes; redis: commit by a Redis record (FORMAT.md section 1), for S3-compatible servers that ignore "
        "conditional writes (Redis must persist its data: appendonly or save rules)",
    )
    """How versions are committed (FORMAT.md §1): ``store``, the create-only manifest write (the
    Trainer first checks that the store honours create-only writes and refuses to start where
    it does not); ``redis``, a Redis record per version (Redis-commit mode, for S3-compatible
    servers that ignore conditional writes; Redis must persist its data). Env
    ``AURORA_TRAINER_COMMIT_VIA``."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig, metadata={"env": False})
    """How batches are split over Actors and how long leases last."""
    options: EncodeOptions = field(default_factory=EncodeOptions, metadata={"env": False})
    """Encodings the delta encoder may choose from."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch < 1 or self.group < 2:
            raise ConfigError("steps >= 1, batch >= 1 and group >= 2 are required (GRPO needs a group)")
        if self.transfer not in TRANSFERS or self.max_lag < 0:
            raise ConfigError(f"transfer must be delta, full or none and max_lag >= 0 (got {self.transfer!r}, {self.max_lag})")
        if self.poll_s <= 0 or self.progress_s <= 0 or self.heartbeat_timeout_s <= 0:
            raise ConfigError(
                f"poll_s, progress_s and heartbeat_timeout_s must be > 0 (got {self.poll_s}, {self.progress_s}, {self.heartbeat_timeout_s})"
            )
        if self.eval_every < 0 or self.eval_size < 1 or self.reward_timeout_s <= 0 or self.min_actors < 0:
            raise ConfigError(
                f"eval_every and min_actors must be >= 0, eval_size >= 1 and reward_timeout_s > 0 "
                f"(got {self.eval_every}, {self.min_actors}, {self.eval_size}, {self.reward_timeout_s})"
            )
        if self.optimizer not in OPTIMIZERS or not self.lr > 0 or not 0 <= self.momentum < 1:
            raise ConfigError(
                f"optimizer must be one of {', '.join(OPTIMIZERS)}, lr > 0 and momentum in [0, 1) "
                f"(got {self.optimizer!r}, {self.lr}, {self.momentum})"
            )
        if self.micro_batch < 0 or self.versions_on not in ("auto", "device", "host"):
            raise ConfigError(
                f"micro_batch must be >= 0 and versions_on auto, device or host (got {self.micro_batch}, {self.versions_on!r})"
            )
        coef = self.router_aux_loss_coef
        if coef is not None and not 0 <= coef < float("inf"):
            raise ConfigError(f"router_aux_loss_coef must be a finite number >= 0, got {coef}")
        if self.commit_via not in COMMIT_VIA:
            raise ConfigError(f"commit_via must be one of {', '.join(COMMIT_VIA)}, got {self.commit_via!r}")
        self._check_recovery_knobs()

    def _check_recovery_knobs(self) -> None:
        if self.digest_every < 0:
            raise ConfigError(f"digest_every must be >= 0, got {self.digest_every}")
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1 or self.keep_snapshots < 0:
            raise ConfigError(
                f"checkpoint_every and keep_snapshots must be >= 0 and keep_checkpoints >= 1 "
                f"(got {self.checkpoint_every}, {self.keep_snapshots}, {self.keep_checkpoints})"
            )
        if not 0 < self.min_batch_fraction <= 1 or (self.batch_deadline_s is not None and self.batch_deadline_s <= 0):
            raise ConfigError(
                f"min_batch_fraction must be in (0, 1] and batch_deadline_s > 0 (got {self.min_batch_fraction}, {self.batch_deadline_s})"
            )
        if self.outage_budget_s <= 0:
            raise ConfigError(f"outage_budget_s must be > 0, got {self.outage_budget_s}")

    def make_optimizer(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The ``torch.optim`` optimizer this config names, over ``params`` (no weight decay).

        AdamW is torch's fused one: its step makes no temporaries, where the per-tensor loop
        holds two of the largest parameter's size (the embedding: a byte per parameter at 200 M).
        """
        import torch

        if self.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.0, fused=True)
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum)

    def publish_config(self, **overrides: Any) -> PublishConfig:
        """How this run's versions are cut and sent."""
        options = self.options if self.options.format == self.format else dataclasses.replace(self.options, format=self.format)
        kw: dict[str, Any] = {"streams": self.streams, "segment_bytes": self.segment_bytes, "options": options}
        kw.update(overrides)
        return PublishConfig(**kw)

    @classmethod
    def from_env(cls, prefix: str = ENV_PREFIX, **overrides: Any) -> TrainerConfig:
        """Defaults, then ``AURORA_TRAINER_*`` (and ``AURORA_STREAMS``), then ``overrides``."""
        return from_env(cls, prefix, **overrides)
