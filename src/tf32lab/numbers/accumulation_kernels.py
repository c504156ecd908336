"""Compiled kernels for :mod:`tf32lab.numbers.accumulation` (numba, the optional extra ``tf32lab[fast]``).

The same arithmetic as the tensor code there, on slices of output rows so that the inner loops run over
contiguous columns and vectorise: the tests compare the two bit for bit. Operands come as a batch of GEMMs
(``(B, M, K)`` and ``(B, K, N)`` float32, any strides), so that a batched matmul is one call whose GEMMs share the
threads.

Everything stays in registers and in float64 (exact for these values) until the output is stored: exponents are
float32 (a step's maximum runs eight lanes to a vector), powers of two and their reciprocals are built from bits,
the rounding toward zero to float32 is a bit mask, and special lanes (subnormal, overflowing) are chosen by
selects rather than branches. Chunks of 4 (the Ampere and Ada unit) run as one pass over four output rows, each
row of ``b`` read once for all four. No fast-math: every bit counts. Imported only when numba is installed.

Example:

    >>> import numpy as np
    >>> from tf32lab.numbers.accumulation_kernels import fma_gemm
    >>> fma_gemm(np.ones((1, 1, 3)), np.ones((1, 3, 2)), np.zeros((1, 1, 2), np.float32), 64).tolist()
    [[[3.0, 3.0]]]
"""

from __future__ import annotations

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

__all__ = ["fma_gemm", "nvidia_gemm"]

_KEEP24 = ~np.int64((1 << 29) - 1)  # a float64's sign, exponent and top 24 significand bits
_RECIPROCAL = np.int64(2046) << 52  # bits(2^e) + bits(2^-e), for normal powers of two
_LOWEST, _HIGHEST = np.int64(1023 - 126), np.int64(1023 + 128)  # float32's exponent range, biased as float64's
_OPTIONS = {"cache": True, "error_model": "numpy", "boundscheck": False}  # no fastmath: every bit counts


@intrinsic
def _bits(typingctx, x):  # pragma: no cover - compiled
    """The bits of a float64 as an int64 (a register move, unlike a view through memory)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(64))

    return types.int64(types.float64), codegen


@intrinsic
def _float(typingctx, x):  # pragma: no cover - compiled
    """The float64 with the given bits."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(types.int64), codegen


@nb.njit(inline="always", **_OPTIONS)
def _exponent(r):  # pragma: no cover - compiled
    """MMA-Sim's exponent of the float32 value ``r`` (held in a float64): floor(log2|r|), -126 for zero and
    subnormals, 128 for Inf/NaN; as a float32, so that a step's maximum runs eight lanes to a vector."""
    return np.float32(min(max((_bits(r) >> 52) & 0x7FF, _LOWEST), _HIGHEST) - 1023)


@nb.njit(inline="always", **_OPTIONS)
def _scale(bits, emax):  # pragma: no cover - compiled
    """2^(bits - emax) in float64, from its bits."""
    return _float((bits + 1023 - np.int64(emax)) << 52)


@nb.njit(inline="always", **_OPTIONS)
def _toward_zero(units, scale):  # pragma: no cover - compiled
    """units / scale (exact: scale is a power of two) rounded toward zero to float32 (subnormals on their grid;
    at or above 2^128: Inf; a zero is +0), and that float32's exponent as :func:`_exponent` gives it (the
    quotient's exponent field, clamped: the rounding keeps it)."""
    s = units * _float(_RECIPROCAL - _bits(scale))
    field = (_bits(s) >> 52) & 0x7FF
    r = _float(_bits(s) & _KEEP24)
    r = np.trunc(s * 2.0 ** 149) * 2.0 ** -149 if field < _LOWEST else r
    r = s * 2.0 ** 1000 if field >= _HIGHEST else r  # Inf of its sign (NaN stays NaN)
    return r + 0.0, np.float32(min(max(field, _LOWEST), _HIGHEST) - 1023)  # a zero is +0, as in MMA-Sim


@nb.njit(inline="always", **_OPTIONS)
def _toward_zero_normal(units, scale):  # pragma: no cover - compiled
    """:func:`_toward_zero` for a GEMM whose sums stay normal float32 or zero (``nvidia_gemm``'s ``normal``): no
    subnormal or overflowing lane to choose, only zero's exponent to clamp."""
    s = units * _float(_RECIPROCAL - _bits(scale))
    field = (_bits(s) >> 52) & 0x7FF
    return _float(_bits(s) & _KEEP24) + 0.0, np.float32(max(field, _LOWEST) - 1023)


