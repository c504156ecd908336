"""A model whose work depends on the values it computes (an adaptive ODE solver's steps: torchdiffeq's dopri5 at
rtol 1e-6 ran 76 linear layers at `highest` and 964 at `high`) is told that its levels did different work: the
speed prediction counts one run's, and said `high` was 1.00x as fast where it did 12x the work."""

from __future__ import annotations

import torch

import tf32lab


class _Adaptive(torch.nn.Module):
    """Takes more steps where its error estimate, a product checked against its float32 value, is larger."""

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__()
        self.estimate, self.step = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
        with torch.no_grad():
            self.register_buffer("exact", self.estimate(x))

    def forward(self, x):
        error = (self.estimate(x) - self.exact).abs().max()
        h = x
        for _ in range(1 if error < 1e-4 else 10):  # TF32's 1e-3 fails the estimate: ten smaller steps
            h = torch.tanh(self.step(h))
        return h


def test_levels_that_did_different_work_are_told_beside_the_speed():
    torch.manual_seed(0)
    x = torch.randn(32, 64)
    report = tf32lab.check(tf32lab.Workload(_Adaptive(x), x, name="adaptive"), levels=("highest", "high"),
                           target="a100")
    highest, high = report.levels
    assert sum(highest.coverage.values()) == 2 and sum(high.coverage.values()) == 11
    (note,) = [n for n in report.notes if "matmul-family ops" in n]
    assert "at `high` 11" in note and "`highest` 2" in note, note


def test_levels_that_did_the_same_work_get_no_such_note():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh())
    report = tf32lab.check(tf32lab.Workload(model, torch.randn(32, 64)), levels=("highest", "high"), target="a100")
    assert not any("matmul-family ops" in n for n in report.notes), report.notes
