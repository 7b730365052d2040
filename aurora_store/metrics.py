"""Prometheus metrics of the workers: one set of metric objects per process, one exporter.

Every worker (``aurora trainer``, ``actor``, ``relay``) records what it does
with one call at the point where it happens (a version published, staged,
activated or mirrored; a lease claimed or settled; an outage starting or
ending) on :func:`active`, and serves the lot over HTTP when started with
``--metrics-port N`` (:func:`serve_from_args`). The names, types and labels
are listed in docs/WORKERS.md, "Metrics"; ``infra/grafana-aurora.json`` is a
dashboard built on them.

Each :class:`Metrics` holds its metric objects in a
:class:`~prometheus_client.CollectorRegistry` of its own, never the global
default: a test can make as many as it needs, and a worker's exporter serves
only Aurora's metrics. A process that was given no port still records into
an unserved one (a dictionary update per event), so the recording lines
never need an ``if``.

This module is shared by every layer (:mod:`aurora_store.outage` reports
outages here), so it imports none of them: only ``prometheus_client``, the
standard library and :mod:`aurora_store.errors`.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from aurora_store.errors import ConfigError

__all__ = [
    "DEFAULT_METRICS_HOST",
    "METRICS_PREFIX",
    "SECONDS_BUCKETS",
    "Metrics",
    "MetricsServer",
    "StepRecord",
    "active",
    "install",
    "serve_from_args",
    "step_key",
    "step_record",
    "uninstall",
]

SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Histogram buckets of every ``*_seconds`` metric: 1 ms (a small delta applied) to 60 s (a
large model's snapshot across a far link); slower lands in ``+Inf``."""

DEFAULT_METRICS_HOST = "127.0.0.1"
"""Where the exporter listens unless ``--metrics-host`` says otherwise. Loopback: the
endpoint has no authentication and no TLS, and names Actors, regions, rewards and lag;
opening it to the network is a deliberate choice (docs/WORKERS.md, "Metrics")."""

METRICS_PREFIX = "metrics/"
"""Where the Trainer's per-step records go, under the run root (:func:`step_key`)."""

_ACTOR = ("actor", "region")


class StepRecord(Protocol):
    """What :meth:`Metrics.trainer_step` and :func:`step_record` read of one Trainer step
    (``workers.trainer.trainer.StepLog`` has these fields; this module may not import it)."""

    step: int
    version: int
    reward: float
    wait_s: float
    train_s: float
    extract_publish_s: float
    step_s: float
    delta_bytes: int
    changed: int
    tokens: int
    tokens_per_s: float
    by_actor: dict[str, int]


@dataclass(frozen=True, slots=True)
class MetricsServer:
    """A running exporter: ``port`` is the one bound (useful with port 0); :meth:`close` stops it."""

    host: str
    port: int
    server: WSGIServer
    thread: threading.Thread

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


