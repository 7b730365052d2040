"""A run as a Trainer leaves it, written by hand, for tests of the real Actor.

:class:`TinyRun` writes what the Trainer would: the model description (a
tiny Qwen3 and the character tokenizer), the v0 snapshot, deltas and
snapshots, the run's ``head`` in Redis, and steps in the ledger; it keeps
each version's weights so a test can compare an Actor's digest with the
Trainer's. No training happens: each delta changes a chosen fraction of
the elements at random, so a test decides how big deltas are.

Test modules import it explicitly (``from actor_fixtures import TinyRun``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from aurora_store.apply.sink import weights_digest
from aurora_store.codec.extract import extract, fuse_weights
from aurora_store.coordination.keys import RunKeys
from aurora_store.coordination.ledger import Ledger
from aurora_store.coordination.records import record_expected_state
from aurora_store.coordination.redisconn import connect
from aurora_store.format.manifest import Manifest, version_dir
from aurora_store.lineage.binding import ModelFile
from aurora_store.lineage.publish import PublishConfig, publish_delta, publish_snapshot
from aurora_store.storage import Store
from workers.actor import Actor
from workers.common import write_model_description
from workers.model import fusion_plan_for, hf_weights, is_tied, tiny_qwen3
from workers.tokenizer import CharTokenizer

__all__ = ["Counting", "TinyRun", "running"]

CFG = PublishConfig(streams=2, segment_bytes=16 << 10)


class TinyRun:
    """The Trainer's side of a run: what it writes into the store and Redis."""

    def __init__(self, store: Store, redis_url: str, run: str, seed: int = 0) -> None:
        self.store = store
        self.run = run
        self.redis_url = redis_url
        self.redis = connect(redis_url)
        self.keys = RunKeys(run)
        self.ledger = Ledger(self.redis, run)
        self.tokenizer = CharTokenizer()
        self.model = tiny_qwen3(self.tokenizer.vocab_size, seed=seed)
        hf = hf_weights(self.model)
        self.tied = is_tied(hf)
        self.plan = fusion_plan_for(self.model)
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.states: dict[int, str] = {}
        self.manifests: dict[tuple[str, int], Manifest] = {}
        self.model_files: list[ModelFile] | None = None
        self.record_states = False
        """Record each version's state in Redis when the head reaches it (the Trainer does)."""
        self._w0 = self._copy(hf)
        self._gen = torch.Generator().manual_seed(seed + 1)

    def _copy(self, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {n: t.detach().clone() for n, t in w.items()}
        if self.tied:  # one storage under two names, as in the model
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
        return out

    @property
    def head(self) -> int:
        return max(self.weights)

    # -- the store ----------------------------------------------------------------
    def describe(self) -> None:
        """The model description (``model/``): the first thing a Trainer writes (v0's manifest lists it)."""
        self.model_files = write_model_description(self.store, self.model.config.to_json_string(), self.tokenizer.to_json())

    def publish_v0(self, announce_head: bool = True) -> None:
        m = publish_snapshot(self.store, self.run, 0, fuse_weights(self._w0, self.plan), None, CFG, model=self.model_files)
        self.weights[0], self.states[0] = self._w0, m.state
        self.manifests[("snapshot", 0)] = m
        if announce_head:
            self.set_head(0)

    def start(self) -> None:
        """Model description, v0 and the head: a Trainer that has set up."""
        self.describe()
        self.publish_v0()

    def step(self, n: int = 1, density: float = 0.01, announce_head: bool = True) -> None:
        """Publish ``n`` deltas, each changing about ``density`` of every parameter."""
        for _ in range(n):
            v = self.head + 1
            old = self.weights[v - 1]
            new = self._copy(old)
            for name, t in new.items():
                if self.tied and name == "lm_head.weight":
                    continue
                flat = t.view(-1)
                k = max(1, int(flat.numel() * density))
                idx = torch.randperm(flat.numel(), generator=self._gen)[:k]
                flat[idx] = (flat[idx].float() + 0.05 * torch.randn(k, generator=self._gen) + 0.01).to(flat.dtype)
            m = publish_delta(
                self.store,
                self.run,
                v,
                extract(self.plan, old, new),
                self.states[v - 1],
                CFG,
                weights_digest=weights_digest(new, self.plan),
            )
            self.weights[v], self.states[v] = new, m.state
            self.manifests[("delta", v)] = m
            if announce_head:
                self.set_head(v)

    def snapshot(self, v: int) -> Manifest:
        m = publish_snapshot(self.store, self.run, v, fuse_weights(self.weights[v], self.plan), self.states[v], CFG)
        self.manifests[("snapshot", v)] = m
        return m

    def digest(self, v: int) -> str:
        return weights_digest(self.weights[v], self.plan)

    # -- Redis ----------------------------------------------------------------------
    def set_head(self, v: int) -> None:
        if self.record_states:  # as the Trainer does, before the head names the version
            record_expected_state(self.redis, self.keys, v, self.states[v])
        self.redis.hset(self.keys.trainer, mapping={"head": v, "head_state": self.states[v]})

    def open_step(self, step: int, version: int, prompts: int = 40, lease_ms: int = 120_000, group: int = 2) -> list[str]:
        """A step whose prompts must be generated on ``version``; returns the prompt ids."""
        items = []
        for i in range(prompts):
            text = f"{i % 10}+{(i * 7) % 10}="
            pid = f"s{step}-p{i}"
            items.append((pid, json.dumps({"id": pid, "text": text, "ids": self.tokenizer.encode(text, bos=True)}).encode()))
        self.ledger.create_step(step, self.states[version], items, {}, group, lease_ms, version=version)
        return [p for p, _ in items]

    def settled(self, step: int) -> int:
        total, settled = self.redis.hmget(self.keys.step(step), "total", "settled")
        return 0 if total is None else int(settled or 0)

    def reconnect(self) -> None:
        """New clients (after a Redis restart, the old connections are dead)."""
        self.redis.close()
        self.redis = connect(self.redis_url)
        self.ledger = Ledger(self.redis, self.run)

    def close(self) -> None:
        self.redis.close()


@contextmanager
def running(actor: Actor) -> Iterator[dict[str, Any]]:
    """Run ``actor`` in a thread; on exit stop it and re-raise what ended it, if anything.

    Yields a dict whose ``"error"`` is set as soon as :meth:`Actor.run` raised
    (a test can assert the Actor is still up) and whose ``"stats"`` holds
    what it returned.
    """
    out: dict[str, Any] = {"error": None, "stats": None}

    def go() -> None:
        try:
            out["stats"] = actor.run()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=go, name=f"actor-{actor.cfg.actor_id}", daemon=True)
    t.start()
    out["thread"] = t
    try:
        yield out
    finally:
        actor.stop.set()
        t.join(timeout=60)
    if out["error"] is not None:
        raise out["error"]


class Counting:
    """A store that records every read that reaches it (wrap an Actor's origin with it)."""

    def __init__(self, inner: Store) -> None:
        self.inner, self.gets, self.lists = inner, [], 0

    def get(self, key: str, *a: Any, **kw: Any) -> bytes:
        self.gets.append(key)
        return self.inner.get(key, *a, **kw)

    def get_capped(self, key: str, *a: Any, **kw: Any) -> bytes:
        self.gets.append(key)
        return self.inner.get_capped(key, *a, **kw)

    def list(self, *a: Any, **kw: Any) -> Any:
        self.lists += 1
        return self.inner.list(*a, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def segments_read(self, kind: str, version: int) -> list[str]:
        d = version_dir(kind, version) + "/"
        return [k for k in self.gets if k.startswith(d) and not k.endswith("manifest.json")]
