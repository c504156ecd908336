"""A tuning as one self-contained HTML page: the answer, the search (every candidate, its error against its
predicted speedup, the chosen one marked), then the check of the uniform levels it started from.

Autoescaped like the check report (``report/html.py``): layer names from the model are text.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from .html import _env
from .html import render as render_report

if TYPE_CHECKING:
    from ..tuning import Tuning

PLOT_W, PLOT_H = 560, 260
RATIO_LO, RATIO_HI = -4.0, 3.0  # the y axis: worst error / tolerance, in decades


def _y(ratio: float) -> float:
    if not math.isfinite(ratio) or ratio >= 10**RATIO_HI:
        return 10.0
    value = math.log10(max(ratio, 10**RATIO_LO))
    return 10 + (PLOT_H - 20) * (RATIO_HI - value) / (RATIO_HI - RATIO_LO)


def scatter(tuning: Tuning) -> dict[str, Any]:
    """Geometry of the search plot: x predicted speedup over highest, y worst error over tolerance (log)."""
    top = max([c.speedup for c in tuning.candidates] + [1.0]) * 1.05

    def x(speedup: float) -> float:
        return 50 + (PLOT_W - 70) * (speedup - 1.0 + 0.05) / (top - 1.0 + 0.1)

    points = [{"x": x(c.speedup), "y": _y(c.worst_ratio), "passed": c.passed,
               "chosen": tuning.policy is not None and c.policy == tuning.policy and c.passed,
               "title": f"{c.why}: worst/tolerance {c.worst_ratio:.2g}, predicted {c.speedup:.2f}x"}
              for c in tuning.candidates]
    yticks = [{"y": _y(10.0**e), "label": f"1e{e}"} for e in range(int(RATIO_LO), int(RATIO_HI) + 1)]
    xticks = [{"x": x(v), "label": f"{v:g}x"} for v in sorted({1.0, round(top / 1.05, 1), round((1 + top) / 2, 1)})]
    return {"w": PLOT_W, "h": PLOT_H, "points": points, "yticks": yticks, "xticks": xticks, "tol_y": _y(1.0)}


def render(tuning: Tuning) -> str:
    return _env.get_template("tune.html.j2").render(
        tuning=tuning, plot=scatter(tuning), check=render_report(tuning.report, fragment=True))
