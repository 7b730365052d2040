"""Encoding an entry: the smallest combination of index encoding, value mode
and codec that the caller's :class:`EncodeOptions` allow (FORMAT.md §3: "a
writer chooses per entry, and should choose the smallest").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from aurora_store.codec import encodings as enc
from aurora_store.codec import v2
from aurora_store.codec.encode_options import EncodeOptions
from aurora_store.codec.encodings import DTYPES
from aurora_store.codec.entry_types import EncodedEntry, ParamSpec
from aurora_store.errors import ConfigError

__all__ = ["encode_entry"]

_T = TypeVar("_T")


def _ready(value: _T) -> Callable[[], _T]:
    """A maker for a value already computed (the offers' other makers compute theirs)."""
    return lambda: value


def _nbytes(payload: bytes | np.ndarray) -> int:
    return payload.nbytes if isinstance(payload, np.ndarray) else len(payload)


def _as_bytes(payload: bytes | np.ndarray) -> bytes:
    return payload.tobytes() if isinstance(payload, np.ndarray) else payload


def _dense_ranges(
    start: int,
    stop: int,
    indices: np.ndarray,
    new_bits: np.ndarray,
    xor_sparse: np.ndarray | None,
    read_new_range: Callable[[int, int], np.ndarray] | None,
    bits: Any,
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The dense form's value streams over ``[start, stop)``: every new value (when all changed, or
    ``read_new_range`` can read them) and the XOR with zeros where nothing changed (when XOR is allowed)."""
    span = stop - start
    new_range: np.ndarray | None = None
    if indices.size == span:
        new_range = new_bits
    elif read_new_range is not None:
        new_range = read_new_range(start, stop)
    xor_range: np.ndarray | None = None
    if xor_sparse is not None:
        xor_range = np.zeros(span, dtype=bits)
        xor_range[indices - start] = xor_sparse
    return new_range, xor_range


def encode_entry(
    param: str,
    spec: ParamSpec,
    start: int,
    stop: int,
    indices: np.ndarray,
    new_bits: np.ndarray,
    old_bits: np.ndarray | None,
    options: EncodeOptions,
    read_new_range: Callable[[int, int], np.ndarray] | None = None,
) -> EncodedEntry:
    """Encode the changes of ``[start, stop)``: the smallest allowed choice.

    ``indices`` are the sorted changed flat indices inside the range,
    ``new_bits``/``old_bits`` the new and old bit patterns at them.
    ``read_new_range`` returns the new bits of a whole range; without it a
    dense entry is only possible in ``xor`` mode or when every element changed.
    """
    if options.format >= 2 and ("rice" in options.index_choices or "planes" in options.codec_choices):
        return _encode_entry_v2(param, spec, start, stop, indices, new_bits, old_bits, options, read_new_range)
    info = DTYPES[spec.dtype]
    nnz = int(indices.size)
    span = stop - start
    allow_zstd = "zstd" in options.codec_choices
    allow_raw = "none" in options.codec_choices
    level = options.zstd_level
    can_xor = "xor" in options.value_modes and old_bits is not None
    can_new = "new" in options.value_modes

    best: EncodedEntry | None = None

    def consider(e: EncodedEntry) -> None:
        nonlocal best
        if best is None or e.nbytes < best.nbytes:
            best = e

    cctx = enc.zstd_compressor(level) if allow_zstd else None

    def zstd(raw: bytes | np.ndarray) -> bytes:
        return enc.zstd_compress(raw, level, cctx)

    def value_choices(new: np.ndarray, xor: np.ndarray | None) -> list[tuple[str, str, bytes | np.ndarray, str]]:
        # Streams stay numpy arrays (no copy) until one is chosen; zstd reads them in place.
        out: list[tuple[str, str, bytes | np.ndarray, str]] = []
        streams: list[tuple[str, np.ndarray, str]] = []
        le = info.bits.newbyteorder("<")
        if can_new:
            streams.append(("new", np.ascontiguousarray(new.astype(le, copy=False)), info.st_code))
        if xor is not None and can_xor:
            streams.append(("xor", np.ascontiguousarray(xor.astype(le, copy=False)), info.bits_code))
        for mode, raw, code in streams:
            if allow_raw:
                out.append((mode, "none", raw, code))
            if allow_zstd and raw.size:
                z = zstd(raw)
                if len(z) < raw.nbytes or not allow_raw:
                    out.append((mode, "zstd", z, "U8"))
        if not out and streams:  # zstd only allowed, and an empty stream
            mode, raw, code = streams[0]
            out.append((mode, "zstd", zstd(raw), "U8"))
        return out

    def consider_values(vals: list[tuple[str, str, bytes | np.ndarray, str]], ienc: str, icodec: str, ibytes: bytes | None) -> None:
        """The smallest of the value choices ``vals`` with these indices, as a candidate."""
        vmode, vcodec, payload, vdtype = min(vals, key=lambda t: _nbytes(t[2]))
        consider(EncodedEntry(param, spec, start, stop, nnz, ienc, vmode, icodec, vcodec, ibytes, _as_bytes(payload), vdtype))

    xor_sparse = (new_bits ^ old_bits) if old_bits is not None else None

    # Sparse: the smallest raw index stream, then (optionally) its zstd frame.
    sparse = [e for e in options.index_choices if e != "dense" and not (e == "u32" and stop > 1 << 32)]
    if sparse:
        # The leb128 stream costs as much to size as to write: write it once.
        raws: dict[str, bytes] = {}
        if "leb128" in sparse:
            raws["leb128"] = enc.encode_indices("leb128", indices, start, stop)
        sizes = {e: len(raws[e]) if e in raws else enc.indices_size(e, indices, start, stop) for e in sparse}
        first = min(sparse, key=lambda e: sizes[e])
        tries = [first]
        # zstd narrows bitmask more than leb128 at high density (from ~20% on
        # uniformly spread changes, where the raw bitmask is already no larger
        # than 1.5x the leb128 stream); below that it never wins, so skip it.
        if allow_zstd and "bitmask" in sparse and first != "bitmask" and sizes["bitmask"] <= 1.5 * sizes[first]:
            tries.append("bitmask")
        idx_options: list[tuple[str, str, bytes]] = []
        for e in tries:
            raw = raws[e] if e in raws else enc.encode_indices(e, indices, start, stop)
            if allow_raw:
                idx_options.append((e, "none", raw))
            if allow_zstd and raw:
                z = zstd(raw)
                if len(z) < len(raw) or not allow_raw:
                    idx_options.append((e, "zstd", z))
            elif not allow_raw:
                idx_options.append((e, "zstd", zstd(raw)))
        ienc, icodec, ibytes = min(idx_options, key=lambda t: len(t[2]))
        vals = value_choices(new_bits, xor_sparse)
        if vals:
            consider_values(vals, ienc, icodec, ibytes)

    # Dense: only worth a look when it could plausibly win (or is the only choice).
    if "dense" in options.index_choices:
        dense_raw = span * info.width
        if best is None or dense_raw <= 2 * best.nbytes:
            new_range, xor_range = _dense_ranges(start, stop, indices, new_bits, xor_sparse, read_new_range, info.bits)
            if new_range is None and not can_xor:
                pass
            else:
                vals = value_choices(new_range if new_range is not None else np.empty(0, info.bits), xor_range)
                vals = [v for v in vals if not (v[0] == "new" and new_range is None)]
                if vals:
                    consider_values(vals, "dense", "none", None)

    if best is None:
        raise ConfigError(
            f"{param} [{start}, {stop}): no allowed encoding can carry this entry "
            f"(options {options.index_choices}/{options.value_modes}/{options.codec_choices})"
        )
    return best


def _encode_entry_v2(
    param: str,
    spec: ParamSpec,
    start: int,
    stop: int,
    indices: np.ndarray,
    new_bits: np.ndarray,
    old_bits: np.ndarray | None,
    options: EncodeOptions,
    read_new_range: Callable[[int, int], np.ndarray] | None,
) -> EncodedEntry:
    """:func:`encode_entry` for format-2 options: the same choice, smallest
    first, with ``rice`` indices and ``planes`` values among the candidates.

    Sizes that are cheap to know exactly (raw streams, ``rice`` from one pass
    over the gaps, ``planes`` from byte histograms) are compared before
    anything is written, and only the winner is encoded; zstd is run only
    where it could win, so encoding stays a small part of extraction.
    """
    info = DTYPES[spec.dtype]
    width = info.width
    nnz = int(indices.size)
    span = stop - start
    codecs = options.codec_choices
    level = options.zstd_level
    allow_raw = "none" in codecs
    allow_zstd = "zstd" in codecs
    allow_planes = "planes" in codecs
    can_xor = "xor" in options.value_modes and old_bits is not None
    can_new = "new" in options.value_modes
    le = info.bits.newbyteorder("<")
    cctx = enc.zstd_compressor(level) if allow_zstd else None
    # planes may hold zstd planes whatever ``codecs`` says (they are part of the codec).
    pctx = cctx if cctx is not None else (enc.zstd_compressor(level) if allow_planes else None)

    def zstd(raw: bytes | np.ndarray) -> bytes:
        return enc.zstd_compress(raw, level, cctx)

    Choice = tuple[str, str, bytes, str]  # mode, codec, payload, dtype code

    def planes_maker(mode: str, a: np.ndarray, plan: Any) -> Callable[[], Choice]:
        def make() -> Choice:
            return mode, "planes", v2.encode_planes(a, width, level, plan, pctx), "U8"

        return make

    def raw_maker(mode: str, a: np.ndarray, code: str) -> Callable[[], Choice]:
        return lambda: (mode, "none", a.tobytes(), code)

    def value_choice(streams: list[tuple[str, np.ndarray, str]]) -> tuple[int, Callable[[], Choice]] | None:
        """(size, maker) of the smallest allowed value stream."""
        best: tuple[int, Callable[[], Choice]] | None = None

        def offer(size: int, make: Callable[[], Choice]) -> None:
            nonlocal best
            if best is None or size < best[0]:
                best = (size, make)

        for mode, arr, code in streams:
            a = np.ascontiguousarray(arr.astype(le, copy=False))
            if allow_raw:  # copied only if it wins (rarely: planes are no larger than raw plus 5 bytes a plane)
                offer(a.nbytes, raw_maker(mode, a, code))
            if allow_planes:
                # The entropy bound prunes a stream (``new``, usually) that
                # cannot win; for the second stream it is judged on a sample.
                if best is None:
                    bound, state = 0, v2.plane_state(a, width)
                else:
                    bound, state = v2.planes_lower_bound(a, width, sample=True)
                if best is None or bound < best[0]:
                    plan = v2.plan_planes(a, width, state)
                    offer(plan.nbytes, planes_maker(mode, a, plan))
            elif allow_zstd and a.size:
                z = zstd(a)
                offer(len(z), _ready((mode, "zstd", z, "U8")))
        return best

    def streams_of(new: np.ndarray | None, xor: np.ndarray | None) -> list[tuple[str, np.ndarray, str]]:
        # xor first: on a delta it is nearly always the smaller, and then
        # prunes ``new`` before its planes are planned.
        out: list[tuple[str, np.ndarray, str]] = []
        if can_xor and xor is not None:
            out.append(("xor", xor, info.bits_code))
        if can_new and new is not None:
            out.append(("new", new, info.st_code))
        return out

    xor_sparse = (new_bits ^ old_bits) if old_bits is not None else None
    best: EncodedEntry | None = None

    # Sparse: the smallest index stream, and the smallest value stream.
    sparse = [e for e in options.index_choices if e != "dense" and not (e == "u32" and stop > 1 << 32)]
    idx_best: tuple[int, Callable[[], tuple[str, str, bytes]]] | None = None

    def index_maker(e: str) -> Callable[[], tuple[str, str, bytes]]:
        def make() -> tuple[str, str, bytes]:
            return e, "none", enc.encode_indices(e, indices, start, stop)

        return make

    def offer_idx(size: int, make: Callable[[], tuple[str, str, bytes]]) -> None:
        nonlocal idx_best
        if idx_best is None or size < idx_best[0]:
            idx_best = (size, make)

    rice_size = None
    if "rice" in sparse:
        # Nearly always the smallest index stream: written at once, its size is exact.
        rice_stream = v2.encode_rice(indices, start)
        rice_size = len(rice_stream)
        offer_idx(rice_size, _ready(("rice", "none", rice_stream)))
    # LEB128 takes at least a byte a gap, and zstd takes about a tenth off
    # it on random changes: not worth writing when rice is already close to that.
    if "leb128" in sparse and (rice_size is None or rice_size > 1.1 * nnz):
        raw = enc.encode_indices("leb128", indices, start, stop)
        if allow_raw:
            offer_idx(len(raw), _ready(("leb128", "none", raw)))
        if allow_zstd and raw and (rice_size is None or 0.9 * len(raw) < rice_size):
            z = zstd(raw)
            offer_idx(len(z), _ready(("leb128", "zstd", z)))
    for e in ("bitmask", "u32", "u64"):
        if e not in sparse:
            continue
        size = enc.indices_size(e, indices, start, stop)
        if allow_raw:
            offer_idx(size, index_maker(e))
        if allow_zstd and size and (idx_best is None or size <= 1.5 * idx_best[0]):
            z = zstd(enc.encode_indices(e, indices, start, stop))
            offer_idx(len(z), _ready((e, "zstd", z)))
    if idx_best is not None:
        vals = value_choice(streams_of(new_bits, xor_sparse))
        if vals is not None:
            ienc, icodec, ibytes = idx_best[1]()
            vmode, vcodec, vbytes, vdtype = vals[1]()
            best = EncodedEntry(param, spec, start, stop, nnz, ienc, vmode, icodec, vcodec, ibytes, vbytes, vdtype)

    # Dense: only worth a look when it could plausibly win (or is the only choice).
    if "dense" in options.index_choices and (best is None or span * width <= 2 * best.nbytes):
        new_range, xor_range = _dense_ranges(start, stop, indices, new_bits, xor_sparse, read_new_range, info.bits)
        vals = value_choice(streams_of(new_range, xor_range))
        if vals is not None and (best is None or vals[0] < best.nbytes):
            vmode, vcodec, vbytes, vdtype = vals[1]()
            dense = EncodedEntry(param, spec, start, stop, nnz, "dense", vmode, "none", vcodec, None, vbytes, vdtype)
            if best is None or dense.nbytes < best.nbytes:
                best = dense

    if best is None:
        raise ConfigError(
            f"{param} [{start}, {stop}): no allowed encoding can carry this entry "
            f"(options {options.index_choices}/{options.value_modes}/{options.codec_choices})"
        )
    return best