class Metrics:
    """The metric objects of one process, in their own registry.

    ``worker`` (``trainer``, ``actor``, ``relay``) labels the metrics every
    worker has (outages); the others are each one worker's and carry the
    labels that tell its instances apart (``actor``, ``region``) and what
    was counted (``kind``, ``origin``, ``result``, ``phase``). Thread-safe:
    the Actor's stager, main loop and heartbeat record concurrently.
    """

    def __init__(self, worker: str = "", registry: CollectorRegistry | None = None) -> None:
        self.worker = worker
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        b = SECONDS_BUCKETS
        self._lock = threading.Lock()
        self._newest_published = -1
        self._published_in_step = False
        self._head: dict[tuple[str, str], int] = {}
        self._active: dict[tuple[str, str], int] = {}
        self._staged_at: dict[tuple[str, str], dict[int, float]] = {}
        self._newest_mirrored: dict[str, int] = {}

        # -- Trainer --
        self.versions_published = Counter(
            "aurora_versions_published",
            "Versions the Trainer published (v0 included; a snapshot at a version already published as a delta is not another version)",
            registry=r,
        )
        self.published_version = Gauge("aurora_published_version", "Newest version the Trainer published (the run's head)", registry=r)
        self.published_bytes = Counter(
            "aurora_published_bytes", "Bytes of versions the Trainer wrote to the store (segments and manifests)", ("kind",), registry=r
        )
        self.publish_seconds = Histogram(
            "aurora_publish_seconds",
            "Extracting and publishing one version, delta and any snapshot (the Trainer's critical path)",
            registry=r,
            buckets=b,
        )
        self.trainer_steps = Counter("aurora_trainer_steps", "Training steps taken (each publishes one version)", registry=r)
        self.step_seconds = Histogram(
            "aurora_trainer_step_seconds",
            "Parts of a Trainer step: waiting for the batch, training, extract+publish, the whole step",
            ("phase",),
            registry=r,
            buckets=b,
        )
        self.trainer_rollouts = Counter(
            "aurora_trainer_rollouts",
            "Rollouts the Trainer collected and trained on (one per prompt: its group of completions)",
            registry=r,
        )
        self.trainer_tokens = Counter("aurora_trainer_tokens", "Completion tokens the Trainer trained on", registry=r)
        self.trainer_tokens_per_s = Gauge(
            "aurora_trainer_tokens_per_second", "Completion tokens of the last step over that step's wall time", registry=r
        )
        self.reward = Gauge("aurora_reward_mean", "Mean reward of the last step's completions (the Trainer's own rewards)", registry=r)
        self.eval_accuracy = Gauge(
            "aurora_eval_accuracy", "Held-out accuracy of the newest evaluated version (trainer.eval_accuracy)", registry=r
        )
        self.eval_version = Gauge("aurora_eval_version", "Version aurora_eval_accuracy was measured on", registry=r)

        # -- Actor --
        self.versions_staged = Counter(
            "aurora_versions_staged",
            "Versions the Actor staged (fetched, verified, decoded): deltas, or whole versions from a snapshot",
            (*_ACTOR, "kind"),
            registry=r,
        )
        self.versions_activated = Counter(
            "aurora_versions_activated",
            "Versions the Actor activated at a safe point (one per entry of the activations hash)",
            _ACTOR,
            registry=r,
        )
        self.staged_version = Gauge("aurora_staged_version", "Newest version the Actor holds staged", _ACTOR, registry=r)
        self.active_version = Gauge("aurora_active_version", "Version the Actor generates with", _ACTOR, registry=r)
        self.lag = Gauge(
            "aurora_actor_lag_versions", "The run's head minus the Actor's active version (as last read from Redis)", _ACTOR, registry=r
        )
        self.fetched_bytes = Counter(
            "aurora_fetched_bytes",
            "Bytes of versions the Actor fetched, by kind and by where from (origin or the region's mirror)",
            (*_ACTOR, "kind", "origin"),
            registry=r,
        )
        self.stage_seconds = Histogram("aurora_stage_seconds", "Staging one version: fetch, verify, decode", _ACTOR, registry=r, buckets=b)
        self.apply_seconds = Histogram(
            "aurora_apply_seconds", "Writing one staged version into the engine's weights", _ACTOR, registry=r, buckets=b
        )
        self.activation_seconds = Histogram(
            "aurora_activation_seconds",
            "From the start of staging a version to generating with it (stage, wait for the safe point, apply)",
            _ACTOR,
            registry=r,
            buckets=b,
        )
        self.leases_claimed = Counter("aurora_leases_claimed", "Leases (prompts) the Actor claimed", _ACTOR, registry=r)
        self.leases_settled = Counter(
            "aurora_leases_settled",
            "Results the Actor settled, by the ledger's answer: accepted, or the reason it refused (duplicate, expired, …)",
            (*_ACTOR, "result"),
            registry=r,
        )
        self.actor_rollouts = Counter(
            "aurora_actor_rollouts", "Rollouts the Actor generated (one per leased prompt: its group of completions)", _ACTOR, registry=r
        )
        self.actor_tokens = Counter("aurora_actor_tokens", "Completion tokens the Actor generated", _ACTOR, registry=r)
        self.actor_tokens_per_s = Gauge(
            "aurora_actor_tokens_per_second",
            "Completion tokens of the Actor's last generation batch over its generation time",
            _ACTOR,
            registry=r,
        )

        # -- Relay --
        self.versions_mirrored = Counter(
            "aurora_versions_mirrored", "Versions the Relay completed in its mirror (manifest written last)", ("region", "kind"), registry=r
        )
        self.mirrored_version = Gauge(
            "aurora_mirrored_version", "Newest version the Relay completed in its mirror", ("region",), registry=r
        )
        self.mirrored_bytes = Counter(
            "aurora_mirrored_bytes",
            "Bytes the Relay copied from origin into its mirror (verified objects and manifests; model = the model description)",
            ("region", "kind"),
            registry=r,
        )
        self.mirror_seconds = Histogram(
            "aurora_mirror_seconds",
            "From the first object of a version fetched at origin to its manifest in the mirror",
            ("region", "kind"),
            registry=r,
            buckets=b,
        )

        # -- every worker --
        self.outage_state = Gauge(
            "aurora_outage", "1 while a dependency (Redis, a store) is unreachable, 0 otherwise", ("worker", "dependency"), registry=r
        )
        self.outages = Counter(
            "aurora_outages", "Outages of a dependency seen so far (each counted at its start)", ("worker", "dependency"), registry=r
        )

    # -- Trainer ----------------------------------------------------------------------
    def published(self, version: int, kind: str, nbytes: int) -> None:
        """The Trainer wrote ``kind`` (delta, snapshot) ``version`` of ``nbytes``."""
        self.published_bytes.labels(kind).inc(max(0, nbytes))
        with self._lock:
            self._published_in_step = True
            if version <= self._newest_published:
                return  # a snapshot at a version published as a delta just before
            self._newest_published = version
        self.versions_published.inc()
        self.published_version.set(version)

    def trainer_step(self, s: StepRecord) -> None:
        """One Trainer step done (its log entry)."""
        self.trainer_steps.inc()
        for phase, secs in (("wait", s.wait_s), ("train", s.train_s), ("publish", s.extract_publish_s), ("step", s.step_s)):
            self.step_seconds.labels(phase).observe(max(0.0, secs))
        with self._lock:
            shipped, self._published_in_step = self._published_in_step, False
        if shipped:  # not the baseline that ships nothing (an empty delta is still a publish)
            self.publish_seconds.observe(max(0.0, s.extract_publish_s))
        self.trainer_rollouts.inc(sum(s.by_actor.values()))
        self.trainer_tokens.inc(max(0, s.tokens))
        self.trainer_tokens_per_s.set(s.tokens_per_s)
        self.reward.set(s.reward)

    def evaluated(self, version: int, accuracy: float) -> None:
        """Held-out accuracy measured on ``version``."""
        self.eval_accuracy.set(accuracy)
        self.eval_version.set(version)

    # -- Actor ------------------------------------------------------------------------
    def bootstrapped(self, actor: str, region: str, version: int, nbytes: int) -> None:
        """The Actor loaded a whole version from origin (a snapshot and deltas) into its engine."""
        self.fetched_bytes.labels(actor, region, "snapshot", "origin").inc(max(0, nbytes))
        self.staged_version.labels(actor, region).set(version)
        self._set_active(actor, region, version)

    def staged(self, actor: str, region: str, version: int, kind: str, nbytes: int, origin: str, seconds: float) -> None:
        """The Actor staged ``version`` (``kind``: delta, or snapshot for a whole version) read from ``origin`` (origin, mirror)."""
        self.versions_staged.labels(actor, region, kind).inc()
        self.staged_version.labels(actor, region).set(version)
        self.fetched_bytes.labels(actor, region, kind, origin).inc(max(0, nbytes))
        self.stage_seconds.labels(actor, region).observe(max(0.0, seconds))
        with self._lock:
            started = self._staged_at.setdefault((actor, region), {})
            started[version] = time.monotonic() - max(0.0, seconds)
            if len(started) > 1024:  # staged but never activated (dropped, superseded): bounded
                del started[min(started)]

    def activated(self, actor: str, region: str, version: int, apply_s: float) -> None:
        """The Actor activated ``version`` at a safe point; writing it took ``apply_s``."""
        self.versions_activated.labels(actor, region).inc()
        self.apply_seconds.labels(actor, region).observe(max(0.0, apply_s))
        with self._lock:
            started = self._staged_at.get((actor, region), {})
            t0 = started.pop(version, None)
            for old in [v for v in started if v < version]:
                del started[old]
        if t0 is not None:
            self.activation_seconds.labels(actor, region).observe(max(0.0, time.monotonic() - t0))
        self._set_active(actor, region, version)

    def head_seen(self, actor: str, region: str, head: int | None) -> None:
        """The Actor read the run's head (None: no head yet)."""
        if head is None:
            return
        with self._lock:
            self._head[(actor, region)] = head
            active = self._active.get((actor, region))
        if active is not None:
            self.lag.labels(actor, region).set(max(0, head - active))

    def _set_active(self, actor: str, region: str, version: int) -> None:
        self.active_version.labels(actor, region).set(version)
        with self._lock:
            self._active[(actor, region)] = version
            head = max(self._head.get((actor, region), version), version)
        self.lag.labels(actor, region).set(head - version)

    def claimed(self, actor: str, region: str, leases: int) -> None:
        """The Actor claimed ``leases`` leases."""
        self.leases_claimed.labels(actor, region).inc(max(0, leases))

    def settled(self, actor: str, region: str, result: str) -> None:
        """The ledger answered one of the Actor's results: ``accepted``, or why not."""
        self.leases_settled.labels(actor, region, result or "unknown").inc()

    def generated(self, actor: str, region: str, rollouts: int, tokens: int, seconds: float) -> None:
        """The Actor generated ``rollouts`` prompts' completions, ``tokens`` new tokens, in ``seconds``."""
        self.actor_rollouts.labels(actor, region).inc(max(0, rollouts))
        self.actor_tokens.labels(actor, region).inc(max(0, tokens))
        if seconds > 0:
            self.actor_tokens_per_s.labels(actor, region).set(tokens / seconds)

    # -- Relay ------------------------------------------------------------------------
    def copied(self, region: str, kind: str, nbytes: int) -> None:
        """The Relay wrote an object of ``kind`` (delta, snapshot, model) into its mirror."""
        self.mirrored_bytes.labels(region, kind).inc(max(0, nbytes))

    def mirrored(self, region: str, kind: str, version: int, seconds: float) -> None:
        """The Relay completed ``kind`` ``version`` in its mirror, ``seconds`` after it began."""
        self.versions_mirrored.labels(region, kind).inc()
        self.mirror_seconds.labels(region, kind).observe(max(0.0, seconds))
        with self._lock:
            newest = max(self._newest_mirrored.get(region, -1), version)
            self._newest_mirrored[region] = newest
        self.mirrored_version.labels(region).set(newest)

    # -- every worker -------------------------------------------------------------------
    def outage(self, dependency: str, away: bool, started: bool = False) -> None:
        """``dependency`` is away (``away``) or reachable; ``started``: an outage began just now."""
        self.outage_state.labels(self.worker, dependency).set(1 if away else 0)
        if started:
            self.outages.labels(self.worker, dependency).inc()

    # -- the exporter -------------------------------------------------------------------
    def serve(self, port: int, host: str = DEFAULT_METRICS_HOST) -> MetricsServer:
        """Serve this registry at ``http://host:port/metrics`` from a daemon thread (port 0: any free one).

        A port that cannot be bound is a :class:`ConfigError` naming it.
        """
        if not 0 <= port <= 65535:
            raise ConfigError(f"--metrics-port {port}: not a TCP port (0-65535)")
        try:
            server, thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise ConfigError(f"--metrics-port {port}: cannot listen on {host}:{port}: {e.strerror or e}") from None
        return MetricsServer(host, int(server.server_port), server, thread)


