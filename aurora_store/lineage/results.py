"""Large results through the store: the Actor writes the object, the ledger carries a reference.

A result payload is JSON of a group's completions (docs/WORKERS.md,
"Payloads"). At real sizes (512 prompts x 16 samples x 8 k tokens) a step
is hundreds of MB; through the ledger all of it would cross one Redis node
in one hash slot. So a payload larger than the Actor's threshold
(``--result-inline-max-bytes``, :data:`DEFAULT_INLINE_MAX_BYTES`) is written
as an object under the run root, under the Actor's own prefix
``results/<actor id>/`` (:func:`result_key`), and what the ledger settles
is a small reference instead (:func:`reference_payload`)::

    {"result_ref": {"key": "results/<actor>/s<step>/<token>-<nonce>.json", "bytes": N, "sha256": "<hex>"}}

The settle script and its predicate see only bytes: nothing changes in the
ledger. The Trainer (``workers/trainer/results.py``) takes a reference only
for a key under the prefix of the Actor that settled it
(:func:`check_reference`), reads at most ``bytes`` bytes of it
(:func:`read_referenced`) and compares their sha256 with the reference's;
anything else is a bad payload. A reference settled for step ``b`` must
name a key under ``results/<actor>/s<b>/``: so the step in a key is the
only batch that may ever read it, which is what retention decides by.

Weight readers never look under ``results/`` (like ``eval/``). Retention
(:func:`aurora_store.lineage.gc.retain`, :func:`results_to_remove`) removes
what is left there past its grace, but never an object of a step the ledger
still holds (open, or closing): a batch open for longer than the grace, or
one a resumed Trainer reopens, still reads its results. Which steps those
are only the running system knows (:class:`OpenBatches`); without an answer
nothing is removed.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import urllib.parse
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from aurora_store.errors import AuroraError, ObjectNotFound
from aurora_store.storage import Store

__all__ = [
    "DEFAULT_INLINE_MAX_BYTES",
    "MAX_REFERENCE_BYTES",
    "RESULTS_PREFIX",
    "OpenBatches",
    "ResultRef",
    "ResultRefused",
    "ResultsSweep",
    "check_reference",
    "parse_reference",
    "read_referenced",
    "reference_payload",
    "result_key",
    "result_step",
    "results_prefix",
    "results_to_remove",
    "write_result",
]

RESULTS_PREFIX = "results/"
"""Where Actors write results too large for the ledger (one folder per Actor)."""

DEFAULT_INLINE_MAX_BYTES = 64 << 10
"""Results up to this many bytes go through the ledger as they are; larger ones through the store."""

MAX_REFERENCE_BYTES = 4096
"""A payload longer than this is never read as a reference (a reference is about 200 bytes)."""

_REF_FIELD = "result_ref"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_STEP_DIR = re.compile(r"s(\d{8})")


class ResultRefused(AuroraError, ValueError):
    """A referenced result that is not what its reference says (why: :attr:`reason`)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ResultRef:
    """Where a result lies in the store, its size and its sha256 (hex), as the ledger carries them."""

    key: str
    size: int
    sha256: str


def results_prefix(actor: str) -> str:
    """``results/<actor id>/``: the only folder an Actor writes (its id percent-encoded, so no id leaves it).

    Ids of letters, digits, ``-``, ``_`` and ``.`` appear as they are (what an
    IAM policy's ``${aws:PrincipalTag/aurora-actor-id}`` matches); ``/`` and
    the rest are escaped, and so are the ids ``.`` and ``..``.
    """
    name = urllib.parse.quote(actor, safe="-_")
    if name in (".", ".."):
        name = name.replace(".", "%2E")
    return f"{RESULTS_PREFIX}{name}/"


