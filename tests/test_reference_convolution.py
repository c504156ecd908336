"""The float64 reference's convolutions (``tf32lab.measure.unfolded``): one GEMM over the unfolded input of a slice
of the batch, in place of PyTorch's CPU float64 path (per sample, small GEMMs: 4-6x slower on a pitch tracker's
convolutions), with float64's values in every layout a ``conv1d`` or ``conv2d`` takes."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import tf32lab
from tf32lab.measure import layers, unfolded

# every dimension count and grouping, with strides, paddings, dilations and biases in turn
_CASES = [(dims, groups, *rest) for dims, groups, rest in itertools.product(
    (1, 2), (1, 2, 4), ((1, 0, 1, True), (3, 2, 2, False), (2, 1, 1, False), (1, 2, 2, True)))]


@pytest.mark.parametrize("dims,groups,stride,padding,dilation,bias", _CASES)
def test_an_unfolded_convolution_gives_float64s_values(dims, groups, stride, padding, dilation, bias):
    torch.manual_seed(0)
    x = torch.randn(3, 4, *((11,) if dims == 1 else (11, 9)), dtype=torch.float64)
    weight = torch.randn(8, 4 // groups, *((3,) if dims == 1 else (3, 2)), dtype=torch.float64)
    b = torch.randn(8, dtype=torch.float64) if bias else None
    conv = F.conv1d if dims == 1 else F.conv2d
    expected = conv(x, weight, b, stride=stride, padding=padding, dilation=dilation, groups=groups)
    found = unfolded.convolution(x, weight, b, [stride] * dims, [padding] * dims, [dilation] * dims, False,
                                 [0] * dims, groups)
    assert found.shape == expected.shape and found.is_contiguous()
    torch.testing.assert_close(found, expected, rtol=1e-13, atol=1e-13)


def test_what_is_not_unfolded_is_left_to_pytorch():
    x, weight = torch.randn(2, 3, 5, 5, 5, dtype=torch.float64), torch.randn(4, 3, 2, 2, 2, dtype=torch.float64)
    assert unfolded.convolution(x, weight, None, [1] * 3, [0] * 3, [1] * 3, False, [0] * 3, 1) is None  # 3-D
    x2, w2 = x[..., 0], weight[..., 0]
    assert unfolded.convolution(x2, w2.transpose(0, 1), None, [1, 1], [0, 0], [1, 1], True, [0, 0], 1) is None
    assert unfolded.convolution(x2.float(), w2.float(), None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1) is None
    assert unfolded.convolution(x2, w2, None, [1, 1], [0, 0], [9, 9], False, [0, 0], 1) is None  # no output


def test_the_reference_run_convolves_by_unfolded_gemms_with_float64s_values():
    """A conv net's float64 reference ran PyTorch's slow CPU path, per sample; it now runs one GEMM per slice of
    the batch (no ``_slow_conv2d_forward``), with float64's values."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 4, (5, 1), stride=(2, 1), groups=4))
    x = torch.randn(6, 3, 16, 9)
    recorder = layers.Recorder(model, ["highest"], tf32lab.targets.get("a100"))
    with torch.no_grad(), torch.profiler.profile() as profile, recorder:
        out = model(x)
    ran = {event.name for event in profile.events()}
    assert not ran & {"aten::_slow_conv2d_forward", "aten::slow_conv2d_forward", "aten::thnn_conv2d"}, ran
    with torch.no_grad():
        expected = model.double()(x.double())
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, expected, rtol=1e-13, atol=1e-13)
