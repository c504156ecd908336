"""emulate(target, accumulation="hardware"): GEMMs summed as the target's matrix unit sums them."""

from __future__ import annotations

import math

import pytest
import torch

import tf32lab
from tf32lab.emulation.emulator import emulate
from tf32lab.errors import Tf32LabError
from tf32lab.numbers import accumulation, formats

# numba compiles the accumulation kernels (tens of seconds each, once per process) in a fresh clone: these
# files run on one xdist worker, so that the other worker does not compile the same ones at the same time
pytestmark = pytest.mark.xdist_group("numba_accumulation")


def _operands(seed: int, m: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)


@pytest.mark.parametrize(("target", "level", "model", "rounding"), [
    ("a100", "high", accumulation.AMPERE, "rna"),
    ("h100", "high", accumulation.HOPPER, "rne"),
    ("b200", "high", accumulation.BLACKWELL, "rne"),
    ("mi300", "high", accumulation.CDNA3_XF32, "rz"),
    ("a100", "highest", accumulation.FMA, None),
])
def test_gemms_are_the_model_bit_for_bit(target, level, model, rounding):
    a, b = _operands(0, 24, 200, 40)
    bias, batch = torch.randn(40), torch.randn(3, 24, 200)
    lin = torch.nn.Linear(200, 40)
    with torch.no_grad():
        lin.bias.copy_(bias)
    with tf32lab.precision(level), emulate(target, accumulation="hardware") as emu:
        mm, addmm, linear, bmm = a @ b, torch.addmm(bias, a, b), lin(batch), torch.bmm(batch, b.expand(3, -1, -1))

    def r(x):
        return formats.round_tf32(x, rounding) if rounding else x

    want = accumulation.gemm(r(a), r(b), model)
    assert torch.equal(mm, want)
    assert torch.equal(addmm, want + bias)
    want_batch = accumulation.gemm(r(batch), r(b), model)
    assert torch.equal(bmm, want_batch)
    w = r(lin.weight.detach())
    assert torch.equal(linear.detach(), accumulation.gemm(r(batch).reshape(-1, 200), w.t(), model).reshape(3, 24, 40)
                       + bias)
    label = f"{'ieee' if rounding is None else 'tf32-' + rounding}, {model}"
    assert all(math_ == label for _, math_ in emu.coverage), dict(emu.coverage)


def test_ideal_stays_the_default_and_differs():
    a, b = _operands(1, 16, 4096, 8)
    a, b = a.abs(), b.abs()  # same-sign sums: the truncation's bias shows
    with tf32lab.precision("high"), emulate("h100") as ideal:
        y_ideal = a @ b
    with tf32lab.precision("high"), emulate("h100", accumulation="hardware"):
        y_hw = a @ b
    assert ideal.accumulation == "ideal" and dict(ideal.coverage) == {("aten::mm", "tf32-rne"): 1}
    ref = formats.round_tf32(a, "rne").double() @ formats.round_tf32(b, "rne").double()
    hw, ideal_err = y_hw.double() - ref, y_ideal.double() - ref
    assert hw.mean() < 0 and hw.abs().mean() > ideal_err.abs().mean()


def test_ops_without_a_known_order_say_so():
    x, w = torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 3)
    v, m = torch.randn(16), torch.randn(5, 16)
    with tf32lab.precision("high"), emulate("a100", accumulation="hardware") as emu:
        torch.nn.functional.conv2d(x, w)
        m @ v
    assert dict(emu.coverage) == {("aten::convolution", "tf32-rna, ideal sum"): 1, ("aten::mv", "ieee, ideal sum"): 1}
    assert "accumulation=hardware" in repr(emu)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
def test_attentions_math_backend_is_summed_as_cublas_sums_and_fused_kernels_say_they_are_not(grad):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 8, 32, generator=g) for _ in range(3))
    mask = torch.randn(8, 8, generator=g)
    before = torch.backends.cuda.mem_efficient_sdp_enabled()
    torch.backends.cuda.enable_mem_efficient_sdp(False)  # PyTorch's math backend: bmm calls through cuBLAS
    try:
        with torch.set_grad_enabled(grad), tf32lab.precision("high"), emulate("a100", accumulation="hardware") as emu:
            out = torch.nn.functional.scaled_dot_product_attention(q.requires_grad_(grad), k, v, mask)
    finally:
        torch.backends.cuda.enable_mem_efficient_sdp(before)
    root = 32 ** -0.25  # the math backend scales both operands by sqrt(scale)
    r = formats.round_tf32
    s = accumulation.gemm(r(q.detach() * root), r(k.transpose(-2, -1) * root), accumulation.AMPERE) + mask
    want = accumulation.gemm(r(torch.softmax(s, -1)), r(v), accumulation.AMPERE)
    assert torch.equal(out.detach(), want)  # (the ideal sum is off by up to 2.4e-7 here)
    assert all(label == "tf32-rna, nvidia k4 f24" for _, label in emu.coverage), dict(emu.coverage)
    with tf32lab.precision("high"), emulate("a100", accumulation="hardware") as emu:  # the 3xTF32 fused kernel
        torch.nn.functional.scaled_dot_product_attention(q.detach(), k, v, mask)
    assert {label for _, label in emu.coverage} == {"tf32x3, ideal sum"}


