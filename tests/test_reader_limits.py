"""Hard bounds on untrusted sizes (issue 13, point 6; docs/FORMAT.md "Reader limits").

Each entry of a segment was already bounded on its own; these are the bounds
of a whole version and of the containers around it:

- an aggregate decode bomb (hundreds of tiny zstd frames, each decoding to a
  whole large parameter) is refused as its entries arrive: by the overlap
  check when they cover one parameter, by the version's decode budget when
  they cover parameters the manifest does not vouch for; peak memory (traced)
  and the bytes granted stay under the budget;
- a 90 MB safetensors header is refused from its 8-byte length;
- a 5,000-digit JSON integer and an oversized manifest are ``ManifestError``,
  which the Actor counts as a bad version and the Relay skips;
- ``aurora verify --deep`` flags two overlapping entries for one parameter.
"""

from __future__ import annotations

import struct
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from codec_helpers import publish_raw_delta

from aurora_store.codec.entries import NAIVE, ParamSpec
from aurora_store.codec.extract import ParamDelta
from aurora_store.errors import AuroraError, EntryError, FormatError, ManifestError, SegmentError
from aurora_store.format.checkpoint import encode_segments, stage_segments
from aurora_store.format.limits import (
    BUDGET_SLACK_BYTES,
    MAX_ENTRIES_PER_SEGMENT,
    MAX_HEADER_BYTES,
    MAX_MANIFEST_BYTES,
    VersionGuard,
    load_json,
    version_budget,
)
from aurora_store.format.manifest import Manifest, manifest_key, version_dir
from aurora_store.format.segment import check_header_length, decode_segment, parse_safetensors
from aurora_store.lineage.fetch import fetch_delta, read_manifest
from aurora_store.lineage.verify import verify_run
from aurora_store.storage import Store
from aurora_tools.bench.hostile.forge import (
    BIG,
    bomb_many_params,
    bomb_one_param,
    dense_entry,
    segment,
    zeros_frame,
)

BASE_STATE = "sha256:" + "ab" * 32
BIG_SPEC = ParamSpec((BIG,), "bfloat16")


