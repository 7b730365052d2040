"""The faults of ``aurora bench chaos``: one injector per fault of :data:`~aurora_tools.bench.chaos.config.FAULTS`.

An injector breaks something, waits for as long as the fault lasts, and
lifts it (restarts, resumes, SIGCONTs); it blocks only for the fault itself,
never for the run's recovery (the harness waits for that, and reads what
the workers did from their logs afterwards). What it did and saw goes into
the :class:`FaultRecord`: the phase the run was in, and notes.
"""

from __future__ import annotations

import json
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from aurora_store.coordination.bus import SEGMENT, Bus
from aurora_store.format.manifest import manifest_key
from aurora_tools.bench.chaos.config import FAULT_TITLES, ChaosConfig
from aurora_tools.bench.chaos.fleet import ACTIVATED_RE, AofRedis, Fleet, Incarnation

__all__ = ["FaultRecord", "INJECTORS", "ChaosRun"]


class ChaosRun(Protocol):
    """What an injector may touch of a run (:class:`aurora_tools.bench.chaos.harness.ChaosRun`):
    its servers and workers, and the few helpers that read Redis and the store for it."""

    cfg: ChaosConfig
    fleet: Fleet
    rng: random.Random
    redis: AofRedis
    run: str
    """The run's name."""
    bucket: str
    """The origin bucket (the run root is ``s3://bucket/run``)."""
    relay_name: str
    relay_actors: list[str]
    origin_actors: list[str]

    def phase(self) -> str: ...
    def count_keys(self) -> tuple[int, int]: ...
    def pause_s3(self) -> None: ...
    def resume_s3(self) -> None: ...
    def s3_client(self) -> Any: ...
    def s3_exists(self, key: str) -> bool: ...
    def s3_count(self, prefix: str) -> int: ...
    def redis_client(self, block_s: float | None = None) -> Any: ...
    def leases_of(self, actor: str) -> int | None: ...
    def lease_expiry(self, actor: str) -> tuple[int, float]: ...
    def start_trainer(self, resume: bool = False) -> Incarnation: ...
    def start_actor(self, name: str) -> Incarnation: ...
    def start_relay(self) -> Incarnation: ...
    def watch_fenced(self, old: Incarnation, rec: FaultRecord) -> None: ...


@dataclass
class FaultRecord:
    """One fault of the schedule, as injected."""

    name: str
    trigger: int
    """The version whose publication triggers it."""
    injected: bool = False
    at_version: int = -1
    """The run's head (newest version published) when the fault hit."""
    phase: str = ""
    """What the run was doing when the fault hit."""
    t_start: float = 0.0
    """Harness monotonic time the fault began."""
    t_lifted: float = 0.0
    """Harness monotonic time the fault was lifted (restart, SIGCONT …)."""
    head_lifted: int = -1
    """Head when the fault was lifted: the run recovered once a newer version is published."""
    victims: list[Incarnation] = field(default_factory=list)
    """Incarnations the fault hit (killed, stopped)."""
    successors: list[Incarnation] = field(default_factory=list)
    """Incarnations started to replace them (restarts, resumed Trainers)."""
    notes: list[str] = field(default_factory=list)
    """What the injector saw (one short sentence each)."""
    error: str | None = None
    """Why the fault could not be injected, if it could not."""

    @property
    def title(self) -> str:
        return FAULT_TITLES[self.name]


def _begin(run: ChaosRun, rec: FaultRecord) -> None:
    rec.injected = True
    rec.at_version = run.fleet.head
    rec.phase = rec.phase or run.phase()
    rec.t_start = time.monotonic()


def _lift(run: ChaosRun, rec: FaultRecord) -> None:
    rec.t_lifted = time.monotonic()
    rec.head_lifted = run.fleet.head


