"""Models that a sharded check's ranks run differently (``tests/test_distributed.py``), each a factory for
``tf32lab check FILE:FACTORY``: outside a job, the one-process check of the whole batch."""

from __future__ import annotations

import torch
import torch.distributed as dist

import tf32lab


def _rank():
    return dist.get_rank() if dist.is_initialized() else None


def _part(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's half of the batch, rank 1's other half; the whole outside a job."""
    rank, half = _rank(), x.shape[0] // 2
    return x if rank is None else x[:half] if rank == 0 else x[half:]


def nan_part():
    """Rank 1's rows are NaN, in the float64 reference too; rank 0's are finite: the whole has values to judge."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    x[2:] = float("nan")
    return tf32lab.Workload(torch.nn.Linear(8, 4), (_part(x),), name="nan-part")


class _Widened(torch.nn.Linear):
    def forward(self, x):
        y = super().forward(x)
        return y.double() if _rank() == 1 else y


def widened():
    """Rank 1 returns its part in float64, rank 0 in float32."""
    torch.manual_seed(0)
    return tf32lab.Workload(_Widened(8, 4), (_part(torch.randn(4, 8)),), name="widened")


class _Branch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x):
        out = {"y": self.lin(x)}
        if _rank() == 1:  # a branch on the data: a layer called on one rank only
            out["aux"] = self.lin(x).sum(-1)
        return out


def branch():
    torch.manual_seed(0)
    return tf32lab.Workload(_Branch(), (_part(torch.randn(4, 8)),), name="branch")


class _Narrow(torch.nn.Linear):
    def forward(self, x):
        y = super().forward(x)
        return y[:, :3] if _rank() == 1 else y


def narrow():
    """Rank 1's part of the output has fewer columns."""
    torch.manual_seed(0)
    return tf32lab.Workload(_Narrow(8, 4), (_part(torch.randn(4, 8)),), name="narrow")


def zero():
    """A head initialised to zero: the float64 reference is zero on every rank."""
    model = torch.nn.Linear(8, 4)
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)
    return tf32lab.Workload(model, (_part(torch.randn(4, 8)),), name="zero")


class _Loss(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x).square().mean()


def loss():
    """A 0-d output, each rank's own: compared as the vector of the ranks' values."""
    torch.manual_seed(0)
    return tf32lab.Workload(_Loss(8, 4), (_part(torch.randn(4, 8)),), name="loss")
