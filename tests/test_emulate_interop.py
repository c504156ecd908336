"""emulate() alongside the other ways PyTorch runs a model: torch.jit.trace, sparse tensors, torch.compile.

Each test is a repro of a crash that third-party suites (e3nn, linear_operator, einops) met under ``emulate()``,
which a pytest run at a reduced level would otherwise have blamed on TF32.
"""

from __future__ import annotations

import asyncio
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import cli_runner
import tf32lab
from emulation_reference import emulated, randn

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.trace", "ignore:Sparse CSR tensor support is in beta")


def traced(module, x):
    """``torch.jit.trace(module, x)`` (with PyTorch's own check) inside ``emulate``; the warnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr, emu = emulated(lambda: torch.jit.trace(module, (x,)))
    return tr, emu, [w for w in caught if not issubclass(w.category, DeprecationWarning)]


def ops(graph) -> set[str]:
    return {node.kind() for node in graph.nodes()} - {"prim::Constant", "prim::ListConstruct", "prim::GetAttr"}


# -- torch.jit.trace ------------------------------------------------------------------------------------------
class _ScaledView(torch.nn.Module):
    """e3nn's pattern: a Python float constant, then a view of the result, then a product."""

    def forward(self, x):
        y = x * 0.5
        return y.view(-1, 2) @ torch.ones(2, 3, dtype=x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_traced_module_with_a_python_float_constant_runs_under_emulate(dtype):
    # PyTorch hands a mode the traced constant (a wrapped number) as a Python float; aten::view refused it.
    x = randn(4, 4).to(dtype)
    tr, emu, caught = traced(_ScaledView(), x)
    assert caught == []
    inside, _ = emulated(tr, x)
    assert torch.equal(inside, emulated(_ScaledView(), x)[0])
    assert torch.equal(tr(x), _ScaledView()(x))
    if dtype == torch.float32:
        assert emu.coverage and not emu.unhandled


def test_a_traced_conv_model_is_emulated_records_the_users_graph_and_warns_nothing():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 6 * 6, 5))
    x = randn(2, 3, 8, 8, seed=1) * 10
    tr, emu, caught = traced(model, x)
    assert caught == []  # no TracerWarning from tf32lab's own code in the user's warning summary
    kinds = ops(tr.inlined_graph)
    assert "aten::_convolution" in kinds and not any("bitwise" in k or "tf32lab" in k for k in kinds)
    assert ("aten::convolution", "tf32-rna") in emu.coverage and not emu.unhandled
    inside, _ = emulated(tr, x)
    assert torch.equal(inside, emulated(model, x)[0])  # emulated inside, as the model
    assert torch.equal(tr(x), model(x)) and not torch.equal(inside, model(x))  # native outside


LOW_AND_WIDE = {
    "conv1d": lambda: torch.nn.Conv1d(3, 4, 3),
    "conv2d": lambda: torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()),
    "conv_transpose2d": lambda: torch.nn.ConvTranspose2d(3, 4, 3),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", LOW_AND_WIDE)
def test_a_traced_conv_model_without_float32_traces_as_natively(kind, dtype):
    # The tracer leaves convolution to its kernel to record (the _convolution it calls); the mode passed the
    # non-float32 op on with the tracer's key excluded, so nothing was recorded: "Cannot insert a Tensor that
    # requires grad as a constant". Ops with no float32 operand need no emulation and must trace as without it.
    torch.manual_seed(0)
    model = LOW_AND_WIDE[kind]().to(dtype)
    x = randn(2, 3, 8, 8, seed=3).to(dtype)
    if kind == "conv1d":
        x = x[:, :, 0]
    native = torch.jit.trace(model, (x,))
    tr, emu, caught = traced(model, x)
    assert caught == []
    assert ops(tr.inlined_graph) == ops(native.inlined_graph)
    assert not emu.coverage and not emu.unhandled  # nothing float32: nothing to emulate
    inside, _ = emulated(tr, x)
    assert torch.equal(inside, model(x)) and torch.equal(tr(x), model(x))