def result_key(actor: str, step: int, token: int, nonce: str | None = None) -> str:
    """A fresh key for one result of ``actor``: its step, its lease token and a random nonce.

    The nonce keeps keys apart when a step is issued again after Redis lost it
    (tokens start over) and makes them unguessable.
    """
    return f"{results_prefix(actor)}{_step_dir(step)}/{int(token)}-{nonce or secrets.token_hex(8)}.json"


def _step_dir(step: int) -> str:
    return f"s{int(step):08d}"


def result_step(key: str) -> int | None:
    """The step a key under ``results/`` was written for (``results/<actor>/s<step>/...``), None for any other name.

    Keys are named by Actors (untrusted): the name only tells which batch
    could read the object (:func:`check_reference` takes nothing else), never
    that one will.
    """
    parts = key.split("/")
    if len(parts) < 4 or parts[0] != RESULTS_PREFIX.rstrip("/"):
        return None
    m = _STEP_DIR.fullmatch(parts[2])
    return int(m.group(1)) if m else None


def reference_payload(key: str, data: bytes) -> bytes:
    """What the ledger settles for ``data`` written at ``key``."""
    ref = {"key": key, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return json.dumps({_REF_FIELD: ref}, sort_keys=True).encode()


def write_result(store: Store, actor: str, step: int, token: int, data: bytes) -> bytes:
    """Write ``data`` create-only under ``actor``'s prefix; returns the reference payload to settle.

    A repeat (the same call after a lost answer) writes the same key only if
    the caller passes the same nonce: this function draws a fresh one, so a
    retry writes a second object and the first is left to retention.
    """
    key = result_key(actor, step, token)
    store.put(key, data)
    return reference_payload(key, data)


def parse_reference(payload: bytes) -> ResultRef | None:
    """The reference ``payload`` carries; None when it is an inline result (or not JSON at all).

    Raises :class:`ResultRefused` (``malformed_ref``) for a payload that names
    a reference but not one :func:`reference_payload` writes.
    """
    if len(payload) > MAX_REFERENCE_BYTES or _REF_FIELD.encode() not in payload:
        return None
    try:
        body = json.loads(payload)
    except (ValueError, RecursionError):
        return None
    if not isinstance(body, dict) or _REF_FIELD not in body:
        return None
    ref = body[_REF_FIELD]
    if not isinstance(ref, dict):
        raise ResultRefused("malformed_ref", "the reference is not an object")
    key, size, digest = ref.get("key"), ref.get("bytes"), ref.get("sha256")
    if not isinstance(key, str) or not isinstance(digest, str) or not _HEX64.fullmatch(digest):
        raise ResultRefused("malformed_ref", "the reference lacks a key or a sha256")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ResultRefused("malformed_ref", "the reference's size is not a count of bytes")
    return ResultRef(key, size, digest)


def check_reference(ref: ResultRef, actor: str, max_bytes: int, step: int | None = None) -> None:
    """Refuse a reference outside ``actor``'s own prefix (with ``step``: outside its folder for that step),
    or larger than ``max_bytes``.

    Why: every Actor's credential can write Redis, and each Actor can write
    only its own folder; a reference to another Actor's folder (or anywhere
    else in the run root) would let one Actor have another's result, or the
    Trainer's own objects, read as its rollout. The step folder binds an
    object to the one batch that may read it, so retention can tell which
    objects an open batch still needs (:func:`results_to_remove`).
    """
    prefix = results_prefix(actor)
    rest = ref.key[len(prefix) :]
    if not ref.key.startswith(prefix) or not rest or any(part in ("", ".", "..") for part in rest.split("/")):
        raise ResultRefused("foreign_key", f"{ref.key[:120]!r} is not under {prefix!r}, the folder of the Actor that settled it")
    if step is not None and not (rest.startswith(_step_dir(step) + "/") and len(rest) > len(_step_dir(step)) + 1):
        raise ResultRefused("wrong_step", f"{ref.key[:120]!r} is not under {prefix + _step_dir(step)!r}, the folder of step {step}")
    if ref.size > max_bytes:
        raise ResultRefused("too_large", f"{ref.key[:120]!r} says {ref.size} bytes, more than the {max_bytes} a result may hold")


def read_referenced(store: Store, ref: ResultRef) -> bytes:
    """The bytes ``ref`` names: one range of at most ``ref.size`` bytes, checked against ``ref.sha256``.

    An object larger than its reference says is never read past that size
    (its first ``size`` bytes either hash right, and are the result, or not).
    Raises :class:`ResultRefused`: ``missing`` (no such object), ``short``
    (fewer bytes than the reference says) or ``hash_mismatch``. Transient
    store faults propagate, for the caller to ride out.
    """
    try:
        data = store.get_range(ref.key, 0, ref.size) if ref.size else b""
    except ObjectNotFound:
        raise ResultRefused("missing", f"{ref.key[:120]!r}: no such object") from None
    except ValueError:  # a key the store refuses to address (never one check_reference lets through)
        raise ResultRefused("malformed_ref", f"{ref.key[:120]!r} is not a key under the run root") from None
    if len(data) != ref.size:
        raise ResultRefused("short", f"{ref.key[:120]!r} holds {len(data)} bytes, the reference says {ref.size}")
    if hashlib.sha256(data).hexdigest() != ref.sha256:
        raise ResultRefused("hash_mismatch", f"{ref.key[:120]!r}: its sha256 differs from the reference's")
    return data


@runtime_checkable
class OpenBatches(Protocol):
    """Which steps the ledger still holds: their batches may still read their results.

    Why: an Actor's result object is read when its batch closes, which may be
    long after it was written (a batch waiting on slow Actors, a Trainer that
    died and resumes later, reopening the batches the ledger kept). Only the
    coordination layer knows which steps are open
    (:class:`aurora_store.coordination.retention.LedgerOpenBatches`). An answer
    may only make retention keep more: a step named open that is not costs
    its bytes until the next round.
    """

    def open_batches(self, steps: Collection[int]) -> frozenset[int]:
        """Those of ``steps`` the ledger still holds (open, or sealed and not yet dropped). Raises when it cannot tell."""
        ...


@dataclass(slots=True)
class ResultsSweep:
    """What retention does with the objects under ``results/``."""

    remove: list[str] = field(default_factory=list)
    """Older than the grace, of no step the ledger holds (or removed by force)."""
    young: int = 0
    """Younger than the grace: perhaps not settled yet."""
    open_batches: int = 0
    """Older than the grace, kept: a step the ledger holds may still read them."""
    unasked: int = 0
    """Older than the grace, kept: no ledger was asked which steps are open."""


def results_to_remove(
    keys: Iterable[str],
    age: Callable[[str], float | None],
    grace_s: float,
    batches: OpenBatches | None,
    force: bool = False,
) -> ResultsSweep:
    """Which of ``keys`` (under ``results/``) retention removes: those older than ``grace_s`` that no open batch may read.

    ``batches`` is asked once, about the steps of the old keys only, before
    anything is removed; its error propagates (Redis away: nothing is removed
    this round). None: nobody can tell, so every old key is kept (counted in
    ``unasked``). ``force`` removes every old key whatever the ledger says (an
    operator who knows the run is over). A key that names no step can be read
    by no batch (:func:`check_reference`) and goes once old.
    """
    out = ResultsSweep()
    old: list[tuple[str, int | None]] = []
    for key in keys:
        a = age(key)
        if a is None or a < grace_s:
            out.young += 1
        else:
            old.append((key, result_step(key)))
    if force:
        out.remove = [k for k, _ in old]
        return out
    steps = {s for _, s in old if s is not None}
    if batches is None:
        out.unasked = sum(s is not None for _, s in old)
        out.remove = [k for k, s in old if s is None]
        return out
    held = batches.open_batches(frozenset(steps)) if steps else frozenset()
    for key, s in old:
        if s is not None and s in held:
            out.open_batches += 1
        else:
            out.remove.append(key)
    return out
