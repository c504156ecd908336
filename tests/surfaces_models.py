"""Small models whose module names are long and staged (``encoder.layer.5.…``), for the tests of what a user reads
at 80 columns and in a browser (tests/test_surfaces.py). Specs: ``tests/surfaces_models.py:deep`` and so on."""

from __future__ import annotations

import torch

import tf32lab


class Block(torch.nn.Module):
    def __init__(self, n: int = 16) -> None:
        super().__init__()
        self.attention = torch.nn.ModuleDict({"output": torch.nn.ModuleDict({"dense": torch.nn.Linear(n, n)})})

    def forward(self, x):
        return torch.tanh(self.attention["output"]["dense"](x))


class Deep(torch.nn.Module):
    """Three staged blocks on an offset that TF32's rounding shows through, and a long-named head; two outputs
    with long names."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Module()
        self.encoder.layer = torch.nn.ModuleList([Block() for _ in range(3)])
        self.head_projection_with_a_long_name = torch.nn.Linear(16, 1)

    def forward(self, x):
        for block in self.encoder.layer:
            x = block(x + 3.0) - block(torch.full_like(x, 3.0))
        return {"regression_logits_of_the_head": self.head_projection_with_a_long_name(x),
                "hidden_state_after_the_encoder": x}


def deep() -> tf32lab.Workload:
    torch.manual_seed(0)
    return tf32lab.Workload(Deep(), (torch.randn(32, 16),), name="deep")


def deep_training(steps: int = 3) -> tf32lab.TrainingWorkload:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)) for _ in range(steps)]
    return tf32lab.TrainingWorkload(
        Deep(), data, inputs=lambda b: b[0], name="deep",
        loss=lambda out, b: (out["regression_logits_of_the_head"] - b[1]).pow(2).mean())


class Cancel(torch.nn.Module):
    """TF32 breaks it: its input rides on a large offset that the product takes away again."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(n, n, bias=False)

    def forward(self, x):
        return self.lin(x + 1000.0) - self.lin(torch.full_like(x, 1000.0))


class TwoSensitive(torch.nn.Module):
    """Heavy layers TF32 speeds up, and two sensitive ones with long names: tune pins both, then tries to un-pin
    each, a candidate whose label is longer than 44 characters."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(512, 512), torch.nn.Linear(512, 512)
        self.down, self.up = torch.nn.Linear(512, 64), torch.nn.Linear(64, 512)
        self.encoder = torch.nn.Module()
        self.encoder.layer = torch.nn.ModuleList(
            [torch.nn.ModuleDict({"attention_output_offset": Cancel(64)}) for _ in range(2)])

    def forward(self, x):
        h = self.down(torch.relu(self.b(torch.relu(self.a(x)))))
        for block in self.encoder.layer:
            h = block["attention_output_offset"](h)
        return self.up(h)


def two_sensitive() -> tf32lab.Workload:
    torch.manual_seed(0)  # 1024 rows: heavy enough for TF32 to pay on an A100, so that tune pins
    return tf32lab.Workload(TwoSensitive(), torch.randn(1024, 512), name="two-sensitive")
