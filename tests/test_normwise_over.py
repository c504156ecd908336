"""metrics.normwise_over: the normwise error of several tensors taken as one vector, as metrics.normwise of their
float64 concatenation gives it, without the concatenation, and at magnitudes whose squares overflow or underflow."""

from __future__ import annotations

import math

import pytest
import torch

from tf32lab.numbers import metrics

F64 = torch.float64


def joined(found: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """The formula normwise_over replaces: normwise of the float64 concatenations."""
    flat = [torch.cat([t.detach().double().reshape(-1) for t in ts]) for ts in (found, reference)]
    return metrics.normwise(*flat) if flat[1].numel() else 0.0


def same(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b) or math.isinf(a) or math.isinf(b) or a == 0.0 or b == 0.0:
        return (math.isnan(a) and math.isnan(b)) or a == b
    return abs(a - b) <= 1e-12 * abs(b)


CASES = {
    "nan": ([torch.tensor([math.nan, 1.0])], [torch.ones(2, dtype=F64)]),
    "inf": ([torch.tensor([math.inf, 1.0])], [torch.ones(2, dtype=F64)]),
    "-inf": ([torch.tensor([-math.inf, 1.0])], [torch.ones(2, dtype=F64)]),
    "inf and nan in two tensors": ([torch.tensor([math.inf]), torch.tensor([math.nan])],
                                   [torch.ones(1, dtype=F64), torch.ones(1, dtype=F64)]),
    "nan and inf in two tensors": ([torch.tensor([math.nan]), torch.tensor([math.inf])],
                                   [torch.ones(1, dtype=F64), torch.ones(1, dtype=F64)]),
    "infinite reference": ([torch.ones(2)], [torch.tensor([math.inf, 1.0], dtype=F64)]),
    "all zeros": ([torch.zeros(3), torch.zeros(2)], [torch.zeros(3, dtype=F64), torch.zeros(2, dtype=F64)]),
    "zero reference": ([torch.ones(3)], [torch.zeros(3, dtype=F64)]),
    "empty": ([torch.zeros(0)], [torch.zeros(0, dtype=F64)]),
    "bfloat16": ([torch.tensor([1.5, 2.0], dtype=torch.bfloat16), torch.tensor([3.0])],
                 [torch.tensor([1.4, 2.0], dtype=F64), torch.tensor([2.9], dtype=F64)]),
    "float16": ([torch.tensor([1.5, 2.0], dtype=torch.float16)], [torch.tensor([1.4, 2.0], dtype=F64)]),
    "float64": ([torch.tensor([1.5, 2.0], dtype=F64)], [torch.tensor([1.4, 2.0], dtype=F64)]),
    "integer": ([torch.tensor([1, 2])], [torch.tensor([1, 3])]),
    "bool": ([torch.tensor([True, False])], [torch.tensor([True, True])]),
    "0-dim": ([torch.tensor(1.5), torch.ones(2)], [torch.tensor(1.0, dtype=F64), torch.ones(2, dtype=F64)]),
    "float32 near its top": ([torch.tensor([3e38])], [torch.tensor([2e38], dtype=F64)]),
    "random": ([torch.randn(5, 3, generator=torch.Generator().manual_seed(0)), torch.randn(7)],
               [torch.randn(5, 3, dtype=F64, generator=torch.Generator().manual_seed(1)), torch.randn(7, dtype=F64)]),
}


@pytest.mark.parametrize("case", CASES)
def test_as_the_joined_vector_gives_it(case):
    found, reference = CASES[case]
    assert same(metrics.normwise_over(found, reference), joined(found, reference))


@pytest.mark.parametrize("magnitude", [1e200, 1e-200, 1e-170])
def test_no_overflow_nor_underflow_between_the_tensors(magnitude):
    # each tensor's own norm is finite and nonzero; their squares are not (1e400, 1e-400)
    found = [torch.tensor([1.1 * magnitude], dtype=F64), torch.tensor([magnitude], dtype=F64)]
    reference = [torch.tensor([magnitude], dtype=F64), torch.tensor([magnitude], dtype=F64)]
    assert metrics.normwise_over(found, reference) == pytest.approx(0.1 / math.sqrt(2), rel=1e-12)


def test_complex_tensors_are_compared_with_their_imaginary_parts():
    reference = [torch.tensor([1 + 1j, 2 - 1j], dtype=torch.complex128)]
    found = [torch.tensor([1 + 1.5j, 2 - 1j], dtype=torch.complex64)]
    assert metrics.normwise_over(found, reference) == pytest.approx(0.5 / math.sqrt(7), rel=1e-12)
    assert metrics.normwise_over(reference, reference) == 0.0


def test_lists_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match="2 tensors found against 1"):
        metrics.normwise_over([torch.ones(2), torch.ones(3)], [torch.ones(2, dtype=F64)])
    with pytest.raises(ValueError, match="1 tensors found against 2"):
        metrics.normwise_over([torch.ones(2)], [torch.ones(2, dtype=F64), torch.ones(1, dtype=F64)])


def test_the_training_trees_error_is_nan_where_the_lists_differ_in_length():
    from tf32lab.measure.training import _tree_error
    assert math.isnan(_tree_error([torch.ones(2)], [torch.ones(2, dtype=F64), torch.ones(1, dtype=F64)]))
    assert _tree_error([torch.ones(2)], [torch.full((2,), 2.0, dtype=F64)]) == 0.5
