"""A forward that differentiates: ``torch.enable_grad()`` and ``torch.autograd.grad`` inside it (an energy model's
forces, a continuous normalizing flow's exact trace, a physics-informed residual). The float64 reference handed
autograd.grad widened copies of its inputs, not in the graph, and refused the model as bad input; with that mended,
every row ran under inference mode, where nothing is recorded, and raised at every level ("even `highest` fails")."""

from __future__ import annotations

import copy

import torch

import tf32lab


class _Forces(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))

    def forward(self, x):
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            energy = self.net(x).sum()
            (grad,) = torch.autograd.grad(energy, x)
        return -grad


def _model() -> tuple[_Forces, torch.Tensor]:
    torch.manual_seed(0)
    return _Forces(), torch.randn(32, 3)


def test_a_forward_that_differentiates_is_checked_against_its_float64_forces():
    model, x = _model()
    exact = copy.deepcopy(model).double()(x.double())
    with tf32lab.precision("high"), tf32lab.emulate("a100"):
        tf32 = model(x)
    by_hand = float((tf32.double() - exact).norm() / exact.norm())
    report = tf32lab.check(tf32lab.Workload(model, x), introduced="all",
                           levels=("highest", "high"), target="a100", speed=False)
    highest, high = report.level("highest"), report.level("high")
    assert highest.error is None and high.error is None, (highest.error, high.error)
    assert highest.outputs[0].normwise < 1e-6 and report.passed
    assert abs(high.outputs[0].normwise - by_hand) < 1e-3 * by_hand, (high.outputs[0].normwise, by_hand)
    introduced = {layer.name: layer.introduced for layer in high.layers}
    assert set(introduced) == {"net.0", "net.2"} and all(1e-5 < e < 1e-2 for e in introduced.values()), introduced


def test_the_model_is_left_with_no_graph_and_its_weights_as_they_were():
    model, x = _model()
    before = [p.detach().clone() for p in model.parameters()]
    tf32lab.check(tf32lab.Workload(model, x), levels=("high",), target="a100", speed=False)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, b) and p.dtype == torch.float32 for p, b in zip(model.parameters(), before))
