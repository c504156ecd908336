"""An output that is a dataclass (not a ``ModelOutput``): compared field by field, as a dict's items are."""

from __future__ import annotations

import dataclasses

import torch

import tf32lab
from tf32lab.numbers import trees


@dataclasses.dataclass
class _Prediction:
    scores: torch.Tensor
    labels: torch.Tensor
    extra: object = None


class _ReturnsDataclass(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x):
        y = self.linear(x)
        return _Prediction(y, y.argmax(-1))


def test_a_dataclass_output_is_compared_field_by_field():
    # it was one leaf compared with ==, which raised "Boolean value of Tensor ... is ambiguous" out of check
    torch.manual_seed(0)
    report = tf32lab.check(tf32lab.Workload(_ReturnsDataclass(), torch.randn(8, 16)), levels=("highest",))
    outputs = {o.name: o for o in report.levels[0].outputs}
    assert set(outputs) == {"scores", "labels"}
    assert outputs["scores"].normwise < 1e-5 and outputs["labels"].exact and outputs["labels"].passed


def test_trees_name_and_map_a_dataclass_by_its_fields():
    found = _Prediction(torch.ones(1), torch.zeros(1), extra=3)
    assert [name for name, _ in trees.named_tensors(found)] == ["scores", "labels"]
    assert [name for name, _ in trees.named_leaves(found)] == ["scores", "labels", "extra"]
    widened = trees.map_tensors(lambda t: t.double(), found)
    assert isinstance(widened, _Prediction) and widened.scores.dtype == torch.float64 and widened.extra == 3
    assert found.scores.dtype == torch.float32  # a new one, the model's own left alone


@dataclasses.dataclass(frozen=True)
class _Scaled:
    y: torch.Tensor
    n: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "y", self.y * 3)  # a field transformed on construction


class _Scales(torch.nn.Module):
    """Two layers that each return a dataclass whose __post_init__ transforms its field."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x):
        return _Scaled(x @ self.w)


class _TwoScales(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _Scales(), _Scales()

    def forward(self, x):
        return self.b(self.a(x).y).y


def test_a_dataclass_is_mapped_without_its_post_init_run_again():
    found = _Scaled(torch.ones(2))
    object.__setattr__(found, "n", 5)  # a field set after construction (init=False)
    widened = trees.map_tensors(lambda t: t.double(), found)
    assert widened.y.tolist() == [3.0, 3.0] and widened.y.dtype == torch.float64 and widened.n == 5
    # a layer's kept reference output went through __post_init__ again: its error was 2.0 (3x) at every level
    torch.manual_seed(0)
    report = tf32lab.check(tf32lab.Workload(_TwoScales(), torch.randn(8, 16)), introduced="all",
                           levels=("highest",), speed=False)
    assert all(layer.introduced < 1e-5 for layer in report.levels[0].layers), report.levels[0].layers
