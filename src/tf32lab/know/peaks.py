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

__all__ = ["DATASHEET", "GEMM_EFFICIENCY", "LAUNCH_SECONDS", "MEMORY_EFFICIENCY", "SMS", "Peaks"]

# The PyTorch CUDA notes' 10240^3 float32 matmul on an A100 (0.11 s IEEE, 0.016 s TF32) implies cuBLAS at ~100% of
# the FP32 peak and ~86% of the TF32 peak: one efficiency for a large GEMM, their midpoint, so that
# GeForce cards (TF32 peak = FP32 peak) get the speedup their peaks say, 1.0.
GEMM_EFFICIENCY = 0.93
# A streaming kernel reaches ~85% of HBM/GDDR peak (STREAM-like copies on A100/H100); verify on GPU.
MEMORY_EFFICIENCY = 0.85
# Eager PyTorch: the host's dispatch plus the launch, per kernel; verify on GPU.
LAUNCH_SECONDS = 5e-6


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
