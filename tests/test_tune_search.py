"""`tune`'s search where the measured ranking of layers misleads it: more than four layers pinned before the one
that matters, the layer that matters ranked last, and a model whose own product is the sensitive one while its
blocks sit in a ModuleList. Each answer is a real run's; these check that the search reaches the cheap one."""

from __future__ import annotations

import torch

import tf32lab
from tf32lab.control import flags


class _Offset(torch.nn.Module):
    """TF32 breaks it: the input rides on an offset that the second product takes away. Its layer's own error
    looks ordinary (each product alone is rounded as any other); the cancellation is in this module's forward."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(n, n, bias=False)

    def forward(self, x):
        return self.lin(x + 1000.0) - self.lin(torch.full_like(x, 1000.0))


class _Sides(torch.nn.Module):
    """Six cheap side branches that TF32 breaks but whose output barely counts (ranked first: much error for
    little lost time), then the costly layer that matters, then costlier layers that do not."""

    def __init__(self, n: int = 512, side: int = 32, wide: int = 2048) -> None:
        super().__init__()
        self.down = torch.nn.Linear(n, side)
        self.sides = torch.nn.ModuleList(_Offset(side) for _ in range(6))
        self.key = _Offset(n)
        self.up, self.back = torch.nn.Linear(n, wide), torch.nn.Linear(wide, n)
        self.out = torch.nn.Linear(n, 8)

    def forward(self, x):
        noise = sum(s(self.down(x)) for s in self.sides)
        return self.out(self.back(self.up(self.key(x))) + 1e-7 * noise.sum(-1, keepdim=True))


def test_more_than_four_pinned_layers_are_still_unpinned_where_they_are_not_needed():
    # The shortest passing prefix pinned the six side branches, `down`, `out` and `key.lin`; un-pinning began with
    # all of them as one group, whose trial (nothing pinned) is the failing fast level, and it stopped there: the
    # answer kept nine layers at `highest` where one is needed.
    torch.manual_seed(0)
    workload = tf32lab.Workload(_Sides(), torch.randn(1024, 512), name="sides")
    before = flags.snapshot()
    tuning = tf32lab.tune(workload, target="a100")
    assert flags.snapshot() == before
    assert tuning.passed and tuning.pinned == ("key.lin",), tuning.pinned
    assert any(c.policy == tuning.policy and c.passed for c in tuning.candidates)  # verified by its own run
    assert len([c for c in tuning.candidates if len(c.pinned) > 4 and c.passed]) >= 1  # it came from there


class _Blocks(torch.nn.Module):
    """Blocks in a ModuleList (never called itself) and the sensitive product in the model's own forward, before
    a last layer: the model's own error is measured with `final` answering float64's output, so it ranks last."""

    def __init__(self, n: int = 512, depth: int = 4) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(n, n) for _ in range(depth))
        self.head = torch.nn.Parameter(torch.randn(64, n) / n ** 0.5)
        self.final = torch.nn.Linear(64, 64)

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.final((x + 1000.0) @ self.head.T - torch.full_like(x, 1000.0) @ self.head.T)


def test_the_model_s_own_product_is_pinned_alone_when_it_ranks_last():
    # Before: only every layer pinned passed from the front of the ranking, which tune took for `highest`
    # everywhere (1.00x); and pinning the model itself pinned the blocks under its ModuleList with it.
    torch.manual_seed(0)
    workload = tf32lab.Workload(_Blocks(), torch.randn(1024, 512), name="blocks")
    tuning = tf32lab.tune(workload, target="a100")
    assert tuning.passed and tuning.pinned == ("(model)",), (tuning.pinned, tuning.reason)
    rules = {rule.pattern: rule.level for rule in tuning.policy.rules}
    assert rules[""] == "highest" and all(rules[f"blocks.{i}"] == "high" for i in range(4))
    assert tuning.speedup > 1.2 and tuning.speedup >= 0.9 * tuning.report.level("high").speedup
