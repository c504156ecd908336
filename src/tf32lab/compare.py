"""``check(workload)``: how much each precision level changes a model, output by output and layer by layer.

One float64 run of a copy of the model gives the reference, and records, for every module that runs
matmul-family ops itself (a *layer*), its inputs and its output. Then, per level, under ``precision(level)`` and
``emulate(target)`` (or on the real hardware with ``target="native"``):

1. an end-to-end run: the output metrics (``tf32lab.metrics``) and each layer's *accumulated* error;
2. a run in which every layer is fed its reference inputs: each layer's *introduced* error.

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
import itertools
import math
import platform
import time
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, Optional, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import hardware, metrics, optable, targets
from .emulator import emulate, maths, release_buffers
from .errors import Tf32LabError
from .levels import LEVELS, check_level
from .report import LayerError, LevelResult, Report
from .scope import precision
from .trees import map_tensors, named_tensors
from .workload import Workload

__all__ = ["check", "check_levels", "check_target"]

REFERENCES = ("float64",)
ROOT = "(model)"  # how the model itself is named when it runs family ops directly


def check(workload: Workload, *, levels: Iterable[str] = LEVELS, target: str = "a100", reference: str = "float64",
          tolerance: Union[float, Mapping[str, float], None] = None, progress: bool = False) -> Report:
    """Measure ``workload`` at each level against a float64 reference, as ``target`` would compute it.

    Args:
        levels: precision levels to check, in order.
        target: a hardware profile from ``tf32lab.targets`` (emulated on this machine), or ``"native"`` to run
            the levels on the hardware the model is on.
        reference: ``"float64"`` (the model and inputs in float64, IEEE).
        tolerance: the largest normwise relative error an output may have: a number, or a dict of output names
            with an optional ``"default"``; by default ``metrics.DEFAULT_TOLERANCE`` (1e-2, see there why).
        progress: show a progress bar on stderr.

    Returns a :class:`~tf32lab.report.Report`; ``bool(report)`` is the verdict.

    Example:

        >>> import tf32lab
        >>> from tf32lab import builtin
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
    tolerances = _tolerances(tolerance)
    started = time.perf_counter()
    with _Progress(progress, steps=1 + 2 * len(levels)) as bar, _eval_mode(workload.model), _released():
        model = workload.model
        bar.step(f"{workload.name}: float64 reference")
        ref_model = _float64_copy(model, workload.name)
        recorder = _Recorder(ref_model)
        ref_inputs = map_tensors(_to_float64, workload.inputs)
        with torch.inference_mode(), recorder:
            ref_out = workload.run(ref_model, ref_inputs)
        _warn_unknown(tolerances, ref_out)
        results: list[LevelResult] = []
        for level in levels:
            same = _computed_as(level, target, results)
            if same is not None:  # the target computes both levels alike: measured once
                bar.step(f"{level}: computed as {same.level}")
                bar.step(f"{level}: computed as {same.level}")
                results.append(dataclasses.replace(same, level=level, same_as=same.level, seconds=0.0))
            else:
                results.append(_check_level(workload, level, target, recorder, ref_out, tolerances, bar))
    return Report(
        workload=str(workload.name), target=target, reference=reference, tolerance=dict(tolerances),
        levels=tuple(results), environment=_environment(workload), seconds=time.perf_counter() - started,
    )


def _check_level(workload: Workload, level: str, target: str, recorder: _Recorder, ref_out: Any,
                 tolerances: dict[str, float], bar: _Progress) -> LevelResult:
    started = time.perf_counter()
    model = workload.model
    layers = recorder.layers_of(model)
    bar.step(f"{level}: end to end")
    accumulated = _LayerErrors(recorder, layers, feed=False)
    with _level_context(level, target) as emu, accumulated, torch.inference_mode():
        out = workload.run()
        level_maths = {} if emu is None else maths(target)
    bar.step(f"{level}: each layer on its reference inputs")
    introduced = _LayerErrors(recorder, layers, feed=True)
    with _level_context(level, target), introduced, torch.inference_mode():
        workload.run()
    introduced_errors, accumulated_errors = introduced.errors, accumulated.errors
    outputs = _outputs(out, ref_out, tolerances)
    metric = None
    if workload.metric is not None:
        try:
            metric = float(workload.metric(out, ref_out))
        except Exception as exc:
            raise Tf32LabError(f"workload {workload.name!r}: its metric raised {type(exc).__name__}: {exc}") from exc
    ranked = sorted(
        (LayerError(name, type(module).__name__, len(recorder.calls[name]), introduced_errors[name],
                    accumulated_errors[name]) for name, module in layers),
        key=lambda e: -math.inf if math.isnan(e.introduced) else -e.introduced,
    )
    coverage = {} if emu is None else {f"{op} {m}": n for (op, m), n in sorted(emu.coverage.items())}
    unhandled = {} if emu is None else dict(sorted(emu.unhandled.items()))
    return LevelResult(level, level_maths, outputs, tuple(ranked), metric, coverage, unhandled,
                       time.perf_counter() - started)


