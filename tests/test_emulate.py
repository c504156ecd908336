"""emulate(): every op of the families equals an explicitly rounded float64 reference, and differs from IEEE."""

from __future__ import annotations

import pickle
import random
import textwrap
import threading

import pytest
import torch
import torch.nn.functional as F

import cli_runner
import tf32lab
from dynamo_state import compiling_restored
from emulation_reference import bilinear, bound, check, emulated, randn
from tf32lab import Tf32LabError
from tf32lab.control.scope import current_emulation
from tf32lab.emulation import emulator, recurrent, rules
from tf32lab.numbers import formats

aten = torch.ops.aten


# -- one GEMM per op: exact reference -------------------------------------------------------------------
A, B = randn(16, 96, seed=1), randn(96, 24, seed=2)
A3, B3 = randn(3, 16, 96, seed=3), randn(3, 96, 24, seed=4)
C = randn(24, seed=5)

CASES = {
    # name: (call on (a, b), bilinear part as f(a, b) in float64, term added, a, b, K)
    "mm": (torch.mm, torch.mm, None, A, B, 96),
    "addmm": (lambda a, b: torch.addmm(C, a, b, beta=0.5, alpha=2.0), lambda a, b: 2 * a @ b, 0.5 * C, A, B, 96),
    "bmm": (torch.bmm, torch.bmm, None, A3, B3, 96),
    "baddbmm": (lambda a, b: torch.baddbmm(C, a, b), torch.bmm, C, A3, B3, 96),
    "addbmm": (lambda a, b: torch.addbmm(C, a, b), lambda a, b: torch.bmm(a, b).sum(0), C, A3, B3, 3 * 96),
    "linear": (lambda a, b: F.linear(a, b.T, C), lambda a, b: a @ b, C, A3, B, 96),
    "matmul": (torch.matmul, torch.matmul, None, randn(2, 3, 16, 96), B, 96),
    "einsum": (lambda a, b: torch.einsum("bij,bjk->bik", a, b), torch.bmm, None, A3, B3, 96),
    "tensordot": (lambda a, b: torch.tensordot(a, b, dims=([0, 2], [0, 1])),
                  lambda a, b: torch.tensordot(a, b, dims=([0, 2], [0, 1])), None, A3, B3, 3 * 96),
    "_addmm_activation relu": (lambda a, b: aten._addmm_activation(C, a, b),
                               lambda a, b: a @ b, C, A, B, 96),
    "_addmm_activation gelu": (lambda a, b: aten._addmm_activation(C, a, b, use_gelu=True),
                               lambda a, b: a @ b, C, A, B, 96),
}


def _activation(name, x):
    return F.relu(x) if "relu" in name else F.gelu(x) if "gelu" in name else x


