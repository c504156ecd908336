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

:func:`nvidia_gemm_narrow` is the same unit in 32-bit lanes, twice as many to a vector, for the GEMMs the
emulator sends (operands rounded to TF32 or bf16, values in a range that keeps every step's scale a normal
float32): a product of two such operands is exact in float32, and a step's aligned terms, whole numbers below
2^27, sum exactly in int32.

Example:

    >>> import numpy as np
    >>> from tf32lab.numbers.accumulation_kernels import fma_gemm
    >>> from tf32lab.numbers.compiled import torch_threads
    >>> with torch_threads():  # as tf32lab calls them: numba's first parallel launch set torch's thread count
    ...     fma_gemm(np.ones((1, 1, 3)), np.ones((1, 3, 2)), np.zeros((1, 1, 2), np.float32), 64).tolist()
    [[[3.0, 3.0]]]
"""

from __future__ import annotations

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from tf32lab.numbers.compiled import one_signature

__all__ = ["NARROW_LOWEST", "fma_gemm", "nvidia_gemm", "nvidia_gemm_narrow"]

_KEEP24 = ~np.int64((1 << 29) - 1)  # a float64's sign, exponent and top 24 significand bits
_RECIPROCAL = np.int64(2046) << 52  # bits(2^e) + bits(2^-e), for normal powers of two
_LOWEST, _HIGHEST = np.int64(1023 - 126), np.int64(1023 + 128)  # float32's exponent range, biased as float64's
_OPTIONS = {"cache": True, "error_model": "numpy", "boundscheck": False}  # no fastmath: every bit counts
# One signature per kernel (compiled.one_signature): read-only inputs take writable arrays too. nvidia_gemm reads
# its operands once, into dense copies, so any strides cost nothing there; the others loop over their inputs, which
# vectorises only over C-contiguous arrays.
_ANY32 = types.Array(types.float32, 3, "A", readonly=True)
_DENSE32 = types.Array(types.float32, 3, "C", readonly=True)
_DENSE64 = types.Array(types.float64, 3, "C", readonly=True)
_I64, _BOOL = types.int64, types.boolean


def _bitcast(source, target, llvm_target):
    """The value of type ``target`` with the bits of a ``source`` (a register move, unlike a view through
    memory)."""
    @intrinsic
    def cast(typingctx, x):  # pragma: no cover - compiled
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], llvm_target)

        return target(source), codegen

    return cast


_bits = _bitcast(types.float64, types.int64, ir.IntType(64))  # a float64's bits
_float = _bitcast(types.int64, types.float64, ir.DoubleType())  # the float64 with these bits
_bits32 = _bitcast(types.float32, types.int32, ir.IntType(32))
_float32 = _bitcast(types.int32, types.float32, ir.FloatType())


@nb.njit(**_OPTIONS)
def _exponent(r):  # pragma: no cover - compiled
    """MMA-Sim's exponent of the float32 value ``r`` (held in a float64): floor(log2|r|), -126 for zero and
    subnormals, 128 for Inf/NaN; as a float32, so that a step's maximum runs eight lanes to a vector."""
    return np.float32(min(max((_bits(r) >> 52) & 0x7FF, _LOWEST), _HIGHEST) - 1023)


@nb.njit(**_OPTIONS)
def _scale(bits, emax):  # pragma: no cover - compiled
    """2^(bits - emax) in float64, from its bits."""
    return _float((bits + 1023 - np.int64(emax)) << 52)


@nb.njit(**_OPTIONS)
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


@nb.njit(**_OPTIONS)
def _toward_zero_normal(units, scale):  # pragma: no cover - compiled
    """:func:`_toward_zero` for a GEMM whose sums stay normal float32 or zero (``nvidia_gemm``'s ``normal``): no
    subnormal or overflowing lane to choose, only zero's exponent to clamp."""
    s = units * _float(_RECIPROCAL - _bits(scale))
    field = (_bits(s) >> 52) & 0x7FF
    return _float(_bits(s) & _KEEP24) + 0.0, np.float32(max(field, _LOWEST) - 1023)


