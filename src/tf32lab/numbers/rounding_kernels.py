"""A compiled kernel for :mod:`tf32lab.numbers.formats`: a float32's bits rounded in one pass (numba, the optional
extra ``tf32lab[fast]``).

The tensor code rounds in three passes over memory (a scan for NaNs, the rounding bias, the mask; five for
ties-to-even). This kernel reads each value once and writes it once, NaNs handled on the way, with the same
arithmetic: the tests compare the two bit for bit. It runs on the calling thread (``nogil``: other Python threads
go on): numba's own thread pool, woken for each call, cost more than it saved on the machines this was measured
on (benchmarks/emulate.py). Imported only when numba is installed.

Example:

    >>> import numpy as np
    >>> from tf32lab.numbers.rounding_kernels import round_bits
    >>> bits = np.array([1.0 + 2**-11, float("nan")], np.float32).view(np.int32)
    >>> out = np.empty_like(bits)
    >>> round_bits(bits, (0, 0, 0, 1), (1, 1, 1, 2), out, 13, "rna").view(np.float32).tolist()  # a tie: away
    [1.0009765625, nan]
    >>> grid = np.arange(6, dtype=np.float32).reshape(2, 3).view(np.int32)  # its transpose read in place:
    >>> round_bits(grid.reshape(-1), (0, 0, 1, 3), (1, 1, 3, 2), np.empty(6, np.int32), 13, "rz").view(np.float32)
    array([0., 3., 1., 4., 2., 5.], dtype=float32)
"""

from __future__ import annotations

from typing import Optional

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from tf32lab.numbers.compiled import one_signature

__all__ = ["as_bits", "as_float", "round_bits", "split_tf32x3"]

_OPTIONS = {"cache": True, "error_model": "numpy", "boundscheck": False, "nogil": True}  # no fastmath


@nb.njit(**_OPTIONS, inline="always")
def _rounded(u, bias, odd, drop, mask):  # pragma: no cover - compiled
    # the bias, plus the lowest kept bit for ties to even, carried into the exponent where it overflows
    r = (u + bias + ((u >> drop) & odd)) & mask
    return u if (u & np.int32(0x7FFFFFFF)) > np.int32(0x7F800000) else r  # a NaN keeps its bits


@nb.njit(**_OPTIONS)
def _row_starts(s0, s1, s2, n0, n1, n2):  # pragma: no cover - compiled
    """Where each row of a strided 4-D source starts (elements), in row-major order: unsigned, so that the
    kernels' indices need no wraparound test."""
    starts = np.empty(n0 * n1 * n2, np.uint64)
    r = 0
    for i0 in range(n0):
        for i1 in range(n1):
            for i2 in range(n2):
                starts[r] = np.uint64(i0 * s0 + i1 * s1 + i2 * s2)
                r += 1
    return starts


@intrinsic
def as_float(typingctx, u):  # pragma: no cover - compiled
    """The float32 with the bits of the int32 ``u`` (a register move)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@intrinsic
def as_bits(typingctx, x):  # pragma: no cover - compiled
    """The bits of the float32 ``x`` as an int32."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(types.float32), codegen


@nb.njit(**_OPTIONS, inline="always")
def _special(u):  # pragma: no cover - compiled
    return np.int32((u & np.int32(0x7FFFFFFF)) >= np.int32(0x7F800000))  # Inf or NaN


@nb.njit(**_OPTIONS, inline="always")
def _parts(u, summed):  # pragma: no cover - compiled
    b = u & np.int32(-8192)  # toward zero: the bits below TF32's cleared
    d = as_bits(as_float(u) - as_float(b))  # exact in float32 (and finite for a finite u)
    small = (d + np.int32(4096)) & np.int32(-8192)  # to nearest, ties away
    return b, (as_bits(as_float(b) + as_float(small)) if summed else small)


_I64 = types.int64


