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
  changed: those whose largest element shrank, which :func:`quantize_blocks`
  rescans, and those whose largest element grew (the new one is among the
  changes), which it only requantizes; either way it overwrites what the
  first pass wrote there. One sequential pass over the change: the weights
  are not read at all, and the FP8 copy is written only where a byte
  changes. Nothing is written before the whole change has been checked
  (order, bounds, finite values).

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
rounding (to nearest, ties to even) is done on the float32 bit pattern, in
one scalar helper both kernels call (:func:`_fp8`; numba inlines it and the
loops around it still vectorize): integer rounding of the mantissa for
normal values, and for subnormals (below 2**-6) a float32 addition of 2**14
that rounds at 2**-9, as :func:`aurora_store.quant.twins.fp8_bits` does over
arrays. Compiled with numba like the codec's kernels
(:mod:`aurora_store.codec.kernels.jit`: lazily, cached, serial;
``AURORA_NO_JIT`` picks the numpy twins of :mod:`aurora_store.quant.twins`);
the tests compare both paths bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from aurora_store.codec.kernels.jit import compiled, helper, readonly, use_jit
from aurora_store.codec.kernels.prefetch import prefetch_read, prefetch_write
from aurora_store.quant.twins import NONFINITE, all_blocks_numpy, blocks_numpy, changes_numpy

__all__ = ["NONFINITE", "quantize_blocks", "requantize_changes", "warm_up"]


#: Changes per chunk of :func:`_changes` (its scratch rows stay in L1).
_CHUNK = 512
#: Rows :func:`_blocks` asks for ahead of the one it reads: the listed blocks lie apart in memory and
#: each row of one is a 256-byte piece the hardware prefetchers do not see coming. Six rows hide
#: DRAM's latency here (the 1 B workload's whole-block pass: 9.8 ms without, 5.2 ms with).
_AHEAD = 6

# ---------------------------------------------------------------------------
# Kernel bodies (plain Python in numba's subset; compiled lazily)


@helper
def _widen(h: Any) -> Any:
    """The float32 value of bf16 bits ``h`` (uint16)."""
    return np.uint32(np.uint32(h) << np.uint32(16)).view(np.float32)


@helper
def _fp8(f: Any) -> Any:
    """The ``float8_e4m3fn`` byte of float32 ``f`` (finite, magnitude below 464), rounded to nearest even.

    Normal results: the 23-bit mantissa rounded to 3 bits (ties to even: add
    half less one plus the lowest kept bit), the exponent rebiased from 127
    to 7. Below 2**-6 an FP8 value is a multiple of 2**-9: adding 2**14 to
    the magnitude makes the float32 sum round exactly there (to nearest
    even), the result in its low bits.
    """
    u = np.float32(f).view(np.uint32)
    # Every intermediate narrowed back to 32 bits: numba computes integer operations at 64 bits, and
    # without the truncations LLVM keeps 64-bit lanes, half as many per vector (the pass at 1.45x the time).
    a = np.uint32(u & np.uint32(0x7FFFFFFF))
    r = np.uint32(a + np.uint32(0x7FFFF) + np.uint32((a >> np.uint32(20)) & np.uint32(1)))
    v = np.uint32(np.uint32(r >> np.uint32(20)) - np.uint32(960))
    sub = np.uint32(np.float32(abs(f) + np.float32(16384.0)).view(np.uint32) - np.uint32(0x46800000))
    sign = np.uint32(np.uint32(u >> np.uint32(24)) & np.uint32(0x80))
    return np.uint8(np.uint32(sub if a < np.uint32(0x3C800000) else v) | sign)


@helper
def _scale(top: Any) -> Any:
    """The block scale of largest magnitude ``top`` (bf16 bits without the sign): ``max(amax, 1e-4) / 448``."""
    amax = _widen(top)
    if amax < np.float32(1e-4):
        amax = np.float32(1e-4)
    return np.float32(amax / np.float32(448.0))