class _Mixed(torch.nn.Module):
    """A float32 conv feeding float64 convs (one transposed): one graph, some ops emulated, some passed on."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Conv2d(3, 4, 3)
        self.body = torch.nn.Conv2d(4, 2, 3).double()
        self.tail = torch.nn.ConvTranspose2d(2, 3, 3).double()

    def forward(self, x):
        return self.tail(self.body(torch.relu(self.head(x)).double())).float()


def test_a_traced_model_mixing_float32_and_float64_convs_emulates_the_float32_one_only():
    torch.manual_seed(0)
    model = _Mixed()
    x = randn(2, 3, 8, 8, seed=4) * 10
    native = torch.jit.trace(model, (x,))
    tr, emu, caught = traced(model, x)
    assert caught == []
    assert ops(tr.inlined_graph) == ops(native.inlined_graph)
    assert {math for _, math in emu.coverage} == {"tf32-rna"} and not emu.unhandled
    inside, _ = emulated(tr, x)
    assert torch.equal(inside, emulated(model, x)[0]) and not torch.equal(inside, model(x))
    assert torch.equal(tr(x), model(x))


def test_a_task_tracing_natively_beside_an_emulating_task_records_its_conv():
    # The emulating task keeps the thread's mode on the stack; the other task's ops pass through it unemulated,
    # and passed on with the tracer's key excluded its conv went unrecorded.
    torch.manual_seed(0)
    model, x = torch.nn.Conv2d(3, 4, 3), randn(1, 3, 8, 8, seed=5)
    opened, done = asyncio.Event(), asyncio.Event()
    found = {}

    async def emulating():
        with tf32lab.emulate("a100"):
            opened.set()
            await done.wait()

    async def plain():
        await opened.wait()
        try:
            found["tr"] = torch.jit.trace(model, (x,))
        finally:
            done.set()

    async def main():
        await asyncio.gather(emulating(), plain())

    asyncio.run(main())
    assert torch.equal(found["tr"](x), model(x)) and "aten::_convolution" in ops(found["tr"].inlined_graph)


class _Attention(torch.nn.Module):
    def forward(self, q):
        return F.scaled_dot_product_attention(q, q * 2, q * 3)


@pytest.mark.parametrize("make", [lambda: torch.nn.LSTM(4, 3), lambda: torch.nn.GRU(4, 3), _Attention],
                         ids=["lstm", "gru", "attention"])
def test_a_traced_rnn_or_attention_records_pytorchs_op_not_the_emulation(make):
    # The function-level emulation runs above the tracer: its own ops (rounding included) went into the graph.
    torch.manual_seed(0)
    model = make()
    x = randn(1, 2, 5, 8, seed=2) if isinstance(model, _Attention) else randn(5, 2, 4, seed=2)
    tr, _, _ = traced(model, x)
    kinds = ops(tr.inlined_graph)
    assert not any(k.startswith("tf32lab::") or "bitwise" in k for k in kinds), kinds
    assert {"aten::lstm", "aten::gru", "aten::scaled_dot_product_attention"} & kinds

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    assert torch.equal(first(tr(x)), first(model(x)))


# -- sparse operands ------------------------------------------------------------------------------------------
def _sparse(layout, dtype):
    dense = torch.zeros(6, 5, dtype=dtype)
    dense[0, 1], dense[2, 4], dense[3, 0], dense[5, 2] = 1024.5, -3.25, 1.0 + 2**-12, 7.0
    return dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()


PRODUCTS = {
    "sparse @ dense": lambda s, d: s @ d,
    "dense @ sparse": lambda s, d: d.T @ s,
    "addmm with sparse": lambda s, d: torch.addmm(torch.ones(6, 3, dtype=d.dtype), s, d),
    "torch.sparse.mm": lambda s, d: torch.sparse.mm(s, d),
    "sparse @ vector": lambda s, d: s @ d[:, 0],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["coo", "csr"])
@pytest.mark.parametrize("name", PRODUCTS)
def test_products_with_a_sparse_operand_are_ieee_on_every_target(name, layout, dtype):
    # cuSPARSE computes them in the operands' type; the TF32 flags reach cuBLAS and cuDNN only.
    product = PRODUCTS[name]
    s, d = _sparse(layout, dtype), torch.ones((6, 3) if name == "dense @ sparse" else (5, 3), dtype=dtype)
    got, emu = emulated(product, s, d)
    with tf32lab.precision("highest"):
        expected = product(s, d)
    assert torch.equal(got.to_dense(), expected.to_dense())
    assert not emu.unhandled
    if dtype == torch.float32:
        assert emu.coverage and {math for _, math in emu.coverage} == {"ieee"}
        if name in ("sparse @ dense", "dense @ sparse", "addmm with sparse"):  # dense operands: TF32, 1024.5 -> 1025
            assert not torch.equal(emulated(product, s.to_dense(), d)[0], expected.to_dense())
    else:
        assert not emu.coverage


def test_writes_to_sparse_tensors_next_to_rounded_weights_and_their_gradients():
    layer = torch.nn.Linear(5, 5)
    s = _sparse("coo", torch.float32).coalesce()
    weights = torch.sparse_coo_tensor(s.indices(), s.values().clone(), s.shape, requires_grad=True,
                                      check_invariants=True)
    d = torch.ones(5, 3, requires_grad=True)
    with tf32lab.precision("high"), tf32lab.emulate("a100") as emu:
        layer(torch.ones(2, 5))  # a rounded weight is cached: writes are now looked at
        s.mul_(2)
        (torch.sparse.mm(weights, d).sum() + (s @ d).sum()).backward()
    assert weights.grad.layout == torch.sparse_coo and d.grad.shape == d.shape
    assert ("aten::addmm", "tf32-rna") in emu.coverage and not emu.unhandled


# -- torch.compile ----------------------------------------------------------------------------------------------
def test_fullgraph_compile_inside_emulate_runs_eagerly_and_leaves_dynamo_clean_for_a_native_compile(tmp_path):
    # Dynamo skipped the frame (a dispatch mode was on the stack), raised "found no compiled frames", and remembered
    # the skip: the same function compiled natively afterwards raised "Compilation was not attempted". Both orders:
    # dynamo imported inside the block, then already loaded. The process is forked from the suite's CLI server
    # (torch and tf32lab imported, Dynamo not: the first line says so), not a fresh interpreter importing torch.
    code = textwrap.dedent("""
        import sys, torch, tf32lab
        def f(a, b):
            return torch.relu(a @ b) * 2
        a = torch.randn(16, 64, generator=torch.Generator().manual_seed(1)) * 100
        b = torch.randn(64, 8, generator=torch.Generator().manual_seed(2))
        with tf32lab.precision("high"), tf32lab.emulate("a100"):
            emulated = f(a, b)
        for round in ("dynamo imported inside", "dynamo loaded"):
            print(round, "torch._dynamo" in sys.modules)
            with tf32lab.precision("high"), tf32lab.emulate("a100") as emu:
                inside = torch.compile(f, fullgraph=True, backend="eager")(a, b)
            # (the f's one product; Dynamo's own set-up may run ops too, as torch 2.6 does: two dot products)
            print("inside emulated:", torch.equal(inside, emulated), emu.coverage[("aten::mm", "tf32-rna")])
            sys.path.insert(0, {tests!r})
            from dynamo_state import compiling_restored
            print("stance:", "default" if compiling_restored() else "forced")
            native = torch.compile(f, fullgraph=True, backend="eager")(a, b)
            print("native after:", torch.equal(native, f(a, b)))
    """).replace("{tests!r}", repr(str(Path(__file__).parent)))
    (tmp_path / "compile_inside_emulate.py").write_text(code)
    done = cli_runner.run(module="compile_inside_emulate", cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        "dynamo imported inside False", "inside emulated: True 1", "stance: default",
        "native after: True",
        "dynamo loaded True", "inside emulated: True 1", "stance: default",
        "native after: True",
    ]


def _warned_from_here(fn) -> list[str]:
    """The messages of the UserWarnings ``fn`` raises under emulate that a filter keyed on this module ignores."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.filterwarnings("error", category=UserWarning)  # a warning put down to another module raises
        warnings.filterwarnings("ignore", category=UserWarning, module=__name__)
        with tf32lab.precision("high"), tf32lab.emulate("a100"):
            fn()
    return [str(w.message) for w in seen]


