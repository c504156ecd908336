"""Reports: what ``check`` measured, as frozen data, rendered as a terminal table, JSON or a self-contained HTML file.

``bool(report)`` is the verdict: every level within tolerance. The JSON form is documented in
``docs/report-schema.md`` and described by ``schema.json`` beside this module (``SCHEMA_VERSION``).

Example:

    >>> import torch, tf32lab
    >>> w = tf32lab.Workload(torch.nn.Linear(64, 8), torch.randn(16, 64), name="tiny")
    >>> report = tf32lab.check(w, levels=("highest", "high"))
    >>> bool(report), [lv.level for lv in report.levels]
    (True, ['highest', 'high'])
    >>> report.to_dict()["schema_version"]
    3
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Union

from tf32lab.numbers.files import finite, write_atomically, write_json
from tf32lab.numbers.metrics import HISTOGRAM_EDGES, OutputError
from tf32lab.report import terminal  # noqa: F401 (first: rich without drawing from the caller's random)
from tf32lab.report.wording import one_line

__all__ = ["SCHEMA_VERSION", "Document", "LayerError", "LevelResult", "Report", "Rows", "schema"]

SCHEMA_VERSION = 3


@dataclass(frozen=True)
class LayerError:
    """One module that ran matmul-family ops itself, at one level.

    ``introduced``: normwise error of its output when it runs under the level fed the reference inputs (its own
    rounding; a module's sub-layers run fed their reference inputs too). ``accumulated``: normwise error of its
    output in the end-to-end run (everything upstream included). Both are the worst over its ``calls``; NaN when
    not measured. ``diverged``: why some call could not be measured (data-dependent control flow: another output
    shape, another number of calls; or it raised when run alone at the level; ``not measured: ...``: its output holds
    no tensor, or run alone it met a float64 value the reference left), or, first, in a policy row, why its
    introduced error is not measured: the policy pins it to a conv math its reruns did not run at
    (``conclusion.PINNED_CONV``).
    """

    name: str
    kind: str
    calls: int
    introduced: float
    accumulated: float
    diverged: Optional[str] = None
    order: Optional[int] = None  # where its first call came among the layers' in the float64 reference (0: first)


@dataclass(frozen=True)
class LevelResult:
    """Everything measured at one precision level."""

    level: str
    maths: dict[str, str]
    outputs: tuple[OutputError, ...]
    layers: tuple[LayerError, ...]  # the largest introduced error first; where not ``reruns``: in the order they ran
    metric: Optional[float]
    coverage: dict[str, int]  # "aten::linear tf32-rna" -> ops emulated so
    unhandled: dict[str, int]  # family ops that ran without emulation
    seconds: float
    same_as: Optional[str] = None  # an earlier level the target computes identically, measured once for both
    error: Optional[str] = None  # "NotPSDError: ...": the model raised at this level (a finding: FAILED)
    policy: Optional[dict[str, Any]] = None  # the row "policy": the policy's dict form and its base level
    # predicted on the target, over highest (tf32lab.speed.prediction); None: not predicted
    speedup: Optional[float] = None
    # a second run at this level gave other outputs ("normwise 1.2e-01, then 9.8e-02"): the model is not
    # deterministic (unseeded sampling), so a failure says nothing about precision; only looked at when it fails
    unstable: Optional[str] = None
    # how many of the float64 reference's discrete choices (a top-k's, an argmax's indices) this run made otherwise
    # (tf32lab.measure.choices.Choices); None where the reference made none
    choices: Any = None
    # whether each layer was rerun at this level for its introduced error; False: a level that passed under
    # check(introduced="failing"), whose layers' introduced errors are NaN (their accumulated ones are measured)
    reruns: bool = True

    @property
    def passed(self) -> bool:
        return self.error is None and bool(self.outputs) and all(o.passed for o in self.outputs)

    @property
    def worst(self) -> Optional[OutputError]:
        """The output with the largest normwise error relative to its tolerance."""
        return max(self.outputs, key=lambda o: _ratio(o.normwise, o.tolerance), default=None)

    def top_layers(self, n: int = 3) -> tuple[LayerError, ...]:
        """The first ``n`` layers: those that introduce the most error, or where not ``reruns``, the first to run."""
        return self.layers[:n]


class Document:
    """A result written as JSON (:meth:`to_dict`) and as a self-contained HTML page (:meth:`to_html`), each file
    whole or not at all: check's :class:`Report` and tune's ``Tuning``."""

    def to_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def to_html(self) -> str:
        raise NotImplementedError

    def to_json(self, path: Union[str, Path, None] = None) -> str:
        """The result as JSON text (non-finite numbers as ``"nan"``, ``"inf"``, ``"-inf"``); written to ``path`` too
        when given (whole or not at all)."""
        return write_json(path, self.to_dict())

    def save_html(self, path: Union[str, Path]) -> Path:
        """Write :meth:`to_html` to ``path`` (whole or not at all)."""
        return write_atomically(path, self.to_html())


class Rows(Document):
    """A document of one row per level (and perhaps a policy row): check's :class:`Report`, the training and the
    generation reports. ``bool(doc)`` is the verdict: the policy row's when there is one (the levels beside it are
    context), else every level's; ``str(doc)`` is its verdict lines."""

    levels: tuple[Any, ...]

    @property
    def policy_row(self) -> Any:
        """The row of ``check(policy=...)`` / ``check_training(policy=...)``, or ``None``."""
        return next((lv for lv in self.levels if getattr(lv, "policy", None) is not None), None)

    @property
    def passed(self) -> bool:
        row = self.policy_row
        if row is not None:
            return row.passed
        return all(lv.passed for lv in self.levels)

    def __bool__(self) -> bool:
        return self.passed

    def level(self, name: str) -> Any:
        """The row of level ``name``; ``KeyError`` naming the levels checked otherwise."""
        for result in self.levels:
            if result.level == name:
                return result
        raise KeyError(f"level {name!r} was not checked; checked: {', '.join(lv.level for lv in self.levels)}")

    def verdicts(self) -> list[str]:
        raise NotImplementedError

    def __str__(self) -> str:
        return "\n".join(self.verdicts())

    def __repr__(self) -> str:
        """One line: the workload, the target and each row's verdict. Its fields (every output's and layer's
        errors) run to thousands of lines for a real model: ``print(report)`` gives the verdict lines,
        ``report.to_dict()`` every number.

        >>> import torch, tf32lab
        >>> tf32lab.check(tf32lab.Workload(torch.nn.Linear(4, 2), torch.ones(3, 4), name="probe"))
        <Report 'probe' on a100: PASSED (highest passed, high passed, medium passed)>
        """
        rows = ", ".join(f"{lv.level} {'passed' if lv.passed else 'FAILED'}" for lv in self.levels)
        return (f"<{type(self).__name__} {getattr(self, 'workload', None)!r} on {getattr(self, 'target', None)}: "
                f"{'PASSED' if self.passed else 'FAILED'} ({rows})>")


