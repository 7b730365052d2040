"""Manifests and digests (FORMAT.md §1 and §4).

A version exists exactly when its manifest exists; the manifest lists the
segment objects with their sizes and sha256, and chains ``state`` digests so
that ``state`` names the exact weights of a version, whichever path reached it.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from aurora_store.codec.encodings import DTYPES
from aurora_store.codec.entries import ParamSpec
from aurora_store.errors import ManifestError
from aurora_store.format.limits import MAX_MANIFEST_BYTES, load_json

__all__ = [
    "SegmentRef",
    "Manifest",
    "canonical_json",
    "content_digest",
    "chain_state",
    "version_dir",
    "manifest_key",
    "new_attempt_id",
    "parse_version_dir",
    "PRODUCER_NAME",
]

PRODUCER_NAME = "aurora"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_ATTEMPT = re.compile(r"^[0-9a-f]{16,}$")
_SEGKEY = re.compile(r"^[0-9a-f]{16,}/(seg|shard)-[0-9]{5}\.safetensors$")
_VDIR = re.compile(r"^v([0-9]{10})$")


def canonical_json(x: Any) -> bytes:
    """FORMAT.md §4 canonical JSON."""
    return json.dumps(x, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _sha(b: bytes) -> str:
    return "sha256:" + hashlib.sha256(b).hexdigest()


def version_dir(kind: str, version: int) -> str:
    """``deltas/v0000000121`` or ``snapshots/v0000000121``."""
    if kind not in ("delta", "snapshot"):
        raise ValueError(f"unknown kind {kind!r}")
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    return f"{kind}s/v{version:010d}"


def manifest_key(kind: str, version: int) -> str:
    return f"{version_dir(kind, version)}/manifest.json"


def parse_version_dir(name: str) -> int | None:
    """``v0000000121`` -> 121; anything else -> None."""
    m = _VDIR.fullmatch(name)
    return int(m.group(1)) if m else None


def new_attempt_id() -> str:
    """A fresh publish-attempt id: 16 random lowercase hex characters."""
    return secrets.token_hex(8)


@dataclass(frozen=True, slots=True)
class SegmentRef:
    """One object of a version, as listed in its manifest."""

    key: str
    """Relative to the version's folder: ``{attempt}/seg-00000.safetensors``."""
    bytes: int
    """Object size."""
    sha256: str
    """Hex digest of the object's bytes (no prefix)."""

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "bytes": self.bytes, "sha256": self.sha256}


def content_digest(segments: Sequence[SegmentRef]) -> str:
    """``C(V)``: sha256 of the canonical JSON of the segments list."""
    return _sha(canonical_json([s.to_json() for s in segments]))


