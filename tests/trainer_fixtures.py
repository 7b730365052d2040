"""Test Trainers: one that publishes the tiny model's chain as the Trainer does, and the real Trainer over a tiny workload.

:class:`FakeTrainer` publishes snapshot 0 and then deltas of the tiny Qwen3
(:func:`aurora_tools.synthetic.shapes.make_weights`, stepped by
:class:`~aurora_tools.synthetic.shapes.MasterWeights`) at origin, each delta
carrying its weights digest, and announces segments and versions on a bus
when given one (the Relay tests), optionally signed (the signing tests).

:class:`TinyWorkload` is a step source and weights source
(:mod:`workers.trainer.sources`) over one small bf16 tensor; the Trainer
around it is the real one (epochs, batches over the ledger, the Publisher,
the run's records). :func:`settling_actor` claims every open step's prompts
and settles them on the version and state the run's records name, so batches
close without an engine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch

from aurora_store.apply.sink import weights_digest
from aurora_store.codec.extract import extract, fuse_weights, plan_of, spec_of
from aurora_store.codec.fusion import FusionPlan
from aurora_store.coordination.bus import SEGMENT, VERSION, Bus
from aurora_store.coordination.ledger import AcceptedResult, Ledger
from aurora_store.coordination.records import RunRecords
from aurora_store.format.manifest import Manifest, manifest_key
from aurora_store.format.signing import Signer
from aurora_store.lineage.publish import (
    PublishConfig,
    SegmentEvent,
    publish_delta,
    publish_snapshot,
)
from aurora_store.storage import Store
from aurora_tools.synthetic.shapes import QWEN3_TINY, MasterWeights, make_weights
from workers.trainer.grpo import Rollouts
from workers.trainer.sources import FirstVersion

CFG = PublishConfig(streams=4, segment_bytes=2048)
"""Small segments: every delta of the tiny model spans several objects."""


class FakeTrainer:
    """Publishes at origin (and announces on ``bus``, each announcement ``repeat`` times) as the Trainer does.

    Snapshot 0 is published at construction; :meth:`step` publishes the next
    delta, :meth:`snapshot` a snapshot of a version already published.
    ``signer`` (settable between steps) signs every manifest;
    ``weights_digests=False`` leaves the weights digest out of the deltas
    (FORMAT.md allows it: a writer that puts digests only where it snapshots).
    """

    def __init__(
        self,
        store: Store,
        run: str = "t",
        bus: Bus | None = None,
        *,
        repeat: int = 1,
        config: PublishConfig = CFG,
        signer: Signer | None = None,
        weights_digests: bool = True,
    ) -> None:
        self.store, self.run, self.bus, self.repeat, self.config, self.signer = store, run, bus, repeat, config, signer
        self.weights_digests = weights_digests
        self.weights = {0: make_weights(QWEN3_TINY, seed=0)}
        self.plan = FusionPlan.from_specs({n: spec_of(t, n) for n, t in self.weights[0].items()})
        self.master = MasterWeights(self.weights[0], seed=0)
        self.manifests: dict[tuple[str, int], Manifest] = {}
        m = publish_snapshot(store, run, 0, fuse_weights(self.weights[0], self.plan), None, config, signer=signer)
        self.states = {0: m.state}
        self._committed(m, announce=True)

    def _committed(self, m: Manifest, announce: bool) -> None:
        self.manifests[(m.kind, m.version)] = m
        if announce:
            self.announce(m)

    def announce(self, m: Manifest) -> None:
        """VERSION for ``m`` on the bus (``repeat`` times); nothing without a bus."""
        for _ in range(self.repeat if self.bus is not None else 0):
            assert self.bus is not None
            self.bus.announce(VERSION, m.version, kind=m.kind, state=m.state, bytes=m.total_bytes)

    def step(
        self,
        before: Callable[[SegmentEvent], None] | None = None,
        after: Callable[[SegmentEvent], None] | None = None,
        announce: bool = True,
    ) -> Manifest:
        """Publish the next delta; ``before``/``after`` run around each segment's announcement."""
        v = max(self.weights) + 1

        def on_segment(ev: SegmentEvent) -> None:
            if before is not None:
                before(ev)
            for _ in range(self.repeat if announce and self.bus is not None else 0):
                assert self.bus is not None
                self.bus.announce(SEGMENT, ev.version, index=ev.index, key=ev.key, bytes=ev.bytes, sha256=ev.sha256)
            if after is not None:
                after(ev)

        new = self.master.step(lr=2.5e-7)
        m = publish_delta(
            self.store,
            self.run,
            v,
            extract(self.plan, self.weights[v - 1], new),
            self.states[v - 1],
            self.config,
            on_segment=on_segment,
            weights_digest=weights_digest(new, self.plan) if self.weights_digests else None,
            signer=self.signer,
        )
        self.weights[v], self.states[v] = new, m.state
        self._committed(m, announce)
        return m

    def steps(self, n: int) -> None:
        """``n`` deltas, announced."""
        for _ in range(n):
            self.step()

    def snapshot(self, v: int) -> Manifest:
        """A snapshot of version ``v`` (already published as a delta), announced."""
        m = publish_snapshot(
            self.store, self.run, v, fuse_weights(self.weights[v], self.plan), self.states[v], self.config, signer=self.signer
        )
        self._committed(m, announce=True)
        return m

    def digest(self, v: int) -> str:
        return weights_digest(self.weights[v], self.plan)

    def version_bytes(self, kind: str, v: int) -> int:
        """Objects plus manifest: what one copy of the version weighs."""
        return self.manifests[(kind, v)].total_bytes + len(self.store.get(manifest_key(kind, v)))