_active: Metrics | None = None
_active_lock = threading.Lock()


def active() -> Metrics:
    """The process's metrics: the installed ones, else an unserved set (recording costs little)."""
    global _active
    m = _active
    if m is None:
        with _active_lock:
            if _active is None:
                _active = Metrics()
            m = _active
    return m


def install(worker: str, registry: CollectorRegistry | None = None) -> Metrics:
    """Make a fresh :class:`Metrics` for ``worker`` the process's (what :func:`active` returns)."""
    global _active
    m = Metrics(worker, registry)
    with _active_lock:
        _active = m
    return m


def uninstall() -> None:
    """Forget the installed metrics (tests that installed some, in a process that goes on)."""
    global _active
    with _active_lock:
        _active = None


def serve_from_args(args: argparse.Namespace, worker: str) -> MetricsServer | None:
    """``--metrics-port`` / ``--metrics-host`` of a worker: install its metrics and serve them; None when off."""
    port = getattr(args, "metrics_port", None)
    if not port:
        return None
    host = getattr(args, "metrics_host", None) or DEFAULT_METRICS_HOST
    return install(worker).serve(int(port), host)


def step_key(step: int) -> str:
    """``metrics/step-<8 digits>.json`` of Trainer step ``step``."""
    return f"{METRICS_PREFIX}step-{step:08d}.json"


