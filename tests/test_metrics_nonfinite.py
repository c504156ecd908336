"""An output that holds NaN or Inf where its reference holds the same: the metrics of the finite rest, row by row
as the module's definitions take them (a row's cosine, a row's argmax), not of the rest flattened into one row."""

from __future__ import annotations

import math

import pytest
import torch

from tf32lab.numbers import metrics


def _plain_cosine(y: torch.Tensor, r: torch.Tensor) -> float:
    """The smallest cosine of a row's finite values with its reference's, in float64, row by row."""
    found = []
    for a, b in zip(y, r):
        keep = torch.isfinite(b)
        if keep.any():
            found.append(float(torch.nn.functional.cosine_similarity(a[keep], b[keep], dim=0)))
    return min(found)


def test_a_reversed_row_is_seen_where_another_row_holds_a_nan():
    torch.manual_seed(0)
    r = torch.randn(100, 10, dtype=torch.float64)
    y = r.clone()
    y[7] = -r[7]  # one row reversed: the smallest cosine is -1
    r[0, 0] = y[0, 0] = math.inf
    r[1, :] = y[1, :] = math.nan  # a row with nothing finite has no cosine
    found = metrics.compare("out", y, r)
    assert found.failure is None and "NaN/Inf" in found.note
    assert abs(found.cosine - _plain_cosine(y, r)) < 1e-12 and found.cosine < -0.99  # it said 0.98
    finite = torch.isfinite(r)
    d, rf = (y - r)[finite], r[finite]
    assert abs(found.normwise - float(d.norm() / rf.norm())) < 1e-12
    assert found.histogram == metrics.histogram(d.abs(), rf)
    assert abs(found.bias - float(d.mean() / rf.abs().mean())) < 1e-12


def test_top1_counts_rows_where_a_logit_is_nan():
    torch.manual_seed(0)
    r = -torch.rand(100, 10, dtype=torch.float64) - 1  # all negative: a NaN taken as 0 would be every argmax
    y = r.clone()
    for i in range(10):  # ten rows' argmax moved
        top2 = r[i].topk(2).indices
        y[i, top2[0]], y[i, top2[1]] = r[i, top2[1]], r[i, top2[0]]
    r[50, 3] = y[50, 3] = math.nan
    found = metrics.compare("logits", y, r)
    assert found.top1 == 0.9  # it was 0.0 or 1.0: the argmax of the finite rest as one row


def test_a_complex_number_with_one_part_nan_is_held_whole():
    # nan+0j: its real part was held and its imaginary 0 kept as a pair of zeros, whose cosine is 0: an output
    # equal to its reference said cosine 0.0
    r = torch.tensor([[complex(math.nan, 0.0), 1 + 1j, 2 - 3j]], dtype=torch.complex128)
    found = metrics.compare("z", r.to(torch.complex64), r)
    assert found.passed and found.cosine > 0.999, found
    other = r.clone()
    other[0, 0] = complex(math.nan, 1.0)  # the same NaN, another imaginary part: still no finite value to compare
    assert metrics.compare("z", other.to(torch.complex64), r).failure is None


def test_a_row_of_zeros_on_both_sides_has_cosine_one():
    # a padded position's row, zero in the output and in its reference: cosine_similarity says 0 there, and a
    # report's smallest cosine read 0.000000 for an output equal to its reference
    r = torch.randn(4, 8, dtype=torch.float64)
    r[1] = 0
    assert metrics.compare("x", r.clone(), r, 1e-2).cosine == pytest.approx(1.0)
    y = r.clone()
    y[1, 0] = 1e-3  # a row of zeros against one that is not: no direction in common
    assert metrics.compare("x", y, r, 1e-2).cosine == 0.0
    tiny = torch.full((2, 8), 1e-300, dtype=torch.float64)  # a norm that underflows is not a row of zeros
    assert metrics.compare("x", tiny, tiny, 1e-2).cosine == pytest.approx(1.0)
    assert metrics.compare("x", tiny, -tiny, 1e-2).cosine == pytest.approx(-1.0)
