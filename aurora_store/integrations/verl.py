"""``aurora``: Aurora as verl's checkpoint engine, for rollout replicas in other regions and clouds.

verl moves weights from the trainer (the actor worker group) to rollout
replicas through a pluggable checkpoint engine (``verl.checkpoint_engine``).
Its backends (``nccl``, ``nixl`` …) broadcast over one communication group
inside one cluster, rebuilt when replicas come and go. This one publishes
each update as an Aurora version instead: a sparse bf16 delta in an object
store, announced on Redis, that any replica anywhere fetches (from its
region's mirror when it has one) and checks before it yields a tensor.
Importing this module registers it under ``aurora``; verl imports it in
every worker when the config names it (docs/INTEGRATIONS.md)::

    actor_rollout_ref.rollout.checkpoint_engine:
      backend: aurora
      custom_backend_module: aurora_store.integrations.verl
      engine_kwargs:
        aurora: {store: "s3://bucket/runs/r1", redis: "redis://redis:6379/0"}

Choices, and why:

- One engine class serves both sides; the side is the call: the trainer's
  workers call :meth:`send_weights`, the rollout workers
  :meth:`receive_weights`. The Publisher or Follower is opened at its first
  call and kept: it holds the last version (the trainer's delta base, the
  replica's weights), which is what makes the next transfer sparse.
- Only the master (actor rank 0, ``is_master``) publishes. verl's
  per-tensor generator gathers each sharded parameter collectively, so the
  other ranks walk it too and drop what it yields, as verl's own backends
  do. Each tensor is copied (bf16, to ``device``) as it comes: a generator
  may reuse its buffers.
- A tied head (``lm_head.weight`` bit-equal to ``model.embed_tokens.weight``
  at the first update, or ``tied: true``) travels once, as FORMAT.md §2
  says; replicas then get the embedding alone (vLLM and SGLang tie the head
  themselves). A tied head that stops being equal is an error, never a
  silently dropped update.
- A replica yields Hugging Face names, full tensors, recovered from the
  run's own snapshot manifest (fused names and shapes, FORMAT.md §2): no
  model config to pass, nothing to keep in step.
- Mixture-of-experts models: the trainer's generator may name experts one
  tensor per expert (what verl's FSDP engine yields: it unpacks transformers
  5's packed experts, ``verl/workers/engine/fsdp/utils.py:unfuse_moe_params``)
  or packed (``…experts.gate_up_proj``); the Publisher stacks them into the
  format's ``w13_weight`` / ``w2_weight``. Every update is checked first: a
  layer with an expert missing, or with two forms, is one error and nothing
  is published. A replica yields one tensor per expert under the
  checkpoint's names, which vLLM's ``load_weights`` takes (verl's vLLM
  adapter calls it: ``verl/workers/rollout/vllm_rollout/utils.py``).
  Mixtral needs ``model_type: mixtral``: transformers 5 holds its experts
  under ``mlp`` (as Qwen's), the checkpoint and the format under
  ``block_sparse_moe``, and names alone cannot tell the two apart.
- ``receive_weights(global_steps=k)`` waits until a version published for
  step ``k`` or later is committed (the step is in its manifest's
  ``producer``), so a replica called before the trainer has published waits,
  and one that joins late (or was down) catches up by the cheapest path
  (the deltas after what it holds, or the newest snapshot and the deltas
  after it). ``build_topology`` and ``init_process_group`` only check that
  every worker names the same run: there is no group to build or rebuild.
- Secrets never sit in verl's config, which verl logs: a Redis URL that
  carries a password, or storage options that carry credentials, are
  refused. They come from the environment as for every Aurora process
  (``AURORA_REDIS_URL``, ``AURORA_REDIS_PASSWORD_FILE``, ``AURORA_SIGN_KEY``,
  ``AURORA_TRUST_KEYS``, the cloud SDK's own variables).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import torch

try:
    from verl.checkpoint_engine.base import CheckpointEngineRegistry, CheckpointEngineWithCache
except ImportError as e:  # one clear line, not verl's import chain
    raise ImportError(f"aurora_store.integrations.verl needs verl: pip install 'aurora-store[verl]' ({e})") from e

from aurora_store.api import Follower, Publisher, Updated
from aurora_store.api.weights import leader
from aurora_store.codec.entries import ParamSpec
from aurora_store.codec.experts import plan_experts
from aurora_store.codec.fusion import EMBED, TIED_HEAD
from aurora_store.credentials import REDIS_URL_ENV, resolve_redis_url
from aurora_store.errors import AuroraError, ConfigError, ModelMismatchError, VersionNotFound
from aurora_store.integrations.hf_layout import checkpoint_module, hf_layout
from aurora_store.lineage.fetch import read_manifest
from aurora_store.lineage.plan import scan_versions
from aurora_store.options import sign_key_path, trust_key_paths

__all__ = ["AuroraCheckpointEngine"]

log = logging.getLogger("aurora.integrations.verl")

MIRROR_ENV, MIRROR_OPTIONS_ENV = "AURORA_ACTOR_MIRROR", "AURORA_ACTOR_MIRROR_OPTIONS"
"""A replica's region mirror when the config names none: the Actor's variables, set on each region's nodes
(verl hands every replica the same config; a region is where a node is)."""

_SECRET_OPTIONS = frozenset(
    {"key", "secret", "token", "password", "session_token", "aws_access_key_id", "aws_secret_access_key", "aws_session_token"}
    | {"account_key", "sas_token", "client_secret", "credentials", "service_account_info"}
)
"""Storage option names that hold credentials: refused in verl's config (the SDKs read them from the environment)."""


