"""Emulated LSTMs and GRUs (``tf32lab.emulation.recurrent``): forward and backward against a float64 reference
whose GEMMs round their operands as cuDNN's RNN kernel does, and the shape of the autograd graph."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

import tf32lab
from tf32lab.emulation import recurrent
from tf32lab.emulation.emulator import release_buffers
from tf32lab.numbers import formats
from tf32lab.numbers.compiled import kernels


def _tf32(t: torch.Tensor) -> torch.Tensor:
    return formats.round_tf32(t.float()).double()


class _RoundedLinear(torch.autograd.Function):
    """x wᵀ in float64 with both operands rounded to TF32, in the forward and in both backward GEMMs."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return _tf32(x) @ _tf32(w).t()

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        g = _tf32(grad)
        return g @ _tf32(w), g.t() @ _tf32(x)


def _reference(rnn: nn.Module, x: torch.Tensor):
    """``rnn(x)`` (batch first, zero initial state) in float64, every GEMM's operands rounded to TF32 (RNA)."""
    lstm = isinstance(rnn, nn.LSTM)
    size = rnn.hidden_size
    layer_in = x.double().transpose(0, 1)
    for layer in range(rnn.num_layers):
        outs = []
        for suffix in ("", "_reverse")[:1 + rnn.bidirectional]:
            w_ih, w_hh, b_ih, b_hh = (getattr(rnn, f"{name}_l{layer}{suffix}").double()
                                      for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))
            gates_x = _RoundedLinear.apply(layer_in.reshape(-1, layer_in.size(-1)), w_ih)
            gates_x = gates_x.reshape(*layer_in.shape[:2], -1) + b_ih
            h = c = torch.zeros(layer_in.size(1), size, dtype=torch.float64)
            out = [None] * layer_in.size(0)
            steps = range(layer_in.size(0) - 1, -1, -1) if suffix else range(layer_in.size(0))
            for t in steps:
                gates_h = _RoundedLinear.apply(h, w_hh) + b_hh
                if lstm:
                    i, f, g, o = (gates_x[t] + gates_h).split(size, -1)
                    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                    h = torch.sigmoid(o) * torch.tanh(c)
                else:
                    x_r, x_z, x_n = gates_x[t].split(size, -1)
                    h_r, h_z, h_n = gates_h.split(size, -1)
                    r, z = torch.sigmoid(x_r + h_r), torch.sigmoid(x_z + h_z)
                    n = torch.tanh(x_n + r * h_n)
                    h = (1 - z) * n + z * h
                out[t] = h
            outs.append(torch.stack(out))
        layer_in = torch.cat(outs, -1)
    return layer_in.transpose(0, 1)


def _grads(rnn: nn.Module, x: torch.Tensor, run) -> list[torch.Tensor]:
    """The output and the gradients of (output²).sum() for the input and every parameter, as float64."""
    rnn.zero_grad()
    x = x.clone().requires_grad_()
    out = run(x)
    out.pow(2).sum().backward()
    params = [p.grad for p in rnn.parameters()] if out.dtype == torch.float32 else []
    return [out.detach().double(), x.grad.double(), *(g.double() for g in params)]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


_RNNS = {"lstm": nn.LSTM, "gru": nn.GRU}


