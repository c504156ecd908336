"""A training report on the terminal (rich tables) and as one self-contained HTML page (inline SVG, no scripts).

Names from the model (parameters, modules, exception messages) reach the terminal through ``text.inert`` and the
page through Jinja2's autoescaping.

Example:

    >>> import torch, tf32lab
    >>> data = [(torch.randn(8, 4), torch.randn(8, 1))] * 3
    >>> w = tf32lab.TrainingWorkload(torch.nn.Linear(4, 1), data, inputs=lambda b: b[0],
    ...                              loss=lambda o, b: (o - b[1]).pow(2).mean())
    >>> page = tf32lab.check_training(w, levels=("highest", "high")).to_html()
    >>> page.count("<polyline")   # float32's drift and `high`'s, step by step
    2
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Optional

from rich.text import Text

from tf32lab.report.html import TEMPLATES, row_color
from tf32lab.report.tables import Column, Fitted
from tf32lab.report.text import fmt, inert
from tf32lab.report.wording import given

# A ``tf32lab.report.training.TrainingReport`` and one of its ``TrainingLevel`` rows: that module calls this
# renderer (``TrainingReport.to_html()``, ``.print()``), so they are named, not imported, not even for type
# checking (tests/test_layers.py: no import circle, TYPE_CHECKING imports included).
TrainingReport = TrainingLevel = Any

TOP = 8  # parameters and modules listed
PLOT_W, PLOT_H = 620, 240
LOG_LO = -12  # the deviation axis starts at 1e-12 (an exact match is drawn there)


def rows(report: TrainingReport) -> list[TrainingLevel]:
    """float32's floor first, then each row run on its own (``highest`` is the floor itself)."""
    return [report.floor, *[lv for lv in report.levels if lv.same_as is None and lv.level != "highest"]]


def _state(error: float) -> str:
    """The optimizer state's error; ``-`` where there is none to compare (SGD without momentum keeps no state,
    so the error is nan on every row: nothing went wrong)."""
    return "-" if math.isnan(error) else fmt(error)


def _label(lv: TrainingLevel) -> str:
    return lv.level  # "float32" for the floor, which its verdict cell names


HEADER = {"check": "tf32lab check --train ", "callback": "tf32lab training check "}  # a callback ran no command


def renderables(report: TrainingReport) -> Iterator[Any]:
    env = report.environment
    yield Text.assemble(
        (HEADER[report.asked], "bold"), (inert(report.workload), "bold cyan"),
        f"  target {report.target}, {report.steps} steps, tolerance {given(report.tolerance)} (the loss's relative "
        f"deviation from float64's; a level within 3x float32's own drift passes too)\n",
        (f"torch {env.get('torch')} on {env.get('gpu') or env.get('cpu', '')}, {report.seconds:.1f} s", "dim"),
    )
    # narrow tables rather than one wide one: each fits 80 columns (a pipe, a narrow terminal) without a number cut
    # (tables.Fitted); a row's name is never cut ("high…" could be highest): it wraps between words, each whole
    speed = any(lv.speedup is not None for lv in report.levels)
    row = Column("row", "text", key=True)
    path = Fitted("loss path against float64's", [
        row, Column("final loss"), Column("max dev."), Column("x fp32"), Column("diverges", "text"),
        *((Column("speedup"),) if speed else ()), Column("verdict", "text")])
    gradients = Fitted("step-1 gradients (the same weights in every row)", [
        row, Column("worst gradient", "name"), Column("normwise"), Column("1 - cos")])
    state = Fitted("after the last step: weights and optimizer state", [
        row, Column("worst weight", "name"), Column("weights"), Column("opt. state")])
    for lv in [report.floor, *report.levels]:
        worst = lv.worst_gradient
        verdict = Text("floor", style="dim") if lv.level == "float32" else \
            Text("PASSED" if lv.passed else "FAILED", style="bold green" if lv.passed else "bold red")
        diverges = f"step {lv.divergence_step}" if lv.divergence_step is not None else "never"
        if lv.failure is not None:  # the loss may have left the tolerance before the step that raised
            diverges = (f"{diverges}, " if lv.divergence_step is not None else "") + f"step {lv.failed_step}: failed"
        # one word, as the check's level table writes it: a key column wraps between words at 80 columns
        label = _label(lv) + (f"={lv.same_as}" if lv.same_as else "")
        cells = [label, f"{lv.losses[-1]:.6g}" if lv.losses else "-", fmt(lv.drift if lv.failure is None else None),
                 f"{lv.multiple:.1f}x" if math.isfinite(lv.multiple) else "-", diverges]
        if speed:
            cells.append(f"{lv.speedup:.2f}x" if lv.speedup is not None else "-")
        path.add_row(*cells, verdict)
        gradients.add_row(label, inert(worst.name) if worst else "-", fmt(worst.normwise if worst else None),
                          fmt(1 - worst.cosine) if worst else "-")
        # the parameter farthest from float64's, named: float32's own distance says where training drifts
        weight = lv.weights[0] if lv.weights else None
        state.add_row(label, inert(weight.name) if weight else "-", fmt(weight.normwise if weight else None),
                      _state(lv.optimizer_state))
    yield path
    yield gradients
    yield state
    shown = rows(report)
    names = [e.name for e in report.floor.layers]
    if names:
        ranked = sorted(names, key=lambda n: -max((_introduced(lv, n) for lv in shown[1:]), default=0.0))
        layers = Fitted("step 1: error each module's own backward introduces (normwise)", [
            Column("module", "name", key=True), Column("kind", "text"), *(Column(_label(lv)) for lv in shown)])
        for name in ranked[:TOP]:
            kind = next(e.kind for e in report.floor.layers if e.name == name)
            layers.add_row(inert(name), inert(kind), *[fmt(_introduced(lv, name)) for lv in shown])
        yield layers
    for lv in report.levels:
        if lv.failure is not None and lv.same_as is None:
            yield Text(f"{lv.level}: step {lv.failed_step} raised or went non-finite: {inert(lv.failure)}",
                       style="bold red")
        if lv.unhandled:
            ops = ", ".join(f"{op} x{n}" for op, n in lv.unhandled.items())
            yield Text(f"{lv.level}: ran without emulation (unhandled): {inert(ops)}", style="bold yellow")
    for note in report.notes:
        yield Text(inert(note), style="dim")


