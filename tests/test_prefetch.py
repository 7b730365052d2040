"""Fetching segments from their announcements (``--fetch announced``), before the manifest.

Announcements are untrusted: these tests plant bytes the manifest does not
list, bytes whose digest differs from the manifest's, and a manifest signed
by a key nobody trusts, and check that no such bytes ever reach the decoder,
that the version still stages from the store, and that held memory stays
within its bound. The last tests run the stager and a Relay for real.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from actor_fixtures import Counting
from relay_helpers import describe_model
from trainer_fixtures import FakeTrainer

import aurora_store.lineage.fetch as fetch_mod
from aurora_store.clock import SYSTEM_CLOCK, Clock
from aurora_store.codec.extract import extract
from aurora_store.coordination.bus import SEGMENT, Bus, Event
from aurora_store.coordination.keys import RunKeys
from aurora_store.coordination.records import RunRecords
from aurora_store.errors import ConfigError, SignatureError
from aurora_store.format.manifest import manifest_key, version_dir
from aurora_store.format.signing import Signer
from aurora_store.lineage.fetch import fetch_delta, read_manifest
from aurora_store.lineage.prefetch import Prefetcher, announced_segment
from aurora_store.lineage.publish import PublishConfig, SegmentEvent, publish_delta
from aurora_store.storage import Store, open_store
from aurora_store.testing.clock import ManualClock
from aurora_store.testing.wait import wait_until
from aurora_tools.bench.hostile.workers import SourceRecorder
from aurora_tools.bench.wan_sweep import (
    HEADLINE,
    Link,
    RunConfig,
    SweepOptions,
    build_sweep,
    delta_over_wire_floor,
    summarize,
    targets,
)
from aurora_tools.synthetic.engine import SyntheticEngine
from aurora_tools.synthetic.shapes import QWEN3_TINY
from aurora_tools.synthetic.workload import SyntheticSpec, base_weights, sparse_update
from workers.actor import Actor, ActorConfig, add_arguments, config_from_args
from workers.actor.announced import AnnouncedFetch
from workers.common import Endpoints
from workers.model import fusion_plan_for
from workers.relay import Relay, RelayConfig
from workers.relay import add_arguments as relay_arguments
from workers.relay import config_from_args as relay_config

SEG = PublishConfig(streams=2, segment_bytes=2048)


class Published:
    """A few deltas of the tiny synthetic model at a staging store, with their announcements."""

    def __init__(self, root: Path, versions: int = 2, signer: Signer | None = None) -> None:
        self.spec = SyntheticSpec(QWEN3_TINY, seed=3, density=0.05)
        self.src = open_store(f"file://{root}/published")
        self.events: dict[int, list[SegmentEvent]] = {}
        self.manifests: dict[int, Any] = {}
        w = base_weights(self.spec.shape, self.spec.seed)
        self.plan = fusion_plan_for(w, tied=True)
        state = self.spec.base_state
        for v in range(1, versions + 1):
            new = {n: t.clone() for n, t in w.items()}
            sparse_update(new, self.spec.density, self.spec.seed, v)
            evs: list[SegmentEvent] = []
            m = publish_delta(
                self.src,
                "p",
                v,
                extract(self.plan, w, new),
                state,
                SEG,
                on_segment=evs.append,
                signer=signer,
            )
            assert len(m.segments) > 2
            self.events[v], self.manifests[v], state, w = evs, m, m.state, new
        self.root = root

    def specs(self) -> Any:
        eng = SyntheticEngine(self.spec, hold=False)
        return eng.param_specs()

    def copy_segments(self, dest: Path, v: int) -> None:
        d = version_dir("delta", v)
        shutil.copytree(
            self.root / "published" / d,
            dest / d,
            ignore=shutil.ignore_patterns("manifest.json"),
            dirs_exist_ok=True,
        )

    def copy_manifest(self, dest: Path, v: int) -> None:
        shutil.copy(self.root / "published" / manifest_key("delta", v), dest / manifest_key("delta", v))


class Tampering:
    """A store whose ranged reads (the prefetcher's) return other bytes for chosen keys."""

    def __init__(self, inner: Store, swap: dict[str, bytes]) -> None:
        self.inner, self.swap = inner, swap

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        if key in self.swap:
            return self.swap[key][start:stop]
        return self.inner.get_range(key, start, stop)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture
def decoded(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every byte string handed to the segment decoder by ``fetch_delta``."""
    seen: list[bytes] = []
    real = fetch_mod.decode_segment

    def recording(data: bytes, *a: Any, **kw: Any) -> Any:
        seen.append(bytes(data))
        return real(data, *a, **kw)

    monkeypatch.setattr(fetch_mod, "decode_segment", recording)
    return seen


def _announce_all(pf: Prefetcher, store: Any, evs: list[SegmentEvent], held_version: int) -> None:
    for ev in evs:
        assert pf.announce(store, ev.version, ev.key, ev.bytes, ev.sha256, held_version)


def _wait_downloads(pf: Prefetcher) -> None:
    for slot in list(pf._slots.values()):
        slot.future.result(timeout=30)


# ---------------------------------------------------------------------------
# the library


def test_announcements_are_parsed_strictly() -> None:
    good = "deltas/v0000000003/0123456789abcdef/seg-00001.safetensors"
    sha = "a" * 64
    assert announced_segment(3, good, "17", sha) == (good, 17, sha)
    assert announced_segment(4, good, 17, sha) is None  # another version's folder
    assert announced_segment(3, good.replace("deltas", "snapshots").replace("seg", "shard"), 17, sha) is None
    assert announced_segment(3, "deltas/v0000000003/../../model/config.json", 17, sha) is None
    assert announced_segment(3, good, "-1", sha) is None
    assert announced_segment(3, good, "many", sha) is None
    assert announced_segment(3, good, 17, "A" * 64) is None


def test_prefetched_segments_stage_the_same_version(tmp_path: Path, decoded: list[bytes]) -> None:
    pub = Published(tmp_path, versions=1)
    store = Counting(pub.src)
    pf = Prefetcher(streams=2)
    _announce_all(pf, store, pub.events[1], held_version=0)
    m, staged = fetch_delta(store, 1, pub.specs(), streams=2, held=pf.take)
    assert store.segments_read("delta", 1) == []  # every segment came from the prefetch
    assert pf.stats.taken == len(m.segments) and pf.held_bytes == 0
    _, plain = fetch_delta(pub.src, 1, pub.specs(), streams=2)
    assert [(e.param, e.start, e.stop, e.nnz) for e in staged.entries] == [(e.param, e.start, e.stop, e.nnz) for e in plain.entries]
    pf.close()


def test_wrong_bytes_and_unlisted_keys_are_never_decoded(tmp_path: Path, decoded: list[bytes]) -> None:
    pub = Published(tmp_path, versions=2)
    m1 = pub.manifests[1]
    vdir = version_dir("delta", 1)
    listed = [f"{vdir}/{r.key}" for r in m1.segments]
    # A segment of another version, planted under v1's folder in an attempt no manifest names,
    # and announced with its true digest: well-formed, and it would decode.
    planted_bytes = pub.src.get(pub.events[2][0].key)
    planted = f"{vdir}/{'f' * 16}/seg-00000.safetensors"
    pub.src.put(planted, planted_bytes)
    # And a listed key whose prefetched bytes are other ones, announced with *their* digest.
    real = pub.src.get(listed[1])
    forged = real[:-1] + bytes([real[-1] ^ 0xFF])
    store = Tampering(pub.src, {listed[1]: forged})
    pf = Prefetcher(streams=2)
    for ev in pub.events[1]:
        sha = hashlib.sha256(forged).hexdigest() if ev.key == listed[1] else ev.sha256
        assert pf.announce(store, 1, ev.key, len(forged) if ev.key == listed[1] else ev.bytes, sha, 0)
    assert pf.announce(store, 1, planted, len(planted_bytes), hashlib.sha256(planted_bytes).hexdigest(), 0)
    _wait_downloads(pf)
    m, staged = fetch_delta(store, 1, pub.specs(), streams=2, held=pf.take)
    assert m.state == m1.state and staged.nnz == sum(int(p["nnz"]) for p in m1.params.values())
    assert forged not in decoded and planted_bytes not in decoded
    assert len(decoded) == len(m1.segments)
    assert pf.stats.taken == len(m1.segments) - 1  # the forged one was read again from the store
    assert pf.drop_through(1) == 1 and pf.held_bytes == 0  # the planted one, dropped untaken
    pf.close()


def test_bytes_that_fail_the_manifest_check_are_read_again(tmp_path: Path, decoded: list[bytes]) -> None:
    """Held bytes of the right announcement but other content (a replaced object): dropped, not decoded."""
    pub = Published(tmp_path, versions=1)
    m1 = pub.manifests[1]
    key = f"{version_dir('delta', 1)}/{m1.segments[0].key}"
    bad = b"\x00" * m1.segments[0].bytes

    def held(k: str, size: int, sha: str) -> bytes | None:
        return bad if k == key else None

    _, staged = fetch_delta(pub.src, 1, pub.specs(), streams=2, held=held)
    assert bad not in decoded and staged.version == 1


def test_a_forged_signed_run_is_refused_before_any_held_byte_is_used(tmp_path: Path, decoded: list[bytes]) -> None:
    trusted, forger = Signer.generate(), Signer.generate()
    pub = Published(tmp_path, versions=1, signer=forger)  # the manifest and its segments: someone else's
    pf = Prefetcher(streams=2)
    _announce_all(pf, pub.src, pub.events[1], held_version=0)
    _wait_downloads(pf)
    taken: list[str] = []

    def held(k: str, size: int, sha: str) -> bytes | None:
        taken.append(k)
        return pf.take(k, size, sha)

    with pytest.raises(SignatureError):
        fetch_delta(pub.src, 1, pub.specs(), streams=2, trust=trusted.trust(), held=held)
    with pytest.raises(SignatureError):  # a manifest read elsewhere and handed in: checked too
        fetch_delta(
            pub.src,
            1,
            pub.specs(),
            streams=2,
            manifest=read_manifest(pub.src, "delta", 1),
            trust=trusted.trust(),
            held=held,
        )
    assert taken == [] and decoded == [] and pf.stats.taken == 0
    assert pf.drop_through(1) == len(pub.events[1]) and pf.held_bytes == 0
    pf.close()


def test_held_memory_is_bounded(tmp_path: Path) -> None:
    pub = Published(tmp_path, versions=2)
    sizes = [ev.bytes for ev in pub.events[1]]
    bound = sum(sizes[:2])
    pf = Prefetcher(streams=4, max_held_bytes=bound)
    started = [pf.announce(pub.src, 1, ev.key, ev.bytes, ev.sha256, 0) for ev in pub.events[1]]
    assert started[:2] == [True, True] and not any(started[2:])
    assert pf.held_bytes <= bound and pf.stats.peak_held_bytes <= bound
    # Too far ahead of what is held, or already held: never fetched.
    assert not pf.announce(pub.src, 2, pub.events[2][0].key, 1, pub.events[2][0].sha256, held_version=-1)
    assert not pf.announce(pub.src, 1, pub.events[1][0].key, 1, pub.events[1][0].sha256, held_version=1)
    # An object bigger than announced is read no further than announced (plus one byte), and dropped.
    small = Prefetcher(streams=1, max_held_bytes=1 << 20)
    ev = pub.events[1][0]
    assert small.announce(pub.src, 1, ev.key, ev.bytes // 2, ev.sha256, 0)
    _wait_downloads(small)
    assert small.stats.mismatched == 1 and small.held_bytes == 0
    # The version still stages, the rest read from the store.
    _wait_downloads(pf)
    _, staged = fetch_delta(pub.src, 1, pub.specs(), streams=2, held=pf.take)
    assert staged.version == 1 and pf.stats.taken == 2 and pf.held_bytes == 0
    pf.close()
    small.close()


def test_the_manifest_may_land_after_every_segment(tmp_path: Path, decoded: list[bytes]) -> None:
    pub = Published(tmp_path, versions=1)
    origin_dir = tmp_path / "origin"
    origin_dir.mkdir()
    pub.copy_segments(origin_dir, 1)
    origin = Counting(open_store(f"file://{origin_dir}"))
    pf = Prefetcher(streams=2)
    _announce_all(pf, origin, pub.events[1], held_version=0)
    _wait_downloads(pf)
    assert pf.held_bytes == pub.manifests[1].total_bytes
    pub.copy_manifest(origin_dir, 1)
    m, staged = fetch_delta(origin, 1, pub.specs(), streams=2, held=pf.take)
    assert origin.segments_read("delta", 1) == [] and m.state == pub.manifests[1].state
    assert len(decoded) == len(m.segments) and pf.held_bytes == 0
    pf.close()


@pytest.mark.server
def test_held_segments_spill_to_a_private_folder_for_workers_that_read_a_store(tmp_path: Path, redis_client: Any, run_name: str) -> None:
    """vLLM's workers read a store themselves: what is held is checked and written where they read it."""
    pub = Published(tmp_path, versions=1)
    m1 = pub.manifests[1]
    vdir = version_dir("delta", 1)
    listed = [f"{vdir}/{r.key}" for r in m1.segments]
    real = pub.src.get(listed[1])
    forged = real[:-1] + bytes([real[-1] ^ 0xFF])
    origin = Counting(pub.src)
    early = AnnouncedFetch(2, 1 << 26, RunRecords(redis_client, run_name))
    assert early.spill(origin, m1, 2) is None  # nothing held: the workers read the store
    tampering = Tampering(origin, {listed[1]: forged})
    for ev in pub.events[1]:
        early.segment(tampering, Event("1-0", SEGMENT, 1, {"key": ev.key, "bytes": str(ev.bytes), "sha256": ev.sha256}), 0)
    _wait_downloads(early.prefetch)
    local = early.spill(origin, m1, 2)
    assert local is not None and local.url.startswith("file://")
    spill_dir = Path(local.url.removeprefix("file://"))
    assert sorted(local.list(vdir)) == sorted(listed)
    for key in listed:
        assert local.get(key) == pub.src.get(key)  # the forged held bytes were not what was written
    assert origin.segments_read("delta", 1) == [listed[1]]  # the rest came from the prefetch
    assert early.prefetch.held_bytes == 0
    assert oct(spill_dir.parent.stat().st_mode & 0o777) == "0o700"
    early.unspill(1)
    assert not spill_dir.exists() and spill_dir.parent.exists()
    early.close()
    assert not spill_dir.parent.exists()


# ---------------------------------------------------------------------------
# the Actor's stager


def _actor(
    pub: Published, tmp: Path, redis_url: str, run: str, redis: Any, fetch: str, clock: Clock | None = None, **kw: Any
) -> tuple[Actor, SourceRecorder]:
    """An Actor at v0 (as bootstrap leaves it) on the synthetic engine, its origin counted."""
    eng = SyntheticEngine(pub.spec, hold=True, digests=True)
    eng.load_base()
    rec = SourceRecorder()
    a = Actor.from_endpoints(
        Endpoints(f"file://{tmp}/origin", redis_url, run),
        ActorConfig(actor_id="a", region="r1", fetch=fetch, **kw),
        clock or ManualClock(),
        origin=Counting(open_store(f"file://{tmp}/origin")),
        engine=eng,
        observers=[rec],
    )
    a.holding.start_at(0, pub.spec.base_state)
    return a, rec


def _segment_events(pub: Published, v: int) -> list[Event]:
    return [
        Event(
            f"{i + 1}-0",
            SEGMENT,
            v,
            {"key": e.key, "bytes": str(e.bytes), "sha256": e.sha256, "index": str(e.index)},
        )
        for i, e in enumerate(pub.events[v])
    ]


@pytest.mark.server
def test_the_stager_prefetches_announced_segments_and_stages_once_committed(
    tmp_path: Path, redis_server: Any, redis_client: Any, run_name: str
) -> None:
    pub = Published(tmp_path, versions=2)
    (tmp_path / "origin").mkdir()
    for v in (1, 2):
        pub.copy_segments(tmp_path / "origin", v)
    a, rec = _actor(pub, tmp_path, redis_server.url, run_name, redis_client, "announced")
    for v in (1, 2):
        for ev in _segment_events(pub, v):
            a.stager.announcement(ev, None, None)
    assert a.fetcher.announced is not None and a.fetcher.announced.prefetch.versions() == {1, 2}
    _wait_downloads(a.fetcher.announced.prefetch)
    a.stager.stage_once()  # nothing committed yet: nothing staged, nothing decoded
    assert a.staged_version == 0
    for v in (1, 2):
        pub.copy_manifest(tmp_path / "origin", v)
    redis_client.hset(RunKeys(run_name).trainer, mapping={"head": 2})
    a.stager.stage_once()
    assert a.staged_version == 2 and rec.sources == [(1, False), (2, False)]
    assert a.origin.segments_read("delta", 1) == [] and a.origin.segments_read("delta", 2) == []
    assert a.fetcher.announced.prefetch.held_bytes == 0
    for e in a.staged:
        a.engine.apply(e.item)
    a.fetcher.announced.close()


@pytest.mark.server
def test_manifest_first_is_the_old_path(
    tmp_path: Path, redis_server: Any, redis_client: Any, run_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    base = ["--store", "file:///x", "--redis", "redis://127.0.0.1:1/0", "--run", "r"]
    assert config_from_args(ap.parse_args(base), engine="synthetic").fetch == "announced"
    assert config_from_args(ap.parse_args([*base, "--fetch", "manifest-first"]), engine="synthetic").fetch == "manifest-first"
    with pytest.raises(SystemExit):
        ap.parse_args([*base, "--fetch", "eventually"])
    with pytest.raises(ConfigError):
        ActorConfig(fetch="eventually")
    pub = Published(tmp_path, versions=1)
    (tmp_path / "origin").mkdir()
    pub.copy_segments(tmp_path / "origin", 1)
    a, _ = _actor(pub, tmp_path, redis_server.url, run_name, redis_client, "manifest-first")
    assert a.fetcher.announced is None
    ranged: list[str] = []
    real = a.origin.inner.get_range

    def spy(key: str, *x: Any) -> bytes:
        ranged.append(key)
        return real(key, *x)

    monkeypatch.setattr(a.origin.inner, "get_range", spy)
    for ev in _segment_events(pub, 1):
        a.stager.announcement(ev, None, None)
    assert ranged == []  # announcements start no reads (every read is a capped range now: counted here only)
    pub.copy_manifest(tmp_path / "origin", 1)
    redis_client.hset(RunKeys(run_name).trainer, mapping={"head": 1})
    a.stager.stage_once()
    assert a.staged_version == 1
    assert sorted(a.origin.segments_read("delta", 1)) == sorted(f"{version_dir('delta', 1)}/{r.key}" for r in pub.manifests[1].segments)


@contextlib.contextmanager
def _stager_running(a: Actor) -> Iterator[None]:
    """The Actor's real stager loop in a thread for the body's length, stopped however it ends."""
    t = threading.Thread(target=a.stager.run, daemon=True)
    t.start()
    try:
        yield
    finally:
        a.stop.set()
        t.join(10)
        a.fetcher.close()


def _stream_reads(a: Actor, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """When the stager loop began each read of the stream. Once one began, the loop has taken the
    stream's end (what was announced before is not read) and every later announcement is read."""
    reads: list[float] = []
    real_read = a.ctx.bus.read

    def counted(*args: Any, **kw: Any) -> Any:
        reads.append(time.monotonic())
        return real_read(*args, **kw)

    monkeypatch.setattr(a.ctx.bus, "read", counted)
    return reads


COLD_S = 90
"""A cold first run (imports, kernels) is slow: how long a stager loop test waits on each condition."""


def _commit_and_stage(pub: Any, tmp_path: Path, redis_client: Any, run_name: str, a: Any) -> None:
    """v1's manifest lands and is announced: the loop stages it from the held segments, reading none again."""
    pub.copy_manifest(tmp_path / "origin", 1)
    redis_client.hset(RunKeys(run_name).trainer, mapping={"head": 1})
    Bus(redis_client, run_name).announce("version", 1, kind="delta", state=pub.manifests[1].state)
    wait_until(lambda: a.staged_version >= 1, "version 1 staged", timeout=COLD_S)
    assert a.origin.segments_read("delta", 1) == []


@pytest.mark.server
def test_the_stager_loop_prefetches_from_the_stream(
    tmp_path: Path, redis_server: Any, redis_client: Any, run_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real loop: announcements on the stream start downloads before the manifest exists."""
    pub = Published(tmp_path, versions=1)
    (tmp_path / "origin").mkdir()
    a, _ = _actor(pub, tmp_path, redis_server.url, run_name, redis_client, "announced", clock=SYSTEM_CLOCK, stage_block_ms=50)
    reads = _stream_reads(a, monkeypatch)
    with _stager_running(a):
        bus = Bus(redis_client, run_name)
        pf = a.fetcher.announced.prefetch if a.fetcher.announced is not None else None
        assert pf is not None
        # The loop takes the stream's end first: what is announced before is not read.
        wait_until(lambda: reads, "the stager's first read of the stream", timeout=COLD_S)
        pub.copy_segments(tmp_path / "origin", 1)
        for e in pub.events[1]:
            bus.announce(SEGMENT, 1, index=e.index, key=e.key, bytes=e.bytes, sha256=e.sha256)
        wait_until(lambda: pf.stats.started == len(pub.events[1]), "every announced segment prefetched", timeout=COLD_S)
        _commit_and_stage(pub, tmp_path, redis_client, run_name, a)


# ---------------------------------------------------------------------------
# the Relay


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.server
def test_a_relay_mirroring_with_prefetch_makes_the_same_mirror(tmp_path: Path, redis_server: Any, redis_client: Any, run_name: str) -> None:
    ap = argparse.ArgumentParser()
    relay_arguments(ap)
    base = [
        "--store",
        "file:///o",
        "--mirror",
        "file:///m",
        "--redis",
        "redis://127.0.0.1:1/0",
        "--run",
        "r",
        "--region",
        "x",
    ]
    assert relay_config(ap.parse_args(base)).fetch == "announced"
    assert relay_config(ap.parse_args([*base, "--fetch", "manifest-first"])).fetch == "manifest-first"
    with pytest.raises(ConfigError):
        RelayConfig(
            origin="file:///o",
            mirror="file:///m",
            redis="redis://x",
            run="r",
            region="x",
            fetch="later",
        )

    origin = open_store(f"file://{tmp_path}/origin")
    describe_model(origin)
    relays = {}
    for region, fetch in (("ra", "announced"), ("rm", "manifest-first")):
        mirror = open_store(f"file://{tmp_path}/mirror-{region}")
        cfg = RelayConfig(
            origin=origin.url,
            mirror=mirror.url,
            redis=redis_server.url,
            run=run_name,
            region=region,
            fetch=fetch,
            block_ms=100,
            heartbeat_s=0.2,
            ttl_s=1.0,
            streams=4,
            resync_s=0.0,
            retry_s=0.2,
        )
        relays[region] = Relay(cfg, origin=origin, mirror=mirror)
    stop = threading.Event()
    threads = [threading.Thread(target=r.run, args=(stop,), daemon=True) for r in relays.values()]
    for t in threads:
        t.start()
    try:
        for r in relays.values():
            wait_until(r.caught_up.is_set, "the first listing")
        trainer = FakeTrainer(origin, run_name, Bus(redis_client, run_name))
        for _ in range(3):
            trainer.step()
        want = {("snapshot", 0), ("delta", 1), ("delta", 2), ("delta", 3)}
        for r in relays.values():
            wait_until(lambda r=r: want <= set(r.stats().mirrored), "versions 0-3 in both mirrors")
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        for r in relays.values():
            r.close()
    a, m = _files(tmp_path / "mirror-ra"), _files(tmp_path / "mirror-rm")
    assert a == m and any(k.endswith("seg-00000.safetensors") for k in a)
    bus = Bus(redis_client, run_name)
    # Cut-through copies are re-announced to the region segment by segment; manifest-first copies none early.
    assert any(e.type == SEGMENT for e in bus.read("0", region="ra"))
    assert not any(e.type == SEGMENT for e in bus.read("0", region="rm"))


# ---------------------------------------------------------------------------
# the benchmark's table


def test_the_fetch_experiment_and_its_table() -> None:
    cs = [c for c in build_sweep(SweepOptions(experiments=("fetch", "bandwidth"))) if "fetch" in c.experiments]
    assert {(c.link.gbps, c.fetch) for c in cs} == {(g, f) for g in (0.25, 1.0) for f in ("announced", "manifest-first")}
    assert all(c.actors == 1 and not c.uses_relay and c.mode == "delta" for c in cs)
    # The announced runs are the bandwidth experiment's (shared), the manifest-first ones their own.
    assert all("bandwidth" in c.experiments for c in cs if c.fetch == "announced")
    assert "fetch=manifest-first" in next(c.name for c in cs if c.fetch == "manifest-first")
    with pytest.raises(ValueError, match="fetch"):
        RunConfig("delta", HEADLINE, 1, False, 4, 4, 2, fetch="lazy")
    results = []
    for gbps, fetch, took in (
        (0.25, "announced", 0.55),
        (0.25, "manifest-first", 0.70),
        (1.0, "announced", 0.15),
        (1.0, "manifest-first", 0.33),
    ):
        cfg = RunConfig("delta", Link(gbps, 20.0), 1, False, 4, 4, 1, experiments=("fetch",), fetch=fetch)
        published = {
            v: {
                "start_ms": 1000.0 * v,
                "end_ms": 1000.0 * v + 50,
                "bytes": 12_500_000,
                "kind": "delta",
            }
            for v in range(1, 4)
        }
        staged = {("a0", v): {"t_ms": 1000.0 * v + 100 + 1000 * took, "stage_s": 0.1} for v in range(1, 4)}
        steps = [{"step": i, "step_s": 1.0, "tokens": 10, "tokens_per_s": 10.0, "version": max(0, i - 1)} for i in range(4)]
        r = summarize(
            cfg,
            steps,
            published,
            staged,
            {},
            10**9,
            announced={v: {"first_segment_ms": 1000.0 * v + 100, "last_segment_ms": 1000.0 * v + 150} for v in range(1, 4)},
        )
        assert r["announce_to_staged_s"] == pytest.approx(took) and r["segments_span_s"] == pytest.approx(0.05)
        r["error"] = None
        results.append(r)
    table = delta_over_wire_floor(results)
    assert list(table) == ["0.25", "1"]
    assert table["0.25"]["wire_floor_s"] == pytest.approx(0.4) and table["1"]["wire_floor_s"] == pytest.approx(0.1)
    assert table["0.25"]["announced"] == pytest.approx(0.55 / 0.4) and table["0.25"]["manifest_first"] == pytest.approx(0.7 / 0.4)
    assert table["1"]["announced"] == pytest.approx(1.5) and table["1"]["manifest_first_s"] == pytest.approx(0.33)
    t = targets(results)["delta_fetch_at_wire_speed"]
    assert t["value"] == {"0.25": pytest.approx(1.375), "1": pytest.approx(1.5)} and t["met"] is False


@pytest.mark.server
def test_a_version_announcement_reads_ahead_only_what_the_stager_would(tmp_path: Path, redis_client: Any, run_name: str) -> None:
    """The manifest read when a version is announced is checked as the stager checks it; a failed one is read again."""
    from workers.actor.announced import AnnouncedFetch

    trusted, forger = Signer.generate(), Signer.generate()
    pub = Published(tmp_path, versions=1, signer=forger)
    ev = Event("1-0", "version", 1, {"kind": "delta"})
    early = AnnouncedFetch(2, 1 << 20, RunRecords(redis_client, run_name))
    early.version(pub.src, ev, 0, trusted.trust(), None)
    assert early.manifest(pub.src, 1) is None  # refused (signed by another key): the stager's own read raises
    assert early.expected_state(1) == (True, None)  # no record in Redis
    early.done(1)
    early.version(pub.src, ev, 0, forger.trust(), None)
    assert early.manifest(pub.src, 1) == pub.manifests[1]
    other = open_store(f"file://{tmp_path}/elsewhere")
    assert early.manifest(other, 1) is None  # read from another store: not this one's
    early.version(pub.src, Event("2-0", "version", 3, {"kind": "delta"}), 0, None, None)  # not the next version: ignored
    assert early.manifest(pub.src, 1) == pub.manifests[1]
    early.close()


@pytest.mark.server
def test_the_state_read_early_serves_the_check_after_the_fetch(tmp_path: Path, redis_client: Any, run_name: str) -> None:
    """The stager checks the Trainer's record after the fetch (after ``done``): the early read serves that check, once."""
    from workers.actor.announced import AnnouncedFetch

    pub = Published(tmp_path, versions=2)
    records = RunRecords(redis_client, run_name)
    records.record_expected_state(1, "sha256:" + "a" * 64)
    early = AnnouncedFetch(2, 1 << 20, records)
    early.version(pub.src, Event("1-0", "version", 1, {"kind": "delta"}), 0, None, None)
    assert early.manifest(pub.src, 1) == pub.manifests[1]
    early.done(1)  # the fetch is over: the manifest read early is gone, the record stays
    assert early.manifest(pub.src, 1) is None
    assert early.expected_state(1) == (True, "sha256:" + "a" * 64)
    assert early.expected_state(1) == (False, None)  # once: the check before activation reads it again
    early.version(pub.src, Event("2-0", "version", 2, {"kind": "delta"}), 1, None, None)
    early.done(2)
    early.done(3)  # a later version staged: the record of 2 is let go unread
    assert early.expected_state(2) == (False, None)
    # A version the stager found by polling, before its announcement: the fetch starts the read.
    records.record_expected_state(4, "sha256:" + "b" * 64)
    early.expect(4)
    early.expect(4)  # once
    early.version(pub.src, Event("4-0", "version", 4, {"kind": "delta"}), 3, None, None)  # a read under way is kept
    assert early.expected_state(4) == (True, "sha256:" + "b" * 64)
    assert early.expected_state(4) == (False, None)
    early.close()


@pytest.mark.server
def test_the_stager_loop_reads_segment_announcements_without_polling_between(
    tmp_path: Path, redis_server: Any, redis_client: Any, run_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Segments of a version still being published: back to the stream at once, no poll of the head between them."""
    pub = Published(tmp_path, versions=1)
    (tmp_path / "origin").mkdir()
    a, _ = _actor(pub, tmp_path, redis_server.url, run_name, redis_client, "announced", clock=SYSTEM_CLOCK, stage_block_ms=5_000)
    polls = []
    real_poll = a.stager.poll

    def counted() -> Any:
        polls.append(time.monotonic())
        return real_poll()

    monkeypatch.setattr(a.stager, "poll", counted)
    reads = _stream_reads(a, monkeypatch)
    with _stager_running(a):
        bus = Bus(redis_client, run_name)
        pf = a.fetcher.announced.prefetch if a.fetcher.announced is not None else None
        assert pf is not None
        # The loop's first poll, then it waits on the stream (from its end: take it before announcing).
        wait_until(lambda: polls and reads, "the stager's first poll and read of the stream", timeout=COLD_S)
        pub.copy_segments(tmp_path / "origin", 1)
        before = len(polls)
        for i, e in enumerate(pub.events[1]):
            # One at a time, as a version still being published: each read from the stream alone.
            bus.announce(SEGMENT, 1, index=e.index, key=e.key, bytes=e.bytes, sha256=e.sha256)
            wait_until(lambda i=i: pf.stats.started == i + 1, f"segment {i} prefetched", timeout=COLD_S)
        # One poll at most (the one that a segment-only batch makes once the last poll is a block old).
        assert len(polls) - before <= 1 < len(pub.events[1])
        _commit_and_stage(pub, tmp_path, redis_client, run_name, a)  # the version's announcement polls, and stages
