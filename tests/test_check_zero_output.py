"""An output that is zero at every element of the float64 reference, formed by products that are zero too (a
classifier head initialised to zero, as timm's ``mixer_s16_224``, ``sequencer2d_s`` and ``hiera_tiny_224`` are
before training): every level computes exactly zero there, and check said "TF32 is safe ... worst normwise
0.0e+00" having measured nothing (its cosine shown as 0, orthogonal). Such a workload cannot be judged: said
before any level runs, as bad input, as for a reference that is NaN everywhere."""

from __future__ import annotations

import pytest
import torch

import tf32lab
from tf32lab.errors import Tf32LabError


def _zero_head() -> torch.nn.Sequential:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))
    torch.nn.init.zeros_(model[2].weight)
    torch.nn.init.zeros_(model[2].bias)
    return model


def test_a_check_of_an_output_zero_by_zero_weights_is_refused_before_any_level():
    workload = tf32lab.Workload(_zero_head(), torch.randn(8, 32), name="zero-head")
    with pytest.raises(Tf32LabError, match=r"zero-head.*zero at every element of output 'output'.*zero weights"):
        tf32lab.check(workload, levels=("highest", "high"), target="a100")
    with pytest.raises(Tf32LabError, match="zero at every element"):
        tf32lab.tune(workload, target="a100")


class _Both(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = _zero_head(), torch.nn.Linear(32, 4)

    def forward(self, x):
        return {"logits": self.body(x), "value": self.head(x)}


class _Residual(torch.nn.Module):
    """A round trip that cancels exactly in float64: zero, but formed by products that are not (judged over them)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(32, 32, bias=False)

    def forward(self, x):
        return self.lin(x) - self.lin(x)


@pytest.mark.parametrize("model", [_Both, _Residual])
def test_a_zero_output_beside_a_measured_one_or_one_formed_by_nonzero_products_is_still_checked(model):
    torch.manual_seed(0)
    report = tf32lab.check(tf32lab.Workload(model(), torch.randn(8, 32)), levels=("highest", "high"),
                           target="a100", speed=False)
    assert all(row.error is None and row.outputs for row in report.levels)
