"""The training check where a row's and float64's tensors differ in size by many orders, where a one-value
gradient overflows in float64, and where SGD's momentum of a sparse gradient is sparse."""

import math

import pytest
import torch

import tf32lab
from tf32lab.measure.norms import scratch
from tf32lab.measure.training import _against


@pytest.mark.parametrize("ratio", [1e-16, 1e-12, 1e12, 1e14, 1e16])
def test_the_cosine_holds_where_the_norms_differ_by_many_orders(ratio):
    g = torch.Generator().manual_seed(0)
    a, o = torch.randn(1000, generator=g), torch.randn(1000, generator=g, dtype=torch.float64)
    r = o * ratio
    expected = float(a.double() @ r) / float(a.double().norm() * r.norm())
    _, cosine = _against(a, r, 0.0, scratch(torch.device("cpu")))
    assert cosine == pytest.approx(expected, rel=1e-9)


def test_the_cosine_of_nearly_parallel_tensors_keeps_its_digits():
    g = torch.Generator().manual_seed(1)
    r = torch.randn(4096, generator=g, dtype=torch.float64)
    x = r.float()  # parallel but for float32's rounding
    exact = 1 - float(x.double() @ r) / float(x.double().norm() * r.norm())
    _, cosine = _against(x, r, 0.0, scratch(torch.device("cpu")))
    assert 0 <= 1 - cosine < 1e-13 and exact < 1e-13


class _Huge(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.s = torch.nn.Parameter(torch.tensor(400.0))
        self.lin = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.lin(x).mean() + torch.exp(self.s)


def test_a_one_value_gradient_past_float64s_square_fails_the_rows_not_the_check():
    data = [(torch.ones(4, 3), torch.zeros(4, 1))] * 2
    w = tf32lab.TrainingWorkload(_Huge(), data, inputs=lambda b: b[0], loss=lambda o, b: o)
    report = tf32lab.check_training(w, levels=("highest", "high"), target="a100", speed=False)
    assert not report.passed
    assert all(level.failure for level in report.levels)


class _Recommender(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.items = torch.nn.Embedding(500, 32, sparse=True)
        self.score = torch.nn.Linear(32, 1)

    def forward(self, ids):
        return self.score(self.items(ids).mean(dim=1))


def test_sgd_momentum_of_a_sparse_gradient_is_compared():
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 500, (16, 8), generator=g), torch.randn(16, 1, generator=g)) for _ in range(3)]
    w = tf32lab.TrainingWorkload(_Recommender(), batches, inputs=lambda b: b[0],
                                 loss=lambda o, b: (o - b[1]).pow(2).mean(),
                                 optimizer=lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9))
    report = tf32lab.check_training(w, levels=("highest", "high"), target="a100", speed=False)
    assert all(level.failure is None for level in report.levels)
    assert all(math.isfinite(level.state_error) for level in report.levels if hasattr(level, "state_error"))