class TinyWorkload:
    """Version 0 is a ramp; each step adds one to one element (the step's index). Records what it was given."""

    def __init__(self, batch: int = 2) -> None:
        self.batch = batch
        self.current = {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8).to(torch.bfloat16)}
        self.trained = 0
        self.behaviours: list[dict[str, torch.Tensor]] = []
        """The behaviour weights each :meth:`train` was given."""
        self.made = [self.current]
        """The weights of every version, version 0 first."""

    def first_version(self, store: Store) -> FirstVersion:
        return FirstVersion(self.current, plan_of(self.current, tied=False), None)

    def prompts(self, step: int) -> list[tuple[str, bytes]]:
        return [(f"s{step}-{i}", b"{}") for i in range(self.batch)]

    def rollouts(self, results: Mapping[str, AcceptedResult]) -> Rollouts:
        out = Rollouts(tokens=len(results))
        for r in results.values():
            out.by_actor[r.actor] = out.by_actor.get(r.actor, 0) + 1
        return out

    def train(self, rollouts: Rollouts, behaviour: Mapping[str, torch.Tensor]) -> None:
        self.behaviours.append(dict(behaviour))
        new = {n: t.clone() for n, t in self.current.items()}
        new["w"].view(-1)[self.trained % 64] += 1
        self.current = new
        self.made.append(new)
        self.trained += 1

    def weights(self) -> dict[str, torch.Tensor]:
        return self.current


@contextmanager
def settling_actor(redis: object, run: str, actor: str = "a0", poll_s: float = 0.01) -> Iterator[threading.Event]:
    """A thread that settles every open step's prompts on the version (and state) the run records; set the event to stop it."""
    ledger, records = Ledger(redis, run), RunRecords(redis, run)
    stop = threading.Event()

    def loop() -> None:
        ledger.register(actor)
        while not stop.wait(poll_s):
            for b in ledger.open_steps():
                v = ledger.step_version(b)
                state = records.expected_state(v) if v is not None else None
                if v is None or state is None:
                    continue
                ledger.heartbeat(actor, active=v, staged=v, active_state=state)
                status, leases = ledger.claim(actor, b, 16)
                for lease in leases if status == "ok" else []:
                    ledger.settle(actor, lease, v, state, b"{}")

    t = threading.Thread(target=loop, name=f"settling-{actor}", daemon=True)
    t.start()
    try:
        yield stop
    finally:
        stop.set()
        t.join(10)
