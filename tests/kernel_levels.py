"""A dispatch mode for tests: the level PyTorch holds when each mm reaches the kernel."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tf32lab.control import flags


class KernelLevels(TorchDispatchMode):
    """Pushed before tf32lab's modes, so it sits below them and sees each mm as the kernel will run it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            self.seen.append(flags.read_level())
        return func(*args, **(kwargs or {}))