@dataclass(frozen=True, repr=False)  # Rows.__repr__: one line
class Report(Rows):
    """The result of :func:`tf32lab.check`. ``bool(report)`` is the verdict: every level within tolerance; with a
    policy row (``check(policy=...)``), the policy's own verdict, the levels beside it being context (a tuned
    policy gates CI while `high` everywhere fails)."""

    workload: str
    target: str
    reference: str
    tolerance: dict[str, float]  # "default" and any per-output entries
    levels: tuple[LevelResult, ...]
    environment: dict[str, Any]
    seconds: float
    notes: tuple[str, ...] = ()  # what a reader must know about the measurement (a module not broken down, ...)
    speed: Any = None  # the predicted tf32lab.speed.prediction.SpeedReport of one forward on the target, when predicted
    # the convolutions and RNNs it ran, whose math cuDNN's flag sets, not the level (tf32lab.report.cudnn)
    cudnn: tuple[Any, ...] = ()

    @property
    def rerun(self) -> bool:
        """Whether some level's layers were rerun for their introduced errors: False where every level passed
        under ``check(introduced="failing")`` (each layer's accumulated error only)."""
        return any(lv.reruns for lv in self.levels)

    def verdicts(self) -> list[str]:
        """Lines to grep, one per level and output: ``PASSED | level 'high' | output 'x' | normwise … <= …``;
        a level at which the model raised gets one: ``FAILED | level 'high' | raised NotPSDError: …``."""
        lines = []
        for lv in self.levels:
            if lv.error is not None:
                lines.append(f"FAILED | level {lv.level!r} | raised {one_line(lv.error)}")
            lines += [o.verdict(lv.level) for o in lv.outputs]
        return lines

    def conclusion(self, policy_file: Optional[str] = None) -> list[str]:
        """What the result means and what to do, in plain sentences (``tf32lab.report.conclusion``); with a
        policy row, ``policy_file`` names the file it came from in the advice to apply it."""
        from tf32lab.report.conclusion import conclusion

        return conclusion(self, policy_file)

    # -- renderings ---------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain data, as in ``docs/report-schema.md`` (non-finite numbers become strings: "inf", "nan")."""
        data = {
            "schema_version": SCHEMA_VERSION,
            "workload": self.workload,
            "target": self.target,
            "reference": self.reference,
            "tolerance": dict(self.tolerance),
            "passed": self.passed,
            "seconds": self.seconds,
            "environment": dict(self.environment),
            "histogram_edges_log10": list(HISTOGRAM_EDGES),
            "notes": list(self.notes),
            "conclusion": self.conclusion(),
            "speed": None if self.speed is None else self.speed.to_dict(),
            "cudnn": [asdict(family) for family in self.cudnn],
            "levels": [
                {
                    "level": lv.level,
                    "passed": lv.passed,
                    "maths": dict(lv.maths),
                    "outputs": [dict(asdict(o), shape=list(o.shape), histogram=list(o.histogram), passed=o.passed)
                                for o in lv.outputs],
                    "layers": [asdict(layer) for layer in lv.layers],
                    "metric": lv.metric,
                    "coverage": dict(lv.coverage),
                    "unhandled": dict(lv.unhandled),
                    "seconds": lv.seconds,
                    "same_as": lv.same_as,
                    "error": lv.error,
                    "policy": lv.policy,
                    "speedup": lv.speedup,
                    "choices": None if lv.choices is None else lv.choices.to_dict(),
                    "reruns": lv.reruns,
                }
                for lv in self.levels
            ],
        }
        return finite(data)

    def to_html(self) -> str:
        """A self-contained HTML page (inline CSS and SVG plots, no scripts, nothing fetched)."""
        from tf32lab.report.html import render

        return render(self)

    def _repr_html_(self) -> str:  # Jupyter
        from tf32lab.report.html import render

        return render(self, fragment=True)

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from tf32lab.report.text import renderables

        yield from renderables(self)

    def print(self, console: Any = None, policy_file: Optional[str] = None) -> None:
        """Print the tables, the verdict lines and the conclusion to ``console`` (a ``rich.console.Console``;
        default: stdout); ``policy_file``: see :meth:`conclusion`."""
        from tf32lab.report.text import print_with_verdicts

        print_with_verdicts(self, console, self.conclusion(policy_file))


def schema() -> dict[str, Any]:
    """The JSON Schema of :meth:`Report.to_dict` (``schema.json`` beside this module)."""
    return json.loads((Path(__file__).with_name("schema.json")).read_text(encoding="utf-8"))


def _ratio(value: float, tolerance: float) -> float:
    if math.isnan(value):
        return math.inf
    return value / tolerance if tolerance > 0 else math.inf