@pytest.mark.parametrize("bidirectional", [False, True], ids=["one-way", "bidirectional"])
@pytest.mark.parametrize("kind", list(_RNNS))
def test_emulated_forward_and_backward_match_a_float64_reference_with_rounded_gemm_operands(kind, bidirectional):
    torch.manual_seed(0)
    rnn = _RNNS[kind](12, 16, num_layers=2, batch_first=True, bidirectional=bidirectional)
    x = torch.randn(3, 20, 12)

    with tf32lab.precision("high"), tf32lab.emulate("a100", strict=True):
        got = _grads(rnn, x, lambda x: rnn(x)[0])  # the backward inside the block: cuDNN's is TF32 too
    native = _grads(rnn, x, lambda x: rnn(x)[0])
    # the reference's gradients: parameters as float64 leaves
    rnn64 = _RNNS[kind](12, 16, num_layers=2, batch_first=True, bidirectional=bidirectional).double()
    rnn64.load_state_dict(rnn.state_dict())
    x64 = x.double().requires_grad_()
    ref_out = _reference(rnn64, x64)
    ref_out.pow(2).sum().backward()
    ref = [ref_out.detach(), x64.grad, *(p.grad for p in rnn64.parameters())]
    names = ["output", "input", *(name for name, _ in rnn.named_parameters())]
    shares = {}  # each result's distance to the reference, as a share of what rounding to TF32 changes there
    for name, g, n, r in zip(names, got, native, ref):
        effect = _relative(n, r)
        assert effect > 1e-5, (name, effect)  # float32's own error is far below rounding to TF32's
        shares[name] = _relative(g, r) / effect
    # float32 arithmetic and the odd operand rounded the other way (within float32 noise of a TF32 tie, then
    # carried along the recurrence) are all that may separate the emulation from the reference
    assert sorted(shares.values())[len(shares) // 2] < 0.1 and max(shares.values()) < 0.5, shares


@pytest.mark.parametrize("kind", list(_RNNS))
def test_the_forward_with_gradients_gives_the_forward_without(kind):
    torch.manual_seed(0)
    rnn = _RNNS[kind](12, 16, num_layers=2, batch_first=True, bidirectional=True)
    x = torch.randn(3, 20, 12)
    with tf32lab.precision("high"), tf32lab.emulate("a100"):
        with torch.no_grad():
            plain = rnn(x)
        trained = rnn(x.clone().requires_grad_())
    for a, b in zip(_flat(plain), _flat(trained)):
        assert torch.equal(a, b.detach())


def _flat(out) -> list[torch.Tensor]:
    return [t for part in out for t in (part if isinstance(part, tuple) else (part,))]


def _nodes(out: torch.Tensor) -> int:
    seen, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo += [next_fn for next_fn, _ in node.next_functions]
    return len(seen)


@pytest.mark.parametrize("kind", list(_RNNS))
def test_the_backward_is_a_few_nodes_per_layer_not_one_per_step(kind):
    torch.manual_seed(0)
    rnn = _RNNS[kind](12, 16, num_layers=2, batch_first=True)
    short, long = torch.randn(2, 5, 12, requires_grad=True), torch.randn(2, 50, 12, requires_grad=True)
    with tf32lab.precision("high"), tf32lab.emulate("a100"):
        nodes = [_nodes(rnn(x)[0]) for x in (short, long)]
    assert nodes[0] == nodes[1] < 40, nodes


@pytest.mark.parametrize("rounding", ["rna", "rne", "rz"])
@pytest.mark.parametrize("name", ["tf32", "bf16"])
def test_the_hot_rounder_gives_the_bits_of_the_checked_rounding(name, rounding):
    # the hidden state's rounder (0-dim tensor constants) against round_tf32 / round_bf16, into a buffer and in place
    torch.manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (1 << 16,), dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    x = torch.cat((x[~torch.isnan(x)], torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.4028235e38,
                                                       -3.4028235e38, 1e-45, 1 + 2**-11, 1 + 3 * 2**-11])))
    checked = {"tf32": formats.round_tf32, "bf16": formats.round_bf16}[name](x, rounding)
    hot = formats.hot_rounder(name, rounding)
    into = hot(x, torch.empty_like(x))
    in_place = x.clone()
    hot(in_place, in_place)
    assert torch.equal(into.view(torch.int32), checked.view(torch.int32))
    assert torch.equal(in_place.view(torch.int32), checked.view(torch.int32))


def _ops(steps: int, grad: bool) -> collections.Counter:
    """The aten ops an emulated LSTM's forward (and backward) records, by name, less those ``unbind`` runs (the
    per-step views, made once)."""
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 8)
    x = torch.randn(steps, 2, 4, requires_grad=grad)

    def run() -> None:
        if grad:
            lstm(x)[0].sum().backward()
        else:
            with torch.inference_mode():
                lstm(x)

    with tf32lab.precision("high"), tf32lab.emulate("a100"):
        run()  # the rounded weights cached
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run()

    def in_unbind(event) -> bool:
        while event is not None:
            if event.name == "aten::unbind":
                return True
            event = event.cpu_parent
        return False

    return collections.Counter(e.name for e in prof.events() if not in_unbind(e))