@helper
def _fetch_ahead(bits: Any, q: Any, blocks: Any, k: Any, r: Any, rows: Any, cols: Any, nbr: Any, nbc: Any) -> None:
    """Prefetch the row :data:`_AHEAD` rows after row ``r`` of the ``k``-th listed block (in the next
    listed block past its last row): its bf16 bits to read, its FP8 bytes to write."""
    b = np.int64(blocks[k])
    r0 = (b // nbc) % nbr * 128
    t = r + _AHEAD
    nr = min(rows, r0 + 128) - r0
    if t >= nr:
        if k + 1 >= blocks.size:
            return
        t -= nr
        b = np.int64(blocks[k + 1])
        r0 = (b // nbc) % nbr * 128
    at = ((b // (nbr * nbc)) * rows + r0 + t) * cols + b % nbc * 128
    for c in range(0, 128, 32):  # 64-byte lines: 32 bf16 elements, 64 FP8 bytes
        prefetch_read(bits, at + c)
    prefetch_write(q, at)
    prefetch_write(q, at + 64)


def _blocks(bits: Any, rows: Any, cols: Any, blocks: Any, q: Any, scale: Any, peak: Any, ties: Any, scan: Any) -> Any:
    """Requantize each block of ``blocks`` whole; (scales changed, elements).

    With ``scan`` each block is rescanned first for its largest magnitude and
    how many elements hold it; without, ``peak`` is already right (a block
    whose largest element grew: :func:`_changes` knows the new one and its
    ties) and only the requantization pass reads the block. Each loop is
    simple so that it vectorizes; positions are unsigned: numba checks every
    signed index for wrap-around, which costs more than the arithmetic here.
    """
    nbr = (rows + 127) // 128
    nbc = (cols + 127) // 128
    per = nbr * nbc
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
        if scan:
            top = np.uint16(0)
            for r in range(nr):
                _fetch_ahead(bits, q, blocks, k, r, rows, cols, nbr, nbc)
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
        s = _scale(peak[b])
        if scale[b] != s:
            rescaled += 1
        scale[b] = s
        inv = np.float32(np.float32(1.0) / s)
        for r in range(nr):
            if not scan:  # else the scan above brought the block in
                _fetch_ahead(bits, q, blocks, k, r, rows, cols, nbr, nbc)
            o = first + np.uint64(r) * ucols
            for c in range(cw):
                q[o + np.uint64(c)] = _fp8(np.float32(_widen(bits[o + np.uint64(c)]) * inv))
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
    reached ``peak``). Then, per block that saw one: a new largest magnitude
    raises ``peak`` (``ties`` = ``at_hi``: every other element is below it);
    else ``ties`` loses and gains, and a block left with none was shrunk and
    must be rescanned. A block whose scale changes goes to ``whole`` for
    :func:`_blocks` (which overwrites what this pass wrote there): from the
    front when it must be rescanned, from the back when its largest element
    grew (``peak`` and ``ties`` already set, no rescan). Returns (blocks to
    rescan: their largest element shrank, blocks to requantize with their new
    peak); or, with nothing written, (-1, 0) when a new value is not finite,
    (-2, 0) when an index is out of order or out of bounds.

    Changes go through in chunks: a scalar loop finds each change's block
    (from its row, which changes only every few indices: the divisions are
    paid per row) and gathers the block's scale and peak; a straight one (it
    vectorizes) requantizes the old and new values and flags the changes
    whose byte moved or that reach or leave their block's peak; the last
    writes the moved bytes and updates the blocks of the flagged ones.
    """
    nbr = (rows + 127) // 128
    nbc = (cols + 127) // 128
    nblocks = scale.size
    mag, inf = np.uint16(0x7FFF), np.uint16(0x7F80)
    one, two = np.uint8(1), np.uint8(2)
    nk = np.uint64(idx.size)
    # Checks first, nothing written if one fails; flags or-ed without branches, so the loops vectorize.
    if nk == 0:
        return 0, 0
    if np.int64(idx[0]) < 0 or np.int64(idx[nk - np.uint64(1)]) >= size:
        return -2, 0
    disorder = False
    for j in range(np.uint64(1), nk):
        disorder |= idx[j] <= idx[j - np.uint64(1)]
    if disorder:
        return -2, 0
    nonfinite = False
    for j in range(nk):
        nonfinite |= (new[j] & inf) == inf
    if nonfinite:
        return -1, 0
    inv = np.empty(nblocks, np.float32)
    for bb in range(nblocks):
        inv[bb] = np.float32(1.0) / scale[bb]
    blk = np.empty(_CHUNK, np.uint32)
    scl = np.empty(_CHUNK, np.float32)
    pk = np.empty(_CHUNK, np.uint16)
    qq = np.empty(_CHUNK, np.uint8)
    hot = np.empty(_CHUNK, np.uint8)
    sel = np.empty(_CHUNK, np.uint32)
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
            i = np.uint64(idx[k0 + np.uint64(c)])
            if i >= row_end:
                fr = i // ucols
                e = np.int64(fr) // rows
                row_block = np.uint64((e * nbr + (np.int64(fr) - e * rows) // 128) * nbc)
                row_start = fr * ucols
                row_end = row_start + ucols
            b = row_block + ((i - row_start) >> u7)
            blk[c] = np.uint32(b)
            scl[c] = inv[b]
            pk[c] = peak[b]
        for c in range(m):
            k = k0 + np.uint64(c)
            x = new[k]
            y = old[k]
            p = pk[c]
            qn = _fp8(np.float32(_widen(x) * scl[c]))
            qo = _fp8(np.float32(_widen(y) * scl[c]))
            qq[c] = qn
            hot[c] = np.uint8(((x & mag) >= p) | ((y & mag) == p)) * two | np.uint8(qn != qo)
        # The flagged changes (about one in six) listed without a branch, then visited: a branch per
        # change on a flag set at random would be mispredicted about as often as it is taken.
        nh = 0
        for c in range(m):
            sel[nh] = c
            nh += hot[c] != 0
        for j in range(nh):
            cf = np.uint64(sel[j])
            t = hot[cf]
            k = k0 + cf
            if t & one:
                q[idx[k]] = qq[cf]
            if t & two:  # rare: the change reaches or leaves the block's peak
                b = np.uint64(blk[cf])
                mn = new[k] & mag
                p = peak[b]
                h = hi[b]
                if h < 0:
                    seen[ns] = b
                    ns += 1
                if np.int64(mn) > h:
                    hi[b] = mn
                    at_hi[b] = 1
                elif np.int64(mn) == h:
                    at_hi[b] += 1
                if (old[k] & mag) == p:
                    lost[b] += 1
                if mn == p:
                    gained[b] += 1
        k0 += m
    rescan = 0
    grown = 0
    for t in range(ns):
        b = np.uint64(seen[t])
        p = np.int64(peak[b])
        left = ties[b] - lost[b] + gained[b]
        if hi[b] > p:
            # Every unchanged element is at most the old peak: the new peak and its ties are among the changes.
            peak[b] = hi[b]
            ties[b] = at_hi[b]
            if _scale(peak[b]) != scale[b]:  # else under the 1e-4 floor: a new peak, the same scale
                grown += 1
                whole[nblocks - grown] = b
        elif left > 0:
            ties[b] = left
        else:
            whole[rescan] = b
            rescan += 1
    return rescan, grown


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
    scan: bool = True,
) -> tuple[int, int]:
    """Requantize ``blocks`` whole (all blocks when None); (scales changed, elements).

    Every array is flat and C-contiguous; ``q``, ``scale``, ``peak`` and
    ``ties`` are written in place. ``scan=False`` trusts ``peak`` and
    ``ties`` of the listed blocks instead of rescanning them (the numpy path
    rescans anyway: the same result when they are right). With ``blocks``
    None on the numpy path the scales changed are not counted (0): a
    from-scratch quantization has nothing to compare with.
    """
    if use_jit(jit):
        if blocks is None:
            blocks, scan = np.arange(scale.size, dtype=np.int64), True
        rescaled, elements = compiled(_blocks)(readonly(bits), rows, cols, readonly(blocks), q, scale, peak, ties, scan)
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
) -> tuple[np.ndarray, np.ndarray] | int:
    """:func:`_changes` on the chosen path: (blocks to rescan and requantize whole, blocks to requantize
    whole with the peak and ties it set); or, nothing written, -1 when a new value is not finite, -2 when
    an index is out of order or out of bounds."""
    if use_jit(jit):
        whole = np.empty(scale.size, np.int64)
        rescan, grown = compiled(_changes)(rows, cols, q.size, readonly(idx), readonly(old), readonly(new), q, scale, peak, ties, whole)
        if rescan < 0:
            return int(rescan)
        # The grown blocks fill ``whole`` from its end, last seen first: put them back in ascending order.
        return whole[:rescan], np.ascontiguousarray(whole[whole.size - grown :][::-1])
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
