"""The accumulation models as data: what :mod:`tf32lab.numbers.accumulation` computes, per matrix unit.

No torch here: the target table (``tf32lab.know.targets``) names these, and the CLI lists targets without
importing torch.

Example:

    >>> from tf32lab.numbers.accumulation_models import AMPERE, HOPPER
    >>> str(AMPERE), str(HOPPER)
    ('nvidia k4 f24', 'nvidia k8 f25')
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AMPERE", "BLACKWELL", "CDNA3_XF32", "FMA", "HOPPER", "KINDS", "Accumulation"]

KINDS = ("nvidia", "amd", "fma")


@dataclass(frozen=True)
class Accumulation:
    """One matrix unit's way of summing: ``kind`` in KINDS, products fused per step (``chunk``), the fraction
    bits kept when terms are aligned (``fraction_bits``), and where the figures come from.

    >>> str(AMPERE)
    'nvidia k4 f24'
    """

    kind: str
    chunk: int
    fraction_bits: int
    source: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown accumulation kind {self.kind!r}; accepted: {', '.join(map(repr, KINDS))}")
        if self.chunk < 1 or (self.kind == "fma" and self.chunk != 1):
            raise ValueError(f"accumulation chunk must be >= 1 (1 for 'fma'), got {self.chunk}")

    def __str__(self) -> str:
        return "fma" if self.kind == "fma" else f"{self.kind} k{self.chunk} f{self.fraction_bits}"


_MMASIM = "MMA-Sim (arXiv:2511.10909, github microsoft/MMA-Sim)"
AMPERE = Accumulation("nvidia", 4, 24, f"{_MMASIM}: Ampere/Ada TF32 m16n8k8 = two fused steps of 4, 24 bits, RZ")
HOPPER = Accumulation("nvidia", 8, 25, f"{_MMASIM}: Hopper TF32 wgmma k8, one fused step of 8, 25 bits, RZ")
BLACKWELL = Accumulation("nvidia", 8, 25, f"{_MMASIM}: Blackwell TF32 tcgen05.mma k8, one fused step, 25 bits, RZ")
CDNA3_XF32 = Accumulation("amd", 4, 24, f"{_MMASIM}: CDNA3 v_mfma_f32_*_xf32, groups of 4, 24 bits, RD, RNE out")
FMA = Accumulation("fma", 1, 23, "IEEE float32 FMA per product, in K order (an SGEMM thread's loop)")
