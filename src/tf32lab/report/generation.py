"""The generation check's result as frozen data: per level, where greedy decoding leaves float64's tokens, how
often its top-1 token agrees with float64's when fed float64's tokens, its worst logit error per step and what it
does to the loss on the prompts' own text; judged by a criterion the user names. JSON, text and HTML renderings.

A :class:`Criterion` is one of (the text form is what ``--criterion`` and ``criterion=`` take):

- ``divergence>K`` (the default, with K the new tokens: every new token equals float64's): no prompt's tokens
  leave float64's within the first K new tokens; ``divergence>=K`` is ``divergence>K-1``;
- ``agreement>=X``: the teacher-forced top-1 agreement with float64 is at least X (a share, 0 to 1);
- ``perplexity<X``: the perplexity on the prompts' own text moves by less than X (relative: 0.01 is 1%).

The JSON form is documented in ``docs/report-schema.md`` ("The generation report") and described by
``generation_schema.json`` beside this module.

Example:

    >>> from tf32lab.report.generation import Criterion
    >>> c = Criterion.parse("divergence>=9", new_tokens=32)
    >>> c.text, c.words()
    ('divergence>8', "no prompt leaves float64's tokens within the first 8 new tokens")
    >>> Criterion.parse("perplexity<0.01", new_tokens=32).words()
    'the perplexity on the prompts moves by less than 1%'
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from tf32lab.errors import Tf32LabError
from tf32lab.know.targets import NATIVE
from tf32lab.numbers.files import finite
from tf32lab.report import Rows
from tf32lab.report.conclusion import REDUCED, enable
from tf32lab.report.wording import one_line, share

__all__ = ["FLOOR", "GENERATION_SCHEMA_VERSION", "Criterion", "GenerationLevel", "GenerationReport",
           "generation_schema", "median_divergence"]

GENERATION_SCHEMA_VERSION = 1
FLOOR = "float32"  # the row of float32 `highest` on the target: float32's own distance from float64's tokens
_FORMS = "divergence>K, divergence>=K, agreement>=X (a share, 0 to 1) or perplexity<X (relative, 0.01 = 1%)"


@dataclass(frozen=True)
class Criterion:
    """What a level must do to pass: ``kind`` ``"divergence"`` (``value``: the new tokens that must all equal
    float64's), ``"agreement"`` (the least teacher-forced top-1 agreement) or ``"perplexity"`` (the largest
    relative change of the perplexity, exclusive)."""

    kind: str
    value: float

    @classmethod
    def parse(cls, text: Optional[str], new_tokens: int) -> Criterion:
        """``text`` (None: every new token equals float64's on every prompt); one line naming it when bad."""
        if text is None:
            return cls("divergence", new_tokens)
        said = str(text).strip().replace(" ", "").lower()
        found = re.fullmatch(r"(divergence|agreement|perplexity)(>=|>|<=|<)([0-9.eE+-]+)", said)
        if found is None:
            raise Tf32LabError(f"criterion {text!r} is not understood; accepted: {_FORMS}")
        kind, op, number = found.groups()
        try:
            value = float(number)
        except ValueError:
            raise Tf32LabError(f"criterion {text!r}: {number!r} is not a number; accepted: {_FORMS}") from None
        if kind == "divergence":
            if op not in (">", ">=") or not value.is_integer():
                raise Tf32LabError(f"criterion {text!r}: divergence takes > or >= and a whole number of tokens; "
                                   f"accepted: {_FORMS}")
            k = int(value) - (op == ">=")
            # the range in the form given (divergence>=0 named a K of -1); K 0 is none: no step comes before the
            # first, so divergence>0 passed every row that ran
            if not 1 <= k <= new_tokens:
                low = int(op == ">=")
                # named as given: the K of divergence>=1 is 1, not the 0 it is read as
                why = f" (divergence{op}{low} holds for any row: no step comes before the first)" if k == 0 else ""
                raise Tf32LabError(f"criterion {text!r}: divergence{op}K takes K from {low + 1} to "
                                   f"{new_tokens + low} with {new_tokens} new tokens{why}")
            return cls("divergence", k)
        if kind == "agreement":
            # ``>`` is not ``>=``: taken as ``>=``, agreement>1 passed a row of full agreement
            if op != ">=" or not 0 <= value <= 1:
                raise Tf32LabError(f"criterion {text!r}: agreement takes >= and a share from 0 to 1 (0.95 is 95%)")
            return cls("agreement", value + 0.0)  # -0 is 0: "agreement>=-0" read "at least -0.0%"
        if op != "<" or not value > 0 or not math.isfinite(value):
            raise Tf32LabError(f"criterion {text!r}: perplexity takes < and a relative change above 0 "
                               f"(0.01 is 1%)")
        return cls("perplexity", value)

    @property
    def text(self) -> str:
        """The criterion as ``criterion=`` takes it."""
        if self.kind == "divergence":
            return f"divergence>{int(self.value)}"
        return f"agreement>={self.value:g}" if self.kind == "agreement" else f"perplexity<{self.value:g}"

    def words(self) -> str:
        """The criterion in a sentence's words."""
        if self.kind == "divergence":
            if self.value == 1:  # "within the first 1 new tokens"
                return "no prompt leaves float64's tokens at the first new token"
            return f"no prompt leaves float64's tokens within the first {int(self.value)} new tokens"
        if self.kind == "agreement":
            # every digit given: at one decimal, agreement>=0.9999 read "at least 100.0%" (at six, 0.9999999 did)
            return f"the teacher-forced top-1 agreement with float64 is at least {_every_digit(self.value)}"
        return f"the perplexity on the prompts moves by less than {_every_digit(self.value)}"

    def passes(self, row: GenerationLevel) -> bool:
        if row.failure is not None:
            return False
        if self.kind == "divergence":
            return all(step is None or step > self.value for step in row.divergence)
        if self.kind == "agreement":
            return row.agreement >= self.value
        return math.isfinite(row.perplexity_change) and abs(row.perplexity_change) < self.value


def median_divergence(steps: tuple[Optional[int], ...], new_tokens: int) -> Optional[float]:
    """The median first differing step over the prompts, a prompt that never differs counted as never (past any
    step); None when that median is never (half the prompts or more never leave float64's tokens).

    A prompt that never differs is no step to average with: counted as ``new_tokens + 1``, steps 2 and none gave
    a median of 18 at 32 new tokens and 6 at 8, a step neither prompt took.

    >>> median_divergence((2, 4, None), 32), median_divergence((2, None), 32)
    (4.0, None)
    """
    if not steps:
        return None
    found = statistics.median(math.inf if s is None else s for s in steps)
    return None if found > new_tokens else float(found)


@dataclass(frozen=True)
class GenerationLevel:
    """One row: a level (or float32's floor) decoding greedily from every prompt."""

    level: str
    maths: dict[str, str]
    tokens: tuple[tuple[int, ...], ...]  # per prompt, the new tokens generated (up to the divergence, at least)
    divergence: tuple[Optional[int], ...]  # per prompt: the first new token (1-based) not float64's; None: never
    agreement: float  # teacher-forced: the share of steps whose top-1 token is float64's
    logit_errors: tuple[float, ...]  # per step, teacher-forced: max |logit - float64's| over the prompts not ended
    loss: float  # mean token cross-entropy on the prompts' own text (nats)
    loss_change: float  # loss - float64's
    perplexity_change: float  # exp(loss_change) - 1
    passed: bool
    coverage: dict[str, int]
    unhandled: dict[str, int]
    seconds: float
    failure: Optional[str] = None  # the exception a run raised: FAILED
    same_as: Optional[str] = None  # an earlier row the target computes identically, run once for both

    @property
    def median(self) -> Optional[float]:
        """The median divergence step over the prompts (:func:`median_divergence`)."""
        return median_divergence(self.divergence, len(self.logit_errors))

    @property
    def first(self) -> Optional[int]:
        """The earliest divergence step over the prompts; None where no prompt leaves float64's tokens."""
        return min((s for s in self.divergence if s is not None), default=None)

    @property
    def worst_logit_error(self) -> float:
        return max(self.logit_errors, default=0.0) if self.failure is None else math.inf


@dataclass(frozen=True, repr=False)  # Rows.__repr__: one line
class GenerationReport(Rows):
    """The result of :func:`tf32lab.check_generation`; ``bool(report)`` is the verdict: every level passes the
    criterion."""

    workload: str
    target: str
    new_tokens: int
    prompts: tuple[str, ...]
    criterion: Criterion
    use_cache: bool
    reference_tokens: tuple[tuple[int, ...], ...]
    reference_loss: float
    floor: GenerationLevel
    levels: tuple[GenerationLevel, ...]
    environment: dict[str, Any]
    seconds: float
    notes: tuple[str, ...] = ()
    # per prompt, the new tokens compared: up to float64's end-of-text token, that token included (else all)
    reference_ends: tuple[int, ...] = ()

    def verdicts(self) -> list[str]:
        """One line per level to grep: ``PASSED | level 'high' | generation 32 tokens x 8 prompts | ...``."""
        return [_verdict(lv, self) for lv in self.levels]

    def conclusion(self) -> list[str]:
        """What the result means, in the criterion's terms."""
        return conclusion(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain data, as in ``docs/report-schema.md`` ("The generation report")."""

        def row(lv: GenerationLevel) -> dict[str, Any]:
            data = asdict(lv)
            data.update(tokens=[list(t) for t in lv.tokens], divergence=list(lv.divergence),
                        logit_errors=list(lv.logit_errors), median_divergence=lv.median, first_divergence=lv.first)
            return data

        return finite({
            "schema_version": GENERATION_SCHEMA_VERSION,
            "kind": "generation",
            "workload": self.workload,
            "target": self.target,
            "new_tokens": self.new_tokens,
            "prompts": list(self.prompts),
            "criterion": {"kind": self.criterion.kind, "value": self.criterion.value, "text": self.criterion.text,
                          "words": self.criterion.words()},
            "use_cache": self.use_cache,
            "passed": self.passed,
            "seconds": self.seconds,
            "environment": dict(self.environment),
            "notes": list(self.notes),
            "conclusion": self.conclusion(),
            "reference": {"tokens": [list(t) for t in self.reference_tokens], "loss": self.reference_loss,
                          "ends": list(self.reference_ends or [self.new_tokens] * len(self.prompts))},
            "floor": row(self.floor),
            "levels": [row(lv) for lv in self.levels],
        })

    def to_html(self) -> str:
        """A self-contained HTML page: the conclusion, the rows, and per prompt the step where each row leaves
        float64's tokens (a chart)."""
        from tf32lab.report.generation_render import html

        return html(self)

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from tf32lab.report.generation_render import renderables

        yield from renderables(self)

    def print(self, console: Any = None) -> None:
        """The tables, the verdict lines and the conclusion on ``console`` (default: stdout)."""
        from tf32lab.report.text import print_with_verdicts

        print_with_verdicts(self, console)


def generation_schema() -> dict[str, Any]:
    """The JSON Schema of :meth:`GenerationReport.to_dict` (``generation_schema.json`` beside this module)."""
    return json.loads(Path(__file__).with_name("generation_schema.json").read_text(encoding="utf-8"))


# -- verdicts and conclusion --------------------------------------------------------------------------------------
def _diverges(lv: GenerationLevel, n_prompts: int) -> str:
    if lv.first is None:
        return "never leaves float64's tokens"
    left = sum(s is not None for s in lv.divergence)
    median = "none" if lv.median is None else f"{lv.median:g}"
    return f"leaves float64's tokens at step {lv.first} ({left} of {_prompts(n_prompts)}; median {median})"


def _every_digit(value: float) -> str:
    """A criterion's share as a percentage with every digit it was given (15 significant digits: 0.57 is 57%, not
    the 56.99999999999999% its product with 100 is)."""
    return f"{value * 100:.15g}%"


def _prompts(count: int) -> str:
    return f"{count} prompt{'' if count == 1 else 's'}"


def _perplexity(change: float) -> str:
    return "perplexity unknown" if not math.isfinite(change) else f"perplexity {change:+.3%}"


def _verdict(lv: GenerationLevel, report: GenerationReport) -> str:
    head = (f"{'PASSED' if lv.passed else 'FAILED'} | level {lv.level!r} | generation {report.new_tokens} tokens x "
            f"{_prompts(len(report.prompts))}")
    if lv.failure is not None:
        return f"{head} | raised: {_one_line(lv.failure)}"
    return (f"{head} | {_diverges(lv, len(report.prompts))}; agreement {share(lv.agreement)}; "
            f"{_perplexity(lv.perplexity_change)} | criterion {report.criterion.text}")


def _one_line(text: str) -> str:
    return one_line(text).rstrip(".")


def _called(lv: GenerationLevel) -> str:
    matmul = lv.maths.get("matmul", "").split("-")[0].split("x")[0]
    word = {"tf32": "TF32", "bf16": "bf16", "bfx9": "bfx9"}.get(matmul)
    return f"{word} (`{lv.level}`)" if word and lv.level != "highest" else f"`{lv.level}`"


def _facts(lv: GenerationLevel, n_prompts: int) -> str:
    return (f"it {_diverges(lv, n_prompts)}, agrees with float64's top-1 token on {share(lv.agreement)} of "
            f"teacher-forced steps and moves the {_perplexity(lv.perplexity_change)}")


def conclusion(report: GenerationReport) -> list[str]:
    """The plain sentences: each level's verdict in the criterion's terms, with its numbers and float32's."""
    where = "on this machine" if report.target == NATIVE else f"on {report.target}"
    name = " ".join(str(report.workload).split())
    n = len(report.prompts)
    rule = report.criterion.words()
    lines: list[str] = []
    # the level to turn on: the fastest that passes and computes otherwise than `highest`
    reduced = [lv for level in REDUCED for lv in report.levels if lv.level == level and lv.same_as is None]
    best = next((lv for lv in reduced if lv.passed and lv.failure is None), None)
    for lv in report.levels:
        if lv.same_as is not None and lv.same_as != "highest":
            continue
        if lv.level == "highest" and len(report.levels) > 1:
            continue  # float32's own line below
        called = _called(lv)
        if lv.failure is not None:
            lines.append(f"{called} fails {where}: its run raised {_one_line(lv.failure)}.")
        elif lv.passed:
            advice = f" Enable it with {enable(lv.level)}." if lv is best else ""
            lines.append(f"{called} passes for generating with {name} {where} ({rule}): {_facts(lv, n)}.{advice}")
        else:
            lines.append(f"{called} fails for generating with {name} {where} (criterion: {rule}): "
                         f"{_facts(lv, n)}.")
    floor = report.floor
    if floor.failure is not None:
        lines.append(f"float32 itself (`highest`) raised: {_one_line(floor.failure)}.")
    else:
        own = report.criterion.passes(floor)
        lines.append(f"float32 itself (`highest`): {_facts(floor, n)}; it "
                     f"{'meets' if own else 'does not meet'} the criterion"
                     f"{'' if own else ', so it asks more than float32 gives: name a looser one'}.")
        if own and reduced and best is None:
            lines.append(f"Keep `highest` (PyTorch's default) for generating with {name}.")
    unhandled = {op: k for lv in (floor, *report.levels) if lv.same_as is None for op, k in lv.unhandled.items()}
    if unhandled:
        ops = ", ".join(f"{op} x{k}" for op, k in sorted(unhandled.items()))
        lines.append(f"Some matmul-family ops ran without emulation ({ops}): they computed as this machine does, so "
                     f"what the target would do to them is not in these tokens.")
    return lines