@pytest.mark.parametrize("math", ["tf32", "bf16", "tf32x3", "bf16x3", "bfx9"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("name", list(CASES))
def test_gemm_ops_equal_rounded_reference(name, grad, math):
    call, f, term, a, b, k = CASES[name]
    a, b = a.clone().requires_grad_(grad), b.clone()
    options = {} if math == "tf32" else {"math": math}
    with torch.set_grad_enabled(grad):
        out, emu = emulated(call, a, b, **options)
        ieee = call(a, b)
    a, b = a.detach(), b.detach()
    ref = bilinear(f, a, b, math) + (0 if term is None else term.double())
    ref = _activation(name, ref)
    check(out.detach(), ieee.detach(), ref, bound(f, a, b, k, term), math=math)
    assert not emu.unhandled
    assert any(m == (f"{math}-rna" if math == "tf32" else f"{math}-rne" if math == "bf16" else math)
               for _, m in emu.coverage), emu.coverage


def test_rna_pin():
    """pytorch#53635: [1024.5] @ [[1.0]] gave 1025 on an RTX 3090: cuBLAS rounds TF32 ties away from zero."""
    a, b = torch.tensor([[1024.5]]), torch.tensor([[1.0]])
    assert emulated(torch.mm, a, b)[0].item() == 1025.0
    assert emulated(torch.mm, a, b, rounding="rne")[0].item() == 1024.0
    assert emulated(torch.mm, a, b, level="highest")[0].item() == 1024.5


@pytest.mark.parametrize("target", ["h100", "h200"])
def test_hopper_rounds_tf32_operands_to_nearest_even(target):
    # Measured on an H100: A @ I holds exactly the operands as cuBLAS rounded them, and ties went to even.
    a = torch.tensor([[1024.5, 0.0], [0.0, 1536.5]])  # two TF32 ties
    assert emulated(torch.mm, a, torch.eye(2), target=target)[0].diagonal().tolist() == [1024.0, 1536.0]
    assert emulated(torch.mm, a, torch.eye(2), target="a100")[0].diagonal().tolist() == [1025.0, 1537.0]
    assert "measured on an H100" in tf32lab.know.targets.get(target).entry("matmul").source


@pytest.mark.parametrize("call, a, b", [
    (torch.mm, randn(1, 96, seed=20), B),
    (torch.mm, A, randn(96, 1, seed=21)),
    (lambda a, b: torch.addmm(C[:1], a, b), A, randn(96, 1, seed=21)),
    (lambda a, b: F.linear(a, b.T, C), randn(1, 1, 96, seed=22), B),
    (lambda a, b: F.linear(a, b.T), A3, randn(96, 1, seed=23)),
    (torch.bmm, randn(3, 1, 96, seed=24), B3),
    (lambda a, b: torch.baddbmm(C, a, b), randn(3, 1, 96, seed=24), B3),
    (lambda a, b: aten._addmm_activation(C, a, b), randn(1, 96, seed=20), B),
    (torch.mm, randn(64, 1, seed=29), randn(1, 8, seed=30)),
    (torch.bmm, randn(3, 64, 1, seed=29), randn(3, 1, 8, seed=30)),
    (lambda a, b: F.linear(a, b.T), randn(4, 16, 1, seed=31), randn(1, 8, seed=32)),
], ids=["mm-row", "mm-column", "addmm-column", "linear-row", "linear-column", "bmm-row", "baddbmm-row",
        "addmm_activation-row", "mm-outer", "bmm-outer", "linear-outer"])
def test_one_row_or_one_column_products_are_ieee_on_hopper(call, a, b):
    # On an H100, mm/addmm/linear with one row or one column gave the same bits at 'high' as at 'highest'; on an
    # H200 so did every product with an inner dimension of 1 (an outer product), mm and bmm alike.
    out, emu = emulated(call, a, b, target="h100", strict=True)
    assert torch.equal(out, call(a, b)) and {m for _, m in emu.coverage} == {"ieee"}
    # Ampere keeps TF32 for them (pytorch#53635: a 1x1 product was rounded on an RTX 3090)
    _, emu = emulated(call, a, b, target="a100")
    assert {m for _, m in emu.coverage} == {"tf32-rna"}


def test_two_rows_are_a_tf32_gemm_on_hopper():
    a = randn(2, 96, seed=25)
    out, emu = emulated(torch.mm, a, B, target="h100")
    assert {m for _, m in emu.coverage} == {"tf32-rne"} and not torch.equal(out, a @ B)
    _, emu = emulated(lambda x: F.linear(x, B.T), randn(2, 1, 96, seed=26), target="h100")
    assert {m for _, m in emu.coverage} == {"tf32-rne"}  # 2 rows once the batch dims are folded


def test_hopper_convolutions_and_rnns_round_to_nearest_even_and_say_it_is_per_kernel():
    x, w = randn(2, 8, 10, 10, seed=27), randn(6, 8, 3, 3, seed=28)
    _, emu = emulated(F.conv2d, x, w, target="h100", level="highest")
    assert {m for _, m in emu.coverage} == {"tf32-rne"}
    for key in ("conv", "rnn"):
        assert "per kernel" in tf32lab.know.targets.get("h100").entry(key).source


@pytest.mark.parametrize("name", ["mv", "addmv", "dot", "addr"])
def test_matvec_ops(name):
    v = randn(96, seed=7)
    calls = {"mv": (lambda a, x: torch.mv(a, x), lambda a, x: a @ x, None, A, v),
             "addmv": (lambda a, x: torch.addmv(C[:16], a, x), lambda a, x: a @ x, C[:16], A, v),
             "dot": (torch.dot, torch.dot, None, v, randn(96, seed=8)),
             "addr": (lambda x, y: torch.addr(A[:, :24], x, y), torch.outer, A[:, :24], A[:, 0], C)}
    call, f, term, a, b = calls[name]
    # The a100 computes matrix-vector products in IEEE (gemv has no tensor-core path) ...
    out, emu = emulated(call, a, b)
    assert torch.equal(out, call(a, b)) and {m for _, m in emu.coverage} == {"ieee"}
    # ... and math= forces one math everywhere.
    out, emu = emulated(call, a, b, math="tf32")
    ref = bilinear(f, a, b, "tf32") + (0 if term is None else term.double())
    check(out, call(a, b), ref, bound(f, a, b, a.shape[-1], term))
    assert not emu.unhandled


# -- convolutions ------------------------------------------------------------------------------------------
CONVS = {
    "conv1d": (F.conv1d, randn(2, 4, 20, seed=10), randn(6, 4, 3, seed=11), {}),
    "conv2d": (F.conv2d, randn(2, 4, 9, 9, seed=12), randn(6, 4, 3, 3, seed=13), {"padding": 1}),
    "conv3d": (F.conv3d, randn(1, 2, 5, 6, 6, seed=14), randn(4, 2, 3, 3, 3, seed=15), {}),
    "conv_transpose2d": (F.conv_transpose2d, randn(2, 4, 7, 7, seed=16), randn(4, 3, 3, 3, seed=17),
                         {"stride": 2}),
    "conv2d groups": (F.conv2d, randn(2, 8, 9, 9, seed=18), randn(8, 2, 3, 3, seed=19), {"groups": 4}),
}


@pytest.mark.parametrize("math", ["tf32", "tf32x3"])
@pytest.mark.parametrize("name", list(CONVS))
def test_convolutions(name, math):
    conv, x, w, kw = CONVS[name]
    bias = randn(w.shape[1] * kw.get("groups", 1) if "transpose" in name else w.shape[0], seed=20)

    def call(a, b):
        return conv(a, b, bias, **kw)

    def f(a, b):
        return conv(a, b, None, **kw)

    # highest: cuDNN's TF32 flag defaults to on, so the a100 runs convolutions in TF32 anyway
    out, emu = emulated(call, x, w, level="highest", **({} if math == "tf32" else {"math": math}))
    k = w[0].numel() if "transpose" not in name else w.shape[0] * w[0, 0].numel()
    extra = bias.double().view(-1, *[1] * (x.dim() - 2))
    check(out, call(x, w), bilinear(f, x, w, math) + extra, bound(f, x, w, k, extra), math=math)
    assert not emu.unhandled


@pytest.mark.parametrize("math", ["tf32", "tf32x3"])
def test_convolution_backward(math):
    x, w = randn(2, 4, 9, 9, seed=21).requires_grad_(), randn(6, 4, 3, 3, seed=22).requires_grad_()
    bias = randn(6, seed=23).requires_grad_()
    g = randn(2, 6, 9, 9, seed=24)
    with tf32lab.emulate("a100", **({} if math == "tf32" else {"math": math})) as emu:
        F.conv2d(x, w, bias, padding=1).backward(g)
    assert ("aten::convolution_backward", "tf32-rna" if math == "tf32" else math) in emu.coverage
    grad_x, grad_w, grad_b = x.grad, w.grad, bias.grad
    x.grad = w.grad = bias.grad = None
    F.conv2d(x, w, bias, padding=1).backward(g)
    ieee_x, ieee_w, ieee_b = x.grad, w.grad, bias.grad
    x, w = x.detach(), w.detach()

    def dx(gg, ww):
        return torch.nn.grad.conv2d_input(x.shape, ww, gg, padding=1)

    def dw(gg, xx):
        return torch.nn.grad.conv2d_weight(xx, w.shape, gg, padding=1)

    check(grad_x, ieee_x, bilinear(dx, g, w, math), bound(dx, g, w, 6 * 9), math=math)
    check(grad_w, ieee_w, bilinear(dw, g, x, math), bound(dw, g, x, 2 * 81), math=math)
    assert torch.allclose(grad_b, ieee_b, rtol=1e-6, atol=1e-5)  # a plain sum, in float32 everywhere


# -- attention ---------------------------------------------------------------------------------------------
Q, K, V = randn(2, 3, 8, 32, seed=30), randn(2, 3, 10, 32, seed=31), randn(2, 3, 10, 16, seed=32)
MASK = randn(8, 10, seed=33)


def attention_reference(q, k, v, mask, math, scale=None, math_backend=False):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if math_backend:
        q, k, scale = q * scale**0.5, k * scale**0.5, 1.0
    s = bilinear(torch.matmul, q, k.transpose(-2, -1), math) * scale + mask.double()
    p = torch.softmax(s, -1)
    tol_s = bound(torch.matmul, q, k.transpose(-2, -1), q.shape[-1]) * scale
    out = bilinear(torch.matmul, p.float(), v, math)
    tol = bound(torch.matmul, p.float(), v, v.shape[-2]) + (tol_s.max() * v.abs().max().double())
    return out, tol


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_sdpa_is_3xtf32_on_a100(grad):
    """float32 SDPA picks the memory-efficient kernel, which runs 3xTF32 whatever the level."""
    q = Q.clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        out, emu = emulated(F.scaled_dot_product_attention, q, K, V, MASK)
        ieee = F.scaled_dot_product_attention(q, K, V, MASK)
    assert {m for _, m in emu.coverage} == {"tf32x3"} and not emu.unhandled
    ref, tol = attention_reference(Q, K, V, MASK, "tf32x3")
    check(out.detach(), ieee.detach(), ref, tol, math="tf32x3")


def test_sdpa_math_backend_follows_the_matmul_flag():
    before = torch.backends.cuda.mem_efficient_sdp_enabled()
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    try:
        out, emu = emulated(F.scaled_dot_product_attention, Q, K, V, MASK)
        out_highest, _ = emulated(F.scaled_dot_product_attention, Q, K, V, MASK, level="highest")
    finally:
        torch.backends.cuda.enable_mem_efficient_sdp(before)
    assert {m for _, m in emu.coverage} == {"tf32-rna"}
    ref, tol = attention_reference(Q, K, V, MASK, "tf32", math_backend=True)
    check(out, F.scaled_dot_product_attention(Q, K, V, MASK), ref, tol, flips=0.02)
    assert torch.allclose(out_highest, F.scaled_dot_product_attention(Q, K, V, MASK), atol=1e-6)


def test_sdpa_math_variant_returns_the_weights_it_used():
    with torch.inference_mode():  # reaches the dispatcher whole (elsewhere it decomposes into emulated bmm)
        (out, p), emu = emulated(lambda q, k: aten._scaled_dot_product_attention_math(q, k, V, MASK), Q, K)
    assert {m for _, m in emu.coverage} == {"tf32-rna"}
    root = 32**-0.25  # the math backend scales both operands by sqrt(scale)
    s_ref = bilinear(torch.matmul, Q * root, K.transpose(-2, -1) * root, "tf32") + MASK.double()
    assert torch.allclose(p.double(), torch.softmax(s_ref, -1), atol=1e-5)
    ref = bilinear(torch.matmul, p, V, "tf32")
    ieee = torch.matmul(p, V)
    check(out, ieee, ref, bound(torch.matmul, p, V, 10))


@pytest.mark.parametrize("variant", ["flash_for_cpu", "efficient"])
def test_sdpa_kernel_variants_forward_and_backward(variant):
    q, k, v = Q.clone().requires_grad_(), K.clone().requires_grad_(), V.clone().requires_grad_()
    g = randn(*Q.shape[:-1], 16, seed=34)
    if variant == "flash_for_cpu":
        call = lambda q, k, v: aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)[0]  # noqa: E731
        mask = torch.zeros(8, 10)
    else:
        call = lambda q, k, v: aten._scaled_dot_product_efficient_attention(q, k, v, MASK, True)[0]  # noqa: E731
        mask = MASK
    with tf32lab.emulate("a100") as emu:
        out = call(q, k, v)
        if variant == "flash_for_cpu":
            out.backward(g)
    assert not emu.unhandled and {m for _, m in emu.coverage} == {"tf32x3"}
    ref, tol = attention_reference(Q, K, V, mask, "tf32x3")
    ieee = F.scaled_dot_product_attention(Q, K, V, mask)
    check(out.detach(), ieee, ref, tol, math="tf32x3")
    if variant == "flash_for_cpu":
        grads = [t.grad for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        F.scaled_dot_product_attention(q, k, v).backward(g)
        for emulated_grad, t in zip(grads, (q, k, v)):
            assert torch.allclose(emulated_grad, t.grad, rtol=1e-4, atol=1e-5)  # 3xTF32 is near float32
            assert not torch.equal(emulated_grad, t.grad)


@pytest.mark.parametrize("backend", ["math", "fused"])
def test_sdpa_edge_cases_compute_as_pytorch_does(backend):
    """A negative scale (the math backend puts its sign on q), a fully masked row (zeros from torch 2.5, NaN
    before, pytorch#131060) and no head dim (every score 0: uniform attention), forward and backward, at
    `highest` (IEEE products: PyTorch's own results within float32's rounding)."""
    q, k, v = (randn(1, 2, 4, 8, seed=s) for s in (50, 51, 52))
    keep = torch.ones(4, 4, dtype=torch.bool)
    keep[1] = False
    calls = {"negative scale": lambda q, k: F.scaled_dot_product_attention(q, k, v, scale=-0.5),
             "masked row": lambda q, k: F.scaled_dot_product_attention(q, k, v, keep),
             "both": lambda q, k: F.scaled_dot_product_attention(q, k, v, keep, scale=-0.5),
             "no head dim": lambda q, k: F.scaled_dot_product_attention(q[..., :0], k[..., :0], v)}
    before = torch.backends.cuda.mem_efficient_sdp_enabled()
    torch.backends.cuda.enable_mem_efficient_sdp(backend == "fused")
    try:
        for name, call in calls.items():
            leaves = [t.clone().requires_grad_() for t in (q, k)]
            out, emu = emulated(call, *leaves, level="highest")
            assert emu.coverage and not emu.unhandled, name
            out.backward(torch.ones_like(out))  # after the block: PyTorch's own backward
            native = [t.clone().requires_grad_() for t in (q, k)]
            want = call(*native)
            want.backward(torch.ones_like(want))
            assert torch.allclose(out, want, atol=1e-6), name
            for got, expected in zip(leaves, native):
                assert torch.allclose(got.grad, expected.grad, atol=1e-5), name
            with tf32lab.emulate("a100"):  # the emulated backward: inside the block
                inside = [t.clone().requires_grad_() for t in (q, k)]
                call(*inside).sum().backward()
            assert all(torch.allclose(a.grad, b.grad, atol=1e-5) for a, b in zip(inside, native)), name
    finally:
        torch.backends.cuda.enable_mem_efficient_sdp(before)


# -- the rest of the families ---------------------------------------------------------------------------
def test_cdist_uses_a_gemm_past_25_rows():
    x1, x2 = randn(30, 16, seed=40), randn(40, 16, seed=41)
    out, emu = emulated(torch.cdist, x1, x2)
    assert not emu.unhandled and {m for _, m in emu.coverage} == {"tf32-rna"}
    n1, n2 = x1.pow(2).sum(-1, keepdim=True), x2.pow(2).sum(-1, keepdim=True)
    a = torch.cat([x1 * -2, n1, torch.ones_like(n1)], -1)
    b = torch.cat([x2, torch.ones_like(n2), n2], -1).T
    ref = bilinear(torch.mm, a, b, "tf32").clamp_min(0)  # compared squared, where the GEMM's error lives
    tol = bound(torch.mm, a, b, 18) + 4 * 2.0**-24 * ref
    check(out.double() ** 2, torch.cdist(x1, x2).double() ** 2, ref, tol)
    small, emu = emulated(torch.cdist, x1[:5], x2[:5])  # a direct kernel below 25 rows: no GEMM, IEEE
    assert torch.equal(small, torch.cdist(x1[:5], x2[:5]))


def test_non_float32_passes_through():
    a, b = A.double(), B.double()
    out, emu = emulated(torch.mm, a, b)
    assert torch.equal(out, a @ b) and not emu.coverage and not emu.unhandled


def test_unknown_op_of_a_family_is_unhandled_and_strict_raises():
    if not hasattr(torch.ops, "tf32lab_test") or not hasattr(torch.ops.tf32lab_test, "fancy_matmul"):
        torch.library.define("tf32lab_test::fancy_matmul", "(Tensor a, Tensor b) -> Tensor")
        torch.library.impl("tf32lab_test::fancy_matmul", "cpu")(lambda a, b: a @ b)
    op = torch.ops.tf32lab_test.fancy_matmul
    out, emu = emulated(op, A, B)
    assert emu.unhandled == {"tf32lab_test::fancy_matmul": 1} and torch.equal(out, A @ B)
    with pytest.raises(Tf32LabError, match="tf32lab_test::fancy_matmul"):
        emulated(op, A, B, strict=True)


def test_bad_arguments_are_refused_clearly():
    with pytest.raises(Tf32LabError, match="unknown target 'a200'; accepted: 'v100'"):
        tf32lab.emulate("a200")
    with pytest.raises(Tf32LabError, match="unknown math 'fp8'"):
        tf32lab.emulate(math="fp8")
    with pytest.raises(Tf32LabError, match="unknown rounding 'up'"):
        tf32lab.emulate(rounding="up")


def test_targets_differ_as_the_table_says():
    for target, expected in [("v100", A @ B), ("cpu", A @ B)]:
        assert torch.equal(emulated(torch.mm, A, B, target=target)[0], expected)
    high = emulated(torch.mm, A, B, target="h100")[0]
    medium = emulated(torch.mm, A, B, target="h100", level="medium")[0]
    assert torch.equal(high, medium)  # cuBLAS never uses bf16 for float32: medium is TF32 on CUDA
    amx = emulated(torch.mm, A, B, target="cpu-amx", level="medium")[0]
    check(amx, A @ B, bilinear(torch.mm, A, B, "bf16"), bound(torch.mm, A, B, 96))


# -- gradients, caching, compile, TorchScript, threads ----------------------------------------------------
def test_mlp_gradients_equal_reference_gradients():
    torch.manual_seed(60)
    mlp = torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    x = randn(32, 48, seed=61)
    g = randn(32, 10, seed=62)
    with tf32lab.precision("high"), tf32lab.emulate("a100") as emu:
        hidden = mlp[1](mlp[0](x))
        hidden.retain_grad()
        mlp[2](hidden).backward(g)
    assert not emu.unhandled
    w1, w2 = mlp[0].weight, mlp[2].weight
    hidden_grad = hidden.grad
    pre_grad = hidden_grad * (hidden > 0)  # the gradient entering the first layer, as the emulation computed it
    hidden = hidden.detach()

    def expect(got, f, a, b, k):
        check(got, f(a, b).float(), bilinear(f, a, b, "tf32"), bound(f, a, b, k))

    expect(w2.grad, lambda gg, h: gg.T @ h, g, hidden, 32)
    expect(hidden_grad, lambda gg, w: gg @ w, g, w2.detach(), 10)
    expect(w1.grad, lambda gg, xx: gg.T @ xx, pre_grad, x, 32)


def test_an_activation_is_rounded_for_every_op_so_a_write_through_numpy_is_seen():
    q = torch.nn.Linear(64, 32)
    x = randn(8, 64, seed=71)
    with tf32lab.precision("high"), tf32lab.emulate("a100"):
        before = q(x)
        x.numpy()[:] *= 2  # no version counter moves, no op passes the emulator
        after = q(x)
    with tf32lab.precision("high"), tf32lab.emulate("a100"):
        assert torch.equal(after, q(x)) and not torch.equal(after, before)


def test_a_linear_backward_rounds_its_output_gradient_once_for_both_gemms(monkeypatch):
    layer = torch.nn.Linear(64, 48)
    x = randn(16, 64, seed=72).requires_grad_()
    grad = randn(16, 48, seed=73)

    def grads(seen: list) -> tuple[torch.Tensor, torch.Tensor]:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        with tf32lab.precision("high"), tf32lab.emulate("a100"):
            out = layer(x)
            with monkeypatch.context() as m:
                m.setitem(emulator._SINGLE_ROUND, "tf32", _counting_into(seen))
                out.backward(grad)
        return layer.weight.grad, x.grad

    kept = grads(seen := [])
    # grad_input = grad @ W and grad_weight = grad.T @ x: grad rounded once for both, x once, W (the forward read
    # W.T) kept from the forward
    assert sorted(seen) == sorted([grad.numel(), x.numel()])
    monkeypatch.setattr(emulator._WeightCache, "RECENT_BYTES", 0)  # no copy kept: every operand rounded afresh
    fresh = grads(seen := [])
    assert sorted(seen) == sorted([grad.numel(), grad.numel(), x.numel()])  # W is a parameter: still kept
    assert all(torch.equal(a, b) for a, b in zip(kept, fresh))  # the same bits either way


class _WritesBetween(torch.autograd.Function):
    """A custom backward that writes its gradient through a numpy view between two GEMMs: user code."""

    @staticmethod
    def forward(ctx, x, a, b):
        ctx.save_for_backward(a, b)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        g = g.contiguous().clone()
        first = g @ a
        g.numpy()[:] = 1.0  # no version counter moves, no op passes the emulator
        return first + g @ b, None, None


def test_a_custom_backward_gets_no_kept_copies_so_its_numpy_writes_are_seen():
    a, b, g = randn(64, 64, seed=74), randn(64, 64, seed=75), randn(64, 64, seed=76)
    x = randn(64, 64, seed=77).requires_grad_()
    with tf32lab.precision("high"), tf32lab.emulate("a100"):
        _WritesBetween.apply(x, a, b).backward(g)
        want = g @ a + torch.ones(64, 64) @ b
    assert torch.equal(x.grad, want)


@pytest.mark.parametrize("op", ["mm", "matmul", "bmm", "addmm"])
def test_a_product_into_out_gets_the_emulated_value(op):
    x, c = randn(16, 16, seed=78), randn(16, 16, seed=79)
    calls = {"mm": lambda o: torch.mm(x, x, out=o), "matmul": lambda o: torch.matmul(x, x, out=o),
             "bmm": lambda o: torch.bmm(x[None], x[None], out=o[None]), "addmm": lambda o: torch.addmm(c, x, x, out=o)}
    plain = {"mm": lambda: x @ x, "matmul": lambda: x @ x, "bmm": lambda: x @ x, "addmm": lambda: c + x @ x}
    out = torch.empty(16, 16)
    with tf32lab.precision("high"), tf32lab.emulate("a100"):
        calls[op](out)
        want = torch.addmm(c, x, x) if op == "addmm" else torch.mm(x, x)
    assert torch.equal(out, want) and not torch.equal(out, plain[op]())


def test_a_product_written_into_a_weight_through_out_drops_its_rounded_copy():
    w = torch.nn.Parameter(randn(16, 16, seed=80))
    x = randn(16, 16, seed=81)
    with tf32lab.precision("high"), tf32lab.emulate("a100"):
        x @ w  # w's rounded copy made
        torch.mm(x, x, out=w.data)
        got = x @ w
    with tf32lab.precision("high"), tf32lab.emulate("a100"):
        assert torch.equal(got, x @ w.detach().clone())


def _counting_into(seen: list):
    original = emulator._SINGLE_ROUND["tf32"]

    def counting(x, *args, **kwargs):
        seen.append(x.numel())
        return original(x, *args, **kwargs)

    return counting


def test_parameter_copies_are_rounded_once_per_block_and_dropped_with_it(monkeypatch):
    rounded = []
    original = emulator._SINGLE_ROUND["tf32"]

    def counting(x, *args, **kwargs):
        rounded.append(x.numel())
        return original(x, *args, **kwargs)

    monkeypatch.setitem(emulator._SINGLE_ROUND, "tf32", counting)
    layer = torch.nn.Linear(64, 32)
    x = randn(8, 64, seed=70)
    with tf32lab.precision("high"), tf32lab.emulate("a100"):
        first = layer(x)
        again = layer(x)  # the weight's rounded copy is reused ...
        block = current_emulation()
        assert len(block.cache.entries) == 1 and rounded.count(layer.weight.numel()) == 1
        with torch.no_grad():
            layer.weight.mul_(2)  # ... until it changes: the version counter moves, the copy is rounded again
        doubled = layer(x)
        assert rounded.count(layer.weight.numel()) == 2
    assert torch.equal(first, again)
    assert torch.allclose(doubled - layer.bias, 2 * (first - layer.bias), atol=1e-5)
    assert len(block.cache) == 0  # nothing outlives the block


def test_a_reused_weight_cache_keeps_a_copy_from_the_second_use_on(monkeypatch):
    rounded = []
    monkeypatch.setitem(emulator._SINGLE_ROUND, "tf32", _counting_into(rounded))
    layer = torch.nn.Linear(64, 32)
    x = randn(8, 64, seed=71)
    with tf32lab.precision("high"), tf32lab.emulate("a100", weight_cache="reused"):
        first = layer(x)
        block = current_emulation()
        # one forward reads each weight once: rounded for its op alone, no copy of the model held to the end
        assert len(block.cache.entries) == 0 and rounded.count(layer.weight.numel()) == 1
        again = layer(x)
        layer(x)  # rounded again and kept at the second use, the kept copy read at the third
        assert len(block.cache.entries) == 1 and rounded.count(layer.weight.numel()) == 2
    with tf32lab.precision("high"), tf32lab.emulate("a100"):
        kept = layer(x)
    assert torch.equal(first, kept) and torch.equal(again, kept)  # the same bits as a block that keeps every copy
    assert len(block.cache) == 0 and not block.cache.seen


@pytest.mark.parametrize("bad", ["yes", "Reused", None])
def test_an_unknown_weight_cache_is_refused_by_name(bad):
    with pytest.raises(tf32lab.Tf32LabError, match=rf"unknown weight_cache {bad!r}; accepted: True, False, 'reused'"):
        tf32lab.emulate("a100", weight_cache=bad)


def test_compiled_model_runs_eagerly_inside_emulate():
    def escaping_backend(graph, example_inputs):
        # A compiled kernel never comes back through the dispatcher: stand-in that hides its ops the same way.
        def run(*args):
            with torch._C._DisableTorchDispatch():
                return graph(*args)

        return run

    layer = torch.nn.Linear(64, 32)
    compiled = torch.compile(layer, backend=escaping_backend)
    x = randn(8, 64, seed=71)
    compiled(x)  # compiled outside
    out, emu = emulated(compiled, x)
    assert not emu.unhandled and emu.coverage
    assert torch.equal(out, emulated(layer, x)[0]) and not torch.equal(out, layer(x))
    assert compiling_restored()


def test_without_a_compile_neither_emulate_nor_check_imports_dynamo_and_a_compile_inside_the_block_is_emulated(
        tmp_path):
    # torch._dynamo costs 71 MiB and a second to import: a program that never compiles does not pay it. One that
    # compiles inside the block (importing dynamo there) is still emulated: Dynamo runs eagerly under the mode.
    # The process is forked from the suite's CLI server (torch and tf32lab imported, Dynamo not: were it, the
    # first line would say so), without the 2-3 CPU seconds of a fresh interpreter's import of torch.
    code = textwrap.dedent("""
        import sys, threading, torch, tf32lab
        def escaping_backend(graph, example_inputs):
            def run(*args):
                with torch._C._DisableTorchDispatch():
                    return graph(*args)
            return run
        torch.manual_seed(0)
        layer = torch.nn.Linear(64, 32)
        x = torch.randn(8, 64) * 100 + 1
        with tf32lab.precision("high"), tf32lab.emulate("a100"):
            emulated = layer(x)
        tf32lab.check(tf32lab.Workload(layer, x, name="one layer"))
        class Helped(torch.nn.Module):  # part of its forward on a helper thread, which the check watches
            def forward(self, x):
                out = []
                helper = threading.Thread(target=lambda: out.append(layer(x)))
                helper.start()
                helper.join()
                return layer(x) + out[0]
        tf32lab.check(tf32lab.Workload(Helped(), x, name="a helper thread"), levels=("high",), speed=False)
        print("dynamo after emulate and check:", "torch._dynamo" in sys.modules)
        with tf32lab.precision("high"), tf32lab.emulate("a100"):
            compiled = torch.compile(layer, backend=escaping_backend)
            inside = compiled(x)
        print("compiled inside:", torch.equal(inside, emulated), not torch.equal(inside, layer(x)))
    """)
    (tmp_path / "without_a_compile.py").write_text(code)
    done = cli_runner.run(module="without_a_compile", cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["dynamo after emulate and check: False", "compiled inside: True True"]


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_torchscript_modules_are_emulated():
    layer = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    scripted = torch.jit.script(layer)
    x = randn(8, 64, seed=72)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            out, emu = emulated(scripted, x)
            assert torch.equal(out, emulated(layer, x)[0]) and not emu.unhandled and emu.coverage


@pytest.mark.parametrize("target", ["a100", "cpu-amx"])
def test_threads_each_get_the_math_of_their_own_scope(target):
    a, b = randn(16, 512, seed=80), randn(512, 64, seed=81)
    expected = {}
    for level in tf32lab.LEVELS:
        math = tf32lab.know.targets.get(target).math("matmul", {
            **tf32lab.know.levels.level_cells(level)})
        rnd = {"ieee": lambda t: t, "tf32": formats.round_tf32, "bf16": formats.round_bf16}[math.name]
        options = {} if math.rounding is None else {"rounding": math.rounding}
        expected[level] = rnd(a, **options) @ rnd(b, **options)
    failures, levels_seen = [], []

    def worker(seed):
        rng = random.Random(seed)
        level = rng.choice(tf32lab.LEVELS)
        levels_seen.append(level)
        with tf32lab.precision(level), tf32lab.emulate(target):
            for _ in range(200):
                if not torch.equal(a @ b, expected[level]):
                    failures.append(level)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures and len(levels_seen) == 8
    assert len(set(levels_seen)) > 1


# -- large operands: the compiled rounding (numba) gives what the tensor code gives ----------------------------------
@pytest.mark.skipif(not formats.load_compiled(), reason="numba not installed")
@pytest.mark.parametrize("target", ["a100", "h100"])
def test_compiled_rounding_changes_no_bit_of_an_emulated_layer(target, monkeypatch):
    # operands above formats.COMPILED_FROM: a linear layer (one rounding) and attention over permuted heads (split
    # operands), computed with the kernel and with the tensor code
    torch.manual_seed(0)
    x, layer = torch.randn(64, 18, 384), torch.nn.Linear(384, 384)
    heads = [torch.randn(64, 18, 12, 32).transpose(1, 2) for _ in range(3)]
    mask = torch.ones(64, 1, 18, 18, dtype=torch.bool).tril()

    def run():
        return layer(x), F.scaled_dot_product_attention(*heads, attn_mask=mask)

    with torch.no_grad():
        compiled, _ = emulated(run, target=target)
        monkeypatch.setattr(formats, "COMPILED_FROM", 1 << 62)
        tensor_code, emu = emulated(run, target=target)
    assert sum(emu.coverage.values()) >= 2 and all(torch.equal(a, b) for a, b in zip(compiled, tensor_code))
    assert not torch.equal(compiled[0], layer(x).detach())  # rounded: not float32's own result


def test_the_builtin_covariance_is_safe_at_high_on_hopper_and_not_on_ampere():
    # Its mean's outer product (K = 1) takes no TF32 on an H200, so only the Gram term does. Measured there:
    # `high` 5.5e-04 natively and 5.6e-04 emulated as h200; as a100 (whose thin products keep the flag's TF32,
    # unmeasured) 4.6e-02. Before, h200 said FAILED at 4.6e-02 where the GPU passed.
    from tf32lab.workloads.builtin import covariance

    errors = {}
    for target in ("h200", "a100"):
        report = tf32lab.check(covariance(), levels=("high",), target=target, speed=False)
        errors[target] = report.level("high").outputs[0].normwise
    assert errors["h200"] < 1e-3 < 1e-2 < errors["a100"]


# -- the caller's own errors ----------------------------------------------------------------------------------
def _mha_mismatched():
    torch.nn.MultiheadAttention(8, 2)(torch.ones(4, 1, 8), torch.ones(4, 1, 6), torch.ones(4, 1, 8))


REFUSED = {  # operands that PyTorch refuses natively: a rule, its part of a composite, or a whole function meets them
    "mm": lambda: torch.ones(4, 4) @ torch.ones(5, 1),
    "linear": lambda: F.linear(torch.ones(2, 3), torch.ones(4, 5)),
    "baddbmm": lambda: torch.baddbmm(torch.ones(2, 4, 3), torch.ones(2, 4, 4), torch.ones(2, 5, 3)),
    "addr": lambda: torch.addr(torch.ones(4, 4), torch.ones(4), torch.ones(5)),
    "complex mm": lambda: torch.ones(2, 3, dtype=torch.complex64) @ torch.ones(4, 2, dtype=torch.complex64),
    "conv2d": lambda: F.conv2d(torch.ones(1, 3, 8, 8), torch.ones(4, 2, 3, 3)),
    "conv_tbc": lambda: torch.conv_tbc(torch.ones(1, 4, 4), torch.ones(1, 5, 2), torch.ones(2)),
    "lstm_cell": lambda: torch.lstm_cell(torch.ones(2, 3), (torch.ones(2, 4), torch.ones(2, 4)), torch.ones(16, 5),
                                         torch.ones(16, 4)),
    "sdpa": lambda: F.scaled_dot_product_attention(torch.ones(1, 2, 4, 8), torch.ones(1, 2, 4, 6),
                                                   torch.ones(1, 2, 4, 8)),
    "multi-head attention": _mha_mismatched,
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_operands_pytorch_refuses_raise_its_own_error_not_one_of_tf32labs(name):
    # A rule computes on rounded copies of the operands, so the kernel it calls met a bad shape first and said so in
    # its own words, from a frame of tf32lab's: the pytest plugin reported "tf32lab error (not precision) ...
    # please report" for a test's own shape error. The op is run natively where its emulation raised.
    from tf32lab.pytest_plugin import _inside_tf32lab

    call = REFUSED[name]
    with pytest.raises(Exception) as native:
        call()
    with pytest.raises(type(native.value)) as emulated_error, tf32lab.precision("high"), tf32lab.emulate("a100"):
        call()
    assert str(emulated_error.value) == str(native.value)
    assert _inside_tf32lab(emulated_error) is None, emulated_error.getrepr()
    assert emulated_error.value.__suppress_context__ or emulated_error.value.__context__ is None


def test_a_rule_that_breaks_where_the_op_runs_natively_is_still_tf32labs_own():
    # a custom op given the addmm rule, which takes three operands where the op has two: natively it computes
    from tf32lab.pytest_plugin import _inside_tf32lab

    if not hasattr(torch.ops.tf32labemulatetest, "product"):
        library = torch.library.Library("tf32labemulatetest", "DEF")
        library.define("product(Tensor a, Tensor b) -> Tensor")
        library.impl("product", lambda a, b: a @ b, "CompositeExplicitAutograd")
        rules.rule(torch.ops.tf32labemulatetest.product)(rules.RULES[torch.ops.aten.addmm])
        test_a_rule_that_breaks_where_the_op_runs_natively_is_still_tf32labs_own.library = library  # kept alive
    a = torch.ones(4, 4)
    assert torch.equal(torch.ops.tf32labemulatetest.product(a, a), a @ a)
    with pytest.raises(ValueError, match="not enough values to unpack") as error, tf32lab.precision("high"), \
            tf32lab.emulate("a100"):
        torch.ops.tf32labemulatetest.product(a, a)
    where = _inside_tf32lab(error)
    assert where is not None and where[1].startswith("tf32lab/emulation/rules.py"), where


def _raising(error: BaseException):
    """A rule that raises ``error``."""
    def rule(call, func, args, kwargs):
        raise error

    return rule


def _transposed_in_backward(call, func, args, kwargs):
    """aten.mm's rule, its result transposed inside a backward: a gradient of the wrong shape."""
    out = rules.RULES[aten.mm](call, func, args, kwargs)
    return out.t().contiguous() if torch._C._current_autograd_node() is not None else out


@pytest.fixture
def breaks(monkeypatch):
    """``breaks(op, rule)``: ``op`` emulated by ``rule`` for this test."""
    def apply(op, rule):
        monkeypatch.setitem(emulator._TREATMENTS, op, emulator.Treatment("matmul", "rule", rule))
    return apply


@pytest.mark.parametrize("error", [RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to ..."),
                                   torch.cuda.OutOfMemoryError("CUDA out of memory."), MemoryError()])
def test_a_rule_that_runs_out_of_memory_is_not_rerun_natively(breaks, monkeypatch, error):
    # the native rerun, while the rule's buffers are held, ran out too, and the emulation's own memory was put down
    # to the caller
    reruns = []
    monkeypatch.setattr(emulator, "_refused_natively", lambda *args: reruns.append(args))
    breaks(aten.mm.default, _raising(error))
    with pytest.raises(type(error)) as raised, tf32lab.precision("high"), tf32lab.emulate("a100"):
        torch.ones(4, 4) @ torch.ones(4, 4)
    assert raised.value is error and not reruns


def test_a_gradient_of_the_wrong_shape_from_a_rule_stays_tf32labs(breaks):
    # autograd's engine refuses it below the backward's hand-off: not rerun, not the caller's
    from tf32lab.pytest_plugin import _inside_tf32lab

    breaks(aten.mm.default, _transposed_in_backward)
    a = torch.ones(4, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="invalid gradient") as error, tf32lab.precision("high"), \
            tf32lab.emulate("a100"):
        (a @ torch.ones(3, 5)).sum().backward()
    assert _inside_tf32lab(error) is not None


BACKWARDS_REFUSED = {  # refused by autograd before any op of the backward ran: the caller's own, as natively
    "no grad_fn": lambda a, b: (a @ b).sum().backward(),
    "not a scalar": lambda a, b: (a.requires_grad_() @ b).backward(),
    "grad of no grad_fn": lambda a, b: torch.autograd.grad((a @ b).sum(), [a]),
    "gradient of another shape": lambda a, b: (a.requires_grad_() @ b).backward(torch.ones(2, 2)),
}


@pytest.mark.parametrize("name", list(BACKWARDS_REFUSED))
def test_a_backward_autograd_refuses_before_any_emulated_op_is_the_callers(name):
    # the engine's error surfaced below the emulator's hand-off of the backward: the plugin said "tf32lab error
    # (not precision) ... please report" for a test's own mistake
    from tf32lab.pytest_plugin import _inside_tf32lab

    call = BACKWARDS_REFUSED[name]
    with pytest.raises(RuntimeError) as native:
        call(torch.ones(4, 3), torch.ones(3, 5))
    with pytest.raises(RuntimeError) as error, tf32lab.precision("high"), tf32lab.emulate("a100"):
        call(torch.ones(4, 3), torch.ones(3, 5))
    assert str(error.value) == str(native.value)
    assert _inside_tf32lab(error) is None, error.getrepr()
    # nothing of tf32lab's rides on the error: it pickles (a process pool's worker sends it back) and holds no frame
    assert vars(error.value) == vars(native.value) and pickle.loads(pickle.dumps(error.value)).args == native.value.args


def test_another_threads_emulated_ops_in_the_block_leave_a_backwards_error_the_callers():
    # the block's whole coverage was counted: another thread's matmuls, during the backward, made the caller's second
    # backward through a graph of no emulated op tf32lab's error, at random
    from tf32lab.pytest_plugin import _inside_tf32lab

    def elsewhere(grad):  # a thread of the same block emulates a matmul while this backward runs
        worker = threading.Thread(target=lambda: _in(emu, lambda: torch.ones(4, 4) @ torch.ones(4, 4)))
        worker.start()
        worker.join()

    x = torch.ones(3, requires_grad=True)
    with tf32lab.precision("high"), tf32lab.emulate("a100") as emu:
        y = (x * 2).exp()
        y.register_hook(elsewhere)
        y.sum().backward()
        with pytest.raises(RuntimeError, match="second time") as error:
            y.sum().backward()
    assert emu.coverage[("aten::mm", "tf32-rna")] == 2
    assert _inside_tf32lab(error) is None, error.getrepr()


def test_every_op_a_block_counts_is_counted_for_its_thread_a_hand_offs_too():
    # a hand-off's replayed ops reach the coverage by update(), which an empty Counter does as a dict, not item by
    # item: a backward whose first op was a replay would not have seen it
    coverage = emulator._Coverage()
    before = emulator._EMULATED_HERE.count
    coverage.update({("aten::mm", "tf32-rna"): 2})
    coverage[("aten::mm", "tf32-rna")] += 1
    assert emulator._EMULATED_HERE.count - before == 2 and dict(coverage) == {("aten::mm", "tf32-rna"): 3}
    seen = []
    worker = threading.Thread(target=lambda: seen.append(emulator._EMULATED_HERE.count))
    worker.start()
    worker.join()
    assert seen == [0]  # another thread's count is its own


def _in(emu, fn):
    with tf32lab.precision("high"), emu:
        return fn()


@pytest.mark.parametrize("nested", [False, True], ids=["another block", "a block inside the forward's"])
def test_a_broken_rnn_backward_in_another_block_stays_tf32labs(monkeypatch, nested):
    # the whole-sequence layer's backward counts its GEMMs into the forward's block: counted by block, a wrong
    # gradient of its own was put down to the caller where the backward ran in another block
    from tf32lab.pytest_plugin import _inside_tf32lab

    real = recurrent._lstm_backward

    def transposed(ctx, *grads):  # a bug of the rule's: the recurrent weight's gradient transposed
        found = list(real(ctx, *grads))
        found[3] = found[3].t().contiguous()
        return tuple(found)

    monkeypatch.setattr(recurrent, "_lstm_backward", transposed)
    lstm, x = torch.nn.LSTM(4, 8), torch.ones(3, 2, 4)
    with pytest.raises(RuntimeError, match="invalid gradient") as error:
        with tf32lab.precision("high"), tf32lab.emulate("a100"):
            out = lstm(x)[0]
            if nested:
                with tf32lab.emulate("a100"):
                    out.sum().backward()
        if not nested:
            with tf32lab.precision("high"), tf32lab.emulate("a100"):
                out.sum().backward()
    assert _inside_tf32lab(error) is not None


def test_an_in_place_op_whose_rule_breaks_leaves_its_operand_as_it_was(breaks):
    breaks(aten.addmm_.default, _raising(ValueError("a rule's own bug")))
    c = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="a rule's own bug"), tf32lab.precision("high"), tf32lab.emulate("a100"):
        c.addmm_(torch.ones(4, 4), torch.ones(4, 4))
    assert torch.equal(c, torch.zeros(4, 4))


def test_a_broken_rnn_emulation_is_checked_natively_outside_the_emulation(monkeypatch):
    # the native run went through the dispatch mode: counted as unhandled, and refused under strict, hiding the bug
    def broken(*args):
        raise KeyError("an RNN emulation's own bug")

    monkeypatch.setattr(emulator, "_rnn", broken)
    lstm, x = torch.nn.LSTM(5, 3), torch.ones(4, 1, 5)
    with pytest.raises(KeyError, match="own bug"), tf32lab.precision("high"), tf32lab.emulate("a100", strict=True):
        lstm(x)
    with pytest.raises(KeyError, match="own bug"), tf32lab.precision("high"), tf32lab.emulate("a100") as emu:
        lstm(x)
    assert not emu.unhandled, emu.unhandled


@pytest.mark.parametrize("out", [torch.empty(0), torch.empty(3, 3), torch.empty(2, 2, dtype=torch.float64),
                                 torch.empty(4, 4)], ids=["empty", "other shape", "float64", "same"])
def test_out_of_another_shape_or_dtype_is_resized_or_refused_as_natively(out):
    # an empty out= raised a size mismatch in the emulator's copy (said to be tf32lab's), and a float64 one was cast
    # where PyTorch refuses it
    import warnings

    a = randn(4, 4, seed=6)
    native_out, emulated_out = out.clone(), out.clone()
    with warnings.catch_warnings(record=True) as native_warnings:
        warnings.simplefilter("always")
        try:
            torch.mm(a, a, out=native_out)
            native = None
        except RuntimeError as exc:
            native = str(exc)
    with warnings.catch_warnings(record=True) as emulated_warnings, tf32lab.precision("high"), \
            tf32lab.emulate("a100"):
        warnings.simplefilter("always")
        if native is not None:
            with pytest.raises(RuntimeError) as error:
                torch.mm(a, a, out=emulated_out)
            assert str(error.value) == native
            return
        torch.mm(a, a, out=emulated_out)
    assert emulated_out.shape == native_out.shape == (4, 4)
    torch.testing.assert_close(emulated_out, native_out, rtol=1e-2, atol=1e-2)  # TF32 against IEEE
    assert [str(w.message) for w in emulated_warnings if "resized" in str(w.message)] == \
        [str(w.message) for w in native_warnings if "resized" in str(w.message)]
