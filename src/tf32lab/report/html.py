"""A report as one self-contained HTML page: tables and SVG plots, inline CSS, no scripts, nothing fetched.

Every name that comes from the model (outputs, layers, module classes, the workload) goes through Jinja2's
autoescaping, so a module named ``<script>…</script>`` shows as text.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import jinja2
import markupsafe

from tf32lab.numbers.metrics import HISTOGRAM_EDGES
from tf32lab.report.cudnn import off_depthwise, on_cpu
from tf32lab.report.text import fmt, notes, ranked_layers, short_name, times
from tf32lab.report.wording import given, tolerance_words

# A ``tf32lab.report.Report``: the package's own module calls this renderer (``Report.to_html()``), so it is
# named, not imported, not even for type checking (tests/test_layers.py: no import circle, TYPE_CHECKING imports
# included).
Report = Any

COLORS = {"highest": "#4c78a8", "high": "#f58518", "medium": "#e45756"}
FLOOR_COLOR = "#555"  # float32 `highest`'s own row, the floor beside the levels
OTHER_COLOR = "#9467bd"  # a level without a color of its own (bfx9)


def row_color(level: str) -> str:
    """The color a row of a chart is drawn in: its level's, the floor's for ``"float32"``.

    >>> row_color("high"), row_color("float32")
    ('#f58518', '#555')
    """
    return FLOOR_COLOR if level == "float32" else COLORS.get(level, OTHER_COLOR)
CHART_LAYERS = 25
LOG_LO, LOG_HI = -10.0, 1.0  # the error axis of the layer chart, in decades

# The page templates (report/templates/), shared by every HTML page tf32lab renders (the check report, tune's page).
TEMPLATES = jinja2.Environment(
    loader=jinja2.PackageLoader("tf32lab", "report/templates"),
    autoescape=True,  # every template, whatever its extension
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
    extensions=["jinja2.ext.do"],
)
TEMPLATES.filters["fmt"] = fmt
TEMPLATES.filters["short"] = short_name
TEMPLATES.filters["given"] = given  # a tolerance in the digits it was given
TEMPLATES.filters["tolerance"] = tolerance_words
TEMPLATES.filters["times"] = times


def with_code(text: str) -> markupsafe.Markup:
    """Plain text (a conclusion) as HTML: escaped, its `backticked` spans set as code.

    >>> str(with_code("Enable it with `x < y`."))
    'Enable it with <code>x &lt; y</code>.'
    """
    parts = str(markupsafe.escape(text)).split("`")
    if len(parts) % 2 == 0:  # an unpaired backtick: shown as it is
        return markupsafe.Markup("`".join(parts))
    return markupsafe.Markup("".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts)))


TEMPLATES.filters["code"] = with_code


def render(report: Report, fragment: bool = False, context: Optional[str] = None) -> str:
    """The page (``fragment``: only its body, for Jupyter). ``context``: the report is part of another result
    (tune's page) and this label replaces its own PASSED/FAILED, which is not that result's verdict."""
    return TEMPLATES.get_template("report.html.j2").render(
        report=report, fragment=fragment, context=context, colors=COLORS, layer_chart=layer_chart(report),
        histograms=histograms(report), data=report.to_dict(), notes=notes(report),
        # on a CPU oneDNN computes the convolutions and RNNs, under its own flags (torch.backends.mkldnn)
        cudnn_cpu=on_cpu(report), cudnn_off_depthwise=off_depthwise(report),
    )


def _x(value: float, width: float) -> float:
    """Position of an error on the log axis (0 and anything below the axis at its start)."""
    if math.isnan(value) or value >= 10**LOG_HI:
        return width
    if value <= 10**LOG_LO:
        return 0.0
    return width * (math.log10(value) - LOG_LO) / (LOG_HI - LOG_LO)


def layer_chart(report: Report) -> dict[str, Any]:
    """Geometry of the per-layer chart: one bar per level for the introduced error, a dot for the accumulated."""
    names = ranked_layers(report)[:CHART_LAYERS]
    label_w, plot_w, bar_h, gap = 280, 520, 7, 8
    group_h = bar_h * len(report.levels) + gap
    rows = []
    for i, name in enumerate(names):
        y0 = 24 + i * group_h
        bars = []
        for j, lv in enumerate(report.levels):
            layer = next((e for e in lv.layers if e.name == name), None)
            if layer is None:
                continue
            # a level whose layers were not rerun (it passed) has no introduced error: no bar, its dot only,
            # in the level's colour (a dark dot on its bar where there is one)
            color = COLORS.get(lv.level, "#888")
            bars.append({
                "y": y0 + j * bar_h, "w": _x(layer.introduced, plot_w) if lv.reruns else 0.0,
                "color": color, "dot": "#222" if lv.reruns else color, "cx": _x(layer.accumulated, plot_w),
                "title": (f"{lv.level}: introduced {fmt(layer.introduced)}, " if lv.reruns else
                          f"{lv.level}: introduced not measured (the level passed), ")
                + f"accumulated {fmt(layer.accumulated)}",
            })
        rows.append({"name": name, "y": y0 + group_h / 2 - gap / 2 + 4, "bars": bars})
    ticks = [{"x": _x(10.0**e, plot_w), "label": f"1e{e}"} for e in range(int(LOG_LO), int(LOG_HI) + 1, 2)]
    return {"rows": rows, "label_w": label_w, "plot_w": plot_w, "bar_h": bar_h - 1, "ticks": ticks,
            "height": 24 + len(names) * group_h + 24, "total": len(ranked_layers(report)),
            "rerun": report.rerun, "rerun_all": all(lv.reruns for lv in report.levels),
            "tolerance_x": _x(report.tolerance["default"], plot_w)}


def histograms(report: Report) -> list[dict[str, Any]]:
    """One chart per output: for each level, the share of elements per decade of |error| / rms(reference)."""
    names: list[str] = []
    for lv in report.levels:
        names += [o.name for o in lv.outputs if o.name not in names]
    plot_w, plot_h, bins = 520, 160, len(HISTOGRAM_EDGES)
    slot = plot_w / bins
    bar_w = (slot - 4) / max(1, len(report.levels))
    charts = []
    for name in names:
        bars = []
        for j, lv in enumerate(report.levels):
            out = next((o for o in lv.outputs if o.name == name), None)
            if out is None:
                continue
            total = sum(out.histogram) or 1
            for b, count in enumerate(out.histogram):
                h = plot_h * count / total
                bars.append({"x": b * slot + 2 + j * bar_w, "y": plot_h - h, "w": bar_w, "h": h,
                             "color": COLORS.get(lv.level, "#888"),
                             "title": f"{lv.level}: {count} of {total} elements"})
        labels = [{"x": b * slot + slot / 2, "label": ("≤" if b == 0 else "") + f"1e{int(e)}"}
                  for b, e in enumerate(HISTOGRAM_EDGES)]
        charts.append({"name": name, "bars": bars, "labels": labels, "plot_w": plot_w, "plot_h": plot_h})
    return charts
