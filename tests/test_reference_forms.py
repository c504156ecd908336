"""The float64 reference computes GELU as x·erfc(−x/√2)/2: PyTorch's float64 GELU kernel is slow on the CPU, and
its 1 + erf(x/√2) cancels to 0 below x = -8, where the reference must still hold x·Φ(x)."""

from __future__ import annotations

import math

import torch

from tf32lab.measure.reference import Float64Run


def _gelu_exact(x: float) -> float:
    return 0.5 * x * math.erfc(-x / math.sqrt(2.0))


def test_the_reference_gelu_holds_x_phi_x_where_pytorchs_float64_kernel_cancels():
    x = torch.tensor([-30.0, -12.5, -10.0, -8.5], dtype=torch.float32)
    with torch.no_grad(), Float64Run():
        y = torch.nn.functional.gelu(x)
    assert y.dtype == torch.float64
    for got, v in zip(y.tolist(), x.tolist()):
        assert got != 0.0 and math.isclose(got, _gelu_exact(v), rel_tol=1e-12), (v, got)


def test_the_reference_gelu_is_pytorchs_to_float64_rounding_and_alike_at_the_edges():
    torch.manual_seed(0)
    x = torch.randn(4096, dtype=torch.float64) * 4
    with torch.no_grad(), Float64Run():
        y = torch.nn.functional.gelu(x)
        tanh = torch.nn.functional.gelu(x, approximate="tanh")
    assert torch.allclose(y, torch.nn.functional.gelu(x), rtol=1e-14, atol=1e-15)
    assert torch.equal(tanh, torch.nn.functional.gelu(x, approximate="tanh"))  # PyTorch's own kernel
    edges = torch.tensor([-math.inf, math.inf, math.nan, -0.0, 0.0, -40.0, 40.0], dtype=torch.float64)
    with torch.no_grad(), Float64Run():
        got = torch.nn.functional.gelu(edges)
    want = torch.nn.functional.gelu(edges)
    assert torch.equal(got.isnan(), want.isnan())
    kept = ~want.isnan()
    assert torch.equal(got[kept], want[kept]) and torch.equal(got[kept].signbit(), want[kept].signbit())


def test_a_module_gelu_under_autograd_in_the_reference_differentiates_as_pytorchs():
    x = torch.linspace(-5, 5, 101, dtype=torch.float64, requires_grad=True)
    with Float64Run():
        (g,) = torch.autograd.grad(torch.nn.GELU()(x).sum(), x)
    x2 = x.detach().clone().requires_grad_(True)
    (want,) = torch.autograd.grad(torch.nn.functional.gelu(x2).sum(), x2)
    assert torch.allclose(g, want, rtol=1e-14, atol=1e-15)