@pytest.mark.parametrize("steps", ["tensor", "compiled"])
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "forward-and-backward"])
def test_an_lstm_step_runs_its_kernels_and_makes_no_view(monkeypatch, grad, steps):
    # a Python-level view or allocation costs as much as a step's pointwise kernel on an 8 x 256 state
    if steps == "compiled":
        _compiled_steps_or_skip()
    else:
        monkeypatch.setattr(recurrent, "_compiled_steps", lambda kit, like: None)
    short, long = _ops(5, grad), _ops(25, grad)
    per_step = {name: (long[name] - short[name]) / 20 for name in long | short if long[name] != short[name]}
    # (the compiled forward without gradients accumulates into the input projection: addmm_)
    assert per_step.get("aten::addmm", 0) + per_step.get("aten::addmm_", 0) == 1 + grad, per_step
    made = {"aten::view", "aten::select", "aten::slice", "aten::split", "aten::chunk", "aten::empty",
            "aten::empty_like", "aten::zeros_like", "aten::clone"}
    assert not made & per_step.keys(), per_step


def test_the_compiled_lstm_derivatives_give_the_tensor_code_bits():
    if kernels("recurrent_kernels") is None:
        pytest.skip("numba is not installed")
    torch.manual_seed(0)
    steps, batch, size = 7, 3, 5  # odd sizes: no vector lane lines up with a gate
    acts = torch.cat((torch.randn(steps, batch, 4 * size).sigmoid(), torch.randn(steps, batch, 4 * size) * 4))
    g, c = torch.randn(2 * steps, batch, size).tanh(), torch.randn(2 * steps, batch, size) * 3
    c0 = torch.randn(batch, size)
    compiled = recurrent._lstm_factors(acts, g, c, c0, nan_free=True)
    tensor_code = recurrent._lstm_factors(acts, g, c, c0, nan_free=False)
    for a, b in zip(compiled, tensor_code):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_the_compiled_lstm_derivatives_are_compiled_once_whatever_the_layout():
    # numba compiled the kernel anew for a cell state laid out otherwise (its tangent, made as it lies, was
    # passed as it came): once per process now, the same bits
    if kernels("recurrent_kernels") is None:
        pytest.skip("numba is not installed")
    from numba.core.dispatcher import Dispatcher

    from tf32lab.numbers import recurrent_kernels

    torch.manual_seed(1)
    steps, batch, size = 4, 3, 5
    acts, g = torch.randn(steps, batch, 4 * size).sigmoid(), torch.randn(steps, batch, size).tanh()
    c, c0 = torch.randn(steps, batch, size) * 3, torch.randn(batch, size)
    for cell in (c, c.transpose(0, 1).contiguous().transpose(0, 1), c.transpose(1, 2).contiguous().transpose(1, 2)):
        compiled = recurrent._lstm_factors(acts, g, cell, c0, nan_free=True)
        tensor_code = recurrent._lstm_factors(acts, g, cell, c0, nan_free=False)
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(compiled, tensor_code))
    found = {name: getattr(f, "dispatcher", f) for name, f in vars(recurrent_kernels).items()}
    counts = {name: len(d.signatures) for name, d in found.items() if isinstance(d, Dispatcher)}
    assert counts["lstm_factors"] == 1 and all(n <= 1 for n in counts.values()), counts


@pytest.mark.parametrize("kind", [torch.nn.LSTM, torch.nn.GRU], ids=["lstm", "gru"])
def test_a_second_derivative_is_refused_in_words_and_a_first_one_still_runs(kind):
    torch.manual_seed(0)
    layer, x = kind(4, 8, 1), torch.randn(5, 2, 4, requires_grad=True)
    with tf32lab.precision("high"), tf32lab.emulate("a100"):
        first, = torch.autograd.grad(layer(x)[0].pow(2).sum(), x)  # no graph asked: as before
        assert torch.isfinite(first).all()
        with pytest.raises(tf32lab.Tf32LabError, match=r"first derivatives only.*create_graph=True"):
            torch.autograd.grad(layer(x)[0].pow(2).sum(), x, create_graph=True)