@CheckpointEngineRegistry.register("aurora")
class AuroraCheckpointEngine(CheckpointEngineWithCache):
    """verl's checkpoint-engine interface over an Aurora run; see the module's docstring.

    verl passes ``bucket_size`` (unused: Aurora cuts its own segments), the
    actor's ``is_master`` (None: rank 0 of torch.distributed, or no process
    group) and ``engine_kwargs.aurora``: ``store`` (run root URL, required),
    ``redis`` (URL, default ``$AURORA_REDIS_URL``; none: replicas poll the
    store every ``poll_s``), ``run`` (default: the root's last path
    component), ``mirror`` and ``mirror_options`` (the replica's region
    mirror, a Relay's; default ``$AURORA_ACTOR_MIRROR`` and
    ``$AURORA_ACTOR_MIRROR_OPTIONS``, set on the region's nodes), ``trust_keys`` (files; default ``$AURORA_TRUST_KEYS``),
    ``sign_key`` (file; default ``$AURORA_SIGN_KEY``), ``storage_options``
    (fsspec, no credentials), ``snapshot_every``, ``commit_via``,
    ``outage_budget_s``, ``device`` (where the trainer's bf16 copies and a
    replica's weights live: ``cpu``, or null for where verl's tensors are),
    ``tied`` (null: detect), ``model_type`` (the trainer's config's; needed
    for Mixtral, see the module's docstring), ``timeout_s`` (a replica's
    wait for a version; null: no limit).
    """

    wire_format = "named_tensors"

    def __init__(
        self,
        bucket_size: int = 0,
        is_master: bool | None = None,
        *,
        store: str | None = None,
        redis: str | None = None,
        run: str | None = None,
        mirror: str | None = None,
        mirror_options: Mapping[str, Any] | None = None,
        trust_keys: str | Iterable[str] | None = None,
        sign_key: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        snapshot_every: int = 0,
        commit_via: str = "store",
        outage_budget_s: float | None = None,
        device: str | None = "cpu",
        tied: bool | None = None,
        model_type: str | None = None,
        timeout_s: float | None = None,
        poll_s: float = 1.0,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise ConfigError(f"engine_kwargs.aurora: unknown option(s) {sorted(unknown)}; known: {', '.join(sorted(_KNOWN))}")
        if not isinstance(store, str) or not store:
            raise ConfigError("engine_kwargs.aurora.store: the run root URL is required (s3://bucket/runs/r1, file:///…)")
        if timeout_s is not None and not timeout_s > 0:
            raise ConfigError(f"engine_kwargs.aurora.timeout_s must be > 0 or null, got {timeout_s!r}")
        self.bucket_size = int(bucket_size)
        self.is_master = is_master
        self.store = store
        self.run = run or urlsplit(store).path.rstrip("/").rsplit("/", 1)[-1] or None
        if not self.run:
            raise ConfigError(f"engine_kwargs.aurora.run: {store} has no last path component to name the run; set run")
        self._redis = _checked_redis(redis)
        self.redis = self._redis if self._redis is not None else _without_password(os.environ.get(REDIS_URL_ENV) or None)
        """The Redis URL every worker may see (no password): from the config, else ``$AURORA_REDIS_URL``."""
        self.mirror = mirror if mirror is not None else os.environ.get(MIRROR_ENV) or None
        self.device = torch.device(device) if device is not None else None
        self.tied = tied
        self.model_type = model_type
        self.timeout_s = timeout_s
        self._storage_options = _no_secrets("storage_options", storage_options)
        self._mirror_options = _no_secrets("mirror_options", mirror_options) if mirror is not None else _env_options(MIRROR_OPTIONS_ENV)
        self._trust = trust_key_paths(_as_list(trust_keys))
        self._sign_key = sign_key_path(sign_key)
        self._publisher_kwargs: dict[str, Any] = {
            "snapshot_every": snapshot_every,
            "commit_via": commit_via,
            "outage_budget": outage_budget_s,
        }
        self._poll_s = poll_s
        self._publisher: Publisher | None = None
        self._follower: Follower | None = None
        self._held: dict[str, torch.Tensor] | None = None
        self._steps: dict[int, int | None] = {}
        """Each version's ``producer.step`` (manifests never change once committed)."""
        self.last: Updated | None = None
        """What the replica's last update did (None before the first, and on the trainer)."""

    # -- verl's group lifecycle: nothing to build --------------------------------------
    def prepare(self) -> dict[str, Any]:
        """What ``build_topology`` hands every worker: the run, the store and Redis (no password), nothing else."""
        return {"store": self.store, "run": self.run, "redis": self.redis}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Actor rank 0's run for every worker: replicas joining or leaving change nothing else."""
        if not metadata or not isinstance(metadata[0], Mapping) or not {"store", "run"} <= set(metadata[0]):
            raise ConfigError("aurora build_topology: actor rank 0 reported no run (is every worker's backend aurora?)")
        head = {k: metadata[0].get(k) for k in ("store", "run", "redis")}
        return (
            {k: [v] * actor_wg_world_size for k, v in head.items()},
            {k: [v] * rollout_world_size for k, v in head.items()},
        )

    def init_process_group(self, store: str, run: str, redis: str | None = None) -> None:
        """Check that this worker follows the run the trainer publishes; no group is made."""
        if run != self.run:
            raise ConfigError(f"aurora: this worker's run is {self.run!r}, the trainer's {run!r}: engine_kwargs.aurora differ between them")
        if store != self.store:
            log.warning("aurora: this worker reads %s, the trainer writes %s (fine only if they are one store)", self.store, store)

    def finalize(self) -> None:
        """Nothing to free: the Publisher's base and a replica's weights are what the next update builds on."""

    def close(self) -> None:
        """Close the Publisher or Follower (a replica waiting for a version stops with an error)."""
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None
        if self._follower is not None:
            self._follower.close()

    # -- the trainer's side ---------------------------------------------------------------
    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, Any]:
        """Publish verl's per-tensor generator as the next version (master); drain it (other ranks)."""
        if not (leader() if self.is_master is None else self.is_master):
            async for _ in _items(weights):  # each item may be a collective gather: every rank walks it
                pass
            return {}
        t0 = time.perf_counter()
        new: dict[str, torch.Tensor] = {}
        async for name, t in _items(weights):
            if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                raise ConfigError(f"aurora send_weights: expected (name, tensor) pairs, got ({type(name).__name__}, {type(t).__name__})")
            if name in new:
                raise ConfigError(f"aurora send_weights: {name} yielded twice")
            # Always a copy: a generator may hand out views of buffers it reuses for the next tensor.
            new[name] = t.detach().to(device=self.device or t.device, dtype=torch.bfloat16, copy=True)
        self._tie(new, global_steps)
        new = self._experts_checked(new, global_steps)
        pub = self._publisher_or_open()
        try:
            p = await asyncio.to_thread(pub.publish, new, step=global_steps, owned=True)
        except AuroraError as e:
            log.error("aurora: publishing step %s to %s failed: %s: %s", global_steps, self.store, type(e).__name__, e)
            raise
        if p is None:
            raise ConfigError("aurora: is_master is set on a process that is not rank 0 of its process group")
        seconds = time.perf_counter() - t0
        log.info(
            "aurora: v%d (%s) step %s: %d bytes, %.2f%% changed, %.2f s", p.version, p.kind, global_steps, p.bytes, 100 * p.density, seconds
        )
        return {
            "aurora/version": p.version,
            "aurora/bytes": p.bytes,
            "aurora/density": p.density,
            "aurora/publish_s": p.seconds,
            "aurora/send_s": seconds,
        }

    def _tie(self, new: dict[str, torch.Tensor], step: int | None) -> None:
        """One tensor under both names when the head is tied, so the Publisher carries it once."""
        if TIED_HEAD not in new or EMBED not in new:
            return
        head, embed = new[TIED_HEAD], new[EMBED]
        if self.tied is None:
            self.tied = head.shape == embed.shape and torch.equal(head, embed)
        if not self.tied:
            return
        if head.shape != embed.shape or not torch.equal(head, embed):
            raise ConfigError(
                f"aurora: at step {step} {TIED_HEAD} differs from {EMBED}, which this run ties (they were equal at its first "
                f"update): an untied model starts a new run root with engine_kwargs.aurora.tied: false"
            )
        new[TIED_HEAD] = embed

    def _experts_checked(self, new: dict[str, torch.Tensor], step: int | None) -> dict[str, torch.Tensor]:
        """``new`` under checkpoint modules (Mixtral's experts out of ``mlp``), its experts checked before anything is written."""
        moved = checkpoint_module(list(new), self.model_type)
        out = {moved.get(n, n): t for n, t in new.items()} if moved else new
        try:
            if len(out) != len(new):
                both = sorted(m for m in moved.values() if m in new)
                raise ModelMismatchError(f"{both[0]} is also named under mlp (transformers 5's module for {self.model_type}'s experts)")
            plan_experts({n: ParamSpec(tuple(t.shape), "bfloat16") for n, t in out.items()}, self.model_type)
        except ModelMismatchError as e:
            raise ModelMismatchError(f"aurora send_weights, step {step}: {e}; nothing was published") from None
        return out

    def _publisher_or_open(self) -> Publisher:
        if self._publisher is None:
            self._publisher = Publisher(
                self.store,
                redis=self._redis_url(),
                run=self.run,
                storage_options=self._storage_options,
                sign_key=self._sign_key,
                **self._publisher_kwargs,
            )
        return self._publisher

    # -- a replica's side -----------------------------------------------------------------
    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """The weights of the version for ``global_steps`` (else the next one), once committed and checked.

        The tensors yielded are this engine's own (no copy): the caller copies them before the next update.
        """
        await asyncio.to_thread(self._receive, global_steps)
        assert self._held is not None
        for item in list(self._held.items()):
            yield item

    async def get_weights(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """The weights held, brought to the newest committed version first; waits only while nothing is held."""
        await asyncio.to_thread(self._refresh)
        assert self._held is not None
        for item in list(self._held.items()):
            yield item

    def _refresh(self) -> None:
        f = self._follower_or_open()
        v = f.latest()
        if self._held is None or v is None:
            self._receive(None)
        elif f.version is None or v > f.version:
            self._update(f, v)

    def _receive(self, global_steps: int | None) -> None:
        f = self._follower_or_open()
        self._update(f, self._wait_for(f, global_steps))

    def _update(self, f: Follower, v: int) -> None:
        if self._held is None:
            self._held = {n: torch.empty(s.shape, dtype=torch.bfloat16, device=self.device) for n, s in self._layout(f, v).items()}
        u = f.update(self._held, v)
        self.last = u
        log.info("aurora: v%d by %s (%d deltas, %d bytes) in %.2f s", u.version, u.path, u.deltas, u.bytes, u.seconds)

    def _wait_for(self, f: Follower, step: int | None) -> int:
        """The newest committed version once it is for ``step`` or later (None: newer than the one held)."""
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        while True:
            v = f.latest()
            if v is not None:
                made_for = self._step_of(f, v) if step is not None else None
                if made_for is not None and step is not None:
                    if made_for >= step:
                        return v
                elif f.version is None or v > f.version:  # no step to go by: anything newer than what is held
                    return v
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise VersionNotFound(f"{self.store}: no version for step {step} after {self.timeout_s:g} s (newest: v{v})")
            f.wait(after=-1 if v is None else v, timeout=left)
            if f.stop.is_set():
                raise AuroraError(f"{self.store}: the engine was closed while waiting for step {step}")

    def _step_of(self, f: Follower, v: int) -> int | None:
        """``producer.step`` of version ``v`` (untrusted: anything but a non-negative int counts as none)."""
        if v not in self._steps:
            m = read_manifest(f.origin, "snapshot" if v == 0 else "delta", v, trust=f.trust)
            s = m.producer.get("step")
            self._steps[v] = s if isinstance(s, int) and not isinstance(s, bool) and s >= 0 else None
        return self._steps[v]

    def _layout(self, f: Follower, v: int) -> dict[str, ParamSpec]:
        """Hugging Face names and shapes of the run, from its newest readable snapshot manifest at or below ``v``."""
        snaps = sorted((s for s in scan_versions(f.origin).snapshots if s <= v), reverse=True)
        for s in snaps:
            try:
                m = read_manifest(f.origin, "snapshot", s, trust=f.trust)
            except AuroraError as e:
                log.info("aurora: snapshot %d not usable for the run's names (%s)", s, e)
                continue
            return hf_layout(m.param_specs(), where=f"{self.store} snapshot {s}")
        raise VersionNotFound(f"{self.store}: no readable snapshot at or below v{v} to learn the run's parameters from")

    def _follower_or_open(self) -> Follower:
        if self._follower is None:
            self._follower = Follower(
                self.store,
                redis=self._redis_url(),
                run=self.run,
                mirror=self.mirror,
                trust_keys=self._trust,
                storage_options=self._storage_options,
                mirror_options=self._mirror_options,
                outage_budget=self._publisher_kwargs["outage_budget"],
                poll_s=self._poll_s,
            )
        return self._follower

    def _redis_url(self) -> str | None:
        """The URL to connect to, its password (from ``$AURORA_REDIS_PASSWORD_FILE``) folded in; never logged."""
        return resolve_redis_url(self._redis) if self.redis is not None else None


_KNOWN = frozenset(inspect.signature(AuroraCheckpointEngine).parameters) - {"bucket_size", "is_master", "unknown"}
"""The options ``engine_kwargs.aurora`` may hold."""


async def _items(weights: Any) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """verl's weights, a generator or an async iterator of (name, tensor)."""
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


def _checked_redis(url: str | None) -> str | None:
    """The configured Redis URL, refused when it carries a password: verl logs its config."""
    if url is None:
        return None
    try:
        parts = urlsplit(url)
        has_pw = bool(parts.password) or "password=" in parts.query
    except ValueError:
        raise ConfigError("engine_kwargs.aurora.redis: not a URL") from None
    if has_pw:
        raise ConfigError(
            "engine_kwargs.aurora.redis carries a password, which verl's logged config would show: "
            "put it in a file named by $AURORA_REDIS_PASSWORD_FILE (or the whole URL in $AURORA_REDIS_URL)"
        )
    return url


def _without_password(url: str | None) -> str | None:
    """``url`` as others may see it: no password in its userinfo or query."""
    if url is None:
        return None
    try:
        parts = urlsplit(url)
        host = parts.netloc.rpartition("@")[2]
        user = parts.username
    except ValueError:
        return None
    return urlunsplit((parts.scheme, f"{user}@{host}" if user else host, parts.path, "", ""))


def _no_secrets(what: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``options`` as a plain dict; credentials in it are refused (they belong in the environment)."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"engine_kwargs.aurora.{what}: expected a mapping, got {type(options).__name__}")

    def plain(x: Any, path: str) -> Any:
        if isinstance(x, Mapping):
            out = {}
            for k, v in x.items():
                if str(k).lower() in _SECRET_OPTIONS:
                    raise ConfigError(
                        f"engine_kwargs.aurora.{what}: {path}{k} is a credential, which verl's logged config would show: "
                        "use the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY …) instead"
                    )
                out[str(k)] = plain(v, f"{path}{k}.")
            return out
        if isinstance(x, Sequence) and not isinstance(x, (str, bytes)):
            return [plain(v, path) for v in x]
        return x

    return plain(options, "")


def _env_options(var: str) -> dict[str, Any]:
    """fsspec options from a JSON object in ``var`` (the environment may hold credentials; the config may not)."""
    raw = os.environ.get(var, "").strip()
    if not raw:
        return {}
    try:
        got = json.loads(raw)
    except ValueError:
        got = None
    if not isinstance(got, dict):
        raise ConfigError(f"${var}: expected a JSON object of fsspec options")
    return got


def _as_list(keys: str | Iterable[str] | None) -> list[str] | None:
    """``trust_keys`` as a list of ``[KEY_ID=]FILE`` (a comma-separated string, or a list from YAML)."""
    if keys is None:
        return None
    items = keys.split(",") if isinstance(keys, str) else [str(k) for k in keys]
    return [s.strip() for s in items if s.strip()] or None
