"""``check(workload)``: how much each precision level changes a model, output by output and layer by layer.

One run of the model in float64 (``tf32lab.measure.reference``: the float32 model itself, every op widened, no copy)
gives the reference. During it, each module that runs matmul-family ops itself (a *layer*) is hooked: its
float64 output is kept, and right after each of its calls it is run again in float32 under each level, fed the
inputs it just had, with the layers nested in it answering with their reference outputs: the error it
*introduces* with its own ops. Then, per level, under ``precision(level)`` and ``emulate(target)`` (or on the real
hardware with ``target="native"``), one end-to-end run gives the outputs' errors and each layer's *accumulated*
error. No layer's inputs are stored, so the memory is the model's, one level's activations and the reference
outputs of the layers.

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
    >>> sorted(layer.name for layer in report.level("high").layers), bool(report)   # ranked by introduced error
    (['0', '1'], True)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import platform
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Optional, Union

import torch

from tf32lab.control import flags
from tf32lab.control.policy import Policy
from tf32lab.control.scope import get_float32_matmul_precision, precision
from tf32lab.emulation.emulator import emulate, maths, release_buffers
from tf32lab.errors import Tf32LabError
from tf32lab.know import optable, peaks, targets
from tf32lab.know.levels import LEVELS, check_levels
from tf32lab.machine import hardware
from tf32lab.measure.reference import Float64Run, widen
from tf32lab.measure.spill import Spilled, SpillFile, min_bytes_from_env
from tf32lab.numbers import metrics
from tf32lab.numbers.origin import internal_error
from tf32lab.numbers.trees import map_tensors, named_leaves, named_tensors
from tf32lab.report import LayerError, LevelResult, Report
from tf32lab.report.conclusion import BEYOND_FLOAT32
from tf32lab.speed.counting import Counting, OtherThreads
from tf32lab.speed.predict import SpeedReport, predict_counts, seconds_at
from tf32lab.workloads.workload import Workload, eval_mode

__all__ = ["check", "check_levels", "check_target"]

REFERENCES = ("float64",)
ROOT = "(model)"  # how the model itself is named when it runs family ops directly
_OUT_OF_MEMORY = (MemoryError, getattr(torch, "OutOfMemoryError", MemoryError))


def _out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says memory ran out: a MemoryError, CUDA's OutOfMemoryError, or the CPU allocator's
    RuntimeError ("DefaultCPUAllocator: can't allocate memory")."""
    return isinstance(exc, _OUT_OF_MEMORY) or (isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


def check(workload: Workload, *, levels: Iterable[str] = LEVELS, target: str = "a100", reference: str = "float64",
          tolerance: Union[float, Mapping[str, float], None] = None, progress: bool = False,
          policy: Optional[Policy] = None, speed: bool = True) -> Report:
    """Measure ``workload`` at each level against a float64 reference, as ``target`` would compute it.

    Args:
        levels: precision levels to check, in order.
        target: a hardware profile from ``tf32lab.know.targets`` (emulated on this machine), or ``"native"`` to run
            the levels on the hardware the model is on.
        reference: ``"float64"`` (every op of the model in float64, IEEE).
        tolerance: the largest normwise relative error an output may have: a number, or a dict of output names
            with an optional ``"default"``; by default ``metrics.DEFAULT_TOLERANCE`` (1e-2, see there why).
        progress: show a progress bar on stderr.
        policy: a :class:`~tf32lab.Policy` measured as one more row, ``"policy"``, after the levels: the model
            runs with it applied (its default None: the level in force where ``check`` is called), and each
            layer's introduced error is the one at the level the policy gives it.
        speed: predict each level's speedup on the target (``tf32lab.speed.predict``; GPU targets), counted during the
            first end-to-end run.

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
        raise Tf32LabError(f"check() takes a tf32lab.Workload, not {type(workload).__name__}")
    levels = check_levels(levels)
    check_target(target)
    if reference not in REFERENCES:
        raise Tf32LabError(f"unknown reference {reference!r}; accepted: {', '.join(map(repr, REFERENCES))}")
    tolerances = tolerances_of(tolerance)
    refuse_applied(workload, "check")
    with kept_flags() as changed:
        report = _check(workload, levels, target, reference, tolerances, progress, policy, speed)
    return _noted(report, changed)


def _check(workload: Workload, levels: tuple[str, ...], target: str, reference: str, tolerances: dict[str, float],
           progress: bool, policy: Optional[Policy], speed: bool) -> Report:
    started = time.perf_counter()
    row = PolicyRow.of(policy, workload.model) if policy is not None else None
    extra = tuple(level for level in LEVELS if row is not None and level in row.levels and level not in levels)
    alike = alike_levels(levels + extra, target)  # level -> the earlier level the target computes identically, if any
    measured = [level for level in levels + extra if alike[level] is None]
    runs = len([level for level in levels if alike[level] is None]) + (row is not None)
    with Progress(progress, steps=1 + runs) as bar, \
            Session(workload, measured, target, tolerances, speed=speed, bar=bar) as session:
        results: dict[str, LevelResult] = {}
        for level in levels:
            same = alike[level]
            if same is not None:  # the target computes both levels alike: measured once
                results[level] = dataclasses.replace(results[same], level=level, same_as=same, seconds=0.0)
                continue
            results[level] = session.level(level)
        if "highest" in results and results["highest"].same_as is None:
            results["highest"] = session.steady(results["highest"])
        rows = [results[level] for level in levels]
        if row is not None:
            rows.append(session.policy(row, alike))
    predicted = session.predicted(levels)
    if predicted is not None:
        rows = [dataclasses.replace(r, speedup=session.speedup(r, predicted, row)) for r in rows]
    return Report(
        workload=str(workload.name), target=target, reference=reference, tolerance=dict(tolerances),
        levels=tuple(rows), environment=environment_of(workload),
        seconds=time.perf_counter() - started, notes=tuple(session.notes()), speed=predicted,
    )


def refuse_applied(workload: Workload, what: str) -> None:
    """Refuse, before any run, a model that carries an applied policy: it sets each module's level as the module
    runs, so ``check`` would measure the policy under every level's name (and ``tune`` would tune on top of it).
    Refusing (rather than lifting it for the duration) leaves the user's policy untouched; the message says how to
    go on."""
    from tf32lab.control.policy import applied_to

    found = applied_to(workload.model)
    if found is None:
        return
    from tf32lab.report.conclusion import policy_summary

    summary = policy_summary(dict(found.to_dict(), base=get_float32_matmul_precision()))
    measure = {
        "check": "pass it as check(policy=...) (tf32lab check --policy FILE) to measure it beside the levels",
        "tune": "tune searches a policy itself",
        "predict": "check(policy=...) (tf32lab check --policy FILE) predicts its speedup beside the levels",
        "bench": "bench times each level of the model without a policy",
    }[what]
    raise Tf32LabError(f"workload {workload.name!r}: its model has a policy applied ({summary}); {what} would "
                       f"measure that policy instead of each level: remove it first (handle.remove()); {measure}")


@contextlib.contextmanager
def kept_flags() -> Iterator[list[str]]:
    """Every PyTorch precision flag as it was, put back on every exit (KeyboardInterrupt included): a model that
    calls ``torch.set_float32_matmul_precision`` in its forward must not leave its level in the process. Yields a
    list that names, at exit, each flag that had been changed (for the report's notes)."""
    before = flags.snapshot()
    changed: list[str] = []
    try:
        yield changed
    finally:
        diff = before.diff(flags.snapshot())
        if diff:
            flags.restore(before)
            changed += [f"{name} {old!r} -> {new!r}" for name, old, new in diff]


def changed_note(changed: list[str]) -> str:
    return (f"the workload changed PyTorch's flags while it ran ({'; '.join(changed[:3])}"
            f"{' …' if len(changed) > 3 else ''}); they were put back as they were")


def _noted(report: Report, changed: list[str]) -> Report:
    return dataclasses.replace(report, notes=(*report.notes, changed_note(changed))) if changed else report


class Session:
    """A workload's float64 reference, run once on entry (each layer rerun at the ``measured`` levels), then
    end-to-end runs measured against it: a level (:meth:`level`) or a policy (:meth:`policy`). ``check`` is one
    session; ``tune`` measures many policies in one. Inside it the model is in eval mode; its state (buffers) is
    reset before each run and restored at the end. With ``speed`` (a GPU target), the first end-to-end run is
    counted for the speed model.
    """

    def __init__(self, workload: Workload, measured: list[str], target: str, tolerances: dict[str, float], *,
                 speed: bool = True, bar: Optional[Progress] = None) -> None:
        self.workload, self.target, self.tolerances = workload, target, tolerances
        self.measured = list(measured)
        self.bar = bar or Progress(False, 0)
        self.spill = SpillFile(min_bytes_from_env())
        self.recorder = _Recorder(workload.model, self.measured, target, self.spill)
        self.counting = Counting(workload.model) if speed and target in peaks.PEAKS else None
        self.runs = 0  # end-to-end runs so far
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Session:
        stack = self._stack
        try:
            stack.enter_context(eval_mode(self.workload.model))
            stack.enter_context(_released())
            stack.enter_context(self.spill)
            self.threads = stack.enter_context(OtherThreads())
            self.reset = stack.enter_context(_state_kept(self.workload.model))
            self._reference()
            if self.threads.ops and not self.recorder.family_ops:  # a report of nothing would call it safe
                raise Tf32LabError(self.threads.refusal(str(self.workload.name)))
        except BaseException:
            stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.__exit__(*exc)

    def _reference(self) -> None:
        workload, recorder = self.workload, self.recorder
        self.bar.step(f"{workload.name}: float64 reference, each layer at {len(self.measured)} level(s)")
        try:
            # not inference mode: its tensors keep no version counters
            with _float64_scripted(workload, recorder) as model, torch.inference_mode(False), \
                    torch.no_grad(), recorder:
                ref_inputs = map_tensors(widen, workload.inputs)
                recorder.model_inputs = {id(t) for _, t in named_tensors(ref_inputs)}
                self.ref_out = workload.run(model, ref_inputs)
        except Tf32LabError:
            raise
        except Exception as exc:
            if _out_of_memory(exc):
                raise _no_memory(workload, "the float64 reference", exc) from exc
            bug = internal_error(exc, f"running workload {workload.name!r} at the float64 reference")
            if bug is not None:
                raise bug from exc
            raise Tf32LabError(f"workload {workload.name!r} raised at the float64 reference, before any level ran: "
                               f"{_described(exc)}") from exc
        _check_comparable(workload, self.ref_out)
        _check_judgeable(workload, self.ref_out)
        _warn_unknown(self.tolerances, self.ref_out)

    def notes(self) -> list[str]:
        """What the report must say about the runs."""
        found = self.recorder.notes()
        threads = self.threads.note("not emulated, counted or measured by layer in any run (the float64 "
                                    "reference included), so their error is not in this report")
        return [*found, threads] if threads else found

    def _fresh(self, what: str) -> Optional[Counting]:
        self.bar.step(what)
        self.reset()  # every run starts from the state the model had (a buffer it updates as it runs)
        release_buffers()  # the reruns' scratch sizes are not this run's: memory the peak need not hold
        self.runs += 1
        counting = self.counting
        return counting if counting is not None and not counting.counts.ops else None

    def level(self, level: str) -> LevelResult:
        """One end-to-end run at ``level`` (one of ``measured``)."""
        counting = self._fresh(f"{level}: end to end")
        return _check_level(self.workload, level, self.target, self.recorder, self.ref_out, self.tolerances,
                            counting=counting)

    def steady(self, result: LevelResult) -> LevelResult:
        """``result`` (a level that fails without raising) run once more: when the outputs' errors differ, the
        model samples (``torch.randn``, dropout kept in train mode) and the failure is chance, not precision.
        Emulation and the float64 reference are deterministic, so the same model gives the same bits."""
        if result.passed or result.error is not None:
            return result
        again = self.level(result.level)
        first = [(o.name, o.normwise) for o in result.outputs]
        second = [(o.name, o.normwise) for o in again.outputs]
        if first == second or again.error is not None:
            return result
        name, value = next(((n, v) for (n, v), (_, w) in zip(first, second) if v != w), first[0])
        other = dict(second).get(name, math.nan)
        return dataclasses.replace(result, unstable=f"output {name!r}: normwise {value:.2e}, then {other:.2e}")

    def policy(self, row: PolicyRow, alike: dict[str, Optional[str]]) -> LevelResult:
        """One end-to-end run with ``row``'s policy applied (its levels among ``measured``, or ``alike`` them)."""
        counting = self._fresh("policy: end to end")
        return _check_level(self.workload, row.base, self.target, self.recorder, self.ref_out, self.tolerances,
                            row=row, alike=alike, counting=counting)

    def predicted(self, levels: Iterable[str]) -> Optional[SpeedReport]:
        """The speed report of the counted run, when one was counted."""
        if self.counting is None or not self.counting.counts.ops:
            return None
        return predict_counts(self.counting.counts, str(self.workload.name), self.target, levels)

    def seconds(self, row: PolicyRow) -> float:
        """The predicted time of one forward under ``row``'s policy (a speed model is needed)."""
        by_name = row.by_name  # every module's level; an op outside every module runs at the policy's base
        return seconds_at(self.counting.counts, self.target, lambda layer: by_name.get(layer, row.base))

    def speedup(self, result: LevelResult, predicted: SpeedReport, row: Optional[PolicyRow]) -> float:
        if result.policy is None or row is None:
            return predicted.level(result.level).speedup
        return predicted.level("highest").seconds / self.seconds(row)


@dataclasses.dataclass(frozen=True)
class PolicyRow:
    """A policy as check measures it: its level per module name (``ROOT`` for the model), unmatched rules refused."""

    policy: Policy
    base: str  # the level the model itself runs at: the policy's default, or the one in force here
    by_name: dict[str, str]
    levels: frozenset[str]

    @classmethod
    def of(cls, policy: Policy, model: torch.nn.Module) -> PolicyRow:
        if not isinstance(policy, Policy):
            raise Tf32LabError(f"check(policy=...) takes a tf32lab.Policy, not {type(policy).__name__}")
        unmatched = policy.unmatched_message(model)
        if unmatched is not None:
            raise Tf32LabError(unmatched)
        base = policy.default or get_float32_matmul_precision()
        if base not in LEVELS:  # the process's cells hold a value no level writes (a newer torch's)
            raise Tf32LabError(f"check(policy=...): the policy has no default level and the process level is "
                               f"{base!r} (a flag holds a value this tf32lab does not know); give the policy a "
                               "default level")
        by_name = {(a.name or ROOT): a.level or base for a in policy.explain(model)}
        return cls(policy, base, by_name, frozenset(by_name.values()))

    def describe(self) -> dict[str, Any]:
        return dict(self.policy.to_dict(), base=self.base)


def alike_levels(levels: tuple[str, ...], target: str) -> dict[str, Optional[str]]:
    """For each level, an earlier one whose every op family gets the same math on ``target`` (emulation is
    deterministic, so one measurement serves both)."""
    found: dict[str, Optional[str]] = {}
    seen: list[tuple[str, dict[str, str]]] = []
    for level in levels:
        if target == "native":
            found[level] = None
            continue
        with precision(level):
            level_maths = maths(target)
        found[level] = next((other for other, m in seen if m == level_maths), None)
        if found[level] is None:
            seen.append((level, level_maths))
    return found


def _check_level(workload: Workload, level: str, target: str, recorder: _Recorder, ref_out: Any,
                 tolerances: dict[str, float], row: Optional[PolicyRow] = None,
                 alike: Optional[dict[str, Optional[str]]] = None, counting: Optional[Counting] = None) -> LevelResult:
    """One end-to-end run at ``level`` (with ``row``: the policy applied, ``level`` its base) and its result;
    ``counting``: the run's work is counted too (for the speed prediction)."""
    started = time.perf_counter()
    accumulated = _Accumulated(recorder, counting)
    out, error = None, None
    applied = row.policy.applied(workload.model) if row else contextlib.nullcontext()
    with _level_context(level, target) as emu, applied:
        level_maths = {} if emu is None else (_policy_maths(row, target) if row else maths(target))
        try:
            with accumulated, (counting or contextlib.nullcontext()), torch.inference_mode():
                out = workload.run()
        except Tf32LabError:
            raise
        except Exception as exc:
            if _out_of_memory(exc):  # not a finding about the level: check itself is short of memory
                raise _no_memory(workload, "the policy" if row else f"level {level!r}", exc) from exc
            bug = internal_error(exc, f"running workload {workload.name!r} "
                                      f"{'with the policy' if row else f'at level {level!r}'}")
            if bug is not None:  # tf32lab's own failure: not a finding about the level
                raise bug from exc
            error = _described(exc)  # the model cannot run at this level: that is the finding
    outputs: tuple[metrics.OutputError, ...] = ()
    metric = None
    if error is None:
        outputs = _outputs(out, ref_out, tolerances)
        if workload.metric is not None:
            try:
                metric = float(workload.metric(out, ref_out))
            except Exception as exc:
                raise Tf32LabError(
                    f"workload {workload.name!r}: its metric raised {type(exc).__name__}: {exc}") from exc
    layers = []
    for name, module in recorder.layers:
        at = level
        if row is not None:  # the level the policy gives this layer, as measured (a level computed alike)
            at = row.by_name.get(name, level)
            at = (alike or {}).get(at) or at
        introduced, why = _introduced(recorder, accumulated, at, name)
        acc, diverged = accumulated.result(name, finished=error is None)
        reasons = "; ".join(r for r in (why, diverged) if r)
        layers.append(LayerError(name, type(module).__name__, recorder.count[name], introduced, acc,
                                 reasons or None))
    ranked = sorted(layers, key=lambda e: -math.inf if math.isnan(e.introduced) else -e.introduced)
    coverage = {} if emu is None else {f"{op} {m}": n for (op, m), n in sorted(emu.coverage.items())}
    unhandled = {} if emu is None else dict(sorted(emu.unhandled.items()))
    return LevelResult("policy" if row else level, level_maths, outputs, tuple(ranked), metric, coverage, unhandled,
                       time.perf_counter() - started, error=error, policy=row.describe() if row else None)


def _policy_maths(row: PolicyRow, target: str) -> dict[str, str]:
    """Per family: the math every level of the policy gives it, or ``mixed``."""
    found: dict[str, set[str]] = {}
    for level in sorted(row.levels):
        with precision(level):
            for key, m in maths(target).items():
                found.setdefault(key, set()).add(m)
    return {key: values.pop() if len(values) == 1 else "mixed" for key, values in found.items()}


def _introduced(recorder: _Recorder, accumulated: _Accumulated, level: str, name: str) -> tuple[float, Optional[str]]:
    """A layer's worst introduced error at ``level``: from its reruns, and from the end-to-end run for the calls
    that the end-to-end run computes exactly as a rerun would (fed the model's own inputs)."""
    found = [recorder.introduced[level][name]] if name in recorder.introduced[level] else []
    found += [(accumulated.per_call.get(key, math.nan), None) for key in recorder.as_accumulated if key[0] == name]
    if not found:
        return math.nan, None
    why = next((w for _, w in found if w), None)
    values = [v for v, _ in found]
    return (math.nan if any(math.isnan(v) for v in values) else max(values)), why


def _described(exc: BaseException) -> str:
    """``LinAlgError: linalg.cholesky: ...``: the exception's public name and its message, on one line (of a
    TorchScript traceback, its first and last lines)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] + (f" … {lines[-1]}" if len(lines) > 1 else "") if lines else ""
    name = type(exc).__name__.lstrip("_")
    return f"{name}: {text}" if text else name


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


@contextlib.contextmanager
def _level_context(level: str, target: str):
    with precision(level):
        if target == "native":
            yield None
        else:
            with emulate(target) as emu:
                yield emu


# -- the reference run: which modules are layers, their outputs, the error each introduces -----------------------
def _hookable(model: torch.nn.Module) -> tuple[list[tuple[str, torch.nn.Module]], list[str]]:
    """The modules of ``model`` that take hooks, and the TorchScript ones that do not (nor do their insides)."""
    found, scripted = [], []
    script = torch.jit.ScriptModule
    for name, module in model.named_modules():
        if any(name == s or name.startswith(s + ".") or s == ROOT for s in scripted):
            continue
        if isinstance(module, script):
            scripted.append(name or ROOT)
            continue
        found.append((name or ROOT, module))
    return found, scripted


def _versions(tree: Any) -> list[Optional[int]]:
    """Each tensor's version counter (how many in-place writes it has had); None for inference tensors."""
    return [None if t.is_inference() else t._version for _, t in named_tensors(tree)]


@contextlib.contextmanager
def _float64_scripted(workload: Workload, recorder: _Recorder):
    """The model to run for the reference: TorchScript parts swapped for float64 copies of them (a ScriptModule
    checks dtypes where no mode can widen), put back afterwards (and for every float32 rerun)."""
    model = workload.model
    if ROOT in recorder.scripted:
        yield _scripted_twin(model, workload.name, ROOT)
        return
    swapped = recorder.swapped
    try:
        for name in recorder.scripted:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            original = parent._modules[child]
            twin = _scripted_twin(original, workload.name, name)
            parent._modules[child] = twin
            swapped.append((parent, child, original, twin))
        yield model
    finally:
        for parent, child, original, _ in reversed(swapped):
            parent._modules[child] = original
        swapped.clear()


@contextlib.contextmanager
def _originals(swapped: list):
    """The float32 TorchScript parts back in place while a layer reruns in float32."""
    for parent, child, original, _ in swapped:
        parent._modules[child] = original
    try:
        yield
    finally:
        for parent, child, _, twin in swapped:
            parent._modules[child] = twin


def _scripted_twin(module: torch.nn.Module, workload: str, name: str) -> torch.nn.Module:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ScriptModule.double() reads .grad of its parameters
            twin = copy.deepcopy(module)
            return twin.to(torch.float64)
    except Exception as exc:
        raise Tf32LabError(f"workload {workload!r}: the TorchScript module {name!r} cannot be copied to float64 "
                           f"for the reference: {type(exc).__name__}: {exc}") from exc


class _Frame:
    """A module call in progress in the reference run."""

    __slots__ = ("args", "inner", "kwargs", "name", "ran", "versions")

    def __init__(self, name: str, args: tuple, kwargs: dict) -> None:
        self.name, self.args, self.kwargs, self.ran = name, args, kwargs, False
        self.versions = _versions((args, kwargs))
        self.inner: list[tuple[str, int]] = []  # layer calls made inside this one: (name, call index)


class _Recorder:
    """Hooks and a float64 mode for the reference run (see the module's docstring)."""

    def __init__(self, model: torch.nn.Module, levels: list[str], target: str,
                 spill: Optional[SpillFile] = None) -> None:
        self.model, self.levels, self.target = model, levels, target
        self.spill = spill or SpillFile()
        self.modules, self.scripted = _hookable(model)
        self.mode = Float64Run(self._op, self._written)
        self.shared: dict[int, list[tuple[str, int]]] = {}  # storage address -> outputs kept without a copy
        self.stack: list[_Frame] = []
        self.outputs: dict[tuple[str, int], tuple[Any, dict[str, float]]] = {}  # float64 output, each ‖r‖²
        self.count: dict[str, int] = {}  # calls per layer
        self.layers: list[tuple[str, torch.nn.Module]] = []  # in the order they first ran
        self.introduced: dict[str, dict[str, tuple[float, Optional[str]]]] = {level: {} for level in levels}
        self.handles: list = []
        self.rerunning = False
        self.scratch: Optional[torch.Tensor] = None
        self.swapped: list = []  # (parent, name, float32 original, float64 twin) of TorchScript parts
        self.model_inputs: set[int] = set()  # ids of the (widened) workload inputs
        self.as_accumulated: set[tuple[str, int]] = set()  # calls whose introduced error is their accumulated one
        self.family_ops = 0  # matmul-family ops the reference saw on this thread (not another's: see OtherThreads)

    def __enter__(self) -> _Recorder:
        try:
            for name, module in self.modules:
                self.handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True))
                self.handles.append(module.register_forward_hook(self._post(name, module), with_kwargs=True))
            self.mode.__enter__()
        except BaseException:
            self._unhook()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.mode.__exit__(*exc)
        finally:
            self._unhook()
            self.scratch = None

    def _unhook(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _op(self, func) -> None:
        if not self.rerunning and optable.family(func.name()) is not None:
            self.family_ops += 1
            if self.stack:
                self.stack[-1].ran = True

    def _written(self, tensors: list[torch.Tensor]) -> None:
        """Copy-on-write: a kept output is copied only when the model is about to write into its storage."""
        for t in tensors:
            keys = self.shared.pop(_address(t), None) if self.shared else None
            for key in keys or ():
                reference, norms = self.outputs[key]
                self.outputs[key] = (map_tensors(torch.clone, reference), norms)

    def _keep(self, name: str, i: int, output: Any) -> Any:
        """The output as kept: a large float64 tensor written out (``tf32lab.measure.spill``), the rest without a copy."""
        kept = map_tensors(lambda t: self.spill.put(t.detach()), output)
        for _, t in named_tensors(kept):
            self.shared.setdefault(_address(t), []).append((name, i))
        return kept

    def _pre(self, name: str):
        def hook(module, args, kwargs):
            if not self.rerunning:
                self.stack.append(_Frame(name, args, kwargs))

        return hook

    def _post(self, name: str, module: torch.nn.Module):
        def hook(module, args, kwargs, output):
            if self.rerunning:
                return None
            frame = self.stack.pop()
            if not frame.ran:
                if self.stack:
                    self.stack[-1].inner += frame.inner
                return None
            i = self.count.get(name, 0)
            if i == 0:
                self.layers.append((name, module))
            self.count[name] = i + 1
            self.mode.paused = True  # our own arithmetic, in float64 already
            try:
                norms = {key: float(torch.linalg.vector_norm(t)) ** 2 for key, t in named_tensors(output)
                         if t.is_floating_point() or t.is_complex()}
                reference = self._keep(name, i, output)
                self.outputs[(name, i)] = (reference, norms)
                self._introduce(name, module, frame, i)
            finally:
                self.mode.paused = False
            if self.stack:
                self.stack[-1].inner.append((name, i))
            return None

        return hook

    def _introduce(self, name: str, module: torch.nn.Module, frame: _Frame, i: int) -> None:
        """Run ``module`` again under each level, fed the inputs of this call, its inner layers answering with
        their reference outputs; its output's error against the reference is what it introduces."""
        if _versions((frame.args, frame.kwargs)) != frame.versions:
            self._worst(name, math.nan, "not fed: it changes its own inputs in place")
            return
        tensors = [id(t) for _, t in named_tensors((frame.args, frame.kwargs))]
        if not frame.inner and tensors and all(t in self.model_inputs for t in tensors):
            # fed the model's own inputs and nothing nested: the end-to-end run computes exactly this call
            self.as_accumulated.add((name, i))
            return
        reference, norms = self.outputs[(name, i)]
        inner = self._inner_outputs(frame)
        for level in self.levels:
            args, kwargs = map_tensors(_to_float32, frame.args), map_tensors(_to_float32, frame.kwargs)
            self.rerunning = True
            try:
                with _state_kept(module), _originals(self.swapped), _answering(inner), \
                        _level_context(level, self.target), torch.inference_mode():
                    output = module(*args, **kwargs)
                error = self._normwise(output, reference, norms)
                why = None
            except Tf32LabError:
                raise
            except Exception as exc:
                if _out_of_memory(exc):
                    raise
                bug = internal_error(exc, f"rerunning layer {name!r} alone at level {level!r}")
                if bug is not None:
                    raise bug from exc
                error, why = math.nan, f"raised when run alone at this level: {_described(exc)}"
            finally:
                self.rerunning = False
            self._worst(name, error, why, level)

    def _worst(self, name: str, error: float, why: Optional[str], level: Optional[str] = None) -> None:
        for lv in (self.levels if level is None else [level]):
            known = self.introduced[lv].get(name)
            # the worst call wins; a call that could not be measured (NaN) wins over any number, and stays
            if known is None or (not math.isnan(known[0]) and (math.isnan(error) or error > known[0])):
                self.introduced[lv][name] = (error, why or (known[1] if known else None))

    def _inner_outputs(self, frame: _Frame) -> dict[torch.nn.Module, list[Any]]:
        modules = dict(self.layers)
        answers: dict[torch.nn.Module, list[Any]] = {}
        for name, i in frame.inner:
            answers.setdefault(modules[name], []).append(
                map_tensors(_to_float32, self.outputs[(name, i)][0], (torch.Tensor, Spilled)))
        return answers

    def _normwise(self, output: Any, reference: Any, norms: dict[str, float]) -> float:
        if self.scratch is None:
            self.scratch = _scratch(_device_of(reference))
        error, _ = _tree_normwise(output, reference, norms, self.scratch)
        return error

    def notes(self) -> list[str]:
        """What the report must say about the reference run."""
        found = []
        if self.scripted:
            names = ", ".join(repr(s) for s in self.scripted[:5]) + (" …" if len(self.scripted) > 5 else "")
            found.append(f"not broken down into layers: {names} (TorchScript: PyTorch takes no hooks on a "
                         f"ScriptModule); its ops count toward the module that calls it, and the outputs are "
                         f"measured end to end; its reference ran on a float64 copy of it")
        if self.mode.float32_writes:
            found.append(f"the reference wrote {self.mode.float32_writes} time(s) into tensors the model holds in "
                         f"float32 (buffers it updates): those values are rounded to float32 in the reference too")
        return found


@contextlib.contextmanager
def _answering(answers: dict[torch.nn.Module, list[Any]]):
    """The modules in ``answers`` return their next recorded output instead of computing (a layer's own error
    leaves out the layers nested in it)."""
    saved = {}
    for module, outputs in answers.items():
        pending = iter(outputs)
        original = module.forward

        def forward(*args, _pending=pending, _original=original, **kwargs):
            return _next_or_run(_pending, _original, args, kwargs)

        saved[module] = module.__dict__.get("forward", _MISSING)
        module.forward = forward
    try:
        yield
    finally:
        for module, before in saved.items():
            if before is _MISSING:
                del module.forward
            else:
                module.forward = before


_MISSING = object()


def _next_or_run(pending, original, args, kwargs) -> Any:
    answer = next(pending, _MISSING)
    return original(*args, **kwargs) if answer is _MISSING else answer


def _device_of(tree: Any) -> torch.device:
    return next((t.device for _, t in named_tensors(tree)), torch.device("cpu"))


def _to_float32(t: Union[torch.Tensor, Spilled]) -> torch.Tensor:
    if isinstance(t, Spilled):
        return t.load(torch.float32)
    if t.dtype == torch.float64:
        return t.float()
    return t.to(torch.complex64) if t.dtype == torch.complex128 else t.clone()


def _address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Accumulated:
    """Hooks on the layers for one end-to-end run: each call's output against the reference output of the same
    call, the worst kept per layer; a call that cannot be matched makes the layer diverged."""

    def __init__(self, recorder: _Recorder, counting: Optional[Counting] = None) -> None:
        self.recorder, self.counting = recorder, counting
        self.errors: dict[str, float] = {}
        self.count: dict[str, int] = {}
        self.diverged: dict[str, str] = {}
        self.per_call: dict[tuple[str, int], float] = {}  # for the calls in recorder.as_accumulated
        self.handles: list = []
        self.scratch: Optional[torch.Tensor] = None

    def __enter__(self) -> _Accumulated:
        for name, module in self.recorder.layers:
            self.handles.append(module.register_forward_hook(self._post(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.scratch = None

    def _post(self, name: str):
        def hook(module, args, output):
            if self.counting is None:
                return self._measure(name, output)
            self.counting.paused = True  # our arithmetic is not the model's work
            try:
                return self._measure(name, output)
            finally:
                self.counting.paused = False

        return hook

    def _measure(self, name: str, output: Any) -> None:
        i = self.count.get(name, 0)
        self.count[name] = i + 1
        found = self.recorder.outputs.get((name, i))
        if found is None:
            return
        reference, norms = found
        if self.scratch is None:
            self.scratch = _scratch(_device_of(reference))
        error, mismatch = _tree_normwise(output, reference, norms, self.scratch)
        if (name, i) in self.recorder.as_accumulated:
            self.per_call[(name, i)] = error
        if mismatch is not None:
            self.diverged.setdefault(name, f"call {i + 1}: {mismatch}")
        elif math.isnan(error) or error > self.errors.get(name, 0.0):
            self.errors[name] = error

    def result(self, name: str, finished: bool) -> tuple[float, Optional[str]]:
        """The worst accumulated error of ``name`` over its matched calls, and why it diverged, if it did."""
        expected, seen = self.recorder.count[name], self.count.get(name, 0)
        why = self.diverged.get(name)
        if why is None and seen != expected and (finished or seen > expected):
            why = f"called {seen} time(s) end to end, {expected} in the reference"
        return self.errors.get(name, math.nan), why


_CHUNK = 1 << 16  # elements: a chunk's difference stays in the L2 cache between its two passes (3x faster than 1 Mi)


def _scratch(device: torch.device) -> torch.Tensor:
    """The buffer :func:`_tree_normwise` works in: a chunk read back from a spill file, and a chunk's difference."""
    return torch.empty(2 * _CHUNK, dtype=torch.float64, device=device)


def _tree_normwise(output: Any, reference: Any, norms: dict[str, float],
                   scratch: torch.Tensor) -> tuple[float, Optional[str]]:
    """‖y − r‖ / ‖r‖ over the float tensors of a module's output, in float64 (``norms``: each ‖r‖², from the
    reference run), and what does not match the reference's structure, if anything. The difference goes through a
    reused chunk buffer (:func:`_scratch`): fresh multi-MB temporaries cost page faults that dwarf the arithmetic.
    A reference kept in memory and one read back from a spill file give the same bits."""
    refs = {key: r for key, r in named_leaves(reference) if isinstance(r, (torch.Tensor, Spilled))}
    read, work = scratch[:_CHUNK], scratch[_CHUNK:]
    diff2 = ref2 = 0.0
    for name, y in named_tensors(output):
        r = refs.get(name)
        if r is None or name not in norms:
            continue
        if r.shape != y.shape:
            what = "its output" if name == "output" else f"its output {name}"
            return math.nan, f"{what} has shape {tuple(y.shape)}, the reference's {tuple(r.shape)}"
        if isinstance(r, Spilled):
            parts = r.chunks(read)
        else:
            if y.is_complex():
                y, r = torch.view_as_real(y), torch.view_as_real(r)
            flat = r.reshape(-1)
            parts = (flat[start:start + _CHUNK] for start in range(0, flat.numel(), _CHUNK))
        y = y.reshape(-1)
        start = 0
        for part in parts:
            d = work[:part.numel()]
            d.copy_(y[start:start + part.numel()])  # widened exactly; then a float64-only subtraction (fast path)
            d.sub_(part)
            diff2 += float(torch.dot(d, d))
            start += part.numel()
        ref2 += norms[name]
    if ref2 == 0.0:
        return (0.0 if diff2 == 0.0 else math.inf), None
    return math.sqrt(diff2 / ref2), None


# -- outputs ----------------------------------------------------------------------------------------------------
def _outputs(out: Any, ref_out: Any, tolerances: dict[str, float]) -> tuple[metrics.OutputError, ...]:
    refs = dict(named_leaves(ref_out))
    found = dict(named_leaves(out))
    results = []
    for name, r in refs.items():
        tolerance = tolerances.get(name, tolerances["default"])
        y = found.get(name, metrics.ABSENT)
        if r is not None or y is not None:
            results.append(_range_said(metrics.compare(name, y, r, tolerance), y, r))
    for name in found.keys() - refs.keys():
        results.append(metrics.compare(name, found[name], metrics.ABSENT, tolerances.get(name, tolerances["default"])))
    return tuple(results)


def _range_said(found: metrics.OutputError, y: Any, r: Any) -> metrics.OutputError:
    """A float32 output that is Inf (or NaN) where its float64 reference is finite but larger than float32 can
    hold: its failure says so, for it is float32's range, not its rounding, that no precision level fixes."""
    if found.failure is None or not (isinstance(y, torch.Tensor) and isinstance(r, torch.Tensor)) \
            or y.dtype != torch.float32 or y.shape != r.shape or r.is_complex():
        return found
    lost = ~torch.isfinite(y) & torch.isfinite(r)
    if not bool(lost.any()):
        return found
    largest = float(r[lost].double().abs().max())
    if largest <= torch.finfo(torch.float32).max:
        return found
    return dataclasses.replace(found, failure=f"{found.failure}; the reference reaches {largest:.1e} there, "
                                              f"{BEYOND_FLOAT32} (largest finite {torch.finfo(torch.float32).max:.1e})")


def _check_comparable(workload: Workload, ref_out: Any) -> None:
    leaves = list(named_leaves(ref_out))
    if not any(metrics.comparable(value) for _, value in leaves):
        kinds = ", ".join(sorted({"None" if v is None else f"an empty {type(v).__name__}" for _, v in leaves}))
        raise Tf32LabError(f"workload {workload.name!r}: its output has nothing to compare ({kinds or 'nothing'}); "
                           f"return the tensors to check (a tensor, or a tuple/dict of them)")


def _check_judgeable(workload: Workload, ref_out: Any) -> None:
    """A float64 reference with no finite value cannot judge any level: the model makes it without any reduced
    precision, and an output that is NaN at every level would compare as equal (normwise 0, "safe"). Said before
    any level runs, as bad input (``Tf32LabError``: the CLI's exit code 2), never as a pass. Where only some
    elements are NaN or Inf, the rest is compared and the non-finite ones must be held alike, position and value
    (``metrics.compare``; the output's note counts them): a masked logit is ``-inf`` on purpose."""
    for name, value in named_leaves(ref_out):
        if isinstance(value, float):
            value = torch.tensor(value)
        if not isinstance(value, torch.Tensor) or not (value.is_floating_point() or value.is_complex()) \
                or value.numel() == 0:
            continue
        real = torch.view_as_real(value) if value.is_complex() else value
        if not bool(torch.isfinite(real).any()):
            nan = int(torch.isnan(real).sum())
            what = "NaN at every element" if nan == real.numel() else f"NaN or Inf at every element ({nan} NaN)"
            raise Tf32LabError(f"workload {workload.name!r}: the float64 reference itself is {what} of output "
                               f"{name!r}: cannot judge any level against it (it is there without reduced "
                               f"precision); fix the model or its inputs, or leave that output out")


def tolerances_of(tolerance: Union[float, Mapping[str, float], None]) -> dict[str, float]:
    if tolerance is None:
        return {"default": metrics.DEFAULT_TOLERANCE}
    if isinstance(tolerance, Mapping):
        found = {str(k): _tolerance_value(v, k) for k, v in tolerance.items()}
        return {"default": found.pop("default", metrics.DEFAULT_TOLERANCE), **found}
    return {"default": _tolerance_value(tolerance, None)}


def _tolerance_value(value: Any, key: Optional[str]) -> float:
    where = f" for {key!r}" if key is not None else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise Tf32LabError(f"bad tolerance{where} {value!r}; accepted: a finite number >= 0 (normwise relative error)")
    return float(value)


def _warn_unknown(tolerances: dict[str, float], ref_out: Any) -> None:
    names = {name for name, _ in named_leaves(ref_out)}
    unknown = sorted(set(tolerances) - names - {"default"})
    if unknown:
        warnings.warn(f"tolerance given for outputs the workload does not have: {', '.join(unknown)}; "
                      f"its outputs: {', '.join(sorted(names))}", stacklevel=3)


def check_target(target: str) -> str:
    """``target`` if it names a row of ``tf32lab.know.targets`` or is ``"native"``, else a one-line ``Tf32LabError``."""
    if target == "native":
        return target
    try:
        targets.get(target)
    except Tf32LabError as exc:
        raise Tf32LabError(f"{exc}, or 'native' (this machine's own hardware)") from None
    return target


@contextlib.contextmanager
def _state_kept(model: torch.nn.Module):
    """The model's buffers as they were, put back on every exit; yields ``reset()``, which puts them back now.
    A model that updates a buffer as it runs (a running average, a cache) would otherwise start each of
    check's runs from another state, and keep the last one."""
    kept = []
    with torch.no_grad():
        for buffer in model.buffers():
            if not buffer.is_inference():
                kept.append((buffer, buffer.detach().clone()))

    def reset() -> None:
        with torch.no_grad():
            for buffer, value in kept:
                if buffer.shape == value.shape:
                    buffer.copy_(value)

    try:
        yield reset
    finally:
        reset()


# -- the model --------------------------------------------------------------------------------------------------
def environment_of(workload: Workload) -> dict[str, Any]:
    device = next((t.device for t in workload.model.parameters()), None)
    if device is None:
        device = next((t.device for _, t in named_tensors(workload.inputs)), torch.device("cpu"))
    hw = hardware.detect()
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "cpu": hw.cpu,
        "cpus": hw.usable_cpus,
        "threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    return env


class Progress:
    """A rich progress bar on stderr when asked for; otherwise nothing."""

    def __init__(self, show: bool, steps: int) -> None:
        self.show, self.steps, self.bar, self.task = show, steps, None, None

    def __enter__(self) -> Progress:
        if self.show:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("{task.description:<48}"), BarColumn(), TimeElapsedColumn(),
                                console=Console(stderr=True), transient=True)
            self.bar.__enter__()
            self.task = self.bar.add_task("", total=self.steps)
        return self

    def step(self, description: str) -> None:
        if self.bar is not None:
            if self.bar.tasks[0].description:
                self.bar.advance(self.task)
            self.bar.update(self.task, description=description)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)
