"""``tune(training_workload)``: the fastest policy whose training passes on a target, every candidate trained.

1. **Uniform levels.** One training session (``measure.training.TrainingSession``): the float64 reference,
   float32's floor, then each distinct reduced level, the fastest first. The fastest level whose training passes
   is the answer.
2. **Pins.** When the fastest reduced level ``F`` fails, the module that owns the parameter whose step-1 gradient
   is furthest from float64's is pinned to ``highest`` (the rest at ``F``) and the policy is trained; while it
   still fails, the module owning the worst gradient of *that* run is added, up to ``MAX_PINS`` modules. A step
   that fails before any gradient falls back to the module whose own backward introduces the most error. The
   first policy that passes is the answer, less each earlier pin it still passes without (one run each: the
   culprits were found one at a time, and a later one can make an earlier one unneeded); none within
   ``MAX_PINS``: the fastest uniform level that passes (``highest`` when float32 itself trains).
3. Every candidate is a full training run compared with float64 and float32's floor; none is chosen without one.
   Fewer pins are faster (each pin runs its module's products in IEEE), so the search stops at the first pass.
   As in a forward tune, a pinned policy is taken only where a training step is predicted at least ``WORTH``
   (1.10x) as fast as at ``highest`` (``check_training``'s prediction), and none is tried where the fastest level
   itself would not gain that; else ``highest`` (where float32 itself passes). A uniform level that passes is
   taken whatever its speedup, which the answer states.
4. **Convolutions.** cuDNN's conv math is no level's: ``conv="tf32"`` or ``"ieee"`` runs the whole search under
   it (set for the run and put back, as ``check_training(conv=)``), and the answer says which math it needs.
   Unlike a forward tune, no second search is made under IEEE when nothing passes at TF32: float32's floor is
   trained as the target computes ``highest``, TF32 convolutions included, so ``highest`` always passes there.
   None: the convolutions run as the process's flag holds them.

Example:

    >>> import torch, tf32lab
    >>> data = [(torch.randn(32, 16), torch.randn(32, 1)) for _ in range(3)]
    >>> w = tf32lab.TrainingWorkload(torch.nn.Linear(16, 1), data, inputs=lambda b: b[0],
    ...                              loss=lambda o, b: (o - b[1]).pow(2).mean())
    >>> tuning = tf32lab.tune(w, target="a100")
    >>> tuning.level, tuning.pinned, tuning.passed
    ('high', (), True)
    >>> "buys little" in tuning.reason                  # a model this small gains nothing from TF32
    True
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from tf32lab.control.policy import Policy, exact_pattern
from tf32lab.decide.conv_maths import IEEE_CONV_FLAGS, conv_matters, families_matter, with_conv_math
from tf32lab.errors import Tf32LabError
from tf32lab.know.levels import ALL_LEVELS, check_conv, check_levels
from tf32lab.know.targets import Target
from tf32lab.machine.hardware import resolve_target
from tf32lab.measure.check import ConvRun, PolicyRow, alike_levels
from tf32lab.measure.training import (
    TrainingSession,
    cudnn_floor_note,
    ran_at_the_flag,
    random_state_kept,
    scripted_rnn_note,
    training_steps,
    training_tolerance,
)
from tf32lab.report import Document
from tf32lab.report.conclusion import WORTH
from tf32lab.report.training import FLOOR, TrainingLevel, TrainingReport, changed_layers, faster
from tf32lab.report.wording import tolerance_words
from tf32lab.workloads.running import (
    Progress,
    autograd_on,
    changed_note,
    exits_refused,
    kept_flags,
    refuse_applied,
)
from tf32lab.workloads.training import TrainingWorkload

__all__ = ["MAX_PINS", "TrainingCandidate", "TrainingTuning", "tune_training"]

MAX_PINS = 6  # modules pinned before the search gives up on a mixed policy


@dataclass(frozen=True)
class TrainingCandidate:
    """One policy trained: the modules it pins, its verdict, its loss drift (over float32's own) and why tried."""

    policy: Policy
    pinned: tuple[str, ...]
    passed: bool
    multiple: float
    failure: Optional[str]
    why: str


@dataclass(frozen=True)
class TrainingTuning(Document):
    """The result of :func:`tune` for a training workload. ``passed``: a policy whose training passes was found
    (``policy``); ``level`` is set when it is uniform."""

    workload: str
    target: str
    steps: int
    passed: bool
    policy: Optional[Policy]
    level: Optional[str]
    pinned: tuple[str, ...]
    candidates: tuple[TrainingCandidate, ...]
    runs: int  # float32 trainings, the floor included
    seconds: float
    reason: str
    report: TrainingReport  # the uniform levels (and the chosen policy's row, when mixed)
    policy_file: Optional[str] = None
    conv: Optional[str] = None  # cuDNN's conv math the search ran under ("tf32" / "ieee"); None: the flag as it was
    scripted: bool = False  # the model is TorchScript, which takes no hooks: no policy applies to it

    def __bool__(self) -> bool:
        return self.passed

    def advice(self, policy_file: Optional[str] = None, command: bool = False) -> list[str]:
        where = policy_file or self.policy_file
        if not self.passed:
            return [self.reason]
        if self.level is not None:
            lines = [f"{self.reason} Use `torch.set_float32_matmul_precision(\"{self.level}\")` or "
                     f"`tf32lab.precision(\"{self.level}\")` for this training."]
        else:
            apply = f"`tf32lab.Policy.load(\"{where}\").apply(model)`" if where else \
                "`tf32lab.Policy.load(FILE).apply(model)` once written with `--out FILE`" if command else \
                "`tuning.policy.apply(model)` (or save it: `tf32lab tune --train --out FILE`)"
            lines = [self.reason, f"Apply it with {apply} before training."]
        if self.conv is not None:
            lines.append(f"It holds with convolutions (and cuDNN's RNNs) at {self.conv!r}" + (
                ", PyTorch's default." if self.conv == "tf32" else
                ": " + IEEE_CONV_FLAGS
                + (", or apply the policy, which sets it itself" if self.policy.conv == self.conv and
                   not self.scripted else "")
                + "; no level sets it."))
        return lines

    def lines(self, policy_file: Optional[str] = None, width: Optional[int] = None,
              command: bool = False) -> list[str]:
        """The terminal summary: the search (a table ``width`` columns wide; None: the terminal's), the answer,
        what to do."""
        out = [f"tf32lab tune --train {self.workload}  target {self.target}, {self.steps} steps, "
               f"{tolerance_words(self.report.tolerance)}"]
        out += [lv_line for lv_line in self.report.verdicts()]
        if self.candidates:
            from tf32lab.report.tables import Column, Fitted, as_lines

            # every label whole (it wraps), every number whole, at the terminal's width (report.tables)
            table = Fitted(None, [Column("candidate (pinned to highest)", "text"), Column("x float32"),
                                  Column("verdict", "text")])
            for c in self.candidates:
                chosen = " <- chosen" if c.passed and c.policy == self.policy else ""
                shown = f"{c.multiple:.1f}x" if math.isfinite(c.multiple) else "failed"
                table.add_row(c.why, shown, f"{'PASSED' if c.passed else 'FAILED'}{chosen}")
            out += as_lines(table, width)
        out.append(f"{self.runs} float32 trainings besides the float64 reference; {self.seconds:.1f} s")
        # what the runs need said (a flag the workload changed, the convolutions' math): as check prints them
        return out + list(self.report.notes) + self.advice(policy_file, command)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "training-tuning", "workload": self.workload, "target": self.target, "steps": self.steps,
            "passed": self.passed, "policy": None if self.policy is None else self.policy.to_dict(),
            "level": self.level, "pinned": list(self.pinned), "runs": self.runs, "seconds": self.seconds,
            "reason": self.reason, "conv": self.conv,
            "candidates": [{"pinned": list(c.pinned), "passed": c.passed, "multiple": c.multiple,
                            "failure": c.failure, "why": c.why, "policy": c.policy.to_dict()}
                           for c in self.candidates],
            "check": self.report.to_dict(),
        }

    def to_html(self) -> str:
        """The training report of the uniform levels (and the chosen policy), headed by the search's answer."""
        page = self.report.to_html()
        from tf32lab.report.html import with_code

        head = "".join(f"<p>{with_code(line)}</p>" for line in self.advice())  # escaped, `code` as <code>
        return page.replace('<div class="conclusion">', f'<div class="conclusion"><h2>tune</h2>{head}', 1)