def chain_state(base_state: str, content: str) -> str:
    """``state`` of a delta: sha256(base_state + "\\n" + C(V))."""
    return _sha((base_state + "\n" + content).encode("utf-8"))


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True, slots=True)
class Manifest:
    """The commit record of one delta or snapshot version."""

    kind: str
    """``delta`` or ``snapshot``."""
    run: str
    """Run name (informational)."""
    version: int
    """Policy version: optimizer steps applied."""
    segments: tuple[SegmentRef, ...]
    """Segment (delta) or shard (snapshot) objects, in production order."""
    params: Mapping[str, Mapping[str, Any]]
    """Fused name -> {shape, dtype[, nnz]}."""
    state: str
    """``sha256:…`` naming the exact weights of this version."""
    base_version: int | None = None
    """Delta only: the version this delta applies on."""
    base_state: str | None = None
    """Delta only: the ``state`` of the base."""
    created_at: str = field(default_factory=_now)
    producer: Mapping[str, Any] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Fields this reader does not know, kept as read."""

    # ------------------------------------------------------------------
    @property
    def content(self) -> str:
        return content_digest(self.segments)

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.segments)

    @property
    def nnz(self) -> int:
        return sum(int(p.get("nnz", 0)) for p in self.params.values())

    def param_specs(self) -> dict[str, ParamSpec]:
        return {n: ParamSpec(tuple(p["shape"]), p["dtype"]) for n, p in self.params.items()}

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.param_specs().values())

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = dict(self.extra)
        d.update({"format": 1, "kind": self.kind, "run": self.run, "version": self.version})
        if self.kind == "delta":
            d["base_version"] = self.base_version
            d["base_state"] = self.base_state
        d["state"] = self.state
        d["segments"] = [s.to_json() for s in self.segments]
        d["params"] = {k: dict(v) for k, v in self.params.items()}
        d["created_at"] = self.created_at
        d["producer"] = dict(self.producer)
        return d

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_json(), indent=1, ensure_ascii=False).encode("utf-8") + b"\n"

    # ------------------------------------------------------------------
    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Manifest:
        """Parse and validate an untrusted manifest, including its digests.

        Refused before parsing: more than :data:`~aurora_store.format.limits.MAX_MANIFEST_BYTES`;
        while parsing: an integer of more than 20 digits (format/limits.py).
        """
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(where, f"{len(data)} bytes, past the reader's limit of {MAX_MANIFEST_BYTES}")
        d = load_json(data, lambda why: ManifestError(where, why))
        if not isinstance(d, dict):
            raise ManifestError(where, "not a JSON object")

        def get(name: str, kind: type | tuple[type, ...], required: bool = True) -> Any:
            if name not in d:
                if required:
                    raise ManifestError(where, f"field {name!r} is missing")
                return None
            v = d[name]
            if not isinstance(v, kind) or (isinstance(v, bool) and kind is int):
                raise ManifestError(where, f"field {name!r} has type {type(v).__name__}")
            return v

        if d.get("format") != 1:
            raise ManifestError(where, f"format is {d.get('format')!r}; this reader knows format 1")
        kind = get("kind", str)
        if kind not in ("delta", "snapshot"):
            raise ManifestError(where, f"unknown kind {kind!r}")
        version = get("version", int)
        if version < 0:
            raise ManifestError(where, f"version {version} is negative")
        state = get("state", str)
        if not _DIGEST.fullmatch(state):
            raise ManifestError(where, f"state {state!r} is not 'sha256:' + 64 hex digits")
        segs: list[SegmentRef] = []
        for i, s in enumerate(get("segments", list)):
            if not isinstance(s, dict):
                raise ManifestError(where, f"segments[{i}] is not an object")
            key, size, sha = s.get("key"), s.get("bytes"), s.get("sha256")
            if not isinstance(key, str) or not _SEGKEY.fullmatch(key):
                raise ManifestError(where, f"segments[{i}].key {key!r} is not '<attempt>/seg-NNNNN.safetensors'")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise ManifestError(where, f"segments[{i}].bytes {size!r} is not a non-negative integer")
            if not isinstance(sha, str) or not _HEX64.fullmatch(sha):
                raise ManifestError(where, f"segments[{i}].sha256 {sha!r} is not 64 lowercase hex digits")
            segs.append(SegmentRef(key, size, sha))
        params = get("params", dict)
        for name, p in params.items():
            if not isinstance(p, dict):
                raise ManifestError(where, f"params[{name!r}] is not an object")
            shape = p.get("shape")
            if not isinstance(shape, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape):
                raise ManifestError(where, f"params[{name!r}].shape {shape!r} is invalid")
            if not isinstance(p.get("dtype"), str) or p.get("dtype") not in DTYPES:
                raise ManifestError(
                    where,
                    f"params[{name!r}].dtype {p.get('dtype')!r} is not one of {sorted(DTYPES)}",
                )
            nnz = p.get("nnz")
            if nnz is not None and (not isinstance(nnz, int) or isinstance(nnz, bool) or nnz < 0):
                raise ManifestError(where, f"params[{name!r}].nnz {nnz!r} is invalid")
        base_version = base_state = None
        if kind == "delta":
            base_version = get("base_version", int)
            if base_version != version - 1:
                raise ManifestError(where, f"base_version {base_version} of delta {version} is not {version - 1}")
            base_state = get("base_state", str)
            if not _DIGEST.fullmatch(base_state):
                raise ManifestError(where, f"base_state {base_state!r} is not 'sha256:' + 64 hex digits")
            want = chain_state(base_state, content_digest(segs))
            if state != want:
                raise ManifestError(
                    where,
                    f"state {state[:19]}… does not match sha256(base_state, C(V)) = {want[:19]}…",
                )
        known = {
            "format",
            "kind",
            "run",
            "version",
            "base_version",
            "base_state",
            "state",
            "segments",
            "params",
            "created_at",
            "producer",
        }
        return cls(
            kind=kind,
            run=str(d.get("run", "")),
            version=version,
            segments=tuple(segs),
            params=params,
            state=state,
            base_version=base_version,
            base_state=base_state,
            created_at=str(d.get("created_at", "")),
            producer=d["producer"] if isinstance(d.get("producer"), dict) else {},
            extra={k: v for k, v in d.items() if k not in known},
        )
