"""A generation report on the terminal (rich tables) and as one self-contained HTML page (inline SVG, no scripts).

Prompts, tokens and exception messages reach the terminal through ``text.inert`` and the page through Jinja2's
autoescaping.

Example:

    >>> import torch, tf32lab
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <...>
    >>> model = torch.nn.Sequential(torch.nn.Embedding(40, 16), torch.nn.Linear(16, 40))
    >>> page = tf32lab.check_generation(model, new_tokens=3, prompts=[[1, 2], [3, 4, 5]],
    ...                                 levels=("highest", "high"), use_cache=False).to_html()
    >>> page.count('class="prompt-line"')   # one line per prompt in the divergence chart
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
from tf32lab.report.wording import share

# report.generation's classes, named without importing them: the report calls this renderer (no circle)
GenerationReport = GenerationLevel = Any

PROMPT_CHARS = 40  # a prompt as a table shows it
PLOT_W, LABEL_W, LINE_H = 560, 300, 22


def rows(report: GenerationReport) -> list[GenerationLevel]:
    """float32's floor first, then each row run on its own (``highest`` is the floor itself)."""
    return [report.floor, *[lv for lv in report.levels if lv.same_as is None and lv.level != "highest"]]


def short(prompt: str, chars: int = PROMPT_CHARS) -> str:
    """A prompt on one line, cut to ``chars`` characters."""
    text = " ".join(prompt.split())
    return text if len(text) <= chars else text[:chars - 1] + "…"


def _step(step: Optional[int]) -> str:
    return "none" if step is None else str(step)


def _median(lv: GenerationLevel) -> str:
    return "none" if lv.median is None else f"{lv.median:g}"


def _perplexity(change: float) -> str:
    return "-" if not math.isfinite(change) else f"{change:+.3%}"


def renderables(report: GenerationReport) -> Iterator[Any]:
    env = report.environment
    yield Text.assemble(
        ("tf32lab check --generate ", "bold"), (inert(report.workload), "bold cyan"),
        f"  target {report.target}, {report.new_tokens} new tokens x {len(report.prompts)} prompts, greedy, "
        f"cache {'on' if report.use_cache else 'off'}; criterion {report.criterion.text} "
        f"({report.criterion.words()})\n",
        (f"torch {env.get('torch')} on {env.get('gpu') or env.get('cpu', '')}, {report.seconds:.1f} s", "dim"),
    )
    row = Column("row", "text", key=True)
    table = Fitted("greedy decoding against float64's tokens (agreement and logits teacher-forced)", [
        row, Column("first diverges"), Column("median"), Column("prompts left"), Column("agreement"),
        Column("max logit err"), Column("ppl change"), Column("verdict", "text")])
    for lv in [report.floor, *report.levels]:
        # one word, as the check's level table writes it: a key column wraps between words, and ``(= high)``
        # took a line of its own at 80 columns
        label = lv.level + (f"={lv.same_as}" if lv.same_as else "")
        verdict = Text("floor", style="dim") if lv.level == "float32" else \
            Text("PASSED" if lv.passed else "FAILED", style="bold green" if lv.passed else "bold red")
        if lv.failure is not None:
            table.add_row(label, "raised", "-", "-", "-", "-", "-", verdict)
            continue
        left = sum(s is not None for s in lv.divergence)
        table.add_row(label, _step(lv.first), _median(lv), f"{left}/{len(lv.divergence)}", share(lv.agreement),
                      fmt(lv.worst_logit_error), _perplexity(lv.perplexity_change), verdict)
    yield table
    shown = rows(report)
    prompts = Fitted("the first new token that is not float64's, per prompt", [
        Column("prompt", "text", key=True), *(Column(lv.level) for lv in shown)])
    for i, prompt in enumerate(report.prompts):
        prompts.add_row(inert(short(prompt)), *[_step(lv.divergence[i]) if lv.failure is None else "-"
                                                for lv in shown])
    yield prompts
    for lv in [report.floor, *report.levels]:
        if lv.same_as is not None:
            continue
        if lv.failure is not None:
            yield Text(f"{lv.level}: raised: {inert(lv.failure)}", style="bold red")
        if lv.unhandled:
            ops = ", ".join(f"{op} x{n}" for op, n in lv.unhandled.items())
            yield Text(f"{lv.level}: ran without emulation (unhandled): {inert(ops)}", style="bold yellow")
    for note in report.notes:
        yield Text(inert(note), style="dim")


# -- HTML -------------------------------------------------------------------------------------------------------
def divergence_chart(report: GenerationReport) -> dict[str, Any]:
    """One line per prompt, its new tokens from 1 to N; a mark per row at the step where its tokens leave
    float64's (an open mark past the end where they never do)."""
    n = report.new_tokens
    shown = rows(report)

    def x(step: float) -> float:
        return LABEL_W + 10 + (PLOT_W - 40) * (step - 1) / max(n, 1)

    lines = []
    for i, prompt in enumerate(report.prompts):
        y = 30 + i * LINE_H
        marks = []
        for j, lv in enumerate(shown):
            if lv.failure is not None:
                continue
            step = lv.divergence[i]
            marks.append({"x": x(n + 1 if step is None else step), "y": y + (j - (len(shown) - 1) / 2) * 4,
                          "color": row_color(lv.level), "never": step is None,
                          "title": f"{lv.level}: {'never leaves' if step is None else f'leaves at step {step}'}"})
        lines.append({"label": short(prompt), "y": y, "marks": marks})
    ticks = [{"x": x(s), "label": str(s)} for s in sorted({1, (n + 1) // 2, n})]
    return {"lines": lines, "ticks": ticks, "x0": x(1), "x1": x(n), "never_x": x(n + 1), "label_w": LABEL_W,
            "w": LABEL_W + PLOT_W, "h": 50 + len(report.prompts) * LINE_H,
            "legend": [{"label": lv.level, "color": row_color(lv.level)} for lv in shown]}


def html(report: GenerationReport) -> str:
    data = report.to_dict()  # the constants as the JSON states them: this renderer does not import its report
    return TEMPLATES.get_template("generation.html.j2").render(
        report=report, rows=[report.floor, *report.levels], chart=divergence_chart(report), step=_step,
        median=_median, perplexity=_perplexity, short=short, share=share, schema_version=data["schema_version"])