def tune_training(workload: TrainingWorkload, *, target: Union[str, Target] = "a100",
                  tolerance: Optional[float] = None, levels: Iterable[str] = ("high", "medium", "highest"),
                  steps: Optional[int] = None, progress: bool = False, conv: Optional[str] = None) -> TrainingTuning:
    """The fastest policy whose training passes on ``target`` (module docstring); every global setting, the
    model and the random state are as they were afterwards. ``tune()`` calls it for a training workload.
    ``conv``: cuDNN's float32 convolution math to search under, ``"tf32"`` or ``"ieee"`` (None: the flag as the
    process holds it)."""
    if not isinstance(workload, TrainingWorkload):
        raise Tf32LabError(f"tune_training() takes a tf32lab.TrainingWorkload, not {type(workload).__name__}")
    target = resolve_target(target, speed=True)  # "fastest" needs a GPU whose levels differ in speed, as tune
    levels = check_levels(levels)
    steps = training_steps(workload, steps)
    tolerance = training_tolerance(tolerance)
    conv = check_conv(conv, "tune")
    refuse_applied(workload, "tune")  # type: ignore[arg-type]  # it reads .model and .name
    started = time.perf_counter()
    with exits_refused(workload.name, "tune"), kept_flags() as changed, autograd_on(), \
            random_state_kept(workload.model, "tune --train"), ConvRun(conv) as conv_run:
        search = _Search(TrainingSession(workload, target, steps, tolerance), levels, progress)
        found = search.run()
    # the answer's predicted speedup of a training step (its rows carry theirs, as check_training's do)
    mixed = found.policy is not None and found.level is None
    answer = next((row for row in found.rows if row.level == ("policy" if mixed else found.level)), None)
    if answer is not None and found.level != "highest":
        found = dataclasses.replace(found, reason=found.reason.rstrip(".") + faster(answer, target.name) + ".")
    report = search.session.report(found.rows, time.perf_counter() - started)
    rnns = scripted_rnn_note(workload.model, target)
    # the search's policies leave cuDNN's flag alone: float32's own row ran the convolutions as every row did
    floor_tf32 = None if conv is not None else cudnn_floor_note(search.session.families, target,
                                                                 search.session.op_maths.get(FLOOR, {}))
    notes = ([conv_run.note(**ran_at_the_flag(search.session))] if conv is not None else []) + \
        ([changed_note(changed)] if changed else []) + ([rnns] if rnns is not None else []) + \
        ([floor_tf32] if floor_tf32 is not None else [])
    # the math matters where the model's modules or the ops its rows ran (TorchScript's convolutions) say it does
    matters = conv_matters(workload.model, target) or \
        families_matter({f for f in search.session.families if f is not None}, target)
    if conv is not None and (conv_run.moved is not None or not matters):
        conv = None  # the workload wrote another math (the note says so), or no op the math changes
    elif conv is not None:  # the policies set the math they were trained under
        found = dataclasses.replace(found, policy=with_conv_math(found.policy, conv))
        search.candidates = [dataclasses.replace(c, policy=with_conv_math(c.policy, conv)) for c in search.candidates]
    if notes:
        report = dataclasses.replace(report, notes=(*report.notes, *notes))
    return TrainingTuning(
        workload=str(workload.name), target=target.name, steps=steps, passed=found.policy is not None,
        policy=found.policy, level=found.level, pinned=found.pinned, candidates=tuple(search.candidates),
        runs=search.session.runs, seconds=time.perf_counter() - started, reason=found.reason, report=report,
        conv=conv, scripted=isinstance(workload.model, torch.jit.ScriptModule))


