"""Format 2's streams (docs/FORMAT.md §3.1).

Format 2 adds one index encoding and one value codec to format 1's, and
nothing else: decoded entries are the same plain arrays (absolute indices,
``new`` or ``xor`` bit patterns), so every applier takes them unchanged.

- ``rice`` (index encoding): gaps in a Rice code whose parameter ``k`` the
  writer picks per entry, its unary and fixed-width parts in separate planes
  (:mod:`aurora_store.codec.kernels.rice`). On RL-sparse changes the gaps are
  close to geometric, and a Rice code is within a fraction of a percent of
  their entropy (about 1.00 B per changed element at 1% density, where
  LEB128 takes 1.25 B and zstd over it 1.10 B).
- ``planes`` (value codec): the value stream (``new`` or ``xor``) split into
  its byte planes, byte ``j`` of every element in plane ``j``, each plane
  stored raw, as a constant, Huffman-coded
  (:mod:`aurora_store.codec.kernels.huffman`) or as a zstd frame, whichever
  is smallest. The low byte of a bf16 XOR stream is nearly dyadic (1, 3, 7,
  15, ...: a carry chain of one ulp), which Huffman codes within 1-2% of
  its entropy, while the high byte is nearly all zero, which zstd codes in
  almost nothing: together about 0.36 B per element against 0.54 B for zstd
  over the interleaved stream.

Encoders trust their input; decoders trust nothing and raise
:class:`StreamError`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import cast

import numpy as np
import zstandard

from aurora_store.codec import encodings as enc
from aurora_store.codec.kernels import huffman, rice
from aurora_store.errors import StreamError

__all__ = [
    "FORMAT2_INDEX_ENCODINGS",
    "FORMAT2_CODECS",
    "PLANE_RAW",
    "PLANE_CONST",
    "PLANE_HUFFMAN",
    "PLANE_ZSTD",
    "rice_stream_bound",
    "encode_rice",
    "decode_rice",
    "PlanesPlan",
    "planes_lower_bound",
    "plan_planes",
    "plane_state",
    "planes_estimate",
    "encode_planes",
    "decode_planes",
    "planes_bound",
]

FORMAT2_INDEX_ENCODINGS = ("rice",)
FORMAT2_CODECS = ("planes",)

#: Plane methods (the first byte of a plane record).
PLANE_RAW, PLANE_CONST, PLANE_HUFFMAN, PLANE_ZSTD = 0, 1, 2, 3
_RECORD = struct.Struct("<BI")  # method, payload length
#: zstd is tried on a plane only when its most frequent byte is at least this
#: share of it: below that Huffman wins (zstd's literals are Huffman-coded
#: too, and its matches do not pay on a near-random plane).
_ZSTD_SHARE = 0.6


# --------------------------------------------------------------------------
# rice


def rice_stream_bound(nnz: int) -> int:
    """Largest ``rice`` stream a reader accepts for ``nnz`` indices: every
    gap escaped (8 bytes), with the largest ``k`` and the longest unary code."""
    return 5 + 8 * nnz + (nnz * rice.RICE_MAX_K + 7) // 8 + (nnz * (rice.RICE_ESCAPE + 1) + 7) // 8


def encode_rice(indices: np.ndarray, start: int, k: int | None = None) -> bytes:
    """The ``rice`` stream of sorted unique ``indices`` in a range from
    ``start``, with parameter ``k`` (by default the one that makes it smallest)."""
    return rice.rice_encode_gaps(indices, start, k)


def decode_rice(data: bytes | memoryview, start: int, stop: int, nnz: int) -> np.ndarray:
    """Decode and fully validate a ``rice`` stream; int64 absolute indices."""
    if len(data) > rice_stream_bound(nnz):
        raise StreamError(f"rice index stream of {len(data)} bytes exceeds its bound {rice_stream_bound(nnz)}")
    if not 0 <= start < stop <= enc.MAX_INDEX:
        raise StreamError(f"range [{start}, {stop}) cannot be indexed")
    b = np.frombuffer(data, dtype=np.uint8)
    if b.size < 5:
        raise StreamError(f"rice index stream of {b.size} bytes is shorter than its 5-byte header")
    if int(b[0]) > rice.RICE_MAX_K:
        raise StreamError(f"rice parameter k = {int(b[0])} is above {rice.RICE_MAX_K}")
    out = rice.rice_indices(b, start, stop, nnz)
    if out is None:
        raise StreamError(
            f"rice index stream does not hold exactly {nnz} indices inside [{start}, {stop}) "
            "(truncated, extra or non-zero trailing bits, a bad escape count, or a gap that leaves the range)"
        )
    return out


# --------------------------------------------------------------------------
# planes


def _as_planes(bits: np.ndarray, width: int) -> np.ndarray:
    """(count, width) uint8 view: column ``j`` is byte plane ``j``."""
    le = np.ascontiguousarray(bits.astype(np.dtype(f"<u{width}"), copy=False))
    return le.view(np.uint8).reshape(-1, width)


@dataclass(frozen=True, slots=True)
class PlanesPlan:
    """How :func:`encode_planes` will write each plane, and its size bound."""

    methods: tuple[int, ...]
    sizes: tuple[int, ...]
    """Payload bytes per plane (for a zstd candidate: the Huffman size, an upper bound)."""
    hists: tuple[np.ndarray, ...]
    lengths: tuple[np.ndarray | None, ...]

    @property
    def nbytes(self) -> int:
        return sum(_RECORD.size + n for n in self.sizes)


def _plane_plan(count: int, hist: np.ndarray) -> tuple[int, int, np.ndarray | None]:
    """(method, payload bytes or bound, Huffman lengths) of a plane of ``count`` bytes."""
    top = int(hist.max())
    if top == count:
        return PLANE_CONST, 1, None
    lengths = huffman.huffman_lengths(hist)
    huff = huffman.table_bytes(lengths) + huffman.huffman_size(hist, lengths)
    if huff < count:
        # zstd is tried on a skewed plane, and kept only if smaller.
        return (PLANE_ZSTD if top >= _ZSTD_SHARE * count else PLANE_HUFFMAN), huff, lengths
    return PLANE_RAW, count, None


def _histograms(bits: np.ndarray, width: int) -> tuple[np.ndarray, list[np.ndarray]]:
    u = np.ascontiguousarray(bits.astype(np.dtype(f"<u{width}"), copy=False))
    h = huffman.byte_histograms(u)
    return u.view(np.uint8).reshape(-1, width), [h[j] for j in range(width)]


def planes_lower_bound(bits: np.ndarray, width: int, sample: bool = False) -> tuple[int, object]:
    """(about the smallest size the planes could take, state for :func:`plan_planes`):
    the order-0 entropy of each plane, from its histogram. A stream whose
    bound already loses to another candidate is not planned at all. With
    ``sample``, a long stream is judged on every 8th element (an estimate,
    not a bound, and no state)."""
    if bits.size == 0:
        return width * _RECORD.size, None
    if sample and bits.size > 4096:
        est, _ = planes_lower_bound(bits[::8], width)
        return 8 * est, None
    p, hists = _histograms(bits, width)
    total = 0
    for h in hists:
        nz = h[h > 0].astype(np.float64)
        n = float(nz.sum())
        ent = float(-(nz * np.log2(nz / n)).sum()) / 8 if nz.size > 1 else 0.0
        total += _RECORD.size + max(1, int(ent))
    return total, (p, hists)


def plan_planes(bits: np.ndarray, width: int, state: object = None) -> PlanesPlan:
    """Per-plane methods and sizes for ``bits``, from byte histograms alone."""
    if bits.size == 0:
        return PlanesPlan((PLANE_RAW,) * width, (0,) * width, (), ())
    if state is None:
        p, hists = _histograms(bits, width)
    else:
        p, hists = cast("tuple[np.ndarray, list[np.ndarray]]", state)
    methods, sizes, lengths = [], [], []
    for j in range(width):
        m, n, ln = _plane_plan(int(p.shape[0]), hists[j])
        methods.append(m)
        sizes.append(n)
        lengths.append(ln)
    return PlanesPlan(tuple(methods), tuple(sizes), tuple(hists), tuple(lengths))


def planes_estimate(bits: np.ndarray, width: int) -> int:
    """Bytes :func:`encode_planes` writes at most for ``bits``, from histograms alone."""
    return plan_planes(bits, width).nbytes


def plane_state(bits: np.ndarray, width: int) -> object:
    """The byte histograms :func:`plan_planes` needs, computed once."""
    return None if bits.size == 0 else _histograms(bits, width)


def encode_planes(
    bits: np.ndarray,
    width: int,
    level: int = 1,
    plan: PlanesPlan | None = None,
    compressor: zstandard.ZstdCompressor | None = None,
) -> bytes:
    """The ``planes`` value stream of ``bits`` (unsigned, ``width`` bytes each).

    ``compressor``: a :func:`~aurora_store.codec.encodings.zstd_compressor`
    at ``level`` to reuse (one is made when a plane needs it otherwise)."""
    if bits.size == 0:
        return _RECORD.pack(PLANE_RAW, 0) * width
    if plan is None:
        plan = plan_planes(bits, width)
    p = _as_planes(bits, width)
    out: list[bytes] = []
    for j in range(width):
        method, size = plan.methods[j], plan.sizes[j]
        if method == PLANE_CONST:
            payload = bytes([int(p[0, j])])
        elif method == PLANE_RAW:
            payload = np.ascontiguousarray(p[:, j]).tobytes()
        else:
            # The Huffman size is exact from the histogram: zstd (tried only
            # on a skewed plane) is kept when smaller, without coding both.
            z = enc.zstd_compress(np.ascontiguousarray(p[:, j]), level, compressor) if method == PLANE_ZSTD else None
            if z is not None and len(z) < size:
                payload = z
            else:
                method = PLANE_HUFFMAN
                payload = huffman.huffman_encode(p[:, j], plan.hists[j], plan.lengths[j])
        out.append(_RECORD.pack(method, len(payload)))
        out.append(payload)
    return b"".join(out)


def planes_bound(count: int, width: int) -> int:
    """Largest ``planes`` stream a reader accepts: every plane raw."""
    return width * (_RECORD.size + count)


def decode_planes(data: bytes | memoryview, count: int, width: int) -> np.ndarray:
    """Decode and validate a ``planes`` stream of ``count`` elements of
    ``width`` bytes; returns the little-endian unsigned values."""
    view = memoryview(data)
    if len(view) > planes_bound(count, width):
        raise StreamError(f"planes stream of {len(view)} bytes exceeds its bound {planes_bound(count, width)}")
    out = np.empty((count, width), np.uint8)
    pos = 0
    for j in range(width):
        if len(view) - pos < _RECORD.size:
            raise StreamError(f"planes stream ends before plane {j} of {width}")
        method, size = _RECORD.unpack_from(view, pos)
        pos += _RECORD.size
        if size > len(view) - pos:
            raise StreamError(f"plane {j} claims {size} bytes, {len(view) - pos} remain")
        payload = view[pos : pos + size]
        pos += size
        col = out[:, j]
        if method == PLANE_RAW:
            if size != count:
                raise StreamError(f"raw plane {j} is {size} bytes, expected {count}")
            col[:] = np.frombuffer(payload, np.uint8)
        elif method == PLANE_CONST:
            if size != 1:
                raise StreamError(f"constant plane {j} is {size} bytes, expected 1")
            col[:] = payload[0]
        elif method == PLANE_HUFFMAN:
            b = np.frombuffer(payload, np.uint8)
            if not huffman.huffman_decode_into(b, col):
                raise StreamError(
                    f"huffman plane {j} does not decode to exactly {count} bytes "
                    "(bad code lengths, a code the table lacks, truncated, or bits after the last code)"
                )
        elif method == PLANE_ZSTD:
            col[:] = np.frombuffer(enc.zstd_decompress(payload, count, count), np.uint8)
        else:
            raise StreamError(f"plane {j} has unknown method {method}")
    if pos != len(view):
        raise StreamError(f"planes stream has {len(view) - pos} bytes after its last plane")
    return out.reshape(-1).view(np.dtype(f"<u{width}"))
