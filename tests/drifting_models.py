"""A model whose training TF32 breaks, for the training check and both training-loop callbacks: the input rides on
an offset that the product takes away again, so the gradient of ``lin`` is a difference of two large, TF32-rounded
products. The layers and the forward are given apart, so that a LightningModule and a model that returns its own
loss are the same model."""

from __future__ import annotations

import torch


def offset_layers(module: torch.nn.Module) -> None:
    """``module.lin`` (16 to 16, no bias) and ``module.head`` (16 to 1)."""
    module.lin = torch.nn.Linear(16, 16, bias=False)
    module.head = torch.nn.Linear(16, 1)


def offset_forward(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module.head(module.lin(x + 1000.0) - module.lin(torch.full_like(x, 1000.0)))


class Offset(torch.nn.Module):
    """TF32 breaks its training (the module's docstring)."""

    def __init__(self) -> None:
        super().__init__()
        offset_layers(self)

    forward = offset_forward
