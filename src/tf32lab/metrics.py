"""Error of an output against its reference: the numbers a report shows, each defined once.

All are computed in float64 from the output ``y`` and the reference ``r`` (same shape):

- ``max_abs``: max |y − r|;
- ``max_rel`` / ``mean_rel``: |y − r| / |r| over the elements whose |r| is at least ``REL_FLOOR`` × max |r|
  (relative error of a reference that is zero, or nearly, says nothing);
- ``normwise``: ‖y − r‖₂ / ‖r‖₂ over the whole output, the number verdicts use (:data:`DEFAULT_TOLERANCE`);
- ``cosine``: the smallest cosine similarity of a row (the last dimension) with its reference row;
- ``top1``: for outputs named like logits, the fraction of rows whose argmax agrees;
- ``histogram``: counts of |y − r| / rms(r) in decades (:data:`HISTOGRAM_EDGES`).

Example:

    >>> import torch
    >>> from tf32lab import metrics
    >>> r = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    >>> e = metrics.output_error("logits", r + 1e-3, r)
    >>> round(e.max_abs, 6), round(e.max_rel, 6), e.top1
    (0.001, 0.001, 1.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["DEFAULT_TOLERANCE", "HISTOGRAM_EDGES", "OutputError", "normwise", "output_error"]

# The default verdict: normwise relative error at most 1e-2, i.e. the output keeps two significant digits as a
# whole. A well-conditioned network stays well below it at every reduced level (TF32's unit roundoff is
# 2^-11 ≈ 4.9e-4, bf16's 2^-8 ≈ 3.9e-3; all-MiniLM-L6-v2 measures 5.5e-4 under TF32 and 4.7e-3 under bf16);
# a computation that amplifies rounding (a rotation undone step by step, a one-pass covariance) goes past it.
# Past 1e-2, embeddings lose more than ~5e-5 of cosine similarity and close logits change order.
DEFAULT_TOLERANCE = 1e-2
REL_FLOOR = 1e-6
# decades of |y - r| / rms(r), from 1e-10 to 1e+1; errors below the first edge (zeros included) count in bin 0
HISTOGRAM_EDGES = tuple(float(e) for e in range(-10, 2))


@dataclass(frozen=True)
class OutputError:
    """One output's error against its reference. ``passed`` compares ``normwise`` with ``tolerance``."""

    name: str
    shape: tuple[int, ...]
    max_abs: float
    max_rel: float
    mean_rel: float
    normwise: float
    cosine: float
    top1: Optional[float]
    histogram: tuple[int, ...]
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.normwise <= self.tolerance  # NaN compares False: a NaN error fails

    def verdict(self, level: Optional[str] = None) -> str:
        """A line to grep: ``PASSED | level 'high' | output 'x' | normwise 1.2e-04 <= 1.0e-02``."""
        word, sign = ("PASSED", "<=") if self.passed else ("FAILED", ">")
        where = "" if level is None else f" | level {level!r}"
        return f"{word}{where} | output {self.name!r} | normwise {self.normwise:.2e} {sign} {self.tolerance:.1e}"


def normwise(y: torch.Tensor, r: torch.Tensor) -> float:
    """‖y − r‖ / ‖r‖ in float64; 0 when both are zero, inf when only the reference is."""
    diff = float(torch.linalg.vector_norm(y.double() - r.double()))
    ref = float(torch.linalg.vector_norm(r.double()))
    if ref == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / ref


def output_error(name: str, y: torch.Tensor, r: torch.Tensor, tolerance: float = DEFAULT_TOLERANCE) -> OutputError:
    """The metrics of the module docstring for output ``name``."""
    if y.shape != r.shape:
        raise ValueError(f"output {name!r} has shape {tuple(y.shape)}, its reference {tuple(r.shape)}")
    y64, r64 = y.detach().double(), r.detach().double()
    diff = (y64 - r64).abs()
    ref_abs = r64.abs()
    if y64.numel() == 0:
        return OutputError(name, tuple(y.shape), 0.0, 0.0, 0.0, 0.0, 1.0, None, (0,) * len(HISTOGRAM_EDGES), tolerance)
    big = ref_abs >= REL_FLOOR * ref_abs.max()
    rel = diff[big] / ref_abs[big]
    max_rel = float(rel.max()) if rel.numel() else 0.0
    mean_rel = float(rel.mean()) if rel.numel() else 0.0
    rows_y = y64.reshape(-1, y64.shape[-1]) if y64.dim() else y64.reshape(1, 1)
    rows_r = r64.reshape(-1, r64.shape[-1]) if r64.dim() else r64.reshape(1, 1)
    cosine = float(torch.nn.functional.cosine_similarity(rows_y, rows_r, dim=-1, eps=1e-300).min())
    top1 = None
    if "logit" in name.lower() and y64.dim() >= 1 and y64.shape[-1] > 1:
        top1 = float((rows_y.argmax(-1) == rows_r.argmax(-1)).double().mean())
    return OutputError(name, tuple(y.shape), float(diff.max()), max_rel, mean_rel, normwise(y64, r64), cosine, top1,
                       histogram(diff, r64), tolerance)


def histogram(diff: torch.Tensor, r: torch.Tensor) -> tuple[int, ...]:
    """Counts of ``diff / rms(r)`` per decade: bin i holds [10^e_i, 10^e_(i+1)), the first also everything below,
    the last everything above."""
    rms = float(r.pow(2).mean().sqrt())
    scaled = diff / (rms if rms > 0 else 1.0)
    decade = torch.floor(torch.log10(scaled.clamp_min(1e-300)))
    lo, hi = HISTOGRAM_EDGES[0], HISTOGRAM_EDGES[-1]
    index = (decade.clamp(lo, hi) - lo).long().flatten()
    index[torch.isnan(scaled.flatten())] = len(HISTOGRAM_EDGES) - 1  # NaN errors count as the largest
    return tuple(int(c) for c in torch.bincount(index, minlength=len(HISTOGRAM_EDGES)))