@nb.njit(inline="always", **_OPTIONS)
def _larger(x, y):  # pragma: no cover - compiled
    return x if x > y else y  # one max instruction (exponents are never NaN)


@nb.njit(parallel=True, **_OPTIONS)
def _operands(x):  # pragma: no cover - compiled
    """x (B, R, C) float32, any strides -> its values in float64 and their exponents (float32), C-contiguous."""
    nq, rows, cols = x.shape
    values = np.empty((nq, rows, cols), np.float64)
    exponents = np.empty((nq, rows, cols), np.float32)
    for item in nb.prange(nq * rows):
        q, r = divmod(np.int64(item), np.int64(rows))
        for j in range(cols):
            v = np.float64(x[q, r, j])
            values[q, r, j] = v
            exponents[q, r, j] = _exponent(v)
    return values, exponents


@nb.njit(inline="always", **_OPTIONS)
def _start(acc, emax, x, value):  # pragma: no cover - compiled
    r = np.float64(value)
    acc[x] = r
    emax[x] = _exponent(r)


@nb.njit(inline="always", **_OPTIONS)
def _sum_k4(acc, emax, x, v0, v1, v2, v3, p0, p1, p2, p3, bits):  # pragma: no cover - compiled
    """One fused step of 4 products for output column x of one row: its aligned sum, in units, and the scale."""
    s = _scale(bits, emax[x])
    return (np.trunc(acc[x] * s) + np.trunc(v0 * p0 * s) + np.trunc(v1 * p1 * s) + np.trunc(v2 * p2 * s)
            + np.trunc(v3 * p3 * s)), s


@nb.njit(inline="always", **_OPTIONS)
def _step_k4(acc, emax, x, v0, v1, v2, v3, p0, p1, p2, p3, bits):  # pragma: no cover - compiled
    units, scale = _sum_k4(acc, emax, x, v0, v1, v2, v3, p0, p1, p2, p3, bits)
    r, e = _toward_zero(units, scale)
    acc[x] = r
    emax[x] = e


@nb.njit(inline="always", **_OPTIONS)
def _step_k4_normal(acc, emax, x, v0, v1, v2, v3, p0, p1, p2, p3, bits):  # pragma: no cover - compiled
    units, scale = _sum_k4(acc, emax, x, v0, v1, v2, v3, p0, p1, p2, p3, bits)
    r, e = _toward_zero_normal(units, scale)
    acc[x] = r
    emax[x] = e


@nb.njit(inline="always", **_OPTIONS)
def _largest_k4(emax, x, f0, f1, f2, f3, e0, e1, e2, e3):  # pragma: no cover - compiled
    emax[x] = _larger(_larger(emax[x], _larger(f0 + e0, f1 + e1)), _larger(f2 + e2, f3 + e3))