@nb.njit(**_OPTIONS)
def _larger(x, y):  # pragma: no cover - compiled
    return x if x > y else y  # one max instruction of the operands' type (exponents are never NaN)


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


@nb.njit(**_OPTIONS)
def _start(acc, emax, x, value):  # pragma: no cover - compiled
    r = np.float64(value)
    acc[x] = r
    emax[x] = _exponent(r)


@nb.njit(**_OPTIONS)
def _sum_k4(acc, emax, x, v0, v1, v2, v3, p0, p1, p2, p3, bits):  # pragma: no cover - compiled
    """One fused step of 4 products for output column x of one row: its aligned sum, in units, and the scale."""
    s = _scale(bits, emax[x])
    return (np.trunc(acc[x] * s) + np.trunc(v0 * p0 * s) + np.trunc(v1 * p1 * s) + np.trunc(v2 * p2 * s)
            + np.trunc(v3 * p3 * s)), s


@nb.njit(**_OPTIONS)
def _step_k4(acc, emax, x, v0, v1, v2, v3, p0, p1, p2, p3, bits):  # pragma: no cover - compiled
    units, scale = _sum_k4(acc, emax, x, v0, v1, v2, v3, p0, p1, p2, p3, bits)
    r, e = _toward_zero(units, scale)
    acc[x] = r
    emax[x] = e


@nb.njit(**_OPTIONS)
def _step_k4_normal(acc, emax, x, v0, v1, v2, v3, p0, p1, p2, p3, bits):  # pragma: no cover - compiled
    units, scale = _sum_k4(acc, emax, x, v0, v1, v2, v3, p0, p1, p2, p3, bits)
    r, e = _toward_zero_normal(units, scale)
    acc[x] = r
    emax[x] = e


@nb.njit(**_OPTIONS)
def _largest_k4(emax, x, f0, f1, f2, f3, e0, e1, e2, e3):  # pragma: no cover - compiled
    emax[x] = _larger(_larger(emax[x], _larger(f0 + e0, f1 + e1)), _larger(f2 + e2, f3 + e3))


@nb.njit(**_OPTIONS)
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


