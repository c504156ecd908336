"""A model for `tf32lab tune`: three heavy layers, and one small layer that TF32 breaks.

    tf32lab tune examples/tune/model.py:make --out policy.json --html tune.html

The tests (tests/test_tune.py) and benchmarks/tune.py tune this same model.
"""

import torch

import tf32lab


class Cancel(torch.nn.Module):
    """TF32 breaks it: its input rides on a large offset that the product then takes away again."""

    def __init__(self, n):
        super().__init__()
        self.lin = torch.nn.Linear(n, n, bias=False)

    def forward(self, x):
        return self.lin(x + 1000.0) - self.lin(torch.full_like(x, 1000.0))


class Net(torch.nn.Module):
    """Three heavy layers, and one small sensitive one."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(512, 512) for _ in range(3))
        self.down, self.sens, self.up = torch.nn.Linear(512, 64), Cancel(64), torch.nn.Linear(64, 512)

    def forward(self, x):
        h = torch.relu(self.b(torch.relu(self.a(x))))
        return self.c(self.up(self.sens(self.down(h))))


def make():
    torch.manual_seed(0)
    return tf32lab.Workload(Net(), torch.randn(1024, 512), name="one-sensitive")  # heavy enough for TF32 to pay
