"""Ask the machine itself what each level does to a float32 matmul: the kernel's answer, not the table's.

``tf32lab.know.targets`` says what a level *should* give on a device; a CPU's oneDNN build, a driver or an environment
variable can say otherwise. :func:`probe_matmul` runs one small float32 product per level on the device and
classifies it by where its result lies:

- ``same-as-highest``: bit for bit the product computed at ``highest``;
- ``ieee``: other bits (another float32 kernel, e.g. another blocking or accumulation order) but an error against
  float64 of float32 size;
- ``tf32-rna``, ``tf32-rne``, ``tf32-rz`` or ``bf16-rne``: the result sits on the exact product of operands rounded
  that way (half the probe's elements are exact TF32 ties, so the three TF32 roundings tell apart).

On an AMD EPYC with AVX512-BF16 and no AMX, for example, ``medium`` makes oneDNN pick another float32 kernel
(``ieee``: the bits change, the error stays at float32 size), while on a CPU with AMX it is a bf16 product
(PyTorch's ``torch.backends.mkldnn.matmul.fp32_precision``, https://pytorch.org/docs/stable/notes/numerical_accuracy.html).

Example:

    >>> from tf32lab.machine.probe import probe_matmul
    >>> found = probe_matmul("cpu")
    >>> found["highest"].math
    'same-as-highest'
    >>> found["medium"].math in ("same-as-highest", "ieee", "tf32-rna", "tf32-rne", "tf32-rz", "bf16-rne")
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tf32lab.know.levels import LEVELS
from tf32lab.numbers.formats import round_bf16, round_tf32

__all__ = ["SHAPE", "ProbeResult", "probe_matmul"]

# Large enough in k that operand rounding (2^-9 for bf16, 2^-11 for TF32) dwarfs float32 accumulation error
# (about sqrt(k) * 2^-24) by orders of magnitude, small enough to cost well under a millisecond on a CPU.
SHAPE = (32, 512, 32)
# A result this many times closer to a rounded-operand product than to float64 was computed from rounded operands.
_MARGIN = 16.0


@dataclass(frozen=True)
class ProbeResult:
    """What one level gave: ``math`` (see the module doc), ``error`` (max abs error against float64, relative
    to the largest entry) and ``same_bits`` (identical to the ``highest`` result)."""

    math: str
    error: float
    same_bits: bool

    def to_dict(self) -> dict[str, Any]:
        return {"math": self.math, "error": self.error, "same_bits": self.same_bits}


_ROUNDED = ("tf32-rna", "tf32-rne", "tf32-rz", "bf16-rne")


def _classify(out: torch.Tensor, highest: torch.Tensor, exact: dict[str, torch.Tensor], scale: float) -> ProbeResult:
    wide = out.double()
    error = float((wide - exact["float64"]).abs().max()) / scale
    if torch.equal(out, highest):
        return ProbeResult("same-as-highest", error, True)
    distance = {math: float((wide - exact[math]).abs().max()) / scale for math in _ROUNDED}
    nearest = min(distance, key=distance.__getitem__)
    if distance[nearest] * _MARGIN < error:
        return ProbeResult(nearest, error, False)
    return ProbeResult("ieee", error, False)


def _operands(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded normal matrices in which half the elements are exact TF32 ties (low 13 bits 0x1000), so that the
    three TF32 roundings give clearly different products (on plain random data they differ in a few elements)."""
    m, k, n = SHAPE
    out = []
    for shape in ((m, k), (k, n)):
        x = torch.randn(shape, generator=gen)
        bits = x.view(torch.int32)
        tie = torch.rand(shape, generator=gen) < 0.5
        bits[tie] = (bits[tie] & ~0x1FFF) | 0x1000
        out.append(x)
    return out[0], out[1]


def probe_matmul(device: str = "cpu") -> dict[str, ProbeResult]:
    """Run one float32 ``SHAPE`` product per level on ``device`` and say what each level computed.

    Levels are entered with :class:`tf32lab.precision`, so every PyTorch flag is as it was afterwards. The inputs
    come from a fixed seed of a private generator: the global random stream is not touched.
    """
    from tf32lab.control.scope import precision

    a, b = _operands(torch.Generator().manual_seed(20261125))
    exact = {"float64": a.double() @ b.double(), "bf16-rne": round_bf16(a).double() @ round_bf16(b).double()}
    for rounding in ("rna", "rne", "rz"):
        exact[f"tf32-{rounding}"] = round_tf32(a, rounding).double() @ round_tf32(b, rounding).double()
    scale = float(exact["float64"].abs().max())
    da, db = a.to(device), b.to(device)
    outs = {}
    for level in LEVELS:
        with precision(level):
            outs[level] = (da @ db).cpu()
    return {level: _classify(out, outs["highest"], exact, scale) for level, out in outs.items()}