@one_signature(_ANY32, _ANY32, _ANY32, _I64, _I64, _I64, _I64, _BOOL)
@nb.njit(parallel=True, **_OPTIONS)
def nvidia_gemm(a, b, c, chunk, bits, tile, band, normal=False):  # pragma: no cover - compiled
    """c + a @ b per GEMM of the batch, chunks of ``chunk`` products fused as accumulation's "nvidia" kind.

    a (B, M, K), b (B, K, N), c (B, M, N): float32, any strides, K a multiple of ``chunk``. Work items: ``tile``
    columns by ``band`` rows of one GEMM. Products are exact in float64, and so is every aligned term
    (< 2^(bits + 2), 2^27 for the real units) and their sum (``accumulation_models.MAX_CHUNK`` + 1 terms, < 2^41).
    ``normal``: the caller knows every sum stays a normal float32 or zero
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


# -- 32-bit lanes ---------------------------------------------------------------------------------------------

NARROW_LOWEST = -100  # nvidia_gemm_narrow's least step exponent: 2^(bits - e) and 2^(e - bits) stay normal float32


def _int32_op(name: str):
    """An int32 operation that stays int32: numba widens int32 arithmetic to int64, half the lanes a vector."""
    @intrinsic
    def op(typingctx, x, y):  # pragma: no cover - compiled
        def codegen(context, builder, signature, args):
            return getattr(builder, name)(args[0], args[1])

        return types.int32(types.int32, types.int32), codegen

    return op


_WIDE = '"prefer-vector-width"="512"'


def _attribute_parses(attribute: str) -> bool:
    """Whether llvmlite prints ``attribute`` into a function's IR as it is and this LLVM accepts it there. llvmlite
    lists no string attributes, so :func:`_wide_vectors` adds it to the set as text: checked once, on a function
    of its own, so that an llvmlite that stopped printing it so costs the speed, never a failed compile."""
    try:
        from llvmlite import binding

        module = ir.Module()
        function = ir.Function(module, ir.FunctionType(ir.VoidType(), []), "probe")
        set.add(function.attributes, attribute)
        ir.IRBuilder(function.append_basic_block()).ret_void()
        text = str(module)
        binding.parse_assembly(text).verify()
        return attribute in text
    except Exception:  # any failure means: leave the attribute out
        return False


_WIDE_OK = _attribute_parses(_WIDE)


@intrinsic
def _wide_vectors(typingctx):  # pragma: no cover - compiled
    """Lets LLVM vectorise the calling function with 512-bit registers where the CPU has AVX-512: its default
    for these CPUs is 256 bits, which halves the lanes of this all-register arithmetic (1.3x here). The function
    attribute is LLVM's own ("prefer-vector-width"); nothing where :func:`_attribute_parses` found it does not
    parse."""
    def codegen(context, builder, signature, args):
        if _WIDE_OK:
            set.add(builder.function.attributes, _WIDE)
        return context.get_dummy_value()

    return types.none(), codegen


_add32, _sub32, _shl32, _shr32, _and32 = (_int32_op(name) for name in ("add", "sub", "shl", "lshr", "and_"))
_I32 = np.int32
_BIASED_LOWEST = _I32(NARROW_LOWEST + 127)


@nb.njit(**_OPTIONS)
def _min32(x, y):  # pragma: no cover - compiled
    return x if x < y else y


@nb.njit(**_OPTIONS)
def _field32(r):  # pragma: no cover - compiled
    """The biased exponent field of the float32 ``r`` (0 for zero and subnormals)."""
    return _and32(_shr32(_bits32(r), _I32(23)), _I32(0xFF))


@nb.njit(**_OPTIONS)
def _survey32(x, bias):  # pragma: no cover - compiled
    """MMA-Sim's exponents of x (B, R, C) float32 (-126 for zero and subnormals) plus ``bias``, as int32 (the
    rows of ``a`` unbiased, those of ``b`` biased, so that a sum of the two is a product's biased exponent),
    and what :func:`nvidia_gemm_narrow` asks of its operands: the least exponent field of a nonzero value
    (subnormals count as 1), the largest field, and whether any value has more than 12 significant bits."""
    nq, rows, cols = x.shape
    exponents = np.empty((nq, rows, cols), np.int32)
    least, most, long = _I32(255), _I32(0), _I32(0)
    for q in range(nq):
        for r in range(rows):
            for j in range(cols):
                word = _bits32(x[q, r, j])
                field = _larger(_field32(x[q, r, j]), _I32(1))
                exponents[q, r, j] = _add32(field, bias)
                least = _min32(least, field if _and32(word, _I32(0x7FFFFFFF)) != 0 else _I32(255))
                most = _larger(most, field)
                long = long | _and32(word, _I32(0xFFF))
    return exponents, least, most, long != 0


@nb.njit(**_OPTIONS)
def _aligned32(r, terms, bits):  # pragma: no cover - compiled
    """A step's alignment: the bits of the scale s = 2^(bits - e), s, and the accumulator ``r``'s units at it,
    where e, the step's exponent, is the larger of r's and ``terms`` (the products' largest, biased), and at
    least NARROW_LOWEST (below it every term is zero or exact)."""
    top = _larger(_larger(_field32(r), _BIASED_LOWEST), terms)
    scale = _shl32(_sub32(_add32(bits, _I32(254)), top), _I32(23))
    s = _float32(scale)
    return scale, s, np.int32(r * s)


@nb.njit(**_OPTIONS)
def _toward_zero32(units, scale):  # pragma: no cover - compiled
    """units / s rounded toward zero to float32: int32 -> float32 rounds to nearest, so where that went away
    from zero, one ulp back (the bits count magnitudes); 1/s from the bits of s; the division is exact (the sum
    stays normal)."""
    rounded = np.float32(units)
    back = _bits32(rounded)
    back = _sub32(back, _I32(1)) if abs(np.int32(rounded)) > abs(units) else back
    return _float32(back) * _float32(_sub32(_I32(254 << 23), scale))


@nb.njit(**_OPTIONS)
def _units4(v0, v1, v2, v3, p0, p1, p2, p3, s):  # pragma: no cover - compiled
    """The aligned units of 4 products at the scale s, summed (``v``, ``p``: the row's and the column's values;
    each product is exact in float32 and its units below 2^27)."""
    return _add32(_add32(np.int32(v0 * p0 * s), np.int32(v1 * p1 * s)),
                  _add32(np.int32(v2 * p2 * s), np.int32(v3 * p3 * s)))


@nb.njit(**_OPTIONS)
def _top4(f0, f1, f2, f3, e0, e1, e2, e3):  # pragma: no cover - compiled
    """The largest biased exponent of 4 products (``f``, ``e``: the row's and the column's exponents)."""
    return _larger(_larger(_add32(f0, e0), _add32(f1, e1)), _larger(_add32(f2, e2), _add32(f3, e3)))


@nb.njit(**_OPTIONS)
def _step32_k4(acc, x, f, v, e, p, bits):  # pragma: no cover - compiled
    """One fused step of 4 products into output column x of one row, all in registers: ``f``, ``v`` the row's
    4 exponents and values, ``e``, ``p`` the column's (tuples: read through arrays, each store to acc would
    reload them)."""
    scale, s, units = _aligned32(acc[x], _top4(f[0], f[1], f[2], f[3], e[0], e[1], e[2], e[3]), bits)
    units = _add32(units, _units4(v[0], v[1], v[2], v[3], p[0], p[1], p[2], p[3], s))
    acc[x] = _toward_zero32(units, scale)


@nb.njit(**_OPTIONS)
def _step32_k8(acc, x, f, v, e, p, bits):  # pragma: no cover - compiled
    """:func:`_step32_k4` for 8 products (Hopper and Blackwell): 9 terms below 2^27 sum below 2^31."""
    top = _larger(_top4(f[0], f[1], f[2], f[3], e[0], e[1], e[2], e[3]),
                 _top4(f[4], f[5], f[6], f[7], e[4], e[5], e[6], e[7]))
    scale, s, units = _aligned32(acc[x], top, bits)
    units = _add32(units, _add32(_units4(v[0], v[1], v[2], v[3], p[0], p[1], p[2], p[3], s),
                                 _units4(v[4], v[5], v[6], v[7], p[4], p[5], p[6], p[7], s)))
    acc[x] = _toward_zero32(units, scale)


@nb.njit(**_OPTIONS)
def _band32_k4(a, ea, b, eb, c, out, q, i0, i1, n0, n1, bits):  # pragma: no cover - compiled
    """Rows i0..i1, columns n0..n1 of GEMM q in chunks of 4, four rows a pass: each row of ``b`` read once for
    the four (the band's last row repeated where its rows run out)."""
    _wide_vectors()
    w, k = n1 - n0, a.shape[2]
    acc0, acc1, acc2, acc3 = (np.empty(w, np.float32), np.empty(w, np.float32), np.empty(w, np.float32),
                              np.empty(w, np.float32))
    bq, ebq = b[q], eb[q]
    for i in range(i0, i1, 4):
        r0, r1, r2, r3 = i, min(i + 1, i1 - 1), min(i + 2, i1 - 1), min(i + 3, i1 - 1)
        for x in range(w):  # no c (an empty array): zeros
            acc0[x], acc1[x] = (c[q, r0, n0 + x], c[q, r1, n0 + x]) if c.size else (0.0, 0.0)
            acc2[x], acc3[x] = (c[q, r2, n0 + x], c[q, r3, n0 + x]) if c.size else (0.0, 0.0)
        for k0 in range(0, k, 4):
            f0, f1, f2, f3 = ea[q, r0, k0:k0 + 4], ea[q, r1, k0:k0 + 4], ea[q, r2, k0:k0 + 4], ea[q, r3, k0:k0 + 4]
            v0, v1, v2, v3 = a[q, r0, k0:k0 + 4], a[q, r1, k0:k0 + 4], a[q, r2, k0:k0 + 4], a[q, r3, k0:k0 + 4]
            x0, x1, x2, x3 = ((f0[0], f0[1], f0[2], f0[3]), (f1[0], f1[1], f1[2], f1[3]),
                              (f2[0], f2[1], f2[2], f2[3]), (f3[0], f3[1], f3[2], f3[3]))
            y0, y1, y2, y3 = ((v0[0], v0[1], v0[2], v0[3]), (v1[0], v1[1], v1[2], v1[3]),
                              (v2[0], v2[1], v2[2], v2[3]), (v3[0], v3[1], v3[2], v3[3]))
            g0, g1, g2, g3 = ebq[k0, n0:n1], ebq[k0 + 1, n0:n1], ebq[k0 + 2, n0:n1], ebq[k0 + 3, n0:n1]
            p0, p1, p2, p3 = bq[k0, n0:n1], bq[k0 + 1, n0:n1], bq[k0 + 2, n0:n1], bq[k0 + 3, n0:n1]
            for x in range(w):
                e, p = (g0[x], g1[x], g2[x], g3[x]), (p0[x], p1[x], p2[x], p3[x])
                _step32_k4(acc0, x, x0, y0, e, p, bits)
                _step32_k4(acc1, x, x1, y1, e, p, bits)
                _step32_k4(acc2, x, x2, y2, e, p, bits)
                _step32_k4(acc3, x, x3, y3, e, p, bits)
        for x in range(w):
            out[q, r0, n0 + x], out[q, r1, n0 + x] = acc0[x], acc1[x]
            out[q, r2, n0 + x], out[q, r3, n0 + x] = acc2[x], acc3[x]


@nb.njit(**_OPTIONS)
def _band32_k8(a, ea, b, eb, c, out, q, i0, i1, n0, n1, bits):  # pragma: no cover - compiled
    """:func:`_band32_k4` in chunks of 8, two rows a pass."""
    _wide_vectors()
    w, k = n1 - n0, a.shape[2]
    acc0, acc1 = np.empty(w, np.float32), np.empty(w, np.float32)
    bq, ebq = b[q], eb[q]
    for i in range(i0, i1, 2):
        r0, r1 = i, min(i + 1, i1 - 1)
        for x in range(w):  # no c (an empty array): zeros
            acc0[x], acc1[x] = (c[q, r0, n0 + x], c[q, r1, n0 + x]) if c.size else (0.0, 0.0)
        for k0 in range(0, k, 8):
            f0, f1, v0, v1 = ea[q, r0, k0:k0 + 8], ea[q, r1, k0:k0 + 8], a[q, r0, k0:k0 + 8], a[q, r1, k0:k0 + 8]
            x0 = (f0[0], f0[1], f0[2], f0[3], f0[4], f0[5], f0[6], f0[7])
            x1 = (f1[0], f1[1], f1[2], f1[3], f1[4], f1[5], f1[6], f1[7])
            y0 = (v0[0], v0[1], v0[2], v0[3], v0[4], v0[5], v0[6], v0[7])
            y1 = (v1[0], v1[1], v1[2], v1[3], v1[4], v1[5], v1[6], v1[7])
            g0, g1, g2, g3 = ebq[k0, n0:n1], ebq[k0 + 1, n0:n1], ebq[k0 + 2, n0:n1], ebq[k0 + 3, n0:n1]
            g4, g5, g6, g7 = ebq[k0 + 4, n0:n1], ebq[k0 + 5, n0:n1], ebq[k0 + 6, n0:n1], ebq[k0 + 7, n0:n1]
            p0, p1, p2, p3 = bq[k0, n0:n1], bq[k0 + 1, n0:n1], bq[k0 + 2, n0:n1], bq[k0 + 3, n0:n1]
            p4, p5, p6, p7 = bq[k0 + 4, n0:n1], bq[k0 + 5, n0:n1], bq[k0 + 6, n0:n1], bq[k0 + 7, n0:n1]
            for x in range(w):
                e = (g0[x], g1[x], g2[x], g3[x], g4[x], g5[x], g6[x], g7[x])
                p = (p0[x], p1[x], p2[x], p3[x], p4[x], p5[x], p6[x], p7[x])
                _step32_k8(acc0, x, x0, y0, e, p, bits)
                _step32_k8(acc1, x, x1, y1, e, p, bits)
        for x in range(w):
            out[q, r0, n0 + x], out[q, r1, n0 + x] = acc0[x], acc1[x]


@nb.njit(**_OPTIONS)
def _fits32(a, b, c, la, ma, lb, mb):  # pragma: no cover - compiled
    """Whether :func:`nvidia_gemm_narrow` computes ``c + a @ b`` (``la``, ``ma``, ``lb``, ``mb``: the least and
    largest exponent fields of the operands, as :func:`_survey32` gives them)."""
    lc, mc = _I32(255), _I32(0)
    for v in c.ravel():
        field = _larger(_field32(v), _I32(1))
        lc = _min32(lc, field if v != 0 else _I32(255))
        mc = _larger(mc, field)
    # |a| < 2^(ma - 126) and so on: no sum reaches 2^127 (Inf and NaN have field 255: refused here)
    largest = 2.0 ** (np.int64(ma) + mb - 252) * a.shape[2] + 2.0 ** (np.int64(mc) - 126)
    return (largest < 2.0 ** 127 and np.int64(la) + lb - 254 >= NARROW_LOWEST
            and np.int64(lc) - 127 >= NARROW_LOWEST)


@one_signature(_DENSE32, _DENSE32, _DENSE32, _I64, _I64, _I64, _I64)
@nb.njit(parallel=True, **_OPTIONS)
def nvidia_gemm_narrow(a, b, c, chunk, bits, tile, band):  # pragma: no cover - compiled
    """:func:`nvidia_gemm` in 32-bit lanes, for chunks of 4 or 8, where it applies: (output, True), or
    (an empty array, False) where it does not and the caller must use :func:`nvidia_gemm`.

    a (B, M, K), b (B, K, N), c (B, M, N) (an empty array: zeros): C-contiguous float32. It applies to chunks of
    4 or 8, 0 to 25 fraction bits and K a multiple of the chunk, where each product is exact in float32 (operands of 12
    significant bits or fewer: TF32 and bf16 values have 11 and 8), every nonzero product and every nonzero ``c``
    is at least 2^NARROW_LOWEST, and no sum can reach 2^127: then every partial sum is a whole number of units of
    2^(NARROW_LOWEST - bits) or more, normal, and a step that would align below NARROW_LOWEST holds only zero
    products and an accumulator it leaves exact, so raising its exponent to NARROW_LOWEST changes nothing. The
    check costs one pass over the operands, which the kernel makes anyway for their exponents."""
    if chunk not in (4, 8) or not 0 <= bits <= 25 or a.shape[2] % chunk:
        return np.empty((0, 0, 0), np.float32), False
    bits = np.int32(bits)
    ea, la, ma, long_a = _survey32(a, _I32(-127))
    eb, lb, mb, long_b = _survey32(b, _I32(0))
    if long_a or long_b or not _fits32(a, b, c, la, ma, lb, mb):
        return np.empty((0, 0, 0), np.float32), False
    nq, m = a.shape[0], a.shape[1]
    n = b.shape[2]
    out = np.empty((nq, m, n), np.float32)
    tiles, bands = (n + tile - 1) // tile, (m + band - 1) // band
    for item in nb.prange(nq * tiles * bands):
        q, rest = divmod(np.int64(item), np.int64(tiles * bands))
        t, g = divmod(rest, np.int64(bands))
        n0, n1, i0, i1 = t * tile, min(n, t * tile + tile), g * band, min(m, g * band + band)
        if chunk == 4:
            _band32_k4(a, ea, b, eb, c, out, q, i0, i1, n0, n1, bits)
        else:
            _band32_k8(a, ea, b, eb, c, out, q, i0, i1, n0, n1, bits)
    return out, True


@one_signature(_DENSE64, _DENSE64, _DENSE32, _I64)
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