def step_record(s: StepRecord, eval_accuracy: float | None = None) -> tuple[str, bytes]:
    """(key, body) of one step's record in the run root: a small create-only JSON object, since
    object stores cannot append. ``eval_accuracy``: measured on this step's version, if it was."""
    body: dict[str, Any] = {
        "step": s.step,
        "version": s.version,
        "reward": s.reward,
        "tokens": s.tokens,
        "tokens_per_s": s.tokens_per_s,
        "wait_s": s.wait_s,
        "train_s": s.train_s,
        "publish_s": s.extract_publish_s,
        "step_s": s.step_s,
        "delta_bytes": s.delta_bytes,
        "changed": s.changed,
        "time_ms": int(time.time() * 1000),
    }
    # Parts of the step the Trainer times where it has them (``aurora bench trainer`` reads them back):
    # ``publish_s`` above is the whole publish call, these split it and add the checkpoint's wait.
    for name, field in (("publish_wait_s", "publish_s"), ("digest_s", "digest_s"), ("checkpoint_wait_s", "checkpoint_wait_s")):
        value = getattr(s, field, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            body[name] = float(value)
    if eval_accuracy is not None:
        body["eval_accuracy"] = eval_accuracy
    return step_key(s.step), json.dumps(body, sort_keys=True).encode("utf-8")
