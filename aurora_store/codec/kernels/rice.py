"""Rice-coded index gaps (format 2, docs/FORMAT.md §3.1).

A stream of format 2's ``rice`` index encoding (FORMAT.md §3.1) is the
parameter byte ``k`` (0..56), the number ``E`` of escaped quotients
(uint32), those quotients (uint64 each), the remainder plane (``k`` bits a
gap) and the unary plane, bits least significant first. Gap ``g`` (the
first index minus ``start``, then each index minus the previous one minus
1, so every gap is ``>= 0``) is its quotient ``q = g >> k`` in unary (``q``
zero bits, then a one bit) and its ``k`` low bits in the remainder plane; a
quotient of :data:`RICE_ESCAPE` or more is written as :data:`RICE_ESCAPE`
zero bits and a one bit, the quotient itself going to the escape list. The
unary plane ends on the byte holding its last one bit; the pad bits after
it are zero.

- :func:`rice_encode_gaps`: the encoder (trusts its input: sorted, unique
  indices inside the range);
- :func:`rice_best_k` / :func:`rice_size`: the parameter that makes the
  stream smallest, and the stream's exact size, from the gaps alone;
- :func:`rice_indices`: the decoder, validating every rule (exactly ``nnz``
  gaps, every index inside ``[start, stop)``, no bits past the last gap but
  zero padding inside its byte); ``None`` on any violation, and the caller
  words the error.

The kernel bodies are plain Python in numba's subset: compiled where numba
is there, and run as they are (the same code, slowly) where it is not, so
both paths accept and refuse exactly the same streams.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from aurora_store.codec.kernels.jit import compiled, readonly, use_jit

__all__ = [
    "RICE_ESCAPE",
    "RICE_MAX_K",
    "rice_size",
    "rice_best_k",
    "rice_plan",
    "rice_choose_k",
    "rice_encode_gaps",
    "rice_indices",
]

#: Quotients from this value on are escaped (the gap follows in 64 bits).
RICE_ESCAPE = 32
#: Largest Rice parameter; a reader refuses a larger one.
RICE_MAX_K = 56

# Trailing-zero count of a power of two p < 2^32 (de Bruijn):
# _DEBRUIJN[((p * _DEBRUIJN_MUL) & 0xFFFFFFFF) >> 27]; the product stays below 2^59.
_DEBRUIJN_MUL = np.uint64(0x077CB531)
_DEBRUIJN = np.zeros(32, np.uint8)
for _i in range(32):
    _DEBRUIJN[(((1 << _i) * 0x077CB531) & 0xFFFFFFFF) >> 27] = _i
del _i


# ---------------------------------------------------------------------------
# Kernel bodies


def _rice_bits(indices: Any, start: Any, k0: Any, stride: Any, ubits: Any, nesc: Any) -> Any:
    """Unary bits and escapes for ``k = k0 .. k0 + ubits.size - 1`` into
    ``ubits`` and ``nesc`` (int64), over every ``stride``-th gap, in one pass."""
    esc = np.uint64(RICE_ESCAPE)
    nk = ubits.size
    for j in range(nk):
        ubits[j] = 0
        nesc[j] = 0
    for i in range(0, indices.size, stride):
        if i == 0:
            g = np.uint64(indices[0] - start)
        else:
            g = np.uint64(indices[i] - indices[i - 1] - np.int64(1))
        for j in range(nk):
            q = g >> np.uint64(k0 + j)
            if q < esc:
                ubits[j] += np.int64(q) + 1
            else:
                ubits[j] += RICE_ESCAPE + 1
                nesc[j] += 1
    return True


def _rice_bits5(indices: Any, start: Any, k0: Any, stride: Any, out: Any) -> Any:
    """:func:`_rice_bits` for ``k = k0 .. k0 + 3`` and ``k = 0`` at once, in
    registers: ``out[j]`` the unary bits and ``out[5 + j]`` the escapes of
    candidate ``j`` (``k = 0`` last)."""
    esc = np.uint64(RICE_ESCAPE)
    big = np.int64(RICE_ESCAPE + 1)
    ka, kb, kc, kd = np.uint64(k0), np.uint64(k0 + 1), np.uint64(k0 + 2), np.uint64(k0 + 3)
    ua = ub = uc = ud = uz = np.int64(0)
    ea = eb = ec = ed = ez = np.int64(0)
    for i in range(0, indices.size, stride):
        if i == 0:
            g = np.uint64(indices[0] - start)
        else:
            g = np.uint64(indices[i] - indices[i - 1] - np.int64(1))
        q = g >> ka
        if q < esc:
            ua += np.int64(q) + 1
        else:
            ua += big
            ea += 1
        q = g >> kb
        if q < esc:
            ub += np.int64(q) + 1
        else:
            ub += big
            eb += 1
        q = g >> kc
        if q < esc:
            uc += np.int64(q) + 1
        else:
            uc += big
            ec += 1
        q = g >> kd
        if q < esc:
            ud += np.int64(q) + 1
        else:
            ud += big
            ed += 1
        if g < esc:
            uz += np.int64(g) + 1
        else:
            uz += big
            ez += 1
    out[0], out[1], out[2], out[3], out[4] = ua, ub, uc, ud, uz
    out[5], out[6], out[7], out[8], out[9] = ea, eb, ec, ed, ez
    return True


def _rice_write(indices: Any, start: Any, k: Any, rem: Any, una: Any, escs: Any) -> Any:
    """Write the three parts: ``rem`` (k bits a gap, zeroed, 8 spare bytes),
    ``una`` (unary codes, zeroed, room for 33 bits a gap) and ``escs``
    (escaped quotients, room for one a gap); returns the escapes written and
    the unary bits (as ``escapes * 2^40 + bits``, one integer for both paths)."""
    esc = np.uint64(RICE_ESCAPE)
    kk = np.uint64(k)
    mask = (np.uint64(1) << kk) - np.uint64(1)
    u7, u3 = np.uint64(7), np.uint64(3)
    upos = np.uint64(0)
    e = 0
    prev = np.int64(start) - np.int64(1)
    for i in range(indices.size):
        g = np.uint64(indices[i] - prev - np.int64(1))
        prev = indices[i]
        q = g >> kk
        if kk:
            bit = np.uint64(i) * kk
            r = (g & mask) << (bit & u7)
            byte = bit >> u3
            for j in range(8):
                if r == np.uint64(0):
                    break
                rem[byte + np.uint64(j)] |= np.uint8(r & np.uint64(0xFF))
                r >>= np.uint64(8)
        if q < esc:
            upos += q
        else:
            upos += esc
            escs[e] = q
            e += 1
        una[upos >> u3] |= np.uint8(np.uint64(1) << (upos & u7))
        upos += np.uint64(1)
    return np.int64(e) * np.int64(1 << 40) + np.int64(upos)


def _rice_indices(rem: Any, una: Any, escs: Any, k: Any, start: Any, stop: Any, out: Any) -> Any:
    """The three parts (``rem`` with 8 zero bytes after it) -> absolute
    indices in ``out``; the number of escaped quotients used, or -1 on any
    violation: a unary plane that ends early or has bits after the last
    code, more escapes than given, a quotient too large for 63 bits, an
    index outside ``[start, stop)``. (The wrapper checks the remainder
    plane's pad bits.)

    ``0 <= start < stop < 2^63`` and every gap is checked against the span
    before it is added, so the running position (uint64) cannot wrap.
    """
    u0, u1, u3, u7, u8 = np.uint64(0), np.uint64(1), np.uint64(3), np.uint64(7), np.uint64(8)
    u32mask = np.uint64(0xFFFFFFFF)
    esc = np.uint64(RICE_ESCAPE)
    kk = np.uint64(k)
    mask = (u1 << kk) - u1
    qmax = np.uint64(1) << (np.uint64(63) - kk)
    span = np.uint64(stop - start)
    stop_u = np.uint64(stop)
    pos = np.uint64(start)
    inc = u0
    nnz = out.size
    nu = una.size
    i = 0
    e = 0
    prev = np.int64(-1)  # bit position of the previous terminating one
    base = np.int64(0)
    p = 0
    while p < nu:
        # 32 bits of the unary plane at a time (fewer at its end).
        w = np.uint64(0)
        for j in range(4):
            if p + j < nu:
                w |= np.uint64(una[p + j]) << (u8 * np.uint64(j))
        while w != u0:
            if i == nnz:
                return -1  # a one bit after the last code
            # Trailing zeros of w (below 2^32): isolate its lowest one bit,
            # de Bruijn lookup; the product stays below 2^59 on both paths.
            t = np.uint64(_DEBRUIJN[(((w & (~w + u1)) * _DEBRUIJN_MUL) & u32mask) >> np.uint64(27)])
            w &= w - u1
            one = base + np.int64(t)
            q = np.uint64(one - prev - 1)
            prev = one
            if q > esc:
                return -1  # a run of zeros longer than the escape
            if q == esc:
                if e == escs.size:
                    return -1
                q = escs[e]
                e += 1
                if q >= qmax:
                    return -1
            # The remainder at its fixed offset (8 bytes read; ``rem`` has 8 spare).
            bit = np.uint64(i) * kk
            byte = bit >> u3
            r = u0
            for j in range(8):
                r |= np.uint64(rem[byte + np.uint64(j)]) << (u8 * np.uint64(j))
            g = (q << kk) | ((r >> (bit & u7)) & mask)
            if g >= span:
                return -1
            pos += g + inc
            inc = u1
            if pos >= stop_u:
                return -1
            out[i] = np.int64(pos)
            i += 1
        p += 4
        base += 32
    if i != nnz:
        return -1
    # The plane ends on the byte of its last one bit (so nothing after it is set).
    if nu != (prev >> 3) + 1:
        return -1
    return e


# ---------------------------------------------------------------------------
# Wrappers


def _layouts(indices: np.ndarray, start: int, k0: int, nk: int, jit: bool | None, stride: int = 1) -> tuple[np.ndarray, np.ndarray]:
    ubits = np.zeros(nk, np.int64)
    nesc = np.zeros(nk, np.int64)
    if indices.size:
        fn = compiled(_rice_bits) if use_jit(jit) else _rice_bits
        fn(readonly(indices), np.int64(start), np.int64(k0), np.int64(stride), ubits, nesc)
    return ubits, nesc


#: Above this many gaps, the parameter is chosen on every 8th gap only.
_SAMPLE_ABOVE = 8192


def _size(n: int, k: int, ubits: int, nesc: int) -> int:
    """Bytes after the ``k`` byte: escape count, escapes, remainder plane, unary plane."""
    return 4 + 8 * nesc + (n * k + 7) // 8 + (ubits + 7) // 8


def rice_size(indices: np.ndarray, start: int, k: int, jit: bool | None = None) -> int:
    """Bytes of the stream (without the ``k`` byte) for sorted unique int64 ``indices``."""
    idx = np.ascontiguousarray(indices, dtype=np.int64)
    ubits, nesc = _layouts(idx, start, k, 1, jit)
    return _size(int(idx.size), k, int(ubits[0]), int(nesc[0]))


def rice_best_k(indices: np.ndarray, start: int, jit: bool | None = None) -> tuple[int, int]:
    """(k, stream bytes without the ``k`` byte) of the Rice code
    :func:`rice_choose_k` picks."""
    k, size, _ = rice_plan(indices, start, jit)
    return k, size


def rice_plan(indices: np.ndarray, start: int, jit: bool | None = None) -> tuple[int, int, tuple[int, int]]:
    """(k, stream bytes without the ``k`` byte, layout) of the smallest Rice
    code; ``layout`` lets :func:`rice_encode_gaps` skip a pass."""
    idx = np.ascontiguousarray(indices, dtype=np.int64)
    n = int(idx.size)
    if n == 0:
        return 0, 4, (0, 0)
    k = rice_choose_k(idx, start, jit)
    ubits, nesc = _layouts(idx, start, k, 1, jit)
    return k, _size(n, k, int(ubits[0]), int(nesc[0])), (int(ubits[0]), int(nesc[0]))


def rice_choose_k(indices: np.ndarray, start: int, jit: bool | None = None) -> int:
    """The Rice parameter with the fewest bits, among the four around the
    optimum for geometric gaps (``log2(mean * ln 2)``) and 0, judged on every 8th
    gap of a long stream (on all of a short one). The stream is exact with
    any ``k``; this only decides its size."""
    idx = np.ascontiguousarray(indices, dtype=np.int64)
    n = int(idx.size)
    if n == 0:
        return 0
    mean = (int(idx[-1]) - start - (n - 1)) / n
    guess = int(np.floor(np.log2(max(mean * 0.6931, 1.0))))
    k0 = min(max(0, guess - 1), RICE_MAX_K - 3)
    stride = 8 if n > _SAMPLE_ABOVE else 1
    m = len(range(0, n, stride))
    # The four around the guess, and k = 0: a few huge gaps (a jump to a dense run far along)
    # pull the mean, and so the guess, up; the dense run itself wants k = 0, its jumps escaped.
    c = np.zeros(10, np.int64)
    fn = compiled(_rice_bits5) if use_jit(jit) else _rice_bits5
    fn(readonly(idx), np.int64(start), np.int64(k0), np.int64(stride), c)
    sizes = {k0 + j: _size(m, k0 + j, int(c[j]), int(c[5 + j])) for j in range(4)}
    sizes[0] = _size(m, 0, int(c[4]), int(c[9]))
    return min(sizes, key=lambda k: (sizes[k], k))


def rice_encode_gaps(
    indices: np.ndarray,
    start: int,
    k: int | None = None,
    jit: bool | None = None,
    layout: tuple[int, int] | None = None,
) -> bytes:
    """The whole ``rice`` index stream of sorted unique ``indices`` at or
    after ``start``: the ``k`` byte, the escape count, the escaped quotients,
    the remainder plane, the unary plane; ``k`` by default the best."""
    idx = np.ascontiguousarray(indices, dtype=np.int64)
    if k is None:
        k = rice_choose_k(idx, start, jit)
    if not 0 <= k <= RICE_MAX_K:
        raise ValueError(f"rice parameter {k} outside 0..{RICE_MAX_K}")
    n = int(idx.size)
    if n == 0:
        return bytes([k, 0, 0, 0, 0])
    jitted = use_jit(jit)
    rem = np.zeros((n * k + 7) // 8 + 8, np.uint8)
    if layout is None:
        # Room for the worst case; np.zeros leaves untouched pages unallocated.
        una = np.zeros((n * (RICE_ESCAPE + 1) + 7) // 8, np.uint8)
        escs = np.zeros(n, np.uint64)
    else:
        una = np.zeros((layout[0] + 7) // 8, np.uint8)
        escs = np.zeros(layout[1], np.uint64)
    write = compiled(_rice_write) if jitted else _rice_write
    packed = int(write(readonly(idx), np.int64(start), np.int64(k), rem, una, escs))
    nesc, ubits = packed >> 40, packed & ((1 << 40) - 1)
    una = una[: (ubits + 7) // 8]
    escs = escs[:nesc]
    # join reads the arrays' buffers in place: one copy, into the result.
    return b"".join(
        [
            bytes([k]),
            int(nesc).to_bytes(4, "little"),
            escs.astype("<u8", copy=False).data,
            rem[: (n * k + 7) // 8].data,
            una.data,
        ]
    )


def rice_indices(data: np.ndarray, start: int, stop: int, nnz: int, jit: bool | None = None) -> np.ndarray | None:
    """Decode a whole ``rice`` stream into int64 indices; ``None`` if it
    breaks any rule. Needs ``0 <= start < stop < 2^63``."""
    if not (0 <= start < stop <= (1 << 63) - 1):
        raise ValueError(f"range [{start}, {stop}) is outside what the kernel handles")
    if data.size < 5 or nnz < 0:
        return None
    k = int(data[0])
    nesc = int.from_bytes(data[1:5].tobytes(), "little")
    if k > RICE_MAX_K or nesc > nnz:
        return None
    rem_len = (nnz * k + 7) // 8
    head = 5 + 8 * nesc
    if data.size < head + rem_len:
        return None
    una = data[head + rem_len :]
    if nnz == 0:
        return np.empty(0, np.int64) if data.size == 5 else None
    # Every unary code is at least one bit: a plane this short cannot hold them.
    if 8 * una.size < nnz:
        return None
    if (nnz * k) % 8 and int(data[head + rem_len - 1]) >> ((nnz * k) % 8):
        return None  # a pad bit of the remainder plane is set
    escs = np.frombuffer(data[5:head].tobytes(), dtype="<u8").astype(np.uint64)
    rem = np.zeros(rem_len + 8, np.uint8)
    rem[:rem_len] = data[head : head + rem_len]
    out = np.empty(nnz, np.int64)
    fn = compiled(_rice_indices) if use_jit(jit) else _rice_indices
    used = fn(
        readonly(rem),
        readonly(una),
        readonly(escs),
        np.int64(k),
        np.int64(start),
        np.int64(stop),
        out,
    )
    if used != nesc:
        return None
    return out
