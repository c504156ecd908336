"""Published float32 timings on tensor-core GPUs, IEEE vs TF32: the data the speed model is fitted to and checked on.

Each :class:`Published` row is one pair (the same work timed at ``highest``, IEEE, and at ``high`` or with cuDNN's
TF32 flag on), with its source. ``role`` says what the model does with it: ``"fit"`` rows set the per-math GEMM
efficiencies of ``tf32lab.know.peaks`` (:func:`tf32lab.speed.calibration.fit`); ``"held-out"`` rows are only
compared. ``kind``: ``gemm`` (one product), ``conv`` (one convolution, cuDNN), ``memory`` (a memory-bound op) or
``training`` (a whole training step). A row gives both times (seconds) where its source does, else only the
speedup. ``benchmarks/predict.py`` prints every row against the model.

Example:

    >>> from tf32lab.speed.published import ROWS
    >>> notes = next(r for r in ROWS if r.source.startswith("PyTorch CUDA notes"))
    >>> notes.target, notes.shape, round(notes.speedup, 2), notes.role
    ('a100', (10240, 10240, 10240), 6.88, 'fit')
"""

from __future__ import annotations

from typing import NamedTuple, Optional

__all__ = ["KINDS", "ROLES", "ROWS", "Published"]

KINDS = ("gemm", "conv", "memory", "training")
ROLES = ("fit", "held-out")


class Published(NamedTuple):
    """One published pair. ``shape``: (m, n, k) for a GEMM (labels may say m x k x n); for the others the workload
    is named by ``label`` and built by ``benchmarks/predict.py``. ``seconds``: (IEEE, TF32), when published."""

    label: str
    kind: str
    target: str
    role: str
    speedup: float
    source: str
    shape: tuple[int, ...] = ()  # a training row: (batch, gradient accumulation steps if more than one)
    seconds: Optional[tuple[float, float]] = None
    note: str = ""
    harness: float = 0.0  # seconds the timing harness adds to each call (this project's bench), added to predictions


def _pair(label: str, target: str, role: str, shape: tuple[int, ...], ieee: float, tf32: float, source: str,
          kind: str = "gemm", note: str = "", harness: float = 0.0) -> Published:
    return Published(label, kind, target, role, ieee / tf32, source, shape, (ieee, tf32), note, harness)


_NOTES = "PyTorch CUDA notes, TensorFloat-32 (TF32) on Ampere devices"
_PADDLE = "PaddlePaddle/Paddle#30612 (cuBLAS TF32 switch, A100)"
_JAX = "jax-ml/jax#9693 (A100, float32 vs tensorfloat32 matmul)"
_CUPY = "cupy/cupy#3810 (A100, CUDA 11.0; cupyx.time.repeat GPU times, CUPY_TF32=0/1)"
_KERNELBENCH = ("BytedTsinghua-SIA/CUDA-Agent#16 (A100, torch 2.12, KernelBench level 1, CUDA events, median of 30; "
                "shapes from ScalingIntelligence/KernelBench)")
_HF_T5 = ("huggingface/transformers#15026 (A100, HF Trainer, t5-base on wmt16 en-ro, batch 16, samples/s with "
          "--tf32 0 / 1)")
_HF_T5_3090 = ("huggingface/transformers#14608 (description: 1x RTX-3090, pt-1.10, cuda-11.3, HF Trainer, t5-small on "
               "wmt16 en-ro, --per_device_train_batch_size 32, --max_source_length 512 --max_target_length 512; "
               "samples/s with --tf32 0 / 1)")
_H100 = ("this project, docs/gpu-results.md, 2026-11-25 (NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, bench medians; "
         "bench's own cost, 51.8 µs per call, measured there, is added to the predictions)")
_BENCH_CALL = 51.8e-6
_H200 = ("this project, docs/gpu-results.md, 2026-11-26 (NVIDIA H200, torch 2.11.0+cu130; CUDA-event medians of 7 "
         "interleaved rounds; labels m x k x n)")

