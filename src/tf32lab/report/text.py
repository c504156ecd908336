"""A report as rich terminal tables: levels, outputs, the layers that introduce the most error, coverage.

Every name that comes from the model (workload, outputs, layers, exception messages) reaches the terminal through
:func:`inert`: a model named with an escape sequence prints as text, never as a command to the terminal.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Optional

from rich.text import Text

from tf32lab.numbers.metrics import OPERANDS
from tf32lab.report.tables import Column, Fitted, short_name
from tf32lab.report.wording import inert, tolerance_words

__all__ = ["fmt", "footnoted", "inert", "notes", "print_with_verdicts", "ranked_layers", "renderables", "short_name",
           "times"]

# A ``tf32lab.report.Report``: the package's own module calls this renderer (``Report.print()``), so it is
# named, not imported, not even for type checking (tests/test_layers.py: no import circle, TYPE_CHECKING
# imports included).
Report = Any

TOP_LAYERS = 10

def fmt(value: float | None) -> str:
    """Errors in scientific notation, with ``-`` for nothing measured."""
    if value is None:
        return "-"
    if math.isnan(value) or math.isinf(value):
        return str(value)
    return f"{value:.2e}"


def times(multiple: float | None) -> str:
    """An error as a multiple of float32 `highest`'s, ``-`` where unknown: ``1.0x``, ``8616x``, ``1.2e+05x``."""
    if multiple is None or math.isnan(multiple):
        return "-"
    if math.isinf(multiple):
        return "inf"
    return f"{multiple:.1f}x" if multiple < 10 else f"{multiple:.0f}x" if multiple < 1e5 else f"{multiple:.1e}x"


def renderables(report: Report) -> Iterator[Any]:
    """The tables (each fits any width without cutting a number: ``tables.Fitted``); the verdict lines are left to
    the caller (they must not wrap, to grep well)."""
    env = report.environment
    where = env.get("gpu") or env.get("cpu", "")
    yield Text.assemble(
        ("tf32lab check ", "bold"), (inert(report.workload), "bold cyan"),
        f"  target {report.target}, reference {report.reference}, {tolerance_words(report.tolerance)} "
        f"(normwise)\n",
        (f"torch {env.get('torch')} on {where}, {report.seconds:.1f} s", "dim"),
    )
    yield _levels(report)
    yield _outputs(report)
    layers = _layers(report)
    if layers is not None:
        yield layers
    for lv in report.levels:
        if lv.error is not None and lv.same_as is None:
            yield Text(f"level {lv.level}: the model raised {inert(lv.error)}", style="bold red")
        if lv.unhandled:
            ops = ", ".join(f"{op} ×{n}" for op, n in lv.unhandled.items())
            yield Text(f"level {lv.level}: ran without emulation (unhandled): {inert(ops)}", style="bold yellow")
    for note in notes(report):
        yield Text(inert(note), style="dim")


def notes(report: Report) -> list[str]:
    """The lines under the tables: the report's notes, what outputs and layers need said, the max rel footnote."""
    from tf32lab.report.conclusion import MAX_REL_NOTE, choices_said, notes_apart, pinned_and_diverged, policy_summary

    # the note on products run on other threads qualifies the verdict: the conclusion says it, beside the verdict
    lines = notes_apart(report)
    for lv in report.levels:
        if lv.policy is not None:
            lines.append(f"policy: {policy_summary(lv.policy)}; each layer's introduced error is the one at the "
                         f"level (and cuDNN conv math) the policy gives it")
    for lv in report.levels:
        if lv.same_as is not None:  # its lines are the other level's
            continue
        said = choices_said(lv)
        if said is not None:  # the model's discrete choices (a router's top-k) against the reference's
            lines.append(f"choices: {said}")
        for o in lv.outputs:
            if o.failure is not None:
                lines.append(f"level {lv.level}, output {o.name!r}: {o.failure}")
            elif o.note:
                lines.append(f"level {lv.level}, output {o.name!r}: {o.note}")
        for layer in lv.layers:
            pin, diverged = pinned_and_diverged(layer.diverged)
            if pin:
                lines.append(f"level {lv.level}, layer {layer.name!r}: {pin}")
            if diverged:
                lines.append(f"level {lv.level}, layer {layer.name!r}: diverged: {diverged}")
    if any(o.scale == OPERANDS for lv in report.levels for o in lv.outputs) and \
            any(lv.layers for lv in report.levels):
        lines.append("layers: a layer's errors are over its own output's norm, not over the magnitudes that formed "
                     "it: a layer whose output is zero or cancels ((model), beside an output judged over them) reads "
                     "large there, inf where it is zero")
    if footnoted(report):
        lines.append(f"* {MAX_REL_NOTE}.")
    return lines


def footnoted(report: Report) -> bool:
    """Whether an output passed with a max rel above its tolerance (the footnote explains it)."""
    return any(_starred(o) for lv in report.levels for o in lv.outputs)


def _starred(o: Any) -> bool:
    """A max rel shown above the tolerance of an output that passed (not one judged over its operands: its max
    rel is not shown)."""
    return o.passed and not o.exact and o.scale != OPERANDS and o.max_rel > o.tolerance


def _verdict(passed: bool) -> Text:
    return Text("PASSED", style="bold green") if passed else Text("FAILED", style="bold red")