@pytest.mark.parametrize("kind,layers,bidirectional,batch_first,unbatched,bias,given", [
    ("lstm", 1, False, False, False, True, False),
    ("lstm", 2, True, True, False, True, True),
    ("lstm", 2, False, False, True, False, True),
    ("gru", 1, False, True, False, True, False),
    ("gru", 2, True, False, False, False, True),
    ("gru", 1, True, False, True, True, True),
])
def test_the_exact_layers_give_atens_float64_results(kind, layers, bidirectional, batch_first, unbatched, bias,
                                                     given):
    """The float64 reference's recurrences (nothing rounded) against PyTorch's own float64 kernel, in every
    layout ``nn.LSTM`` and ``nn.GRU`` call ``torch._VF`` with: to float64's last bits' order."""
    torch.manual_seed(0)
    module = (nn.LSTM if kind == "lstm" else nn.GRU)(5, 6, layers, bias=bias, batch_first=batch_first,
                                                     bidirectional=bidirectional, dropout=0.3 if layers > 1 else 0.0)
    module = module.double().eval()  # dropout between layers is off outside training
    shape = (7, 5) if unbatched else ((3, 7, 5) if batch_first else (7, 3, 5))
    x = torch.randn(*shape, dtype=torch.float64)
    states = (layers * (2 if bidirectional else 1), *(() if unbatched else (3,)), 6)
    h0 = torch.randn(states, dtype=torch.float64) if given else torch.zeros(states, dtype=torch.float64)
    hx = (h0, torch.randn_like(h0) if given else torch.zeros_like(h0)) if kind == "lstm" else h0
    with torch.no_grad():
        expected = module(x, hx)
        found = recurrent.exact_layers(kind, x, hx, module._flat_weights, bias, layers, module.dropout, False,
                                       bidirectional, batch_first)
    expected = [expected[0], *(expected[1] if kind == "lstm" else (expected[1],))]
    assert len(found) == len(expected)
    for got, want in zip(found, expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_the_exact_layers_widen_float32_weights_as_each_direction_runs(kind):
    """The float64 reference hands the loops the RNN's own float32 weights (its float64 copies of all of them at
    once were a third of an LSTM encoder's check memory): each direction's are widened as it runs, to the same
    bits as float64 weights given whole."""
    torch.manual_seed(0)
    module = (nn.LSTM if kind == "lstm" else nn.GRU)(5, 6, 2, bidirectional=True).eval()
    x = torch.randn(70, 3, 5, dtype=torch.float64)  # more steps than one part of the input projection
    h0 = torch.randn(4, 3, 6, dtype=torch.float64)
    hx = (h0, torch.randn_like(h0)) if kind == "lstm" else h0
    wide = [w.double() for w in module._flat_weights]
    with torch.no_grad():
        given = recurrent.exact_layers(kind, x, hx, module._flat_weights, True, 2, 0.0, False, True, False)
        widened = recurrent.exact_layers(kind, x, hx, wide, True, 2, 0.0, False, True, False)
    assert given is not None and all(w.dtype == torch.float32 for w in module._flat_weights)
    for got, want in zip(given, widened):
        assert got.dtype == torch.float64 and torch.equal(got, want)


def test_the_exact_layers_leave_dropout_in_training_and_other_rnns_to_pytorch():
    lstm = nn.LSTM(5, 6, 2, dropout=0.5).double()
    x, h0 = torch.randn(4, 2, 5, dtype=torch.float64), torch.zeros(2, 2, 6, dtype=torch.float64)
    assert recurrent.exact_layers("lstm", x, (h0, h0), lstm._flat_weights, True, 2, 0.5, True, False, False) is None
    projected = nn.LSTM(5, 6, proj_size=3).double()
    h0, c0 = torch.zeros(1, 2, 3, dtype=torch.float64), torch.zeros(1, 2, 6, dtype=torch.float64)
    assert recurrent.exact_layers("lstm", x, (h0, c0), projected._flat_weights, True, 1, 0.0, False, False,
                                  False) is None
    rnn = nn.RNN(5, 6).double()
    assert recurrent.exact_layers("rnn_tanh", x, h0, rnn._flat_weights, True, 1, 0.0, False, False, False) is None
    assert recurrent.exact_layers("lstm", x.float(), (h0.float(), h0.float()), [p.float() for p in
                                  lstm._flat_weights], True, 2, 0.0, False, False, False) is None


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU])
def test_the_float64_reference_of_an_empty_sequence_raises_as_pytorch_does(kind, batch_first):
    # ATen refuses a sequence of no steps; the exact layers returned an empty output, and check then said the
    # final state, zeros, was "zero at every element ... from products that are zero too" (zero weights?)
    from tf32lab.measure.reference import Float64Run

    module = kind(3, 4, batch_first=batch_first)
    x = torch.randn(2, 0, 3) if batch_first else torch.randn(0, 2, 3)
    with pytest.raises(RuntimeError, match="sequence length"):
        module(x)
    with pytest.raises(RuntimeError, match="sequence length"), torch.no_grad(), Float64Run():
        module(x)