@nb.njit(inline="always", **_OPTIONS)
def _four_rows_k4(a, ea, b, eb, c, out, q, rows, n0, n1, bits, accs, emaxs, normal):  # pragma: no cover - compiled
    """Four rows (``rows``; repeats allowed) of one GEMM, columns n0..n1, chunks of 4: each b row read once."""
    w = n1 - n0
    k = a.shape[2]
    bq, ebq = b[q], eb[q]
    i0, i1, i2, i3 = rows
    acc0, acc1, acc2, acc3 = accs
    emax0, emax1, emax2, emax3 = emaxs
    for x in range(w):
        _start(acc0, emax0, x, c[q, i0, n0 + x])
        _start(acc1, emax1, x, c[q, i1, n0 + x])
        _start(acc2, emax2, x, c[q, i2, n0 + x])
        _start(acc3, emax3, x, c[q, i3, n0 + x])
    for k0 in range(0, k, 4):
        r0, r1, r2, r3 = ebq[k0, n0:n1], ebq[k0 + 1, n0:n1], ebq[k0 + 2, n0:n1], ebq[k0 + 3, n0:n1]
        ea0, ea1, ea2, ea3 = ea[q, i0, k0:k0 + 4], ea[q, i1, k0:k0 + 4], ea[q, i2, k0:k0 + 4], ea[q, i3, k0:k0 + 4]
        for x in range(w):
            e0, e1, e2, e3 = r0[x], r1[x], r2[x], r3[x]
            _largest_k4(emax0, x, ea0[0], ea0[1], ea0[2], ea0[3], e0, e1, e2, e3)
            _largest_k4(emax1, x, ea1[0], ea1[1], ea1[2], ea1[3], e0, e1, e2, e3)
            _largest_k4(emax2, x, ea2[0], ea2[1], ea2[2], ea2[3], e0, e1, e2, e3)
            _largest_k4(emax3, x, ea3[0], ea3[1], ea3[2], ea3[3], e0, e1, e2, e3)
        r0, r1, r2, r3 = bq[k0, n0:n1], bq[k0 + 1, n0:n1], bq[k0 + 2, n0:n1], bq[k0 + 3, n0:n1]
        a0, a1, a2, a3 = a[q, i0, k0:k0 + 4], a[q, i1, k0:k0 + 4], a[q, i2, k0:k0 + 4], a[q, i3, k0:k0 + 4]
        if normal:  # the test outside the loop: inside, it kept the loop from its vectorised form
            for x in range(w):
                p0, p1, p2, p3 = r0[x], r1[x], r2[x], r3[x]
                _step_k4_normal(acc0, emax0, x, a0[0], a0[1], a0[2], a0[3], p0, p1, p2, p3, bits)
                _step_k4_normal(acc1, emax1, x, a1[0], a1[1], a1[2], a1[3], p0, p1, p2, p3, bits)
                _step_k4_normal(acc2, emax2, x, a2[0], a2[1], a2[2], a2[3], p0, p1, p2, p3, bits)
                _step_k4_normal(acc3, emax3, x, a3[0], a3[1], a3[2], a3[3], p0, p1, p2, p3, bits)
            continue
        for x in range(w):
            p0, p1, p2, p3 = r0[x], r1[x], r2[x], r3[x]
            _step_k4(acc0, emax0, x, a0[0], a0[1], a0[2], a0[3], p0, p1, p2, p3, bits)
            _step_k4(acc1, emax1, x, a1[0], a1[1], a1[2], a1[3], p0, p1, p2, p3, bits)
            _step_k4(acc2, emax2, x, a2[0], a2[1], a2[2], a2[3], p0, p1, p2, p3, bits)
            _step_k4(acc3, emax3, x, a3[0], a3[1], a3[2], a3[3], p0, p1, p2, p3, bits)
    for x in range(w):
        out[q, i0, n0 + x] = acc0[x]
        out[q, i1, n0 + x] = acc1[x]
        out[q, i2, n0 + x] = acc2[x]
        out[q, i3, n0 + x] = acc3[x]


