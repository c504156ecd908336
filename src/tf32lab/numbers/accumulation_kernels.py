"""Compiled kernels for :mod:`tf32lab.numbers.accumulation` (numba, the optional extra ``tf32lab[fast]``).

The same arithmetic as the tensor code there, one output row slice at a time so that the inner loops run over
contiguous columns and vectorise: the tests compare the two bit for bit. Imported only when numba is installed.

Example:

    >>> import numpy as np
    >>> from tf32lab.numbers.accumulation_kernels import fma_gemm
    >>> fma_gemm(np.ones((1, 3)), np.ones((3, 2)), np.zeros((1, 2), np.float32), 64).tolist()
    [[3.0, 3.0]]
"""

from __future__ import annotations

import numba as nb
import numpy as np

__all__ = ["POW2", "POW2_OFFSET", "fma_gemm", "nvidia_gemm"]

POW2_OFFSET = 1100
POW2 = np.ldexp(1.0, np.arange(-POW2_OFFSET, 2046 - POW2_OFFSET)).astype(np.float64)  # 2.0**e at e + OFFSET
_FLT_HUGE = 2.0 ** 128


@nb.njit(parallel=True, cache=True)
def nvidia_gemm(a, ea, b, eb, c, chunk, bits, pow2, tile):  # pragma: no cover - compiled
    """c + a @ b, chunks of ``chunk`` products fused as accumulation's "nvidia" kind (a, b: float64 holding
    float32 values, K a multiple of ``chunk``; ea, eb: their int32 exponents; c: float32)."""
    m, k = a.shape
    n = b.shape[1]
    out = np.empty((m, n), np.float32)
    for t in nb.prange((n + tile - 1) // tile):
        n0 = t * tile
        w = min(n, n0 + tile) - n0
        acc = np.empty(w, np.float64)
        emax = np.empty(w, np.int32)
        scale = np.empty(w, np.float64)
        units = np.empty(w, np.float64)
        bits_of = acc.view(np.int64)
        for i in range(m):
            for x in range(w):
                acc[x] = c[i, n0 + x]
            for k0 in range(0, k, chunk):
                for x in range(w):  # the accumulator's exponent, as float32 sees it (-126 for zero/subnormal)
                    e = np.int32((bits_of[x] >> 52) & 0x7FF) - np.int32(1023)
                    emax[x] = min(max(e, np.int32(-126)), np.int32(128))
                for kk in range(k0, k0 + chunk):
                    e_a = ea[i, kk]
                    for x in range(w):
                        emax[x] = max(emax[x], e_a + eb[kk, n0 + x])
                for x in range(w):
                    s = pow2[bits - emax[x] + 1100]
                    scale[x] = s
                    units[x] = np.trunc(acc[x] * s)
                for kk in range(k0, k0 + chunk):
                    v = a[i, kk]
                    for x in range(w):
                        units[x] += np.trunc(v * b[kk, n0 + x] * scale[x])
                for x in range(w):  # to float32 toward zero; Inf at or above 2^128
                    s = units[x] * pow2[emax[x] - bits + 1100]
                    r = np.float32(s)
                    rd = np.float64(r)
                    if abs(rd) > abs(s) and abs(s) < _FLT_HUGE:
                        rd = np.float64(np.nextafter(r, np.float32(0.0)))
                    acc[x] = rd
            for x in range(w):
                out[i, n0 + x] = acc[x]
    return out


@nb.njit(parallel=True, cache=True)
def fma_gemm(a, b, c, tile):  # pragma: no cover - compiled
    """c + a @ b as one float32 FMA per product in K order (a, b: float64 holding float32 values)."""
    m, k = a.shape
    n = b.shape[1]
    out = np.empty((m, n), np.float32)
    for t in nb.prange((n + tile - 1) // tile):
        n0 = t * tile
        w = min(n, n0 + tile) - n0
        acc = np.empty(w, np.float64)
        for i in range(m):
            for x in range(w):
                acc[x] = c[i, n0 + x]
            for kk in range(k):
                v = a[i, kk]
                for x in range(w):
                    acc[x] = np.float64(np.float32(acc[x] + v * b[kk, n0 + x]))
            for x in range(w):
                out[i, n0 + x] = acc[x]
    return out
