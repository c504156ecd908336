"""The training check's comparisons of parameters, gradients and optimizer states with float64's, a chunk at a time
(`measure.norms.distance_sums`): the numbers of the float64 copies they replace, no buffer the tensors' size, and the
scaled norms wherever plain sums could not stand for them."""

from __future__ import annotations

import math

import pytest
import torch

from tf32lab.measure.norms import CHUNK, distance_sums, scratch
from tf32lab.measure.training import _against, _tree_error
from tf32lab.numbers import metrics

CPU = torch.device("cpu")


def _plain(y: torch.Tensor, r: torch.Tensor) -> tuple[float, float, float]:
    y, r = y.double().reshape(-1), r.double().reshape(-1)
    return float(y @ y), float(r @ r), float((y - r) @ (y - r))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("size", [1, CHUNK - 1, CHUNK, 3 * CHUNK + 5])
def test_the_sums_are_the_float64_copies_sums(dtype, size):
    g = torch.Generator().manual_seed(size)
    r = torch.randn(size, dtype=torch.float64, generator=g)
    y = (r + 1e-3 * torch.randn(size, dtype=torch.float64, generator=g)).to(dtype)
    found = distance_sums(y, r, scratch(CPU))
    assert found is not None
    for got, want in zip(found, _plain(y, r)):
        assert got == pytest.approx(want, rel=1e-12)


def test_a_float32_reference_and_a_strided_tensor_are_read_as_they_lie():
    r = torch.randn(300, 500, dtype=torch.float64)
    y = (r + 1e-4).float().t()  # read in place: the sums follow the elements' logical order
    found = distance_sums(y, r.t().float(), scratch(CPU))
    assert found is not None
    for got, want in zip(found, _plain(y, r.t().float())):
        assert got == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("case", ["complex", "integer", "sizes", "empty", "equal", "overflow", "tiny", "inf", "nan",
                                  "meta"])
def test_where_plain_sums_cannot_stand_for_the_norms_there_are_none(case):
    r = torch.ones(4, dtype=torch.float64)
    y = {"complex": torch.ones(4, dtype=torch.complex64), "integer": torch.ones(4, dtype=torch.int64),
         "sizes": torch.ones(5), "empty": torch.ones(0), "equal": torch.ones(4),
         "overflow": torch.full((4,), 1e200, dtype=torch.float64), "tiny": torch.full((4,), 1.0) + 0.0,
         "inf": torch.tensor([1.0, math.inf, 1.0, 1.0]), "nan": torch.tensor([1.0, math.nan, 1.0, 1.0]),
         "meta": torch.ones(4, device="meta")}[case]
    if case == "empty":
        r = torch.ones(0, dtype=torch.float64)
    if case == "tiny":
        r = torch.full((4,), 1e-160, dtype=torch.float64)
    assert distance_sums(y, r, scratch(CPU)) is None


@pytest.mark.parametrize("x", [torch.tensor([1.0, math.inf]), torch.tensor([1.0, math.nan]), torch.zeros(2),
                               torch.tensor([1e-170, 2e-170], dtype=torch.float64), torch.tensor([1.0, 2.0])])
@pytest.mark.parametrize("floor", [0.0, 10.0])
def test_against_gives_what_the_float64_copies_gave(x, floor):
    ref = torch.tensor([1.0, 2.5], dtype=torch.float64)
    chunked, copied = _against(x, ref, floor, work=scratch(CPU)), _against(x, ref, floor)
    assert chunked == pytest.approx(copied, rel=1e-12, nan_ok=True)


def test_one_minus_the_cosine_keeps_its_digits_where_the_two_are_nearly_parallel():
    # a row's weights against float64's: 1 - cos about 5e-13, which x·r / (‖x‖ ‖r‖) gave 5% off (its float64 sum
    # of 300,000 products cancels), and the difference's norm to float64's spacing near 1 (1.1e-16, 2e-4 of it)
    np = pytest.importorskip("numpy")
    if np.finfo(np.longdouble).precision <= np.finfo(np.float64).precision:
        pytest.skip("numpy's longdouble is float64 here: no wider sum to compare with")
    g = torch.Generator().manual_seed(0)
    r = torch.randn(300_000, dtype=torch.float64, generator=g)
    x = (r * (1 + 1e-6 * torch.randn(r.shape, dtype=torch.float64, generator=g))).float()
    wide_x, wide_r = x.double().numpy().astype(np.longdouble), r.numpy().astype(np.longdouble)  # 64-bit mantissas
    true = float(1 - (wide_x @ wide_r) / np.sqrt(wide_x @ wide_x) / np.sqrt(wide_r @ wide_r))
    _, cosine = _against(x, r, work=scratch(CPU))
    assert 1 - cosine == pytest.approx(true, rel=2e-3)


def test_an_optimizer_states_error_is_normwise_over_all_of_it():
    g = torch.Generator().manual_seed(0)
    refs = [torch.randn(n, dtype=torch.float64, generator=g) for n in (3, CHUNK + 7, 1000)]
    found = [(r + 1e-5 * torch.randn(r.shape, dtype=torch.float64, generator=g)).float() for r in refs]
    assert _tree_error(found, refs) == pytest.approx(metrics.normwise_over(found, refs), rel=1e-12)
    # a state the sums cannot stand for (an Inf) sends all of it to the scaled norms, as before
    found[1][5] = math.inf
    assert _tree_error(found, refs) == metrics.normwise_over(found, refs) == math.inf


def test_a_comparison_allocates_no_buffer_the_tensors_size():
    r = torch.randn(4 * CHUNK, dtype=torch.float64)
    y = r.float()
    work = scratch(CPU)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        _against(y, r, work=work)
    allocated = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]
    assert max(allocated, default=0) < y.numel() * 4  # bytes: less than the float32 tensor itself
