"""Depthwise convolutions on a GPU target: PyTorch runs a float32 NCHW one in its own CUDA kernels
(``ConvBackend::CudaDepthwise2d`` / ``CudaDepthwise3d``, aten/src/ATen/native/Convolution.cpp), which no TF32 flag
reaches, and sends it to cuDNN only where cuDNN's memory format is channels-last. The emulator computes the first in
IEEE at every level, forward and backward, and counts it so; the second at the ``conv.depthwise`` key's math for
its forward and input gradient (IEEE on Hopper, measured on an H200) and cuDNN's for its weight gradient; any
convolution with more than one input channel a group at cuDNN's math (MobileNet's, EfficientNet's and ConvNeXt's
depthwise layers read TF32's error at `highest` before)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tf32lab


def _operands(dims: int, channels: int = 8, multiplier: int = 1):
    torch.manual_seed(0)
    x = torch.randn(2, channels, *([9] * dims), requires_grad=True)
    w = torch.randn(channels * multiplier, 1, *([3] * dims), requires_grad=True)
    return x, w


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _run(conv, x, w, groups, target=None, level="high"):
    """The output and the gradients of x and w, emulated on ``target`` at ``level`` (None: natively), and the
    block's coverage."""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    if target is None:
        y = conv(x, w, groups=groups, padding=1)
        y.pow(2).sum().backward()
        return y.detach(), x.grad, w.grad, {}
    with tf32lab.precision(level), tf32lab.emulate(target) as emu:
        y = conv(x, w, groups=groups, padding=1)
        y.pow(2).sum().backward()
    return y.detach(), x.grad, w.grad, dict(emu.coverage)


@pytest.mark.parametrize("target", ["a100", "h100"])
@pytest.mark.parametrize("dims,multiplier", [(1, 1), (2, 1), (2, 2), (3, 1)])
def test_an_nchw_depthwise_convolution_is_ieee_on_a_gpu_target_at_every_level(target, dims, multiplier):
    x, w = _operands(dims, multiplier=multiplier)
    native = _run(_CONV[dims], x, w, groups=8)
    for level in ("highest", "high", "medium"):
        found = _run(_CONV[dims], x, w, groups=8, target=target, level=level)
        for got, want in zip(found[:3], native[:3]):
            assert torch.equal(got, want), (level, dims)
        assert {math for _, math in found[3]} == {"ieee"}, found[3]


def test_a_channels_last_depthwise_convolution_goes_to_cudnn_at_its_tf32():
    x, w = _operands(2)
    x = x.detach().to(memory_format=torch.channels_last)
    native = _run(F.conv2d, x, w, groups=8)
    found = _run(F.conv2d, x, w, groups=8, target="a100")
    assert not torch.equal(found[0], native[0])
    assert ("aten::convolution", "tf32-rna") in found[3]


@pytest.mark.parametrize("dims", [2, 3])
def test_cudnns_depthwise_forward_and_input_gradient_take_no_tf32_on_hopper(dims):
    # On an H200 (cuDNN 9.19) a channels-last depthwise convolution gave the same forward bits with cuDNN's TF32
    # flag on as off in 8 shapes, and input-gradient bits in 6 (two 3-D ones: other bits at float32's error, no
    # TF32's); its weight gradient took TF32 in 5 of them (conv's math)
    x, w = _operands(dims)
    x = x.detach().to(memory_format=torch.channels_last if dims == 2 else torch.channels_last_3d)
    native = _run(_CONV[dims], x, w, groups=8)
    found = _run(_CONV[dims], x, w, groups=8, target="h200", level="highest")
    assert torch.equal(found[0], native[0]) and torch.equal(found[1], native[1])
    assert not torch.equal(found[2], native[2])  # the weight gradient at cuDNN's TF32
    assert found[3] == {("aten::convolution", "ieee"): 1, ("aten::convolution_backward", "tf32-rne"): 1}


def test_a_grouped_convolution_with_several_channels_a_group_stays_at_cudnns_math():
    x, w = _operands(2)
    w = torch.randn(8, 2, 3, 3)  # 4 groups of 2 input channels: not depthwise
    native = _run(F.conv2d, x, w, groups=4)
    found = _run(F.conv2d, x, w, groups=4, target="a100")
    assert not torch.equal(found[0], native[0])
    assert ("aten::convolution", "tf32-rna") in found[3]


def test_check_measures_a_depthwise_block_at_float32s_own_error_where_only_the_depthwise_conv_computes():
    # a ConvNeXt-like depthwise 7x7 alone: every level computes it as float32 does, so every row is the floor
    torch.manual_seed(0)
    model = torch.nn.Conv2d(16, 16, 7, padding=3, groups=16)
    report = tf32lab.check(tf32lab.Workload(model, torch.randn(2, 16, 12, 12), name="depthwise"),
                           target="a100", speed=False)
    errors = {row.level: row.outputs[0].normwise for row in report.levels}
    assert errors["high"] == errors["highest"] < 1e-6, errors


@pytest.mark.parametrize("level", ["highest", "high"])
def test_an_emulated_convolution_keeps_a_channels_last_output_so_the_next_depthwise_one_goes_to_cudnn(level):
    # ConvNeXt's downsampling conv on a channels-last input (its LayerNorm permutes back), then a depthwise conv:
    # natively the first gives a channels-last output, so on a GPU the second reaches cuDNN, at its TF32
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(8, 16, 2, stride=2), torch.nn.Conv2d(16, 16, 7, padding=3, groups=16))
    x = torch.randn(2, 8, 16, 16).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        assert model[0](x).is_contiguous(memory_format=torch.channels_last)  # natively
        with tf32lab.precision(level), tf32lab.emulate("a100") as emu:
            y = model[0](x)
            model[1](y)
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert dict(emu.coverage) == {("aten::convolution", "tf32-rna"): 2}


def test_a_check_of_a_channels_last_model_that_views_a_convs_output_as_nhwc_runs_as_natively():
    # natively the conv's output is channels-last, so its NHWC permute is contiguous and .view() works; a contiguous
    # emulated output made .view() raise at every level ("Even `highest` fails")
    class Patches(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(8, 16, 3, padding=1)
            self.head = torch.nn.Linear(16, 4)

        def forward(self, x):
            y = self.conv(x)
            n, c, h, w = y.shape
            return self.head(y.permute(0, 2, 3, 1).view(n * h * w, c))

    torch.manual_seed(0)
    x = torch.randn(2, 8, 8, 8).contiguous(memory_format=torch.channels_last)
    report = tf32lab.check(tf32lab.Workload(Patches().eval(), x), levels=("highest", "high"), speed=False)
    assert [lv.error for lv in report.levels] == [None, None]
    assert report.passed
