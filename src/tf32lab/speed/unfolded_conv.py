"""A convolution as a GPU runs it with cuDNN off (``torch.backends.cudnn.enabled = False``): PyTorch's own "slow"
backends, im2col and a cuBLAS GEMM per sample.

With cuDNN off, PyTorch sends a float32 convolution that is not depthwise to its slow backends (``Slow2d``,
``SlowDilated2d``, ``SlowTranspose2d`` and their 3-D kin: ``_select_conv_backend`` in
aten/src/ATen/native/Convolution.cpp). For each sample of the batch, they unfold the input into columns (im2col,
``Cin x kernel`` rows by the output's positions; skipped for a 1x1 kernel with stride 1 and no padding) and multiply
them by the weight in one cuBLAS GEMM under the matmul flag (``slow_conv2d_forward`` in
aten/src/ATen/native/cuda/ConvolutionMM2d.cu: ``for (int elt = 0; elt < batchSize; elt ++)``); a transposed one
multiplies first and folds the columns back (col2im); the backward does both per sample. Backends without groups
run one group at a time (``_convolution_nogroup``). So a convolution becomes ``batch x groups`` GEMMs of one sample's
positions each, launched one after another, and memory-bound im2col/col2im kernels that write and read the columns:
what cuDNN's implicit GEMM, one kernel over the whole batch, does not pay.

The counting records, for each convolution, the ops it is replaced by (:func:`unfolded`); the prediction takes
them where the target is a GPU and cuDNN is off (:func:`as_run`). A depthwise convolution keeps its own kernel
(PyTorch's, with or without cuDNN).

Example:

    >>> import torch
    >>> x, w = torch.randn(8, 16, 32, 32), torch.randn(32, 16, 3, 3)
    >>> out = torch.nn.functional.conv2d(x, w, padding=1)
    >>> gemm, columns = unfolded("convolution", {"input": x, "weight": w, "padding": [1, 1], "groups": 1}, out)
    >>> gemm.gemms, gemm.kernels, columns.kernels
    (((8, 1, 1024, 32, 144),), 8, 9)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

__all__ = ["Unfolded", "as_run", "unfolded"]


class Unfolded(NamedTuple):
    """One op a convolution becomes without cuDNN: its name (``aten::_slow_conv2d_forward``, ``aten::im2col``),
    FLOPs, bytes read and written, GEMMs ``(count, batch, m, n, k)``, kernel launches, and its kind
    (``speed.kinds``: ``gemm``, cuBLAS's, or ``memory``)."""

    op: str
    flops: float
    bytes: float
    gemms: tuple[tuple[int, int, int, int, int], ...]
    kernels: int
    kind: str


def _prod(sizes: Sequence[int]) -> int:
    return math.prod(int(s) for s in sizes)


def _needs_columns(weight: torch.Tensor, a: Mapping[str, Any]) -> bool:
    """Whether im2col runs: a kernel, stride or padding other than 1x1, 1 and 0 (``requires_columns``)."""
    stride, padding = a.get("stride") or [1], a.get("padding") or [0]
    return _prod(weight.shape[2:]) != 1 or any(int(s) != 1 for s in stride) or any(int(p) != 0 for p in padding)


def unfolded(name: str, a: Mapping[str, Any], out: Any) -> tuple[Unfolded, ...]:
    """What a GPU runs for convolution op ``name`` (``convolution``, ``convolution_backward``; ``a``: its arguments
    by name, ``out``: its result) with cuDNN off: its GEMMs and its im2col/col2im traffic; empty where it keeps a
    kernel of its own (depthwise) or the arguments are not a convolution's."""
    x = a.get("input")
    w = a.get("weight")
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor) or x.dim() < 3 or w.dim() < 3:
        return ()
    groups = int(a.get("groups", 1) or 1)
    transposed = bool(a.get("transposed", False)) or "transpose" in name
    channels = int(x.shape[1])
    if not transposed and groups > 1 and channels == groups:  # depthwise: PyTorch's own kernel, cuDNN or not
        return ()
    size = x.element_size()
    batch, kernel = int(x.shape[0]), _prod(w.shape[2:])
    inner = _prod(x.shape[2:])  # the input's positions, per sample
    columns = _needs_columns(w, a)
    if name == "convolution_backward":
        grad = a.get("grad_output")
        if not isinstance(grad, torch.Tensor):
            return ()
        outer = _prod(grad.shape[2:])
        mask = a.get("output_mask") or [True, True, True]
        return _backward(batch, groups, channels, int(grad.shape[1]), kernel, inner, outer, size, columns,
                         transposed, mask)
    y = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(y, torch.Tensor) or y.dim() != x.dim():
        return ()
    outer = _prod(y.shape[2:])
    c_out = int(y.shape[1])
    count = batch * groups
    if transposed:  # per sample: columns = Wᵀ x, then col2im into the output
        rows = c_out // groups * kernel
        gemm = (count, 1, inner, rows, channels // groups)
        traffic = batch * (2 * rows * groups * inner + c_out * outer) * size  # columns written and read, output
        kernels = count
    else:  # per sample: im2col, then the output = W columns
        rows = channels // groups * kernel
        gemm = (count, 1, outer, c_out // groups, rows)
        traffic = batch * (channels * inner + 2 * rows * groups * outer) * size if columns else 0.0
        kernels = count if columns else 0
    flops = 2.0 * count * gemm[2] * gemm[3] * gemm[4]
    products = Unfolded("aten::_slow_conv_forward", flops, float(x.numel() + w.numel() + y.numel()) * size,
                        (gemm,), count, "gemm")
    # the output first set to the bias (or zero): one more kernel over it
    moved = Unfolded("aten::im2col", 0.0, traffic + y.numel() * size, (), kernels + 1, "memory")
    return products, moved


def _backward(batch: int, groups: int, channels: int, c_out: int, kernel: int, inner: int, outer: int, size: int,
              columns: bool, transposed: bool, mask: Sequence[bool]) -> tuple[Unfolded, ...]:
    """The backward's per-sample GEMMs and column traffic: the input's gradient (a GEMM, then col2im) and the
    weight's (im2col, then a GEMM summed over the samples), each where ``mask`` asks for it."""
    count = batch * groups
    if transposed:  # the forward's roles swapped: the gradient's columns come from the output's positions
        inner, outer, channels, c_out = outer, inner, c_out, channels
    rows = channels // groups * kernel
    gemms, traffic, kernels = [], 0.0, 0
    if mask[0]:
        gemms.append((count, 1, outer, rows, c_out // groups))
        traffic += batch * (2 * rows * groups * outer + channels * inner) * size
        kernels += count
    if len(mask) > 1 and mask[1]:
        gemms.append((count, 1, c_out // groups, rows, outer))
        traffic += batch * (channels * inner + 2 * rows * groups * outer) * size if columns else 0.0
        kernels += count if columns else 0
    if not gemms:
        return ()
    flops = sum(2.0 * c * m * n * k for c, _, m, n, k in gemms)
    read = batch * (c_out * outer + channels * inner) * size
    products = Unfolded("aten::_slow_conv_backward", flops, float(read), tuple(gemms), sum(g[0] for g in gemms),
                        "gemm")
    return (products, Unfolded("aten::col2im", 0.0, traffic, (), max(1, kernels), "memory"))


def as_run(ops: Sequence[Any], off: bool) -> list[Any]:
    """``ops`` (``counting.OpCost``) as a GPU runs them: with cuDNN ``off``, each convolution replaced by the ops
    it becomes (:func:`unfolded`, recorded as the op's ``unfolded``); else as counted."""
    if not off or not any(op.unfolded for op in ops):
        return list(ops)
    found = []
    for op in ops:
        if not op.unfolded:
            found.append(op)
            continue
        for part in op.unfolded:
            found.append(op._replace(op=part.op, flops=part.flops, bytes=part.bytes, gemms=part.gemms,
                                     kind=part.kind, kernels=part.kernels, unfolded=(),
                                     family=op.family if part.gemms else None))
    return found

