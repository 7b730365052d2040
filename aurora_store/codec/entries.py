"""Entries: the sparse change of one flat-index range of one parameter.

Encoding picks, per entry, the smallest combination of index encoding, value
mode and codec that the caller allows (FORMAT.md §3: "a writer chooses per
entry, and should choose the smallest"). Decoding validates every field of
an untrusted entry and returns plain arrays ready to apply.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from aurora_store import config
from aurora_store.codec import encodings as enc
from aurora_store.codec import v2
from aurora_store.codec.encodings import DTYPES, StreamError
from aurora_store.errors import ConfigError

__all__ = [
    "EncodeOptions",
    "PAPER",
    "NAIVE",
    "AUTO_V2",
    "ParamSpec",
    "EncodedEntry",
    "DecodedEntry",
    "encode_entry",
    "decode_entry",
    "decoded_cost",
    "Claim",
]

_T = TypeVar("_T")


def _ready(value: _T) -> Callable[[], _T]:
    """A maker for a value already computed (the offers' other makers compute theirs)."""
    return lambda: value



@dataclass(frozen=True, slots=True)
class EncodeOptions:
    """What an encoder may choose from. The default allows everything."""

    index_encodings: tuple[str, ...] = ("leb128", "bitmask", "dense", "u32", "u64")
    """Index encodings the encoder may pick (``dense`` also covers all-changed ranges)."""
    value_modes: tuple[str, ...] = ("new", "xor")
    """``new`` is the paper's raw new values; ``xor`` needs the exact base."""
    codecs: tuple[str, ...] = ("none", "zstd")
    """``zstd`` costs CPU (about 200 MB/s per core); drop it on fast links."""
    zstd_level: int = 1
    """zstd compression level; 1 is the fast end."""

    def __post_init__(self) -> None:
        for name, allowed, given in (
            ("index encoding", enc.INDEX_ENCODINGS + v2.FORMAT2_INDEX_ENCODINGS, self.index_encodings),
            ("value mode", enc.VALUE_MODES, self.value_modes),
            ("codec", enc.CODECS + v2.FORMAT2_CODECS, self.codecs),
        ):
            if not given:
                raise ConfigError(f"EncodeOptions: at least one {name} is required")
            for g in given:
                if g not in allowed:
                    raise ConfigError(
                        f"EncodeOptions: unknown {name} {g!r} (allowed: {', '.join(allowed)})"
                    )
        if not 1 <= self.zstd_level <= 22:
            raise ConfigError(f"EncodeOptions: zstd_level must be 1..22, got {self.zstd_level}")

    @property
    def format(self) -> int:
        """The segment format these options write: 2 as soon as a format-2
        encoding (``rice``) or codec (``planes``) is allowed, else 1."""
        if any(e in v2.FORMAT2_INDEX_ENCODINGS for e in self.index_encodings) or any(
            c in v2.FORMAT2_CODECS for c in self.codecs
        ):
            return 2
        return 1

    @classmethod
    def from_env(cls, prefix: str = "AURORA_", environ: Mapping[str, str] | None = None) -> EncodeOptions:
        """Options from ``AURORA_INDEX_ENCODINGS``, ``AURORA_VALUE_MODES``,
        ``AURORA_CODECS`` (comma lists) and ``AURORA_ZSTD_LEVEL``, read by
        :func:`aurora_store.config.from_env`. An empty variable counts as unset."""
        env = os.environ if environ is None else environ
        given = {k: v for k, v in env.items() if k.startswith(prefix) and v != ""}
        return config.from_env(cls, prefix, given)


#: The paper's encoding: LEB128 gaps and raw new values, nothing else.
PAPER = EncodeOptions(index_encodings=("leb128",), value_modes=("new",), codecs=("none",))
#: The naive baseline: absolute 32/64-bit indices and raw new values.
NAIVE = EncodeOptions(index_encodings=("u32", "u64"), value_modes=("new",), codecs=("none",))
#: Everything format 1 allows and format 2's ``rice`` gaps and ``planes``
#: values, smallest per entry: segments written with it are format 2.
AUTO_V2 = EncodeOptions(
    index_encodings=enc.INDEX_ENCODINGS + v2.FORMAT2_INDEX_ENCODINGS,
    codecs=enc.CODECS + v2.FORMAT2_CODECS,
)


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """Shape and dtype of one parameter under its fused name."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class EncodedEntry:
    """One entry, encoded, ready to be placed in a segment."""

    param: str
    spec: ParamSpec
    start: int
    stop: int
    nnz: int
    encoding: str
    values: str
    idx_codec: str
    val_codec: str
    idx: bytes | None
    """Index stream (after its codec); ``None`` for dense."""
    val: bytes
    """Value stream (after its codec)."""
    val_dtype: str = field(default="")
    """safetensors dtype code of the value tensor."""

    @property
    def nbytes(self) -> int:
        return len(self.val) + (len(self.idx) if self.idx is not None else 0)

    def metadata(self, idx_name: str | None, val_name: str) -> dict[str, Any]:
        m: dict[str, Any] = {
            "param": self.param,
            "shape": list(self.spec.shape),
            "dtype": self.spec.dtype,
            "start": self.start,
            "stop": self.stop,
            "nnz": self.nnz,
            "encoding": self.encoding,
            "val": val_name,
        }
        if idx_name is not None:
            m["idx"] = idx_name
        if self.values != "new":
            m["values"] = self.values
        if self.idx_codec != "none":
            m["idx_codec"] = self.idx_codec
        if self.val_codec != "none":
            m["val_codec"] = self.val_codec
        return m


@dataclass(frozen=True, slots=True)
class DecodedEntry:
    """A validated entry: what to write where."""

    param: str
    spec: ParamSpec
    """The whole parameter's shape and dtype, as the entry declares them."""
    start: int
    stop: int
    nnz: int
    """Changed elements in the range, as the entry declares (checked where possible)."""
    indices: np.ndarray | None
    """Absolute flat indices (int64), or ``None`` for a dense range."""
    bits: np.ndarray
    """Raw bit patterns (uint16/uint32): new values, or XOR masks."""
    values: str
    """``new`` (overwrite) or ``xor``."""


def _nbytes(payload: bytes | np.ndarray) -> int:
    return payload.nbytes if isinstance(payload, np.ndarray) else len(payload)


def _as_bytes(payload: bytes | np.ndarray) -> bytes:
    return payload.tobytes() if isinstance(payload, np.ndarray) else payload


def _pick_stream(raw: bytes, allow_zstd: bool, level: int) -> tuple[str, bytes]:
    """The smaller of the raw stream and its zstd frame."""
    if allow_zstd and raw:
        z = enc.zstd_compress(raw, level)
        if len(z) < len(raw):
            return "zstd", z
    return "none", raw


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
    if options.format >= 2:
        return _encode_entry_v2(
            param, spec, start, stop, indices, new_bits, old_bits, options, read_new_range
        )
    info = DTYPES[spec.dtype]
    nnz = int(indices.size)
    span = stop - start
    allow_zstd = "zstd" in options.codecs
    allow_raw = "none" in options.codecs
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

    def value_choices(
        new: np.ndarray, xor: np.ndarray | None
    ) -> list[tuple[str, str, bytes | np.ndarray, str]]:
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

    def smallest_value(
        vals: list[tuple[str, str, bytes | np.ndarray, str]],
    ) -> tuple[str, str, bytes, str]:
        vmode, vcodec, payload, vdtype = min(vals, key=lambda t: _nbytes(t[2]))
        return vmode, vcodec, _as_bytes(payload), vdtype

    xor_sparse = (new_bits ^ old_bits) if old_bits is not None else None

    # Sparse: the smallest raw index stream, then (optionally) its zstd frame.
    sparse = [
        e for e in options.index_encodings if e != "dense" and not (e == "u32" and stop > 1 << 32)
    ]
    if sparse:
        # The leb128 stream costs as much to size as to write: write it once.
        raws: dict[str, bytes] = {}
        if "leb128" in sparse:
            raws["leb128"] = enc.encode_indices("leb128", indices, start, stop)
        sizes = {
            e: len(raws[e]) if e in raws else enc.indices_size(e, indices, start, stop)
            for e in sparse
        }
        first = min(sparse, key=lambda e: sizes[e])
        tries = [first]
        # zstd narrows bitmask more than leb128 at high density (from ~20% on
        # uniformly spread changes, where the raw bitmask is already no larger
        # than 1.5x the leb128 stream); below that it never wins, so skip it.
        if (
            allow_zstd
            and "bitmask" in sparse
            and first != "bitmask"
            and sizes["bitmask"] <= 1.5 * sizes[first]
        ):
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
            vmode, vcodec, vbytes, vdtype = smallest_value(vals)
            consider(
                EncodedEntry(
                    param,
                    spec,
                    start,
                    stop,
                    nnz,
                    ienc,
                    vmode,
                    icodec,
                    vcodec,
                    ibytes,
                    vbytes,
                    vdtype,
                )
            )

    # Dense: only worth a look when it could plausibly win (or is the only choice).
    if "dense" in options.index_encodings:
        dense_raw = span * info.width
        if best is None or dense_raw <= 2 * best.nbytes:
            new_range: np.ndarray | None = None
            if nnz == span:
                new_range = new_bits
            elif read_new_range is not None:
                new_range = read_new_range(start, stop)
            xor_range: np.ndarray | None = None
            if xor_sparse is not None:
                xor_range = np.zeros(span, dtype=info.bits)
                xor_range[indices - start] = xor_sparse
            if new_range is None and not can_xor:
                pass
            else:
                vals = value_choices(
                    new_range if new_range is not None else np.empty(0, info.bits), xor_range
                )
                vals = [v for v in vals if not (v[0] == "new" and new_range is None)]
                if vals:
                    vmode, vcodec, vbytes, vdtype = smallest_value(vals)
                    consider(
                        EncodedEntry(
                            param,
                            spec,
                            start,
                            stop,
                            nnz,
                            "dense",
                            vmode,
                            "none",
                            vcodec,
                            None,
                            vbytes,
                            vdtype,
                        )
                    )

    if best is None:
        raise ConfigError(
            f"{param} [{start}, {stop}): no allowed encoding can carry this entry "
            f"(options {options.index_encodings}/{options.value_modes}/{options.codecs})"
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
    codecs = options.codecs
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

    def value_choice(streams: list[tuple[str, np.ndarray, str]]) -> tuple[int, Callable[[], Choice]] | None:
        """(size, maker) of the smallest allowed value stream."""
        best: tuple[int, Callable[[], Choice]] | None = None

        def offer(size: int, make: Callable[[], Choice]) -> None:
            nonlocal best
            if best is None or size < best[0]:
                best = (size, make)

        for mode, arr, code in streams:
            a = np.ascontiguousarray(arr.astype(le, copy=False))
            if allow_raw:
                offer(a.nbytes, _ready((mode, "none", a.tobytes(), code)))
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
    sparse = [
        e for e in options.index_encodings if e != "dense" and not (e == "u32" and stop > 1 << 32)
    ]
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
            best = EncodedEntry(
                param, spec, start, stop, nnz, ienc, vmode, icodec, vcodec, ibytes, vbytes, vdtype
            )

    # Dense: only worth a look when it could plausibly win (or is the only choice).
    if "dense" in options.index_encodings and (best is None or span * width <= 2 * best.nbytes):
        new_range: np.ndarray | None = None
        if nnz == span:
            new_range = new_bits
        elif read_new_range is not None:
            new_range = read_new_range(start, stop)
        xor_range: np.ndarray | None = None
        if xor_sparse is not None:
            xor_range = np.zeros(span, dtype=info.bits)
            xor_range[indices - start] = xor_sparse
        vals = value_choice(streams_of(new_range, xor_range))
        if vals is not None and (best is None or vals[0] < best.nbytes):
            vmode, vcodec, vbytes, vdtype = vals[1]()
            dense = EncodedEntry(
                param, spec, start, stop, nnz, "dense", vmode, "none", vcodec, None, vbytes, vdtype
            )
            if best is None or dense.nbytes < best.nbytes:
                best = dense

    if best is None:
        raise ConfigError(
            f"{param} [{start}, {stop}): no allowed encoding can carry this entry "
            f"(options {options.index_encodings}/{options.value_modes}/{options.codecs})"
        )
    return best


# --------------------------------------------------------------------------
# Decoding untrusted entries

_INT_FIELDS = ("start", "stop", "nnz")
#: Flat indices are int64 on every path; no parameter may have more elements.
MAX_NUMEL = 1 << 63


def _field(meta: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in meta:
        raise StreamError(f"missing field {name!r}")
    v = meta[name]
    if not isinstance(v, kind) or isinstance(v, bool):
        raise StreamError(f"field {name!r} has type {type(v).__name__}")
    return v


#: ``claim(param, start, stop, nnz, cost)``: called once an entry's metadata is
#: valid and before any of its streams is decompressed; ``cost`` is the bytes
#: the decoded entry will hold (values, plus int64 indices unless dense). It
#: raises :class:`StreamError` to refuse the entry (an overlap, a budget spent).
Claim = Callable[[str, int, int, int, int], None]


def decoded_cost(spec: ParamSpec, encoding: str, start: int, stop: int, nnz: int) -> int:
    """Bytes a decoded entry holds: its values, and int64 indices unless dense."""
    width = DTYPES[spec.dtype].width
    if encoding == "dense":
        return (stop - start) * width
    return nnz * (width + 8)


def decode_entry(
    meta: Mapping[str, Any],
    tensor: Callable[[str], tuple[str, tuple[int, ...], memoryview]],
    model: Mapping[str, ParamSpec] | None,
    claim: Claim | None = None,
    fmt: int = 1,
) -> DecodedEntry:
    """Validate one entry's metadata and streams; raises :class:`StreamError`.

    ``tensor(name)`` returns (safetensors dtype code, shape, bytes) of a tensor
    of the segment, raising :class:`StreamError` if there is none. ``model``
    maps fused names to specs; when given, the entry must match it.
    ``claim`` (see :data:`Claim`) lets a caller bound a whole version: it
    sees the entry before a byte of it is decompressed. ``fmt`` is the
    segment's format: format 2's ``rice`` encoding and ``planes`` codec are
    refused in a format-1 segment.
    """
    if not isinstance(meta, Mapping):
        raise StreamError("entry is not a JSON object")
    param = _field(meta, "param", str)
    start, stop, nnz = (_field(meta, f, int) for f in _INT_FIELDS)
    raw_shape = _field(meta, "shape", list)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in raw_shape):
        raise StreamError(f"shape {raw_shape!r} is not a list of non-negative integers")
    dtype = _field(meta, "dtype", str)
    if dtype not in DTYPES:
        raise StreamError(f"unknown dtype {dtype!r}")
    spec = ParamSpec(tuple(raw_shape), dtype)
    if model is not None:
        have = model.get(param)
        if have is None:
            raise StreamError(f"the model has no parameter {param!r}")
        if have != spec:
            raise StreamError(
                f"parameter {param!r} is {list(spec.shape)} {spec.dtype} in the delta, "
                f"{list(have.shape)} {have.dtype} in the model"
            )
    numel = spec.numel
    if numel >= MAX_NUMEL:
        raise StreamError(f"shape {list(spec.shape)} has {numel} elements, more than 2^63 - 1")
    if not 0 <= start < stop <= numel:
        raise StreamError(f"range [{start}, {stop}) is not inside [0, {numel})")
    span = stop - start
    if not 0 <= nnz <= span:
        raise StreamError(f"nnz {nnz} impossible for a range of {span} elements")
    encoding = _field(meta, "encoding", str)
    if encoding in v2.FORMAT2_INDEX_ENCODINGS and fmt < 2:
        raise StreamError(f"encoding {encoding!r} needs a format-2 segment, this one is format {fmt}")
    if encoding not in enc.INDEX_ENCODINGS + v2.FORMAT2_INDEX_ENCODINGS:
        raise StreamError(f"unknown encoding {encoding!r}")
    values = meta.get("values", "new")
    if values not in enc.VALUE_MODES:
        raise StreamError(f"unknown values mode {values!r}")
    idx_codec = meta.get("idx_codec", "none")
    val_codec = meta.get("val_codec", "none")
    for name, c in (("idx_codec", idx_codec), ("val_codec", val_codec)):
        if name == "val_codec" and c in v2.FORMAT2_CODECS and fmt < 2:
            raise StreamError(f"val_codec {c!r} needs a format-2 segment, this one is format {fmt}")
        if c not in enc.CODECS + (v2.FORMAT2_CODECS if name == "val_codec" else ()):
            raise StreamError(f"unknown {name} {c!r}")
    if encoding == "rice" and idx_codec != "none":
        raise StreamError(f"idx_codec {idx_codec!r} with encoding 'rice' (only 'none' is allowed)")
    info = DTYPES[dtype]
    if claim is not None:
        claim(param, start, stop, nnz, decoded_cost(spec, encoding, start, stop, nnz))

    count = span if encoding == "dense" else nnz
    indices: np.ndarray | None = None
    if encoding != "dense":
        idx_name = _field(meta, "idx", str)
        code, shape, data = tensor(idx_name)
        if code != "U8" or len(shape) != 1:
            raise StreamError(
                f"index tensor {idx_name!r} must be a 1-D U8 tensor, is {code} {list(shape)}"
            )
        if encoding == "rice":
            indices = v2.decode_rice(data, start, stop, nnz)
        else:
            bound = enc.index_stream_bound(encoding, nnz, start, stop)
            if idx_codec == "zstd":
                exact = None if encoding == "leb128" else bound
                data = memoryview(enc.zstd_decompress(data, exact, bound))
            elif len(data) > bound:
                raise StreamError(f"index stream of {len(data)} bytes exceeds its bound {bound}")
            indices = enc.decode_indices(encoding, data, start, stop, nnz)

    val_name = _field(meta, "val", str)
    code, shape, data = tensor(val_name)
    width = info.width
    if val_codec == "planes":
        if code != "U8" or len(shape) != 1:
            raise StreamError(
                f"value tensor {val_name!r} with planes must be a 1-D U8 tensor, is {code} {list(shape)}"
            )
        bits = v2.decode_planes(data, count, width).astype(info.bits, copy=False)
    else:
        if val_codec == "zstd":
            if code != "U8" or len(shape) != 1:
                raise StreamError(
                    f"value tensor {val_name!r} with zstd must be a 1-D U8 tensor, is {code} {list(shape)}"
                )
            data = memoryview(enc.zstd_decompress(data, count * width, count * width))
        else:
            want = info.st_code if values == "new" else info.bits_code
            if code != want:
                raise StreamError(f"value tensor {val_name!r} has dtype {code}, expected {want}")
            if tuple(shape) != (count,):
                raise StreamError(
                    f"value tensor {val_name!r} has shape {list(shape)}, expected [{count}]"
                )
        if len(data) != count * width:
            raise StreamError(f"value stream holds {len(data)} bytes, expected {count * width}")
        bits = np.frombuffer(data, dtype=info.bits.newbyteorder("<")).astype(info.bits, copy=False)
    if indices is None and values == "xor":
        changed = int(np.count_nonzero(bits))
        if changed != nnz:
            raise StreamError(f"dense xor stream changes {changed} elements, nnz is {nnz}")
    return DecodedEntry(param, spec, start, stop, nnz, indices, bits, values)
