"""Counting a run's work (the speed prediction) reads each operand's bytes: a sparse CSR operand (a graph's
adjacency, as torch_geometric's ``GCNConv`` takes it) has no storage of its own to key them by, and counting it
made the counted level's row fail with "Cannot access data pointer of Tensor that doesn't have storage"."""

from __future__ import annotations

import pytest
import torch

import tf32lab


class _Graph(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w, self.out = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)

    def forward(self, x, adjacency):
        return self.out(torch.relu(torch.sparse.mm(adjacency, self.w(x))))


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr, torch.sparse_csc])
def test_a_sparse_operand_is_counted_and_its_row_measured(layout):
    torch.manual_seed(0)
    edges = torch.randint(0, 50, (2, 200))
    adjacency = torch.sparse_coo_tensor(edges, torch.ones(200), (50, 50)).coalesce()
    adjacency = adjacency if layout == torch.sparse_coo else adjacency.to_sparse(layout=layout)
    report = tf32lab.check(tf32lab.Workload(_Graph(), (torch.randn(50, 16), adjacency), name="graph"),
                           levels=("highest", "high"), target="a100")
    for row in report.levels:
        assert row.error is None, (row.level, row.error)
    assert report.levels[0].outputs[0].normwise < 1e-5 and report.speed is not None