def _levels(report: Report) -> Fitted:
    title = "Levels: the math per op family, the worst output's error"
    if report.speed is not None:
        title += f", the speedup predicted on {report.target}"
    speed = any(lv.speedup is not None for lv in report.levels)
    # maths without their rounding (tf32-rna: tf32): JSON and HTML have it all
    table = Fitted(title, [Column("level", "text", key=True), *(Column(family, "text") for family in
                                                                 ("matmul", "conv", "rnn", "attn")),
                           Column("worst"), *([Column("speed")] if speed else []), Column("verdict", "text")])
    for lv in report.levels:
        worst = lv.worst
        name = lv.level if lv.same_as is None else f"{lv.level}={lv.same_as}"
        if lv.error is not None:
            value = Text("raised", style="bold red")
        else:
            value = Text(fmt(worst.normwise if worst else None))
        faster = [f"{lv.speedup:.2f}x" if lv.speedup is not None else "-"] if speed else []
        table.add_row(
            name, *("/".join(m.split("-")[0] for m in lv.maths.get(key, "native").split("/"))
                   for key in ("matmul", "conv", "rnn", "attention")),
            value, *faster, _verdict(lv.passed),
        )
    return table


def _signed(value: float) -> str:
    """A bias with its sign; 0 as "0" (an exact sum)."""
    return "0" if value == 0 else f"{value:+.1e}"


def _outputs(report: Report) -> Fitted:
    metric = any(lv.metric is not None for lv in report.levels)
    # "x fp32": the error over float32 `highest`'s own, as the training check shows its drift
    columns = ["max abs", "max rel", "normwise", "x fp32", "bias", "min cos", "top-1"] + (["metric"] if metric else [])
    table = Fitted("Outputs against the reference", [Column("level", "text", key=True),
                                                    Column("output", "text", key=True), *map(Column, columns)])
    for lv in report.levels:
        for o in lv.outputs:
            style = "green" if o.passed else "bold red"
            if o.failure is not None:
                row = [lv.level, Text(inert(o.name)), "-", "-", Text("see below", style=style), "-", "-", "-", "-"]
            elif o.exact:
                row = [lv.level, Text(inert(o.name)), "-", "-", Text("equal", style=style), "-", "-", "-", "-"]
            else:
                star = "*" if _starred(o) else ""
                # over its operands: max rel and cosine are over a reference that is zero or cancels, and say
                # nothing (the output's note says what its normwise is over)
                over = o.scale == OPERANDS
                row = [lv.level, Text(inert(o.name)), fmt(o.max_abs), "-" if over else fmt(o.max_rel) + star,
                       Text(fmt(o.normwise), style=style), times(o.multiple), _signed(o.bias),
                       "-" if over else f"{o.cosine:.6f}", "-" if o.top1 is None else f"{o.top1:.1%}"]
            table.add_row(*row, *([fmt(lv.metric)] if metric else []))
    return table


def _layers(report: Report) -> Fitted | None:
    from tf32lab.report.conclusion import pinned_and_diverged

    ranked = ranked_layers(report)
    if not ranked:
        return None
    shown = min(TOP_LAYERS, len(ranked))
    levels = [lv for lv in report.levels if lv.same_as is None]  # a level computed as another adds nothing here
    headers = [" = ".join([lv.level, *(o.level for o in report.levels if o.same_as == lv.level)]) for lv in levels]
    rerun = report.rerun  # else every level passed unrerun: accumulated errors only
    rows = []
    for name in ranked[:TOP_LAYERS]:
        cells = []
        for lv in levels:
            layer = next((e for e in lv.layers if e.name == name), None)
            cell = "-" if layer is None else f"{_short(layer.introduced)} / {_short(layer.accumulated)}" if rerun \
                else _short(layer.accumulated)
            pin, diverged = pinned_and_diverged(None if layer is None else layer.diverged)
            cells.append(cell + (" diverged" if diverged else " pinned" if pin else ""))
        rows.append((name, cells))
    title = f"most error introduced first ({shown} of {len(ranked)}): introduced / accumulated" if rerun else \
        f"most error accumulated first ({shown} of {len(ranked)})"
    table = Fitted(f"Layers, {title}", [Column("layer", "name", key=True), *(Column(header) for header in headers)])
    for name, cells in rows:
        table.add_row(Text(inert(name)), *cells)
    return table


def _short(value: float) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:.1e}" if math.isfinite(value) else str(value)


def ranked_layers(report: Report) -> list[str]:
    """Layer names, the largest introduced error at any level first; where no level's layers were rerun (every
    level passed, ``check(introduced="failing")``), the largest accumulated error."""
    rerun = report.rerun
    worst: dict[str, float] = {}
    for lv in report.levels:
        for layer in lv.layers:
            value = layer.introduced if rerun else layer.accumulated
            worst[layer.name] = max(worst.get(layer.name, 0.0), -1.0 if math.isnan(value) else value)
    return sorted(worst, key=lambda name: -worst[name])


def print_with_verdicts(document: Any, console: Any = None, conclusion: Optional[list[str]] = None) -> None:
    """``document``'s tables (its ``__rich_console__``), its verdict lines unwrapped (one a line, to grep), then its
    conclusion (``conclusion``, default ``document.conclusion()``) wrapped at the console's width, on ``console``
    (default: stdout; through a pipe, 80 columns or ``COLUMNS``): how every report prints."""
    from rich.console import Console

    console = console or Console(highlight=False)
    console.print(document)
    for line in document.verdicts():
        console.print(inert(line), soft_wrap=True, markup=False, emoji=False, highlight=False)
    console.print()
    for line in document.conclusion() if conclusion is None else conclusion:
        console.print(inert(line), markup=False, emoji=False, highlight=False)