# -- Redis ------------------------------------------------------------------------------
def redis_aof(run: ChaosRun, rec: FaultRecord) -> None:
    """SIGKILL redis-server, keep it down ``redis_down_s``, start it again on its AOF."""
    _begin(run, rec)
    run.redis.crash()
    run.fleet.sleep(run.cfg.redis_down_s)
    run.redis.start()
    _lift(run, rec)
    rec.notes.append(f"down {run.cfg.redis_down_s:g}s; back with {run.count_keys()[0]} run key(s) from the AOF")


def redis_empty(run: ChaosRun, rec: FaultRecord) -> None:
    """Stop redis-server, delete its data, start it empty on the same port."""
    _begin(run, rec)
    before = run.count_keys()[0]
    run.redis.crash()
    run.redis.wipe()
    run.fleet.sleep(run.cfg.redis_down_s)
    run.redis.start()
    _lift(run, rec)
    rec.notes.append(f"down {run.cfg.redis_down_s:g}s; {before} run key(s) before, 0 after the restart")


# -- the store ----------------------------------------------------------------------------
def s3_pause(run: ChaosRun, rec: FaultRecord) -> None:
    """SIGSTOP the S3 server's process for ``s3_pause_s`` (its objects stay in its memory)."""
    _begin(run, rec)
    run.pause_s3()
    try:
        run.fleet.sleep(run.cfg.s3_pause_s)
    finally:
        run.resume_s3()
    _lift(run, rec)
    rec.notes.append(f"paused {run.cfg.s3_pause_s:g}s")


