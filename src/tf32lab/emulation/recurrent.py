"""Whole-sequence LSTM and GRU layers for the emulator: cuDNN's RNN kernel with its GEMMs' operands rounded.

On the target one cuDNN kernel runs a layer: the input projection of all time steps as one GEMM, then one GEMM
per step on the hidden state, then (training) the backward GEMMs: one per step for the hidden state's gradient
and one over the whole sequence for the recurrent weight's (Appleyard, Kocisky and Blunsom, "Optimizing
performance of recurrent neural networks on GPUs", arXiv:1604.01946, describe these groupings; cuDNN's
``cudnnRNNBackwardWeights`` takes the whole sequence at once). Every GEMM rounds its operands to the rnn family's
math (TF32 at ``high`` on an A100), so the hidden state is rounded at every step.

Each layer and direction is one ``torch.autograd.Function`` here: its forward runs the steps with the fewest
kernels it can (the same kernels, in the same order, as :func:`tf32lab.emulation.rnn_steps.run_rnn` with a fused
step, so a forward gives the bits it gave before), and keeps what the backward needs; its backward runs the
sequence backwards with the pointwise derivatives computed for all steps at once (or, compiled, within each
step's one call), one rounding and one GEMM per step, and the weight gradient as one GEMM. Per-step autograd
nodes (thousands for a speaker encoder) cost 8x a native forward and backward of an LSTM, 5x of a GRU; this costs
about 1.4x and 0.9x (docs/benchmarks.md).

Covered: ``lstm`` without ``proj_size`` and ``gru``, float32, in a math rounded once per operand (``tf32``,
``bf16``). :func:`layers` answers ``None`` for anything else, which :func:`~tf32lab.emulation.rnn_steps.run_rnn` runs.
The same loops with nothing rounded (:func:`exact_layers`) run the float64 reference's recurrences
(``measure.reference``): ATen's float64 LSTM, with no oneDNN kernel for float64, took 2.5-3x as long a step.

Example (the emulator calls it; a user meets it as an LSTM under ``emulate``):

    >>> import torch, tf32lab
    >>> lstm, x = torch.nn.LSTM(8, 16), torch.randn(5, 2, 8, requires_grad=True)
    >>> with tf32lab.precision("high"), tf32lab.emulate("a100"):
    ...     out, _ = lstm(x)
    ...     out.sum().backward()
    >>> out.shape, x.grad.shape
    (torch.Size([5, 2, 16]), torch.Size([5, 2, 8]))
"""

from __future__ import annotations

import functools
import math as _pymath
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from tf32lab.errors import Tf32LabError
from tf32lab.numbers import formats
from tf32lab.numbers.compiled import kernels

__all__ = ["EXACT", "Kit", "assembled", "exact_layers", "layers"]

_ROUND = {"tf32": formats.round_tf32, "bf16": formats.round_bf16}
EXACT = "exact"  # a kit's math that rounds nothing: the recurrence in its operands' own precision


