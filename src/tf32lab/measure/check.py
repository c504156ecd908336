"""``check(workload)``: how much each precision level changes a model, output by output and layer by layer.

One run of the model in float64 (``tf32lab.measure.reference``: the float32 model itself, every op widened, no copy)
gives the reference. During it, each module that runs matmul-family ops itself (a *layer*) is hooked: its
float64 output is kept. Then, per level, under ``precision(level)`` and ``emulate(target)`` (or on the real
hardware with ``target="native"``), one end-to-end run gives the outputs' errors and each layer's *accumulated*
error. Where a level fails, the reference runs once more, and right after each layer call the layer is run again
in float32 under that level, fed the inputs it just had, with the layers nested in it answering with their
reference outputs: the error it *introduces* with its own ops, which says which layer to pin
(``introduced="all"``: at every level, in the first pass). No layer's inputs are stored, so the memory is the
model's, one level's activations and the reference outputs of the layers.

A level at which the model raises is a result (``LevelResult.error``), not a crash: a Cholesky that fails under
TF32 is what check is for. A model that raises at the reference, in float64, is bad input (``Tf32LabError``).
Where control flow depends on the data (a detector keeping another number of boxes), a layer whose call cannot be
matched with the reference's is *diverged*, with the reason, and the rest of the report stands.

This module never touches flags itself: it runs the workload inside ``scope`` / ``emulate`` contexts, so every
global setting is as it was afterwards, also when the model raises. The model's train/eval modes are restored.

Example:

    >>> import torch, tf32lab
    >>> w = tf32lab.Workload(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4)),
    ...                      torch.randn(32, 256), name="mlp")
    >>> report = tf32lab.check(w, levels=("high",))
    >>> sorted(layer.name for layer in report.level("high").layers), bool(report)   # its two layers, and the verdict
    (['0', '1'], True)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, Callable, Optional, TypeVar, Union

import torch

from tf32lab.control import flags, modestack
from tf32lab.control.policy import Policy
from tf32lab.control.scope import conv_math, get_float32_matmul_precision
from tf32lab.emulation.emulator import check_accumulation, context_cells, release_buffers
from tf32lab.emulation.reuse import KEPT, Handoff, alike
from tf32lab.errors import Tf32LabError
from tf32lab.know import optable
from tf32lab.know.levels import ALL_LEVELS, LEVELS, check_levels, with_conv
from tf32lab.know.targets import CUDNN_CELL, Target, counted_math, cudnn_cell, rnn_math
from tf32lab.machine.distributed import agree, policy_digest
from tf32lab.machine.hardware import resolve_target
from tf32lab.measure import resolution, sharded
from tf32lab.measure.choices import ChoiceLog, compared
from tf32lab.measure.draws import DrawLog, Streams, cuda_devices, draw_plan, lazy_note, materialised
from tf32lab.measure.given import KeptInputs, inputs_note
from tf32lab.measure.layers import (
    ROOT,
    Accumulated,
    Recorder,
    described,
    float64_scripted,
    level_context,
    out_of_memory,
)
from tf32lab.measure.reference import storage_address, widen
from tf32lab.measure.scales import Formed
from tf32lab.measure.sharded import Ranks, collective_failure, ranks_fail
from tf32lab.measure.spill import SpillFile, min_bytes_from_env
from tf32lab.measure.state import state_kept, stateful_note, written_note
from tf32lab.numbers import metrics
from tf32lab.numbers.metrics import tolerances_of
from tf32lab.numbers.origin import internal_error
from tf32lab.numbers.trees import map_tensors, named_leaves, named_tensors
from tf32lab.report import LayerError, LevelResult, Report, cudnn
from tf32lab.report.conclusion import (
    BELOW_FLOAT32,
    BEYOND_FLOAT32,
    DRAWS_UNMATCHED,
    INPUTS_NOT_FLOAT32,
    NO_FAMILY_OPS,
    PINNED_CONV,
)
from tf32lab.speed.counting import Counting, OtherThreads
from tf32lab.speed.prediction import SpeedReport, predict_counts, seconds_at
from tf32lab.workloads.eager import eager
from tf32lab.workloads.running import Progress, changed_note, environment_of, exits_refused, kept_flags, refuse_applied
from tf32lab.workloads.workload import Workload, eval_mode, not_a_workload, training_note

__all__ = ["PolicyRow", "Session", "alike_levels", "check", "dtypes_refused", "float_inputs_note", "policy_maths",
           "rows_of_alike"]

REFERENCES = ("float64",)
INTRODUCED = ("failing", "all")  # check(introduced=...): where the layers are rerun
_T = TypeVar("_T")




def check(workload: Workload, *, levels: Iterable[str] = LEVELS, target: Union[str, Target] = "a100",
          reference: str = "float64", tolerance: Union[float, Mapping[str, float], None] = None, progress: bool = False,
          policy: Optional[Policy] = None, speed: bool = True, accumulation: Optional[str] = None,
          conv: Optional[str] = None, introduced: str = "failing") -> Report:
    """Measure ``workload`` at each level against a float64 reference, as ``target`` would compute it.

    Args:
        levels: precision levels to check, in order.
        target: a hardware profile from ``tf32lab.targets`` (emulated on this machine), or ``"native"`` to run
            the levels on the hardware the model is on.
        reference: ``"float64"`` (every op of the model in float64, IEEE).
        tolerance: the largest normwise relative error an output may have: a number, or a dict of output names
            with an optional ``"default"``; by default ``metrics.DEFAULT_TOLERANCE`` (1e-2, see there why).
        progress: show a progress bar on stderr.
        policy: a :class:`~tf32lab.Policy` measured as one more row, ``"policy"``, after the levels: the model
            runs with it applied (its default None: the level in force where ``check`` is called), and each
            layer's introduced error is the one at the level and cuDNN conv math the policy gives it (a layer
            pinned to another conv math is rerun at it too).
        speed: predict each level's speedup on the target (``tf32lab.predict``; GPU targets), counted during
            the first end-to-end run.
        accumulation: how emulated GEMMs sum their products, ``"ideal"`` or ``"hardware"`` (``emulate()``'s
            argument; None: the ``TF32LAB_ACCUMULATION`` setting, ``"ideal"`` by default).
        conv: cuDNN's float32 convolution math for every row, ``"tf32"`` or ``"ieee"``
            (``torch.backends.cudnn.conv.fp32_precision``, which no level sets; None: as the process's flag holds
            it, PyTorch's default ``tf32``), set for the run and put back (``control.scope.conv_math``).
        introduced: at which levels each layer's *introduced* error (its own ops' rounding: the layer run again
            on the reference's inputs) is measured. ``"failing"`` (default): at the levels that fail, where it says
            which layer to pin, by one more float64 pass after the rows; a level that passes reports each layer's
            accumulated error only (``LevelResult.reruns`` False). ``"all"``: at every level, in the reference's
            one pass, for one more run of every layer per level. With ``policy``, every level is rerun.

    Returns a :class:`~tf32lab.report.Report`; ``bool(report)`` is the verdict. Raises ``Tf32LabError`` for bad
    arguments, a model that raises at the float64 reference, an output with nothing to compare, or no memory.

    Example:

        >>> import tf32lab
        >>> from tf32lab.workloads import builtin
        >>> report = tf32lab.check(builtin.covariance(), levels=("highest", "high"))
        >>> report.level("highest").passed, report.level("high").passed
        (True, False)
    """
    if not isinstance(workload, Workload):
        raise not_a_workload("check", workload)
    if resolution.running():  # its every op widened by that run's modes: each level's error read 0.0
        raise Tf32LabError(f"check of {workload.name!r} called inside another check's float64 reference run (from a "
                           f"model's forward or one of its hooks); call it outside the checked workload")
    levels = check_levels(levels)
    target = resolve_target(target)
    refuse_native_levels(levels, target)
    if reference not in REFERENCES:
        raise Tf32LabError(f"unknown reference {reference!r}; accepted: {', '.join(map(repr, REFERENCES))}")
    tolerances = tolerances_of(tolerance)
    accumulation = check_accumulation(accumulation)
    if not isinstance(introduced, str) or introduced not in INTRODUCED:  # an array's == is no bool
        raise Tf32LabError(f"introduced must be {' or '.join(map(repr, INTRODUCED))}, not {introduced!r}")
    conv_scope = ConvRun(conv)
    refuse_applied(workload, "check")
    ranks = Ranks.of_job()  # in a job of several ranks: the model is sharded over them, the errors reduced
    with exits_refused(workload.name, "check"), kept_flags() as changed, ranks_fail(ranks), conv_scope, \
            eager(workload.model):
        if ranks is not None:  # ranks at other levels would measure other things, and run other collectives
            agree(ranks.group, model=workload.model, also={
                "check levels": ",".join(levels), "check target": target.name, "check reference": reference,
                "check tolerance": repr(tolerances), "check accumulation": accumulation, "check conv": str(conv),
                "check policy": policy_digest(policy), "check speed": str(speed), "check introduced": introduced})
        report = _check(workload, levels, target, reference, tolerances, progress and (ranks is None or
                        ranks.rank == 0), policy, speed, accumulation, ranks, conv, introduced)
        if ranks is not None:  # every rank done before any leaves, or writes the report (and none ran more)
            ranks.meet("the end of the check")
    if conv is not None:
        ran = {family.family for family in report.cudnn}
        report = dataclasses.replace(report, notes=(*report.notes, conv_scope.note(
            policy, cpu=target.device == "cpu", convolutions="conv" in ran, rnns="rnn" in ran)))
    return _noted(report, changed)


def refuse_native_levels(levels: Iterable[str], target: Target) -> None:
    """On ``native`` (levels run for real), a one-line error for a level this torch cannot set (``bfx9`` before
    pytorch#195301), before anything runs: an emulated target that has it computes it on any torch."""
    if target.emulated:
        return
    for level in levels:
        reason = flags.native_refusal(level)
        if reason is not None:
            raise Tf32LabError(f"level {level!r} on target 'native' (this machine, run for real): {reason}; a "
                               f"target that has it computes it emulated on any torch (target 'b200')")


def conv_note(conv: str, policy: Optional[Policy] = None, searched: bool = False, moved: Optional[str] = None,
              cpu: bool = False, cudnn_off: bool = False, convolutions: bool = True, rnns: bool = False) -> str:
    """The report's note on a conv math named by the caller (``searched``: chosen by ``tune`` itself); ``policy``:
    the policy row's, whose pins of another conv math it names (the row ran those modules at theirs); ``moved``:
    the math the workload wrote into the flag meanwhile (:class:`ConvRun`); ``cpu``: the target is a CPU, which
    does not read cuDNN's flag; ``cudnn_off``: ``torch.backends.cudnn.enabled`` was False for the run, so no GPU
    reads it either; ``convolutions``: whether the model ran any (False: the note says none ran, not that they
    ran at the flag); ``rnns``: whether it ran cuDNN RNNs, which the flag sets too (named where they ran)."""
    if not convolutions and not rnns:
        return (f"conv={conv!r} set cuDNN's convolution flag (torch.backends.cudnn.conv.fp32_precision) for the "
                f"check's rows, and put it back; the model ran no convolution")
    if cudnn_off and not cpu:  # the rows ran them at each level's math: saying conv= set them contradicted the table
        return (f"conv={conv!r} set cuDNN's convolution flag (torch.backends.cudnn.conv.fp32_precision), which "
                f"nothing read: cuDNN is off (torch.backends.cudnn.enabled = False), so a GPU runs convolutions and "
                f"RNNs as cuBLAS GEMMs under the matmul flag, at each level's math")
    if cpu:  # the flag was set all the same; saying the convolutions ran at it contradicted the report's own line
        return (f"conv={conv!r} set cuDNN's convolution flag (torch.backends.cudnn.conv.fp32_precision), which a "
                f"CPU does not read: a CPU's convolutions follow torch.backends.mkldnn.conv.fp32_precision, which "
                f"no level sets either")
    pins = [] if policy is None else [
        *([f"the model → {policy.conv}"] if policy.conv not in (None, conv) else []),
        *(f"{r.pattern!r} → {r.conv}" for r in policy.rules if r.conv not in (None, conv))]
    where = "" if not pins else (f", except where the policy pins another: {', '.join(pins[:3])}"
                                 f"{f' and {len(pins) - 3} more' if len(pins) > 3 else ''}")
    said = "chosen by tune: TF32 convolutions were searched first" if searched else "conv="
    rows = "in every row" if moved is None else (
        f"until the workload wrote {moved!r} into the flag (it held that at the end of the run; what ran after the "
        f"write ran at {moved!r})")
    ran = [family for family, met in (("conv", convolutions), ("rnn", rnns)) if met]
    what = " and ".join({"conv": "convolutions", "rnn": "cuDNN's RNNs"}[f] for f in ran)
    cells = " and ".join(f"cudnn.{f}" for f in ran)
    flag = ", ".join(f"torch.backends.cudnn.{f}.fp32_precision = {conv!r}" for f in ran)
    return (f"{what} ran at {cells} {conv!r} {rows} ({said}){where}; a level does not set cuDNN's "
            f"flag: {flag}")


class ConvRun:
    """``conv_math(conv)`` around a run, and whether the workload wrote the flag meanwhile: ``moved`` is the conv
    math the flag held at the run's end where that is not ``conv`` (a write back to ``conv`` before the end is
    not seen). ``note()``: the report's note on it."""

    def __init__(self, conv: Optional[str]) -> None:
        self.scope = conv_math(conv)  # validates conv
        self.conv, self.moved = self.scope.conv, None
        self.cudnn = cudnn_cell()  # cuDNN on or off for the run (know.targets.CUDNN_CELL)

    def __enter__(self) -> ConvRun:
        self.cudnn = cudnn_cell()
        self.scope.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.conv is not None and exc[0] is None:
                now = flags.read_cells().get("cuda.conv")
                self.moved = now if now != self.conv else None
        finally:
            self.scope.__exit__(*exc)

    def note(self, policy: Optional[Policy] = None, searched: bool = False, cpu: bool = False,
             convolutions: bool = True, rnns: bool = False) -> str:
        return conv_note(self.conv, policy, searched, self.moved, cpu, self.cudnn == "off", convolutions, rnns)


def _check(workload: Workload, levels: tuple[str, ...], target: Target, reference: str, tolerances: dict[str, float],
           progress: bool, policy: Optional[Policy], speed: bool, accumulation: Optional[str] = None,
           ranks: Optional[Ranks] = None, conv: Optional[str] = None, introduced: str = "failing") -> Report:
    started = time.perf_counter()
    cells = context_cells()  # cuDNN's flag as the run holds it (conv=, else the process's)
    row = PolicyRow.of(policy, workload.model) if policy is not None else None
    extra = tuple(level for level in ALL_LEVELS if row is not None and level in row.levels and level not in levels)
    alike = alike_levels(levels + extra, target)  # level -> the earlier level the target computes identically, if any
    measured = [level for level in levels + extra if alike[level] is None]
    # the levels whose layers the reference's own pass reruns; the others' only where they fail, by a second pass
    # (a policy row reads its layers' errors at each of its levels: all rerun at once)
    upfront = measured if introduced == "all" or row is not None else []
    # float32 `highest`'s own error, each row's multiple of it: a row, or one run more where no row computes it
    floor_from = _floor_row(levels, target)
    runs = len([level for level in levels if alike[level] is None]) + (row is not None) + (floor_from is None)
    pins = {} if row is None else _pins(row, target, alike)
    with Progress(progress, steps=1 + runs) as bar, \
            Session(workload, measured, target, tolerances, speed=speed, bar=bar, accumulation=accumulation,
                    ranks=ranks, pins=pins, rows=[level for level in levels if alike[level] is None],
                    rerun=upfront) as session:
        results: dict[str, LevelResult] = {}
        for level in levels:
            if alike[level] is None:
                results[level] = session.level(level)
        if "highest" in results:
            results["highest"] = session.steady(results["highest"])
        policy_result = session.policy(row, alike) if row is not None else None
        floor = results[floor_from].outputs if floor_from is not None and results[floor_from].error is None \
            else session.floor() if floor_from is None else None
        failing = [level for level, result in results.items() if not result.reruns and not result.passed]
        unmeasured = None
        if failing and session.recorder.layers:  # which layer to pin: each rerun where the level failed
            if not session.recorder.all_fed():  # else the rows' own calls are every layer's introduced error
                try:
                    session.introduce(failing)
                except Tf32LabError as exc:
                    if ranks is not None:  # every rank ends with the error, as at any other pass
                        raise
                    # the rows stand: their verdicts and accumulated errors are measured
                    unmeasured, failing = f"each layer's introduced error at {_named(failing)} is not measured: " \
                                          f"{exc}", []
            results.update({level: session.introduced_at(results[level]) for level in failing})
    for level in levels:
        same = alike[level]
        if same is not None:  # the target computes both levels alike: measured once
            results[level] = dataclasses.replace(results[same], level=level, same_as=same, seconds=0.0)
    rows = [results[level] for level in levels] + ([policy_result] if policy_result is not None else [])
    rows = [with_multiples(r, floor) for r in rows]
    # cuDNN as the rows ran: a workload that turned it off (kept_flags puts it back, and says so) ran them without
    cells = {**cells, CUDNN_CELL: cudnn_cell()}
    predicted = session.predicted(levels)
    if predicted is not None:
        rows = [dataclasses.replace(r, speedup=session.speedup(r, predicted, row)) for r in rows]
    notes = [*workload.notes, *session.notes()]
    refused = any(r.error is not None and dtypes_refused(r.error) for r in rows)
    notes += [note for note in [float_inputs_note(workload.inputs) if refused else None] if note]
    counted = next((r for r in rows if r.same_as is None), None)  # the first end-to-end run: the one counted
    work = _work_note(rows, counted) if predicted is not None and counted is not None else None
    notes += [work] if work else []
    unrerun = _unrerun_note(rows) if session.recorder.layers else None
    notes += [note for note in (unrerun, unmeasured) if note]
    if ranks is not None:
        notes.append(f"sharded over {ranks.world} ranks: every error is the whole model's, reduced over the ranks "
                     f"(sums of squares, maxima); the speed prediction counts rank {ranks.rank}'s share of the work")
    return Report(
        workload=str(workload.name), target=target.name, reference=reference, tolerance=dict(tolerances),
        levels=tuple(rows), environment=environment_of(workload),
        seconds=time.perf_counter() - started, notes=tuple(notes), speed=predicted,
        cudnn=cudnn.families(session.recorder.by_family, rows, target, cells, conv, predicted,
                             rnn_ops=session.recorder.rnn_ops),
    )


def _unrerun_note(rows: list[LevelResult]) -> Optional[str]:
    """What the report says where some level's layers were not rerun: why their introduced errors are blank."""
    # those computed alike another level included, by name
    passed = [r.level for r in rows if not r.reruns and r.passed]
    if not passed:
        return None
    return (f"the layers were not rerun at {_named(passed)}, which passed: only each layer's accumulated error is "
            f"measured there; its introduced error (the layer run again on the reference's inputs: its own rounding) "
            f"is measured where a level fails, and at every level with --introduced all (check(introduced=\"all\"))")


def _named(levels: Iterable[str]) -> str:
    return ", ".join(f"`{level}`" for level in levels)


def _work_note(rows: list[LevelResult], counted: LevelResult) -> Optional[str]:
    """What the report says where the levels ran different numbers of matmul-family ops (control flow that depends
    on the values: an adaptive ODE solver takes more steps where TF32's error fails its estimate): the speed
    prediction counts ``counted``'s run only, and a level doing more work is slower than it says."""
    base = sum(counted.coverage.values())
    other = [(r.level, sum(r.coverage.values())) for r in rows
             if r.same_as is None and r.error is None and r is not counted]
    other = [(level, ops) for level, ops in other if abs(ops - base) > 0.1 * max(base, 1)]
    if not other or counted.error is not None:
        return None
    shown = ", ".join(f"at `{level}` {ops}" for level, ops in other)
    return (f"the levels did different work: {shown} matmul-family ops, at `{counted.level}` {base} (control flow "
            f"that depends on the values, such as an adaptive solver's steps); the predicted speedups count "
            f"`{counted.level}`'s work only")


def _noted(report: Report, changed: list[str]) -> Report:
    return dataclasses.replace(report, notes=(*report.notes, changed_note(changed))) if changed else report


class Session:
    """A workload's float64 reference, run once on entry (each layer rerun at the ``measured`` levels, and a layer
    in ``pins`` at its (level, conv math) too, where a call runs cuDNN's ops), then
    end-to-end runs measured against it: a level (:meth:`level`) or a policy (:meth:`policy`). ``check`` is one
    session; ``tune`` measures many policies in one. Inside it the model is in eval mode; its state (buffers) is
    reset before each run and restored at the end. With ``speed`` (a GPU target), the first end-to-end run is
    counted for the speed model.
    """

    def __init__(self, workload: Workload, measured: list[str], target: Target, tolerances: dict[str, float], *,
                 speed: bool = True, bar: Optional[Progress] = None, accumulation: Optional[str] = None,
                 ranks: Optional[Ranks] = None, pins: Optional[dict[str, tuple[str, str]]] = None,
                 rows: Optional[Iterable[str]] = None, rerun: Optional[Iterable[str]] = None,
                 command: str = "check") -> None:
        self.workload, self.target, self.tolerances = workload, target, tolerances
        self.command = command  # the one whose session this is, as its notes name it ("check", "tune")
        self.ranks = ranks
        self.measured = list(measured)
        # the measured levels :meth:`level` runs end to end (None: all); the others' layers are only rerun
        self.rows = set(self.measured if rows is None else rows)
        self.bar = bar or Progress(False, 0)
        self.spill = SpillFile(min_bytes_from_env())
        # the levels the reference's pass reruns each layer at (None: every measured one; the others' by
        # :meth:`introduce`, where they fail)
        rerun = self.measured if rerun is None else list(rerun)
        self._recording = (workload.model, rerun, target, self.spill, accumulation, ranks, pins)
        # level -> each call's accumulated error in its row, for the calls whose introduced error it is (a layer fed
        # the model's own inputs), kept for a level whose layers :meth:`introduce` reruns after its row
        self.fed: dict[str, dict[tuple[str, int], float]] = {}
        self.recorder = Recorder(*self._recording)
        self.counting = Counting(workload.model) if speed and target.peaks is not None else None
        self.runs = 0  # end-to-end runs so far
        self.idle: list[str] = []  # a policy's rules that did not act in its run (their notes)
        self.scales: dict[str, metrics.Scale] = {}  # output -> the magnitudes that formed it (measure.scales)
        self._stack = contextlib.ExitStack()
        self.ref_drawn: list[tuple[str, Optional[str]]] = []  # the reference's draws: op, dtype kind
        self._draws_learnt = False  # whether a float32 row's draws were compared with the reference's
        self._draw_notes: list[str] = []
        self.handed: Optional[tuple[str, Handoff]] = None  # the next level, what the run before it kept for it
        self.ran: set[str] = set()  # the levels run end to end so far

    def __enter__(self) -> Session:
        stack, workload = self._stack, self.workload
        try:
            # every run draws from one seed, the caller's random state kept; one check in the process at a time
            self.streams = stack.enter_context(Streams(
                cuda_devices(workload.model, [t for _, t in named_tensors(workload.inputs)]), "check"))
            self.recorder.streams = self.streams
            self._training = training_note(workload.model, self.command)
            stack.enter_context(eval_mode(workload.model))
            stack.enter_context(_released())
            stack.enter_context(self.spill)
            self.threads = stack.enter_context(OtherThreads())
            # every run is given the inputs as they were, and the caller has them so again at the end; kept before
            # the call that makes lazy modules, which may write into them too
            self.inputs_kept = KeptInputs(workload.inputs)
            stack.callback(self.inputs_kept)
            made = materialised(workload.model, lambda model: workload.run(model), f"workload {workload.name!r}")
            self._lazy = [lazy_note(made)] if made else []
            self.inputs_kept()
            self.reset = stack.enter_context(state_kept(workload.model))
            self._reference()
            if self.threads.ops and not self.recorder.family_ops:  # a report of nothing would call it safe
                raise Tf32LabError(self.threads.refusal(str(self.workload.name)))
        except BaseException:
            stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.handed is not None:  # the run it was kept for never came
            self.handed[1].close()
            self.handed = None
        try:
            self._stack.__exit__(*exc)
        finally:
            # the kept outputs let go as the check returns (the report keeps none of them), whoever still holds the
            # session (the report is made from it after this)
            self.recorder.release()
            self.ref_out = None

    def _reference(self, plan: Optional[list[Optional[str]]] = None, announce: bool = True,
                   again: Optional[str] = None) -> None:
        """The float64 pass (``plan``: each draw's dtype, learnt from a row); ``again``: why it runs once more, after
        a row (None: the first, before any)."""
        workload, recorder = self.workload, self.recorder
        recorder.mode.plan = plan
        recorder.before_write = self.reset.before_write  # a parameter it writes into: copied first, put back
        if announce:
            self.bar.step(f"{workload.name}: float64 reference, each layer at {len(recorder.levels)} level(s)")
        # the model's own ops only (not the layers' reruns, nor the recorder's arithmetic); not sharded: a rank's
        # part of an output is not formed by its own operands alone
        formed = Formed(lambda: not (recorder.rerunning or recorder.mode.paused), recorder.mode) \
            if self.ranks is None else None
        try:
            try:
                # not inference mode: its tensors keep no version counters
                with float64_scripted(workload, recorder) as model, torch.inference_mode(False), \
                        torch.no_grad(), recorder, formed or contextlib.nullcontext():
                    ref_inputs = _reference_inputs(workload, recorder)
                    recorder.model_inputs = {id(t) for _, t in named_tensors(ref_inputs)}
                    self.streams.seeded()
                    self.ref_out = workload.run(model, ref_inputs)
            except (Tf32LabError, KeyboardInterrupt):
                raise
            except BaseException as exc:  # sys.exit() included: bad input, never a check that ends with no verdict
                if out_of_memory(exc):
                    raise _no_memory(workload, "the float64 reference", exc) from exc
                if self.ranks is not None and collective_failure(exc):
                    raise
                bug = internal_error(exc, f"running workload {workload.name!r} at the float64 reference")
                if bug is not None:
                    raise bug from exc
                when = "before any level ran" if again is None else f"run again after the rows, {again}"
                raise Tf32LabError(f"workload {workload.name!r} raised at the float64 reference, {when}: "
                                   f"{described(exc)}") from exc
            # sharded: a rank may hold an empty part of an output (its rows of a small batch); the whole must compare
            here = _comparable(self.ref_out)
            if self.ranks is not None:
                here = any(self.ranks.gather(here, "the end of the float64 reference"))
            _check_comparable(workload, self.ref_out, here)
            _check_judgeable(workload, self.ref_out, self.ranks)
            _warn_unknown(self.tolerances, self.ref_out)
            if formed is not None:
                self.scales = formed.scales(self.ref_out)
                _check_measurable(workload, self.ref_out, self.scales)
            else:
                _check_measurable_sharded(workload, self.ref_out, self.ranks)
            self.ref_drawn = list(recorder.mode.drawn)
            self.ref_out = _owned(self.ref_out, workload.model)
        finally:
            if formed is not None:  # its kept ops (operands held) and it refer to each other: let go on any exit
                formed.kept.clear()

    def _as_drawn(self, run: Callable[[], _T], where: str) -> _T:
        """``run()``, the session's first end-to-end run (``where``: what it is, for a note). Where the reference
        drew random values, this run's draws are kept and compared with the reference's: the reference decides
        per draw whether the model asks for float64 itself (``measure.reference``), but a ``torch.dtype`` read off
        a widened tensor and kept (torchsde's ``BrownianInterval(dtype=y0.dtype)``) cannot say where it came from,
        and a float64 draw where the rows draw float32 is other noise, not rounding. Where the two runs made the
        same draws at other dtypes, the reference is run again drawing each as this run did, and so is this run;
        where they made other draws, a note says so. A model that draws nothing pays nothing."""
        if self._draws_learnt or not self.ref_drawn or self.ranks is not None:  # sharded: every rank would rerun
            self._draws_learnt = True
            return run()
        self._draws_learnt = True
        log = DrawLog()
        modestack.push(log)
        try:
            result = run()
        finally:
            modestack.remove(log)
        plan, differing = draw_plan(self.ref_drawn, log.drawn)
        if differing < 0:
            self._draw_notes.append(
                f"{DRAWS_UNMATCHED}: the float64 reference made {len(self.ref_drawn)} and "
                f"{where} {len(log.drawn)}, not the same ops at float32 or float64 one for one (control flow "
                f"that depends on the values, or a draw of other shape or dtype), so the errors may be the "
                f"draws' difference, not float32's")
            return result
        if plan is None:
            return result
        self._new_recorder()  # the run's hand-off to the next level goes too: the run runs again, and keeps it anew
        self.reset()
        self.inputs_kept()  # the reference again from the inputs as they were, not as the row left them
        self._reference(plan, again=f"drawing as {where} did")
        if [kind for _, kind in self.ref_drawn] != plan:  # the second reference drew otherwise again
            self._draw_notes.append(
                f"{DRAWS_UNMATCHED}: the float64 reference, run again drawing as {where} "
                f"did, made other draws than it, so the errors may be the draws' difference, not float32's")
            return run()
        wide = plan.count("float64")
        self._draw_notes.append(
            f"{differing} of the {len(plan)} random draw(s) were made at another dtype by the float64 reference "
            f"than by {where} (a dtype read off a widened tensor and kept); the reference was run again drawing "
            f"each as the rows do ({wide} at float64, the rest at float32 and cast up)")
        return run()

    def _new_recorder(self) -> None:
        """A fresh recorder for another float64 pass, the last pass's kept outputs let go first: the last recorder
        may stay (``introduce`` keeps it for the report, should the pass fail), and held its outputs through the
        next pass (both passes' at once: MiniLM's failing check 607 MiB over the loaded model, against 374 with
        every level rerun in one pass). The spill file is emptied too, and a row's hand-off to the next level with
        it: nothing reads them now, and the pass writes its own."""
        self.recorder.release()
        self.ref_out = None  # the model's output, as large as a layer's: the next pass keeps its own
        if self.handed is not None:
            self.handed[1].close()
        self.spill.clear()
        self.recorder = Recorder(*self._recording)
        self.recorder.streams = self.streams

    def notes(self) -> list[str]:
        """What the report must say about the runs (after them: the model's state put back last included)."""
        self.inputs_kept()  # the last run's writes into the inputs, if any: undone, and said
        found = [*self._lazy, *([self._training] if self._training else []), *self.recorder.notes(),
                 *self._draw_notes]
        threads = self.threads.note("not emulated, counted or measured by layer in any run (the float64 "
                                    "reference included), so their error is not in this report")
        found = [*found, threads] if threads else found
        if not self.recorder.family_ops and not self.threads.ops:
            found.append(f"{NO_FAMILY_OPS} (a matmul, convolution, attention, RNN or solver) in the float64 "
                         f"reference: every level computes it alike, and the matmul precision does not reach it")
        stateful = [stateful_note(self.reset.changed)] if self.reset.changed else []
        stateful += [written_note(self.reset.written)] if self.reset.written else []
        stateful += [inputs_note()] if self.inputs_kept.written else []
        return [*found, *stateful, *self.idle]

    def _fresh(self, what: str) -> Optional[Counting]:
        self.bar.step(what)
        self.reset()  # every run starts from the state the model had (a buffer it updates, an attribute it sets)
        self.inputs_kept()  # and from the inputs it was given (a model that scales its input in place)
        release_buffers()  # the reruns' scratch sizes are not this run's: memory the peak need not hold
        self.streams.seeded()  # the draws of the reference, and of every other run
        self.runs += 1
        counting = self.counting
        return counting if counting is not None and not counting.counts.ops else None

    def level(self, level: str) -> LevelResult:
        """One end-to-end run at ``level`` (one of ``measured``). The first measured level's run keeps, for the
        second's, the results of the leading convolutions and RNNs both compute alike (``emulation.reuse``)."""
        handoff, replaying = self._handoff(level)

        def run() -> LevelResult:
            counting = self._fresh(f"{level}: end to end")
            if handoff is not None:
                handoff.replay() if replaying else handoff.record()
            return _check_level(self.workload, level, self.target, self.recorder, self.ref_out, self.tolerances,
                                counting=counting, scales=self.scales, handoff=handoff,
                                fed=self.fed.setdefault(level, {}))

        try:
            return self._as_drawn(run, f"the `{level}` row")
        finally:
            self.ran.add(level)
            if replaying:
                handoff.close()

    def introduce(self, levels: list[str]) -> None:
        """Run the float64 reference again, each layer rerun at ``levels`` (rows run already, without their layers
        rerun): their introduced errors, for :meth:`introduced_at`. The reference is deterministic (its draws from
        one seed, as the first pass drew them), so this pass computes the same float64 values as the first; the
        first's kept outputs are let go before it keeps its own."""
        plan, first = self.recorder.mode.plan, self.recorder
        self._recording = (self._recording[0], list(levels), *self._recording[2:])
        self._new_recorder()
        self.handed = None  # a row's hand-off no row will take
        self.bar.more(f"{self.workload.name}: float64 reference again, each layer at {len(levels)} level(s)")
        self.reset()
        self.inputs_kept()
        release_buffers()
        try:
            self._reference(plan, announce=False, again=f"for the introduced errors at "
                            f"{', '.join(map(repr, levels))}, which failed (check(introduced=\"all\") measures "
                            f"them in the first)")
        except Tf32LabError:
            # the first pass's layers, op counts and notes stand for the report (its kept outputs are gone)
            self.recorder = first
            raise

    def introduced_at(self, result: LevelResult) -> LevelResult:
        """``result``, a level's row run without its layers rerun, with each layer's introduced error from the
        reruns of :meth:`introduce`, ranked by it."""
        fed = self.fed.get(result.level, {})
        layers = []
        for layer in result.layers:
            introduced, why = _introduced(self.recorder, fed, result.level, layer.name)
            reasons = "; ".join(r for r in (why, layer.diverged) if r)
            layers.append(dataclasses.replace(layer, introduced=introduced, diverged=reasons or None))
        return dataclasses.replace(result, layers=_ranked(layers), reruns=True)

    def _handoff(self, level: str) -> tuple[Optional[Handoff], bool]:
        """The hand-off this run of ``level`` replays (True: the one the run before recorded for it) or records
        for the next measured level (False), where that level has not run yet and the two compute a kept family
        alike; None where nothing would be kept (sharded: each rank computes its own part, for the collectives)."""
        handed, self.handed = self.handed, None
        if handed is not None and handed[0] == level:
            return handed[1], True
        if handed is not None:
            handed[1].close()
        if not self.target.emulated or self.ranks is not None or level not in self.measured:
            return None, False
        # a level whose layers only are rerun (a policy's, not a row) never takes what is kept
        later = [other for other in self.measured[self.measured.index(level) + 1:] if other in self.rows]
        same = alike(self.target, level, later[0], context_cells()) if later and later[0] not in self.ran else None
        if not same or not KEPT & same:
            return None, False
        self.handed = (later[0], Handoff(same, spill=self.spill))
        return self.handed[1], False

    def floor(self) -> Optional[tuple[metrics.OutputError, ...]]:
        """float32 `highest`'s outputs on the target, for the rows' multiples of its error, where no row computes
        them: one end-to-end run, its layers not measured. None where it raises (the multiples are then unknown)."""
        return self._as_drawn(self._floor, "float32's `highest` run")

    def _floor(self) -> Optional[tuple[metrics.OutputError, ...]]:
        self._fresh("highest: float32's own error, end to end")
        recorder = self.recorder
        try:
            with level_context("highest", self.target, recorder.accumulation, recorder.weight_cache()), \
                    recorder.grad_mode():
                out = self.workload.run()
        except Exception as exc:
            if recorder.ranks is not None or out_of_memory(exc):
                raise
            return None
        return _outputs(out, self.ref_out, self.tolerances, self.scales) if recorder.ranks is None else \
            sharded.outputs(out, self.ref_out, self.tolerances, recorder.ranks, _outputs, _below_float32)

    def steady(self, result: LevelResult) -> LevelResult:
        """``result`` (a level that fails without raising) run once more: when the outputs' errors differ, the
        model draws from a stream no run seeds (Python's ``random``, NumPy's, a generator of its own) and the
        failure is chance, not precision. Emulation and the float64 reference are deterministic, and every run
        draws PyTorch's random ops from one seed (``measure.draws``), so the same model gives the same bits."""
        if result.passed or result.error is not None:
            return result
        fed = dict(self.fed.get(result.level, {}))
        again = self.level(result.level)
        self.fed[result.level] = fed  # ``result``'s calls, not this run's: the one whose errors are reported
        first = [(o.name, o.normwise) for o in result.outputs]
        second = [(o.name, o.normwise) for o in again.outputs]
        if first == second or again.error is not None:
            return result
        name, value = next(((n, v) for (n, v), (_, w) in zip(first, second) if v != w), first[0])
        other = dict(second).get(name, math.nan)
        return dataclasses.replace(result, unstable=f"output {name!r}: normwise {value:.2e}, then {other:.2e}")

    def policy(self, row: PolicyRow, alike: dict[str, Optional[str]]) -> LevelResult:
        """One end-to-end run with ``row``'s policy applied (its levels among ``measured``, or ``alike`` them)."""
        def run() -> LevelResult:
            counting = self._fresh("policy: end to end")
            return _check_level(self.workload, row.base, self.target, self.recorder, self.ref_out, self.tolerances,
                                row=row, alike=alike, counting=counting, idle=self.idle, scales=self.scales)

        return self._as_drawn(run, "the policy's row")

    def predicted(self, levels: Iterable[str]) -> Optional[SpeedReport]:
        """The speed report of the counted run, when one was counted."""
        if self.counting is None or not self.counting.counts.ops:
            return None
        return predict_counts(self.counting.counts, str(self.workload.name), self.target, levels)

    def seconds(self, row: PolicyRow) -> float:
        """The predicted time of one forward under ``row``'s policy (a speed model is needed)."""
        by_name = row.by_name  # every module's level; an op outside every module runs at the policy's base
        return seconds_at(self.counting.counts, self.target, lambda layer: by_name.get(layer, row.base),
                          lambda layer: row.conv_by_name.get(layer, row.conv_by_name.get(ROOT)))

    def speedup(self, result: LevelResult, predicted: SpeedReport, row: Optional[PolicyRow]) -> float:
        if result.policy is None or row is None:
            return predicted.level(result.level).speedup
        return predicted.level("highest").seconds / self.seconds(row)


@dataclasses.dataclass(frozen=True)
class PolicyRow:
    """A policy as check measures it: its level per module name (``ROOT`` for the model), unmatched rules refused;
    ``convs``: the conv maths its modules run at (None: the caller's flag)."""

    policy: Policy
    base: str  # the level the model itself runs at: the policy's default, or the one in force here
    by_name: dict[str, str]
    levels: frozenset[str]
    convs: frozenset[Optional[str]] = frozenset({None})
    conv_by_name: dict[str, Optional[str]] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, policy: Policy, model: torch.nn.Module) -> PolicyRow:
        if not isinstance(policy, Policy):
            raise Tf32LabError(f"check(policy=...) takes a tf32lab.Policy, not {type(policy).__name__}")
        unmatched = policy.unmatched_message(model)
        if unmatched is not None:
            raise Tf32LabError(unmatched)
        base = policy.default or get_float32_matmul_precision()
        if base not in ALL_LEVELS:  # the process's cells hold a value no level writes (a newer torch's)
            raise Tf32LabError(f"check(policy=...): the policy has no default level and the process level is "
                               f"{base!r} (a flag holds a value this tf32lab does not know); give the policy a "
                               "default level")
        assignments = policy.explain(model)
        by_name = {(a.name or ROOT): a.level or base for a in assignments}
        return cls(policy, base, by_name, frozenset(by_name.values()), frozenset(a.conv for a in assignments),
                   {(a.name or ROOT): a.conv for a in assignments})

    def describe(self) -> dict[str, Any]:
        return dict(self.policy.to_dict(), base=self.base)


def alike_levels(levels: tuple[str, ...], target: Target) -> dict[str, Optional[str]]:
    """For each level, an earlier one whose every op family gets the same math on ``target`` (emulation is
    deterministic, so one measurement serves both)."""
    found: dict[str, Optional[str]] = {}
    seen: list[tuple[str, dict[str, str]]] = []
    cells = context_cells()
    for level in levels:
        if not target.emulated:
            found[level] = None
            continue
        level_maths = target.maths_at(level, cells)
        found[level] = next((other for other, m in seen if m == level_maths), None)
        if found[level] is None:
            seen.append((level, level_maths))
    return found


def rows_of_alike(levels: Iterable[str], alike: Mapping[str, Optional[str]], rows: dict[str, Any], floor: Any) -> None:
    """Fill ``rows`` for the levels measured once for another (``alike``) and for `highest` (float32's ``floor``
    row): a copy naming what it is the same as, taking no time of its own. For the training and generation checks,
    whose rows are dataclasses with ``level``, ``same_as`` and ``seconds``."""
    for level in levels:
        same = alike[level]
        if level == "highest" or same == "highest":
            rows[level] = dataclasses.replace(floor, level=level, same_as=None if level == "highest" else "highest",
                                              seconds=floor.seconds if level == "highest" else 0.0)
        elif same is not None:
            rows[level] = dataclasses.replace(rows[same], level=level, same_as=same, seconds=0.0)


def _check_level(workload: Workload, level: str, target: Target, recorder: Recorder, ref_out: Any,
                 tolerances: dict[str, float], row: Optional[PolicyRow] = None,
                 alike: Optional[dict[str, Optional[str]]] = None, counting: Optional[Counting] = None,
                 idle: Optional[list[str]] = None,
                 scales: Optional[Mapping[str, metrics.Scale]] = None, handoff: Optional[Handoff] = None,
                 fed: Optional[dict[tuple[str, int], float]] = None) -> LevelResult:
    """One end-to-end run at ``level`` (with ``row``: the policy applied, ``level`` its base) and its result;
    ``counting``: the run's work is counted too (for the speed prediction); ``idle``: a note on the policy's rules
    that did not act in the run is added to it; ``scales``: the magnitudes that formed the outputs
    (``measure.scales``); ``handoff``: what this run keeps for the next or takes from the one before
    (``emulation.reuse``); ``fed``: filled with the accumulated errors of the calls whose introduced error they
    are, for a level whose layers the reference's pass did not rerun (``Session.introduced_at``)."""
    started = time.perf_counter()
    accumulated = Accumulated(recorder, counting)
    out, error = None, None
    applied = row.policy.applied(workload.model) if row else contextlib.nullcontext()
    cells = context_cells()  # the caller's cells: those a level leaves alone (convs, RNNs, the SDPA kernel)
    with level_context(level, target, recorder.accumulation, recorder.weight_cache(), handoff) as emu, \
            applied as handle:
        level_maths = {} if emu is None else (
            policy_maths(row, target, cells) if row else target.maths_at(level, cells))
        ran = rnn_math(level_maths, target.device, recorder.rnn_ops) if level_maths else None
        if ran is not None:  # on a CPU target a GRU runs in the matmul's math, not the rnn key's
            level_maths = {**level_maths, "rnn": ran}
        made = recorder.mode.choices.choices if recorder.mode.choices is not None else None
        chosen = ChoiceLog(len(made)) if made else None
        if chosen is not None:  # the reference made choices (a router's top-k): this run's are compared with them
            modestack.push(chosen)
        try:
            with accumulated, (counting or contextlib.nullcontext()), recorder.grad_mode():
                out = workload.run()
        except (Tf32LabError, KeyboardInterrupt):  # Ctrl-C stops the check
            raise
        except BaseException as exc:  # sys.exit() included: the level's finding, never an end with no verdict
            if out_of_memory(exc):  # not a finding about the level: check itself is short of memory
                raise _no_memory(workload, "the policy" if row else f"level {level!r}", exc) from exc
            if recorder.ranks is not None:  # sharded: the other ranks may wait inside the model's own collectives
                if collective_failure(exc):
                    raise
                raise Tf32LabError(f"workload {workload.name!r} raised "
                                   f"{'with the policy' if row else f'at level {level!r}'} (a sharded check "
                                   f"stops there: {described(exc)})") from exc
            bug = internal_error(exc, f"running workload {workload.name!r} "
                                      f"{'with the policy' if row else f'at level {level!r}'}")
            if bug is not None:  # tf32lab's own failure: not a finding about the level
                raise bug from exc
            error = described(exc)  # the model cannot run at this level: that is the finding
        finally:
            if chosen is not None:
                modestack.remove(chosen)
        if row is not None and idle is not None and error is None:
            idle.extend(idle_note(handle.idle()))
    outputs: tuple[metrics.OutputError, ...] = ()
    metric = None
    if error is None:
        outputs = _outputs(out, ref_out, tolerances, scales) if recorder.ranks is None else \
            sharded.outputs(out, ref_out, tolerances, recorder.ranks, _outputs, _below_float32)
        if workload.metric is not None:
            try:
                metric = float(workload.metric(out, ref_out))
            except Exception as exc:
                raise Tf32LabError(
                    f"workload {workload.name!r}: its metric raised {type(exc).__name__}: {exc}") from exc
    layers = []
    reruns = row is not None or level in recorder.introduced  # else its introduced errors come later, if it fails
    if fed is not None:
        fed.update({key: accumulated.per_call.get(key, math.nan) for key in recorder.as_accumulated})
    for order, (name, module) in enumerate(recorder.layers):
        at = level
        if row is not None:  # the level the policy gives this layer, as measured (a level computed alike)
            at = row.by_name.get(name, level)
            at = (alike or {}).get(at) or at
        introduced, why = _introduced(recorder, accumulated.per_call, at, name, _pinned_conv(
            row, name, recorder.families.get(name, ()), target, cells)) if reruns else (math.nan, None)
        acc, diverged = accumulated.result(name, finished=error is None)
        reasons = "; ".join(r for r in (why, diverged) if r)
        layers.append(LayerError(name, sharded.type_name(module), recorder.count[name], introduced, acc,
                                 reasons or None, order))
    ranked = _ranked(layers)
    if emu is not None and level_maths.get("conv") not in (None, "ieee", "mixed"):
        level_maths = {**level_maths, "conv": conv_ran(level_maths["conv"], emu.coverage)}
    coverage = {} if emu is None else {f"{op} {m}": n for (op, m), n in sorted(emu.coverage.items())}
    unhandled = {} if emu is None else dict(sorted(emu.unhandled.items()))
    # past the reference's budget the row's log stops where the reference's kept ones end: no more to tell
    choices = compared(made, chosen.choices, chosen.more and not recorder.mode.choices.full) \
        if chosen is not None and error is None else None
    return LevelResult("policy" if row else level, level_maths, outputs, tuple(ranked), metric, coverage, unhandled,
                       time.perf_counter() - started, error=error, policy=row.describe() if row else None,
                       choices=choices, reruns=reruns)


def _reference_inputs(workload: Workload, recorder: Recorder) -> Any:
    """The inputs of the float64 reference. The modes widen each op's float32 operands as it runs, so the inputs
    may stay float32 (no copy); but a TorchScript part checks dtypes inside itself where no mode can widen: a
    scripted (or traced) convolution given the float32 input beside its float64 twin's weights raised "Input type
    (float) and bias type (double) should be the same". Where the model has one, the inputs are float64 copies
    (made with the modes paused: under them a dtype read answers float64 and ``widen`` copied nothing)."""
    if not recorder.scripted:
        return map_tensors(widen, workload.inputs)
    mode = recorder.mode
    paused, mode.paused = mode.paused, True
    try:
        return map_tensors(widen, workload.inputs)
    finally:
        mode.paused = paused


def _ranked(layers: list[LayerError]) -> tuple[LayerError, ...]:
    """The largest introduced error first (one not measured last), else in the order they first ran."""
    # NaN as +inf: after every measured one (as -inf it came first, and layers[0] named a layer of unknown error)
    return tuple(sorted(layers, key=lambda e: math.inf if math.isnan(e.introduced) else -e.introduced))


def idle_note(rules: Iterable[Any]) -> list[str]:
    """The note on a policy's rules that did not act in a run (empty: every rule acted): no module they set ran
    its forward and no matmul-family op used their parameters, so they change nothing a GPU computes."""
    if not rules:
        return []
    named = ", ".join(f"{rule.pattern!r} -> {rule.level or rule.conv}" for rule in rules)
    return [f"the policy's rule(s) {named} did not act in the run: no module they set ran its forward, and no "
            f"matmul-family op ran at their level with their parameters (a module kept but never called, or weights "
            f"only a fused op used at another module's more accurate level, as nn.TransformerEncoderLayer's fast "
            f"path in eval does), so they change nothing"]


def _pinned_conv(row: Optional[PolicyRow], name: str, families: Iterable[str], target: Target,
                 cells: Mapping[str, str]) -> Optional[str]:
    """The conv math the policy pins a layer to, where that computes some of its own cuDNN ops (``families``: what
    it ran, convolutions or RNNs, whatever its class) otherwise than the check's own math; else None."""
    conv = None if row is None else row.conv_by_name.get(name)
    if conv is None:
        return None
    pinned = with_conv(cells, conv)
    differs = [f for f in ("conv", "rnn") if f in families and (
        target.math(f, pinned) != target.math(f, cells) if target.emulated else conv != cells.get(f"cuda.{f}"))]
    return conv if differs else None


def _pins(row: PolicyRow, target: Target, alike: Mapping[str, Optional[str]]) -> dict[str, tuple[str, str]]:
    """Module -> (the measured level, the conv math) the policy runs it at, for the modules it pins to a conv math
    that computes cuDNN's ops (convolutions or RNNs) otherwise than the caller's: the reruns those need."""
    cells = context_cells()
    pins = {}
    for name, conv in row.conv_by_name.items():
        if _pinned_conv(row, name, ("conv", "rnn"), target, cells) is not None:
            level = row.by_name.get(name, row.base)
            pins[name] = (alike.get(level) or level, conv)
    return pins


def conv_ran(table: str, coverage: Mapping[tuple[str, str], int]) -> str:
    """The convolutions' math as a run computed them: the target's ``table`` math for its cuDNN convolutions,
    ``ieee`` where every one ran IEEE (a GPU runs a float32 NCHW depthwise conv in PyTorch's own kernels, which no
    TF32 flag reaches: ``emulation.rules._depthwise``), ``table/ieee`` where some did."""
    # a "hardware" run's labels say how each count was summed too ("ieee, ideal sum"): its math is what came before
    ran = {counted_math(m) for (op, m), n in coverage.items() if n and optable.family(op) == "conv"}
    if "ieee" not in ran:
        return table
    return "ieee" if ran == {"ieee"} else f"{table}/ieee"


def policy_maths(row: PolicyRow, target: Target, cells: Mapping[str, str]) -> dict[str, str]:
    """Per family: the math every level (and conv math) of the policy gives it, or ``mixed``."""
    found: dict[str, set[str]] = {}
    for level in sorted(row.levels):
        for conv in row.convs:  # a conv math pinned by the policy over the caller's (cuDNN's flag covers RNNs too)
            at = with_conv(cells, conv)
            for key, m in target.maths_at(level, at).items():
                found.setdefault(key, set()).add(m)
    return {key: values.pop() if len(values) == 1 else "mixed" for key, values in found.items()}


def _introduced(recorder: Recorder, per_call: Mapping[tuple[str, int], float], level: str, name: str,
                conv: Optional[str] = None) -> tuple[float, Optional[str]]:
    """A layer's worst introduced error at ``level`` (and at the conv math ``conv`` a policy pins it to): from its
    reruns, and from the end-to-end run (``per_call``: its calls' accumulated errors) for the calls that the
    end-to-end run computes exactly as a rerun would (fed the model's own inputs)."""
    if conv is None:
        found = [recorder.introduced[level][name]] if name in recorder.introduced.get(level, {}) else []
    elif recorder.pins.get(name) == (level, conv):
        found = [recorder.pinned[name]] if name in recorder.pinned else []
    else:  # not rerun at that conv math (a session made without the pin): one clause, no "; "
        return math.nan, (f"{PINNED_CONV} {conv!r}, at which its reruns did not run, so its introduced error is "
                          "not measured (its accumulated error is)")
    found += [(per_call.get(key, math.nan), None) for key in recorder.as_accumulated if key[0] == name]
    if not found:
        return math.nan, None
    why = next((w for _, w in found if w), None)
    values = [v for v, _ in found]
    return (math.nan if any(math.isnan(v) for v in values) else max(values)), why




def _no_memory(workload: Workload, where: str, exc: BaseException) -> Tf32LabError:
    detail = str(exc).strip()
    return Tf32LabError(f"workload {workload.name!r}: out of memory at {where} ({type(exc).__name__}"
                        f"{': ' + detail.splitlines()[0] if detail else ''}); check needs the model, its "
                        f"activations in float64 and every layer's reference output: try fewer or shorter inputs")


@contextlib.contextmanager
def _released():
    """Afterwards no scratch memory of the emulator stays with this thread (it may be as large as the model)."""
    try:
        yield
    finally:
        release_buffers()






# -- outputs ----------------------------------------------------------------------------------------------------
def _outputs(out: Any, ref_out: Any, tolerances: dict[str, float],
             scales: Optional[Mapping[str, metrics.Scale]] = None) -> tuple[metrics.OutputError, ...]:
    refs = dict(named_leaves(ref_out))
    found = dict(named_leaves(out))
    results = []
    for name, r in refs.items():
        tolerance = tolerances.get(name, tolerances["default"])
        y = found.get(name, metrics.ABSENT)
        if r is not None or y is not None:
            scale = (scales or {}).get(name)
            results.append(_range_said(metrics.compare(name, y, r, tolerance, scale), y, r))
    for name in found.keys() - refs.keys():
        results.append(metrics.compare(name, found[name], metrics.ABSENT, tolerances.get(name, tolerances["default"])))
    return tuple(results)


def _floor_row(levels: tuple[str, ...], target: Target) -> Optional[str]:
    """The level among ``levels`` whose row computes as float32 `highest` does on ``target`` (`highest`, or one
    the target computes alike), if any."""
    if "highest" in levels:
        return "highest"
    alike = alike_levels(("highest", *levels), target)
    return next((level for level in levels if alike[level] == "highest"), None)


def with_multiples(row: LevelResult, floor: Optional[tuple[metrics.OutputError, ...]]) -> LevelResult:
    """``row`` with each output's error as a multiple of float32 `highest`'s (``floor``, the same outputs; None:
    not measured, the multiples stay unknown). An output compared exactly, or failed on either side, has none."""
    if floor is None:
        return row
    by_name = {o.name: o for o in floor}
    outputs = []
    for o in row.outputs:
        f = by_name.get(o.name)
        value = None
        if f is not None and not (o.exact or f.exact) and o.failure is None and f.failure is None:
            found = metrics.multiple(o.normwise, f.normwise)
            value = None if math.isnan(found) else found
        outputs.append(dataclasses.replace(o, multiple=value))
    return dataclasses.replace(row, outputs=tuple(outputs))


def _range_said(found: metrics.OutputError, y: Any, r: Any) -> metrics.OutputError:
    """A float32 output that is Inf (or NaN) where its float64 reference is finite but larger than float32 can
    hold: its failure says so, for it is float32's range, not its rounding, that no precision level fixes. One that
    fails where its reference lies wholly below float32's least normal number: its note says so (an untrained
    model's logits at 1e-41: float32 keeps a few bits there, at every level)."""
    if not (isinstance(y, torch.Tensor) and isinstance(r, torch.Tensor)) or y.dtype != torch.float32 \
            or y.shape != r.shape or r.is_complex():
        return found
    if found.failure is None:
        return _underflow_said(found, r)
    lost = ~torch.isfinite(y) & torch.isfinite(r)
    if not bool(lost.any()):
        return found
    largest = float(r[lost].double().abs().max())
    if largest <= torch.finfo(torch.float32).max:
        return found
    return dataclasses.replace(found, failure=f"{found.failure}; the reference reaches {largest:.1e} there, "
                                              f"{BEYOND_FLOAT32} (largest finite {torch.finfo(torch.float32).max:.1e})")


def _underflow_said(found: metrics.OutputError, r: torch.Tensor) -> metrics.OutputError:
    if found.passed or found.exact or r.numel() == 0 or not r.is_floating_point():
        return found
    finite = r[torch.isfinite(r)]
    return _below_float32(found, float(finite.double().abs().max()) if finite.numel() else 0.0)


def _below_float32(found: metrics.OutputError, largest: float) -> metrics.OutputError:
    """``found`` (a float32 output's error), with a note where it fails and its reference's ``largest`` magnitude
    is below float32's least normal number (also a sharded output's, over every rank's part)."""
    if found.passed or found.exact:
        return found
    tiny = torch.finfo(torch.float32).tiny
    if not 0.0 < largest < tiny:
        return found
    said = (f"{BELOW_FLOAT32}: the reference's largest magnitude is {largest:.1e}, under float32's least normal "
            f"number ({tiny:.1e})")
    return dataclasses.replace(found, note=f"{found.note}; {said}" if found.note else said)


def _owned(ref_out: Any, model: torch.nn.Module) -> Any:
    """The reference's outputs in tensors of their own: an output that is the model's state (a buffer it writes,
    ``return self.cache``, or a float32 view of one, ``self.cache.view(-1)``, which the reference keeps float32) is
    put back with the state before each row, and the row's writes then made it that row's own output (every
    level's error 0.0). A float32 output is always such a one (every result the reference computes is float64)."""
    state = {storage_address(t) for t in (*model.parameters(), *model.buffers())} - {None}

    def own(t: torch.Tensor) -> torch.Tensor:
        if storage_address(t) is None:  # a sharded tensor (a wrapper with no storage of its own): as it is
            return t
        if t.dtype in (torch.float32, torch.complex64):
            return widen(t.detach())
        return t.detach().clone() if storage_address(t) in state else t

    return map_tensors(own, ref_out)


def _comparable(ref_out: Any) -> bool:
    return any(metrics.comparable(value) for _, value in named_leaves(ref_out))


def _check_comparable(workload: Workload, ref_out: Any, comparable: bool) -> None:
    leaves = list(named_leaves(ref_out))
    if not comparable:
        kinds = ", ".join(sorted({_leaf_kind(v) for _, v in leaves}))
        raise Tf32LabError(f"workload {workload.name!r}: its output has nothing to compare ({kinds or 'nothing'}); "
                           f"return the tensors to check (a tensor, or a tuple/dict of them)")


def _leaf_kind(value: Any) -> str:
    """An output leaf that holds nothing to compare, in words: ``None``, an empty tensor, or an object whose values
    tf32lab cannot read (a ``torch.distributions`` one: its parameters or a sample are tensors to return)."""
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return "an empty tensor"
    kind = type(value)
    if kind.__module__.startswith("torch.distributions"):
        return f"a torch.distributions {kind.__name__}, whose parameters (such as its mean) are the tensors"
    return f"a {kind.__name__} object, with no tensors tf32lab can read in it"


def _check_judgeable(workload: Workload, ref_out: Any, ranks: Optional[Ranks] = None) -> None:
    """A float64 reference with no finite value cannot judge any level: the model makes it without any reduced
    precision, and an output that is NaN at every level would compare as equal (normwise 0, "safe"). Said before
    any level runs, as bad input (``Tf32LabError``: the CLI's exit code 2), never as a pass. Where only some
    elements are NaN or Inf, the rest is compared and the non-finite ones must be held alike, position and value
    (``metrics.compare``; the output's note counts them): a masked logit is ``-inf`` on purpose. Sharded
    (``ranks``), over every rank's part: a rank whose rows are NaN beside another's finite ones is that case, and
    every rank says the same or none does (one rank alone raised, and the others stopped at their next collective)."""
    unjudgeable = {}
    for name, value in named_leaves(ref_out):
        if isinstance(value, float):
            value = torch.tensor(value)
        if not isinstance(value, torch.Tensor) or not (value.is_floating_point() or value.is_complex()):
            continue
        real = torch.view_as_real(value) if value.is_complex() else value
        if real.numel() == 0:  # nothing to judge with here; another rank's part may have it
            unjudgeable[name] = None
        elif not bool(torch.isfinite(real).any()):
            nan = int(torch.isnan(real).sum())
            unjudgeable[name] = "NaN at every element" if nan == real.numel() else \
                f"NaN or Inf at every element ({nan} NaN)"
    if ranks is not None:
        parts = ranks.gather(unjudgeable, "the float64 reference's outputs")
        unjudgeable = {name: next((p[name] for p in parts if p.get(name)), None) for name in unjudgeable
                       if all(name in p for p in parts)}
    for name, what in unjudgeable.items():
        if what is not None:
            raise Tf32LabError(f"workload {workload.name!r}: the float64 reference itself is {what} of output "
                               f"{name!r}: cannot judge any level against it (it is there without reduced "
                               f"precision); fix the model or its inputs, or leave that output out")


def _check_measurable(workload: Workload, ref_out: Any, scales: Mapping[str, metrics.Scale]) -> None:
    """Every float output zero at every element of the float64 reference, and formed by products that are zero
    too (no :class:`~tf32lab.numbers.metrics.Scale`, or one of norm 0): a layer whose weights are zero (a
    classifier head initialised to zero before training). Every level computes exactly zero there, and a check
    would pass having measured nothing; said before any level runs, as bad input (``Tf32LabError``). An output
    that cancels to zero from products that are not zero is judged over them, and one output with values is
    enough to judge a level."""
    zero = []
    for name, value in named_leaves(ref_out):
        if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()) and value.numel():
            scale = scales.get(name)
            if bool(value.any()) or (scale is not None and scale.norm != 0):
                return
            zero.append(name)
    if zero:
        which = ", ".join(repr(name) for name in zero)
        raise Tf32LabError(f"workload {workload.name!r}: the float64 reference is zero at every element of output "
                           f"{which}, from products that are zero too: no level can change it, so a check would "
                           f"measure nothing (zero weights: a layer initialised to zero before training?); check "
                           f"it with trained weights, or return an output the model's matmuls form")


