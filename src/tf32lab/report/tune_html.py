"""A tuning as one self-contained HTML page: the answer, the search (every candidate, its error against its
predicted speedup, the chosen one marked), then the check of the uniform levels it started from.

Autoescaped like the check report (``report/html.py``): layer names from the model are text.
"""

from __future__ import annotations

import math
from typing import Any

from tf32lab.report import html

# A ``tf32lab.decide.tune.Tuning``: that layer sits above this one (it calls this renderer), so it is named, not
# imported, not even for type checking.
Tuning = Any

PLOT_W, PLOT_H = 560, 260


def _decades(ratios: list[float]) -> tuple[int, int]:
    """The y axis, in decades of worst error / tolerance: the data's range, the tolerance line (1) always in it,
    at least one decade either side of it (a search whose candidates all sit near 1 gets 1e-1..1e1, not 1e-4..1e3);
    a candidate that failed outright (inf) is drawn at the top."""
    finite = [r for r in ratios if math.isfinite(r) and r > 0]
    lo = math.floor(math.log10(min([*finite, 0.1])))
    hi = math.ceil(math.log10(max([*finite, 10.0])))
    return max(lo, -12), min(hi, 12)


def scatter(tuning: Tuning) -> dict[str, Any]:
    """Geometry of the search plot: x predicted speedup over highest, y worst error over tolerance (log)."""
    top = max([c.speedup for c in tuning.candidates] + [1.0]) * 1.05
    lo, hi = _decades([c.worst_ratio for c in tuning.candidates])

    def x(speedup: float) -> float:
        return 50 + (PLOT_W - 70) * (speedup - 1.0 + 0.05) / (top - 1.0 + 0.1)

    def y(ratio: float) -> float:
        if not math.isfinite(ratio) or ratio >= 10.0**hi:
            return 10.0
        value = math.log10(max(ratio, 10.0**lo))
        return 10 + (PLOT_H - 20) * (hi - value) / (hi - lo)

    points = [{"x": x(c.speedup), "y": y(c.worst_ratio), "passed": c.passed,
               "chosen": tuning.policy is not None and c.policy == tuning.policy and c.passed,
               "title": f"{c.why}: " + (f"raised {c.error.splitlines()[0]}" if c.error is not None else
                                         f"worst/tolerance {c.worst_ratio:.2g}") + f", predicted {c.speedup:.2f}x"}
              for c in tuning.candidates]
    step = max(1, (hi - lo + 7) // 8)  # at most about eight labels
    yticks = [{"y": y(10.0**e), "label": f"1e{e}"} for e in range(lo, hi + 1, step)]
    xticks = [{"x": x(v), "label": f"{v:g}x"} for v in sorted({1.0, round(top / 1.05, 1), round((1 + top) / 2, 1)})]
    return {"w": PLOT_W, "h": PLOT_H, "points": points, "yticks": yticks, "xticks": xticks, "tol_y": y(1.0),
            "decades": (lo, hi)}


def render(tuning: Tuning) -> str:
    levels = ", ".join(f"`{lv.level}` {'passes' if lv.passed else 'fails'}" for lv in tuning.report.levels)
    context = f"the uniform levels the search started from ({levels}); the verdict is the search's, above"
    return html.TEMPLATES.get_template("tune.html.j2").render(
        tuning=tuning, plot=scatter(tuning), check=html.render(tuning.report, fragment=True, context=context))
