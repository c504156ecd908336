"""PyTorch's LSTM, GRU and plain RNN step by step, every GEMM a given function ``linear(x, w, b)`` (the emulator's
rounded product, or an autograd Function around it): over a padded batch (:func:`run_rnn`, what ``torch._VF.lstm``
computes for a tensor) and over a packed sequence (:func:`run_packed_rnn`, for a ``PackedSequence``). The general
form, for what ``emulation.recurrent``'s whole-sequence loops do not cover (a projection, a plain RNN, a split math,
a packed batch); the same kernels in the same order as those loops.

Example:

    >>> import torch, torch.nn.functional as F
    >>> from tf32lab.emulation.rnn_steps import run_rnn
    >>> lstm, x = torch.nn.LSTM(3, 4), torch.randn(5, 2, 3)
    >>> h0 = torch.zeros(1, 2, 4)
    >>> with torch.no_grad():
    ...     out, h, c = run_rnn("lstm", F.linear, x, (h0, h0), lstm._flat_weights, True, 1, 0.0, False, False, False)
    ...     torch.allclose(out, lstm(x)[0], atol=1e-6)
    True
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from tf32lab.emulation import recurrent


def run_rnn(mode: str, linear: Callable, x, hx, params, has_biases, num_layers, dropout, train, bidirectional,
            batch_first, step: Optional[Callable] = None):
    """PyTorch's multi-layer (bi)directional LSTM / GRU / RNN, with every GEMM done by ``linear(x, w, b)``;
    ``step(acc, h, w)``, when given, is ``acc + h wᵀ`` in one GEMM (the recurrent product of LSTMs and plain RNNs,
    whose hidden bias is then added to the input projection once for all steps)."""
    if batch_first:
        x = x.transpose(0, 1)
    unbatched = x.dim() == 2
    if unbatched:
        x = x.unsqueeze(1)
    dirs = 2 if bidirectional else 1
    per = len(params) // (num_layers * dirs)
    lstm = mode == "lstm"
    h0, c0 = (hx[0], hx[1]) if lstm else (hx, None)
    if unbatched:
        h0, c0 = h0.unsqueeze(1), (c0.unsqueeze(1) if c0 is not None else None)
    fused = step is not None and mode != "gru"  # a GRU needs h wᵀ on its own (r scales its n part)

    def direction(layer_in, idx: int, reverse: bool):
        h, c = h0[idx], (c0[idx] if lstm else None)
        gates_x, cell = _direction(mode, linear, step if fused else None, layer_in, params, idx, per, has_biases)
        out = [None] * layer_in.size(0)
        for t in range(layer_in.size(0) - 1, -1, -1) if reverse else range(layer_in.size(0)):
            h, c = cell(gates_x[t], h, c)
            out[t] = h
        return torch.stack(out), h, c

    layer_in, hs, cs = recurrent.stacked(x, num_layers, dirs, dropout, train, direction)
    return recurrent.assembled(layer_in, hs, cs, lstm, unbatched, batch_first)


def run_packed_rnn(mode: str, linear: Callable, data, batch_sizes, hx, params, has_biases, num_layers, dropout,
                   train, bidirectional, step: Optional[Callable] = None):
    """:func:`run_rnn` over a packed sequence (``torch._VF.lstm(data, batch_sizes, hx, ...)``, what ``nn.LSTM``
    calls with a ``PackedSequence``): ``data`` holds step 0's rows, then step 1's..., ``batch_sizes[t]`` of them,
    the longest sequences first. Step t runs the first ``batch_sizes[t]`` sequences; a sequence's final state is
    its state after its own last step; the reverse direction starts each sequence at its own last step, from its
    initial state (ATen's ``PackedLayer`` and ``ReversedPackedLayer``, aten/src/ATen/native/RNN.cpp). Every GEMM is
    ``linear``'s (the input projection of all rows at once, as for a padded batch), the same math as there."""
    sizes = [int(n) for n in batch_sizes.tolist()]
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    dirs = 2 if bidirectional else 1
    per = len(params) // (num_layers * dirs)
    lstm = mode == "lstm"
    h0, c0 = (hx[0], hx[1]) if lstm else (hx, None)
    fused = step is not None and mode != "gru"

    def direction(layer_in, idx: int, reverse: bool):
        gates_x, cell = _direction(mode, linear, step if fused else None, layer_in, params, idx, per, has_biases)
        out: list = [None] * len(sizes)
        if not reverse:  # sequences drop out as they end: their rows keep their last state
            h, c = h0[idx], (c0[idx] if lstm else None)
            for t, n in enumerate(sizes):
                h_t, c_t = cell(gates_x[offsets[t]:offsets[t + 1]], h[:n], c[:n] if lstm else None)
                out[t] = h_t
                h = torch.cat((h_t, h[n:])) if n < h.size(0) else h_t
                c = (torch.cat((c_t, c[n:])) if n < c.size(0) else c_t) if lstm else None
        else:  # sequences join as the steps go back to their own last step, from their initial state
            h, c = h0[idx][:0], (c0[idx][:0] if lstm else None)
            for t in range(len(sizes) - 1, -1, -1):
                n = sizes[t]
                if n > h.size(0):
                    h = torch.cat((h, h0[idx][h.size(0):n]))
                    c = torch.cat((c, c0[idx][c.size(0):n])) if lstm else None
                h, c = cell(gates_x[offsets[t]:offsets[t + 1]], h, c)
                out[t] = h
        return torch.cat(out), h, c

    layer_in, hs, cs = recurrent.stacked(data, num_layers, dirs, dropout, train, direction)
    h_n = torch.stack(hs)
    return (layer_in, h_n, torch.stack(cs)) if lstm else (layer_in, h_n)


def _direction(mode: str, linear: Callable, step: Optional[Callable], layer_in, params, idx: int, per: int,
               has_biases: bool):
    """One layer and direction's input projection of every row at once (as cuDNN makes it; with ``step``, the
    hidden bias added once here) and its :class:`_Cell`."""
    w_ih, w_hh, b_ih, b_hh, w_hr = recurrent.direction_weights(params, idx, per, has_biases)
    gates_x = linear(layer_in, w_ih, b_ih)
    if step is not None and b_hh is not None:
        gates_x = gates_x + b_hh
    return gates_x, _Cell(mode, linear, step, w_hh, b_hh, w_hr)


class _Cell:
    """One step of an LSTM, GRU or plain RNN on the rows it is given, as :func:`run_rnn`'s loop computes it:
    ``cell(gates_x, h, c) -> (h, c)`` (``c`` None but for an LSTM)."""

    def __init__(self, mode: str, linear: Callable, step: Optional[Callable], w_hh, b_hh, w_hr) -> None:
        self.mode, self.linear, self.step, self.w_hh, self.b_hh, self.w_hr = mode, linear, step, w_hh, b_hh, w_hr

    def __call__(self, gates_x, h, c):
        linear, step, w_hh, b_hh = self.linear, self.step, self.w_hh, self.b_hh
        if self.mode == "lstm":
            gates = step(gates_x, h, w_hh) if step is not None else gates_x + linear(h, w_hh, b_hh)
            size = gates.size(-1) // 4
            g = torch.tanh(gates[..., 2 * size:3 * size])
            act = gates.sigmoid_() if step is not None else torch.sigmoid(gates)  # i, f, o (g's slot unused)
            c = torch.addcmul(act[..., size:2 * size] * c, act[..., :size], g)
            h = act[..., 3 * size:] * torch.tanh(c)
            return (linear(h, self.w_hr, None) if self.w_hr is not None else h), c
        if self.mode == "gru":
            hidden = h.size(-1)
            x_r, x_z, x_n = gates_x.split(hidden, -1)
            h_r, h_z, h_n = linear(h, w_hh, b_hh).split(hidden, -1)
            r, z = torch.sigmoid(x_r + h_r), torch.sigmoid(x_z + h_z)
            n = torch.tanh(x_n + r * h_n)
            return n + z * (h - n), None
        pre = step(gates_x, h, w_hh) if step is not None else gates_x + linear(h, w_hh, b_hh)
        return (torch.tanh(pre) if self.mode == "rnn_tanh" else torch.relu(pre)), None
