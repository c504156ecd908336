"""A model whose embedding gives sparse gradients (``nn.Embedding(sparse=True)``, as recommendation models train
with SGD) is checked as its dense twin is: the training check compared its gradients with ``torch.equal`` and
``reshape``, which a sparse tensor does not take, and ended in a NotImplementedError from PyTorch."""

from __future__ import annotations

import pytest
import torch

import tf32lab


class _Recommender(torch.nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.items = torch.nn.Embedding(500, 32, sparse=sparse)
        self.score = torch.nn.Linear(32, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.score(self.items(ids).mean(dim=1))


def _checked(sparse: bool) -> tf32lab.TrainingReport:
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 500, (16, 8), generator=g), torch.randn(16, 1, generator=g)) for _ in range(3)]
    workload = tf32lab.TrainingWorkload(_Recommender(sparse), batches, inputs=lambda b: b[0],
                                        loss=lambda out, b: (out - b[1]).pow(2).mean(),
                                        optimizer=lambda params: torch.optim.SGD(params, lr=0.5))
    return tf32lab.check_training(workload, levels=("highest", "high"), target="a100")


def test_sparse_gradients_are_checked_as_their_dense_twins_are():
    sparse, dense = _checked(True), _checked(False)
    assert bool(sparse) and bool(dense)
    for got, want in zip(sparse.levels, dense.levels):
        assert got.losses == pytest.approx(want.losses, rel=1e-6)
        found = {e.name: e.normwise for e in got.gradients}
        assert found.keys() == {"items.weight", "score.weight", "score.bias"}
        expected = {e.name: e.normwise for e in want.gradients}
        assert found == pytest.approx(expected, rel=1e-3, abs=1e-9)
    # the embedding's own backward measured too, as for the dense one
    high = sparse.level("high")
    assert "items" in {layer.name for layer in high.layers}
