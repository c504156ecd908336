"""Reference results for emulated ops: operands rounded explicitly, products and sums in float64.

Independent of ``tf32lab.emulation.emulator`` and ``tf32lab.emulation.rules``: only ``formats`` (checked against an
integer reference over all 2^32 patterns) is shared.
"""

from __future__ import annotations

from typing import Callable

import torch

import tf32lab
from tf32lab.numbers import formats

U32 = 2.0**-24  # float32 unit roundoff


def randn(*shape, seed=0) -> torch.Tensor:
    """A standard normal tensor from its own seeded generator (the global stream untouched)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def emulated(fn, *args, target="a100", level="high", **options):
    """``fn(*args)`` at ``level`` as ``target`` computes it, and the emulator (its coverage, unhandled ops)."""
    with tf32lab.precision(level), tf32lab.emulate(target, **options) as emu:
        out = fn(*args)
    return out, emu


def rounded(t: torch.Tensor, math: str) -> list[tuple[torch.Tensor, int]]:
    """``t`` as a sum of parts: [(part, group)], group 0 = big/hi, 1 = small/lo (bfx9: 1 = mid, 2 = lo)."""
    if math == "ieee":
        return [(t, 0)]
    if math == "tf32":
        return [(formats.round_tf32(t), 0)]
    if math == "bf16":
        return [(formats.round_bf16(t), 0)]
    if math == "bfx9":
        return [(part, group) for group, part in enumerate(formats.split_bf16x9(t))]
    big, small = formats.split_tf32x3(t) if math == "tf32x3" else formats.split_bf16x3(t)
    return [(big, 0), (small, 1)]


def bilinear(f: Callable, a: torch.Tensor, b: torch.Tensor, math: str) -> torch.Tensor:
    """f(a, b) in float64 for bilinear ``f`` under ``math``; x3 maths keep big·big + big·small + small·big, bfx9
    all nine products of its parts."""
    total = None
    for pa, ga in rounded(a, math):
        for pb, gb in rounded(b, math):
            if ga and gb and math != "bfx9":
                continue  # small·small is what the x3 maths drop
            term = f(pa.double(), pb.double())
            total = term if total is None else total + term
    return total


def bound(f: Callable, a: torch.Tensor, b: torch.Tensor, k: int, term=None) -> torch.Tensor:
    """Elementwise float32 accumulation error of a K-term f(a, b) (+ a term added in float32).

    The probabilistic bound (4·sqrt(K) + 8)·u·f(|a|, |b|), not the worst case K·u·f(|a|, |b|): blocked GEMMs
    accumulate in short chains, and the worst case would hide TF32's own error (sqrt(K)·2^-11) for large K.
    """
    tol = (4 * k**0.5 + 8) * U32 * f(a.abs().double(), b.abs().double()) + 1e-30
    return tol if term is None else tol + 4 * U32 * term.abs().double()


def check(emulated: torch.Tensor, ieee: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor, *,
          flips: float = 0.0, math: str = "tf32") -> None:
    """The emulated result is the reference within ``tol`` (up to a ``flips`` share of elements one rounding
    apart, for fused ops whose intermediates the reference recomputes), and the IEEE result is not."""
    emulated, ieee = emulated.double(), ieee.double()
    bad = (emulated - ref).abs() > tol
    assert bad.double().mean().item() <= flips, (
        f"{bad.sum().item()} of {bad.numel()} elements beyond tolerance; worst "
        f"{((emulated - ref).abs() / tol).max().item():.3g}x")
    if math in ("tf32", "bf16"):
        far = ((ieee - ref).abs() > tol).double().mean().item()
        assert far >= 0.2, f"IEEE float32 also matches the reference ({far:.0%} beyond): the test cannot tell"
    else:
        assert not torch.equal(emulated, ieee), "the split math gave the IEEE result bit for bit"
