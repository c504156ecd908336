"""Compiled kernels for :mod:`tf32lab.numbers.accumulation` (numba, the optional extra ``tf32lab[fast]``).

The same arithmetic as the tensor code there, one output row slice at a time so that the inner loops run over
contiguous columns and vectorise: the tests compare the two bit for bit. Operands come as a batch of GEMMs
(``(B, M, K)`` and ``(B, K, N)``), so that a batched matmul is one call whose GEMMs share the threads.

Exponents are carried as powers of two (``2^-e`` in float64): the largest exponent of a step is then a minimum of
products, and every scaling and the rounding toward zero to float32 are multiplications and bit masks, all of
which the compiler vectorises; no step leaves float64 until the output is stored. Imported only when numba is
installed.

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
def _inverse_power(r):  # pragma: no cover - compiled
    """2^-e for the float32 exponent e of ``r`` (MMA-Sim's: -126 for zero and subnormals, 128 for Inf/NaN)."""
    e = min(max((_bits(r) >> 52) & 0x7FF, _LOWEST), _HIGHEST)
    return _float((2046 - e) << 52)


@nb.njit(parallel=True, **_OPTIONS)
def nvidia_gemm(a, ia, b, ib, c, chunk, bits, tile, band):  # pragma: no cover - compiled
    """c + a @ b per GEMM of the batch, chunks of ``chunk`` products fused as accumulation's "nvidia" kind.

    a (B, M, K), b (B, K, N): float64 holding float32 values, K a multiple of ``chunk``; ia, ib: 2^-e of their
    float32 exponents e; c (B, M, N) float32. Work items: ``tile`` columns by ``band`` rows of one GEMM."""
    nq, m, k = a.shape
    n = b.shape[2]
    out = np.empty((nq, m, n), np.float32)
    two_bits = np.float64(2.0 ** bits)
    tiles, bands = (n + tile - 1) // tile, (m + band - 1) // band
    for item in nb.prange(nq * tiles * bands):
        q, rest = divmod(np.int64(item), np.int64(tiles * bands))
        t, g = divmod(rest, np.int64(bands))
        n0, n1 = t * tile, min(n, t * tile + tile)
        w = n1 - n0
        acc = np.empty(w, np.float64)  # the output row, float32 values
        low = np.empty(w, np.float64)  # 2^-emax of the step
        scale = np.empty(w, np.float64)  # 2^(bits - emax): one unit of the aligned sum is 1
        units = np.empty(w, np.float64)  # the aligned, truncated terms summed (exact: < 2^31)
        bq, ibq = b[q], ib[q]
        for i in range(g * band, min(m, g * band + band)):
            ai, iai = a[q, i], ia[q, i]
            for x in range(w):
                r = np.float64(c[q, i, n0 + x])
                acc[x] = r
                low[x] = _inverse_power(r)
            for k0 in range(0, k, chunk):
                for kk in range(k0, k0 + chunk):
                    v = iai[kk]
                    row = ibq[kk, n0:n1]
                    for x in range(w):
                        p = v * row[x]
                        low[x] = p if p < low[x] else low[x]
                for x in range(w):
                    s = low[x] * two_bits
                    scale[x] = s
                    units[x] = np.trunc(acc[x] * s)
                for kk in range(k0, k0 + chunk):
                    v = ai[kk]
                    row = bq[kk, n0:n1]
                    for x in range(w):
                        units[x] += np.trunc(v * row[x] * scale[x])
                for x in range(w):  # back to scale (exactly), then to float32 toward zero
                    s = units[x] * _float(_RECIPROCAL - _bits(scale[x]))
                    r = _float(_bits(s) & _KEEP24)
                    subnormal = np.trunc(s * 2.0 ** 149) * 2.0 ** -149
                    over = s * 2.0 ** 1000  # at or above 2^128: Inf of its sign
                    size = abs(s)
                    r = subnormal if size < 2.0 ** -126 else r
                    r = over if size >= 2.0 ** 128 else r
                    acc[x] = r
                    low[x] = _inverse_power(r)
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
