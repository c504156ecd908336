"""Tolerances derived from the math, not guessed: how far a product ``a @ b`` can be off under a level on a target.

Under a math whose operands are rounded with unit roundoff ``u`` (TF32: 2^-11, bf16: 2^-8; IEEE float32:
2^-24), each term a_ik·b_kj of a K-long dot product is off by up to 2u·|a_ik|·|b_kj|, and the K errors, of random
sign, add up to about sqrt(K) times one of them. So element (i, j) of the product gets

    tolerance_ij = factor · sqrt(K) · (2u + 2^-24) · max_k |a_ik| · max_k |b_kj|

(FACTS.md §5 and §13: the E8M10 floor sqrt(K)·2^-10·|A|·|B| for TF32; 2^-24 is float32's own accumulation).
``factor`` (default 4) covers the spread of that sum over many elements. The math comes from the target's table
at the level (``emulate(target)`` would use the same), so ``level="highest"`` on an A100 gives float32's
tolerance, and ``high`` TF32's.

Example:

    >>> import torch, tf32lab
    >>> from tf32lab.testing import assert_close, tolerance
    >>> a, b = torch.randn(64, 512), torch.randn(512, 32)
    >>> with tf32lab.precision("high"), tf32lab.emulate("a100"):
    ...     y = a @ b
    >>> exact = (a.double() @ b.double()).float()
    >>> bool((y - exact).abs().max() < tolerance(a, b, level="high").min())
    True
    >>> assert_close(y, exact, operands=(a, b), level="high")              # passes
    >>> assert_close(y, exact, operands=(a, b), level="highest")           # float32's tolerance: too tight
    Traceback (most recent call last):
    ...
    AssertionError: ... elements exceed the tolerance of a 512-long product at 'highest' on a100 (ieee)...
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .errors import Tf32LabError
from .levels import check_level

__all__ = ["UNIT_ROUNDOFF", "assert_close", "tolerance", "unit_roundoff"]

UNIT_ROUNDOFF = {"ieee": 2.0**-24, "tf32": 2.0**-11, "bf16": 2.0**-8, "tf32x3": 2.0**-21, "bf16x3": 2.0**-16}
FLOAT32 = 2.0**-24


def unit_roundoff(level: str = "high", target: str = "a100") -> tuple[float, str]:
    """The operands' unit roundoff of a float32 matmul at ``level`` on ``target``, and the math's name."""
    from .emulator import maths
    from .scope import precision

    check_level(level)
    with precision(level):
        name = maths(target)["matmul"]
    return UNIT_ROUNDOFF[name.split("-")[0]], name


def tolerance(a: torch.Tensor, b: torch.Tensor, *, level: str = "high", target: str = "a100",
              factor: float = 4.0) -> torch.Tensor:
    """Per element of ``a @ b`` (broadcast over batch dimensions): how far it may be off (module docstring)."""
    if a.dim() < 1 or b.dim() < 1 or a.shape[-1] != b.shape[-2 if b.dim() > 1 else 0]:
        raise Tf32LabError(f"tolerance(a, b): shapes {tuple(a.shape)} and {tuple(b.shape)} do not multiply")
    u, _ = unit_roundoff(level, target)
    k = a.shape[-1]
    rows = a.detach().abs().amax(dim=-1, keepdim=True).double()  # (..., M, 1)
    cols = b.detach().abs().amax(dim=-2 if b.dim() > 1 else 0, keepdim=True).double()  # (..., 1, N)
    bound = factor * math.sqrt(k) * (2 * u + FLOAT32) * rows * cols
    return bound.to(torch.promote_types(a.dtype, torch.float32)) if a.dim() > 1 and b.dim() > 1 else bound


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, operands: tuple[torch.Tensor, torch.Tensor],
                 level: str = "high", target: str = "a100", factor: float = 4.0, msg: Optional[str] = None) -> None:
    """Assert ``|actual - expected| <= tolerance(*operands)`` elementwise: ``actual`` computes the product of
    ``operands`` (and perhaps cheap elementwise work after it) at ``level`` on ``target``."""
    bound = tolerance(*operands, level=level, target=target, factor=factor)
    diff = (actual.detach().double() - expected.detach().double()).abs()
    try:
        bound = torch.broadcast_to(bound.double(), diff.shape)
    except RuntimeError:
        raise Tf32LabError(f"assert_close: the product of the operands has shape "
                           f"{tuple(torch.broadcast_shapes(bound.shape))}, the values {tuple(diff.shape)}") from None
    bad = diff > bound
    if bool(bad.any()) or bool(torch.isnan(diff).any()):
        _, name = unit_roundoff(level, target)
        worst = int(torch.argmax(torch.where(torch.isnan(diff), torch.inf, diff / bound.clamp_min(1e-300))))
        off, allowed = float(diff.flatten()[worst]), float(bound.flatten()[worst])
        detail = (f"{int(bad.sum())} of {diff.numel()} elements exceed the tolerance of a "
                  f"{operands[0].shape[-1]}-long product at {level!r} on {target} ({name}); the worst, at flat "
                  f"index {worst}, is off by {off:.3g} against {allowed:.3g}")
        raise AssertionError(f"{msg}: {detail}" if msg else detail)
