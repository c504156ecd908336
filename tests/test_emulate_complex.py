"""complex64 GEMMs under emulate(): a Fourier neural operator's spectral convolution (neuraloperator's
``SpectralConv``: ``torch.einsum`` of a complex64 spectrum and complex64 weights, a complex ``bmm``) ran natively
in IEEE float32 at every level and was counted neither as emulated nor as unhandled: its check said TF32 changed
nothing there. cuBLAS's CGEMM follows the matmul flag as SGEMM does (PyTorch's own tests run complex64 matmuls
under TF32 with TF32's tolerance, ``tf32_on_and_off`` in ``torch/testing/_internal/common_cuda.py``)."""

from __future__ import annotations

import pytest
import torch

import tf32lab


def _complex(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.complex(torch.randn(*shape, generator=g), torch.randn(*shape, generator=g))


def _relative(found: torch.Tensor, exact: torch.Tensor) -> float:
    return float((found.to(torch.complex128) - exact).abs().max() / exact.abs().max())


@pytest.mark.parametrize("product", [
    pytest.param(lambda a, b: a @ b, id="mm"),
    pytest.param(lambda a, b: torch.einsum("bix,iox->box", a.unsqueeze(-1).expand(-1, -1, 3),
                                           b.unsqueeze(-1).expand(-1, -1, 3)), id="einsum-bmm"),
])
def test_a_complex64_product_is_emulated_at_the_level_in_force(product):
    a, b = _complex(8, 64, seed=0), _complex(64, 16, seed=1)
    exact = product(a.to(torch.complex128), b.to(torch.complex128))
    errors, coverage = {}, {}
    for level in ("highest", "high"):
        with tf32lab.precision(level), tf32lab.emulate("a100") as emu:
            errors[level] = _relative(product(a, b), exact)
        coverage[level] = {math for (_, math) in emu.coverage}
        assert not emu.unhandled
    assert coverage == {"highest": {"ieee"}, "high": {"tf32-rna"}}
    # TF32's unit roundoff is 2^-11 (4.9e-4): operands rounded to it put the error far above float32's 1e-7
    assert errors["highest"] < 1e-5 < 1e-4 < errors["high"] < 1e-2


def test_a_complex64_product_equals_the_one_of_its_tf32_rounded_parts():
    a, b = _complex(4, 32, seed=2), _complex(32, 5, seed=3)

    def rounded(t: torch.Tensor) -> torch.Tensor:
        return torch.complex(tf32lab.formats.round_tf32(t.real), tf32lab.formats.round_tf32(t.imag))

    expected = rounded(a).to(torch.complex128) @ rounded(b).to(torch.complex128)
    with tf32lab.precision("high"), tf32lab.emulate("a100"):
        found = a @ b
    assert _relative(found, expected) < 1e-5


def test_a_conjugated_operand_keeps_its_sign_and_the_backward_is_emulated():
    # autograd's backward of a complex mm multiplies by the conjugate (a lazy conj view): its imaginary part is
    # negated only when read as such
    a = _complex(6, 32, seed=4).requires_grad_()
    b = _complex(32, 7, seed=5)
    wide = a.detach().to(torch.complex128).requires_grad_()
    exact = torch.autograd.grad((wide @ b.to(torch.complex128)).abs().sum(), wide)[0]
    with tf32lab.precision("high"), tf32lab.emulate("a100") as emu:
        grad = torch.autograd.grad((a @ b).abs().sum(), a)[0]
        conj = a.detach().conj() @ b
    assert 1e-5 < _relative(grad, exact) < 1e-2
    assert _relative(conj, a.detach().to(torch.complex128).conj() @ b.to(torch.complex128)) < 1e-2
    assert emu.coverage[("aten::mm", "tf32-rna")] >= 3 and not emu.unhandled


def test_a_complex64_linear_with_its_bias_is_emulated_and_a_gemv_is_ieee():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 8, dtype=torch.complex64)
    x = _complex(16, 64, seed=10)
    with torch.no_grad():
        exact = torch.nn.functional.linear(x.to(torch.complex128), lin.weight.to(torch.complex128),
                                           lin.bias.to(torch.complex128))
    with torch.no_grad(), tf32lab.precision("high"), tf32lab.emulate("a100") as emu:
        found = lin(x)
        vector = x @ _complex(64, seed=11)  # cuBLAS's CGEMV: no tensor-core path
    assert 1e-4 < _relative(found, exact) < 1e-2
    assert torch.equal(vector, x @ _complex(64, seed=11))
    assert emu.coverage == {("aten::addmm", "tf32-rna"): 1, ("aten::mv", "ieee"): 1} and not emu.unhandled