ROWS: tuple[Published, ...] = (
    # -- A100: one product ------------------------------------------------------------------------------------
    _pair("10240^3 mm", "a100", "fit", (10240, 10240, 10240), 0.11, 0.016, _NOTES),
    _pair("10240^3 mm", "a100", "held-out", (10240, 10240, 10240), 0.113, 0.017, _PADDLE),
    _pair("4096^3 matmul", "a100", "held-out", (4096, 4096, 4096), 7.56e-3, 1.25e-3, _JAX),
    _pair("8192^3 matmul", "a100", "fit", (8192, 8192, 8192), 64494.774e-6, 11255.235e-6, _CUPY),
    _pair("4096^3 matmul", "a100", "held-out", (4096, 4096, 4096), 10256.822e-6, 1581.901e-6, _CUPY),
    _pair("2048^3 matmul", "a100", "fit", (2048, 2048, 2048), 1438.858e-6, 249.424e-6, _CUPY),
    _pair("1024^3 matmul", "a100", "held-out", (1024, 1024, 1024), 209.142e-6, 66.397e-6, _CUPY),
    _pair("512^3 matmul", "a100", "fit", (512, 512, 512), 54.128e-6, 36.042e-6, _CUPY),
    Published("KernelBench 1: square matmul 4096^3", "gemm", "a100", "held-out", 6.97, _KERNELBENCH,
              (4096, 4096, 4096)),
    Published("KernelBench 13: symmetric matmul 4096^3", "gemm", "a100", "held-out", 6.97, _KERNELBENCH,
              (4096, 4096, 4096)),
    # -- H100 (this project's own bench) --------------------------------------------------------------------------
    _pair("8192^3 linear", "h100", "fit", (8192, 8192, 8192), 22.024e-3, 2.978e-3, _H100,
          harness=_BENCH_CALL),
    _pair("4096^3 linear", "h100", "held-out", (4096, 4096, 4096), 2.960e-3, 0.452e-3, _H100,
          harness=_BENCH_CALL),
    _pair("128x50000x768 linear", "h100", "held-out", (128, 50000, 768), 0.314e-3, 0.125e-3, _H100,
          note="an LM head: its weight's bytes bound the TF32 time", harness=_BENCH_CALL),
    # -- H200 (this project, CUDA events over back-to-back calls: no host cost in the large products) --------------
    _pair("8192^3 mm", "h200", "fit", (8192, 8192, 8192), 21.5838e-3, 2.9328e-3, _H200),
    _pair("2048^3 mm", "h200", "fit", (2048, 2048, 2048), 0.3443e-3, 0.0560e-3, _H200),
    _pair("4096^3 mm", "h200", "fit", (4096, 4096, 4096), 2.7702e-3, 0.4638e-3, _H200),
    _pair("1024^3 mm", "h200", "fit", (1024, 1024, 1024), 0.05648e-3, 0.03146e-3, _H200),
    _pair("4096x4096x16384 mm", "h200", "held-out", (4096, 16384, 4096), 10.8272e-3, 1.765e-3, _H200),
    _pair("16384x4096x1024 mm", "h200", "held-out", (16384, 1024, 4096), 2.8113e-3, 0.5322e-3, _H200),
    _pair("128x50000x768 mm", "h200", "held-out", (128, 768, 50000), 0.2059e-3, 0.0722e-3, _H200),
    # -- A100: convolutions (cuDNN; speedups only) ---------------------------------------------------------------
    Published("KernelBench 69: conv_transpose2d 64x64x128x256, 64->128, 3x5", "conv", "a100", "held-out", 9.62,
              _KERNELBENCH, (64, 64, 128, 256, 128, 3, 5)),
    Published("KernelBench 65: conv_transpose2d 8x64x512x512, 64->64, 3x7", "conv", "a100", "held-out", 9.05,
              _KERNELBENCH, (8, 64, 512, 512, 64, 3, 7)),
    Published("KernelBench 61: conv_transpose3d 8x48x64^3, 48->48, 3^3", "conv", "a100", "held-out", 6.85,
              _KERNELBENCH, (8, 48, 64, 64, 64, 48, 3, 3, 3)),
    # -- A100: memory-bound ops ("~1x for TF32") -------------------------------------------------------------------
    Published("KernelBench 19: relu 4096x393216", "memory", "a100", "held-out", 1.0, _KERNELBENCH, (4096, 393216),
              note="published as ~1x"),
    Published("KernelBench 23: softmax 4096x393216", "memory", "a100", "held-out", 1.0, _KERNELBENCH,
              (4096, 393216), note="published as ~1x"),
    Published("KernelBench 40: layer_norm 16x64x256x256 over (64, 256, 256)", "memory", "a100", "held-out", 1.0,
              _KERNELBENCH, (16, 64, 256, 256), note="published as ~1x"),
    # -- A100: a training step ------------------------------------------------------------------------------------
    Published("t5-base training step, batch 16", "training", "a100", "held-out", 210.5 / 93.7, _HF_T5, (16,),
              note="93.7 -> 210.5 samples/s; sequence lengths padded per batch (wmt16 en-ro), taken as 128 tokens"),
    Published("t5-base training step, batch 16, gradient accumulation 2", "training", "a100", "held-out",
              236.39 / 97.48, _HF_T5, (16, 2),
              note="97.48 -> 236.39 samples/s (--gradient_accumulation_steps 2); two forward and backward passes "
                   "per AdamW update"),
    # -- RTX 3090: a training step (a GeForce card: its TF32 dense peak is its FP32 peak, GA102 whitepaper) --------
    Published("t5-small training step, batch 32", "training", "rtx3090", "held-out", 300 / 252, _HF_T5_3090, (32,),
              note="252 -> 300 samples/s; sequence lengths padded per batch (wmt16 en-ro), taken as 128 tokens"),
)
