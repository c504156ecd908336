"""What each GPU target can do per second: dense peaks per math, memory bandwidth, SMs (NVIDIA datasheets).

The speed model (``tf32lab.speed.predict``) divides work by these. Each row names its source; ``verify on GPU`` marks an
assumption not yet measured on the device. CPU targets have no row: their speed is measured (``tf32lab.bench``),
not predicted.

Example:

    >>> from tf32lab.know import peaks
    >>> a100 = peaks.get("a100")
    >>> a100.flops("ieee") / 1e12, a100.flops("tf32-rna") / 1e12, a100.flops("tf32x3") / 1e12
    (19.5, 156.0, 52.0)
    >>> peaks.get("rtx3090").flops("tf32-rna") == peaks.get("rtx3090").flops("ieee")   # GeForce: TF32 = FP32
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Optional

from tf32lab.errors import Tf32LabError

__all__ = ["GEMM_EFFICIENCY", "LAUNCH_SECONDS", "MEMORY_EFFICIENCY", "PEAKS", "Peaks", "get"]

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


_DATASHEET = "NVIDIA datasheet"
_SMS = "SM count: NVIDIA architecture whitepaper"

PEAKS: Mapping[str, Peaks] = MappingProxyType({p.target: p for p in (
    Peaks("v100", 15.7, None, None, 900, 80, f"V100 SXM2: {_DATASHEET}; {_SMS} (GV100)"),
    Peaks("t4", 8.1, None, None, 320, 40, f"{_DATASHEET}; {_SMS} (TU104)"),
    Peaks("a100", 19.5, 156, 312, 1555, 108, f"A100 40GB SXM: {_DATASHEET} (80GB: 2039 GB/s); {_SMS} (GA100)"),
    Peaks("a10g", 31.2, 62.5, 125, 600, 80, "A10's figures, unverified for the A10G (not in NVIDIA's "
                                            "datasheets); 80 SMs per AWS, unverified"),
    Peaks("rtx3090", 35.6, 35.6, 71, 936, 82, "GA102 whitepaper: GeForce TF32 dense peak = FP32 peak; 82 SMs"),
    Peaks("l4", 30.3, 60, 121, 300, 58, f"{_DATASHEET}, sparse figures halved; {_SMS} (AD104)"),
    Peaks("rtx4090", 82.6, 82.6, 165, 1008, 128, "AD102 whitepaper, GeForce rule (TF32 dense peak = FP32 peak); "
                                                 "128 SMs"),
    Peaks("h100", 67, 495, 989, 3350, 132, f"H100 SXM: {_DATASHEET}; {_SMS} (GH100 SXM5)"),
    Peaks("h200", 67, 495, 989, 4800, 132, f"{_DATASHEET}; {_SMS} (GH100 SXM5)"),
    Peaks("b200", 75, 1125, 2250, 8000, 148, "NVIDIA HGX B200 datasheet: the 8-GPU figures divided by 8, sparse "
                                             "figures halved; 148 SMs, unverified"),
)})


def get(target: str) -> Peaks:
    """The peaks of ``target``; a CPU target or an unknown one is a one-line error.

    >>> get("cpu-amx")
    Traceback (most recent call last):
    ...
    tf32lab.errors.Tf32LabError: no speed model for target 'cpu-amx': predictions cover GPU targets ('v100', ...
    """
    name = getattr(target, "name", target)
    found = PEAKS.get(name)
    if found is None:
        raise Tf32LabError(f"no speed model for target {name!r}: predictions cover GPU targets "
                           f"({', '.join(map(repr, PEAKS))}); on a CPU, measure with tf32lab.bench")
    return found