def _introduced(lv: TrainingLevel, name: str) -> float:
    found = next((e.introduced for e in lv.layers if e.name == name), math.nan)
    return -math.inf if math.isnan(found) else found


# -- HTML -------------------------------------------------------------------------------------------------------
def _y(value: float, hi: int) -> float:
    if not math.isfinite(value) or value >= 10.0**hi:
        return 10.0
    value = math.log10(max(value, 10.0**LOG_LO))
    return 10 + (PLOT_H - 30) * (hi - value) / (hi - LOG_LO)


def loss_chart(report: TrainingReport) -> dict[str, Any]:
    """Each row's deviation from float64's loss per step, on a log axis; the tolerance as a line."""
    shown = rows(report)
    finite = [d for lv in shown for d in lv.deviations if math.isfinite(d) and d > 0]
    hi = max(0, math.ceil(math.log10(max([*finite, report.tolerance * 10]))))
    steps = max(report.steps, 2)

    def x(step: int) -> float:
        return 50 + (PLOT_W - 100) * (step - 1) / (steps - 1)  # room for the last step's label

    lines = []
    for lv in shown:
        points = " ".join(f"{x(k + 1):.1f},{_y(d, hi):.1f}" for k, d in enumerate(lv.deviations))
        lines.append({"label": _label(lv), "points": points, "dashed": lv.level == "float32",
                      "color": row_color(lv.level),
                      "failed_x": x(lv.failed_step) if lv.failed_step else None})
    yticks = [{"y": _y(10.0**e, hi), "label": f"1e{e}"} for e in range(LOG_LO, hi + 1, 2)]
    xticks = [{"x": x(s), "label": str(s)} for s in sorted({1, (steps + 1) // 2, steps})]
    return {"w": PLOT_W, "h": PLOT_H, "lines": lines, "yticks": yticks, "xticks": xticks,
            "tol_y": _y(report.tolerance, hi)}


def layer_chart(report: TrainingReport) -> dict[str, Any]:
    """One bar per row and module: the error its own backward introduces at step 1 (log axis)."""
    shown = rows(report)
    names = sorted((e.name for e in report.floor.layers),
                   key=lambda n: -max((_introduced(lv, n) for lv in shown[1:]), default=0.0))[:25]
    bar_h, gap, plot_w = 7, 8, 480
    group = bar_h * len(shown) + gap

    def w(value: float) -> float:
        if math.isnan(value) or value <= 10.0**LOG_LO:
            return 0.0
        return plot_w * min(1.0, (math.log10(value) - LOG_LO) / (0 - LOG_LO))

    groups = []
    for i, name in enumerate(names):
        bars = []
        for j, lv in enumerate(shown):
            value = next((e.introduced for e in lv.layers if e.name == name), math.nan)
            bars.append({"y": 20 + i * group + j * bar_h, "w": w(value), "title": f"{_label(lv)}: {fmt(value)}",
                         "color": row_color(lv.level)})
        groups.append({"name": name, "y": 20 + i * group + group / 2, "bars": bars})
    ticks = [{"x": w(10.0**e), "label": f"1e{e}"} for e in range(LOG_LO, 1, 2)]
    return {"groups": groups, "plot_w": plot_w, "label_w": 260, "bar_h": bar_h - 1, "ticks": ticks,
            "height": 40 + len(names) * group}


def html(report: TrainingReport, data: Optional[dict[str, Any]] = None) -> str:
    """The report's page; ``data``: its ``to_dict()``, where the caller has made it already (for the JSON)."""
    if data is None:
        data = report.to_dict()  # the constants as the JSON states them: this renderer does not import its report
    return TEMPLATES.get_template("training.html.j2").render(
        report=report, rows=[report.floor, *report.levels], loss=loss_chart(report), layers=layer_chart(report),
        label=_label, top=TOP, inf=math.inf, floor_multiple=data["floor_multiple"],
        schema_version=data["schema_version"])
