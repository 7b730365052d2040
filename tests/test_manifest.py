"""Manifests, canonical JSON and the state digest chain (FORMAT.md §1, §4)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from aurora_store.errors import ManifestError
from aurora_store.format.manifest import (
    Manifest,
    SegmentRef,
    canonical_json,
    chain_state,
    content_digest,
    manifest_key,
    new_attempt_id,
    parse_version_dir,
    version_dir,
)

ATTEMPT = "9f3c0a1b2c3d4e5f"


def sha(b: bytes) -> str:
    return "sha256:" + hashlib.sha256(b).hexdigest()


def canon(x: Any) -> bytes:
    # FORMAT.md §4, verbatim
    return json.dumps(x, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def refs(n: int = 2) -> tuple[SegmentRef, ...]:
    return tuple(SegmentRef(f"{ATTEMPT}/seg-{i:05d}.safetensors", 1000 + i, hashlib.sha256(bytes([i])).hexdigest()) for i in range(n))


def delta_json(version: int = 121, base_state: str | None = None, segs: tuple[SegmentRef, ...] | None = None) -> dict[str, Any]:
    segs = refs() if segs is None else segs
    base_state = base_state or sha(b"base")
    seg_list = [{"key": s.key, "bytes": s.bytes, "sha256": s.sha256} for s in segs]
    c = sha(canon(seg_list))
    return {
        "format": 1,
        "kind": "delta",
        "run": "démo",
        "version": version,
        "base_version": version - 1,
        "base_state": base_state,
        "state": sha((base_state + "\n" + c).encode("utf-8")),
        "segments": seg_list,
        "params": {
            "model.layers.0.self_attn.qkv_proj.weight": {
                "shape": [4096, 1024],
                "dtype": "bfloat16",
                "nnz": 40110,
            }
        },
        "created_at": "2026-11-29T11:00:00Z",
        "producer": {"name": "aurora", "version": "0.1.0", "epoch": 3},
    }


def test_canonical_json_matches_format() -> None:
    x = {"b": [1, {"z": "é", "a": None}], "a": "ü"}
    assert canonical_json(x) == canon(x)
    assert canonical_json(x) == '{"a":"ü","b":[1,{"a":null,"z":"é"}]}'.encode()


def test_content_digest_and_chain_computed_independently() -> None:
    segs = refs(3)
    seg_list = [{"key": s.key, "bytes": s.bytes, "sha256": s.sha256} for s in segs]
    c = "sha256:" + hashlib.sha256(canon(seg_list)).hexdigest()
    assert content_digest(segs) == c
    base = sha(b"whatever")
    assert chain_state(base, c) == "sha256:" + hashlib.sha256(f"{base}\n{c}".encode()).hexdigest()
    # order of segments matters (the order they were produced)
    assert content_digest(segs[::-1]) != c
    # empty delta: C = sha256("[]")
    assert content_digest(()) == sha(b"[]")


def test_manifest_state_of_a_published_delta() -> None:
    d = delta_json()
    m = Manifest.from_bytes(json.dumps(d).encode(), "m.json")
    assert m.content == sha(canon(d["segments"]))
    assert m.state == d["state"]
    assert m.base_version == 120 and m.base_state == d["base_state"]
    assert m.nnz == 40110 and m.total_bytes == 2001
    assert m.numel == 4096 * 1024


def test_round_trip_to_bytes_from_bytes() -> None:
    m = Manifest.from_bytes(json.dumps(delta_json()).encode(), "m")
    again = Manifest.from_bytes(m.to_bytes(), "m")
    assert again == m
    assert json.loads(m.to_bytes()) == delta_json()
    assert m.to_bytes().endswith(b"\n")


def test_snapshot_round_trip() -> None:
    segs = tuple(SegmentRef(f"{ATTEMPT}/shard-{i:05d}.safetensors", 10, "a" * 64) for i in range(2))
    m = Manifest(
        kind="snapshot",
        run="r",
        version=0,
        segments=segs,
        params={"w": {"shape": [2, 3], "dtype": "float32"}},
        state=content_digest(segs),
    )
    d = json.loads(m.to_bytes())
    assert "base_version" not in d and "base_state" not in d
    assert d["format"] == 1 and d["kind"] == "snapshot"
    back = Manifest.from_bytes(m.to_bytes(), "s")
    assert back == m and back.base_state is None


def test_unknown_fields_preserved_and_ignored() -> None:
    d = delta_json()
    d["signature"] = {"alg": "hmac-sha256", "key_id": "k1", "value": "00"}
    d["future_field"] = [1, 2, 3]
    m = Manifest.from_bytes(json.dumps(d).encode(), "m")
    assert m.extra == {"signature": d["signature"], "future_field": [1, 2, 3]}
    assert json.loads(m.to_bytes()) == d
    # unknown fields inside segments/params do not break reading either
    d["params"]["model.layers.0.self_attn.qkv_proj.weight"]["hint"] = "x"
    Manifest.from_bytes(json.dumps(d).encode(), "m")


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (
            lambda d: d.update(state="sha256:" + "0" * 64),
            "does not match sha256\\(base_state, C\\(V\\)\\)",
        ),
        (lambda d: d.update(base_state=sha(b"other")), "does not match"),
        (lambda d: d["segments"][0].update(bytes=1), "does not match"),  # content changed
        (lambda d: d["segments"].reverse(), "does not match"),
        (lambda d: d.update(state="sha256:xyz"), "is not 'sha256:' \\+ 64 hex"),
        (lambda d: d.update(state="SHA256:" + "0" * 64), "is not 'sha256:'"),
        (lambda d: d.update(base_state="abc"), "base_state 'abc'"),
        (lambda d: d["segments"][0].update(key="../../etc/passwd"), "segments\\[0\\].key"),
        (lambda d: d["segments"][0].update(key="seg-00000.safetensors"), "segments\\[0\\].key"),
        (
            lambda d: d["segments"][1].update(key=f"{ATTEMPT}/seg-1.safetensors"),
            "segments\\[1\\].key",
        ),
        (lambda d: d["segments"][0].update(key="ABCDEF0123456789/seg-00000.safetensors"), "key"),
        (lambda d: d["segments"][0].update(bytes=-1), "segments\\[0\\].bytes"),
        (lambda d: d["segments"][0].update(bytes=True), "segments\\[0\\].bytes"),
        (lambda d: d["segments"][0].update(sha256="A" * 64), "segments\\[0\\].sha256"),
        (lambda d: d["segments"].__setitem__(0, "x"), "segments\\[0\\] is not an object"),
        (lambda d: d.update(format=2), "format is 2"),
        (lambda d: d.update(format="1"), "format is '1'"),
        (lambda d: d.update(kind="diff"), "unknown kind 'diff'"),
        (lambda d: d.update(version=-1, base_version=-2), "version -1 is negative"),
        (lambda d: d.update(version="121"), "field 'version' has type str"),
        (lambda d: d.update(version=True), "field 'version' has type bool"),
        (lambda d: d.update(base_version=100), "base_version 100 of delta 121 is not 120"),
        (lambda d: d["params"].update(w={"shape": [2], "dtype": "int8"}), "params\\['w'\\].dtype"),
        (
            lambda d: d["params"].update(w={"shape": [-2], "dtype": "float32"}),
            "params\\['w'\\].shape",
        ),
        (
            lambda d: d["params"].update(w={"shape": [2], "dtype": "float32", "nnz": -1}),
            "params\\['w'\\].nnz",
        ),
        (lambda d: d["params"].update(w=[1]), "params\\['w'\\] is not an object"),
        (lambda d: d.update(segments={}), "field 'segments' has type dict"),
    ],
)
def test_from_bytes_rejects(mutate: Any, match: str) -> None:
    d = delta_json()
    mutate(d)
    with pytest.raises(ManifestError, match=match) as ei:
        Manifest.from_bytes(json.dumps(d).encode(), "s3://b/run/deltas/v0000000121/manifest.json")
    assert str(ei.value).startswith("manifest s3://b/run/deltas/v0000000121/manifest.json: ")


@pytest.mark.parametrize(
    "field",
    ["format", "kind", "version", "state", "segments", "params", "base_version", "base_state"],
)
def test_from_bytes_rejects_missing_fields(field: str) -> None:
    d = delta_json()
    del d[field]
    with pytest.raises(ManifestError, match=field):
        Manifest.from_bytes(json.dumps(d).encode(), "m")


@pytest.mark.parametrize("raw", [b"", b"{", b"\xff\xfe", b"[]", b"null", b'"x"'])
def test_from_bytes_rejects_non_objects(raw: bytes) -> None:
    with pytest.raises(ManifestError):
        Manifest.from_bytes(raw, "m")


def test_trailing_newline_in_digest_rejected() -> None:
    segs = tuple(SegmentRef(f"{ATTEMPT}/shard-00000.safetensors", 10, "a" * 64) for _ in range(1))
    d = json.loads(
        Manifest(
            kind="snapshot",
            run="r",
            version=0,
            segments=segs,
            params={},
            state=content_digest(segs),
        ).to_bytes()
    )
    d["state"] += "\n"
    with pytest.raises(ManifestError):
        Manifest.from_bytes(json.dumps(d).encode(), "m")


def test_layout_helpers() -> None:
    assert version_dir("delta", 121) == "deltas/v0000000121"
    assert manifest_key("snapshot", 0) == "snapshots/v0000000000/manifest.json"
    assert parse_version_dir("v0000000121") == 121
    for bad in ("v121", "x0000000121", "v00000001210", "v000000012a"):
        assert parse_version_dir(bad) is None
    with pytest.raises(ValueError):
        version_dir("deltas", 1)
    with pytest.raises(ValueError):
        version_dir("delta", -1)
    ids = {new_attempt_id() for _ in range(20)}
    assert len(ids) == 20
    assert all(len(i) >= 16 and i == i.lower() and int(i, 16) >= 0 for i in ids)
    # listing order is numeric order
    names = [version_dir("delta", v) for v in (9, 10, 100, 2)]
    assert sorted(names) == [version_dir("delta", v) for v in (2, 9, 10, 100)]


@pytest.mark.parametrize(
    "data",
    [
        b'{"format": 1, "version": 1' + b"1" * 5000 + b"}",  # json's int-digits ValueError
        json.dumps(
            {
                "format": 1,
                "kind": "snapshot",
                "version": 0,
                "state": "sha256:" + "0" * 64,
                "segments": [],
                "params": {"a": {"shape": [1], "dtype": ["bfloat16"]}},
            }
        ).encode(),  # an unhashable dtype
    ],
    ids=["int-digits", "dtype-list"],
)
def test_json_limits_and_odd_types_are_manifest_errors(data: bytes) -> None:
    with pytest.raises(ManifestError):
        Manifest.from_bytes(data, "m")