def traced_peak(fn: Any) -> tuple[BaseException | None, int]:
    """Run ``fn``; return what it raised and the peak of traced allocations (numpy and bytes included)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - returned to the test
            return e, tracemalloc.get_traced_memory()[1]
        return None, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# --- the aggregate decode bomb --------------------------------------------------


def test_bomb_on_one_parameter_is_refused_at_its_second_entry() -> None:
    data = bomb_one_param(300)  # 600 MiB if every frame were decoded
    assert len(data) < 200_000  # a small segment
    guard = VersionGuard.for_model({"big": BIG_SPEC})
    err, peak = traced_peak(lambda: stage_segments([("seg-b", data)], 1, {"big": BIG_SPEC}, guard))
    assert isinstance(err, EntryError) and err.entry == 1 and err.param == "big"
    assert "overlaps [0, 1048576) of seg-b entry 0" in str(err)
    assert guard.decoded_bytes == 2 * BIG  # one entry decoded, the other 299 never
    assert peak < 8 * BIG  # a few MiB, not 600


def test_bomb_within_one_segment_is_refused_without_a_shared_guard() -> None:
    """decode_segment alone (no version guard) still refuses overlaps among its own entries."""
    with pytest.raises(EntryError, match="overlaps"):
        decode_segment(bomb_one_param(3), "seg-b", None)


def test_bomb_across_parameters_spends_the_budget_and_stops(memory_store: Store) -> None:
    """300 parameters of the model, 2 MiB each, but the manifest vouches for one: the
    budget (2x its dense bytes + its indices + the slack) runs out after a few entries,
    long before 600 MiB; fetch_delta, the path of every Actor and engine, refuses it."""
    model = {f"p{i}": BIG_SPEC for i in range(300)}
    params = {"p0": {"shape": [BIG], "dtype": "bfloat16", "nnz": BIG}}
    budget = version_budget(params, model)
    assert budget == BUDGET_SLACK_BYTES + 2 * 2 * BIG + 8 * BIG
    data = bomb_many_params(300)
    publish_raw_delta(memory_store, 1, BASE_STATE, [data], params)

    err, peak = traced_peak(lambda: fetch_delta(memory_store, 1, model))
    assert isinstance(err, EntryError), err
    assert "past its budget" in str(err)
    assert err.entry == budget // (2 * BIG)  # the first entry that would not fit
    assert peak < budget + 8 * BIG

    guard = VersionGuard.for_manifest(params, model)
    with pytest.raises(EntryError, match="past its budget"):
        decode_segment(data, "seg", model, guard)
    assert guard.decoded_bytes <= guard.budget  # type: ignore[operator]


def test_entries_that_tile_a_parameter_are_accepted(memory_store: Store) -> None:
    """The control: 256 frames of one parameter, side by side, decode within the budget."""
    n, piece = 256, BIG // 256
    frames = [zeros_frame(2 * piece)] * n
    data = segment([dense_entry(i, "big", i * piece, (i + 1) * piece) for i in range(n)], frames)
    publish_raw_delta(memory_store, 1, BASE_STATE, [data], {"big": {"shape": [BIG], "dtype": "bfloat16", "nnz": BIG}})
    _, staged = fetch_delta(memory_store, 1, {"big": BIG_SPEC})
    assert len(staged.entries) == n and staged.nnz == BIG


def test_worst_valid_delta_fits_its_budget(memory_store: Store) -> None:
    """Every element changed, written with absolute u32 indices (the naive baseline):
    decoded it holds 8-byte indices besides 2-byte values, 5x the dense bytes, and
    still fits (the budget counts the indices the manifest declares)."""
    numel = 1 << 21
    spec = ParamSpec((numel,), "bfloat16")
    idx = np.arange(numel, dtype=np.int64)
    new = np.arange(numel, dtype=np.uint16)
    d = ParamDelta("w", spec, idx, new, new ^ np.uint16(1))
    params: dict[str, dict[str, object]] = {}
    segs = [s.data for s in encode_segments([d], 1, NAIVE, params_out=params)]
    publish_raw_delta(memory_store, 1, BASE_STATE, segs, params)
    _, staged = fetch_delta(memory_store, 1, {"w": spec})
    assert staged.nnz == numel
    assert sum(e.indices.nbytes + e.bits.nbytes for e in staged.entries if e.indices is not None) == 10 * numel


def test_entry_count_per_segment_is_bounded() -> None:
    n = MAX_ENTRIES_PER_SEGMENT + 1
    data = segment([{} for _ in range(n)], [])  # metadata alone; never looked at one by one
    with pytest.raises(SegmentError, match=f"{n} entries, more than the reader's limit"):
        decode_segment(data, "seg-n", None)


def test_entry_count_per_version_is_bounded() -> None:
    guard = VersionGuard(None, max_entries=3)
    frames = [zeros_frame(2 * 16)] * 4
    data = segment([dense_entry(i, "big", 16 * i, 16 * (i + 1)) for i in range(4)], frames)
    with pytest.raises(EntryError, match="more than 3 entries") as ei:
        decode_segment(data, "seg", {"big": BIG_SPEC}, guard)
    assert ei.value.entry == 3


# --- headers --------------------------------------------------------------------


def test_a_90_mb_header_is_refused_from_its_length(memory_store: Store) -> None:
    n = 90_000_000
    assert n > MAX_HEADER_BYTES
    data = struct.pack("<Q", n) + b"{" + b" " * (n - 2) + b"}"
    with pytest.raises(SegmentError, match="absurdly large"):
        parse_safetensors(data, "seg-h")
    # Through a store: the first 8 bytes say enough; the rest is never read.
    key = f"{version_dir('delta', 1)}/0123456789abcdef/seg-00000.safetensors"
    memory_store.put(key, data)
    with pytest.raises(SegmentError, match="absurdly large"):
        check_header_length(memory_store.get_range(key, 0, 8), memory_store.where(key))


def test_a_90_mb_header_in_a_committed_delta_is_refused_before_decoding(memory_store: Store) -> None:
    n = 90_000_000
    data = struct.pack("<Q", n) + b" " * n
    publish_raw_delta(memory_store, 1, BASE_STATE, [data], {})
    with pytest.raises(SegmentError, match="absurdly large") as ei:
        fetch_delta(memory_store, 1, None)
    assert isinstance(ei.value, FormatError)


# --- JSON integers and manifest size ----------------------------------------------


def _manifest_bytes(memory_store: Store) -> bytes:
    publish_raw_delta(memory_store, 1, BASE_STATE, [], {})
    return memory_store.get(manifest_key("delta", 1))


def test_a_5000_digit_integer_in_a_manifest_is_a_manifest_error(memory_store: Store) -> None:
    good = _manifest_bytes(memory_store)
    d = good.decode()
    bad = d.replace('"version": 1,', '"version": ' + "7" * 5000 + ",", 1).encode()
    assert bad != good
    with pytest.raises(ManifestError, match="an integer of 5000 digits"):
        Manifest.from_bytes(bad, "m")
    # Nested anywhere, and negative too.
    nested = ('{"x": [-' + "1" * 5000 + "], " + d.lstrip()[1:]).encode()
    with pytest.raises(ManifestError, match="an integer of 5000 digits"):
        Manifest.from_bytes(nested, "m")
    # At the store: read_manifest raises the same typed error.
    memory_store.put(manifest_key("delta", 1), bad, mode="overwrite")
    with pytest.raises(ManifestError) as ei:
        read_manifest(memory_store, "delta", 1)
    assert memory_store.where(manifest_key("delta", 1)) in str(ei.value)


def test_twenty_digit_integers_are_fine() -> None:
    assert load_json(b"[18446744073709551616, -18446744073709551616]", lambda why: ManifestError("m", why)) == [1 << 64, -(1 << 64)]
    with pytest.raises(ManifestError, match="21 digits"):
        load_json(b"[100000000000000000000]", lambda why: ManifestError("m", why))


def test_a_manifest_past_the_size_limit_is_refused_unparsed(memory_store: Store) -> None:
    good = _manifest_bytes(memory_store)
    big = good.rstrip().rstrip(b"}") + b', "pad": "' + b"x" * MAX_MANIFEST_BYTES + b'"}'
    with pytest.raises(ManifestError, match="past the reader's limit"):
        Manifest.from_bytes(big, "m")
    Manifest.from_bytes(good, "m")


def test_the_refusals_are_the_errors_actor_and_relay_treat_as_a_bad_version(memory_store: Store) -> None:
    """The Actor quarantines or falls back on ``INVALID`` (and catches ``AuroraError``
    from a mirror); the Relay's listing skips a version on ``AuroraError``. Each limit
    raises one of those, never a bare ValueError."""
    from workers.actor.actor import INVALID

    good = _manifest_bytes(memory_store)
    errors: list[BaseException] = []
    for bad in (good.replace(b'"version": 1', b'"version": ' + b"1" * 5000), b" " * (MAX_MANIFEST_BYTES + 1)):
        try:
            Manifest.from_bytes(bad, "m")
        except Exception as e:  # noqa: BLE001 - inspected below
            errors.append(e)
    for data in (bomb_one_param(2), struct.pack("<Q", 90_000_000) + b" " * 8):
        try:
            stage_segments([("s", data)], 1, {"big": BIG_SPEC})
        except Exception as e:  # noqa: BLE001 - inspected below
            errors.append(e)
    assert len(errors) == 4
    for err in errors:
        assert isinstance(err, INVALID) and isinstance(err, AuroraError), repr(err)


# --- verify --deep ------------------------------------------------------------------


def test_verify_deep_flags_overlapping_entries(tmp_path: Path) -> None:
    """Two segments of delta 1 each carry a valid entry for all of ``w``: each decodes
    alone, apply refuses the pair, and so does ``verify --deep`` (plain verify does not decode)."""
    import torch

    from aurora_store.lineage.publish import publish_snapshot
    from aurora_store.storage import open_store

    store = open_store(f"file://{tmp_path}/run")
    w = torch.zeros(64, dtype=torch.bfloat16)
    snap = publish_snapshot(store, "t", 0, {"w": w}, None)
    frame = zeros_frame(2 * 64)
    seg = segment([dense_entry(0, "w", 0, 64, numel=64)], [frame])
    publish_raw_delta(store, 1, snap.state, [seg, seg], {"w": {"shape": [64], "dtype": "bfloat16", "nnz": 128}})
    with pytest.raises(EntryError, match="overlaps"):
        fetch_delta(store, 1, {"w": ParamSpec((64,), "bfloat16")})
    assert verify_run(store).ok
    rep = verify_run(store, deep=True)
    assert not rep.ok
    assert len(rep.problems) == 1 and "overlaps [0, 64)" in rep.problems[0], rep.problems


def test_verify_deep_flags_declared_nnz_and_passes_a_good_delta(tmp_path: Path) -> None:
    import torch

    from aurora_store.lineage.publish import publish_snapshot
    from aurora_store.storage import open_store

    store = open_store(f"file://{tmp_path}/run")
    snap = publish_snapshot(store, "t", 0, {"w": torch.zeros(64, dtype=torch.bfloat16)}, None)
    seg = segment([dense_entry(0, "w", 0, 64, numel=64)], [zeros_frame(128)])
    m1 = publish_raw_delta(store, 1, snap.state, [seg], {"w": {"shape": [64], "dtype": "bfloat16", "nnz": 64}})
    assert verify_run(store, deep=True).ok
    seg2 = segment([dense_entry(0, "w", 0, 64, numel=64)], [zeros_frame(128)], version=2)
    publish_raw_delta(store, 2, m1.state, [seg2], {"w": {"shape": [64], "dtype": "bfloat16", "nnz": 63}})
    rep = verify_run(store, deep=True)
    assert len(rep.problems) == 1 and "nnz is 63, segments carry 64" in rep.problems[0], rep.problems


# --- the Relay skips one bad version and keeps listing ---------------------------------


@pytest.mark.server
@pytest.mark.slow
def test_relay_skips_a_version_whose_manifest_holds_a_5000_digit_integer(redis_server: Any, run_name: str, tmp_path: Path) -> None:
    """Before the limit this was a bare ValueError that aborted the Relay's listing; now
    delta 2 is quarantined and the versions before it are mirrored. Delta 3 is not: with
    delta 2 unreadable it is off the chain that counts (issue 24), and no reader reaches it."""
    from relay_helpers import describe_model, make_relay, mirrored, running
    from trainer_fixtures import FakeTrainer

    from aurora_store.coordination.bus import Bus
    from aurora_store.coordination.redisconn import connect
    from aurora_store.storage import open_store
    from aurora_store.testing.wait import wait_until

    origin = open_store(f"file://{tmp_path}/origin")
    mirror = open_store(f"file://{tmp_path}/mirror")
    describe_model(origin)
    redis = connect(redis_server.url)
    try:
        trainer = FakeTrainer(origin, run_name, Bus(redis, run_name))
        for _ in range(3):
            trainer.step(announce=False)
        key = manifest_key("delta", 2)
        good = origin.get(key)
        origin.put(key, good.replace(b'"version": 2', b'"version": ' + b"2" * 5000, 1), mode="overwrite")
        relay = make_relay(origin, mirror, redis_server.url, run_name, retry_s=30.0)
        with running(relay):
            wait_until(mirrored(relay, ("snapshot", 0), ("delta", 1)), "the versions before delta 2")
            wait_until(lambda: ("delta", 2) in relay.stats().quarantined, "delta 2 quarantined")
            assert not mirror.exists(key) and not mirror.exists(manifest_key("delta", 3))
    finally:
        redis.close()


# --- the Actor falls back from the mirror to origin ------------------------------------


@pytest.mark.server
def test_actor_reads_origin_when_the_mirror_manifest_breaks_a_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_client: Any, redis_server: Any
) -> None:
    """Mirror delta 1's manifest holds a 5,000-digit integer, delta 2's is past 16 MiB:
    both are staged from origin, each refusal a format error the stager handles."""
    from test_actor_staging import _actor, _mirror

    from aurora_store.codec.extract import extract
    from aurora_store.lineage.publish import PublishConfig, publish_delta
    from aurora_store.storage import open_store
    from aurora_tools.synthetic.shapes import QWEN3_TINY
    from aurora_tools.synthetic.workload import SyntheticSpec, base_weights, sparse_update
    from workers.model import fusion_plan_for

    # The run of test_actor_staging's fixture: two deltas of the tiny synthetic model at origin.
    monkeypatch.setenv("AURORA_SYNTHETIC_CACHE", str(tmp_path / "cache"))
    spec = SyntheticSpec(QWEN3_TINY, seed=7)
    origin = open_store(f"file://{tmp_path}/origin")
    w = base_weights(spec.shape, spec.seed)
    plan = fusion_plan_for(w, tied=True)
    state = spec.base_state
    for v in (1, 2):
        new = {n: t.clone() for n, t in w.items()}
        sparse_update(new, spec.density, spec.seed, v)
        state = publish_delta(origin, "r", v, extract(plan, w, new), state, PublishConfig(streams=2, segment_bytes=4096)).state
        w = new
    run = {"spec": spec, "tmp": tmp_path, "redis": redis_server.url, "client": redis_client}
    _mirror(run, 1, 2)
    mirror = tmp_path / "mirror"
    m1 = mirror / manifest_key("delta", 1)
    m1.write_bytes(m1.read_bytes().replace(b'"version": 1', b'"version": ' + b"1" * 5000, 1))
    m2 = mirror / manifest_key("delta", 2)
    m2.write_bytes(m2.read_bytes().rstrip().rstrip(b"}") + b', "pad": "' + b"x" * MAX_MANIFEST_BYTES + b'"}')
    a, rec = _actor(run, head=2)
    a.stager.stage_once()
    assert rec.sources == [(1, False), (2, False)]


# --- our writer stays inside the limits ---------------------------------------------


def test_many_small_parameters_are_cut_into_segments_readers_accept() -> None:
    """12,000 changed parameters of a few elements: the payload fits one segment, the
    header would not fit half the header limit, so the writer cuts; every segment decodes."""
    n = 12_000
    spec = ParamSpec((4,), "bfloat16")
    idx = np.array([1], dtype=np.int64)
    deltas = [
        ParamDelta(
            f"model.layers.{i}.mlp.experts.{i % 128}.down_proj.weight", spec, idx, np.array([7], np.uint16), np.array([0], np.uint16)
        )
        for i in range(n)
    ]
    segs = list(encode_segments(deltas, 1))
    assert len(segs) >= 2
    model = {d.name: spec for d in deltas}
    for s in segs:
        (h,) = struct.unpack_from("<Q", s.data)
        assert h <= MAX_HEADER_BYTES // 2
    staged = stage_segments([(f"s{i}", s.data) for i, s in enumerate(segs)], 1, model)
    assert len(staged.entries) == n
