"""A small ResNet (a conv stem, two residual blocks, global pooling and a linear head) on 32x32 inputs: a model
whose predicted time is mostly convolutions, for the tests of what a check says of them. ``resnet`` is a workload
factory the CLI takes too (``tests/small_resnet.py:resnet``)."""

from __future__ import annotations

import torch
from torch import nn

import tf32lab


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class ResNet(nn.Module):
    def __init__(self, c: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.blocks = nn.Sequential(Block(c), Block(c))
        self.head = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def resnet() -> tf32lab.Workload:
    torch.manual_seed(0)
    return tf32lab.Workload(ResNet().eval(), torch.randn(2, 3, 32, 32), name="resnet")