def test_bad_accumulation_is_refused():
    with pytest.raises(Tf32LabError, match=r"unknown accumulation 'exact'; accepted: 'ideal', 'hardware'"):
        emulate("a100", accumulation="exact")


@pytest.mark.parametrize("target", ["a100", "h100", "b200", "mi300"])
def test_tensorflow_fill_times_ones_is_exactly_1024(target):
    # TensorFlow's TF32 test: fill([1024, 1024], 1.0001) @ ones is exactly 1024.0 (1.0001 loses its low bits)
    x, ones = torch.full((64, 1024), 1.0001), torch.ones(1024, 16)
    with tf32lab.precision("high"), emulate(target, accumulation="hardware"):
        assert torch.equal(x @ ones, torch.full((64, 16), 1024.0))


def test_mi300x_table_of_tf32_analysis():
    # jeffdaily/tf32_analysis REPORT.md, MI300X: M=64, K=32, N=48, uniform [0, 1): max abs error 8.2e-3, mean
    # signed error -5.3e-3 (round-down model within 3.8e-6 of the hardware); seeds unknown, so over eight seeds
    worst, bias = [], []
    for seed in range(8):
        g = torch.Generator().manual_seed(seed)
        a, b = torch.rand(64, 32, generator=g), torch.rand(32, 48, generator=g)
        with tf32lab.precision("high"), emulate("mi300", accumulation="hardware"):
            err = (a @ b).double() - a.double() @ b.double()
        worst.append(err.abs().max().item())
        bias.append(err.mean().item())
    assert 7.2e-3 < sum(worst) / 8 < 9.2e-3
    assert -5.6e-3 < sum(bias) / 8 < -5.0e-3
    with tf32lab.precision("high"), emulate("a100", accumulation="hardware"):  # an A100 rounds to nearest
        nearest = (a @ b).double() - a.double() @ b.double()
    assert abs(nearest.mean().item()) < 5e-4


def _tail_max(err: torch.Tensor, outputs: int, power: float) -> float:
    """The expected largest |err| among ``outputs`` outputs, from the survival of |err| over its top 1 %
    (log S fitted linear in |err|**power: 2 for a Gaussian tail, 1 for an exponential one)."""
    x = err.abs().flatten().sort().values
    qs = torch.tensor([0.99, 0.995, 0.999, 0.9995, 0.9999], dtype=torch.float64)
    t = torch.stack([x[int(q * x.numel()) - 1] for q in qs]).double() ** power
    design = torch.stack([t, torch.ones_like(t)], 1)
    slope, icpt = torch.linalg.lstsq(design, torch.log1p(-qs)[:, None]).solution.flatten().tolist()
    return ((math.log(1 / outputs) - icpt) / slope) ** (1 / power)


@pytest.mark.slow
def test_a100_notes_in_distribution():
    # PyTorch CUDA notes, A100, 10240 x 10240 randn: float32 max error 0.0031 (3.9e-5 of mean |AB|), TF32 0.1747
    # (0.0022); the CPU's own float32 gives 0.0003. Here 512 x 512 outputs of the same K = 10240, the maximum over
    # 10240^2 outputs extrapolated from the tail: exponential for the FMA chain's error (a mixture of Gaussians
    # whose spread follows the partial sums), Gaussian for TF32's (dominated by the operands' rounding).
    a, b = _operands(0, 512, 10240, 512)
    ref = a.double() @ b.double()
    with emulate("a100", accumulation="hardware"):
        fp32 = (a @ b).double() - ref
    with tf32lab.precision("high"), emulate("a100", accumulation="hardware"):
        tf32 = (a @ b).double() - ref
    cpu = (a @ b).double() - ref
    scale = ref.abs().mean().item()
    fp32_max, cpu_max = _tail_max(fp32, 10240 ** 2, 1), _tail_max(cpu, 10240 ** 2, 1)
    assert 0.0031 / 1.3 < fp32_max < 0.0031 * 1.3 and 3.9e-5 / 1.3 < fp32_max / scale < 3.9e-5 * 1.3
    assert cpu_max < fp32_max / 4  # the CPU's blocked sums: ten times too accurate
    assert 0.1747 / 1.1 < _tail_max(tf32, 10240 ** 2, 2) < 0.1747 * 1.1


def test_the_setting_is_the_default_and_check_reports_the_bias(monkeypatch):
    from tf32lab.workloads.workload import Workload

    monkeypatch.setenv("TF32LAB_ACCUMULATION", "hardware")
    assert emulate("a100").accumulation == "hardware" and emulate("a100", accumulation="ideal").accumulation == "ideal"
    monkeypatch.delenv("TF32LAB_ACCUMULATION")
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(1024, 16)
    with torch.no_grad():
        model.weight.uniform_(0, 1, generator=g)
    workload = Workload(model, (torch.rand(8, 1024, generator=g),), name="positive")
    report = tf32lab.check(workload, levels=("highest", "high"), target="mi300", accumulation="hardware",
                           speed=False)
    high = report.level("high").outputs[0]
    assert high.bias < -1e-4 and abs(report.level("highest").outputs[0].bias) < 1e-6
    with pytest.raises(Tf32LabError, match="unknown accumulation 'fast'"):
        tf32lab.check(workload, accumulation="fast")
