"""What binds a snapshot and the model files to the chain (FORMAT.md §1 and §4.1).

Anyone who can write to a store can create ``snapshots/v{N}`` for a
version the Trainer never snapshotted (the name is free, so create-only does
not stop it), copy the true ``state`` into it and put any weights in its
shards. What such a writer cannot do is rewrite the committed *delta*
manifest of that version. So a snapshot at V > 0 is used only when the delta
manifest of V carries a ``weights_digest`` equal to the snapshot's (the
writer publishes the delta first), and the snapshot's weights are hashed on
arrival and compared with that digest. Version 0 has no delta: it is the
root the chain of states starts from, and it is written once, first.

The one exception is a run that holds no delta at all (``transfer="full"``,
the broadcast baseline: every version is a self-rooted snapshot). There is
nothing to bind to; readers use its snapshots and say so. An Actor still
compares each state with the Trainer's record in Redis.

Pure functions over parsed manifests: no torch, no store reads.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aurora_store.errors import ManifestError

__all__ = [
    "WEIGHTS_DIGEST_FIELD",
    "MODEL_FIELD",
    "ModelFile",
    "manifest_weights_digest",
    "model_files",
    "model_listing",
    "snapshot_unbound",
]

WEIGHTS_DIGEST_FIELD = "weights_digest"
"""Manifest member (FORMAT.md §4.1): ``sha256:`` + hex of the weights the version holds."""
MODEL_FIELD = "model"
"""Version 0's snapshot manifest member listing the files under ``model/`` (FORMAT.md §1)."""

_DIGEST = re.compile(r"^(?:tree-)?sha256:[0-9a-f]{64}$")  # either form of FORMAT.md §4.1
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_MODEL_KEY = re.compile(r"^model/[A-Za-z0-9._-][A-Za-z0-9._/-]{0,254}$")


def manifest_weights_digest(extra: Mapping[str, Any], where: str) -> str | None:
    """The manifest's ``weights_digest`` (from ``Manifest.extra``), None when absent.

    A present value that is not ``sha256:`` or ``tree-sha256:`` + 64 lowercase hex digits is a bad
    manifest (:class:`~aurora_store.errors.ManifestError`), not "absent": a
    reader must never treat a malformed binding as no binding.
    """
    if WEIGHTS_DIGEST_FIELD not in extra:
        return None
    d = extra[WEIGHTS_DIGEST_FIELD]
    if not isinstance(d, str) or not _DIGEST.fullmatch(d):
        raise ManifestError(where, f"weights_digest {str(d)[:80]!r} is not 'sha256:' or 'tree-sha256:' + 64 hex digits")
    return d


@dataclass(frozen=True, slots=True)
class ModelFile:
    """One file under ``model/`` as version 0's manifest lists it."""

    key: str
    """Relative to the run root: ``model/config.json``."""
    bytes: int
    sha256: str
    """Hex digest of the file's bytes (no prefix)."""

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "bytes": self.bytes, "sha256": self.sha256}


def model_files(extra: Mapping[str, Any], where: str) -> dict[str, ModelFile] | None:
    """key -> :class:`ModelFile` from a manifest's ``model`` member; None when it has none.

    Keys must lie under ``model/`` (no ``..``, no absolute paths): the list
    says which files a reader may trust, never where else to read.
    """
    if MODEL_FIELD not in extra:
        return None
    raw = extra[MODEL_FIELD]
    if not isinstance(raw, list) or len(raw) > 1000:
        raise ManifestError(where, "model is not a list of at most 1000 files")
    out: dict[str, ModelFile] = {}
    for i, f in enumerate(raw):
        if not isinstance(f, dict):
            raise ManifestError(where, f"model[{i}] is not an object")
        key, size, sha = f.get("key"), f.get("bytes"), f.get("sha256")
        if not isinstance(key, str) or not _MODEL_KEY.fullmatch(key) or ".." in key.split("/"):
            raise ManifestError(where, f"model[{i}].key {str(key)[:80]!r} is not a file under model/")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ManifestError(where, f"model[{i}].bytes {size!r} is not a non-negative integer")
        if not isinstance(sha, str) or not _HEX64.fullmatch(sha):
            raise ManifestError(where, f"model[{i}].sha256 is not 64 lowercase hex digits")
        if key in out:
            raise ManifestError(where, f"model lists {key!r} twice")
        out[key] = ModelFile(key, size, sha)
    return out


def model_listing(files: Sequence[ModelFile]) -> list[dict[str, Any]]:
    """The ``model`` member to write, in key order."""
    return [f.to_json() for f in sorted(files, key=lambda f: f.key)]


def snapshot_unbound(
    version: int,
    snapshot_digest: str | None,
    delta_digest: str | None,
    delta_committed: bool,
    run_has_deltas: bool,
) -> str | None:
    """Why snapshot ``version`` must not be used, or None when it may.

    ``snapshot_digest`` / ``delta_digest``: the ``weights_digest`` of the
    snapshot's manifest and of the committed delta manifest of the same
    version (None when absent); ``delta_committed``: whether that delta
    manifest exists; ``run_has_deltas``: whether the run holds any delta.
    """
    if version == 0:
        return None
    if snapshot_digest is None:
        return "its manifest carries no weights_digest"
    if not delta_committed:
        if not run_has_deltas:
            return None  # a snapshot-only run (transfer "full"): nothing to bind to
        return f"no committed delta {version} binds it"
    if delta_digest is None:
        return f"delta {version} carries no weights_digest (the writer never snapshotted this version)"
    if delta_digest != snapshot_digest:
        return f"its weights_digest {snapshot_digest[:19]}… differs from delta {version}'s {delta_digest[:19]}…"
    return None
