"""The op table: every matmul-like aten op of this torch is classified, and the emulator treats each as listed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tf32lab
from emulation_reference import bilinear, bound, check
from test_emulate import emulated, randn
from tf32lab import Tf32LabError
from tf32lab.emulation import emulator, rules
from tf32lab.know import optable

aten = torch.ops.aten
ALL_ATEN = sorted({name.split(".")[0] for name in torch._C._dispatch_get_all_op_names() if name.startswith("aten::")})


# -- the table against this torch --------------------------------------------------------------------------------
def test_every_matmul_like_op_of_this_torch_is_classified():
    missing = [name for name in ALL_ATEN if optable.suspect(name) and optable.lookup(name) is None]
    assert missing == [], f"classify these in tf32lab/know/optable.py: {missing}"


def test_the_net_is_wide_enough_to_catch_new_products():
    for name in ("aten::_fused_mm_v3", "aten::_scaled_dot_product_blockwise_attention", "aten::cudnn_linear",
                 "aten::linalg_solve_banded", "aten::_tensorcore_gemm"):
        assert optable.suspect(name), name


def _overloads(packet):
    return [getattr(packet, name) for name in packet.overloads()]


def test_every_family_op_is_emulated_or_says_why_not():
    # What the dispatch mode does with each overload of this torch: a family op runs natively only where the table
    # says why no rule can compute it, and an op with a rule has no such reason (a stale one)
    silent, stale, counted = [], [], []
    for name, op in optable.OPS.items():
        for func in _overloads(getattr(aten, name)) if hasattr(aten, name) else ():
            found = emulator.treatment(func)
            if op.family is None or op.how == "solver":
                counted += [func.name()] if found is not None else []
            elif found.how == "unhandled" and found.why is None:
                silent.append(func.name())
            elif found.how == "rule" and found.why is not None:
                stale.append(func.name())
    assert silent == [], f"give these a rule in tf32lab/emulation/rules.py, or a why in the op table: {silent}"
    assert stale == [] and counted == []


def test_every_rule_is_reached():
    # a rule for an op the table does not count, or says is composite, would never run
    for packet, fn in rules.RULES.items():
        for func in _overloads(packet):
            found = emulator.treatment(func)
            assert found is not None and found.how == "rule" and found.rule is fn, func.name()


def test_one_name_rule_for_ops_the_table_does_not_list():
    assert optable.family("mylib::fancy_matmul") == optable.family_by_name("mylib::fancy_matmul") == "matmul"
    assert optable.family("mylib::cudnn_conv_fused") == "conv" and optable.family("mylib::eigvals") == "linalg"
    # a "linalg" token is no product, nor are the net's loose tokens a family
    assert optable.family("mylib::linalg_vector_norm") is None and optable.family("prims::erf_inv") is None
    assert optable.suspect("aten::_fused_gemm") and optable.family_by_name("aten::_fused_gemm") is None


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


def _base_grid(n: int, spatial: list[int], align_corners: bool) -> torch.Tensor:
    """F.affine_grid's base grid (x along the last dim, then y, z; a 1 last), as ATen builds it."""
    lines = []
    for steps in reversed(spatial):
        line = torch.linspace(-1, 1, steps) if steps > 1 else torch.zeros(1)
        lines.append(line if align_corners or steps <= 1 else line * (steps - 1) / steps)
    grids = torch.meshgrid(*reversed(lines), indexing="ij")
    return torch.stack([*reversed(grids), torch.ones(spatial)], -1).expand(n, *spatial, len(spatial) + 1)


