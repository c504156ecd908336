"""What each GPU target can do per second: dense peaks per math, memory bandwidth, SMs (NVIDIA datasheets).

The speed model (``tf32lab.speed.prediction``) divides work by these. Each GPU target of ``tf32lab.targets`` holds
its :class:`Peaks` (one table: ``targets.TARGETS``), with its source; ``verify on GPU`` marks an assumption not yet
measured on the device. CPU targets have none: their speed is measured (``tf32lab.bench``), not predicted.

Example:

    >>> from tf32lab import targets
    >>> a100 = targets.get("a100").speed_peaks()
    >>> a100.flops("ieee") / 1e12, a100.flops("tf32-rna") / 1e12, a100.flops("tf32x3") / 1e12
    (19.5, 156.0, 52.0)
    >>> rtx = targets.get("rtx3090").speed_peaks()
    >>> rtx.flops("tf32-rna") == rtx.flops("ieee")   # GeForce: TF32 = FP32
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tf32lab.errors import Tf32LabError

__all__ = ["CONV_BAND", "DATASHEET", "DIRECT_CONV_EFFICIENCY", "GEMM_BAND", "GEMM_EFFICIENCY", "GEMM_FITS",
           "HOST_BAND", "HOST_SECONDS", "LAUNCH_SECONDS", "MEMORY_EFFICIENCIES", "MEMORY_EFFICIENCY", "SMS",
           "GemmFit", "Peaks", "gemm_fit", "math_kind", "memory_efficiency"]

# A GEMM on a GPU without a fit below: one efficiency for both maths (so that GeForce cards, TF32 peak = FP32 peak,
# get the speedup their peaks say, 1.0): the PyTorch CUDA notes' 10240^3 matmul on an A100 implies ~100% of the FP32
# peak and ~86% of the TF32 peak; their midpoint.
GEMM_EFFICIENCY = 0.93
# A streaming kernel reaches ~85% of HBM/GDDR peak (STREAM-like copies on A100/H100); verify on GPU.
MEMORY_EFFICIENCY = 0.85
# Eager PyTorch: the host's dispatch plus the launch, per kernel; verify on GPU.
LAUNCH_SECONDS = 5e-6
# The host's cost per op of eager PyTorch (Python, dispatch, launch; a model's own Python between ops): fitted to
# this project's H200 whole-model rows (benchmarks/predict.py --gpu-data), Hugging Face encoders whose MiniLM-sized
# one takes 3.26 ms a forward at both levels (host-bound). ``predict(..., host=HOST_SECONDS)`` queues it
# (``speed.prediction.queued_seconds``); the default, 0, predicts the GPU's time alone (a bare op costs ~12 µs on
# the H100's host, docs/gpu-results.md: one value for every model is not what the rows show).
HOST_SECONDS = 37e-6
# How far those rows' predicted times were off (measured / predicted, low and high): the time band of every op
# whose math a level leaves alone (memory-bound kinds and host cost).
HOST_BAND = (0.80, 1.33)
# A depthwise convolution in PyTorch's own CUDA-core kernel (float32, NCHW: no cuDNN, no tensor cores): the share of
# the FP32 peak its direct loops reach. Unfitted (no published or measured row); it only moves the time such a
# convolution takes at every level alike, never what TF32 buys it.
DIRECT_CONV_EFFICIENCY = 0.5


@dataclass(frozen=True)
class GemmFit:
    """What a GEMM kernel of one kind of math reaches on one GPU: ``efficiency``, the fraction of the math's peak
    its main loop runs at, and ``wave_seconds``, a fixed cost per wave of tiles (filling the pipeline, the epilogue:
    the same for every tile shape, which is why small products gain less from tensor cores than large ones)."""

    efficiency: float
    wave_seconds: float


# Fitted by ``tf32lab.speed.calibration.fit`` on the ``"fit"`` rows of ``tf32lab.speed.published.ROWS`` (published
# A100 timings: the PyTorch CUDA notes' 10240^3 matmul, cupy/cupy#3810's 8192^3, 2048^3 and 512^3; this project's
# H100 8192^3 and H200 1024^3 to 8192^3, docs/gpu-results.md; a single size fits no wave cost), per target and
# kind of math: ``simt`` (IEEE float32 on the CUDA cores) and
# ``tensor`` (TF32, bf16 and their x3/x9 forms on the tensor cores). Tensor-core kernels reach a smaller fraction of
# their peak than SIMT SGEMM does of its own, so a large product gains less than the datasheet ratio (A100: ~6.5x,
# not 8x). ``benchmarks/predict.py`` prints the fit and every held-out row; a test keeps these equal to the fit.
GEMM_FITS: dict[str, dict[str, GemmFit]] = {
    "a100": {"simt": GemmFit(0.92, 21.5e-6), "tensor": GemmFit(0.80, 26.5e-6)},
    "h100": {"simt": GemmFit(0.78, 0.0), "tensor": GemmFit(0.79, 0.0)},
    "h200": {"simt": GemmFit(0.80, 5.0e-6), "tensor": GemmFit(0.89, 19.5e-6)},
}

# How far a prediction may be off, as factors on the time ratio of the ops whose math changes (low, high): for
# GEMMs the fit's residuals on the speedup (``calibration.band``), for convolutions cuDNN's per-shape variability,
# set to cover every conv timing at hand: published A100 transposed convs gain 1.9-2.5x what their implicit GEMMs
# predict (BytedTsinghua-SIA/CUDA-Agent#16, KernelBench level 1: 9.62x, 9.05x, 6.85x), and on an H200
# (docs/gpu-results.md) ResNet-50's convs gain 0.41x to 2.4x of it (cuDNN's TF32 flag: 1.2x to 7.0x).
GEMM_BAND = (0.86, 1.16)
# Per target, the share of the datasheet bandwidth memory-bound ops reach, where measured rows fit it (else
# MEMORY_EFFICIENCY): the H200's, with HOST_SECONDS, on this project's whole-model rows (benchmarks/predict.py
# --gpu-data). 0.95 is the top of the fit's grid: the rows barely constrain it (host cost and GEMMs dominate them),
# and the counted bytes overstate what cached reads cost.
MEMORY_EFFICIENCIES: dict[str, float] = {"h200": 0.95}
CONV_BAND = (0.40, 2.50)


def memory_efficiency(target: str) -> float:
    """The share of ``target``'s datasheet bandwidth a streaming kernel reaches (``MEMORY_EFFICIENCY`` unless
    fitted for the target).

    >>> memory_efficiency("a100") <= 1.0
    True
    """
    return MEMORY_EFFICIENCIES.get(target, MEMORY_EFFICIENCY)


def math_kind(math: str) -> str:
    """``"simt"`` for IEEE float32, ``"tensor"`` for every math on tensor cores.

    >>> math_kind("ieee"), math_kind("tf32-rne"), math_kind("bf16x3")
    ('simt', 'tensor', 'tensor')
    """
    return "simt" if math.split("-")[0] == "ieee" else "tensor"


def gemm_fit(target: str, math: str) -> GemmFit:
    """The :class:`GemmFit` of ``math`` on ``target``: its fit where published timings exist, else
    ``GEMM_EFFICIENCY`` for both maths and no wave cost (unfitted: the datasheet ratio).

    >>> gemm_fit("a100", "ieee").efficiency > gemm_fit("a100", "tf32-rna").efficiency
    True
    >>> gemm_fit("rtx3090", "ieee") == gemm_fit("rtx3090", "tf32-rna")
    True
    """
    fits = GEMM_FITS.get(target)
    if fits is None:
        return GemmFit(GEMM_EFFICIENCY, 0.0)
    return fits[math_kind(math)]


@dataclass(frozen=True)
class Peaks:
    """One GPU: dense TFLOP/s per math without sparsity, bandwidth in GB/s, and its streaming multiprocessors."""

    target: str
    fp32: float  # SIMT, no tensor cores (IEEE)
    tf32: Optional[float]  # tensor cores; None before Ampere
    bf16: Optional[float]
    bandwidth: float  # GB/s
    sms: int
    source: str

    def flops(self, math: str) -> float:
        """FLOP/s of ``math`` (``ieee``, ``tf32-rna``, ``bf16-rne``, ``tf32x3``, ``bf16x3``, ``bfx9``) at its peak."""
        name = math.split("-")[0]
        if name == "ieee":
            return self.fp32 * 1e12
        base = {"tf32": self.tf32, "tf32x3": self.tf32, "bf16": self.bf16, "bf16x3": self.bf16,
                "bfx9": self.bf16}.get(name)
        if base is None:  # a math this GPU lacks never reaches it (targets gives IEEE there): say so, loudly
            raise Tf32LabError(f"target {self.target!r} has no {name} units")
        return base * 1e12 / {"x3": 3, "x9": 9}.get(name[-2:], 1)


DATASHEET = "NVIDIA datasheet"
SMS = "SM count: NVIDIA architecture whitepaper"
