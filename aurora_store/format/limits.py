"""Hard bounds on what an untrusted version may make a reader allocate.

Each entry of a segment is bounded on its own (FORMAT.md §3: a zstd frame
cannot produce more than its entry declares), but a version is many
entries: a small segment could hold hundreds of tiny frames for one large
parameter, each decoding to its full size. The bounds here hold for a whole
version, and are enforced as entries arrive, before their streams are
decompressed:

- :class:`VersionGuard` sees every entry of one version (all its segments,
  decoded in parallel threads): it refuses an entry whose range overlaps one
  already seen for the same parameter, an entry past the version's entry
  count limit, and an entry whose decoded size would take the version past
  its decode budget (:func:`version_budget`).
- :func:`load_json` parses untrusted JSON (manifests, segment headers) with
  integers of at most :data:`MAX_JSON_INT_DIGITS` digits: Python refuses to
  convert more than 4,300 digits with a bare ``ValueError``, and no field of
  the format needs more than 20.
- The size limits (:data:`MAX_MANIFEST_BYTES`, :data:`MAX_HEADER_BYTES`,
  :data:`MAX_ENTRIES_PER_SEGMENT`) are checked by the readers that use them
  before they parse anything.

Every refusal is a typed :class:`~aurora_store.errors.FormatError`
(``ManifestError``, ``SegmentError``, ``EntryError``): callers that treat a
format error as "this version is bad" (the Actor falls back to origin or
quarantines it, the Relay skips it) need no new case. docs/FORMAT.md
("Reader limits") lists the numbers.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from typing import Any

from sortedcontainers import SortedList

from aurora_store.codec.encodings import DTYPES
from aurora_store.codec.entries import ParamSpec
from aurora_store.errors import AuroraError, StreamError

__all__ = [
    "MAX_MANIFEST_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_JSON_INT_DIGITS",
    "MAX_ENTRIES_PER_SEGMENT",
    "MAX_ENTRIES_PER_VERSION",
    "BUDGET_FACTOR",
    "BUDGET_SLACK_BYTES",
    "INDEX_BYTES",
    "load_json",
    "version_budget",
    "VersionGuard",
]

#: A manifest lists one version: a few hundred bytes per segment and per
#: changed parameter. 16 MiB holds about 100,000 of each.
MAX_MANIFEST_BYTES = 16 << 20
#: A segment's safetensors header (the JSON after the 8-byte length). Our
#: writer cuts a segment before its header could reach half of this.
MAX_HEADER_BYTES = 16 << 20
#: Digits (sign aside) of a JSON integer: 2^64 has 20, no field needs more.
MAX_JSON_INT_DIGITS = 20
#: Entries in one segment (our writer cuts a segment before it has this many).
MAX_ENTRIES_PER_SEGMENT = 1 << 17
#: Entries in one version, over all its segments.
MAX_ENTRIES_PER_VERSION = 1 << 20
#: The decode budget allows this many times the dense bytes of the parameters a version touches …
BUDGET_FACTOR = 2
#: … plus this much, for tiny models and metadata.
BUDGET_SLACK_BYTES = 16 << 20
#: Decoded indices are int64: each changed element of a sparse entry costs this much besides
#: its value (:func:`aurora_store.codec.entries.decoded_cost`).
INDEX_BYTES = 8


class _IntTooLong(Exception):
    """Raised inside the JSON parser; :func:`load_json` words it for its caller."""

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _bounded_int(s: str) -> int:
    if len(s) - (s[:1] == "-") > MAX_JSON_INT_DIGITS:
        raise _IntTooLong(len(s) - (s[:1] == "-"))
    return int(s)


def load_json(data: bytes | str, fail: Callable[[str], AuroraError]) -> Any:
    """Parse untrusted UTF-8 JSON; any problem raises ``fail(reason)``.

    Each reason starts with "not valid …", so a caller can word it as
    ``f"header is {reason}"``.

    Integers longer than :data:`MAX_JSON_INT_DIGITS` digits are refused
    while parsing (before Python's own 4,300-digit limit would raise a bare
    ``ValueError``); bad UTF-8, bad JSON and deep nesting are refused too.
    Size limits are the caller's: it knows what the bytes are.
    """
    try:
        text = data.decode("utf-8") if isinstance(data, bytes | bytearray) else data
        return json.loads(text, parse_int=_bounded_int)
    except _IntTooLong as e:
        raise fail(f"not valid JSON here: an integer of {e.digits} digits (the reader's limit is {MAX_JSON_INT_DIGITS})") from None
    except RecursionError:
        raise fail("not valid JSON here: nested too deeply") from None
    except ValueError as e:  # bad UTF-8 (UnicodeDecodeError) or bad JSON
        raise fail(f"not valid UTF-8 JSON: {e}") from None


def version_budget(params: Mapping[str, Mapping[str, Any]], model: Mapping[str, ParamSpec] | None) -> int:
    """Decode budget of a delta whose manifest lists ``params`` (name -> {shape, dtype, nnz}).

    ``BUDGET_FACTOR`` x the dense bytes of the parameters it touches, plus
    ``INDEX_BYTES`` per changed element it declares (at most the
    parameter's size), plus ``BUDGET_SLACK_BYTES``. Shapes come from the
    model where it has the parameter (the manifest is untrusted), else from
    the manifest. A valid delta never needs more than the dense bytes plus
    the indices: entries of one parameter do not overlap, and the segments
    carry exactly the declared ``nnz``. A parameter the manifest does not
    list gets nothing: its entries can only spend the slack.
    """
    total = BUDGET_SLACK_BYTES
    for name, p in params.items():
        spec = model.get(name) if model is not None else None
        if spec is None:
            try:
                spec = ParamSpec(tuple(p["shape"]), p["dtype"])
            except (KeyError, TypeError):
                continue
        info = DTYPES.get(spec.dtype)
        if info is None:
            continue
        numel = spec.numel
        nnz = p.get("nnz", numel)
        nnz = min(nnz, numel) if isinstance(nnz, int) and nnz >= 0 else numel
        total += BUDGET_FACTOR * numel * info.width + INDEX_BYTES * nnz
    return total


class VersionGuard:
    """Every entry of one version, checked as it arrives (thread-safe).

    ``budget``: bytes the version's decoded entries may hold in all
    (:func:`version_budget`); ``None`` for no byte budget (overlaps and the
    entry count are still checked). One guard serves one decode of one
    version; make a fresh one for each.
    """

    def __init__(self, budget: int | None, max_entries: int = MAX_ENTRIES_PER_VERSION) -> None:
        self.budget = budget
        self.max_entries = max_entries
        self.decoded_bytes = 0
        """Bytes granted so far: what the entries decoded (or being decoded) hold."""
        self.entries = 0
        self.nnz: dict[str, int] = {}
        """Changed elements granted per parameter."""
        self._lock = threading.Lock()
        # Per parameter: (start, stop, where, entry) of the ranges granted, sorted by start.
        self._ranges: dict[str, SortedList] = {}

    @classmethod
    def for_manifest(cls, params: Mapping[str, Mapping[str, Any]], model: Mapping[str, ParamSpec] | None) -> VersionGuard:
        """The guard of a delta whose manifest lists ``params``: :func:`version_budget`."""
        return cls(version_budget(params, model))

    @classmethod
    def for_model(cls, model: Mapping[str, ParamSpec] | None) -> VersionGuard:
        """The guard of a delta decoded without its manifest: the budget of one touching
        every parameter of ``model`` (no byte budget without a model)."""
        if model is None:
            return cls(None)
        return cls(version_budget({n: {"shape": list(s.shape), "dtype": s.dtype} for n, s in model.items()}, model))

    def claim(self, where: str, entry: int, param: str, start: int, stop: int, nnz: int, cost: int) -> None:
        """Grant entry ``entry`` of segment ``where`` its range and bytes, or raise :class:`StreamError`.

        Called after the entry's metadata is validated and before any of
        its streams is decompressed; ranges are ``0 <= start < stop``.
        """
        with self._lock:
            if self.entries >= self.max_entries:
                raise StreamError(f"the version has more than {self.max_entries} entries")
            if self.budget is not None and self.decoded_bytes + cost > self.budget:
                raise StreamError(
                    f"decoding it would take the version to {self.decoded_bytes + cost} decoded bytes, "
                    f"past its budget of {self.budget} (FORMAT.md reader limits)"
                )
            ranges = self._ranges.get(param)
            if ranges is None:
                ranges = self._ranges[param] = SortedList()
            i = ranges.bisect_left((start,))
            # The ranges granted are disjoint and sorted by start: only the
            # neighbours of the insertion point can overlap [start, stop).
            for j in (i - 1, i):
                if 0 <= j < len(ranges):
                    a, b, w, k = ranges[j]
                    if a < stop and start < b:
                        raise StreamError(f"range [{start}, {stop}) overlaps [{a}, {b}) of {w} entry {k}")
            ranges.add((start, stop, where, entry))
            self.entries += 1
            self.decoded_bytes += cost
            self.nnz[param] = self.nnz.get(param, 0) + nnz
