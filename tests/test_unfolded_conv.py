"""With cuDNN off a GPU runs a convolution in PyTorch's own slow backends, an im2col and a cuBLAS GEMM per sample
(tf32lab.speed.unfolded_conv); the speed model times it so, not as cuDNN's implicit GEMM over the whole batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tf32lab
from tf32lab.speed.counting import Counting
from tf32lab.speed.unfolded_conv import as_run, unfolded


def _counted(model: nn.Module, x: torch.Tensor, backward: bool = False):
    with Counting(model, backward=backward) as counts:
        out = model(x)
        if backward:
            out.sum().backward()
    return [op for op in counts.ops if op.family == "conv"]


@pytest.mark.parametrize("conv, shape", [
    (nn.Conv2d(6, 8, 3, padding=1), (4, 6, 10, 10)),
    (nn.Conv2d(6, 8, 3, stride=2, groups=2), (4, 6, 11, 11)),
    (nn.Conv1d(6, 8, 5, dilation=2), (3, 6, 40)),
    (nn.Conv3d(2, 4, 3), (2, 2, 6, 6, 6)),
    (nn.ConvTranspose2d(6, 8, 3, stride=2, groups=2), (4, 6, 5, 5)),
])
def test_the_samples_gemms_do_the_convolutions_multiply_adds(conv, shape):
    (op,) = _counted(conv, torch.randn(shape))
    products, moved = op.unfolded
    batch, groups = shape[0], conv.groups
    assert products.gemms[0][:2] == (batch * groups, 1) and products.kernels == batch * groups
    assert products.flops == op.flops  # one sample and one group at a time: the same products
    assert moved.gemms == () and moved.bytes > 0 and moved.kind == "memory"


def test_a_pointwise_convolution_needs_no_columns_and_a_depthwise_one_keeps_its_kernel():
    (pointwise,) = _counted(nn.Conv2d(8, 16, 1), torch.randn(4, 8, 6, 6))
    products, moved = pointwise.unfolded
    assert moved.kernels == 1 and moved.bytes == 4 * 16 * 6 * 6 * 4  # the output set to the bias, no im2col
    assert products.gemms == ((4, 1, 36, 16, 8),)
    (depthwise,) = _counted(nn.Conv2d(8, 8, 3, groups=8), torch.randn(4, 8, 6, 6))
    assert depthwise.unfolded == ()


def test_the_backward_runs_the_gradients_asked_for_per_sample():
    torch.manual_seed(0)
    first = nn.Conv2d(3, 8, 3)  # its input needs no gradient: only the weight's is computed
    ops = _counted(nn.Sequential(first, nn.Conv2d(8, 4, 3)), torch.randn(2, 3, 9, 9), backward=True)
    backward = [op for op in ops if op.op == "aten::convolution_backward"]
    assert len(backward) == 2
    gemm_counts = sorted(len(op.unfolded[0].gemms) for op in backward)
    assert gemm_counts == [1, 2]
    for op in backward:
        assert all(g[:2] == (2, 1) for g in op.unfolded[0].gemms)


def test_not_a_convolutions_arguments_gives_nothing():
    x = torch.randn(2, 3, 4)
    assert unfolded("convolution", {"input": x}, x) == ()
    assert unfolded("conv_tbc", {"self": x, "weight": torch.randn(3, 3, 3)}, x) == ()


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1))
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.body(x).mean((2, 3)))


def test_a_prediction_without_cudnn_times_the_slow_backends():
    torch.manual_seed(0)
    workload = tf32lab.Workload(_Net().eval(), torch.randn(32, 3, 64, 64), name="net")
    on = tf32lab.predict(workload, "a100")
    with torch.backends.cudnn.flags(enabled=False):
        off = tf32lab.predict(workload, "a100")
    assert torch.backends.cudnn.enabled
    # 32 samples x 2 convolutions: 64 GEMMs and 64 im2col kernels where cuDNN launches 2 kernels
    assert off.level("highest").seconds > 2 * on.level("highest").seconds
    # the level now sets the convolutions' math (cuDNN's TF32 flag does not reach them): `high` gains, but less
    # than an implicit GEMM over the batch would (the columns' traffic and the launches stay)
    assert 1.0 < off.level("high").speedup < 2.0
    ops = _counted(_Net(), torch.randn(2, 3, 8, 8))
    assert as_run(ops, off=False) == ops and len(as_run(ops, off=True)) == 2 * len(ops)