@dataclass(frozen=True)
class _Found:
    policy: Optional[Policy]
    level: Optional[str]
    pinned: tuple[str, ...]
    reason: str
    rows: tuple[TrainingLevel, ...]


class _Search:
    def __init__(self, session: TrainingSession, levels: tuple[str, ...], progress: bool) -> None:
        self.session, self.levels, self.progress = session, levels, progress
        self.candidates: list[TrainingCandidate] = []

    def run(self) -> _Found:
        session, target = self.session, self.session.target
        ordered = tuple(level for level in reversed(ALL_LEVELS) if level in self.levels or level == "highest")
        alike = alike_levels(tuple(reversed(ordered)), target)  # highest first: what computes as highest is it
        distinct = [level for level in ordered if level != "highest" and alike[level] is None]
        with Progress(self.progress, steps=2 + len(distinct) + 2 * MAX_PINS - 1) as bar:  # pins, then drops
            session.start(bar)
            uniform: dict[str, TrainingLevel] = {}
            for level in distinct:  # the fastest first
                bar.step(f"{level}: {session.steps} steps")
                uniform[level] = session.level(level)
            floor = session.floor(bar)  # after a level: natively when the target's `highest` is IEEE there
            uniform = {level: session.judged(row) for level, row in uniform.items()}
            uniform["highest"] = dataclasses.replace(floor, level="highest")
            rows = tuple(uniform[level] if alike[level] is None else
                         dataclasses.replace(uniform[alike[level]], level=level, same_as=alike[level])
                         for level in reversed(ordered))
            rows = tuple(session.with_speed(list(rows), None))  # each row's predicted training-step speedup
            speed = {row.level: row.speedup for row in rows}
            for level in distinct:  # as a forward tune: a passing level is taken, its speedup said (even if 1.00x)
                if uniform[level].passed:
                    return _Found(Policy(level), level, (), f"`{level}` trains within tolerance on "
                                  f"{target.name}: no module needs a safer level.", rows)
            if not distinct:
                return self._uniform_fallback(uniform, rows, "no reduced level to try")
            fast = distinct[0]
            # a pinned policy is slower than its level: where that level buys too little, no pin can pay (unless
            # float32 itself fails, and a pinned policy is the only hope)
            if _slow(speed.get(fast)) and uniform["highest"].passed:
                return self._uniform_fallback(uniform, rows, (
                    f"`{fast}` fails ({_why(uniform[fast])}), and a training step there is predicted only "
                    f"{speed[fast]:.2f}x as fast as at `highest` on {target.name} (tune's threshold: "
                    f"{WORTH:.2f}x), so no pinned policy is worth trying"))
            last, pinned = uniform[fast], []
            for _ in range(MAX_PINS):
                module = _culprit(last, pinned, uniform["highest"])
                if module is None:
                    break
                pinned.append(module)
                policy, row = self._trained(fast, pinned, bar)
                if row.passed:
                    # the culprits were added one at a time: an earlier one may not be needed with a later one in
                    for module in pinned[:-1]:
                        fewer = [m for m in pinned if m != module]
                        trial, trial_row = self._trained(fast, fewer, bar, f" (without {module})")
                        if trial_row.passed:
                            pinned, policy, row = fewer, trial, trial_row
                    row = session.with_speed([row], PolicyRow.of(policy, session.saved))[0]
                    passes = (f"`{fast}` fails ({_why(uniform[fast])}); with {', '.join(map(repr, pinned))} at "
                              f"`highest` training passes on {target.name} ({row.multiple:.1f}x float32's own "
                              f"drift)")
                    if _slow(row.speedup) and uniform["highest"].passed:  # as a forward tune's mixed policy
                        return self._uniform_fallback(uniform, rows, (
                            f"{passes}, but a training step is then predicted only {row.speedup:.2f}x as fast as "
                            f"at `highest` on {target.name} (tune's threshold: {WORTH:.2f}x)"))
                    return _Found(policy, None, tuple(pinned), passes + ".", (*rows, row))
                last = row
            tried = (f"no policy of up to {MAX_PINS} pinned modules passes" if pinned else
                     f"no module to pin (none below the model has parameters and computes otherwise at `{fast}` "
                     f"than in float32)")
            return self._uniform_fallback(uniform, rows, f"`{fast}` fails ({_why(uniform[fast])}) and {tried}")

    def _trained(self, fast: str, pinned: list[str], bar: Progress, why: str = "") -> tuple[Policy, TrainingLevel]:
        """``fast`` with the modules ``pinned`` at ``highest``, trained and judged; recorded as a candidate."""
        session = self.session
        policy = Policy(fast, [(exact_pattern(m), "highest") for m in pinned])
        bar.step(f"{fast} with {len(pinned)} module(s) at highest{why}: {session.steps} steps")
        row = session.judged(session.policy(PolicyRow.of(policy, session.saved)))
        self.candidates.append(TrainingCandidate(policy, tuple(pinned), row.passed, row.multiple, row.failure,
                                                 f"{fast}, pinned: {', '.join(pinned)}{why}"))
        return policy, row

    def _uniform_fallback(self, uniform: dict[str, TrainingLevel], rows: tuple[TrainingLevel, ...],
                          why: str) -> _Found:
        top = uniform["highest"]
        if top.passed:
            return _Found(Policy("highest"), "highest", (), f"{why}: keep `highest`.", rows)
        return _Found(None, None, (), f"{why}; float32 itself (`highest`) fails ({_why(top)}): no precision "
                                      f"setting makes this training pass.", rows)


def _slow(speedup: Optional[float]) -> bool:
    """A predicted speedup that buys too little to take a reduced level or a pinned policy for (None: not
    predicted, so taken)."""
    return speedup is not None and speedup < WORTH


def _why(row: TrainingLevel) -> str:
    if row.failure is not None:
        return f"step {row.failed_step}: {row.failure.splitlines()[0]}"
    return f"diverges at step {row.divergence_step}, {row.multiple:.0f}x float32's own drift"


def _culprit(row: TrainingLevel, pinned: list[str], floor: TrainingLevel) -> Optional[str]:
    """The module owning the worst step-1 gradient not yet pinned; without gradients, the module whose backward
    introduces the most error. A module the level computes as float32 does (an embedding, a norm: no
    matmul-family op of its own; ``changed_layers``) is never one: pinning it would change nothing."""
    changed = changed_layers(row, floor)
    alike = {e.name for e in row.layers} - {e.name for e in changed}
    names = [g.name.rpartition(".")[0] for g in row.gradients] + [e.name for e in changed]
    return next((name for name in names if name and name not in pinned and name not in alike), None)