def _compiled_steps_or_skip() -> None:
    if kernels("recurrent_kernels") is None:
        pytest.skip("numba is not installed")
    if not recurrent._addcmul_is_fused():
        pytest.skip("this PyTorch's addcmul is not one fused multiply-add: the LSTM's steps run the tensor kernels")


def _lstm_runs(module: nn.LSTM, x: torch.Tensor, hx, math: str) -> list[torch.Tensor]:
    """The output and states without gradients, then with them, and every gradient of a weighted sum."""
    # the thread's pooled scratch buffers may hold one that an earlier test made under inference mode, into which
    # a weight's BF16 rounding (run outside inference mode) then cannot copy: a fresh pool here
    release_buffers()
    with tf32lab.precision("high"), tf32lab.emulate("a100", math=math):
        with torch.inference_mode():
            plain = module(x, hx)
        module.zero_grad()
        xg = x.clone().requires_grad_()
        hxg = tuple(t.clone().requires_grad_() for t in hx)
        out, (h, c) = module(xg, hxg)
        weights = torch.linspace(-1, 2, out.numel()).view(out.shape)
        ((out * weights).sum() + h.sum() + 0.5 * c.sum()).backward()
    grads = [xg.grad, hxg[0].grad, hxg[1].grad, *(p.grad for p in module.parameters())]
    return [*_flat(plain), out.detach(), h.detach(), c.detach(), *grads]


@pytest.mark.parametrize("math", ["tf32", "bf16"])
@pytest.mark.parametrize("size,big", [(5, False), (32, False), (4, True)], ids=["odd", "vector", "overflowing"])
def test_the_compiled_lstm_steps_give_the_tensor_steps_bits(monkeypatch, size, big, math):
    # the steps' pointwise work after the activations, and the backward's derivatives, compiled: the same bits as
    # the tensor kernels, forward and backward; "overflowing" weights make NaNs mid-run (inf - inf in a step's
    # GEMM) from NaN-free inputs, which the compiled steps leave to the tensor kernels
    _compiled_steps_or_skip()
    torch.manual_seed(3)
    module = nn.LSTM(3, size, 2, bidirectional=True)
    if big:
        with torch.no_grad():
            for name, p in module.named_parameters():
                if name.startswith("weight"):
                    p.zero_()
                    p[::2, 0], p[1::2, 0] = 3e38, -3e38  # finite, and summing to a finite number
    x = torch.randn(6, 3, 3) * (4 if big else 1)
    hx = (torch.randn(4, 3, size), torch.randn(4, 3, size))
    called = collections.Counter()
    compiled_steps = recurrent._compiled_steps

    def counted(kit, like):
        found = compiled_steps(kit, like)
        called[found is not None] += 1
        return found

    monkeypatch.setattr(recurrent, "_compiled_steps", counted)
    compiled = _lstm_runs(module, x, hx, math)
    assert called[True] and not called[False], called
    monkeypatch.setattr(recurrent, "_compiled_steps", lambda kit, like: None)
    tensor_code = _lstm_runs(module, x, hx, math)
    assert any(bool(torch.isnan(t).any()) for t in compiled) == big
    for a, b in zip(compiled, tensor_code):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("rounding", ["rna", "rne", "rz"])
