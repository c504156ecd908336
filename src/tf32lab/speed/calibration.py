"""Fitting the speed model's GEMM constants to published timings, and its residuals.

:func:`fit` finds, per target and kind of math (``peaks.math_kind``), the :class:`~tf32lab.know.peaks.GemmFit`
(efficiency, cost per wave) that minimizes the squared log error of the predicted times of the ``"fit"`` rows of
``tf32lab.speed.published.ROWS`` that give times; a grid search, to the precision ``peaks.GEMM_FITS`` is written
in (efficiency 0.01, wave 0.5 µs). A target with a single fitted size gets no wave cost (one time cannot tell
the two apart). ``peaks.GEMM_FITS`` holds the result; ``benchmarks/predict.py`` prints it and every row.

Example:

    >>> from tf32lab.speed.calibration import fit
    >>> fits = fit()
    >>> fits["a100"]["tensor"].efficiency < fits["a100"]["simt"].efficiency   # tensor cores reach less of their peak
    True
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Optional

from tf32lab.know import targets
from tf32lab.know.peaks import LAUNCH_SECONDS, MEMORY_EFFICIENCY, GemmFit, math_kind
from tf32lab.speed.published import ROWS, Published

__all__ = ["MATHS", "band", "fit", "gemm_prediction", "speedup_residuals"]

# the math each target's ``high`` gives a float32 matmul (TF32, rounded as its cuBLAS does): what was timed
MATHS = {"a100": "tf32-rna", "h100": "tf32-rne", "h200": "tf32-rne"}
_EFFICIENCIES = [round(0.30 + 0.01 * i, 2) for i in range(81)]  # 0.30 .. 1.10
_WAVES = [0.5e-6 * i for i in range(61)]  # 0 .. 30 µs


def _tf32(target: str) -> str:
    return MATHS.get(target, "tf32-rna")


def gemm_prediction(row: Published, math_name: str, gemm_fit: Optional[GemmFit] = None) -> float:
    """The predicted seconds of ``row``'s product (one kernel, its launch included) in ``math_name``."""
    from tf32lab.speed.prediction import gemm_seconds  # speed's model: imported where used (it imports this layer)

    m, n, k = row.shape
    p = targets.get(row.target).speed_peaks()
    memory = 4.0 * (m * k + k * n + m * n) / (p.bandwidth * 1e9 * MEMORY_EFFICIENCY)  # float32 operands and result
    compute = gemm_seconds((1, 1, m, n, k), math_name, p, gemm_fit, fallback=gemm_fit is None)
    return max(compute, memory) + LAUNCH_SECONDS + row.harness


def fit(rows: Iterable[Published] = ROWS) -> dict[str, dict[str, GemmFit]]:
    """Per target with fit rows, per kind of math, the :class:`GemmFit` that best predicts their times."""
    timed = [r for r in rows if r.role == "fit" and r.kind == "gemm" and r.seconds is not None]
    result: dict[str, dict[str, GemmFit]] = {}
    for target in sorted({r.target for r in timed}):
        mine = [r for r in timed if r.target == target]
        several = len({r.shape for r in mine}) > 1
        result[target] = {}
        for index, math_name in enumerate(("ieee", _tf32(target))):
            best, best_error = GemmFit(1.0, 0.0), math.inf
            for wave in _WAVES if several else [0.0]:
                for efficiency in _EFFICIENCIES:
                    candidate = GemmFit(efficiency, wave)
                    error = sum(math.log(gemm_prediction(r, math_name, candidate) / r.seconds[index]) ** 2
                                for r in mine)
                    if error < best_error - 1e-15:
                        best, best_error = candidate, error
            result[target][math_kind(math_name)] = best
    return result


def speedup_residuals(rows: Iterable[Published] = ROWS, role: str = "fit") -> list[float]:
    """published / predicted speedup of the GEMM rows of ``role`` (with the fit in ``peaks.GEMM_FITS``)."""
    out = []
    for r in rows:
        if r.kind == "gemm" and r.role == role:
            predicted = gemm_prediction(r, "ieee") / gemm_prediction(r, _tf32(r.target))
            out.append(r.speedup / predicted)
    return out


def band(rows: Iterable[Published] = ROWS) -> tuple[float, float]:
    """``peaks.GEMM_BAND``: the smallest and largest published / predicted speedup of the fit rows, to 0.01."""
    residuals = speedup_residuals(rows)
    return math.floor(min(residuals) * 100) / 100, math.ceil(max(residuals) * 100) / 100
