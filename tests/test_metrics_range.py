"""An output's metrics at the ends of float64's range and for complex outputs: each number as the module's
whole-tensor definition gives it, whether the compare runs in one process (``output_error``) or over the ranks
that each hold some rows (``sharded._split_error``)."""

from __future__ import annotations

import math

import pytest
import torch

from tf32lab.measure import sharded
from tf32lab.numbers import metrics


def _defined(y: torch.Tensor, r: torch.Tensor) -> dict:
    """The definitions, over the whole tensor in float64, with every norm taken over its largest magnitude (the
    values are exact; only their squares would leave float64's range)."""
    y, r = y.double(), r.double()
    d = y - r

    def norm(t):
        top = t.abs().max()
        return float(top * torch.linalg.vector_norm(t / top))

    def rows(t):
        t = t.reshape(-1, t.shape[-1])
        return t / t.abs().amax(-1, keepdim=True)

    ref_norm = norm(r)
    rms = ref_norm / math.sqrt(r.numel())
    return {"normwise": norm(d) / ref_norm,
            "cosine": float(torch.nn.functional.cosine_similarity(rows(y), rows(r), dim=-1).min()),
            "histogram": metrics.histogram(d.abs(), r, rms),
            "max_rel": float((d.abs() / r.abs()).max())}


def _assert_defined(found: metrics.OutputError, y: torch.Tensor, r: torch.Tensor) -> None:
    want = _defined(y, r)
    assert found.histogram == want["histogram"]
    for key in ("normwise", "cosine", "max_rel"):
        assert getattr(found, key) == pytest.approx(want[key], rel=1e-12), key


def _pair(magnitude: float) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    r = (torch.rand(40, 64, dtype=torch.float64) + 0.5) * magnitude
    return r * (1 + 1e-4 * torch.randn_like(r)), r


@pytest.mark.parametrize("magnitude", [1e200, 1e-170, 1e-300])
def test_huge_and_tiny_outputs_get_the_defined_metrics(magnitude):
    y, r = _pair(magnitude)
    found = metrics.output_error("out", y, r)
    # their squares overflow (1e200) or underflow (1e-170, 1e-300): the norms were inf or 0, normwise NaN or 0,
    # every error in the first bin, the cosine 0 or above 1
    _assert_defined(found, y, r)
    assert found.normwise == pytest.approx(metrics.normwise(y / magnitude, r / magnitude), rel=1e-12)
    assert metrics.normwise_over([y], [r]) == pytest.approx(found.normwise, rel=1e-12)


def test_rows_of_other_magnitudes_in_one_chunk_get_their_own_cosine():
    y, r = _pair(1.0)
    r[3] *= 1e-300
    y[3] = r[3] * -1.0  # the opposite direction: a cosine of -1 that an underflowing row norm hides
    r[5] *= 1e200
    y[5] *= 1e200
    found = metrics.output_error("out", y, r)
    assert found.cosine == pytest.approx(-1.0, rel=1e-12)


def test_a_complex_output_is_compared_with_its_imaginary_part():
    torch.manual_seed(0)
    r = torch.randn(30, 8, dtype=torch.complex128)
    y = r + 1e-3j  # an error in the imaginary part only: .double() drops it
    found = metrics.output_error("out", y, r)
    assert found.normwise == pytest.approx(float(torch.linalg.vector_norm(y - r) / torch.linalg.vector_norm(r)),
                                           rel=1e-12)
    assert found.shape == (30, 8)
    assert found.normwise == pytest.approx(metrics.compare("out", y, r).normwise, rel=1e-12)


@pytest.fixture
def one_rank():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield sharded.Ranks()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("magnitude", [1e200, 1e-300])
def test_a_split_output_gets_the_same_numbers_at_the_ends_of_the_range(one_rank, magnitude):
    y, r = _pair(magnitude)
    found = sharded._split_error("out", y, r, 1e-2, one_rank)
    _assert_defined(found, y, r)  # the ranks' squared norms overflowed or underflowed in their sum



@pytest.mark.parametrize("factor", [0.999, -1.0])
def test_an_output_whose_norm_leaves_float64s_range_keeps_its_error(factor):
    # each value finite, but ‖r‖ (and for -r, each difference) is past float64's largest: the error was
    # 0.0 over an infinite norm (a 1e-3 error passed as none), and NaN for -r
    r = torch.full((4, 4), 1.7e308, dtype=torch.float64)
    y = r * factor
    found = metrics.output_error("out", y, r)
    want = abs(factor - 1.0)
    assert found.normwise == pytest.approx(want, rel=1e-9)
    assert found.max_rel == pytest.approx(want, rel=1e-9) and found.mean_rel == pytest.approx(want, rel=1e-9)
    assert found.bias == pytest.approx(factor - 1.0, rel=1e-9)
    assert found.cosine == pytest.approx(1.0 if factor > 0 else -1.0)
    assert found.max_abs == pytest.approx(1.7e308 * want, rel=1e-9) if factor > 0 else found.max_abs == math.inf
    assert found.passed == (factor > 0)


@pytest.mark.parametrize("factor", [0.999, -1.0])
def test_a_split_output_whose_norm_leaves_float64s_range_keeps_its_error(one_rank, factor):
    # as one process's (above): the ranks' norms were inf, and the error 0.0 (a pass) or NaN
    r = torch.full((4, 4), 1.7e308, dtype=torch.float64)
    y = r * factor
    found = sharded._split_error("out", y, r, 1e-2, one_rank)
    alone = metrics.output_error("out", y, r)
    for field in ("normwise", "max_abs", "max_rel", "mean_rel", "cosine", "bias"):
        assert getattr(found, field) == pytest.approx(getattr(alone, field), rel=1e-12), field
    assert found.histogram == alone.histogram and found.normwise == pytest.approx(abs(factor - 1.0), rel=1e-9)


def test_an_output_of_one_value_per_row_has_its_column_s_cosine():
    # a regression or value head's (N, 1): a row of one value has no direction, its cosine only its sign, so one
    # value near zero that TF32 moved across it read min cos -1.000000 beside a normwise error of 2e-4 (a KAN)
    r = torch.linspace(-1, 1, 256, dtype=torch.float64)[:, None]
    r[100] = 1e-6
    y = r.clone()
    y[100] = -1e-6
    column = metrics.compare("v", y, r, 1e-2)
    assert column.normwise < 1e-5
    assert column.cosine == pytest.approx(metrics.compare("v", y[:, 0], r[:, 0], 1e-2).cosine) and \
        column.cosine > 0.999999
    rows = torch.randn(256, 2, dtype=torch.float64)  # two values a row: still the rows' own cosines
    assert metrics.compare("v", -rows, rows, 1e-2).cosine == pytest.approx(-1.0)
