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


def test_an_input_of_no_channels_is_left_to_pytorch():
    x, weight = torch.zeros(2, 0, 50, dtype=torch.float64), torch.zeros(4, 0, 40, dtype=torch.float64)
    bias = torch.ones(4, dtype=torch.float64)
    assert unfolded.convolution(x, weight, bias, [1], [0], [1], False, [0], 1) is None  # was the bias, (2, 4, 11)


def test_what_is_not_unfolded_is_left_to_pytorch():
    x, weight = torch.randn(2, 3, 5, 5, 5, dtype=torch.float64), torch.randn(4, 3, 2, 2, 2, dtype=torch.float64)
    assert unfolded.convolution(x, weight, None, [1] * 3, [0] * 3, [1] * 3, False, [0] * 3, 1) is None  # 3-D
    x2, w2 = x[..., 0], weight[..., 0]
    assert unfolded.convolution(x2, w2.transpose(0, 1), None, [1, 1], [0, 0], [1, 1], True, [0, 0], 1) is None
    assert unfolded.convolution(x2.float(), w2.float(), None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1) is None
    assert unfolded.convolution(x2, w2, None, [1, 1], [0, 0], [9, 9], False, [0, 0], 1) is None  # no output


class _Tall(torch.nn.Module):
    """A pitch tracker's convolutions: tall kernels one position wide, a conv1d's and a 2-D one's."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Conv1d(1, 8, 40, stride=2)
        self.second = torch.nn.Conv2d(8, 4, (32, 1), padding=(3, 0))

    def forward(self, x):
        return self.second(torch.relu(self.first(x)).unsqueeze(-1))


def test_the_reference_run_convolves_tall_kernels_by_unfolded_gemms_with_float64s_values():
    """A pitch tracker's float64 reference ran PyTorch's slow CPU path, a small GEMM per sample; its tall,
    one-wide convolutions now run one GEMM per slice of the batch (no ``_slow_conv2d_forward``), with float64's
    values."""
    torch.manual_seed(0)
    model = _Tall()
    x = torch.randn(6, 1, 200)
    recorder = layers.Recorder(model, ["highest"], tf32lab.targets.get("a100"))
    with torch.no_grad(), torch.profiler.profile() as profile, recorder:
        out = model(x)
    ran = {event.name for event in profile.events()}
    assert not ran & {"aten::_slow_conv2d_forward", "aten::slow_conv2d_forward", "aten::thnn_conv2d"}, ran
    with torch.no_grad():
        expected = model.double()(x.double())
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, expected, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("x_shape,w_shape,groups", [
    ((2, 32, 48, 48), (32, 32, 3, 3), 1),  # an image's 3x3: PyTorch's path was 1.2-2x the faster
    ((2, 16, 127), (16, 1, 64), 16),  # depthwise: 5x
    ((2, 16, 127), (16, 16, 3), 1),  # a short conv1d kernel
    ((2, 8, 200, 4), (8, 8, 40, 1), 1),  # tall, but four positions wide
])
def test_where_pytorchs_path_is_the_faster_it_stays(x_shape, w_shape, groups):
    x, weight = torch.zeros(x_shape, dtype=torch.float64), torch.zeros(w_shape, dtype=torch.float64)
    assert not unfolded.faster(x, weight, groups)
    assert unfolded.faster(torch.zeros(2, 8, 200, 1, dtype=torch.float64),
                           torch.zeros(8, 8, 40, 1, dtype=torch.float64), 1)


_LAYOUTS = [((3, 4, 11, 9), (6, 4, 3, 2), 1), ((3, 1, 7, 5), (6, 1, 3, 3), 1), ((3, 4, 1, 1), (6, 4, 1, 1), 1),
            ((2, 4, 7, 6), (8, 1, 3, 3), 4)]


@pytest.mark.parametrize("x_shape,w_shape,groups", _LAYOUTS)
@pytest.mark.parametrize("x_last,w_last", [(False, False), (True, False), (False, True), (True, True)])
def test_an_unfolded_convolution_is_laid_out_as_pytorchs(x_shape, w_shape, groups, x_last, w_last):
    """A channels-last input or weight gives PyTorch's CPU convolution a channels-last result (size-1 channels
    and positions included, where the strides tell it); the unfolded one answered contiguous."""
    x, weight = torch.randn(x_shape, dtype=torch.float64), torch.randn(w_shape, dtype=torch.float64)
    x = x.to(memory_format=torch.channels_last) if x_last else x
    weight = weight.to(memory_format=torch.channels_last) if w_last else weight
    expected = F.conv2d(x, weight, groups=groups)
    found = unfolded.convolution(x, weight, None, [1, 1], [0, 0], [1, 1], False, [0, 0], groups)
    assert found.stride() == expected.stride()
    torch.testing.assert_close(found, expected, rtol=1e-13, atol=1e-13)


class _Nhwc(torch.nn.Module):
    """A convolution whose channels-last result is flattened as NHWC by a view (valid on PyTorch's layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y.permute(0, 2, 3, 1).view(y.size(0), -1)


@pytest.mark.parametrize("sliced", [False, True])
def test_the_reference_keeps_a_channels_last_convolutions_layout(sliced, monkeypatch):
    """The reference run of a channels-last model that views its convolution's result as NHWC raised 'view size
    is not compatible with input tensor's size and stride' (the float32 model runs); a batch convolved in slices
    (a budget of one sample) lost the layout too."""
    from tf32lab.measure import reference
    if sliced:
        monkeypatch.setattr(reference, "UNFOLD_BUDGET", 1)
    torch.manual_seed(0)
    model = _Nhwc()
    x = torch.randn(3, 4, 11, 9).to(memory_format=torch.channels_last)
    with torch.no_grad(), reference.Float64Run():
        out = model(x)
    with torch.no_grad():
        expected = model.double()(x.double())
    torch.testing.assert_close(out, expected, rtol=1e-13, atol=1e-13)


def test_a_grouped_convolutions_slices_keep_to_the_budget(monkeypatch):
    """A depthwise convolution's slices keep to the budget: unfolded all groups at once, they held ``groups``
    times it (648 MiB for 64 MiB, 64 channels); PyTorch's path, which grouped convolutions take, unfolds a group at
    a time, so the batch is sliced for one group's channels."""
    from tf32lab.measure import reference
    budget = 2 << 20
    monkeypatch.setattr(reference, "UNFOLD_BUDGET", budget)
    conv = torch.nn.Conv2d(16, 16, 3, padding=1, groups=16)
    x = torch.randn(16, 16, 24, 24)  # the unfolded batch: 16 x 576 positions x 16 x 9 float64s, 10.1 MiB
    with torch.no_grad(), torch.profiler.profile(profile_memory=True) as profile, reference.Float64Run():
        conv(x)
    largest = max(event.cpu_memory_usage for event in profile.events() if event.name != "aten::convolution")
    assert largest <= budget, largest