@pytest.mark.filterwarnings("ignore:Since version 1.3.0")  # align_corners with a one-step dim: PyTorch warns
@pytest.mark.parametrize("spatial", [[7, 9], [3, 5, 6], [1, 4]], ids=["2d", "3d", "one_step"])
@pytest.mark.parametrize("align_corners", [False, True])
def test_affine_grid_is_one_bmm_in_the_matmul_math(spatial, align_corners):
    # ATen's affine_grid_generator (no CompositeImplicitAutograd kernel, so the mode never sees inside it) is
    # base_grid.view(N, HW, 3).bmm(theta.mT): one cuBLAS GEMM on a GPU. It ran natively, counted nowhere.
    dims = len(spatial)
    theta = randn(2, dims, dims + 1, seed=11)
    size = [2, 3, *spatial]
    out, emu = emulated(F.affine_grid, theta, size, align_corners, strict=True)
    assert dict(emu.coverage) == {("aten::affine_grid_generator", "tf32-rna"): 1} and not emu.unhandled
    base = _base_grid(2, spatial, align_corners).reshape(2, -1, dims + 1)

    def f(b, t):
        return (b @ t.mT).view(2, *spatial, dims)

    check(out, F.affine_grid(theta, size, align_corners), bilinear(f, base, theta, "tf32"),
          bound(f, base, theta, dims + 1) + 1e-6)
    highest, _ = emulated(F.affine_grid, theta, size, align_corners, level="highest")
    assert torch.equal(highest, F.affine_grid(theta, size, align_corners))  # the native op's bits at IEEE
    grad = theta.clone().requires_grad_()
    with tf32lab.precision("high"), tf32lab.emulate("a100", strict=True) as emu:
        F.affine_grid(grad, size, align_corners).square().sum().backward()
    assert {op for op, _ in emu.coverage} == {"aten::affine_grid_generator", "aten::bmm"}


@pytest.mark.parametrize("spatial", [[7, 9], [3, 5, 6]], ids=["2d", "3d"])
def test_affine_grid_takes_no_tf32_on_hopper(spatial):
    # An H200 gave F.affine_grid the same bits at 'high' as at 'highest' (its bmm has K = 3 or 4 and N = 2 or 3),
    # 2-D and 3-D, align_corners either way; Ampere keeps the matmul flag's TF32 (unmeasured there)
    dims = len(spatial)
    theta, size = randn(2, dims, dims + 1, seed=12), [2, 3, *spatial]
    out, emu = emulated(F.affine_grid, theta, size, False, target="h200", strict=True)
    assert torch.equal(out, F.affine_grid(theta, size, False))
    assert dict(emu.coverage) == {("aten::affine_grid_generator", "ieee"): 1}
    _, emu = emulated(F.affine_grid, theta, size, False, target="a100")
    assert dict(emu.coverage) == {("aten::affine_grid_generator", "tf32-rna"): 1}


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
    # one trsm block: no GEMM update, so the native solver's own result, counted as computed (IEEE), not as the
    # math the updates would have had (it read tf32-rna beside a result bit-identical to IEEE float32's)
    small = {"aten::linalg_solve_triangular": lambda: torch.linalg.solve_triangular(a, b, upper=True),
             "aten::_linalg_solve_ex": lambda: torch.linalg.solve(a, b),
             "aten::linalg_inv_ex": lambda: torch.linalg.inv(a),
             "aten::linalg_lu_solve": lambda: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b),
             "aten::linalg_lstsq": lambda: torch.linalg.lstsq(a, b).solution}
    for op, fn in small.items():
        out, emu = emulated(fn)
        if op == "aten::linalg_lstsq":  # LAPACK's gelsy is not bit-reproducible across runs on every CPU
            torch.testing.assert_close(out, fn())
        else:
            assert torch.equal(out, fn()), op
        assert {key: n for key, n in emu.coverage.items() if key[0] == op} == {(op, "ieee"): 1}, dict(emu.coverage)
    # a singular matrix past one block: PyTorch's own result and info, IEEE too
    singular = torch.eye(300)
    singular[:, 7] = 0
    (_, info), emu = emulated(lambda: torch.linalg.inv_ex(singular))
    assert int(info) != 0 and dict(emu.coverage) == {("aten::linalg_inv_ex", "ieee"): 1}
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


# -- solvers and backward formulas as measured on an H100 (docs/gpu-results.md) ---------------------------------
def _systems(n=320, seed=14):
    g = torch.Generator().manual_seed(seed)
    upper = torch.triu(torch.randn(n, n, generator=g)) / n ** 0.5 + 2 * torch.eye(n)
    general = torch.randn(n, n, generator=g) / n ** 0.5 + 3 * torch.eye(n)
    return upper, general, torch.randn(n, 24, generator=g), torch.randn(2 * n, n, generator=g)


