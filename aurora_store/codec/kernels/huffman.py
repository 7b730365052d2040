"""Canonical Huffman coding of a byte plane (format 2's ``planes`` values).

A Huffman plane is a table of code lengths (32 bytes: a bitmap of the
symbols that occur, symbol ``s`` at bit ``s % 8`` of byte ``s // 8``; then
their lengths, 1 to :data:`HUFF_MAX_BITS`, in symbol order, two to a
byte, low nibble first, a last odd nibble padded with 0), then a bit stream, least
significant bit of each byte first. Codes are canonical (as in DEFLATE,
RFC 1951 §3.2.2: shorter codes first, then by symbol) and each code is
written from its first (most significant) bit on, so the stream reads bit
by bit from the front. The stream ends on the byte holding the last code's
last bit; the pad bits after it are zero.

- :func:`huffman_lengths`: code lengths for a byte histogram, limited to
  :data:`HUFF_MAX_BITS`;
- :func:`huffman_size`: the bit stream's size for a histogram and lengths;
- :func:`huffman_encode`: lengths table + bit stream;
- :func:`huffman_decode`: the decoder, validating the table (no symbol
  longer than the limit, no over-full code) and the stream (exactly
  ``count`` symbols, no code that the table lacks, no bits past the last
  code but zero padding in its byte); ``None`` on any violation.

The kernel bodies are plain Python in numba's subset: compiled where numba
is there, and run as they are (slowly, the same code) where it is not.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from aurora_store.codec.kernels.jit import compiled, readonly, use_jit

__all__ = [
    "HUFF_MAX_BITS",
    "HUFF_BITMAP_BYTES",
    "table_bytes",
    "byte_histograms",
    "huffman_lengths",
    "huffman_size",
    "huffman_encode",
    "huffman_decode",
    "huffman_decode_into",
]

#: Longest code; the decoder's lookup table has 2^HUFF_MAX_BITS entries.
HUFF_MAX_BITS = 12
#: Bytes of the symbol bitmap at the head of a Huffman plane's table.
HUFF_BITMAP_BYTES = 32


def table_bytes(lengths: np.ndarray) -> int:
    """Bytes of the code-length table for these lengths."""
    return HUFF_BITMAP_BYTES + (int(np.count_nonzero(lengths)) + 1) // 2


def _pack_table(lengths: np.ndarray) -> bytes:
    used = lengths > 0
    bitmap = np.packbits(used, bitorder="little")
    nib = lengths[used].astype(np.uint8)
    if nib.size % 2:
        nib = np.append(nib, np.uint8(0))
    return bitmap.tobytes() + (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8).tobytes()


def _unpack_table(data: np.ndarray) -> tuple[np.ndarray, int] | None:
    """(lengths[256], table bytes) from the head of a plane; ``None`` if it is
    truncated, names a length of 0 or above the limit, or pads with non-zero."""
    if data.size < HUFF_BITMAP_BYTES:
        return None
    used = np.unpackbits(data[:HUFF_BITMAP_BYTES], bitorder="little").astype(bool)
    n = int(used.sum())
    size = HUFF_BITMAP_BYTES + (n + 1) // 2
    if data.size < size:
        return None
    packed = data[HUFF_BITMAP_BYTES:size]
    nib = np.empty(2 * packed.size, np.uint8)
    nib[0::2] = packed & 0x0F
    nib[1::2] = packed >> 4
    if n % 2 and nib[-1] != 0:
        return None
    got = nib[:n]
    if n and (int(got.min()) == 0 or int(got.max()) > HUFF_MAX_BITS):
        return None
    lengths = np.zeros(256, np.uint8)
    lengths[used] = got
    return lengths, size


def _byte_hist(values: Any, width: Any, out: Any) -> Any:
    """``out[j, b]``: how many of the unsigned ``values`` have byte ``j`` equal to ``b``."""
    if width == 2:
        for i in range(values.size):
            v = values[i]
            out[0, v & 0xFF] += 1
            out[1, v >> 8] += 1
        return True
    for i in range(values.size):
        v = np.uint64(values[i])
        for j in range(width):
            out[j, (v >> np.uint64(8 * j)) & np.uint64(0xFF)] += 1
    return True


def byte_histograms(values: np.ndarray, jit: bool | None = None) -> np.ndarray:
    """(width, 256) int64 counts of each byte plane of unsigned ``values``, in one pass."""
    v = np.ascontiguousarray(values).reshape(-1)
    width = v.dtype.itemsize
    out = np.zeros((width, 256), np.int64)
    if v.size == 0:
        return out
    if use_jit(jit):
        compiled(_byte_hist)(readonly(v), np.int64(width), out)
    else:
        planes = v.astype(v.dtype.newbyteorder("<"), copy=False).view(np.uint8).reshape(-1, width)
        for j in range(width):
            out[j] = np.bincount(planes[:, j], minlength=256)
    return out


def _lengths(counts: Any, lengths: Any) -> Any:
    """Huffman code lengths for 256 byte ``counts`` into ``lengths`` (zeroed),
    limited to :data:`HUFF_MAX_BITS`: the two-queue method over the counts
    in stable ascending order (merged nodes are made in non-decreasing order
    of weight, so two queues replace a heap); a tree too deep is rebuilt
    from flattened counts (halved, each kept at least 1)."""
    used = np.empty(256, np.int64)
    n = 0
    for s in range(256):
        if counts[s] > 0:
            used[n] = s
            n += 1
    if n == 0:
        return True
    if n == 1:
        lengths[used[0]] = 1
        return True
    c = np.empty(n, np.int64)
    for i in range(n):
        c[i] = counts[used[i]]
    weight = np.zeros(2 * n - 1, np.int64)
    parent = np.zeros(2 * n - 1, np.int64)
    level = np.zeros(2 * n - 1, np.int64)
    while True:
        order = np.argsort(c, kind="mergesort")
        for i in range(n):
            weight[i] = c[order[i]]
        leaf = 0  # next unmerged leaf
        node = n  # next unmerged internal node
        for made in range(n, 2 * n - 1):
            if leaf < n and (node >= made or weight[leaf] <= weight[node]):
                a = leaf
                leaf += 1
            else:
                a = node
                node += 1
            if leaf < n and (node >= made or weight[leaf] <= weight[node]):
                b = leaf
                leaf += 1
            else:
                b = node
                node += 1
            weight[made] = weight[a] + weight[b]
            parent[a] = made
            parent[b] = made
        level[2 * n - 2] = 0
        deepest = 0
        for v in range(2 * n - 3, -1, -1):  # the root (2n - 2) is at level 0
            level[v] = level[parent[v]] + 1
            if v < n and level[v] > deepest:
                deepest = level[v]
        if deepest <= HUFF_MAX_BITS:
            for i in range(n):
                lengths[used[order[i]]] = level[i]
            return True
        for i in range(n):
            c[i] = max(1, c[i] >> 1)


def huffman_lengths(hist: np.ndarray, jit: bool | None = None) -> np.ndarray:
    """Code lengths (uint8[256]) for a histogram of 256 byte counts.

    A lone symbol gets length 1. Lengths over :data:`HUFF_MAX_BITS` are
    avoided by flattening the counts (halving, keeping each at least 1) and
    building again: a small loss, only on very skewed planes.
    """
    counts = np.ascontiguousarray(hist, dtype=np.int64)
    lengths = np.zeros(256, np.uint8)
    fn = compiled(_lengths) if use_jit(jit) else _lengths
    fn(readonly(counts), lengths)
    return lengths


def huffman_size(hist: np.ndarray, lengths: np.ndarray) -> int:
    """Bytes of the bit stream (without the table) for these counts and lengths."""
    bits = int(np.dot(hist.astype(np.int64), lengths.astype(np.int64)))
    return (bits + 7) // 8


def _canonical(lengths: Any, codes: Any) -> Any:
    """Canonical codes for ``lengths`` into ``codes`` (bit-reversed, so that
    the first code bit is the least significant); False if over-full."""
    bl_count = np.zeros(HUFF_MAX_BITS + 1, np.int64)
    for s in range(256):
        bl_count[lengths[s]] += 1
    bl_count[0] = 0
    # Kraft: an over-full set of lengths is no prefix code.
    room = np.int64(1)
    for n in range(1, HUFF_MAX_BITS + 1):
        room = 2 * room - bl_count[n]
        if room < 0:
            return False
    next_code = np.zeros(HUFF_MAX_BITS + 2, np.int64)
    code = np.int64(0)
    for n in range(1, HUFF_MAX_BITS + 1):
        code = (code + bl_count[n - 1]) << 1
        next_code[n] = code
    for s in range(256):
        ln = lengths[s]
        if ln:
            c = next_code[ln]
            next_code[ln] += 1
            r = np.int64(0)
            for _ in range(ln):
                r = (r << 1) | (c & 1)
                c >>= 1
            codes[s] = r
    return True


def _huff_write(data: Any, lengths: Any, codes: Any, out: Any) -> Any:
    """Bit stream of ``data`` (uint8) into ``out``; returns the bytes written
    (-1 if a symbol has no code)."""
    u0, u8, u32 = np.uint64(0), np.uint64(8), np.uint64(32)
    acc = u0
    nb = u0
    p = 0
    for i in range(data.size):
        s = data[i]
        n = np.uint64(lengths[s])
        if n == u0:
            return -1
        acc |= np.uint64(codes[s]) << nb
        nb += n
        if nb >= u32:  # four bytes at once (codes are at most 12 bits: nb < 44)
            out[p] = np.uint8(acc & np.uint64(0xFF))
            out[p + 1] = np.uint8((acc >> u8) & np.uint64(0xFF))
            out[p + 2] = np.uint8((acc >> np.uint64(16)) & np.uint64(0xFF))
            out[p + 3] = np.uint8((acc >> np.uint64(24)) & np.uint64(0xFF))
            p += 4
            acc >>= u32
            nb -= u32
    while nb >= u8:
        out[p] = np.uint8(acc & np.uint64(0xFF))
        p += 1
        acc >>= u8
        nb -= u8
    if nb:
        out[p] = np.uint8(acc & np.uint64(0xFF))
        p += 1
    return p


def _huff_decode(b: Any, lengths: Any, codes: Any, out: Any) -> Any:
    """Decode ``out.size`` symbols of bit stream ``b`` with a valid code
    (``codes`` from :func:`_canonical`); False on any violation.

    Two lookup tables over the next :data:`HUFF_MAX_BITS` bits: ``one``
    gives the first symbol and its length, ``two`` also the second symbol
    when both codes fit in those bits (short codes, the common case, decode
    two at a time). Near the end, where the bits left are fewer than a
    table's entry consumes, symbols decode one at a time.
    """
    size = 1 << HUFF_MAX_BITS
    # one: symbol | length << 8 (length 0: a code the table lacks).
    one = np.zeros(size, np.int32)
    for s in range(256):
        sl = lengths[s]
        if sl:
            step = 1 << np.int64(sl)
            for j in range(codes[s], size, step):
                one[j] = np.int32(s) | (np.int32(sl) << 8)
    # two: first | second << 8 | total length << 16 | symbols << 24.
    two = np.zeros(size, np.int32)
    for j in range(size):
        e1 = one[j]
        l1 = e1 >> 8
        if l1 == 0:
            continue
        e2 = one[j >> l1]
        l2 = e2 >> 8
        if l2 != 0 and l1 + l2 <= HUFF_MAX_BITS:
            two[j] = (e1 & 0xFF) | ((e2 & 0xFF) << 8) | ((l1 + l2) << 16) | (2 << 24)
        else:
            two[j] = (e1 & 0xFF) | (l1 << 16) | (1 << 24)
    u0, u8, u24, u56 = np.uint64(0), np.uint64(8), np.uint64(24), np.uint64(56)
    top = np.uint64(size - 1)
    n = b.size
    count = out.size
    acc = u0
    nb = u0
    p = 0
    i = 0
    while i + 1 < count:
        if nb < u24:
            while nb <= u56 and p < n:
                acc |= np.uint64(b[p]) << nb
                p += 1
                nb += u8
        e = two[acc & top]
        tl = np.uint64((e >> 16) & 0xFF)
        if tl == u0:
            return False
        if tl > nb:
            break  # the last bits: one symbol at a time below
        out[i] = np.uint8(e & 0xFF)
        out[i + 1] = np.uint8((e >> 8) & 0xFF)
        i += e >> 24
        acc >>= tl
        nb -= tl
    while i < count:
        if nb < np.uint64(HUFF_MAX_BITS):
            while nb <= u56 and p < n:
                acc |= np.uint64(b[p]) << nb
                p += 1
                nb += u8
        e = one[acc & top]
        ln = np.uint64(e >> 8)
        if ln == u0 or ln > nb:
            return False
        out[i] = np.uint8(e & 0xFF)
        acc >>= ln
        nb -= ln
        i += 1
    return p == n and nb < u8 and acc == u0


def huffman_encode(
    data: np.ndarray,
    hist: np.ndarray | None = None,
    lengths: np.ndarray | None = None,
    jit: bool | None = None,
) -> bytes:
    """A whole Huffman plane for uint8 ``data``: lengths table, then the bits
    (``hist`` and ``lengths``, when given, are those of ``data``)."""
    d = data if data.dtype == np.uint8 and data.ndim == 1 else np.ascontiguousarray(data, dtype=np.uint8)
    if hist is None:
        hist = np.bincount(d, minlength=256)
    if lengths is None:
        lengths = huffman_lengths(hist)
    size = huffman_size(hist, lengths)
    out = np.zeros(size + 16, np.uint8)
    codes = np.zeros(256, np.int64)
    if not (compiled(_canonical) if use_jit(jit) else _canonical)(readonly(lengths), codes):
        raise AssertionError("huffman_lengths built an over-full code")
    fn = compiled(_huff_write) if use_jit(jit) else _huff_write
    written = int(fn(readonly(d), readonly(lengths), readonly(codes), out))
    if written != size:
        raise AssertionError(f"huffman writer produced {written} bytes, expected {size}")
    return _pack_table(lengths) + out[:size].tobytes()


def huffman_decode_into(data: np.ndarray, out: np.ndarray, jit: bool | None = None) -> bool:
    """Decode a whole Huffman plane into uint8 ``out`` (``out.size`` symbols;
    a strided view, such as one byte plane of wider elements, is fine).
    False, with ``out`` partly written, if the plane is invalid."""
    parsed = _unpack_table(data)
    if parsed is None:
        return False
    lengths, head = parsed
    body = data[head:]
    count = int(out.size)
    if count == 0:
        return body.size == 0
    if 8 * body.size < count:  # every code is at least one bit
        return False
    codes = np.zeros(256, np.int64)
    if not (compiled(_canonical) if use_jit(jit) else _canonical)(readonly(lengths), codes):
        return False
    fn = compiled(_huff_decode) if use_jit(jit) else _huff_decode
    return bool(fn(readonly(body), readonly(lengths), readonly(codes), out))


def huffman_decode(data: np.ndarray, count: int, jit: bool | None = None) -> np.ndarray | None:
    """Decode a whole Huffman plane of ``count`` symbols; ``None`` if invalid."""
    if count < 0:
        return None
    out = np.empty(count, np.uint8)
    return out if huffman_decode_into(data, out, jit) else None
