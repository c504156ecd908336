"""Compiled kernels for the emulated LSTM (:mod:`tf32lab.emulation.recurrent`; numba, the optional extra
``tf32lab[fast]``): the pointwise derivatives of every step in one pass (:func:`lstm_factors`), and a step's
pointwise work between its tensor kernels, forward (:func:`lstm_cell`, :func:`lstm_hidden`) and backward
(:func:`lstm_back`), each bit for bit what the tensor kernels compute.

The tensor code makes them with seventeen passes over memory, one per product or difference, and a
concatenation: a sixth of an LSTM layer's backward on one thread. :func:`lstm_factors` reads each saved activation once
and writes each factor once, with the same float32 operations in the same order and no contraction into fused
multiply-adds (no ``fastmath``), so that it gives the tensor code's bits (the tests compare the two). The
tangents stay the caller's (torch's vectorised tanh; this kernel takes them). Imported only when numba is
installed.

Example:

    >>> import numpy as np
    >>> from tf32lab.numbers.recurrent_kernels import lstm_factors
    >>> acts, g, tanh_c, c = (np.full(s, 0.5, np.float32) for s in ((1, 1, 4), (1, 1, 1), (1, 1, 1), (1, 1, 1)))
    >>> from_h, factors = np.empty((1, 1, 1), np.float32), np.empty((1, 1, 4), np.float32)
    >>> lstm_factors(acts, g, tanh_c, c, np.zeros((1, 1), np.float32), from_h, factors)
    >>> from_h.ravel().tolist(), factors.ravel().tolist()
    ([0.375], [0.125, 0.0, 0.375, 0.125])
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba import types
from numba.extending import intrinsic

from tf32lab.numbers.compiled import one_signature
from tf32lab.numbers.rounding_kernels import as_bits, as_float

__all__ = ["constants", "fused", "lstm_back", "lstm_cell", "lstm_factors", "lstm_hidden"]

_OPTIONS = {"cache": True, "error_model": "numpy", "boundscheck": False, "nogil": True}  # no fastmath


_IN3, _OUT3 = types.Array(types.float32, 3, "C", readonly=True), types.Array(types.float32, 3, "C")


@one_signature(_IN3, _IN3, _IN3, _IN3, types.Array(types.float32, 2, "C", readonly=True), _OUT3, _OUT3)
@nb.njit(**_OPTIONS)  # compiled once, for C-contiguous arrays (compiled.one_signature)
def lstm_factors(acts, g, tanh_c, c, c0, from_h, factors):  # pragma: no cover - compiled
    """An LSTM layer's derivatives, every step (``acts``: i, f, ·, o after the sigmoid, ``[steps, batch, 4
    hidden]``; ``g``, ``tanh_c`` and ``c``: ``[steps, batch, hidden]``; ``c0``: ``[batch, hidden]``; all float32
    and C-contiguous): ``from_h = o (1 - tanh(c)²)`` and ``factors`` = (g i (1 - i), c_before f (1 - f),
    i (1 - g²), tanh(c) o (1 - o)) along the last axis, each product taken left to right as the tensor code
    ``recurrent._lstm_backward`` takes it."""
    steps, batch, size = g.shape
    one = np.float32(1)
    for t in range(steps):
        for b in range(batch):
            for j in range(size):
                i, f, o = acts[t, b, j], acts[t, b, size + j], acts[t, b, 3 * size + j]
                gate, tc = g[t, b, j], tanh_c[t, b, j]
                before = c0[b, j] if t == 0 else c[t - 1, b, j]
                from_h[t, b, j] = o * (one - tc * tc)
                factors[t, b, j] = gate * i * (one - i)
                factors[t, b, size + j] = before * f * (one - f)
                factors[t, b, 2 * size + j] = i * (one - gate * gate)
                factors[t, b, 3 * size + j] = tc * o * (one - o)


# -- the steps: the pointwise work of one step between its tensor kernels ------------------------------------
# Each kernel below does what a run of exactly rounded tensor kernels does (products, and addcmul's fused
# multiply-add, which PyTorch's CPU kernel contracts: ``recurrent._compiled_steps`` checks that before using them),
# and rounds the next GEMM's operand with ``formats.hot_bits_rounder``'s integer arithmetic. It writes no input, and
# answers False where a result is a NaN: the caller then runs the step's tensor kernels, which write over what it
# wrote (which of two NaNs a product keeps is the instruction's choice, which a compiled loop need not make as
# PyTorch's does; a NaN among the inputs makes a NaN result). The loops run along one row's contiguous run of one
# gate, a few arrays each: with more, LLVM does not vectorise them (its runtime checks for overlap are bounded).

@intrinsic
def _fma(typingctx, a, b, c):  # pragma: no cover - compiled
    """a b + c rounded once (float32), as ``torch.addcmul`` computes it on the CPU."""
    def codegen(context, builder, signature, args):
        return builder.fma(*args)  # llvm.fma.f32: one rounding, on any target

    return types.float32(types.float32, types.float32, types.float32), codegen


@nb.njit(**_OPTIONS, inline="always")
def _rounded(x, bias, odd, drop, mask):  # pragma: no cover - compiled
    """``x`` rounded as ``formats.hot_bits_rounder`` rounds it (int32 constants; no NaN kept)."""
    u = as_bits(x)
    return as_float((u + bias + ((u >> drop) & odd)) & mask)


_F2, _F3, _I = types.Array(types.float32, 2, "C"), types.Array(types.float32, 3, "C"), types.int64


@one_signature(_F3, _I, _F3, _I, _F3, _I, _F3, _I)
@nb.njit(**_OPTIONS)
def lstm_cell(acts, ka, g, kg, before, kb, c, kc):  # pragma: no cover - compiled
    """An LSTM step's cell state, ``c[kc] = i g[kg] + f before[kb]`` with ``i, f`` of ``acts[ka]`` (i, f, ·, o
    after the sigmoid, ``[·, batch, 4 hidden]``; the others ``[·, batch, hidden]``; ``c[kc]`` not ``before[kb]``):
    ``torch.mul(f, before)`` then ``torch.addcmul(·, i, g)``. False where a result is a NaN."""
    size = g.shape[2]
    nan = False
    for b in range(g.shape[1]):
        i, f, gate, prev, out = acts[ka, b, :size], acts[ka, b, size:2 * size], g[kg, b], before[kb, b], c[kc, b]
        for j in range(size):
            x = _fma(i[j], gate[j], f[j] * prev[j])
            out[j] = x
            nan |= x != x
    return not nan


@one_signature(_F3, _I, _F2, _F3, _I, _F2, _I, _I, _I, _I)
@nb.njit(**_OPTIONS)
def lstm_hidden(acts, ka, tanh_c, out, t, held, bias, odd, drop, mask):  # pragma: no cover - compiled
    """An LSTM step's hidden state, ``out[t] = o tanh_c`` with ``o`` of ``acts[ka]`` (``torch.mul``), and its
    rounding into ``held`` (``bias``, ``odd``, ``drop``, ``mask``: :func:`constants`). False where a result is a
    NaN."""
    size = tanh_c.shape[1]
    bias32, odd32, drop32, mask32 = np.int32(bias), np.int32(odd), np.int32(drop), np.int32(mask)
    nan = False
    for b in range(tanh_c.shape[0]):
        o, tc, h, r = acts[ka, b, 3 * size:], tanh_c[b], out[t, b], held[b]
        for j in range(size):
            x = o[j] * tc[j]
            h[j] = x
            r[j] = _rounded(x, bias32, odd32, drop32, mask32)
            nan |= x != x
    return not nan


@one_signature(_F2, _F2, _F2, _F3, _F3, _F3, _F3, _F2, _I, _F3, _F3, _I, _I, _I, _I)
@nb.njit(**_OPTIONS)
def lstm_back(dh, dc, dc_out, acts, g, tanh_c, c, c0, k, d_gates, rounded, bias, odd, drop,
              mask):  # pragma: no cover - compiled
    """Step ``k`` of an LSTM's backward, its derivatives (:func:`lstm_factors`' products) made on the way: with
    ``acts``, ``g``, ``tanh_c`` and ``c`` the forward's slabs (``[steps, batch, ·]``), ``c0`` the first state and
    ``dh``, ``dc``, ``dc_out`` ``[batch, hidden]``: ``dc_out = addcmul(dc, dh, from_h)``, ``d_gates[k] = (dc_out,
    dc_out, dc_out, dh) factors``, ``dc_out *= f``, and ``d_gates[k]`` rounded into ``rounded[k]``. False where a
    result is a NaN."""
    batch, size = dc.shape
    bias32, odd32, drop32, mask32 = np.int32(bias), np.int32(odd), np.int32(drop), np.int32(mask)
    one = np.float32(1)
    nan = False
    for b in range(batch):
        i, f, o = acts[k, b, :size], acts[k, b, size:2 * size], acts[k, b, 3 * size:]
        gate, tc, prev = g[k, b], tanh_c[k, b], (c0[b] if k == 0 else c[k - 1, b])
        grad, old, carried, gates, kept = dh[b], dc[b], dc_out[b], d_gates[k, b], rounded[k, b]
        for j in range(size):  # addcmul(dc, dh, o (1 - tanh(c)²))
            carried[j] = _fma(grad[j], o[j] * (one - tc[j] * tc[j]), old[j])
        # each gate's run in a loop of its own over few arrays, so that LLVM vectorises it
        gq, rq = gates[:size], kept[:size]
        for j in range(size):
            x = carried[j] * (gate[j] * i[j] * (one - i[j]))
            gq[j], rq[j] = x, _rounded(x, bias32, odd32, drop32, mask32)
            nan |= x != x
        gq, rq = gates[size:2 * size], kept[size:2 * size]
        for j in range(size):
            x = carried[j] * (prev[j] * f[j] * (one - f[j]))
            gq[j], rq[j] = x, _rounded(x, bias32, odd32, drop32, mask32)
            nan |= x != x
        gq, rq = gates[2 * size:3 * size], kept[2 * size:3 * size]
        for j in range(size):
            x = carried[j] * (i[j] * (one - gate[j] * gate[j]))
            gq[j], rq[j] = x, _rounded(x, bias32, odd32, drop32, mask32)
            nan |= x != x
        gq, rq = gates[3 * size:], kept[3 * size:]
        for j in range(size):
            x = grad[j] * (tc[j] * o[j] * (one - o[j]))
            gq[j], rq[j] = x, _rounded(x, bias32, odd32, drop32, mask32)
            nan |= x != x
        for j in range(size):
            y = carried[j] * f[j]
            carried[j] = y
            nan |= y != y
    return not nan


@one_signature(types.Array(types.float32, 1, "C"), types.Array(types.float32, 1, "C"),
               types.Array(types.float32, 1, "C"), types.Array(types.float32, 1, "C"))
@nb.njit(**_OPTIONS)
def fused(a, b, c, out):  # pragma: no cover - compiled
    """``out = a b + c`` rounded once: what ``recurrent._compiled_steps`` compares with ``torch.addcmul``."""
    for j in range(out.size):
        out[j] = _fma(a[j], b[j], c[j])


def constants(drop: int, rounding: str) -> tuple[int, int, int, int]:
    """The rounding's ``(bias, odd, drop, mask)`` for the step kernels: ``formats.hot_bits_rounder``'s arithmetic
    for ``23 - drop`` mantissa bits, ``rounding`` ``"rna"``, ``"rne"`` or ``"rz"``."""
    half = 1 << (drop - 1)
    bias, odd = {"rna": (half, 0), "rne": (half - 1, 1), "rz": (0, 0)}[rounding]
    return bias, odd, drop, -(1 << drop)
