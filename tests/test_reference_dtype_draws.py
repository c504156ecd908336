"""A draw whose dtype the model reads off a float32 tensor (``dtype=self.loc.dtype``, as every
``torch.distributions`` ``rsample`` does through ``_standard_normal``) is drawn by the float64 reference at float32
and cast up, as its float32 rows draw it: the reference's ``.dtype`` reads float64 (for Python-level dtype checks),
and took that for the model's own request of a float64 draw (a VAE's ``Normal(mu, std).rsample()`` and pyro's
guides failed ``highest`` at 0.85 and 2.7e-2 normwise, every level alike, with other noise than float64's)."""

from __future__ import annotations

import pytest
import torch

import tf32lab


class _Sampled(torch.nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.loc = torch.nn.Parameter(torch.randn(16))
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        if self.how == "distribution":
            z = torch.distributions.Normal(self.loc, 1.0).rsample((x.shape[0],))
        elif self.how == "empty":  # torch.distributions.utils._standard_normal, spelled out
            z = torch.empty(x.shape, dtype=self.loc.dtype, device=self.loc.device).normal_()
        else:
            z = torch.rand(x.shape, dtype=x.dtype)
        return self.lin(x + z)


@pytest.mark.parametrize("how", ["distribution", "empty", "rand"])
def test_a_draw_at_a_dtype_read_off_a_float32_tensor_is_the_rows_draw(how):
    torch.manual_seed(0)
    report = tf32lab.check(tf32lab.Workload(_Sampled(how), torch.randn(32, 16)), levels=("highest",), speed=False)
    assert report.level("highest").outputs[0].normwise < 1e-5, report.level("highest").outputs[0]
