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

__all__ = ["AMPERE", "BLACKWELL", "CDNA3_XF32", "FMA", "HOPPER", "KINDS", "MAX_CHUNK", "MAX_FRACTION_BITS",
           "Accumulation"]

KINDS = ("nvidia", "amd", "fma")
# The sums are exact in float64 within these (terms below 2^(bits + 2), at most MAX_CHUNK + 1 of them, under 2^53)
# and the tensor code's products held at once stay near its block; real units use 23 to 25 bits, chunks of 4 to 8.
MAX_FRACTION_BITS, MAX_CHUNK = 30, 256


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
        if not _whole(self.chunk) or not 1 <= self.chunk <= MAX_CHUNK or (self.kind == "fma" and self.chunk != 1):
            raise ValueError(f"accumulation chunk must be a whole number 1 to {MAX_CHUNK} (1 for 'fma'), got "
                             f"{self.chunk!r}")
        if not _whole(self.fraction_bits) or not 0 <= self.fraction_bits <= MAX_FRACTION_BITS:
            raise ValueError(f"accumulation fraction_bits must be a whole number 0 to {MAX_FRACTION_BITS}, got "
                             f"{self.fraction_bits!r}")

    def __str__(self) -> str:
        return "fma" if self.kind == "fma" else f"{self.kind} k{self.chunk} f{self.fraction_bits}"


def _whole(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


_MMASIM = "MMA-Sim (arXiv:2511.10909, github microsoft/MMA-Sim)"
AMPERE = Accumulation("nvidia", 4, 24, f"{_MMASIM}: Ampere/Ada TF32 m16n8k8 = two fused steps of 4, 24 bits, RZ")
HOPPER = Accumulation("nvidia", 8, 25, f"{_MMASIM}: Hopper TF32 wgmma k8, one fused step of 8, 25 bits, RZ")
BLACKWELL = Accumulation("nvidia", 8, 25, f"{_MMASIM}: Blackwell TF32 tcgen05.mma k8, one fused step, 25 bits, RZ")
CDNA3_XF32 = Accumulation("amd", 4, 24, f"{_MMASIM}: CDNA3 v_mfma_f32_*_xf32, groups of 4, 24 bits, RD, RNE out")
FMA = Accumulation("fma", 1, 23, "IEEE float32 FMA per product, in K order (an SGEMM thread's loop)")