@one_signature(types.Array(types.int32, 1, "C", readonly=True), _I64, _I64, _I64, _I64,
               types.Array(types.int32, 1, "C"), types.Array(types.int32, 1, "C"), _I64, _I64, _I64,
               _I64, _I64, _I64, _I64, types.boolean, _I64, _I64, _I64, _I64,
               types.boolean)  # compiled once (compiled.one_signature)
@nb.njit(**_OPTIONS)
def _each(src, s0, s1, s2, s3, first, second, o0, o1, o2, n0, n1, n2, n3, split, bias, odd, drop, mask,
          summed):  # pragma: no cover - compiled
    """Every value of a strided 4-D source, in row-major order: rounded into ``first`` (``split`` False; the
    rounding's constants as :func:`round_bits` gives them), or split into ``first`` and ``second`` (True;
    whether a value was Inf or NaN is returned). Each row of ``n3`` values lands where the outputs' row strides
    ``o0, o1, o2`` put it (dense rows, gaps between them allowed: halves of a concatenated operand). The
    branches are loop-invariant: LLVM makes a vectorised loop of each where the source's rows are dense."""
    bias, odd, drop, mask = np.int32(bias), np.int32(odd), np.int32(drop), np.int32(mask)  # int32 lanes
    special = np.int32(0)
    row, step = np.uint64(n3), np.uint64(s3)
    starts = _row_starts(s0, s1, s2, n0, n1, n2)
    outs = starts if (o0, o1, o2) == (s0, s1, s2) else _row_starts(o0, o1, o2, n0, n1, n2)
    for r in range(starts.size):
        s, d = starts[r], outs[r]  # (unsigned throughout: numba makes int64 times uint64 a float)
        for i in range(row):
            u = src[s + i] if s3 == 1 else src[s + i * step]
            if split:
                special |= _special(u)
                first[d + i], second[d + i] = _parts(u, summed)
            else:
                first[d + i] = _rounded(u, bias, odd, drop, mask)
    return special == 0


def _dense(shape: tuple) -> tuple:
    """The row strides (elements) of a dense row-major array of the 4-D ``shape``."""
    return shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3]


def split_tf32x3(src: np.ndarray, strides: tuple, shape: tuple, big: np.ndarray, second: np.ndarray,
                 summed: bool = False, out_strides: Optional[tuple] = None) -> bool:
    """``formats.split_tf32x3`` of a strided 4-D operand in one pass: ``src`` is a flat int32 array (float32
    bits) that ``shape`` indexes with ``strides`` (elements); ``big`` and ``second`` are flat arrays where
    ``shape``'s rows go, dense in its row-major order (or each row where the row strides ``out_strides`` of its
    first three dims put it), filled with ``big = rz(x)`` and ``small = rna(x - big)`` (or ``big + small`` in
    float32 when ``summed``). None of the values written may overlap another or ``src``. False where ``src``
    holds an Inf or a NaN: what was written is then not the tensor code's, which the caller runs instead."""
    return _each(src, *strides, big, second, *(out_strides or _dense(shape)), *shape, True, 0, 0, 0, 0, summed)


def round_bits(src: np.ndarray, strides: tuple, shape: tuple, dst: np.ndarray, drop: int,
               rounding: str, out_strides: Optional[tuple] = None) -> np.ndarray:
    """A strided 4-D operand rounded to ``23 - drop`` mantissa bits in one pass: ``src`` is a flat int32 array
    (float32 bits) that ``shape`` indexes with ``strides`` (elements); ``dst``, a flat array of ``shape``'s size,
    is filled in its row-major order (or each row where ``out_strides`` puts it, as :func:`split_tf32x3`) and
    returned (it may be ``src`` itself, laid out alike). ``rounding`` ``"rna"``, ``"rne"`` or ``"rz"`` as
    ``formats._round_bits``, and every NaN as it was."""
    half = 1 << (drop - 1)
    bias, odd = {"rna": (half, 0), "rne": (half - 1, 1), "rz": (0, 0)}[rounding]
    _each(src, *strides, dst, dst, *(out_strides or _dense(shape)), *shape, False, bias, odd, drop, -(1 << drop),
          False)
    return dst