def _computed_as(level: str, target: str, results: list[LevelResult]) -> Optional[LevelResult]:
    """An earlier level whose every op family gets the same math on ``target`` (emulation is deterministic)."""
    if target == "native":
        return None
    with precision(level):
        level_maths = maths(target)
    return next((r for r in results if r.same_as is None and r.maths == level_maths), None)


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


# -- the reference run: which modules are layers, and what they saw ---------------------------------------------
class _Recorder(TorchDispatchMode):
    """During the float64 run: the modules that ran family ops themselves, with their inputs (as float32, ready to
    feed the float32 model) and outputs (float64), per call."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.stack: list[list] = []  # [name, args, kwargs, ran_family_op]
        self.calls: dict[str, list[tuple[Any, Any, Any, dict[str, float]]]] = {}  # args, kwargs, output, ‖output‖²
        self.handles: list = []
        self.quiet = False

    def __enter__(self) -> _Recorder:
        for name, module in self.model.named_modules():
            self.handles.append(module.register_forward_pre_hook(self._pre(name or ROOT), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post, with_kwargs=True))
        try:
            return super().__enter__()
        except BaseException:
            self._unhook()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._unhook()

    def _unhook(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _pre(self, name: str):
        def hook(module, args, kwargs):
            self.stack.append([name, args, kwargs, False])

        return hook

    def _post(self, module, args, kwargs, output):
        name, args, kwargs, ran = self.stack.pop()
        if ran:
            reference = map_tensors(_keep, output)
            self.quiet = True  # the norms below are ours, not the parent module's ops
            try:
                norms = {key: float(torch.linalg.vector_norm(t)) ** 2 for key, t in named_tensors(reference)
                         if t.is_floating_point()}
            finally:
                self.quiet = False
            self.calls.setdefault(name, []).append(
                (map_tensors(_to_float32, args), map_tensors(_to_float32, kwargs), reference, norms))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.stack and not self.quiet and optable.family(func.name()) is not None:
            self.stack[-1][3] = True
        return func(*args, **(kwargs or {}))

    def layers_of(self, model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
        """The layers, as modules of ``model`` (the float32 original), in the order they first ran."""
        modules = {name or ROOT: module for name, module in model.named_modules()}
        return [(name, modules[name]) for name in self.calls if name in modules]


def _device_of(tree: Any) -> torch.device:
    return next((t.device for _, t in named_tensors(tree)), torch.device("cpu"))


def _to_float64(t: torch.Tensor) -> torch.Tensor:
    return t.double() if t.dtype == torch.float32 else t


def _to_float32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype == torch.float64 else t.clone()


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()  # the caller may change it in place (a residual ``x += ...``)


class _LayerErrors:
    """Hooks on the layers of the float32 model: each call's output against the reference, the worst call kept
    per layer; with ``feed``, each call gets its reference inputs instead of what the model computed."""

    def __init__(self, recorder: _Recorder, layers: list[tuple[str, torch.nn.Module]], feed: bool) -> None:
        self.recorder, self.layers, self.feed = recorder, layers, feed
        self.errors = {name: 0.0 for name, _ in layers}
        self.count = dict.fromkeys(self.errors, 0)
        self.handles: list = []
        self.scratch: Optional[torch.Tensor] = None

    def __enter__(self) -> _LayerErrors:
        for name, module in self.layers:
            if self.feed:
                self.handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.scratch = None

    def _pre(self, name: str):
        calls = self.recorder.calls[name]

        def hook(module, args, kwargs):
            i = self.count[name]
            if i < len(calls):
                ref_args, ref_kwargs = calls[i][:2]
                return map_tensors(torch.clone, ref_args), map_tensors(torch.clone, ref_kwargs)
            return None

        return hook

    def _post(self, name: str):
        calls = self.recorder.calls[name]

        def hook(module, args, output):
            i = self.count[name]
            self.count[name] = i + 1
            if i < len(calls):
                reference, norms = calls[i][2:]
                if self.scratch is None:
                    self.scratch = torch.empty(_CHUNK, dtype=torch.float64, device=_device_of(reference))
                # float64 ops: the emulator passes them through untouched
                error = _tree_normwise(output, reference, norms, self.scratch)
                if math.isnan(error) or error > self.errors[name]:
                    self.errors[name] = error

        return hook


_CHUNK = 1 << 20


def _tree_normwise(output: Any, reference: Any, norms: dict[str, float], scratch: torch.Tensor) -> float:
    """‖y − r‖ / ‖r‖ over the float tensors of a module's output, in float64 (``norms``: each ‖r‖², from the
    reference run). The difference goes through a reused chunk buffer: fresh multi-MB temporaries cost page
    faults that dwarf the arithmetic."""
    refs = dict(named_tensors(reference))
    diff2 = ref2 = 0.0
    for name, y in named_tensors(output):
        r = refs.get(name)
        if r is None or name not in norms or r.shape != y.shape:
            continue
        y, r = y.reshape(-1), r.reshape(-1)
        for start in range(0, r.numel(), scratch.numel()):
            part = r[start:start + scratch.numel()]
            d = torch.sub(y[start:start + part.numel()], part, out=scratch[:part.numel()])
            diff2 += float(torch.dot(d, d))
        ref2 += norms[name]
    if ref2 == 0.0:
        return 0.0 if diff2 == 0.0 else math.inf
    return math.sqrt(diff2 / ref2)


# -- outputs ----------------------------------------------------------------------------------------------------
def _outputs(out: Any, ref_out: Any, tolerances: dict[str, float]) -> tuple[metrics.OutputError, ...]:
    refs = dict(named_tensors(ref_out))
    results = []
    for name, y in named_tensors(out):
        r = refs.get(name)
        if r is None or not y.is_floating_point():
            continue
        results.append(metrics.output_error(name, y, r, tolerances.get(name, tolerances["default"])))
    return tuple(results)


def _tolerances(tolerance: Union[float, Mapping[str, float], None]) -> dict[str, float]:
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
    names = {name for name, _ in named_tensors(ref_out)}
    unknown = sorted(set(tolerances) - names - {"default"})
    if unknown:
        warnings.warn(f"tolerance given for outputs the workload does not have: {', '.join(unknown)}; "
                      f"its outputs: {', '.join(sorted(names))}", stacklevel=3)


def check_target(target: str) -> str:
    """``target`` if it names a row of ``tf32lab.targets`` or is ``"native"``, else a one-line ``Tf32LabError``."""
    if target == "native":
        return target
    try:
        targets.get(target)
    except Tf32LabError as exc:
        raise Tf32LabError(f"{exc}, or 'native' (this machine's own hardware)") from None
    return target


def check_levels(levels: Iterable[str]) -> tuple[str, ...]:
    """The levels, validated and without repeats, in order; a one-line ``Tf32LabError`` for a bad one."""
    if isinstance(levels, str):
        levels = (levels,)
    chosen = []
    for level in levels:
        try:
            check_level(level)
        except ValueError as exc:
            raise Tf32LabError(str(exc)) from None
        if level not in chosen:
            chosen.append(level)
    if not chosen:
        raise Tf32LabError(f"no levels to check; accepted: {', '.join(map(repr, LEVELS))}")
    return tuple(chosen)


# -- the model --------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module):
    """Eval mode while checking (dropout would make runs differ), each module's own mode restored after."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _float64_copy(model: torch.nn.Module, name: str) -> torch.nn.Module:
    """A float64 twin of ``model``: its float32 tensors are converted straight into the copy (the memo hands
    ``deepcopy`` the converted tensors), which costs a fraction of copying first and converting after."""
    memo: dict[int, Any] = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if tensor.dtype == torch.float32 and id(tensor) not in memo:
            twin = tensor.detach().to(torch.float64)
            if isinstance(tensor, torch.nn.Parameter):
                twin = torch.nn.Parameter(twin, requires_grad=tensor.requires_grad)
            memo[id(tensor)] = twin
    try:
        return copy.deepcopy(model, memo)
    except Exception as exc:
        raise Tf32LabError(f"workload {name!r}: the model cannot be copied for its float64 reference: "
                           f"{type(exc).__name__}: {exc}") from exc


def _environment(workload: Workload) -> dict[str, Any]:
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


class _Progress:
    """A rich progress bar on stderr when asked for; otherwise nothing."""

    def __init__(self, show: bool, steps: int) -> None:
        self.show, self.steps, self.bar, self.task = show, steps, None, None

    def __enter__(self) -> _Progress:
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