@pytest.mark.parametrize("reverse", [False, True])
def test_compiled_lstm_steps_leave_a_step_with_a_nan_to_the_tensor_kernels(monkeypatch, reverse, rounding):
    # a NaN in a run said to be NaN-free: the steps it reaches run the tensor kernels, the others compiled
    _compiled_steps_or_skip()
    torch.manual_seed(4)
    kit = recurrent.Kit(None, None, lambda w: formats.round_tf32(w, rounding), "tf32", rounding, True,
                        lambda op, n: None, lambda fn: fn())
    gates, h0, c0, w = torch.randn(6, 3, 20), torch.randn(3, 5), torch.randn(3, 5), torch.randn(20, 5)
    gates[2, 1, 3] = gates[4, 0, 17] = float("nan")
    runs = []
    for steps in (recurrent._compiled_steps, lambda kit, like: None):
        monkeypatch.setattr(recurrent, "_compiled_steps", steps)
        saved: list = []
        kept = recurrent._lstm_forward(gates.clone(), h0, c0, w, kit, reverse, saved)
        plain = recurrent._lstm_forward(gates.clone(), h0, c0, w, kit, reverse, None)
        runs.append([*kept, *saved, *plain])
    for a, b in zip(*runs):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_the_float64_reference_never_holds_a_whole_sequences_projection(kind, bidirectional):
    """An LSTM encoder's check peaked in its float64 reference, at the input projection of every step (8 bytes a
    gate: 10 MiB for 8 x 160 frames of 256 units): the exact layers make it a few steps at a time, and a layer's
    final state is not a view that keeps the layer's whole output alive."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    Largest.numel = max(Largest.numel, t.numel())
            return out

    torch.manual_seed(0)
    steps, batch, size = 100, 2, 8
    module = (nn.LSTM if kind == "lstm" else nn.GRU)(5, size, 2, bidirectional=bidirectional).double()
    x = torch.randn(steps, batch, 5, dtype=torch.float64)
    dirs = 2 if bidirectional else 1
    h0 = torch.zeros(2 * dirs, batch, size, dtype=torch.float64)
    hx = (h0, h0) if kind == "lstm" else h0
    with torch.no_grad():
        expected = module(x, hx)
        with Largest():
            found = recurrent.exact_layers(kind, x, hx, module._flat_weights, True, 2, 0.0, False, bidirectional,
                                           False)
    gates = 4 if kind == "lstm" else 3
    assert Largest.numel < steps * batch * gates * size  # the whole projection: 6400 (LSTM) or 4800 numbers
    assert Largest.numel >= steps * batch * size * dirs  # the output itself
    torch.testing.assert_close(found[0], expected[0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(found[1], expected[1][0] if kind == "lstm" else expected[1], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("bidirectional", [False, True], ids=["one-way", "bidirectional"])
@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_a_packed_sequence_is_emulated_as_each_sequence_alone(kind, bidirectional):
    # a PackedSequence ran natively in IEEE float32 ("unhandled"), so a speech encoder that packs its batch was
    # judged at float32's own error at `high` (1.7e-07 against 2.1e-04 for the same batch unpacked): PASSED blind
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    torch.manual_seed(0)
    rnn = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[kind](12, 16, num_layers=2, batch_first=True,
                                                                 bidirectional=bidirectional)
    lengths = [7, 20, 13]  # unsorted: nn.LSTM sorts them, and its final states come back in this order
    x = torch.randn(3, 20, 12)

    def packed(x: torch.Tensor) -> torch.Tensor:
        out, state = rnn(pack_padded_sequence(x, torch.tensor(lengths), batch_first=True, enforce_sorted=False))
        h = state[0] if kind == "lstm" else state
        return torch.cat([pad_packed_sequence(out, batch_first=True)[0].flatten(1), h.transpose(0, 1).flatten(1)],
                         1)

    def alone(x: torch.Tensor) -> torch.Tensor:
        rows = []
        for i, n in enumerate(lengths):
            out, state = rnn(x[i:i + 1, :n])
            h = state[0] if kind == "lstm" else state
            padded = torch.cat([out, out.new_zeros(1, 20 - n, out.size(-1))], 1)
            rows.append(torch.cat([padded.flatten(1), h.transpose(0, 1).flatten(1)], 1))
        return torch.cat(rows)

    with tf32lab.precision("high"), tf32lab.emulate("a100", strict=True):
        got = _grads(rnn, x, packed)
        want = _grads(rnn, x, alone)
    native = _grads(rnn, x, packed)
    shares = []  # each result's distance to the sequences' own runs, as a share of what TF32 changes there
    for g, w, n in zip(got, want, native):
        effect = _relative(n, w)
        assert effect > 1e-5  # float32's own error is far below rounding to TF32's
        shares.append(_relative(g, w) / effect)
    # as above: the sum of each step's weight gradient in another order, and the odd operand rounded the other way
    assert sorted(shares)[len(shares) // 2] < 0.1 and max(shares) < 0.5, shares