def corrupt(run: ChaosRun, rec: FaultRecord, behind: int = 2, catch_up_s: float = 30.0) -> None:
    """Overwrite bytes of a snapshot shard at origin that a lagging Actor's catch-up will read; repair it after.

    The origin Actor is SIGSTOPped; once the run has published a snapshot at
    least ``behind`` versions past what it holds, and one version more (the
    version the run then needs is past that snapshot, and replaying every
    delta costs more bytes than the snapshot: its catch-up reads the
    snapshot), one shard of that snapshot is overwritten at origin (same
    length, 16 bytes flipped past the safetensors header: the file still
    parses, only its hash tells) and the Actor is woken. It must refuse the
    shard (never apply it) and catch up by another path: a snapshot, unlike
    a delta, is never the only one. Once it has activated a version past the
    snapshot (or after ``catch_up_s``) the shard is repaired at origin.
    """
    name = run.origin_actors[0]
    victim = run.fleet.current[name]
    every = run.cfg.snapshot_every
    _begin(run, rec)
    h = run.fleet.head
    target = -(-(h + behind) // every) * every if every > 0 else -1
    if target <= 0 or target + 1 > run.cfg.steps:
        rec.error = f"no snapshot after v{h + behind} with a version after it in {run.cfg.steps} steps (snapshot every {every})"
        return
    run.fleet.signal(victim, signal.SIGSTOP)
    rec.victims.append(victim)
    s3 = run.s3_client()
    original: tuple[str, bytes] | None = None
    woken = 0.0
    try:
        run.fleet.wait_for(lambda: run.fleet.head > target or run.fleet.trainer_done(), timeout_s=run.cfg.recover_timeout_s)
        if run.fleet.head <= target:
            rec.error = f"the run did not get past snapshot v{target}"
            return
        body = s3.get_object(Bucket=run.bucket, Key=f"{run.run}/{manifest_key('snapshot', target)}")["Body"].read()
        segments = json.loads(body)["segments"]
        seg = segments[run.rng.randrange(len(segments))]
        key = f"{run.run}/snapshots/v{target:010d}/{seg['key']}"
        good = s3.get_object(Bucket=run.bucket, Key=key)["Body"].read()
        data = bytearray(good)
        header = 8 + int.from_bytes(data[:8], "little") if len(data) > 8 else 0
        lo = min(header, len(data) - 1)
        for _ in range(16):
            i = run.rng.randrange(lo, len(data))
            data[i] ^= 0xFF
        s3.put_object(Bucket=run.bucket, Key=key, Body=bytes(data))
        original = (key, good)
        rec.notes.append(
            f"{name} SIGSTOPped at v{h}; at v{run.fleet.head} 16 byte(s) of snapshots/v{target:010d}/{seg['key']} "
            f"({len(data)} B) overwritten at origin; {name} woken"
        )
    finally:
        run.fleet.signal(victim, signal.SIGCONT)
        woken = time.monotonic()
    try:
        caught = run.fleet.wait_for(
            lambda: (
                any(int(m.group(1)) >= target for _, ln in victim.lines_since(woken, ACTIVATED_RE) if (m := ACTIVATED_RE.search(ln)))
                or not victim.alive
            ),
            timeout_s=catch_up_s,
        )
        rec.notes.append(
            f"{name} past v{target} {time.monotonic() - woken:.1f}s after waking"
            if caught and victim.alive
            else f"{name} not past v{target} {catch_up_s:g}s after waking"
        )
    finally:
        if original is not None:
            s3.put_object(Bucket=run.bucket, Key=original[0], Body=original[1])
            rec.notes.append("shard repaired at origin")
    _lift(run, rec)


# -- Actors and the Relay ----------------------------------------------------------------
def actor_kill(run: ChaosRun, rec: FaultRecord) -> None:
    """SIGKILL one Actor behind the Relay (seeded choice), restart it with the same id."""
    name = run.relay_actors[run.rng.randrange(len(run.relay_actors))]
    victim = run.fleet.current[name]
    leases = run.leases_of(name)
    _begin(run, rec)
    run.fleet.kill(victim)
    rec.victims.append(victim)
    rec.notes.append(f"{name} SIGKILLed holding {leases} lease(s)" if leases is not None else f"{name} SIGKILLed")
    run.fleet.sleep(run.cfg.actor_down_s)
    rec.successors.append(run.start_actor(name))
    _lift(run, rec)


def actor_stop(run: ChaosRun, rec: FaultRecord) -> None:
    """SIGSTOP the origin Actor while it holds leases, for longer than they last; then SIGCONT."""
    name = run.origin_actors[0]
    victim = run.fleet.current[name]
    # Past its lease only means something while it holds one: wait (a little) for that.
    run.fleet.wait_for(lambda: bool(run.leases_of(name)) or run.fleet.head >= run.cfg.steps, timeout_s=5.0)
    if run.fleet.head >= run.cfg.steps:
        rec.error = f"not injected: the run finished (v{run.fleet.head}) first"
        return
    _begin(run, rec)
    run.fleet.signal(victim, signal.SIGSTOP)
    leases, left_ms = run.lease_expiry(name)
    stop_s = max(run.cfg.actor_stop_s, left_ms / 1000 + 1.0)
    rec.victims.append(victim)
    rec.notes.append(
        f"{name} SIGSTOPped holding {leases} lease(s) (the last expiring in {left_ms / 1000:.1f}s) for {stop_s:.1f}s"
        if leases
        else f"{name} SIGSTOPped holding no lease for {stop_s:.1f}s"
    )
    try:
        run.fleet.sleep(stop_s)
    finally:
        run.fleet.signal(victim, signal.SIGCONT)
    _lift(run, rec)


def relay_kill(run: ChaosRun, rec: FaultRecord) -> None:
    """SIGKILL the Relay, keep it down ``relay_down_s``, start it again."""
    victim = run.fleet.current[run.relay_name]
    _begin(run, rec)
    run.fleet.kill(victim)
    rec.victims.append(victim)
    run.fleet.sleep(run.cfg.relay_down_s)
    rec.successors.append(run.start_relay())
    _lift(run, rec)
    rec.notes.append(f"down {run.cfg.relay_down_s:g}s")


# -- the Trainer ----------------------------------------------------------------------------
def trainer_kill(run: ChaosRun, rec: FaultRecord, tries: int = 5) -> None:
    """SIGKILL the Trainer between a segment of its next version and that version's manifest.

    The harness follows the run's announcement stream; at the first segment
    of a version newer than the head it SIGSTOPs the Trainer (at once, so
    the publish cannot go on), then looks for the version's manifest: none,
    and the Trainer dies there (mid-publish). A manifest already written
    means the window was missed: SIGCONT, and try again on the next version
    (``tries`` times, then kill it wherever it is).
    """
    victim = run.fleet.trainer()
    if victim is None or not victim.alive:
        rec.error = "no Trainer running"
        return
    bus = Bus(run.redis_client(block_s=3.0), run.run)
    last = "$"
    missed = 0
    tried = -1
    phase = ""
    give_up = min(run.fleet.deadline, time.monotonic() + run.cfg.recover_timeout_s)
    while missed < tries and victim.alive and not phase and time.monotonic() < give_up:
        try:
            if last == "$":
                last = bus.tail_id()
            events = bus.read(last, block_ms=1000)
        except Exception:  # noqa: BLE001 - a gap or a Redis hiccup: look again from the newest entry
            last = "$"
            time.sleep(0.2)
            continue
        for ev in events:
            last = ev.id
            if ev.type != SEGMENT or ev.version <= max(run.fleet.head, tried):
                continue
            tried = ev.version
            run.fleet.signal(victim, signal.SIGSTOP)
            key = f"{run.run}/{manifest_key('delta', ev.version)}"
            if run.s3_exists(key):
                run.fleet.signal(victim, signal.SIGCONT)
                missed += 1
                rec.notes.append(f"v{ev.version}'s manifest was already there when the Trainer stopped; tried again")
                break
            segs = run.s3_count(f"{run.run}/deltas/v{ev.version:010d}/")
            phase = f"mid-publish of v{ev.version}: {segs} segment(s) durable, no manifest"
            break
    if not phase:
        why = f"the manifest was there first {missed} time(s)" if missed else "no segment announced"
        phase = f"after v{run.fleet.head} (not mid-publish: {why})"
    rec.phase = phase
    _begin(run, rec)
    run.fleet.kill(victim)
    rec.victims.append(victim)
    rec.successors.append(run.start_trainer(resume=True))
    _lift(run, rec)


def old_trainer(run: ChaosRun, rec: FaultRecord) -> None:
    """SIGSTOP the Trainer, start a resumed one, SIGCONT the old one once the new one published.

    The woken Trainer belongs to an older epoch: it must be fenced out
    (publish nothing, create and close no step). The harness stops it after
    ``fence_wait_s`` if it has not exited by then.
    """
    old = run.fleet.trainer()
    if old is None or not old.alive:
        rec.error = "no Trainer running"
        return
    _begin(run, rec)
    run.fleet.signal(old, signal.SIGSTOP)
    rec.victims.append(old)
    new = run.start_trainer(resume=True)
    rec.successors.append(new)
    head = run.fleet.head
    published = run.fleet.wait_for(
        lambda: any(v > head and inc is new for v, (_, _, inc) in run.fleet.versions.items()) or not new.alive,
        timeout_s=run.cfg.recover_timeout_s,
    )
    if not published or not new.alive:
        rec.notes.append("the resumed Trainer published nothing; the old one was woken anyway")
    run.fleet.signal(old, signal.SIGCONT)
    _lift(run, rec)
    rec.notes.append(f"old Trainer woken after the resumed one reached v{run.fleet.head}")
    run.watch_fenced(old, rec)


INJECTORS: dict[str, Callable[[ChaosRun, FaultRecord], None]] = {
    "redis-aof": redis_aof,
    "actor-kill": actor_kill,
    "s3-pause": s3_pause,
    "trainer-kill": trainer_kill,
    "redis-empty": redis_empty,
    "actor-stop": actor_stop,
    "old-trainer": old_trainer,
    "relay-kill": relay_kill,
    "corrupt": corrupt,
}
"""Fault name -> injector."""
