"""What the Trainer, Actors and Relays share: the run's keys, the model
description in the store, and the weight digests both sides publish.

See docs/WORKERS.md for the contract these helpers implement.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from aurora_store.coordination.keys import RunKeys
from aurora_store.coordination.versioned import record_versioned
from aurora_store.errors import ConfigError, ObjectNotFound
from aurora_store.storage import Store

__all__ = [
    "MODEL_CONFIG_KEY",
    "TOKENIZER_KEY",
    "RunKeys",
    "write_model_description",
    "read_model_description",
    "DIGEST_LOG_ENV",
    "record_digest",
    "record_activation",
    "read_digests",
    "install_stop_handlers",
    "limit_torch_threads",
    "setup_logging",
    "Endpoints",
]

MODEL_CONFIG_KEY = "model/config.json"
TOKENIZER_KEY = "model/tokenizer.json"

log = logging.getLogger("aurora.workers")


@dataclass(frozen=True, slots=True)
class Endpoints:
    """Where a worker finds the run."""

    store: str
    """Run root URL at origin."""
    redis: str
    """Redis URL."""
    run: str
    """Run name (the Redis key namespace)."""
    storage_options: Mapping[str, Any] = field(default_factory=dict)


def write_model_description(store: Store, config_json: str, tokenizer_json: str) -> None:
    """Create-only: a run's model is fixed for its whole life."""
    store.put(MODEL_CONFIG_KEY, config_json.encode("utf-8"), mode="create")
    store.put(TOKENIZER_KEY, tokenizer_json.encode("utf-8"), mode="create")


def read_model_description(store: Store) -> tuple[Any, Any]:
    """(model skeleton in bf16 with random weights, tokenizer) from ``model/`` in the store."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from workers.tokenizer import CharTokenizer

    try:
        cfg_raw = store.get(MODEL_CONFIG_KEY)
        tok_raw = store.get(TOKENIZER_KEY)
    except ObjectNotFound as e:
        raise ConfigError(f"{e}: the run has no model description yet (has the Trainer started?)") from None
    try:
        cfg_dict = json.loads(cfg_raw)
        model_type = cfg_dict.pop("model_type")
    except (ValueError, KeyError) as e:
        raise ConfigError(f"{store.where(MODEL_CONFIG_KEY)}: not a model config: {e}") from None
    cfg = AutoConfig.for_model(model_type, **cfg_dict)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
    torch.nn.Module.to(model, dtype=torch.bfloat16)
    tokenizer = CharTokenizer.from_json(tok_raw.decode("utf-8"), where=store.where(TOKENIZER_KEY))
    return model.eval(), tokenizer


DIGEST_LOG_ENV = "AURORA_DIGEST_LOG"
"""A file each worker appends one JSON line ``{"who", "version", "digest"}`` to per digest it
records, when set: the chaos benchmark compares digests kept outside Redis, which its faults erase."""

_digest_log_failed = False


def _append_digest_log(who: str, version: int, digest: str) -> None:
    """One ``write`` of one line with ``O_APPEND``: lines of concurrent workers never interleave."""
    global _digest_log_failed
    path = os.environ.get(DIGEST_LOG_ENV)
    if not path:
        return
    line = (json.dumps({"who": who, "version": int(version), "digest": digest}) + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError as e:
        if not _digest_log_failed:  # a diagnostic aid: say so once, never stop the worker
            _digest_log_failed = True
            log.warning("%s=%s: cannot append digests: %s", DIGEST_LOG_ENV, path, e)


def record_digest(redis: Any, keys: RunKeys, who: str, version: int, digest: str, keep_versions: int | None = None) -> None:
    """``who`` is ``trainer`` or an Actor id.

    The hashes keep the newest ``keep_versions`` versions (default
    ``AURORA_LEDGER_KEEP_VERSIONS``, 1000); with ``AURORA_DIGEST_LOG`` set
    the digest is also appended to that file (first, so a Redis outage does
    not lose it there).
    """
    _append_digest_log(who, version, digest)
    if who == "trainer":
        record_versioned(redis, keys, keys.trainer_digests, str(version), digest, version, keep_versions)
    else:
        record_versioned(redis, keys, keys.actor_digests, f"{who}|{version}", digest, version, keep_versions)


def record_activation(
    redis: Any, keys: RunKeys, who: str, version: int, stage_s: float, activate_s: float, keep_versions: int | None = None
) -> None:
    """How long Actor ``who`` took to stage and to activate ``version`` (read by the demo and ``bench e2e``)."""
    body = json.dumps({"stage_s": stage_s, "activate_s": activate_s})
    record_versioned(redis, keys, keys.activations, f"{who}|{version}", body, version, keep_versions)


def read_digests(redis: Any, keys: RunKeys) -> tuple[dict[int, str], dict[tuple[str, int], str]]:
    """(trainer digests by version, actor digests by (actor, version)): the newest versions kept."""
    t = {int(k): v.decode() for k, v in redis.hgetall(keys.trainer_digests).items()}
    a: dict[tuple[str, int], str] = {}
    for k, v in redis.hgetall(keys.actor_digests).items():
        who, _, ver = k.decode().rpartition("|")
        a[(who, int(ver))] = v.decode()
    return t, a


def install_stop_handlers(stop: threading.Event) -> None:
    """SIGTERM (a spot preemption notice) and SIGINT set ``stop``: leave gracefully."""

    def handler(signum: int, frame: Any) -> None:
        log.info("signal %d: stopping gracefully", signum)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def limit_torch_threads(default: int = 1) -> None:
    """Small CPU machines run several workers: one torch thread each unless told otherwise.

    Measured here: two torch threads per process on a busy 2-core machine ran a
    warm start 6x slower than one. ``AURORA_TORCH_THREADS`` overrides.
    """
    n = int(os.environ.get("AURORA_TORCH_THREADS", default))
    if n > 0:
        torch.set_num_threads(n)


def setup_logging(name: str, verbose: bool = False) -> logging.Logger:
    """Configure the root logger for a worker process (never at import time)."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format=f"%(asctime)s {name} %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    return logging.getLogger(f"aurora.{name}")