@pytest.mark.parametrize("call", [
    lambda: F.mse_loss(torch.randn(3, 1), torch.randn(3)),  # Python, stacklevel=2
    lambda: F.softmax(torch.randn(3)),  # Python, stacklevel=2: implicit dimension
    lambda: torch.add(torch.ones(3), torch.ones(3), out=torch.empty(5)),  # a kernel's TORCH_WARN
], ids=["mse_loss", "softmax", "add_out"])
def test_a_torch_calls_warning_under_emulate_is_put_down_to_its_caller(call):
    # the function mode called every torch function once more from its own frame: the warning's module was
    # tf32lab.emulation.emulator, and a filter keyed on the caller's module (pytest's "ignore::UserWarning:pkg")
    # no longer matched
    assert _warned_from_here(call) == []


@pytest.mark.parametrize("call", [
    lambda: F.softmax(torch.randn(3), dim="x"),
    lambda: torch.add(torch.randn(3), "x"),
    lambda: F.interpolate(torch.randn(1, 1, 4), scale_factor=2, mode="nope"),
], ids=["softmax_dim", "add_type", "interpolate_mode"])
def test_an_ops_own_error_under_emulate_stays_the_callers(call):
    from tf32lab.numbers import origin

    with tf32lab.precision("high"), tf32lab.emulate("a100"), pytest.raises(Exception) as raised:
        call()
    assert origin.raised_by_tf32lab(raised.value) is None


def test_code_execd_under_emulate_is_not_kept_alive_by_its_warnings_attribution():
    # call_site kept each calling frame's globals for its next call: exec's own dicts, and the tensors in them
    import gc
    import weakref

    kept = []
    with tf32lab.precision("high"), tf32lab.emulate("a100"):
        for _ in range(5):
            namespace = {"torch": torch, "big": torch.zeros(1000)}
            exec("torch.add(big, 1)", namespace)
            kept.append(weakref.ref(namespace["big"]))
            del namespace
    gc.collect()
    assert [ref() for ref in kept] == [None] * 5


def test_a_call_with_no_python_frame_below_is_made_plainly():
    # sys._getframe raised "call stack is not deep enough" where C called the op with no Python frame beneath (an
    # atexit callback under an emulate block left open, a hook autograd's device thread calls)
    from tf32lab.emulation import call_site

    a = torch.ones(3)
    assert torch.equal(call_site.as_called(torch.add, (a, a), {}, depth=10_000), a + a)
