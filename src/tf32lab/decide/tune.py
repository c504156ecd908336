"""``tune(workload)``: the fastest policy that keeps a workload within its tolerance on a target, verified.

1. **Uniform levels.** One ``check`` session (``compare.Session``): the float64 reference with each layer rerun at
   every distinct level, one end-to-end run per distinct level, and the work counted for the speed model. The
   fastest uniform level within tolerance is the answer unless some faster level fails and a mixed policy is
   predicted meaningfully (``WORTH``) faster than it. On CUDA targets ``medium`` computes as ``high``, so the
   usual answers are ``high`` everywhere, or a mix of ``high`` and ``highest``.
2. **A mixed policy** between the fastest level ``F`` (which fails) and the fastest uniform level within
   tolerance ``S``: layers (modules that run matmul-family ops themselves) are ordered by the error each
   introduces at ``F`` per unit of predicted time it would lose at ``S``. The shortest prefix of that order that
   passes end to end, pinned to ``S``, is found by galloping (1, 2, 4, ... layers) then bisection; then each pinned
   layer, the most time-costly first, is un-pinned while the workload still passes (a group at once, halved on
   failure, when many are pinned). Pinning a layer pins its own ops: its child modules keep ``F`` by rule.
3. **Convolutions.** cuDNN's conv math is no level's: where the model's convolutions compute otherwise at TF32
   and IEEE, steps 1-2 run under TF32 and, if nothing passes, under IEEE; that answer then gives convolution
   layers back to TF32 while it still passes (policy rules that pin their conv math; the largest predicted gain
   first, a group at once, halved on failure).
4. Every candidate is a real run under the policy (``emulate(target)``), compared with the reference; none is
   chosen without one. Each is recorded: the policy, its worst output error, its predicted time.

Example:

    >>> import torch, tf32lab
    >>> w = tf32lab.Workload(torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 4)),
    ...                      torch.randn(1024, 512), name="mlp")
    >>> tuning = tf32lab.tune(w, target="a100")
    >>> tuning.level, tuning.pinned, tuning.passed
    ('high', (), True)
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Union

import torch

from tf32lab.control import flags
from tf32lab.control.policy import Policy, exact_pattern
from tf32lab.decide.conv_maths import IEEE_CONV_FLAGS, conv_matters, families_matter, with_conv_math
from tf32lab.decide.tune_training import TrainingTuning, tune_training
from tf32lab.errors import Tf32LabError
from tf32lab.know.levels import ALL_LEVELS, check_conv, check_levels
from tf32lab.know.targets import Target
from tf32lab.machine.hardware import resolve_target
from tf32lab.measure.check import ConvRun, PolicyRow, Session, alike_levels, dtypes_refused, float_inputs_note
from tf32lab.measure.layers import ROOT
from tf32lab.numbers.metrics import OutputError, tolerances_of
from tf32lab.report import Document, LevelResult, Report
from tf32lab.report.conclusion import WORTH, inputs_held, nondeterministic, notes_apart, unmeasured
from tf32lab.report.wording import one_line, tolerance_words
from tf32lab.speed.prediction import seconds_at
from tf32lab.workloads.eager import eager
from tf32lab.workloads.running import Progress, changed_note, environment_of, exits_refused, kept_flags, refuse_applied
from tf32lab.workloads.training import TrainingWorkload
from tf32lab.workloads.workload import Workload, not_a_workload

__all__ = ["Candidate", "Tuning", "tune"]

GROUP = 4  # with more pinned layers than this, un-pinning tries halves first


@dataclass(frozen=True)
class Candidate:
    """One policy tried: the layers it pins, whether it passed end to end, its worst output's error over that
    output's tolerance, its predicted time and speedup over ``highest``, and why it was tried; ``error``: what the
    model raised under it (``"SystemExit: sys.exit(0) was called"``), None when it ran to the end."""

    policy: Policy
    pinned: tuple[str, ...]
    passed: bool
    worst_ratio: float
    seconds: float
    speedup: float
    why: str
    error: Optional[str] = None

    def verdict(self) -> str:
        """``PASSED``, ``FAILED``, or ``FAILED: raised E: ...`` (what the model raised, so a row of ``inf`` says
        why)."""
        if self.passed:
            return "PASSED"
        return "FAILED" if self.error is None else f"FAILED: raised {self.error.splitlines()[0]}"


@dataclass(frozen=True)
class Tuning(Document):
    """The result of :func:`tune`. ``passed``: a policy within tolerance was found (``policy``); ``level`` is set
    when it is uniform."""

    workload: str
    target: str
    tolerance: dict[str, float]
    passed: bool
    policy: Optional[Policy]
    level: Optional[str]
    pinned: tuple[str, ...]
    outputs: tuple[OutputError, ...]
    speedup: float  # predicted over highest
    uniform: Optional[str]  # the fastest uniform level within tolerance
    speedup_over_uniform: float
    candidates: tuple[Candidate, ...]
    runs: int  # end-to-end runs, besides the float64 reference and each layer's reruns
    seconds: float
    check_seconds: float  # the part that is one check of the uniform levels
    reason: str
    report: Report  # the check of the uniform levels
    policy_file: Optional[str] = None  # where the policy was written (tf32lab tune --out), named in the advice
    conv: Optional[str] = None  # cuDNN's conv math the answer needs ("tf32" / "ieee"); None: the flag left as it was
    conv_searched: bool = False  # the search chose ``conv`` itself (TF32 missed everywhere), rather than being told
    scripted: bool = False  # the model is TorchScript, which takes no hooks: no policy applies to it

    def __bool__(self) -> bool:
        return self.passed

    def advice(self, policy_file: Optional[str] = None, command: bool = False) -> list[str]:
        """What to do, in one or two lines (``command``: said to the ``tf32lab tune`` command's user, who has no
        ``tuning`` variable); then, when the model ran products on other threads, that the answer leaves them out
        (they were neither emulated nor measured)."""
        partial = unmeasured(self.report)
        return self._advice(policy_file, command) + ([partial] if partial else [])

    def _advice(self, policy_file: Optional[str] = None, command: bool = False) -> list[str]:
        lines = self._level_advice(policy_file, command)
        if self.passed and self.conv is not None:
            pins = [rule.pattern for rule in self.policy.rules if rule.conv not in (None, self.conv)]
            sets = ", or apply the policy, which sets it itself" if self.policy.conv == self.conv and \
                not self.scripted else ""
            lines.append(f"Convolutions (and cuDNN's RNNs) at {self.conv!r}" + (
                " (PyTorch's default)." if self.conv == "tf32" else
                ": " + IEEE_CONV_FLAGS
                + sets + (f" and runs {len(pins)} layer(s) at TF32" if pins else "")
                + "; no level sets it, " + ("TF32 everywhere misses the tolerance, " if self.conv_searched else
                                            "the search ran under it as asked, ")
                + "and the speedup above is over `highest` with IEEE convolutions."))
        return lines

    def _level_advice(self, policy_file: Optional[str] = None, command: bool = False) -> list[str]:
        if not self.passed:
            return [self.reason]
        gain = f"predicted {self.speedup:.2f}x faster than `highest` on {self.target}"
        if self.level == "highest":
            return [f"{self.reason} Keep `highest` (PyTorch's default): `torch.set_float32_matmul_precision"
                    f"(\"highest\")` or `tf32lab.precision(\"highest\")`."]
        if self.level is not None and not self.pinned:
            return [f"{self.reason} Use `torch.set_float32_matmul_precision(\"{self.level}\")` or "
                    f"`tf32lab.precision(\"{self.level}\")`: {gain}."]
        where = policy_file or self.policy_file
        over = "" if self.uniform == "highest" else \
            f" ({self.speedup_over_uniform:.2f}x faster than `{self.uniform}` everywhere)"
        if where is None and command:  # the command's user has no `tuning`: the file is how the policy leaves
            return [self.reason, f"Write it with `--out FILE`, then apply it with "
                                 f"`tf32lab.Policy.load(FILE).apply(model)`: {gain}{over}."]
        if where is None:  # not written anywhere: no file name to invent
            return [self.reason, f"Apply it with `tuning.policy.apply(model)`, or save it (`tuning.policy.save(FILE)`, "
                                 f"`tf32lab tune --out FILE`) and load it with `tf32lab.Policy.load(FILE)`: "
                                 f"{gain}{over}."]
        return [self.reason, f"Apply it with `tf32lab.Policy.load({json.dumps(where, ensure_ascii=False)})"
                             f".apply(model)`: {gain}{over}."]

    def lines(self, policy_file: Optional[str] = None, width: Optional[int] = None,
              command: bool = False) -> list[str]:
        """The terminal summary: the search (a table ``width`` columns wide; None: the terminal's), the answer,
        what to do (``command``: in the ``tf32lab tune`` command's words)."""
        out = [f"tf32lab tune {self.workload}  target {self.target}, {tolerance_words(self.tolerance)}"]
        from tf32lab.report.tables import Column, Fitted, as_lines

        # every label whole (it wraps), every number whole, at the terminal's width (report.tables)
        table = Fitted(None, [Column("candidate", "text"), Column("worst/tol"), Column("speedup"),
                              Column("verdict", "text")])
        for c in self.candidates:
            chosen = " <- chosen" if self.policy is not None and c.policy == self.policy and c.passed else ""
            table.add_row(c.why, "-" if c.error is not None else f"{c.worst_ratio:.2f}", f"{c.speedup:.2f}x",
                          f"{c.verdict()}{chosen}")
        out += as_lines(table, width)
        out.append(f"{self.runs} end-to-end runs besides the float64 reference; {self.seconds:.1f} s, "
                   f"{self.seconds / max(self.check_seconds, 1e-9):.2f}x the check of the uniform levels")
        # what the runs need said (a flag the workload changed, the convolutions' math): as check prints them
        return out + notes_apart(self.report) + self.advice(policy_file, command)

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload, "target": self.target, "tolerance": dict(self.tolerance),
            "passed": self.passed, "policy": None if self.policy is None else self.policy.to_dict(),
            "level": self.level, "pinned": list(self.pinned), "speedup": self.speedup, "uniform": self.uniform,
            "speedup_over_uniform": self.speedup_over_uniform, "runs": self.runs, "seconds": self.seconds,
            "check_seconds": self.check_seconds, "reason": self.reason,
            "margin": None if self.policy is None else max((o.normwise / o.tolerance for o in self.outputs
                                                            if o.tolerance > 0), default=0.0),
            "outputs": [{"name": o.name, "normwise": o.normwise, "tolerance": o.tolerance, "passed": o.passed}
                        for o in self.outputs],
            "candidates": [{"pinned": list(c.pinned), "passed": c.passed, "worst_ratio": c.worst_ratio,
                            "seconds": c.seconds, "speedup": c.speedup, "why": c.why, "error": c.error,
                            "policy": c.policy.to_dict()} for c in self.candidates],
            "check": self.report.to_dict(), "conv": self.conv,
        }

    def to_html(self) -> str:
        from tf32lab.report.tune_html import render

        return render(self)


def _ratio(result: LevelResult) -> float:
    """The worst output's error over its tolerance (inf when the model raised or an output failed outright)."""
    if result.error is not None or not result.outputs:
        return math.inf
    worst = 0.0
    for o in result.outputs:
        if o.failure is not None or math.isnan(o.normwise):
            return math.inf
        worst = max(worst, o.normwise / o.tolerance if o.tolerance > 0 else (0.0 if o.normwise == 0 else math.inf))
    return worst


def tune(workload: Union[Workload, TrainingWorkload], *, target: Union[str, Target] = "a100",
         tolerance: Union[float, Mapping[str, float], None] = None,
         levels: Iterable[str] = ("high", "medium", "highest"), progress: bool = False,
         conv: Optional[str] = None) -> Union[Tuning, TrainingTuning]:
    """The fastest policy within tolerance on ``target`` (module docstring); every global setting is as it was
    afterwards. Raises ``Tf32LabError`` for bad input, a target without a speed model, or a model that raises at
    the float64 reference. A :class:`~tf32lab.TrainingWorkload` is tuned by its training
    (``tf32lab.decide.tune_training``: the fastest policy whose training passes, every candidate trained).

    ``conv``: cuDNN's float32 convolution math, which no level sets: ``"tf32"`` or ``"ieee"`` to search under it
    only; None: where the model has convolution modules and the target computes them differently under the two,
    the search runs under ``"tf32"`` (faster) and, if nothing passes there, under ``"ieee"``, whose answer then
    gives back to ``"tf32"`` the convolution layers that still pass there (the policy pins them, a group at once,
    the largest predicted gain first); ``Tuning.conv`` says which math the answer needs for the rest (else
    the flag is left as the process holds it). Convolutions no module shows (TorchScript's, ``F.conv2d``) are
    found as they run: where they ran TF32 and nothing passed, the search runs under ``"ieee"`` too. A training
    workload is searched under the ``conv`` named, or as the flag holds it (``tune_training``).

    Example (a covariance that TF32 breaks: `highest` is the answer):

        >>> import tf32lab
        >>> from tf32lab.workloads import builtin
        >>> tuning = tf32lab.tune(builtin.covariance(), target="a100")
        >>> tuning.passed, tuning.policy.default, tuning.policy.rules
        (True, 'highest', ())
    """
    conv = check_conv(conv, "tune")
    if isinstance(workload, TrainingWorkload):  # the fastest policy whose training passes
        if tolerance is not None and not isinstance(tolerance, (int, float)):
            raise Tf32LabError(f"tune() of a training workload takes one tolerance (the loss's relative "
                               f"deviation), not {type(tolerance).__name__}")
        return tune_training(workload, target=target, tolerance=tolerance, levels=levels, progress=progress,
                             conv=conv)
    if not isinstance(workload, Workload):
        raise not_a_workload("tune", workload, "a tf32lab.Workload or a tf32lab.TrainingWorkload")
    target = resolve_target(target, speed=True)  # tune weighs predicted speed: GPU targets only
    levels = check_levels(levels)
    everything = tuple(level for level in ALL_LEVELS if level in levels or level == "highest")
    tolerances = tolerances_of(tolerance)
    refuse_applied(workload, "tune")
    convs = (conv,) if conv is not None else _conv_choices(workload, target)
    runs, seconds = 0, 0.0  # of every search made (two when TF32 convolutions leave nothing passing)
    with exits_refused(workload.name, "tune"), kept_flags() as changed, eager(workload.model):
        for chosen in convs:  # the faster conv math first; the next only when nothing passes under it
            # under IEEE after TF32 failed everywhere: the answer's cuDNN layers go back to TF32 where they pass
            relax = convs[0] if chosen != convs[0] else None
            with ConvRun(chosen) as conv_run:
                run = _tune(workload, target, tolerances, everything, progress, relax)
            runs, seconds = runs + run.runs, seconds + run.seconds
            if run.answer.policy is not None:
                break
        if run.answer.policy is None and convs == (None,) and flags.read_cells().get("cuda.conv") == "tf32" \
                and families_matter(run.families, target):
            # convolutions or RNNs no module showed (TorchScript's, a functional F.conv2d) ran TF32 and nothing
            # passed: searched under IEEE too, as where the modules show them
            convs, chosen = ("tf32", "ieee"), "ieee"
            with ConvRun(chosen) as conv_run:
                run = _tune(workload, target, tolerances, everything, progress, convs[0])
            runs, seconds = runs + run.runs, seconds + run.seconds
    searched = chosen == "ieee" and convs[0] != "ieee"
    # the conv math matters where the model's modules or the ops the reference ran (TorchScript's) say it does
    matters = chosen is not None and conv_run.moved is None and \
        (conv is None or conv_matters(workload.model, target) or families_matter(run.families, target))
    if matters and (searched or conv is not None):
        run = _stamped(run, chosen)  # a math chosen beyond PyTorch's default, or asked for: the policies set it
    # Built once, whole, here: only now is it known whether the workload changed the flags (a note of the report).
    name, answer = str(workload.name), run.answer
    report = Report(workload=name, target=target.name, reference="float64", tolerance=dict(tolerances),
                    levels=run.levels, environment=run.environment, seconds=run.check_seconds,
                    notes=(*run.notes, *([conv_run.note(searched=conv is None, convolutions="conv" in run.families)]
                                         if chosen else []),
                           *([changed_note(changed)] if changed else [])), speed=run.speed)
    return Tuning(workload=name, target=target.name, tolerance=dict(tolerances), passed=answer.policy is not None,
                  policy=answer.policy, level=answer.level, pinned=answer.pinned, outputs=answer.outputs,
                  speedup=answer.speedup, uniform=answer.uniform, speedup_over_uniform=answer.speedup_over_uniform,
                  candidates=run.candidates, runs=runs, seconds=seconds, check_seconds=run.check_seconds,
                  reason=answer.reason, report=report, conv=chosen if matters else None, conv_searched=searched,
                  scripted=isinstance(workload.model, torch.jit.ScriptModule))


def _conv_choices(workload: Workload, target: Target) -> tuple[Optional[str], ...]:
    """The conv maths worth searching: both (tf32 first) where the model's cuDNN modules compute otherwise under
    the two on ``target``; else None only (the flag as it is)."""
    return ("tf32", "ieee") if conv_matters(workload.model, target) else (None,)


def _stamped(run: _Run, conv: str) -> _Run:
    """``run`` (a search made under cuDNN's ``conv`` math) with that math written into its answer and its
    candidates' policies where they name none: a policy file that sets the flag it passed under."""
    candidates = tuple(dataclasses.replace(c, policy=with_conv_math(c.policy, conv)) for c in run.candidates)
    return run._replace(answer=run.answer._replace(policy=with_conv_math(run.answer.policy, conv)),
                        candidates=candidates)


class _Answer(NamedTuple):
    """What the search decided (:meth:`_Search.run`): the fields of :class:`Tuning` that are its verdict."""

    policy: Optional[Policy]  # None: nothing passes
    level: Optional[str]
    pinned: tuple[str, ...]
    outputs: tuple[OutputError, ...]
    speedup: float
    uniform: Optional[str]
    speedup_over_uniform: float
    reason: str


class _Run(NamedTuple):
    """All one tuning measured, for :func:`tune` to build its :class:`Tuning` and report from."""

    answer: _Answer
    candidates: tuple[Candidate, ...]
    levels: tuple[LevelResult, ...]  # the report's rows: the uniform levels
    notes: tuple[str, ...]
    speed: Any  # the SpeedReport predicted on the target
    environment: dict[str, Any]
    runs: int
    check_seconds: float
    seconds: float
    families: tuple[str, ...]  # the cuDNN families (conv, rnn) the float64 reference ran


def _tune(workload: Workload, target: Target, tolerances: dict[str, float], everything: tuple[str, ...],
          progress: bool, relax: Optional[str] = None) -> _Run:
    """One search under the conv math in force; ``relax``: a faster conv math to give the answer's convolution
    layers back, a group at a time, while it still passes."""
    alike = alike_levels(everything, target)
    distinct = [level for level in everything if alike[level] is None]
    started = time.perf_counter()
    with Progress(progress, steps=1 + len(distinct)) as bar, \
            Session(workload, distinct, target, tolerances, speed=True, bar=bar, command="tune") as session:
        uniform = {level: session.level(level) for level in distinct}
        predicted = session.predicted(everything)
        if predicted is None:
            # the float64 reference ran, but no float32 op was counted: the rows raised before their first
            raised = next((r for r in uniform.values() if r.error is not None), None)
            if raised is None:
                raise Tf32LabError(f"workload {workload.name!r} ran no ops: nothing to tune")
            note = float_inputs_note(workload.inputs) if dtypes_refused(raised.error) else None
            hint = f"; {inputs_held(note)}: give the model float32 inputs " \
                   f"(.float())" if note else ""
            raise Tf32LabError(f"workload {workload.name!r} raised at `{raised.level}` before its first op: "
                               f"{one_line(raised.error)}{hint}")
        check_seconds = time.perf_counter() - started
        families = tuple(family for family, ops in session.recorder.by_family.items() if ops)
        search = _Search(session, workload, alike, uniform, predicted)
        answer = search.run()
        if relax is not None and answer.policy is not None:
            answer = search.relaxed(answer, relax)
        if answer.policy is not None:  # how near the tolerance it is, and why no faster passing candidate won
            ratio = max((o.normwise / o.tolerance if o.tolerance > 0 else 0.0 for o in answer.outputs), default=0.0)
            answer = answer._replace(reason=f"{answer.reason} {margin(ratio)}"
                                            f"{search._passed_over(answer.policy, search.highest / answer.speedup)}")
    levels = tuple(dataclasses.replace(uniform[alike[lv] or lv], level=lv, same_as=alike[lv],
                                       speedup=predicted.level(lv).speedup) for lv in everything)
    return _Run(answer, tuple(search.candidates), levels, tuple(session.notes()), predicted, environment_of(workload),
                session.runs, check_seconds, time.perf_counter() - started, families)


class _Search:
    """Step 2 of the module docstring, with the runs it makes recorded."""

    def __init__(self, session: Session, workload: Workload, alike: dict[str, Optional[str]],
                 uniform: dict[str, LevelResult], predicted: Any) -> None:
        self.session, self.workload, self.alike, self.uniform = session, workload, alike, uniform
        self.predicted = predicted
        self.highest = predicted.level("highest").seconds
        self.candidates: list[Candidate] = []
        self.tried: dict[frozenset[str], Candidate] = {}
        self.results: dict[frozenset[str], LevelResult] = {}
        model = workload.model
        called = session.recorder.called  # (the float64 reference run's)
        # each layer's nearest descendants whose forward ran: the ones a rule can keep at the fast level. Nearest
        # through modules that never run (a ModuleList of blocks): counted under the direct parent only, the blocks
        # inherited a pinned model's level, and pinning the model's own head pinned every block with it.
        self.children: dict[str, list[str]] = {}
        for name, _ in model.named_modules():
            if name and name in called:
                parent = name.rpartition(".")[0]
                while parent and parent not in called:
                    parent = parent.rpartition(".")[0]
                self.children.setdefault(parent or ROOT, []).append(name)

    def seconds(self, level: str) -> float:
        return self.predicted.level(level).seconds

    def run(self) -> _Answer:
        for level, result in self.uniform.items():
            self._record(Policy(default=level), (), result, self.seconds(level), f"uniform {level}")
        passing = sorted((lv for lv, r in self.uniform.items() if r.passed), key=self.seconds)
        fastest = min(self.uniform, key=self.seconds)
        if not passing:
            top = self.session.steady(self.uniform["highest"])
            if top.unstable is not None:
                return self._answer(None, None, (), top, None, nondeterministic(top))
            return self._answer(None, None, (), top, None,
                                f"Not even `highest` is within tolerance on {self.session.target.name} "
                                f"({_failure(top)}): no precision setting fixes that; loosen the tolerance or "
                                f"compute the failing part in float64.")
        safe = passing[0]
        if self.seconds(fastest) * WORTH > self.seconds(safe):  # the fastest level passes, or is not much faster
            return self._answer(Policy(default=safe), safe, (), self.uniform[safe], safe,
                                f"`{safe}` everywhere is within tolerance"
                                + (self._not_faster(passing[1:]) if safe == fastest else
                                   f" (`{fastest}` is at most {WORTH:.2f}x faster)."))
        mixed = self._mixed(fastest, safe)
        if mixed is not None and self.highest / mixed.seconds >= WORTH * self.highest / self.seconds(safe):
            pinned = ", ".join(repr(n) for n in mixed.pinned[:4]) + (" …" if len(mixed.pinned) > 4 else "")
            result = self._result_of(mixed)
            return self._answer(mixed.policy, None, mixed.pinned, result, safe,
                                f"`{fastest}` with {len(mixed.pinned)} layer(s) pinned to `{safe}` ({pinned}) is "
                                f"within tolerance.")
        return self._answer(Policy(default=safe), safe, (), self.uniform[safe], safe,
                            f"`{safe}` everywhere is within tolerance; no mix with `{fastest}` that passes is "
                            f"predicted {WORTH:.2f}x faster.")

    def _not_faster(self, others: list[str]) -> str:
        """The end of the sentence that keeps the fastest level: why the other levels that pass are left (a table
        row "uniform high PASSED 1.00x" beside "keep `highest`" asks it)."""
        if not others:
            return "."
        return f" (`{others[0]}` passes too, predicted {self.highest / self.seconds(others[0]):.2f}x: no faster)."

    # -- candidates -------------------------------------------------------------------------------------------
    def _policy(self, fast: str, safe: str, pinned: Iterable[str]) -> Policy:
        pinned = set(pinned)
        rules: list[tuple[str, str]] = []
        for name in sorted(pinned):
            own = "" if name == ROOT else name
            rules.append((exact_pattern(own), safe))
            # a pinned layer pins its own ops: its children keep the fast level unless pinned themselves. A child
            # whose forward never ran (nn.MultiheadAttention's out_proj: its weight is used by the parent's own
            # ops, measured as the layer's) gets no rule: its weight's ops are the layer's, pinned with it.
            rules += [(exact_pattern(child), fast) for child in self.children.get(name, []) if child not in pinned]
        return Policy(default=fast, rules=rules)

    def _try(self, fast: str, safe: str, pinned: Iterable[str], why: str) -> Candidate:
        key = frozenset(pinned)
        known = self.tried.get(key)
        if known is not None:
            return known
        policy = self._policy(fast, safe, key)
        row = PolicyRow.of(policy, self.workload.model)
        result = self.session.policy(row, self.alike)
        candidate = self._record(policy, tuple(sorted(key)), result, self.session.seconds(row), why)
        self.tried[key] = candidate
        self.results[key] = result
        return candidate

    def _record(self, policy: Policy, pinned: tuple[str, ...], result: LevelResult, seconds: float,
                why: str) -> Candidate:
        candidate = Candidate(policy, pinned, result.passed, _ratio(result), seconds, self.highest / seconds, why,
                              result.error)
        self.candidates.append(candidate)
        return candidate

    def _result_of(self, candidate: Candidate) -> LevelResult:
        return self.results[frozenset(candidate.pinned)]

    def _mixed(self, fast: str, safe: str) -> Optional[Candidate]:
        layers = self.uniform[fast].layers
        gains = {layer.name: layer.seconds[safe] - layer.seconds[fast] for layer in self.predicted.layers}

        def order_key(e) -> float:  # most error per unit of lost time first; unmeasured errors first of all
            if math.isnan(e.introduced):
                return -math.inf
            return -e.introduced / max(gains.get(e.name, 0.0), 1e-12)

        unchanged = self._unchanged(fast, safe)
        order = [e.name for e in sorted(layers, key=order_key) if e.name not in unchanged]
        if not order:
            return None
        # galloping, then bisection, over the prefix length (all layers pinned is `safe` everywhere: it passes)
        low, high, k = 0, len(order), 1
        while k < len(order):
            if self._try(fast, safe, order[:k], f"pin the {k} worst by error per time lost").passed:
                high = k
                break
            low, k = k, k * 2
        while high - low > 1:
            mid = (low + high) // 2
            if self._try(fast, safe, order[:mid], f"pin the {mid} worst (bisection)").passed:
                high = mid
            else:
                low = mid
        if high == len(order):  # from the front, only every layer pinned passes: search from the back
            best = self._from_the_back(fast, safe, order)
            if best is None:  # only every layer pinned passes: that is `safe` everywhere, measured already
                return None
        else:
            best = self.tried[frozenset(order[:high])]
        # un-pin what the workload does not need, the most time-costly first
        pinned = sorted(best.pinned, key=lambda n: -gains.get(n, 0.0))
        best = self._unpin(fast, safe, pinned, best)
        return best

    def _from_the_back(self, fast: str, safe: str, order: list[str]) -> Optional[Candidate]:
        """The shortest suffix of ``order`` that passes pinned (galloping, then bisection), or None when only all of
        it does. Where every prefix but the whole fails, the ranking missed the layer that matters: an error a
        layer's products make that only its parent's own ops reveal (``x + c`` through a layer, then the parent's
        subtraction of ``layer(c)``) is measured as the layer's ordinary rounding, and such a costly layer ranks
        last. log2(layers) runs more, as the front's search."""
        low, high, k = 0, len(order), 1
        while k < len(order):
            if self._try(fast, safe, order[-k:], f"pin the {k} least by error per time lost").passed:
                high = k
                break
            low, k = k, k * 2
        while high - low > 1:
            mid = (low + high) // 2
            if self._try(fast, safe, order[-mid:], f"pin the {mid} least (bisection)").passed:
                high = mid
            else:
                low = mid
        return None if high == len(order) else self.tried[frozenset(order[-high:])]

    def _unchanged(self, fast: str, safe: str) -> set[str]:
        """Layers whose own ops all get the same math at ``fast`` and ``safe`` on the target (cuDNN keeps
        convolutions TF32 at `highest` on a100): pinning one changes nothing, so none is a candidate. Read from the
        maths the uniform runs recorded (the targets table's answer), no scope entered."""
        at_fast, at_safe = self.uniform[fast].maths, self.uniform[safe].maths
        families: dict[str, set[str]] = {}
        for op in self.session.counting.counts.ops if self.session.counting is not None else ():
            if op.family is not None:
                families.setdefault(op.layer, set()).add(op.family)
        return {name for name, found in families.items()
                if all(f in at_fast and at_fast[f] == at_safe.get(f) for f in found)}

    def _unpin(self, fast: str, safe: str, pinned: list[str], best: Candidate) -> Candidate:
        keep = list(pinned)
        groups = [pinned] if len(pinned) > GROUP else [[name] for name in pinned]
        while groups:
            group = groups.pop(0)
            trial = [n for n in keep if n not in group]
            if not trial:  # un-pinning every one is the fast level, which failed: try each half
                if len(group) > 1:
                    half = len(group) // 2
                    groups[:0] = [group[:half], group[half:]]
                continue
            names = ", ".join(repr(n) for n in group[:2]) + (" …" if len(group) > 2 else "")
            candidate = self._try(fast, safe, trial, f"un-pin {names}")
            if candidate.passed:
                keep, best = trial, candidate
            elif len(group) > 1:
                half = len(group) // 2
                groups[:0] = [group[:half], group[half:]]
        return best

    # -- conv maths per module ----------------------------------------------------------------------------------
    def relaxed(self, answer: _Answer, fast: str) -> _Answer:
        """``answer`` (found under the conv math in force, the slow one) with as many cuDNN layers (convolutions,
        RNNs) as still pass run at ``fast``: those whose own cuDNN ops the speed model predicts faster at ``fast``,
        the largest gain first, a group at once, halved on failure, as :meth:`_unpin` does. Taken only where it is
        predicted ``WORTH`` faster than ``answer`` (each pinned module flips cuDNN's process-wide flag); else
        ``answer`` itself, and no run is made where even all of them together would not be."""
        row = PolicyRow.of(answer.policy, self.workload.model)

        def level_of(layer: str) -> str:
            return row.by_name.get(layer, row.base)

        gains = self._conv_gains(level_of, fast)
        now = self.session.seconds(row)
        if not gains or now < (now - sum(gains.values())) * WORTH:
            return answer
        order = sorted(gains, key=lambda name: -gains[name])
        base, chosen, best = answer.policy, [], None
        groups = [order] if len(order) > GROUP else [[name] for name in order]
        while groups:
            group = groups.pop(0)
            names = ", ".join(repr(n) for n in group[:2]) + (" …" if len(group) > 2 else "")
            trial = _with_conv(base, chosen + group, fast, self.children)
            candidate, result = self._run(trial, answer.pinned, f"cuDNN {fast}, {len(group)} more: {names}")
            if candidate.passed:
                chosen, best = chosen + group, (candidate, result)
            elif len(group) > 1:
                half = len(group) // 2
                groups[:0] = [group[:half], group[half:]]
        if best is None or now < best[0].seconds * WORTH:
            return answer
        candidate, result = best
        moved = ", ".join(repr(n) for n in sorted(chosen)[:4]) + (" …" if len(chosen) > 4 else "")
        return answer._replace(
            policy=candidate.policy, level=None, outputs=result.outputs, speedup=candidate.speedup,
            speedup_over_uniform=(self.seconds(answer.uniform) if answer.uniform else self.highest) / candidate.seconds,
            reason=f"{answer.reason.rstrip('.')}, with IEEE cuDNN ops; of the {len(order)} cuDNN layer(s) "
                   f"(convolutions, RNNs) that {fast!r} is predicted to speed up, {len(chosen)} still pass at it "
                   f"({moved}): the policy runs them so.")

    def _conv_gains(self, level_of: Callable[[str], str], fast: str) -> dict[str, float]:
        """Layers whose own ops run faster at the conv math ``fast`` (predicted), and by how much."""
        counts = self.session.counting.counts if self.session.counting is not None else None
        if counts is None:
            return {}
        target = self.session.target
        layers = {op.layer for op in counts.ops if op.family in ("conv", "rnn") and op.layer != ROOT}
        now = seconds_at(counts, target, level_of)
        gains = {name: now - seconds_at(counts, target, level_of, lambda layer, n=name: fast if layer == n else None)
                 for name in sorted(layers)}
        return {name: gain for name, gain in gains.items() if gain > 0}

    def _run(self, policy: Policy, pinned: tuple[str, ...], why: str) -> tuple[Candidate, LevelResult]:
        row = PolicyRow.of(policy, self.workload.model)
        result = self.session.policy(row, self.alike)
        return self._record(policy, pinned, result, self.session.seconds(row), why), result

    def _answer(self, policy: Optional[Policy], level: Optional[str], pinned: tuple[str, ...],
                result: LevelResult, uniform: Optional[str], reason: str) -> _Answer:
        seconds = next((c.seconds for c in self.candidates if c.policy == policy and c.passed), self.highest)
        uniform_seconds = self.seconds(uniform) if uniform else self.highest
        return _Answer(policy, level, pinned, result.outputs, self.highest / seconds, uniform,
                       uniform_seconds / seconds, reason)


    def _passed_over(self, policy: Policy, seconds: float) -> str:
        """Why the fastest candidate that passed and is predicted faster than the answer was not taken ("" when
        none is)."""
        faster = [c for c in self.candidates if c.passed and c.policy != policy and c.seconds < seconds]
        if not faster:
            return ""
        best = min(faster, key=lambda c: c.seconds)
        gain = seconds / best.seconds
        if gain < WORTH:
            why = (f"predicted only {gain:.2f}x faster than the answer, under the {WORTH:.2f}x tune asks of a "
                   "policy with more pins or levels (the speed model's error, and a scope switch at each pinned "
                   "module, would eat less)")
        else:
            why = f"predicted {gain:.2f}x faster; the search kept the policy it reached by pinning and un-pinning"
        return f" Passed over: {best.why!r}, which passes too ({best.speedup:.2f}x over `highest`): {why}."


THIN = 0.9  # a worst output above this share of its tolerance is called a thin margin


def margin(ratio: float) -> str:
    """One sentence on how close the worst output is to its tolerance.

    >>> margin(0.997)
    'Its worst output is at 0.997 of the tolerance: a thin margin (another input or GPU may cross it).'
    >>> margin(0.05)
    'Its worst output is at 0.050 of the tolerance.'
    >>> margin(0.9996)
    'Its worst output is at the tolerance itself (ratio 0.9996): a thin margin (another input or GPU may cross it).'
    >>> margin(3.7e-05)
    'Its worst output is at 3.7e-05 of the tolerance.'
    """
    thin = ": a thin margin (another input or GPU may cross it)" if ratio >= THIN else ""
    if f"{ratio:.3f}" == "1.000" and ratio != 1:  # 0.9996 passes, 1.0004 does not: the digits that tell them apart
        digits = next(n for n in range(4, 17) if float(f"{ratio:.{n}f}") != 1 or n == 16)
        return f"Its worst output is at the tolerance itself (ratio {ratio:.{digits}f}){thin}."
    shown = f"{ratio:.3f}" if ratio == 0 or ratio >= 0.001 else f"{ratio:.1e}"  # not 0.000 for a float32-sized error
    return f"Its worst output is at {shown} of the tolerance{thin}."


def _with_conv(policy: Policy, fast: Iterable[str], conv: str, children: dict[str, list[str]]) -> Policy:
    """``policy`` with the layers ``fast`` at the conv math ``conv``: their own convolutions only (a child keeps
    the flag's math unless it is one of them). One rule per module, as the first matching rule decides."""
    fast = set(fast)
    entries: dict[str, list[Optional[str]]] = {rule.pattern: [rule.level, rule.conv] for rule in policy.rules}
    for name in sorted(fast):
        entries.setdefault(exact_pattern(name), [None, None])[1] = conv
        for child in children.get(name, []):
            if child not in fast:
                entries.setdefault(exact_pattern(child), [None, None])[1] = policy.conv or _other(conv)
    return Policy(default=policy.default, rules=[(p, level, c) for p, (level, c) in entries.items()],
                  conv=policy.conv or _other(conv))


def _other(conv: str) -> str:
    return "ieee" if conv == "tf32" else "tf32"


def _failure(result: LevelResult) -> str:
    if result.error is not None:
        return f"the model raises {result.error.splitlines()[0]}"
    worst = result.worst
    if worst is None:
        return "no output to compare"
    if worst.failure is not None:
        return f"output {worst.name!r}: {worst.failure}"
    return f"output {worst.name!r} is off by {worst.normwise:.1e}, tolerance {worst.tolerance:.0e}"