@dataclass(frozen=True)
class Kit:
    """What the emulator gives a recurrence: its GEMMs in the rnn family's math.

    ``linear(x, w, b)`` is x wᵀ + b with rounded operands (an autograd Function when gradients are wanted),
    ``product(x, w, b)`` the same without autograd, ``weight(w)`` a rounded weight (the block's cached copy of
    a parameter), ``name`` and ``rounding`` the math, ``nan_free`` whether the op's inputs hold no NaN,
    ``count(op, n)`` counts ``n`` GEMMs as ``op`` in the block's coverage, and ``quietly(fn)`` runs ``fn`` as the
    forward runs: the emulator's dispatch mode off (this code rounds its own GEMMs; through the mode every
    pointwise op would pay a Python handler, and every GEMM a second rounding) and native GEMMs at IEEE.
    """

    linear: Callable
    product: Callable
    weight: Callable[[torch.Tensor], torch.Tensor]
    name: str
    rounding: str
    nan_free: bool
    count: Callable[[str, int], None]
    quietly: Callable[[Callable], object]

    def rounder(self, nan_free: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """``fn(x, out)``: ``x`` rounded into ``out``; the checks-free kernel where every NaN is a default one
        (``x`` itself, unrounded, for the exact kit)."""
        if self.name == EXACT:
            return lambda x, out: x
        fn = _ROUND[self.name]
        hot = formats.hot_rounder(self.name, self.rounding) if nan_free else None

        def round_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            if hot is not None and x.is_cpu and x.is_contiguous():
                return hot(x, out)
            return fn(x, self.rounding, out=out, default_nans=nan_free)

        return round_into

    def step_rounder(self, nan_free: bool, source: torch.Tensor, into: torch.Tensor
                     ) -> Callable[[int, torch.Tensor], torch.Tensor]:
        """``fn(k, x)``: ``x`` (which is ``source[k]``; any tensor when ``k`` is -1) rounded into ``into[k]`` when
        ``into`` is a slab of ``source``'s shape, else into ``into`` itself, and returned; for a loop over the
        steps of ``source``. On the CPU the checks-free kernel runs on int32 views of every step made once (the
        views cost as much as the rounding), elsewhere :meth:`rounder`'s."""
        if self.name == EXACT:
            return lambda k, x: x
        round_into = self.rounder(nan_free)
        slab = into.dim() == source.dim()
        outs = into.unbind(0) if slab else None
        if not (nan_free and source.is_cpu and source.is_contiguous() and into.is_contiguous()):
            return lambda k, x: round_into(x, outs[k] if slab else into)
        on_bits = formats.hot_bits_rounder(self.name, self.rounding)
        steps = source.view(torch.int32).unbind(0)
        bits = into.view(torch.int32).unbind(0) if slab else None
        one = into.view(torch.int32)

        def round_step(k: int, x: torch.Tensor) -> torch.Tensor:
            if k < 0:
                return round_into(x, outs[k] if slab else into)
            on_bits(steps[k], bits[k] if slab else one)
            return outs[k] if slab else into

        return round_step

    def round(self, x: torch.Tensor) -> torch.Tensor:
        """A rounded copy of ``x`` (NaNs kept)."""
        return x.clone() if self.name == EXACT else _ROUND[self.name](x.contiguous(), self.rounding)


def covered(mode: str, name: str, params, per: int) -> bool:
    """Whether :func:`layers` runs this RNN: an LSTM without projection or a GRU, float32 in a single-round math,
    or float64 with the exact kit."""
    return (mode in ("lstm", "gru") and (name in _ROUND or name == EXACT) and per in (2, 4)
            and all(p.dtype == _dtype(name) or (name == EXACT and p.dtype == torch.float32) for p in params))


def _dtype(name: str) -> torch.dtype:
    return torch.float64 if name == EXACT else torch.float32


def exact_layers(mode: str, x, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    """:func:`layers` in float64 with nothing rounded and no autograd graph, for a reference run (``None`` where
    :func:`covered` says no, for dropout between layers, whose draws ATen's own kernel makes, and for a sequence of
    no steps, which ATen refuses: "Expected sequence length to be larger than 0 in RNN"). ``params`` may be float32:
    each direction's are widened as it runs.

    Example:

        >>> import torch
        >>> lstm, x = torch.nn.LSTM(3, 4, 2).double(), torch.randn(5, 2, 3, dtype=torch.float64)
        >>> h0 = torch.zeros(2, 2, 4, dtype=torch.float64)
        >>> with torch.no_grad():
        ...     out, h, c = exact_layers("lstm", x, (h0, h0), lstm._flat_weights, True, 2, 0.0, False, False, False)
        ...     torch.allclose(out, lstm(x)[0], rtol=0, atol=1e-14)
        True
    """
    if (dropout and train and num_layers > 1) or x.size(1 if batch_first and x.dim() == 3 else 0) == 0:
        return None
    kit = Kit(F.linear, F.linear, _float64, EXACT, "", True, lambda op, n: None, lambda fn: fn())
    return layers(mode, kit, x, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first,
                  grad=False)


def _float64(w: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The exact kit's weight: a float32 one widened as its direction runs (the reference's float64 copies of a
    whole RNN's weights at once were a third of an LSTM encoder's check memory over its forward)."""
    return w.double() if w is not None and w.dtype == torch.float32 else w


def direction_weights(params, idx: int, per: int, has_biases: bool) -> tuple:
    """One layer and direction's weights in ``torch._VF.lstm``'s flat list (``per`` a direction: w_ih, w_hh, then
    b_ih, b_hh where there are biases, then an LSTM's projection w_hr): ``(w_ih, w_hh, b_ih, b_hh, w_hr)``, the
    missing ones None."""
    p = params[idx * per:(idx + 1) * per]
    b_ih, b_hh = (p[2], p[3]) if has_biases else (None, None)
    return p[0], p[1], b_ih, b_hh, (p[-1] if per in (3, 5) else None)


def layers(mode: str, kit: Kit, x, hx, params, has_biases, num_layers, dropout, train, bidirectional,
           batch_first, grad: bool):
    """PyTorch's multi-layer (bi)directional LSTM or GRU (``torch._VF.lstm``'s arguments), each layer and
    direction one whole-sequence step loop; ``grad``: build the autograd graph (one node per layer and
    direction). ``None`` when :func:`covered` says no."""
    dirs = 2 if bidirectional else 1
    per = len(params) // (num_layers * dirs)
    if not covered(mode, kit.name, params, per) or x.dtype != _dtype(kit.name):
        return None
    if batch_first:
        x = x.transpose(0, 1)
    unbatched = x.dim() == 2
    if unbatched:
        x = x.unsqueeze(1)
    lstm = mode == "lstm"
    h0, c0 = (hx[0], hx[1]) if lstm else (hx, None)
    if unbatched:
        h0, c0 = h0.unsqueeze(1), (c0.unsqueeze(1) if c0 is not None else None)
    linear = kit.linear if grad else kit.product

    def direction(layer_in, idx: int, reverse: bool):
        w_ih, w_hh, b_ih, b_hh, _ = direction_weights(params, idx, per, has_biases)
        if kit.name == EXACT and not grad:
            return _exact_direction(lstm, kit, layer_in, w_ih, w_hh, b_ih, b_hh, h0[idx],
                                    c0[idx] if lstm else None, reverse)
        gates_x = linear(layer_in, w_ih, b_ih)  # all steps at once, as cuDNN does
        if lstm:
            if b_hh is not None:  # the hidden bias once for all steps (in place: a fresh product)
                gates_x = gates_x + b_hh if grad else gates_x.add_(b_hh)
            args = (gates_x, h0[idx], c0[idx], w_hh, kit, reverse)
            out, h, c = _Lstm.apply(*args) if grad else _lstm_forward(*args, None)
        else:
            args = (gates_x, h0[idx], w_hh, b_hh, kit, reverse)
            out, h = _Gru.apply(*args) if grad else _gru_forward(*args, None)
            c = None
        return out, (h if grad else h.clone()), c  # not a view that keeps the layer's whole output alive

    layer_in, hs, cs = stacked(x, num_layers, dirs, dropout, train, direction)
    return assembled(layer_in, hs, cs, lstm, unbatched, batch_first)


# steps whose input projection the float64 reference makes at once: the whole sequence's, 8 bytes a gate of every
# step, was the largest tensor of an LSTM encoder's check (10 MiB of 8 x 160 x 1024), at its peak memory
_EXACT_STEPS = 32


def _exact_direction(lstm: bool, kit: Kit, layer_in, w_ih, w_hh, b_ih, b_hh, h, c, reverse: bool):
    """One layer and direction in the exact kit, the input projection made :data:`_EXACT_STEPS` steps at a time
    (nothing is rounded: no order of cuDNN's to follow); ``(out, h, c)``, ``c`` None for a GRU."""
    steps = layer_in.size(0)
    out = layer_in.new_empty(steps, *h.shape)
    starts = range(0, steps, _EXACT_STEPS)
    w_ih, w_hh, b_ih, b_hh = (kit.weight(w) for w in (w_ih, w_hh, b_ih, b_hh))  # this direction's, for its run
    w_t = w_hh.t() if lstm else None  # once for every part
    for start in reversed(starts) if reverse else starts:
        part = slice(start, min(start + _EXACT_STEPS, steps))
        gates_x = kit.product(layer_in[part], w_ih, b_ih)
        if lstm:
            if b_hh is not None:
                gates_x.add_(b_hh)
            ran, h, c = _lstm_forward(gates_x, h, c, w_hh, kit, reverse, None, w_t)
        else:
            ran, h = _gru_forward(gates_x, h, w_hh, b_hh, kit, reverse, None)
        out[part] = ran
    return out, h.clone(), c


def stacked(layer_in, num_layers: int, dirs: int, dropout: float, train: bool, direction: Callable):
    """A multi-layer (bi)directional RNN's layers in PyTorch's order: ``direction(layer_in, idx, reverse)`` runs
    one layer and direction (``idx`` its place in ``torch._VF.lstm``'s weight list) to ``(out, h, c)``; a layer's
    directions' outputs are concatenated, then dropped out (in training) as the next layer's input. Returns the
    last layer's output and every direction's final states, in order."""
    hs, cs = [], []
    for layer in range(num_layers):
        outs = []
        for d in range(dirs):
            out, h, c = direction(layer_in, layer * dirs + d, bool(d))
            outs.append(out)
            hs.append(h)
            cs.append(c)
        layer_in = torch.cat(outs, -1) if dirs == 2 else outs[0]
        del outs  # not alive beside the next layer's projection
        if dropout and train and layer < num_layers - 1:
            layer_in = F.dropout(layer_in, dropout, True)
    return layer_in, hs, cs


def assembled(layer_in, hs, cs, lstm: bool, unbatched: bool, batch_first: bool):
    """The last layer's output and each layer's final states, shaped as ``torch._VF.lstm`` / ``gru`` return them."""
    output, h_n = layer_in, torch.stack(hs)
    c_n = torch.stack(cs) if lstm else None
    if unbatched:
        output, h_n = output.squeeze(1), h_n.squeeze(1)
        c_n = c_n.squeeze(1) if lstm else None
    if batch_first:
        output = output.transpose(0, 1)
    return (output, h_n, c_n) if lstm else (output, h_n)


def _order(steps: int, reverse: bool) -> range:
    return range(steps - 1, -1, -1) if reverse else range(steps)


def _in_order(t: torch.Tensor, reverse: bool) -> torch.Tensor:
    """A time-major stack in the order the steps ran (time reversed for the backward direction)."""
    return t.flip(0) if reverse else t


def _before(first: torch.Tensor, ran: torch.Tensor) -> torch.Tensor:
    """The state each step started from: ``first``, then the states of the steps before it (in run order)."""
    return torch.cat((first.unsqueeze(0), ran[:-1]))


# -- LSTM ---------------------------------------------------------------------------------------------------
def _lstm_forward(gates_x, h, c, w_hh, kit: Kit, reverse: bool, saved: Optional[list],
                  w_t: Optional[torch.Tensor] = None):
    """The steps of one layer and direction; ``saved`` (a list) receives the activations (i, f, ·, o after the
    sigmoid), g and c of every step, in run order. The kernels and their order are the fused step's of
    ``rnn_steps.run_rnn`` (the same bits); each writes into a preallocated slab through views made once (``unbind``),
    so that a step makes no tensor and nothing is stacked after: a step's pointwise work is a few microseconds,
    as much as a Python-level view or allocation costs. Where :func:`_compiled_steps` allows, the steps run in
    :func:`_lstm_compiled_forward`: the same kernels, those after each step's activations compiled. ``w_t``:
    ``w_hh`` rounded already and viewed transposed, by a caller that runs a direction in parts. A view, not a
    transposed copy: the step's GEMM is then the one ``F.linear`` runs (MKL's "NT" case), 80 µs for 8 x 256 by
    256 x 1024 on an AVX512 EPYC against 119 µs from a contiguous transpose (docs/design.md, "Recurrent layers")."""
    steps = gates_x.size(0)
    size = h.size(-1)
    if w_t is None:
        w_t = kit.weight(w_hh).t()  # rounded once per call; a view (see the docstring)
    held = torch.empty_like(h, memory_format=torch.contiguous_format)  # the rounded hidden state
    out = gates_x.new_empty(steps, *h.shape)
    round_h = kit.step_rounder(kit.nan_free, out, held)
    keep = saved is not None
    compiled = _compiled_steps(kit, gates_x) if kit.nan_free and h.dim() == 2 else None
    if compiled is not None:
        return _lstm_compiled_forward(compiled, gates_x, h, c, w_t, kit, reverse, saved, held, out, round_h)
    acts = gates_x.new_empty(gates_x.shape if keep else gates_x.shape[1:])
    gs = gates_x.new_empty(out.shape) if keep else torch.empty_like(held)
    cs = gates_x.new_empty(out.shape) if keep else c.clone(memory_format=torch.contiguous_format)
    fc, tanh_c = torch.empty_like(held), torch.empty_like(held)  # f c and tanh(c) of the step
    x_at, out_at = gates_x.unbind(0), out.unbind(0)
    slots = [acts[..., j * size:(j + 1) * size] for j in range(4)]  # i, f, g, o
    if keep:
        act_at, g_at, c_at = acts.unbind(0), gs.unbind(0), cs.unbind(0)
        i_at, f_at, g_in_at, o_at = (slot.unbind(0) for slot in slots)
    act, (i, f, g_in, o), g = acts, slots, gs
    last = -1  # the step whose h the next GEMM rounds (-1: the initial state)
    for k, t in enumerate(_order(steps, reverse)):
        if keep:
            act, i, f, g_in, o, g = act_at[k], i_at[k], f_at[k], g_in_at[k], o_at[k], g_at[k]
            c_before, c = c, c_at[k]
        else:
            c_before = c = cs
        torch.addmm(x_at[t], round_h(last, h), w_t, out=act)
        torch.tanh(g_in, out=g)
        act.sigmoid_()  # i, f, o (g's slot unused)
        torch.mul(f, c_before, out=fc)
        torch.addcmul(fc, i, g, out=c)
        torch.tanh(c, out=tanh_c)
        h = torch.mul(o, tanh_c, out=out_at[t])
        last = t
    kit.count("aten::linear", steps)
    if keep:
        saved += [acts, gs, cs]
    return out, h, c


def _lstm_compiled_forward(compiled, gates_x, h, c, w_t, kit: Kit, reverse: bool, saved: Optional[list], held,
                           out, round_h):
    """:func:`_lstm_forward`'s steps with the work after the activations compiled: a step's GEMM, ``tanh`` of g
    and the sigmoid as before, then one compiled call for the cell state (``f c`` and ``addcmul``), ``tanh`` of
    it, and one for the hidden state and its rounding into ``held`` (``numbers.recurrent_kernels``; the tensor
    kernels where a result is a NaN). Without ``saved``, the GEMM accumulates into ``gates_x`` itself where it is
    contiguous (the caller's projection, made for this call): ``addmm`` had copied each step's rows into a
    buffer first."""
    steps, size = gates_x.size(0), h.size(-1)
    keep = saved is not None
    in_place = not keep and gates_x.is_contiguous()
    if keep:
        acts, gs, cs = gates_x.new_empty(gates_x.shape), gates_x.new_empty(out.shape), gates_x.new_empty(out.shape)
    else:  # one step's buffers, and two cell states taken in turn (the kernel writes the new one beside the old)
        acts = gates_x if in_place else gates_x.new_empty(1, *gates_x.shape[1:])
        gs, cs = gates_x.new_empty(1, *h.shape), gates_x.new_empty(2, *h.shape)
        cs[1].copy_(c)
    first = c.clone(memory_format=torch.contiguous_format).numpy()[None] if keep else None
    acts3, gs3, cs3, out3 = (t.numpy() for t in (acts, gs, cs, out))
    fc, tanh_c = torch.empty_like(held), torch.empty_like(held)  # f c and tanh(c) of the step
    tanh2, held2 = tanh_c.numpy(), held.numpy()
    x_at, out_at, g_at, c_at = (t.unbind(0) for t in (gates_x, out, gs, cs))
    act_at = x_at if in_place else acts.unbind(0)
    g_in_at = acts[..., 2 * size:3 * size].unbind(0)
    # each step's t, its activations' index, g's, the new state's, and the old state's slab and index
    where = [(t, k if keep else (t if in_place else 0), k if keep else 0, k if keep else k % 2,
              *((first, 0) if keep and k == 0 else (cs3, k - 1) if keep else (cs3, (k + 1) % 2)))
             for k, t in enumerate(_order(steps, reverse))]
    cell, hidden, rounding = compiled.lstm_cell.dispatcher, compiled.lstm_hidden.dispatcher, _constants(kit)
    round_h(-1, h)
    for t, ka, kg, kc, before, kb in where:
        act, g, c = act_at[ka], g_at[kg], c_at[kc]
        if in_place:
            act.addmm_(held, w_t)
        else:
            torch.addmm(x_at[t], held, w_t, out=act)
        torch.tanh(g_in_at[ka], out=g)
        act.sigmoid_()  # i, f, o (g's slot unused)
        if not cell(acts3, ka, gs3, kg, before, kb, cs3, kc):
            torch.mul(act[..., size:2 * size], torch.from_numpy(before[kb]), out=fc)
            torch.addcmul(fc, act[..., :size], g, out=c)
        torch.tanh(c, out=tanh_c)
        if not hidden(acts3, ka, tanh2, out3, t, held2, *rounding):
            round_h(t, torch.mul(act[..., 3 * size:], tanh_c, out=out_at[t]))
    kit.count("aten::linear", steps)
    if keep:
        saved += [acts, gs, cs]
    return out, out_at[t], c


def _first_order_only(kind: str) -> None:
    """The layer's derivatives are written by hand (into buffers, ``out=``), so they have no derivative of their
    own: a backward asked to build one (``create_graph=True``) is refused in words, not by an ``out=`` error."""
    if torch.is_grad_enabled():
        raise Tf32LabError(f"emulate(): an emulated {kind}'s backward gives first derivatives only; a second one "
                           f"(create_graph=True, e.g. a gradient penalty) is not supported: run that backward "
                           f"outside emulate(), or at level 'highest' natively")


class _Lstm(torch.autograd.Function):
    """One LSTM layer and direction over the whole sequence: ``(gates_x, h0, c0, w_hh) -> (out, h_n, c_n)``,
    where ``gates_x`` holds the input projection of every step with both biases."""

    @staticmethod
    def forward(ctx, gates_x, h0, c0, w_hh, kit, reverse):
        saved: list = []
        out, h, c = _lstm_forward(gates_x, h0, c0, w_hh, kit, reverse, saved)
        ctx.kit, ctx.reverse = kit, reverse
        ctx.save_for_backward(h0, c0, w_hh, out, *saved)
        return out, h, c

    @staticmethod
    def backward(ctx, d_out, d_h, d_c):
        _first_order_only("LSTM")
        return ctx.kit.quietly(lambda: _lstm_backward(ctx, d_out, d_h, d_c))


def _lstm_backward(ctx, d_out, d_h, d_c):
    kit, reverse = ctx.kit, ctx.reverse
    h0, c0, w_hh, out, acts, g, c = ctx.saved_tensors
    size = h0.size(-1)
    d_out = _in_order(d_out, reverse) if d_out is not None else torch.zeros_like(out)
    w = kit.round(w_hh)
    steps = out.size(0)
    d_gates = torch.empty_like(acts)
    d_gates_rounded = torch.empty_like(acts)
    nan_free = _nan_free(d_out, d_h, d_c)
    rounder = kit.step_rounder(nan_free, d_gates, d_gates_rounded)
    # every step's views made once; dh and dc written over in place (the kernels and their order as before)
    d_out_at, d_gates_at, rounded_at = d_out.unbind(0), d_gates.unbind(0), d_gates_rounded.unbind(0)
    both = torch.empty_like(acts[0])  # (dc, dc, dc, dh) of the step
    dh_next = torch.empty_like(h0, memory_format=torch.contiguous_format)
    dh = d_out_at[-1] if d_h is None else torch.add(d_out_at[-1], d_h, out=dh_next)
    dc = torch.zeros_like(dh_next) if d_c is None else d_c.clone(memory_format=torch.contiguous_format)
    compiled = _compiled_steps(kit, acts) if nan_free and h0.dim() == 2 else None
    derivatives: list = []  # (from_h, factors, f) of every step, each unbound: made when first asked for
    if compiled is None:
        derivatives = _lstm_derivatives(acts, g, c, c0, kit.nan_free)
    else:  # one compiled call a step: its derivatives, its pointwise work and rounding (_compiled_steps)
        back, rounding = compiled.lstm_back.dispatcher, _constants(kit)
        if d_h is None:
            dh = dh_next.copy_(dh)
        dcs = (dc, torch.empty_like(dc))  # the kernel writes dc anew beside the one it reads
        dcs2 = tuple(t.numpy() for t in dcs)
        dh2, gates3, rounded3 = dh_next.numpy(), d_gates.numpy(), d_gates_rounded.numpy()
        slabs = [t.detach().contiguous().numpy() for t in (acts, g, torch.tanh(c), c)]
        c0_2 = c0.detach().contiguous().numpy()
        now = 0
    for k in range(steps - 1, -1, -1):
        if compiled is not None and back(dh2, dcs2[now], dcs2[1 - now], *slabs, c0_2, k, gates3, rounded3,
                                         *rounding):
            now = 1 - now
            dc, rounded = dcs[now], rounded_at[k]
        else:
            if not derivatives:  # a NaN: this step as the tensor kernels compute it
                derivatives = _lstm_derivatives(acts, g, c, c0, kit.nan_free)
            from_h_at, factors_at, f_at = derivatives
            torch.addcmul(dc, dh, from_h_at[k], out=dc)
            torch.cat((dc, dc, dc, dh), -1, out=both)
            torch.mul(both, factors_at[k], out=d_gates_at[k])
            torch.mul(dc, f_at[k], out=dc)
            rounded = rounder(k, d_gates_at[k])
        dh = torch.addmm(d_out_at[k - 1], rounded, w, out=dh_next) if k else torch.mm(rounded, w, out=dh_next)
    d_w = None
    if ctx.needs_input_grad[3]:  # the whole sequence in one GEMM
        h_before = kit.round(_before(h0, _in_order(out, reverse)))
        d_w = d_gates_rounded.reshape(-1, 4 * size).t() @ h_before.reshape(-1, size)
    kit.count("aten::mm", steps + (d_w is not None))
    return _in_order(d_gates, reverse), dh, dc, d_w, None, None


def _lstm_derivatives(acts, g, c, c0, nan_free: bool) -> list:
    """:func:`_lstm_factors` and ``f`` of every step, each as a list of the steps' views."""
    size = c.size(-1)
    from_h, gate_factors = _lstm_factors(acts, g, c, c0, nan_free)
    return [from_h.unbind(0), gate_factors.unbind(0), acts[..., size:2 * size].unbind(0)]


def _lstm_factors(acts, g, c, c0, nan_free: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``d c / d h`` through h = o tanh(c), and each gate's factor of the step's (dc, dc, dc, dh), for every
    step: in one compiled pass where numba is loaded (as ``formats`` loads it: at once where the run is known to be
    long, else once the tensor code has rounded enough to pay for numba's import) and nothing holds a NaN (whose
    payload a compiled product may take from the other operand), else the tensor code."""
    tanh_c = torch.tanh(c)
    compiled = kernels("recurrent_kernels") if nan_free and acts.is_cpu and "numba" in sys.modules else None
    if compiled is not None:
        acts, g, c, c0 = (t.detach().contiguous() for t in (acts, g, c, c0))
        from_h, factors = torch.empty_like(c), torch.empty_like(acts)
        compiled.lstm_factors(acts.numpy(), g.numpy(), tanh_c.numpy(), c.numpy(), c0.numpy(), from_h.numpy(),
                              factors.numpy())
        return from_h, factors
    size = c.size(-1)
    i, f, o = acts[..., :size], acts[..., size:2 * size], acts[..., 3 * size:]
    c_before = _before(c0, c)
    from_h = o * (1 - tanh_c * tanh_c)
    return from_h, torch.cat((g * i * (1 - i), c_before * f * (1 - f), i * (1 - g * g), tanh_c * o * (1 - o)), -1)


def _compiled_steps(kit: Kit, like: torch.Tensor):
    """The compiled step kernels (``numbers.recurrent_kernels``) for an LSTM's loops in ``kit``'s math over tensors
    like ``like``, or None where the tensor kernels run: not float32 on the CPU in a math rounded once, numba not
    loaded (as :func:`_lstm_factors` asks), or this PyTorch's ``addcmul`` not one fused multiply-add
    (:func:`_addcmul_is_fused`)."""
    if (kit.name not in _ROUND or not like.is_cpu or like.dtype != torch.float32
            or "numba" not in sys.modules):
        return None
    compiled = kernels("recurrent_kernels")
    return compiled if compiled is not None and _addcmul_is_fused() else None


@functools.cache
def _addcmul_is_fused() -> bool:
    """Whether ``torch.addcmul`` on the CPU gives the bits of ``a + b c`` rounded once (its kernels are compiled
    with floating-point contraction; the step kernels compute it so, and must give the same bits), in its vectorised
    loop and in a loop's scalar tail alike: asked once, on values where one and two roundings differ."""
    compiled = kernels("recurrent_kernels")
    gen = torch.Generator().manual_seed(0)
    for rows, row in ((3, 1027), (16, 31)):  # rows of the vectorised loop and 3 left over; the scalar loop alone
        a, b, c = (torch.randn(rows, row + 4, generator=gen)[:, 4:] for _ in range(3))
        expected, got = torch.addcmul(a, b, c), torch.empty(rows * row)
        compiled.fused.dispatcher(*(t.flatten().numpy() for t in (b, c, a)), got.numpy())
        if not torch.equal(expected.flatten().view(torch.int32), got.view(torch.int32)):
            return False
    return True


def _constants(kit: Kit) -> tuple[int, int, int, int]:
    """The step kernels' rounding constants for ``kit``'s math (``recurrent_kernels.constants``)."""
    return kernels("recurrent_kernels").constants(formats.MANTISSA_DROP[kit.name], kit.rounding)


# -- GRU ----------------------------------------------------------------------------------------------------
def _gru_forward(gates_x, h, w_hh, b_hh, kit: Kit, reverse: bool, saved: Optional[list]):
    """The steps of one GRU layer and direction; ``saved`` receives r, z, n and the hidden product's n part of
    every step, in run order. The kernels and their order are ``rnn_steps.run_rnn``'s (the same bits: a sum or product
    of two operands in either order is one rounding); each writes into a buffer made once, through views made
    once, as the LSTM's steps do."""
    steps = gates_x.size(0)
    size = h.size(-1)
    w_view = kit.weight(w_hh).t()  # as F.linear passes it: the same GEMM kernel
    round_h = kit.rounder(kit.nan_free)
    held = torch.empty_like(h, memory_format=torch.contiguous_format)
    out = gates_x.new_empty(steps, *h.shape)
    keep = saved is not None
    slabs = [gates_x.new_empty((steps, *h.shape) if keep else h.shape) for _ in range(4)]  # r, z, n, h_n
    r_at, z_at, n_at, hn_at = (slab.unbind(0) if keep else [slab] * steps for slab in slabs)
    gates_h = gates_x.new_empty(*h.shape[:-1], 3 * size)  # the hidden product of the step
    h_r, h_z, h_n = gates_h.split(size, -1)
    x_at, out_at = [x.split(size, -1) for x in gates_x.unbind(0)], out.unbind(0)
    between = torch.empty_like(held)  # z (h - n)
    for k, t in enumerate(_order(steps, reverse)):
        hr = round_h(h, held)
        if b_hh is None:
            torch.mm(hr, w_view, out=gates_h)
        else:
            torch.addmm(b_hh, hr, w_view, out=gates_h)
        (x_r, x_z, x_n), r, z, n = x_at[t], r_at[k], z_at[k], n_at[k]
        torch.add(x_r, h_r, out=r).sigmoid_()
        torch.add(x_z, h_z, out=z).sigmoid_()
        torch.mul(r, h_n, out=n).add_(x_n).tanh_()  # tanh(x_n + r h_n)
        torch.sub(h, n, out=between).mul_(z)
        h = torch.add(n, between, out=out_at[t])
        if keep:
            hn_at[k].copy_(h_n)
    kit.count("aten::linear", steps)
    if keep:
        saved += slabs
    return out, h


class _Gru(torch.autograd.Function):
    """One GRU layer and direction over the whole sequence: ``(gates_x, h0, w_hh, b_hh) -> (out, h_n)``, where
    ``gates_x`` holds the input projection of every step with its bias."""

    @staticmethod
    def forward(ctx, gates_x, h0, w_hh, b_hh, kit, reverse):
        saved: list = []
        out, h = _gru_forward(gates_x, h0, w_hh, b_hh, kit, reverse, saved)
        ctx.kit, ctx.reverse, ctx.has_bias = kit, reverse, b_hh is not None
        ctx.save_for_backward(h0, w_hh, out, *saved)
        return out, h

    @staticmethod
    def backward(ctx, d_out, d_h):
        _first_order_only("GRU")
        return ctx.kit.quietly(lambda: _gru_backward(ctx, d_out, d_h))


def _gru_backward(ctx, d_out, d_h):
    kit, reverse = ctx.kit, ctx.reverse
    h0, w_hh, out, r, z, n, h_n = ctx.saved_tensors
    size = h0.size(-1)
    d_out = _in_order(d_out, reverse) if d_out is not None else torch.zeros_like(out)
    h_before = _before(h0, _in_order(out, reverse))
    # h = n + z (h_before - n): the derivatives of every step at once, as factors of the step's dh
    to_n = (1 - z) * (1 - n * n)  # d n_pre
    to_z = (h_before - n) * z * (1 - z)  # d z_pre
    to_r = to_n * h_n * r * (1 - r)  # d r_pre
    hidden_factors = torch.cat((to_r, to_z, to_n * r), -1)  # the hidden product's gradient
    input_factors = torch.cat((to_r, to_z, to_n), -1)  # the input projection's
    rounder = kit.rounder(_nan_free(d_out, d_h))
    w = kit.round(w_hh)
    steps = out.size(0)
    d_hidden = torch.empty(steps, *h0.shape[:-1], 3 * size, dtype=out.dtype, device=out.device)
    d_hidden_rounded = torch.empty_like(d_hidden)
    dh_thrice = torch.empty_like(d_hidden)
    dh = d_out[-1] if d_h is None else d_out[-1] + d_h
    for k in range(steps - 1, -1, -1):
        torch.cat((dh, dh, dh), -1, out=dh_thrice[k])
        torch.mul(dh_thrice[k], hidden_factors[k], out=d_hidden[k])
        rounder(d_hidden[k], d_hidden_rounded[k])
        carried = torch.addcmul(d_out[k - 1], dh, z[k]) if k else dh * z[k]
        dh = torch.addmm(carried, d_hidden_rounded[k], w)
    d_w = None
    if ctx.needs_input_grad[2]:  # the whole sequence in one GEMM
        d_w = d_hidden_rounded.reshape(-1, 3 * size).t() @ kit.round(h_before).reshape(-1, size)
    d_b = d_hidden.sum(tuple(range(d_hidden.dim() - 1))) if ctx.has_bias else None
    kit.count("aten::mm", steps + (d_w is not None))
    return _in_order(dh_thrice * input_factors, reverse), dh, d_w, d_b, None, None


def _nan_free(*grads: Optional[torch.Tensor]) -> bool:
    """Whether the incoming gradients hold no NaN, so every NaN the backward makes is a default one (CPU only:
    elsewhere asking would synchronise, and the rounding mends NaNs itself)."""
    present = [g for g in grads if g is not None]
    return all(g.device.type == "cpu" for g in present) and all(_pymath.isfinite(float(g.sum())) for g in present)