@nb.njit(parallel=True, **_OPTIONS)
def nvidia_gemm(a, b, c, chunk, bits, tile, band, normal=False):  # pragma: no cover - compiled
    """c + a @ b per GEMM of the batch, chunks of ``chunk`` products fused as accumulation's "nvidia" kind.

    a (B, M, K), b (B, K, N), c (B, M, N): float32, any strides, K a multiple of ``chunk``. Work items: ``tile``
    columns by ``band`` rows of one GEMM. Products are exact in float64, and so is every aligned term (< 2^27)
    and their sum (< 2^31). ``normal``: the caller knows every sum stays a normal float32 or zero
    (``accumulation._stays_normal``), which spares each step the choice of a subnormal or infinite result."""
    a, ea = _operands(a)
    b, eb = _operands(b)
    nq, m, k = a.shape
    n = b.shape[2]
    out = np.empty((nq, m, n), np.float32)
    fours = chunk % 4 == 0  # products taken four at a time: fewer passes over the row's state
    tiles, bands = (n + tile - 1) // tile, (m + band - 1) // band
    for item in nb.prange(nq * tiles * bands):
        q, rest = divmod(np.int64(item), np.int64(tiles * bands))
        t, g = divmod(rest, np.int64(bands))
        n0, n1 = t * tile, min(n, t * tile + tile)
        w = n1 - n0
        acc = np.empty(w, np.float64)  # the output row, float32 values
        emax = np.empty(w, np.float32)  # the step's largest exponent
        scale = np.empty(w, np.float64)  # 2^(bits - emax): one unit of the aligned sum is 1
        units = np.empty(w, np.float64)  # the aligned, truncated terms summed
        bq, ebq = b[q], eb[q]
        i0, i1 = g * band, min(m, g * band + band)
        if chunk == 4:  # rows four at a time (the last one repeated where they run out)
            accs = (acc, np.empty(w, np.float64), np.empty(w, np.float64), np.empty(w, np.float64))
            emaxs = (emax, np.empty(w, np.float32), np.empty(w, np.float32), np.empty(w, np.float32))
            for i in range(i0, i1, 4):
                rows = (i, min(i + 1, i1 - 1), min(i + 2, i1 - 1), min(i + 3, i1 - 1))
                _four_rows_k4(a, ea, b, eb, c, out, q, rows, n0, n1, bits, accs, emaxs, normal)
            continue
        for i in range(i0, i1):
            ai, eai = a[q, i], ea[q, i]
            for x in range(w):
                r = np.float64(c[q, i, n0 + x])
                acc[x] = r
                emax[x] = _exponent(r)
            for k0 in range(0, k, chunk):
                if fours:
                    for k1 in range(k0, k0 + chunk, 4):
                        e0, e1, e2, e3 = eai[k1], eai[k1 + 1], eai[k1 + 2], eai[k1 + 3]
                        r0, r1, r2, r3 = ebq[k1, n0:n1], ebq[k1 + 1, n0:n1], ebq[k1 + 2, n0:n1], ebq[k1 + 3, n0:n1]
                        for x in range(w):
                            emax[x] = _larger(_larger(emax[x], _larger(e0 + r0[x], e1 + r1[x])),
                                              _larger(e2 + r2[x], e3 + r3[x]))
                else:
                    for kk in range(k0, k0 + chunk):
                        e0, r0 = eai[kk], ebq[kk, n0:n1]
                        for x in range(w):
                            emax[x] = _larger(emax[x], e0 + r0[x])
                for x in range(w):
                    s = _scale(bits, emax[x])
                    scale[x] = s
                    units[x] = np.trunc(acc[x] * s)
                if fours:
                    for k1 in range(k0, k0 + chunk, 4):
                        v0, v1, v2, v3 = ai[k1], ai[k1 + 1], ai[k1 + 2], ai[k1 + 3]
                        r0, r1, r2, r3 = bq[k1, n0:n1], bq[k1 + 1, n0:n1], bq[k1 + 2, n0:n1], bq[k1 + 3, n0:n1]
                        for x in range(w):
                            s = scale[x]
                            units[x] += (np.trunc(v0 * r0[x] * s) + np.trunc(v1 * r1[x] * s)
                                         + np.trunc(v2 * r2[x] * s) + np.trunc(v3 * r3[x] * s))
                else:
                    for kk in range(k0, k0 + chunk):
                        v0, r0 = ai[kk], bq[kk, n0:n1]
                        for x in range(w):
                            units[x] += np.trunc(v0 * r0[x] * scale[x])
                if normal:
                    for x in range(w):
                        r, e = _toward_zero_normal(units[x], scale[x])
                        acc[x] = r
                        emax[x] = e
                else:
                    for x in range(w):
                        r, e = _toward_zero(units[x], scale[x])
                        acc[x] = r
                        emax[x] = e
            for x in range(w):
                out[q, i, n0 + x] = acc[x]
    return out


@nb.njit(parallel=True, **_OPTIONS)
def fma_gemm(a, b, c, tile):  # pragma: no cover - compiled
    """c + a @ b per GEMM of the batch as one float32 FMA per product in K order (a (B, M, K), b (B, K, N):
    float64 holding float32 values; c (B, M, N) float32)."""
    nq, m, k = a.shape
    n = b.shape[2]
    out = np.empty((nq, m, n), np.float32)
    tiles = (n + tile - 1) // tile
    for item in nb.prange(nq * tiles):
        q, t = divmod(np.int64(item), np.int64(tiles))
        n0, n1 = t * tile, min(n, t * tile + tile)
        w = n1 - n0
        acc = np.empty(w, np.float64)
        bq = b[q]
        for i in range(m):
            ai = a[q, i]
            for x in range(w):
                acc[x] = c[q, i, n0 + x]
            for kk in range(k):
                v = ai[kk]
                row = bq[kk, n0:n1]
                for x in range(w):
                    acc[x] = np.float64(np.float32(acc[x] + v * row[x]))
            for x in range(w):
                out[q, i, n0 + x] = acc[x]
    return out
