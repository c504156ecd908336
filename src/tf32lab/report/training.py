"""The training check's result as frozen data: per level the loss path against float64's, the gradients of the
first step, the weights and optimizer state after the last, and the verdict; JSON, text and HTML renderings.

A level *diverges* at the first step whose loss is further from float64's than the tolerance (relative). It still
passes when its loss path stays within ``FLOOR_MULTIPLE`` times float32's own drift (``highest`` on the target):
training that drifts from float64 just as float32 does is not made worse by the level. A level at which the loss
turns NaN/Inf, or a step raises, fails with that step and the exception.

The JSON form is documented in ``docs/report-schema.md`` ("The training report") and described by
``training_schema.json`` beside this module.

Example:

    >>> import torch, tf32lab
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <...>
    >>> data = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(4)]
    >>> w = tf32lab.TrainingWorkload(torch.nn.Linear(8, 1), data, loss=lambda o, b: (o - b[1]).pow(2).mean(),
    ...                              inputs=lambda b: b[0])
    >>> report = tf32lab.check_training(w, levels=("highest",))
    >>> report.level("highest").deviations == report.floor.deviations, bool(report)
    (True, True)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional

from tf32lab.errors import Tf32LabError
from tf32lab.know.targets import NATIVE
from tf32lab.numbers.files import finite
from tf32lab.report import Rows
from tf32lab.report.conclusion import INPUTS_NOT_FLOAT32, WORTH, enable, inputs_held
from tf32lab.report.wording import given, one_line

__all__ = ["FLOOR_MULTIPLE", "TRAINING_SCHEMA_VERSION", "BackwardLayer", "ParameterError", "TrainingLevel",
           "TrainingReport", "faster", "training_schema"]

TRAINING_SCHEMA_VERSION = 1
# A level whose loss path stays within this multiple of float32's own drift from float64 passes even past the
# tolerance: float32 itself drifts that far (chaotic training, a loss that amplifies rounding). Three, not one:
# two float32 runs that differ only in summation order already differ by up to about 2x in such drift.
FLOOR_MULTIPLE = 3.0
FLOOR = "float32"  # the row of float32 `highest` on the target: float32's own drift from float64


@dataclass(frozen=True)
class ParameterError:
    """One parameter (or its gradient) against float64's: ``normwise`` ‖x − x64‖ / ‖x64‖ and the cosine between
    them (NaN where either is zero)."""

    name: str
    normwise: float
    cosine: float


@dataclass(frozen=True)
class BackwardLayer:
    """A module with parameters, in the first step's backward: ``introduced`` is the normwise error of the
    gradients its own backward computes (of its inputs and its parameters) when run under the level fed
    float64's inputs and output gradients: the error that module adds, as check's layers do for the forward."""

    name: str
    kind: str
    introduced: float


@dataclass(frozen=True)
class TrainingLevel:
    """One row: a level (or the policy, or float32's floor) trained for the report's steps."""

    level: str
    maths: dict[str, str]
    losses: tuple[float, ...]
    deviations: tuple[float, ...]  # per step: |loss - float64's| / |float64's|
    divergence_step: Optional[int]  # the first step (1-based) past the tolerance, None: never
    gradients: tuple[ParameterError, ...]  # step 1, the same weights for every row; worst first
    layers: tuple[BackwardLayer, ...]  # step 1's backward per module; the most introduced error first
    weights: tuple[ParameterError, ...]  # after the last step; worst first
    # normwise error of every optimizer-state tensor (Adam's moments) after the last step; nan where the optimizer
    # keeps none (SGD without momentum), shown as "-"
    optimizer_state: float
    multiple: float  # drift over float32's own drift (1.0 for float32 itself)
    passed: bool
    coverage: dict[str, int]
    unhandled: dict[str, int]
    seconds: float
    failure: Optional[str] = None  # "LinAlgError: ...", "the loss is nan": FAILED at failed_step
    failed_step: Optional[int] = None
    same_as: Optional[str] = None  # an earlier row the target computes identically, run once for both
    policy: Optional[dict[str, Any]] = None
    # a training step's predicted speedup on the target over `highest` (tf32lab.speed), and its likely range
    speedup: Optional[float] = None
    speedup_band: Optional[tuple[float, float]] = None

    @property
    def drift(self) -> float:
        """The largest deviation of the loss from float64's over the steps run (inf when the run failed)."""
        if self.failure is not None:
            return math.inf
        return max(self.deviations, default=0.0)

    @property
    def worst_gradient(self) -> Optional[ParameterError]:
        return self.gradients[0] if self.gradients else None

    @property
    def worst_layer(self) -> Optional[BackwardLayer]:
        return next((layer for layer in self.layers if not math.isnan(layer.introduced)), None)


ASKED = ("check", "callback")  # TrainingReport.asked: whose words its advice is in


@dataclass(frozen=True, repr=False)  # Rows.__repr__: one line
class TrainingReport(Rows):
    """The result of :func:`tf32lab.check_training`; ``bool(report)`` is the verdict (with a policy row, the
    policy's, the levels being context)."""

    workload: str
    target: str
    steps: int
    tolerance: float
    reference_losses: tuple[float, ...]
    floor: TrainingLevel
    levels: tuple[TrainingLevel, ...]
    environment: dict[str, Any]
    seconds: float
    notes: tuple[str, ...] = ()
    # who asked, for the advice's words: "check" (check_training, the CLI: --policy, tune) or "callback" (a training
    # loop's callback, which takes a policy itself and has no spec to tune)
    asked: str = "check"

    def __post_init__(self) -> None:
        if self.asked not in ASKED:  # another word would be advised as "check" without a word said
            raise Tf32LabError(f"asked must be one of {', '.join(map(repr, ASKED))}, not {self.asked!r}")

    def verdicts(self) -> list[str]:
        """One line per row to grep: ``PASSED | level 'high' | training 50 steps | ...``."""
        return [_verdict(lv, self) for lv in self.levels]

    def conclusion(self) -> list[str]:
        """What the result means and what to do, in plain sentences."""
        return conclusion(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain data, as in ``docs/report-schema.md`` ("The training report")."""

        def row(lv: TrainingLevel) -> dict[str, Any]:
            data = _fields(lv)
            data.update(drift=lv.drift, losses=list(lv.losses), deviations=list(lv.deviations),
                        speedup_band=list(lv.speedup_band) if lv.speedup_band else None,
                        gradients=[_fields(g) for g in lv.gradients], layers=[_fields(e) for e in lv.layers],
                        weights=[_fields(w) for w in lv.weights])
            return data

        return finite({
            "schema_version": TRAINING_SCHEMA_VERSION,
            "kind": "training",
            "workload": self.workload,
            "target": self.target,
            "steps": self.steps,
            "tolerance": self.tolerance,
            "floor_multiple": FLOOR_MULTIPLE,
            "passed": self.passed,
            "seconds": self.seconds,
            "environment": dict(self.environment),
            "notes": list(self.notes),
            "conclusion": self.conclusion(),
            "reference_losses": list(self.reference_losses),
            "floor": row(self.floor),
            "levels": [row(lv) for lv in self.levels],
        })

    def to_html(self) -> str:
        """A self-contained HTML page: the conclusion, the loss paths' deviation per step (log axis), the
        per-module gradient errors."""
        from tf32lab.report.training_render import html

        return html(self)

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from tf32lab.report.training_render import renderables

        yield from renderables(self)

    def print(self, console: Any = None) -> None:
        """The tables, the verdict lines and the conclusion on ``console`` (default: stdout)."""
        from tf32lab.report.text import print_with_verdicts

        print_with_verdicts(self, console)


def _fields(row: Any) -> dict[str, Any]:
    """A row's fields by name, their values as they are: ``finite`` makes every dict and list of the JSON anew
    (``dataclasses.asdict`` deep-copied each value first, most of a report's rendering time)."""
    return {f.name: getattr(row, f.name) for f in fields(row)}


def training_schema() -> dict[str, Any]:
    """The JSON Schema of :meth:`TrainingReport.to_dict` (``training_schema.json`` beside this module)."""
    return json.loads(Path(__file__).with_name("training_schema.json").read_text(encoding="utf-8"))


# -- verdicts and conclusion --------------------------------------------------------------------------------------
def _verdict(lv: TrainingLevel, report: TrainingReport) -> str:
    head = f"{'PASSED' if lv.passed else 'FAILED'} | level {lv.level!r} | training {_steps(report.steps)}"
    if lv.failure is not None:
        return f"{head} | step {lv.failed_step}: {_one_line(lv.failure)}"
    drift = f"loss within {lv.drift:.1e} of float64's ({_times(lv.multiple)} float32's own drift)"
    if lv.divergence_step is None:
        return f"{head} | {drift} <= {given(report.tolerance)}"
    if lv.passed:
        return (f"{head} | {drift}: past {given(report.tolerance)} from step {lv.divergence_step}, within "
                f"{FLOOR_MULTIPLE:g}x float32's own drift")
    return (f"{head} | diverges at step {lv.divergence_step}: loss up to {lv.drift:.1e} from float64's "
            f"({_times(lv.multiple)} float32's own drift) > {given(report.tolerance)}")


def faster(lv: TrainingLevel, target: str) -> str:
    """``; a training step is predicted 1.80x faster than at `highest` on a100 (likely 1.60-2.00x)``, or nothing."""
    if lv.speedup is None or target == NATIVE:
        return ""
    band = lv.speedup_band
    likely = f" (likely {band[0]:.2f}-{band[1]:.2f}x)" if band and band[0] != band[1] else ""
    if lv.speedup < WORTH:
        return (f"; but a training step is predicted only {lv.speedup:.2f}x as fast as at `highest` on {target}"
                f"{likely}: it buys little here")
    return f"; a training step is predicted {lv.speedup:.2f}x as fast as at `highest` on {target}{likely}"


def _steps(n: int) -> str:
    return f"{n} step{'' if n == 1 else 's'}"


def _times(multiple: float) -> str:
    return f"{multiple:.1f}x" if math.isfinite(multiple) else ("no measure of" if math.isnan(multiple) else "inf x")


def _one_line(text: str) -> str:
    return one_line(text).rstrip(".")


def _called(lv: TrainingLevel) -> str:
    if lv.level == "policy":
        return "The policy"
    matmul = lv.maths.get("matmul", "").split("-")[0].split("x")[0]
    word = {"tf32": "TF32", "bf16": "bf16", "bfx9": "bfx9"}.get(matmul)
    return f"{word} (`{lv.level}`)" if word and lv.level != "highest" else f"`{lv.level}`"


def changed_layers(lv: TrainingLevel, floor: TrainingLevel) -> list[BackwardLayer]:
    """``lv``'s backward rows whose own error the level raises past float32's own (the floor's, in the same
    module), the most first: a module that runs no matmul-family op (an embedding, a norm) computes alike at every
    level, so pinning it to `highest` changes nothing. A module the floor has no number for counts as changed."""
    own = {layer.name: layer.introduced for layer in floor.layers}
    return [layer for layer in lv.layers if not math.isnan(layer.introduced)
            and not layer.introduced <= own.get(layer.name, math.nan)]


def _gradient_clause(lv: TrainingLevel, floor: TrainingLevel) -> str:
    worst = lv.worst_gradient
    if worst is None:
        return ""
    text = f"gradients of {worst.name!r} are off by {worst.normwise:.0e} at step 1"
    layer = next(iter(changed_layers(lv, floor)), None)
    if layer is not None and layer.introduced > 0:
        text += f" (the module whose own backward adds the most error: {layer.name!r}, {layer.introduced:.0e})"
    return text


# what to do where a level fails and no single module is to blame
_KEEP = ("; keep `highest` (PyTorch's default) for this training, or let `tf32lab tune SPEC --train` search for "
         "modules to pin")
_KEEP_CALLBACK = "; keep `highest` (PyTorch's default) for this training"


def _keep(lv: TrainingLevel, keep: str) -> str:
    """``keep`` (the advice to keep `highest`) for a reduced level's row, not for `highest`'s own or one computed
    as it is."""
    return "" if lv.level == "highest" or lv.same_as == "highest" else keep


def _enable(lv: TrainingLevel, target: str) -> str:
    """`` Enable it with ...`` where a level (not a policy) is safe, unless its step is predicted to buy little
    on the target, as the sentence before it says (no prediction: the machine at hand, or none asked for)."""
    if lv.level in ("policy", "highest") or lv.same_as is not None:
        return ""
    if target != NATIVE and lv.speedup is not None and lv.speedup < WORTH:
        return ""
    return f" Enable it with {enable(lv.level)}."


def _pin(lv: TrainingLevel, floor: TrainingLevel, asked: str = "check") -> str:
    """Pin the module that owns the worst gradient (its parameter's name less the last part); where the level
    leaves that module's own computation as float32's (its gradient is wrong only by what reaches it), the module
    whose own backward the level changes most; none where it changes no module's, nor where no module's own
    backward was measured (gpytorch's modules run past the hooks that measure it: the worst gradient's owner, its
    constant mean, runs no matmul-family op, and pinning it changed nothing). An owner with no row of its own
    where other modules have rows is the most changed module's too: a module that never ran (T5's ``shared``,
    the first name of a weight tied to the embeddings and head that run it) or whose own backward was not measured,
    which pinning is not known to change."""
    worst = lv.worst_gradient
    if worst is None or lv.level not in ("high", "medium") or not lv.layers:
        return ""
    module = worst.name.rpartition(".")[0]
    changed = changed_layers(lv, floor)
    if module and module not in {layer.name for layer in changed}:
        module = changed[0].name if changed else ""
    if not module:
        return ""
    own = next((layer.introduced for layer in lv.layers if layer.name == module), math.nan)
    # its own backward a small share of the gradient's error: the rest reaches it (from its forward's output, or the
    # model's own code outside its modules, which no row measures), and pinning it may or may not help
    guess = (": a guess, its own backward adding little of the gradient's error (the rest reaches it from its forward "
             "or from code outside the modules; only a run tells which)" if own < worst.normwise / GUESS else "")
    policy = f'tf32lab.Policy("{lv.level}", [("{module}", "highest")])'
    if asked == "callback":  # the callback checks a policy itself (policy=), and has no spec for tune
        return f"; pin {module!r}: give the callback `policy={policy}` and train again{guess}"
    return (f"; pin {module!r} with `{policy}` and check again (--policy){guess}, or let `tf32lab tune SPEC --train` "
            f"search")


GUESS = 10  # a module whose own backward adds less than 1/GUESS of the worst gradient's error is pinned as a guess


def conclusion(report: TrainingReport) -> list[str]:
    """The plain sentences: for each reduced level, safe (and why: within tolerance, or within float32's own
    drift) or not (the divergence step, the worst gradient, what to pin); a failed step names its exception."""
    where = "on this machine" if report.target == NATIVE else f"on {report.target}"
    name, steps = " ".join(str(report.workload).split()), _steps(report.steps)  # one line, whatever the name holds
    lines: list[str] = []
    rows = [lv for lv in report.levels if lv.level != "highest"] or list(report.levels)
    # keeping `highest` is an answer only where float32 itself trains: not for its own row, nor where it fails too
    keep = (_KEEP_CALLBACK if report.asked == "callback" else _KEEP) if report.floor.failure is None else ""
    for lv in rows:
        if lv.same_as is not None and lv.same_as != "highest":
            continue
        called = _called(lv)
        if lv.failure is not None:
            lines.append(f"{called} fails at step {lv.failed_step} {where}: {_one_line(lv.failure)}{_keep(lv, keep)}.")
        elif lv.passed and lv.divergence_step is None:
            lines.append(f"{called} is safe for training {name} for {steps} {where}: its loss stays within "
                         f"{lv.drift:.1e} of float64's ({_times(lv.multiple)} float32's own drift; tolerance "
                         f"{given(report.tolerance)}){faster(lv, report.target)}.{_enable(lv, report.target)}")
        elif lv.passed:
            lines.append(f"{called} is safe for training {name} for {steps} {where}: its loss stays within "
                         f"{lv.multiple:.1f}x of float32's own drift, though both leave float64's path by more than "
                         f"{given(report.tolerance)} (from step {lv.divergence_step}){faster(lv, report.target)}."
                         f"{_enable(lv, report.target)}")
        else:
            clause = _gradient_clause(lv, report.floor)
            lines.append(f"{called} diverges at step {lv.divergence_step} {where}: its loss is "
                         f"{lv.drift:.1e} from float64's, {_times(lv.multiple)} float32's own drift"
                         f"{'; ' + clause if clause else ''}{_pin(lv, report.floor, report.asked) or _keep(lv, keep)}.")
    unhandled = {op: n for lv in report.levels if lv.same_as is None for op, n in lv.unhandled.items()}
    if unhandled:
        ops = ", ".join(f"{op} x{n}" for op, n in sorted(unhandled.items()))
        lines.append(f"Some matmul-family ops ran without emulation ({ops}): they computed as this machine does, "
                     f"so what the target would do to them is not in these paths.")
    floor = report.floor
    fed = next((note for note in report.notes if note.startswith(INPUTS_NOT_FLOAT32)), None)
    if floor.failure is not None and fed is not None:
        lines.append(f"float32 itself (`highest`) fails at step {floor.failed_step}: {_one_line(floor.failure)}; "
                     f"{inputs_held(fed, 'batches')} (see the notes): give the model "
                     f"float32 batches (.float()); no precision level is the matter.")
    elif floor.failure is not None:
        lines.append(f"float32 itself (`highest`) fails at step {floor.failed_step}: {_one_line(floor.failure)}; "
                     f"no level can be judged against its drift.")
    elif floor.divergence_step is not None:
        lines.append(f"float32 itself leaves float64's loss path by {floor.drift:.1e}, past the tolerance from step "
                     f"{floor.divergence_step}: levels are judged against that drift too (within "
                     f"{FLOOR_MULTIPLE:g}x of it passes).")
    return lines
