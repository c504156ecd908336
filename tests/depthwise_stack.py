"""A model whose NCHW depthwise convolutions hold most of its predicted time on a GPU target (PyTorch's own
depthwise kernels there, which no TF32 flag reaches), and a small head: shared by the report tests."""

from __future__ import annotations

from torch import nn


class DepthwiseStack(nn.Module):
    """Three depthwise convs (NCHW) that hold most of the predicted time, and a small head."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.Sequential(*(nn.Conv2d(16, 16, 5, padding=2, groups=16) for _ in range(3)))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.convs(x).mean((2, 3)))