def test_complex64_on_a_cpu_target_is_ieee_and_a_family_op_without_parts_is_counted_unhandled():
    a, b = _complex(8, 16, seed=6), _complex(16, 4, seed=7)
    with tf32lab.precision("medium"), tf32lab.emulate("cpu-amx") as emu:
        cpu = a @ b  # MKL's CGEMM: no oneDNN flag reaches it
    assert {math for (_, math) in emu.coverage} == {"ieee"}
    assert torch.equal(cpu, a @ b)
    with tf32lab.precision("high"), tf32lab.emulate("a100") as emu:
        torch.addbmm(_complex(8, 4, seed=8), a.expand(2, 8, 16), b.expand(2, 16, 4))
    assert emu.unhandled == {"aten::addbmm": 1}


class _Spectral(torch.nn.Module):
    """A Fourier layer as neuraloperator's SpectralConv computes it: the lowest modes of the spectrum mixed by
    complex weights (einsum), back to space."""

    def __init__(self, channels: int = 8, modes: int = 6) -> None:
        super().__init__()
        self.modes = modes
        self.weight = torch.nn.Parameter(_complex(channels, channels, modes, seed=9) / channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spectrum = torch.fft.rfft(x)
        mixed = torch.zeros_like(spectrum)
        mixed[..., :self.modes] = torch.einsum("bix,iox->box", spectrum[..., :self.modes], self.weight)
        return torch.fft.irfft(mixed, n=x.size(-1))


def test_check_measures_a_spectral_convolution_at_tf32():
    torch.manual_seed(0)
    report = tf32lab.check(tf32lab.Workload(_Spectral(), torch.randn(4, 8, 32), name="fno"),
                           levels=("highest", "high"), target="a100", speed=False)
    highest, high = report.level("highest"), report.level("high")
    assert not high.unhandled and any(op.endswith("tf32-rna") for op in high.coverage)
    assert high.worst.normwise > 10 * highest.worst.normwise


# "Casting complex values to real discards the imaginary part": the gradients compared without it
@pytest.mark.filterwarnings("error:Casting complex values to real")
def test_training_a_model_with_complex64_weights_runs_its_float64_reference_in_complex128():
    # Module.double() casts floating-point tensors only: the float64 reference kept complex64 weights, and its
    # first backward raised "expected dtype ComplexFloat but got c10::complex<double>" (said as the model failing
    # in float64, before any level ran)
    torch.manual_seed(0)
    data = [(torch.randn(4, 8, 32), torch.randn(4, 8, 32)) for _ in range(2)]
    workload = tf32lab.TrainingWorkload(_Spectral(), data, loss=lambda out, batch: (out - batch[1]).pow(2).mean(),
                                        inputs=lambda batch: batch[0])
    report = tf32lab.check_training(workload, levels=("highest", "high"), target="a100", speed=False)
    high = report.level("high")
    assert high.failure is None and report.level("highest").failure is None and not high.unhandled
    assert any(op.endswith("tf32-rna") for op in high.coverage)
    weight = next(g for g in high.gradients if g.name == "weight")
    assert 1e-5 < weight.normwise < 1e-2  # TF32-sized, over real and imaginary parts
