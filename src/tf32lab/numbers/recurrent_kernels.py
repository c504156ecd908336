"""A compiled kernel for the emulated LSTM's backward (:mod:`tf32lab.emulation.recurrent`): the pointwise
derivatives of every step in one pass (numba, the optional extra ``tf32lab[fast]``).

The tensor code makes them with seventeen passes over memory, one per product or difference, and a
concatenation: a sixth of an LSTM layer's backward on one thread. This kernel reads each saved activation once
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

from tf32lab.numbers.compiled import one_signature

__all__ = ["lstm_factors"]

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
