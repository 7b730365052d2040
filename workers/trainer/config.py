"""The knobs of a training run (:class:`TrainerConfig`); defaults are the CPU demo's."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aurora_store.codec.entries import EncodeOptions
from aurora_store.config import SEGMENT_MIB_ENV, from_env, streams_field
from aurora_store.coordination.scheduler import SchedulerConfig
from aurora_store.errors import ConfigError
from aurora_store.lineage.publish import PublishConfig
from aurora_store.options import SIGN_KEY_ENV
from aurora_store.outage import DEFAULT_OUTAGE_BUDGET_S, OUTAGE_BUDGET_ENV
from aurora_store.storage.probe import COMMIT_VIA

if TYPE_CHECKING:
    import torch

__all__ = ["ENV_PREFIX", "OPTIMIZERS", "TRANSFERS", "TrainerConfig"]

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

    steps: int = 20
    """Optimizer steps (versions published after v0)."""
    batch: int = 32
    """Prompts per batch."""
    group: int = 8
    """Completions per prompt (GRPO group)."""
    max_new_tokens: int = 16
    """Longest completion an Actor may return; longer ones are rejected as malformed. 16 fits the
    arithmetic task's worked answer to a two-digit sum (" 9+8=17\\n#### 17" and ``eos``)."""
    optimizer: str = "sgd"
    """``sgd`` (with :attr:`momentum`) or ``adamw``. SGD's step scales with the gradient, so the
    many elements with small gradients stay on their bf16 value and a delta stays sparse; AdamW
    moves every element by about ``lr`` per step, which on the tiny model crosses a bf16
    rounding boundary almost everywhere unless ``lr`` is too small to learn (docs/BENCHMARKS.md,
    "The demo's regime")."""
    lr: float = 2e-2
    """Learning rate of :attr:`optimizer`."""
    momentum: float = 0.7
    """SGD momentum (ignored by AdamW)."""
    clip: float = 0.2
    """PPO-style ratio clip."""
    epochs: int = 2
    """Passes over each batch (the ratio moves away from 1 after the first)."""
    kl_coef: float = 0.0
    """Weight of the KL to the warm-started reference (0: no reference kept)."""
    snapshot_every: int = 10
    """Write a full snapshot every N versions (late joiners start there)."""
    warm_start_steps: int = 85
    """Supervised steps before RL: enough for some rewarded samples (about a third of the
    sampled answers on the demo's model), not more."""
    difficulty: int = 1
    """Difficulty of the generated problems (:func:`workers.task.make_problems`)."""
    tiny_hidden: int = 64
    """Width of the built-in tiny model (no ``--model``); ``aurora demo`` trains 256 (1.3 M parameters)."""
    tiny_intermediate: int = 192
    """MLP width of the built-in tiny model; ``aurora demo`` trains 768."""
    head_dim: int = 16
    """Attention head size of the tiny policy model; vLLM's CPU attention needs >= 32 (``aurora demo --engine vllm``)."""
    seed: int = 0
    """Seeds the model, the problems and the sampling of every batch."""
    model: str | None = None
    """A local Hugging Face causal-LM directory (config, safetensors weights, tokenizer files,
    generation config) of a family the fusion map supports (Llama, Qwen2, Qwen3, Mistral):
    version 0 is that checkpoint, bit for bit. None: the built-in tiny Qwen3 and its character
    tokenizer (the demo's), warm-started on the arithmetic task."""
    task: str = "arithmetic"
    """The task (prompts and rewards): ``arithmetic``, ``gsm8k``, ``math``, or a custom
    ``package.module:factory`` (:mod:`workers.task`)."""
    data: str | None = None
    """Training problems of the task: a JSON-lines or Parquet file, local or an ``s3://`` URL
    (required by ``gsm8k`` and ``math``; ``arithmetic`` generates its own)."""
    eval_data: str | None = None
    """Held-out problems scored by :attr:`eval_every`; None: a held-out slice of :attr:`data`
    (``eval_size`` problems, never trained on), or generated ones for ``arithmetic``."""
    eval_every: int = 5
    """Score the held-out set (greedy, one completion per prompt) every N versions, and version
    0; the accuracy is recorded with the version it was measured on. 0: never."""
    eval_size: int = 64
    """Held-out problems scored at each evaluation (the first ones of the set)."""
    reward_timeout_s: float = 5.0
    """Wall-clock bound of one reward call (off the main thread); an answer that takes longer scores 0."""
    min_actors: int = 0
    """Before the first batch, wait until this many Actors are alive in the ledger (a fleet whose
    engines take a minute to start, vLLM's, gets the run from its first step); 0: start at once."""
    device: str = "cpu"
    """Where the single-process Trainer holds its weights and trains: ``cpu``, ``cuda`` or
    ``cuda:N`` (env ``AURORA_TRAINER_DEVICE``). Sharded runs (``--nproc``, ``torchrun``) use
    one device per rank instead."""
    streams: int = streams_field()
    """Concurrent uploads per published version (env ``AURORA_STREAMS``)."""
    segment_bytes: int | None = field(default=None, metadata={"env": SEGMENT_MIB_ENV, "scale": 1 << 20})
    """Target segment size of a published delta; None (the default, as for every publisher)
    adapts it to each delta (:func:`aurora_store.lineage.publish.segment_bytes_for`).
    Env ``AURORA_SEGMENT_MIB``, in MiB."""
    heartbeat_timeout_s: float = 8.0
    """An Actor silent this long is marked gone and its work released."""
    progress_s: float = 30.0
    """While a batch is not complete, log its progress this often (the Trainer waits as long as it
    takes: leases expire back to the pool and live Actors redo the work)."""
    poll_s: float = 0.05
    """Pause between two reads of a batch's results while it is not complete."""
    weight_transfer: bool = True
    """False: the "ideal" baseline of ``aurora bench e2e``: versions are trained but never
    shipped, every batch is generated on v0, so the weight path costs nothing."""
    transfer: str = "delta"
    """How each version is shipped (``aurora bench wan`` baselines): ``delta`` (sparse delta,
    Aurora), ``full`` (a full snapshot every version), ``none`` (nothing moves: the version
    and its state are only announced; Actors of the synthetic workload advance for free)."""
    max_lag: int = 1
    """Lag bound K: batch b is generated on version max(0, b - K). 1 is one-step asynchrony;
    2 and 4 are the full-broadcast baselines that hide transfer behind K batches; 0 is
    synchronous (on-policy) training, each batch generated on the version just published:
    the parity baseline of ``aurora bench e2e --parity``."""
    resume: bool = False
    """Continue the run in the store from its newest checkpoint (a fresh run if it holds
    no version yet): ``aurora trainer --resume``, safe to pass on every start."""
    checkpoint_every: int = 5
    """Save a Trainer checkpoint (master weights, optimizer, RNG, scheduler estimates) to the
    run root every N steps, and before step 0; 0 never (a run that cannot be resumed)."""
    keep_checkpoints: int = 2
    """Checkpoints kept; older ones are deleted after each new one."""
    keep_snapshots: int = 3
    """Retention run by the Trainer after each snapshot: keep the newest K snapshots and every
    version after the oldest of them (and whatever live Actors and Relays hold); 0 keeps all."""
    outage_budget_s: float = field(default=DEFAULT_OUTAGE_BUDGET_S, metadata={"env": OUTAGE_BUDGET_ENV})
    """How long Redis or the store may be unreachable before the Trainer gives up (env
    ``AURORA_OUTAGE_BUDGET_S``, shared by every worker)."""
    min_batch_fraction: float = 1.0
    """A batch may close once this fraction of its prompts is in and ``batch_deadline_s`` has
    passed; 1.0 (the default) waits for every prompt (expired leases go back to the pool)."""
    batch_deadline_s: float | None = None
    """Seconds after a batch's creation from which it may close with ``min_batch_fraction``
    of its prompts in; None: no deadline. Late results are refused (reason ``closed``)."""
    sign_key: str | None = field(default=None, metadata={"env": SIGN_KEY_ENV})
    """Sign every manifest with this key file (FORMAT.md §4.1): an Ed25519 private key PEM
    (``aurora keygen``) or an hmac-sha256 secret of >= 32 bytes. None: unsigned. Env ``AURORA_SIGN_KEY``.
    A resumed Trainer may sign with a new key once readers trust both."""
    sign_key_id: str | None = field(default=None, metadata={"env": False})
    """Key id of an hmac-sha256 ``sign_key`` (default: derived from the secret)."""
    commit_via: str = "store"
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
                f"poll_s, progress_s and heartbeat_timeout_s must be > 0 "
                f"(got {self.poll_s}, {self.progress_s}, {self.heartbeat_timeout_s})"
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
        if self.commit_via not in COMMIT_VIA:
            raise ConfigError(f"commit_via must be one of {', '.join(COMMIT_VIA)}, got {self.commit_via!r}")
        self._check_recovery_knobs()

    def _check_recovery_knobs(self) -> None:
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1 or self.keep_snapshots < 0:
            raise ConfigError(
                f"checkpoint_every and keep_snapshots must be >= 0 and keep_checkpoints >= 1 "
                f"(got {self.checkpoint_every}, {self.keep_snapshots}, {self.keep_checkpoints})"
            )
        if not 0 < self.min_batch_fraction <= 1 or (self.batch_deadline_s is not None and self.batch_deadline_s <= 0):
            raise ConfigError(f"min_batch_fraction must be in (0, 1] and batch_deadline_s > 0 (got {self.min_batch_fraction}, {self.batch_deadline_s})")
        if self.outage_budget_s <= 0:
            raise ConfigError(f"outage_budget_s must be > 0, got {self.outage_budget_s}")

    def make_optimizer(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The ``torch.optim`` optimizer this config names, over ``params`` (no weight decay)."""
        import torch

        if self.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.0)
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum)

    def publish_config(self, **overrides: Any) -> PublishConfig:
        """How this run's versions are cut and sent."""
        kw: dict[str, Any] = {"streams": self.streams, "segment_bytes": self.segment_bytes, "options": self.options}
        kw.update(overrides)
        return PublishConfig(**kw)

    @classmethod
    def from_env(cls, prefix: str = ENV_PREFIX, **overrides: Any) -> TrainerConfig:
        """Defaults, then ``AURORA_TRAINER_*`` (and ``AURORA_STREAMS``), then ``overrides``."""
        return from_env(cls, prefix, **overrides)
