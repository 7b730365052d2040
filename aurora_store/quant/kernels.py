"""The block recomputation of FP8 block quantization: the compiled kernels, and the wrappers choosing a path.

Two loops do all the work of :mod:`aurora_store.quant.block`, and neither
vectorizes well in numpy (both are data-dependent):

- :func:`quantize_blocks`: for each listed 128 x 128 block, scan its largest
  magnitude and how many elements hold it, derive the scale and requantize
  every element. Over all blocks it is the from-scratch quantization; over a
  few it is what a changed scale or a shrunken largest element costs.
- :func:`requantize_changes`: for a sparse change of the bf16 weights (flat
  indices, the old and new bits there), requantize each changed element with
  its block's current scale, writing only the FP8 bytes that move, and keep
  each block's largest magnitude current; return the blocks whose scale
  changed or whose largest element shrank, which :func:`quantize_blocks`
  then redoes whole (overwriting what the first pass wrote there). One
  sequential pass over the change: the weights are not read at all, and the
  FP8 copy is written only where a byte changes. Nothing is written before
  the whole change has been checked (order, bounds, finite values).

Tensors are seen as ``(experts, rows, cols)`` (one expert for a 2-D weight),
flat and C-contiguous: element ``(e, r, c)`` is at ``(e * rows + r) * cols
+ c``; block ``(e, br, bc)`` is ``(e * nbr + br) * nbc + bc`` with ``nbr =
ceil(rows / 128)`` and ``nbc = ceil(cols / 128)``. The weights are their bf16
bit patterns (uint16), the FP8 copy its ``float8_e4m3fn`` bytes (uint8).
Per block: ``scale`` (float32, what checkpoints store as
``weight_scale_inv``), ``peak`` (the largest magnitude, as bf16 bits without
the sign: comparing them compares magnitudes) and ``ties`` (elements at
``peak``).

The float32 arithmetic is the recipe's exactly (see
:mod:`aurora_store.quant.recipe`): ``amax = max(f32(peak), f32(1e-4))``,
``scale = amax / 448``, ``inv = 1 / scale``, ``q = fp8(f32(x) * inv)``,
every operation rounded to float32 once. The float32 to ``float8_e4m3fn``
rounding (to nearest, ties to even) is done on the float32 bit pattern:
integer rounding of the mantissa for normal values, and for subnormals
(below 2**-6) a float32 addition of 2**14 that rounds at 2**-9, the same in
the kernels and in :func:`aurora_store.quant.twins.fp8_bits`. Compiled with
numba like the codec's kernels (:mod:`aurora_store.codec.kernels.jit`:
lazily, cached, serial; ``AURORA_NO_JIT`` picks the numpy twins of
:mod:`aurora_store.quant.twins`); the tests compare both paths bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from aurora_store.codec.kernels.jit import compiled, readonly, use_jit
from aurora_store.quant.twins import NONFINITE, all_blocks_numpy, blocks_numpy, changes_numpy

__all__ = ["NONFINITE", "quantize_blocks", "requantize_changes", "warm_up"]


#: Changes per chunk of :func:`_changes` (its scratch rows stay in L1).
_CHUNK = 256

# ---------------------------------------------------------------------------
# Kernel bodies (plain Python in numba's subset; compiled lazily)


def _blocks(bits: Any, rows: Any, cols: Any, blocks: Any, q: Any, scale: Any, peak: Any, ties: Any) -> Any:
    """Rescan and requantize each block of ``blocks`` whole; (scales changed, elements).

    A row of a block goes through small scratch rows, one simple loop per
    step so that each vectorizes: widened to float32 bits (``su``, read as
    floats through ``w``: numba has no scalar bit casts), multiplied
    (``sf``), its magnitude plus 2**14 (``tf``, the subnormal rounding),
    rounded to FP8 (``out``) and written. Positions are unsigned:
    numba checks every signed index for wrap-around, which costs more than
    the arithmetic here.
    """
    nbr = (rows + 127) // 128
    nbc = (cols + 127) // 128
    per = nbr * nbc
    su = np.empty(128, np.uint32)
    sf = np.empty(128, np.float32)
    tf = np.empty(128, np.float32)
    out = np.empty(128, np.uint8)
    w = su.view(np.float32)
    t = sf.view(np.uint32)
    tt = tf.view(np.uint32)
    floor, fmax, one, magic = np.float32(1e-4), np.float32(448.0), np.float32(1.0), np.float32(16384.0)
    u1, u16, u20, u24 = np.uint32(1), np.uint32(16), np.uint32(20), np.uint32(24)
    absmask, half, tiny = np.uint32(0x7FFFFFFF), np.uint32(0x80000), np.uint32(0x3C800000)
    rebias, magic_bits, sign = np.uint32(960), np.uint32(0x46800000), np.uint32(0x80)
    mag = np.uint16(0x7FFF)
    ucols = np.uint64(cols)
    rescaled = 0
    elements = 0
    for k in range(blocks.size):
        b = np.int64(blocks[k])
        e = b // per
        br = (b // nbc) % nbr
        bc = b % nbc
        r0 = br * 128
        nr = min(rows, r0 + 128) - r0
        c0 = bc * 128
        cw = min(cols, c0 + 128) - c0
        first = np.uint64((e * rows + r0) * cols + c0)
        top = np.uint16(0)
        for r in range(nr):
            o = first + np.uint64(r) * ucols
            for c in range(cw):
                top = max(top, bits[o + np.uint64(c)] & mag)
        n = 0
        for r in range(nr):
            o = first + np.uint64(r) * ucols
            for c in range(cw):
                n += (bits[o + np.uint64(c)] & mag) == top
        peak[b] = top
        ties[b] = n
        elements += nr * cw
        su[0] = np.uint32(top) << u16
        amax = w[0]
        if amax < floor:
            amax = floor
        s = amax / fmax
        if scale[b] != s:
            rescaled += 1
        scale[b] = s
        inv = one / s
        for r in range(nr):
            o = first + np.uint64(r) * ucols
            for c in range(cw):
                su[c] = np.uint32(bits[o + np.uint64(c)]) << u16
            for c in range(cw):
                sf[c] = w[c] * inv
            for c in range(cw):
                # Below 2**-6 an FP8 value is a multiple of 2**-9: adding 2**14 makes the
                # float32 sum round exactly there (to nearest even), the result in its low bits.
                tf[c] = abs(sf[c]) + magic
            for c in range(cw):
                u = t[c]
                a = u & absmask
                # Normal: the 23-bit mantissa rounded to 3 bits (nearest, ties to even), exponent rebiased 127 -> 7.
                v = ((a + half - u1 + ((a >> u20) & u1)) >> u20) - rebias
                sub = tt[c] - magic_bits
                v = sub if a < tiny else v
                out[c] = np.uint8(v | ((u >> u24) & sign))
            for c in range(cw):
                q[o + np.uint64(c)] = out[c]
    return rescaled, elements


def _changes(rows: Any, cols: Any, size: Any, idx: Any, old: Any, new: Any, q: Any, scale: Any, peak: Any, ties: Any, whole: Any) -> Any:
    """Requantize the changed elements with their blocks' current scales; find the blocks to redo whole.

    ``idx`` are the changed flat indices (strictly increasing, below ``size``),
    ``old``/``new`` the bf16 bits there before and after. A changed element's
    old FP8 byte is what the current scale gives its old value (the copy is
    current before the change), so it is computed, not read, and the copy is
    written only where the new byte differs.

    Only a change that reaches its block's ``peak`` (new magnitude at or above
    it) or leaves it (old magnitude equal to it) can change the block's
    largest magnitude: a few in a hundred at RL densities, so only those
    update the block's state (``hi``: the largest new magnitude among them,
    ``at_hi``: how many reach it; ``lost``, ``gained``: changes that left or
    reached ``peak``), in a branch that is rarely taken. Then, per block that
    saw one: a new largest magnitude raises ``peak`` (``ties`` = ``at_hi``:
    every other element is below it); else ``ties`` loses and gains, and a
    block left with none was shrunk and must be rescanned. A block whose
    scale changes, or that must be rescanned, goes to ``whole`` for
    :func:`_blocks` (which overwrites what this pass wrote there). Returns
    (blocks in ``whole``, blocks whose largest element shrank); or, with
    nothing written, (-1, -1) when a new value is not finite, (-2, -2) when
    an index is out of order or out of bounds.

    Changes go through in chunks: a scalar loop finds each one's block (from
    its row, which changes only every few indices: the divisions are paid
    per row) and widens both values to float32 bits; then simple loops, each
    of which vectorizes, scale and round them (bit casts are array views:
    numba has none for scalars), and the bytes that moved are written.
    """
    nbr = (rows + 127) // 128
    nbc = (cols + 127) // 128
    nblocks = scale.size
    floor, fmax, one, magic = np.float32(1e-4), np.float32(448.0), np.float32(1.0), np.float32(16384.0)
    u1, u16, u20, u24 = np.uint32(1), np.uint32(16), np.uint32(20), np.uint32(24)
    absmask, half, tiny = np.uint32(0x7FFFFFFF), np.uint32(0x80000), np.uint32(0x3C800000)
    rebias, magic_bits, sign = np.uint32(960), np.uint32(0x46800000), np.uint32(0x80)
    mag, inf = np.uint16(0x7FFF), np.uint16(0x7F80)
    nk = np.uint64(idx.size)
    # Checks first, nothing written if one fails; flags or-ed without branches, so the loops vectorize.
    if nk == 0:
        return 0, 0
    if np.int64(idx[0]) < 0 or np.int64(idx[nk - np.uint64(1)]) >= size:
        return -2, -2
    disorder = False
    for j in range(np.uint64(1), nk):
        disorder |= idx[j] <= idx[j - np.uint64(1)]
    if disorder:
        return -2, -2
    nonfinite = False
    for j in range(nk):
        nonfinite |= (new[j] & inf) == inf
    if nonfinite:
        return -1, -1
    inv = np.empty(nblocks, np.float32)
    for bb in range(nblocks):
        inv[bb] = one / scale[bb]
    wn = np.empty(_CHUNK, np.uint32)
    wo = np.empty(_CHUNK, np.uint32)
    fn, fo = wn.view(np.float32), wo.view(np.float32)
    pn = np.empty(_CHUNK, np.float32)
    po = np.empty(_CHUNK, np.float32)
    bn, bo = pn.view(np.uint32), po.view(np.uint32)
    tn = np.empty(_CHUNK, np.float32)
    to = np.empty(_CHUNK, np.float32)
    sn, so = tn.view(np.uint32), to.view(np.uint32)
    scl = np.empty(_CHUNK, np.float32)
    pos = np.empty(_CHUNK, np.uint64)
    qn = np.empty(_CHUNK, np.uint8)
    qo = np.empty(_CHUNK, np.uint8)
    hi = np.full(nblocks, -1, np.int64)
    at_hi = np.zeros(nblocks, np.int32)
    lost = np.zeros(nblocks, np.int32)
    gained = np.zeros(nblocks, np.int32)
    seen = np.empty(nblocks, np.int64)
    ns = 0
    ucols = np.uint64(cols)
    u7 = np.uint64(7)
    row_end = np.uint64(0)
    row_start = np.uint64(0)
    row_block = np.uint64(0)
    k0 = np.uint64(0)
    while k0 < nk:
        m = min(np.uint64(_CHUNK), nk - k0)
        for c in range(m):
            k = k0 + np.uint64(c)
            i = np.uint64(idx[k])
            if i >= row_end:
                fr = i // ucols
                e = np.int64(fr) // rows
                row_block = np.uint64((e * nbr + (np.int64(fr) - e * rows) // 128) * nbc)
                row_start = fr * ucols
                row_end = row_start + ucols
            b = row_block + ((i - row_start) >> u7)
            x = new[k]
            y = old[k]
            mn = x & mag
            p = peak[b]
            if mn >= p or (y & mag) == p:  # rare: the change reaches or leaves the block's peak
                h = hi[b]
                if h < 0:
                    seen[ns] = b
                    ns += 1
                if np.int64(mn) > h:
                    hi[b] = mn
                    at_hi[b] = 1
                elif np.int64(mn) == h:
                    at_hi[b] += 1
                if (y & mag) == p:
                    lost[b] += 1
                if mn == p:
                    gained[b] += 1
            pos[c] = i
            scl[c] = inv[b]
            wn[c] = np.uint32(x) << u16
            wo[c] = np.uint32(y) << u16
        for c in range(m):
            pn[c] = fn[c] * scl[c]
            po[c] = fo[c] * scl[c]
        for c in range(m):
            # Below 2**-6 an FP8 value is a multiple of 2**-9: adding 2**14 makes the
            # float32 sum round exactly there (to nearest even), the result in its low bits.
            tn[c] = abs(pn[c]) + magic
            to[c] = abs(po[c]) + magic
        for c in range(m):
            # Normal: the 23-bit mantissa rounded to 3 bits (nearest, ties to even), exponent rebiased 127 -> 7.
            u = bn[c]
            a = u & absmask
            v = ((a + half - u1 + ((a >> u20) & u1)) >> u20) - rebias
            sub = sn[c] - magic_bits
            v = sub if a < tiny else v
            qn[c] = np.uint8(v | ((u >> u24) & sign))
            u = bo[c]
            a = u & absmask
            v = ((a + half - u1 + ((a >> u20) & u1)) >> u20) - rebias
            sub = so[c] - magic_bits
            v = sub if a < tiny else v
            qo[c] = np.uint8(v | ((u >> u24) & sign))
        for c in range(m):
            if qn[c] != qo[c]:
                q[pos[c]] = qn[c]
        k0 += m
    w32 = np.empty(1, np.uint32)
    w32f = w32.view(np.float32)
    nw = 0
    shrunk = 0
    for t in range(ns):
        b = np.uint64(seen[t])
        p = np.int64(peak[b])
        left = ties[b] - lost[b] + gained[b]
        redo = False
        if hi[b] > p:
            w32[0] = np.uint32(hi[b]) << u16
            amax = w32f[0]
            if amax < floor:
                amax = floor
            if amax / fmax != scale[b]:
                redo = True
            else:  # under the 1e-4 floor: a new peak, the same scale
                peak[b] = hi[b]
                ties[b] = at_hi[b]
        elif left > 0:
            ties[b] = left
        else:
            redo = True
            shrunk += 1
        if redo:
            whole[nw] = b
            nw += 1
    return nw, shrunk


# ---------------------------------------------------------------------------
# Wrappers (shapes, dtypes and bounds are the caller's: aurora_store.quant.block checks them)


def quantize_blocks(
    bits: np.ndarray,
    rows: int,
    cols: int,
    blocks: np.ndarray | None,
    q: np.ndarray,
    scale: np.ndarray,
    peak: np.ndarray,
    ties: np.ndarray,
    jit: bool | None = None,
) -> tuple[int, int]:
    """Requantize ``blocks`` whole (all blocks when None); (scales changed, elements).

    Every array is flat and C-contiguous; ``q``, ``scale``, ``peak`` and
    ``ties`` are written in place. With ``blocks`` None on the numpy path the
    scales changed are not counted (0): a from-scratch quantization has
    nothing to compare with.
    """
    if use_jit(jit):
        if blocks is None:
            blocks = np.arange(scale.size, dtype=np.int64)
        rescaled, elements = compiled(_blocks)(readonly(bits), rows, cols, readonly(blocks), q, scale, peak, ties)
        return int(rescaled), int(elements)
    if blocks is None:
        all_blocks_numpy(bits, rows, cols, q, scale, peak, ties)
        return 0, int(bits.size)
    return blocks_numpy(bits, rows, cols, blocks, q, scale, peak, ties)


def requantize_changes(
    rows: int,
    cols: int,
    idx: np.ndarray,
    old: np.ndarray,
    new: np.ndarray,
    q: np.ndarray,
    scale: np.ndarray,
    peak: np.ndarray,
    ties: np.ndarray,
    jit: bool | None = None,
) -> tuple[np.ndarray, int] | int:
    """:func:`_changes` on the chosen path: (blocks to redo whole, blocks whose largest element shrank);
    or, nothing written, -1 when a new value is not finite, -2 when an index is out of order or out of
    bounds."""
    if use_jit(jit):
        whole = np.empty(scale.size, np.int64)
        nw, shrunk = compiled(_changes)(rows, cols, q.size, readonly(idx), readonly(old), readonly(new), q, scale, peak, ties, whole)
        if nw < 0:
            return int(nw)
        return whole[:nw], shrunk
    return changes_numpy(rows, cols, q.size, idx, old, new, q, scale, peak, ties)


def warm_up() -> None:
    """Compile (or load from numba's cache) both kernels for every index width, ahead of a timed section."""
    bits = np.arange(1, 300 * 130 + 1, dtype=np.uint16)
    q, scale = np.empty(bits.size, np.uint8), np.empty(6, np.float32)
    peak, ties = np.empty(6, np.uint16), np.empty(6, np.int32)
    quantize_blocks(bits, 300, 130, None, q, scale, peak, ties)
    for dt in (np.int32, np.int64):
        idx = np.array([5, 140, 38999], dt)
        requantize_changes(300, 130, idx, bits[idx], bits[idx] + np.uint16(1), q, scale, peak, ties)