_U, _G, _B, _TALL = _systems()
SOLVERS = {
    "solve_triangular": (lambda: torch.linalg.solve_triangular(_U, _B, upper=True), "aten::linalg_solve_triangular",
                         lambda: torch.linalg.solve_triangular(_U.double(), _B.double(), upper=True)),
    "lu_solve": (lambda: torch.linalg.lu_solve(*torch.linalg.lu_factor(_G), _B), "aten::linalg_lu_solve",
                 lambda: torch.linalg.solve(_G.double(), _B.double())),
    "solve": (lambda: torch.linalg.solve(_G, _B), "aten::_linalg_solve_ex",
              lambda: torch.linalg.solve(_G.double(), _B.double())),
    "inv": (lambda: torch.linalg.inv(_G), "aten::linalg_inv_ex", lambda: torch.linalg.inv(_G.double())),
    "lstsq": (lambda: torch.linalg.lstsq(_TALL, _B[:, :8].repeat(2, 1)).solution, "aten::linalg_lstsq",
              lambda: torch.linalg.lstsq(_TALL.double(), _B[:, :8].repeat(2, 1).double()).solution),
}


def _normwise(x, ref):
    return float((x.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("name", list(SOLVERS))
def test_solvers_that_run_cublas_trsm_follow_the_matmul_level_on_a_gpu_target(name):
    # On an H100 these ran TF32 at 'high' (errors 5e-05 to 1e-04 against 1e-07 to 5e-07 at 'highest').
    fn, op, fn64 = SOLVERS[name]
    ref = fn64()
    high, emu = emulated(fn, target="h100", strict=True)
    assert dict(emu.coverage) == {(op, "tf32-rne"): 1}
    assert 1e-5 < _normwise(high, ref) < 1e-3
    # native float32 (LAPACK's gelsy is not bit-reproducible across runs on every CPU: compared at float32 level)
    highest, emu = emulated(fn, target="h100", level="highest", strict=True)
    assert _normwise(highest, ref) < 1e-5 and dict(emu.coverage) == {(op, "ieee"): 1}
    cpu, emu = emulated(fn, target="cpu-amx", level="medium", strict=True)  # LAPACK: IEEE on a CPU
    assert _normwise(cpu, ref) < 1e-5 and dict(emu.coverage) == {(op, "ieee"): 1}


def test_blocked_triangular_solve_rounds_only_the_updates():
    # cuBLAS trsm solves the block it starts with (the last 256 rows of an upper-triangular system) without a GEMM
    # update: those rows are the float32 solution; the rest carry the TF32 updates.
    out, _ = emulated(lambda: torch.linalg.solve_triangular(_U, _B, upper=True), target="h100")
    tail = torch.linalg.solve_triangular(_U[-256:, -256:], _B[-256:], upper=True)
    assert torch.equal(out[-256:], tail)
    assert not torch.equal(out[:-256], torch.linalg.solve_triangular(_U, _B, upper=True)[:-256])
    right, _ = emulated(lambda: torch.linalg.solve_triangular(_U, _B.T, upper=True, left=False), target="h100")
    assert _normwise(right, torch.linalg.solve_triangular(_U.double(), _B.T.double(), upper=True, left=False)) < 1e-3


def _grad(f, x, level):
    # as measured: the forward at 'highest', only the backward at the level
    x = x.clone().requires_grad_()
    with tf32lab.emulate("h100"):
        loss = f(x)
        with tf32lab.precision(level):
            (grad,) = torch.autograd.grad(loss, x)
    return grad


@pytest.mark.parametrize("name", ["eigh", "qr", "lu", "solve", "det", "inv"])
def test_backward_formulas_keep_tf32_off_as_measured(name):
    # eigh, qr, lu, solve, det: the same bits at 'high' and 'highest' on an H100; inv's backward runs TF32.
    g = torch.Generator().manual_seed(15)
    square = torch.randn(48, 48, generator=g) / 48 ** 0.5 + 2 * torch.eye(48)
    weights = torch.randn(48, 48, generator=g)
    losses = {
        "eigh": (lambda x: (torch.linalg.eigh((x + x.T) / 2)[1] ** 2 * weights).sum()),
        "qr": (lambda x: (torch.linalg.qr(x)[0] * weights).sum()),
        "lu": (lambda x: (torch.linalg.lu(x)[2] * weights).sum()),
        "solve": (lambda x: (torch.linalg.solve(x, weights[:, :4]) * weights[:, 4:8]).sum()),
        "det": (lambda x: torch.linalg.det(x[:16, :16])),
        "inv": (lambda x: (torch.linalg.inv(x) * weights).sum()),
    }
    same = torch.equal(_grad(losses[name], square, "high"), _grad(losses[name], square, "highest"))
    assert same == (name != "inv")
