"""What limits each op on a GPU: its *kind*, which the speed model times it by and takes its band from.

An op's kind is found once, when it is counted (``counting.OpCost.kind``):

- ``gemm``: a product of the matmul, attention, RNN or matvec family (cuBLAS; tensor cores at ``high``);
- ``conv``: a dense convolution (``groups == 1``: 1x1, strided, dilated, 1-D as 2-D, 3-D): cuDNN's implicit GEMM,
  on tensor cores under cuDNN's TF32 flag (cuDNN Developer Guide, "Tensor Core Operations");
- ``conv-transposed``: cuDNN's transposed convolution (PyTorch's ``ConvBackend::CudnnTranspose``), an implicit
  GEMM too, but its per-shape algorithms gain 2-2.5x more than that GEMM says (published KernelBench rows);
- ``conv-grouped``: ``1 < groups < channels``: cuDNN's grouped convolution, on tensor cores only where the channels
  per group suit its kernels (NVIDIA, "Convolutional Layers User's Guide"; the cuDNN 8.3 release notes widened
  the set) -- unknown per shape, so its band reaches down to no gain at all;
- ``conv-depthwise``: one input channel per group (MobileNet, EfficientNet, ConvNeXt): PyTorch sends a float32,
  NCHW one to its own CUDA-core kernels (``aten/src/ATen/native/Convolution.cpp``: ``use_cudnn_depthwise`` takes
  cuDNN for FP16 only, or channels-last; else ``ConvBackend::CudaDepthwise2d`` / ``CudaDepthwise3d``), which no
  TF32 flag reaches; it is memory-bound or CUDA-core-bound, and TF32 buys it nothing (band: at most what its bytes
  allow, where channels-last sends it to cuDNN);
- memory-bound kinds, timed by the bytes they move: ``elementwise``, ``norm`` (LayerNorm, BatchNorm, RMSNorm and
  their backward), ``softmax``, ``embedding`` (and its backward), ``reduction``, ``optimizer`` (an update of
  Adam, AdamW or SGD with momentum), ``copy``; ``memory`` for any other op.

Example:

    >>> from tf32lab.speed.kinds import conv_kind, kind_of
    >>> conv_kind(groups=192, channels=192, transposed=False), conv_kind(groups=1, channels=64, transposed=False)
    ('conv-depthwise', 'conv')
    >>> kind_of("aten::native_layer_norm_backward", None), kind_of("aten::mul", None), kind_of("aten::addmm", "matmul")
    ('norm', 'elementwise', 'gemm')
"""

from __future__ import annotations

from typing import Any, Optional

from tf32lab.know import peaks

OpCost = Any  # counting.OpCost, named without importing it: counting imports this module

__all__ = ["CONV_KINDS", "KINDS", "MEMORY_KINDS", "TIME_BAND", "conv_kind", "gain_band", "kind_of"]

CONV_KINDS = ("conv", "conv-transposed", "conv-grouped", "conv-depthwise")
MEMORY_KINDS = ("elementwise", "norm", "softmax", "embedding", "reduction", "optimizer", "copy", "memory")
KINDS = ("gemm", *CONV_KINDS, *MEMORY_KINDS)

_NORM = ("layer_norm", "batch_norm", "group_norm", "instance_norm", "rms_norm", "_fused_rms_norm", "norm_backward",
         "batch_norm_backward", "_batch_norm_impl_index", "cudnn_batch_norm", "_native_batch_norm_legit")
_SOFTMAX = ("softmax", "log_softmax", "_softmax", "_log_softmax", "_safe_softmax", "_softmax_backward_data",
            "_log_softmax_backward_data")
_EMBEDDING = ("embedding", "embedding_dense_backward", "embedding_backward", "index_select", "gather", "index",
              "take", "_embedding_bag", "embedding_bag")
_REDUCTION = ("sum", "mean", "amax", "amin", "max", "min", "var", "std", "var_mean", "std_mean", "norm",
              "linalg_vector_norm", "all", "any", "argmax", "argmin", "nll_loss_forward", "nll_loss_backward",
              "cumsum", "logsumexp", "max_pool2d_with_indices", "max_pool2d_with_indices_backward", "max_pool2d",
              "adaptive_avg_pool2d", "avg_pool2d", "_adaptive_avg_pool2d", "_adaptive_avg_pool2d_backward")
_COPY = ("clone", "_to_copy", "copy_", "contiguous", "cat", "stack", "zeros_like", "ones_like", "zeros", "ones",
         "fill_", "zero_", "full", "full_like", "new_zeros", "new_ones", "new_full", "_local_scalar_dense")


def conv_kind(groups: int, channels: int, transposed: bool) -> str:
    """The kind of a convolution with ``groups`` groups over ``channels`` input channels (module docstring)."""
    if transposed:
        return "conv-transposed"
    if groups > 1 and channels == groups:
        return "conv-depthwise"
    return "conv-grouped" if groups > 1 else "conv"


def kind_of(op: str, family: Optional[str]) -> str:
    """The kind of a non-convolution op ``op`` (``"aten::mul"``) of ``family`` (None: not precision-sensitive);
    a convolution's kind needs its arguments: :func:`conv_kind`."""
    if family == "conv":
        return "conv"
    if family is not None:
        return "gemm"
    name = op.split("::")[-1]
    if name.startswith("optimizer:") or name.startswith("_foreach_") or name.startswith("_fused_adam") \
            or name.startswith("_fused_sgd"):
        return "optimizer"
    base = name.rstrip("_")
    if base in _NORM or base.endswith("_norm") or base.endswith("_norm_backward"):
        return "norm"
    if base in _SOFTMAX:
        return "softmax"
    if base in _EMBEDDING:
        return "embedding"
    if base in _REDUCTION:
        return "reduction"
    if base in _COPY:
        return "copy"
    return "elementwise" if base else "memory"


# How far the time of an op whose math no level changes may be off, per kind (low, high factors on its time): the
# whole-step residuals of this project's H200 rows (``peaks.HOST_BAND``: their memory-bound ops and host cost),
# for every memory-bound kind alike; a depthwise convolution's CUDA-core time is unfitted: twice as wide.
TIME_BAND: dict[str, tuple[float, float]] = {
    **{kind: peaks.HOST_BAND for kind in MEMORY_KINDS},
    "conv-depthwise": (peaks.HOST_BAND[0] ** 2, peaks.HOST_BAND[1] ** 2),
}


def gain_band(kind: str, op: OpCost, before: float, after: float, p: peaks.Peaks) -> tuple[float, float]:
    """Factors (low, high) on what a level (or cuDNN's flag) is predicted to buy an op of ``kind`` that took
    ``before`` and takes ``after`` seconds (module docstring): GEMMs the published GEMMs' residuals
    (``peaks.GEMM_BAND``); convolutions cuDNN's per-shape variability (``peaks.CONV_BAND``); a grouped one may gain
    nothing (its channels per group may not suit the tensor cores); a depthwise one at most down to its bytes' time
    (cuDNN's channels-last path), at least nothing."""
    if kind == "gemm":
        return peaks.GEMM_BAND
    if kind in ("conv", "conv-transposed"):
        return peaks.CONV_BAND
    gain = before / after if after > 0 else 1.0
    if kind == "conv-grouped":
        return min(peaks.CONV_BAND[0], 1 / gain), peaks.CONV_BAND[1]
    if kind == "conv-depthwise":
        floor = op.bytes / (p.bandwidth * 1e9 * peaks.memory_efficiency(p.target)) + peaks.LAUNCH_SECONDS
        return 1.0 / gain, max(1.0, before / floor / gain)
    return 1.0, 1.0
