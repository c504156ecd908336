"""The op table: every matmul-like aten op of this torch is classified, and the emulator treats each as listed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tf32lab
from emulation_reference import bilinear, bound, check
from test_emulate import emulated, randn
from tf32lab import Tf32LabError, optable, rules

aten = torch.ops.aten
ALL_ATEN = sorted({name.split(".")[0] for name in torch._C._dispatch_get_all_op_names() if name.startswith("aten::")})


# -- the table against this torch --------------------------------------------------------------------------------
def test_every_matmul_like_op_of_this_torch_is_classified():
    missing = [name for name in ALL_ATEN if optable.suspect(name) and optable.lookup(name) is None]
    assert missing == [], f"classify these in tf32lab/optable.py: {missing}"


def test_the_net_is_wide_enough_to_catch_new_products():
    for name in ("aten::_fused_mm_v3", "aten::_scaled_dot_product_blockwise_attention", "aten::cudnn_linear",
                 "aten::linalg_solve_banded", "aten::_tensorcore_gemm"):
        assert optable.suspect(name), name


def test_rules_and_the_table_agree():
    ruled = {op.__name__ for op in rules.RULES if str(op).startswith("aten.")}
    listed = {name for name, op in optable.OPS.items() if op.how == "rule"}
    assert ruled == listed


def test_listed_composites_decompose_in_this_torch():
    for name, op in optable.OPS.items():
        packet = getattr(aten, name, None)
        if packet is None or op.how not in ("decomposes", "no_tf32"):
            continue
        overloads = [getattr(packet, o) for o in packet.overloads()]
        assert any(torch._C._dispatch_has_kernel_for_dispatch_key(o.name(), "CompositeImplicitAutograd")
                   for o in overloads), name


def test_coverage_counts_only_what_a_target_can_change():
    x = randn(8, 16, seed=1)
    _, emu = emulated(lambda: (torch.linalg.vector_norm(x), torch.linalg.cholesky(x.T @ x + 16 * torch.eye(16))))
    assert dict(emu.coverage) == {("aten::mm", "tf32-rna"): 1} and not emu.unhandled


# -- ops the name rule missed or misread ---------------------------------------------------------------------------
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_bilinear_is_emulated_as_two_gemms(grad):
    torch.manual_seed(2)
    layer = torch.nn.Bilinear(24, 20, 12)
    x1, x2 = randn(10, 24, seed=3).requires_grad_(grad), randn(10, 20, seed=4)
    with torch.set_grad_enabled(grad):
        out, emu = emulated(layer, x1, x2, strict=True)
    assert emu.coverage[("aten::_trilinear", "tf32-rna")] >= 1 and not emu.unhandled
    w, b = layer.weight.detach(), layer.bias.detach()
    # The kernel's order: (x1 · W) over the first input's features, rounded again, then · x2 over the second's.
    first = bilinear(lambda a, ww: torch.einsum("ni,oij->noj", a, ww), x1.detach(), w, "tf32")
    ref = bilinear(lambda f, y: torch.einsum("noj,nj->no", f, y), first.float(), x2, "tf32") + b.double()
    tol = bound(lambda f, y: torch.einsum("noj,nj->no", f, y), first.float(), x2, 20) + 1e-5
    check(out.detach(), layer(x1, x2).detach(), ref, tol)
    if grad:
        out.sum().backward()
        assert x1.grad is not None


def test_conv_tbc_follows_the_matmul_flag():
    x, w, bias = randn(12, 3, 5, seed=5), randn(3, 5, 7, seed=6), randn(7, seed=7)
    out, emu = emulated(aten.conv_tbc, x, w, bias, 1, strict=True)
    assert dict(emu.coverage) == {("aten::conv_tbc", "tf32-rna"): 1}

    def f(a, b):
        return torch.nn.functional.conv1d(a.permute(1, 2, 0), b.permute(2, 1, 0), padding=1).permute(2, 0, 1)

    check(out, aten.conv_tbc(x, w, bias, 1), bilinear(f, x, w, "tf32") + bias.double(), bound(f, x, w, 15) + 1e-5)
    _, highest = emulated(aten.conv_tbc, x, w, bias, 1, level="highest")
    assert dict(highest.coverage) == {("aten::conv_tbc", "ieee"): 1}  # not cuDNN's flag, which is TF32 at highest


def test_pinv_and_linalg_backward_formulas_run_ieee_on_a_gpu_target():
    # PyTorch turns TF32 off inside linalg_pinv and the backward of cholesky / pinv / svd (NoTF32Guard).
    a = randn(6, 6, seed=8)
    out, emu = emulated(torch.linalg.pinv, a)
    assert torch.equal(out, torch.linalg.pinv(a))
    assert dict(emu.coverage) == {("aten::linalg_pinv.atol_rtol_tensor", "ieee"): 1}
    spd = (a @ a.T + 6 * torch.eye(6)).requires_grad_()
    with tf32lab.precision("high"), tf32lab.emulate("a100") as emu:
        torch.linalg.cholesky(spd).sum().backward()
    grad = spd.grad.clone()
    spd.grad = None
    torch.linalg.cholesky(spd).sum().backward()
    assert torch.allclose(grad, spd.grad, rtol=1e-5, atol=1e-6)
    assert "tf32-rna" not in {m for _, m in emu.coverage}
    # oneDNN ignores NoTF32Guard, and the kernel's own GEMMs cannot be reached from here: unhandled, and said so
    _, amx = emulated(torch.linalg.pinv, a, target="cpu-amx", level="medium")
    assert dict(amx.unhandled) == {"aten::linalg_pinv.atol_rtol_tensor": 1}


def test_solvers_that_call_cublas_are_counted_and_matrix_exp_is_unhandled():
    a = torch.eye(5) + 0.1 * randn(5, 5, seed=9).triu()
    b = randn(5, 3, seed=10)
    out, emu = emulated(lambda: torch.linalg.solve_triangular(a, b, upper=True))
    assert torch.equal(out, torch.linalg.solve_triangular(a, b, upper=True))
    assert dict(emu.coverage) == {("aten::linalg_solve_triangular", "ieee"): 1}
    out, emu = emulated(torch.linalg.matrix_exp, a)
    assert dict(emu.unhandled) == {"aten::linalg_matrix_exp": 1}
    with pytest.raises(Tf32LabError, match="linalg_matrix_exp"):
        emulated(torch.linalg.matrix_exp, a, strict=True)


def test_a_float32_product_with_integer_weights_is_not_counted():
    x = randn(4, 32, seed=11)
    w = torch.randint(-8, 8, (16, 32), dtype=torch.int8)
    scales = torch.rand(16)
    try:
        aten._weight_int8pack_mm(x, w, scales)
    except RuntimeError:
        pytest.skip("this torch has no CPU kernel for _weight_int8pack_mm")
    _, emu = emulated(aten._weight_int8pack_mm, x, w, scales)
    assert not emu.coverage and not emu.unhandled


def test_conv_double_backward_is_emulated():
    x = randn(1, 2, 6, 6, seed=12).requires_grad_()
    w = randn(3, 2, 3, 3, seed=13).requires_grad_()
    with tf32lab.precision("highest"), tf32lab.emulate("a100", strict=True) as emu:
        out = F.conv2d(x, w)
        (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        gx.pow(2).sum().backward()
    assert not emu.unhandled
    assert {m for _, m in emu.coverage} == {"tf32-rna"}  # cuDNN's flag: TF32 even at highest