def _check_measurable_sharded(workload: Workload, ref_out: Any, ranks: Optional[Ranks]) -> None:
    """:func:`_check_measurable` of a sharded check, over every rank's part: with no magnitudes that formed the
    outputs (a rank's part is not formed by its own operands alone), every float output zero at every element on
    every rank is refused on every rank (a check passed it, having measured nothing; one process refuses a zero
    head, and judges a difference that cancels to zero over what cancelled, which only it can)."""
    zero, values = [], False
    for name, value in named_leaves(ref_out):
        if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
            values = values or bool(value.any())
            zero.append(name)
    if ranks is None:
        return
    parts = ranks.gather((values, zero), "the float64 reference's zeros")  # every rank, whatever it holds
    if any(v for v, _ in parts) or not any(z for _, z in parts):
        return
    which = ", ".join(repr(name) for name in next(z for _, z in parts if z))
    raise Tf32LabError(f"workload {workload.name!r}: the float64 reference is zero at every element of output "
                       f"{which} on every rank: no level can change it, so a check would measure nothing (zero "
                       f"weights: a layer initialised to zero before training?); check it with trained weights, "
                       f"or in one process, where a difference that cancels to zero is judged over what cancelled")


def _warn_unknown(tolerances: dict[str, float], ref_out: Any) -> None:
    names = {name for name, _ in named_leaves(ref_out)}
    unknown = sorted(set(tolerances) - names - {"default"})
    if unknown:
        warnings.warn(f"tolerance given for outputs the workload does not have: {', '.join(unknown)}; "
                      f"its outputs: {', '.join(sorted(names))}", stacklevel=3)


def dtypes_refused(error: str) -> bool:
    """Whether a row's error is PyTorch refusing a float64 (or 16-bit) operand beside a float32 one ("mat1 and mat2
    must have the same dtype, but got Double and Float", "expected scalar type Double but found Float")."""
    text = error.lower()
    return "type" in text and "float" in text and any(w in text for w in ("double", "half", "bfloat16"))


def float_inputs_note(inputs: Any) -> Optional[str]:
    """What to say where a level raised and the inputs hold floating tensors other than float32 (float64 ones a
    float32 model's product refuses at every level); None where they hold none."""
    found = [("input" if isinstance(inputs, torch.Tensor) else name, t.dtype) for name, t in named_tensors(inputs)
             if t.is_floating_point() and t.dtype != torch.float32]
    if not found:
        return None
    dtypes = ", ".join(sorted({str(d).replace("torch.", "") for _, d in found}))
    names = ", ".join(repr(name) for name, _ in found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    return (f"{INPUTS_NOT_FLOAT32} {dtypes} tensors ({names}): every row is fed them as given (the float64 "
            f"reference widens them), so a float32 model that does not cast them itself raises at every level")
