"""What both integrations share: a framework's training step as a :class:`~tf32lab.TrainingWorkload`.

A framework trains its module through its own hooks (Lightning's ``training_step``, Hugging Face's
``compute_loss``), its own optimizer and schedulers, gradient accumulation and clipping. The training check trains
copies of a model with ``loss(output, batch)`` and ``optimizer(params)``. Here the one is put in the terms of the
other, without touching the run:

- the model is a view of the user's module (``check_training`` makes the one copy of it that its rows start
  from) whose class answers one more call, ``model(StepCall, micro_batches)``:
  the loss of one optimizer step, the framework's losses of its micro-batches summed as it scales them for
  gradient accumulation (the sum has the gradient the framework accumulates); any other call is the module's own
  ``forward``;
- the optimizer of a row is the run's own optimizers and schedulers, deep-copied onto the row's parameters
  (:class:`Steps`: clipping, each optimizer's step, the schedulers due);
- the batches are the run's first ones, read from its dataloader with every random stream and sampler generator
  put back afterwards (:func:`tf32lab.integrations.batches.first_batches`), so that the run reads the same
  batches in the same order;
- the report's files are rendered in the hook and written in a thread while the run trains
  (:class:`tf32lab.integrations.written.Written`).
"""

from __future__ import annotations

import collections
import collections.abc
import contextlib
import copy
import copyreg
import functools
import importlib
import logging
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Callable, NamedTuple, Optional, Union

import torch

from tf32lab.control.policy import Policy
from tf32lab.errors import Tf32LabError
from tf32lab.know.levels import LEVELS, check_conv, check_levels, level_cells
from tf32lab.know.targets import NATIVE, Target, check_value
from tf32lab.machine.hardware import resolve_target
from tf32lab.measure.training import check_training, elementwise_step, training_tolerance
from tf32lab.report.training import TrainingReport
from tf32lab.workloads.running import applied_refusal
from tf32lab.workloads.training import TrainingWorkload, check_steps

LOG = logging.getLogger("tf32lab.integrations")

ON_FAIL = ("raise", "warn")

# what the framework's own hooks warn about when a step runs outside its loop (a copy has no trainer)
_OUTSIDE_THE_LOOP = (r".*self\.log\(\)` but the `self\.trainer` reference is not registered.*",
                     r".*optimizer\.step\(\)` has been overridden after learning rate scheduler.*",
                     r".*Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`.*")


def require(module: str, framework: str, extra: str) -> Any:
    """``module`` imported, or one line naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise Tf32LabError(f"tf32lab's {framework} integration needs {framework} ({module} is not installed): "
                           f"pip install 'tf32lab[{extra}]'") from None


class Options(NamedTuple):
    """What both callbacks are given, checked at once in this order (one line naming the first bad value): not
    when training starts, after the run has loaded its model and data.

    >>> Options.checked(target="h100", steps=5, levels="high", tolerance=None, on_fail="warn").levels
    ('high',)
    """

    target: Union[str, Target]
    steps: int
    levels: tuple[str, ...]
    tolerance: Optional[float]
    on_fail: str
    conv: Optional[str] = None
    policy: Optional[Policy] = None

    @classmethod
    def checked(cls, target: Any, steps: Any, levels: Optional[Iterable[str]], tolerance: Any,
                on_fail: Any, conv: Any = None, policy: Any = None) -> Options:
        target, levels = check_target(target), check_levels(default_levels(levels))
        computable(target, levels)
        if policy is not None and not isinstance(policy, Policy):
            raise Tf32LabError(f"policy must be a tf32lab.Policy, not {type(policy).__name__} (a saved one: "
                               f"tf32lab.Policy.load(path))")
        if policy is not None:  # its levels too, at once: not when training starts, after the run loaded its data
            computable(target, [level for level in (policy.default, *(rule.level for rule in policy.rules))
                                if level is not None])
        return cls(target, check_steps(steps), levels, check_tolerance(tolerance), check_on_fail(on_fail),
                   check_conv(conv), policy)


def computable(target: Union[str, Target], levels: Iterable[str]) -> None:
    """A level an emulated ``target`` cannot compute (``bfx9`` before Blackwell), refused in the line the check
    would give, at once; ``"native"`` is the run's machine's, known when the check runs.

    >>> computable("b200", ("high", "bfx9"))
    >>> computable("a100", ("bfx9",))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    tf32lab.errors.Tf32LabError: level 'bfx9' (cuda.matmul = 'bfx9') needs compute capability 10.0 ...
    """
    if isinstance(target, str) and target == NATIVE:
        return
    resolved = resolve_target(target)
    for level in levels:
        for cell, value in level_cells(level).items():
            check_value(resolved, cell, value)


def check_on_fail(on_fail: Any) -> str:
    if not isinstance(on_fail, str) or on_fail not in ON_FAIL:  # an array's == is no bool
        raise Tf32LabError(f"on_fail must be 'raise' or 'warn', not {on_fail!r}")
    return on_fail


class StepCall:
    """The marker of the call ``model(StepCall(...), micro_batches)``: one optimizer step's loss,
    ``loss(model, micro_batches, step)`` (the framework's own sum over its gradient accumulation); with
    ``around``, a context ``around(model)`` entered around it (Lightning's manual optimization binds the row's
    optimizers there)."""

    def __init__(self, step: int, loss: Callable[[torch.nn.Module, list[Any], int], Any],
                 around: Optional[Callable[[torch.nn.Module], Any]] = None) -> None:
        self.step, self.loss, self.around = step, loss, around

    def run(self, model: torch.nn.Module, micro: list[Any]) -> torch.Tensor:
        with self.around(model) if self.around is not None else contextlib.nullcontext():
            return self.loss(model, micro, self.step)


def stepping_copy(module: torch.nn.Module, members: Optional[Mapping[str, Any]] = None) -> torch.nn.Module:
    """A view of ``module`` whose class is the module's own with one more call, ``model(StepCall, micro)``, and
    ``members`` (class attributes: they outlive the check's own copies of it, which instance attributes may not).

    A view, not a copy: it shares the module's parameters, buffers and submodules, and is never trained itself;
    ``check_training`` makes the one snapshot every row starts from (its deep copy of the workload's model), so
    the run's weights are copied once, as a hand-written check copies them."""
    base = type(module)

    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if args and isinstance(args[0], StepCall):
            return args[0].run(self, args[1])
        return base.forward(self, *args, **kwargs)

    own = {"forward": forward, "__qualname__": base.__qualname__, "__module__": base.__module__}
    refs: list[weakref.ref] = []  # the view and the run's module, once made
    if _copied_plainly(base):  # the check's copies of it (one a row and probe) made faster, alike

        def __deepcopy__(self: torch.nn.Module, memo: dict[int, Any]) -> torch.nn.Module:
            # what refers to the run's module itself (a hook that is one of its methods) refers to the copy, as
            # in deepcopy(module), not to a second copy of it
            return _module_copy(self, memo, refs[1]() if refs and self is refs[0]() else None)

        own["__deepcopy__"] = __deepcopy__
    stepping = type(base.__name__, (base,), {**(members or {}), **own})
    made = object.__new__(stepping)
    refs[:] = [weakref.ref(made), weakref.ref(module)]
    made.__dict__.update(module.__dict__)
    # a forward set on the instance (accelerate's autocast wrapper under bf16/fp16) would hide the class's: the
    # check trains in float32, without autocast
    made.__dict__.pop("forward", None)
    return made


def _module_copy(module: torch.nn.Module, memo: dict[int, Any], viewed: Optional[torch.nn.Module] = None
                 ) -> torch.nn.Module:
    """``copy.deepcopy(module, memo)``, the same copy made faster: the check copies the run's module once for its
    snapshot and again for each row and probe (about ten times), and a module's empty hook dicts (a dozen on each
    submodule), which ``deepcopy`` rebuilds through ``__reduce_ex__`` one by one, are most of a small model's copy
    (a LightningModule over a three-layer MLP: 0.41 ms by ``deepcopy``, 0.13 ms so). Each submodule is made as
    ``deepcopy`` makes it (``__new__``, its ``__getstate__`` copied, ``__setstate__``); any other value, the
    parameters and buffers included, is ``deepcopy``'s own copy, sharing ``memo``. A module whose class copies
    itself some other way (its own ``__deepcopy__``, ``__reduce__``, ``__reduce_ex__`` or slots) is left to
    ``deepcopy``, and so is one that ``copyreg`` copies or with its own ``__deepcopy__`` set on the instance.
    ``viewed``: the module ``module`` is a view of, copied as ``module`` is."""
    made = type(module).__new__(type(module))
    memo[id(module)] = made
    if viewed is not None and id(viewed) not in memo:
        memo[id(viewed)] = made
        memo.setdefault(id(memo), []).append(viewed)
    state = module.__getstate__()
    # kept alive as deepcopy keeps what it copies: a container __getstate__ made afresh (and the new empty dict
    # memo maps it to) must not pass its id on to a later one
    memo.setdefault(id(memo), []).append(state)
    if type(state) is not dict:  # a class's own state (not its __dict__'s entries): as deepcopy copies it
        if state is not None:
            made.__setstate__(copy.deepcopy(state, memo))
        return made
    copied: dict[str, Any] = {}
    for key, value in state.items():
        if type(value) in _ATOMIC:  # immutable: deepcopy gives the value itself (a device, an equal one)
            copied[key] = value
        elif type(value) in _EMPTIED and not value:  # a hook dict: a new empty one (shared ones stay shared)
            if id(value) not in memo:
                memo[id(value)] = type(value)()
            copied[key] = memo[id(value)]
        elif key == "_modules" and type(value) is dict:
            if id(value) not in memo:
                memo[id(value)] = {name: _submodule_copy(sub, memo) for name, sub in value.items()}
            copied[key] = memo[id(value)]
        else:
            copied[key] = copy.deepcopy(value, memo)
    made.__setstate__(copied)
    return made


_EMPTIED = (dict, collections.OrderedDict)
_ATOMIC = frozenset((type(None), bool, int, float, str, bytes, torch.dtype, torch.device))
_OWN_COPY = ("__deepcopy__", "__reduce__", "__reduce_ex__", "__slots__", "__new__")


@functools.lru_cache(maxsize=512)
def _copied_plainly(cls: type) -> bool:
    """Whether ``deepcopy`` copies instances of ``cls`` by ``__new__``, ``__getstate__`` and ``__setstate__``
    (no class of its MRO copies or makes them its own way)."""
    return all(not any(name in c.__dict__ for name in _OWN_COPY) for c in cls.__mro__ if c is not object)


def _submodule_copy(module: Optional[torch.nn.Module], memo: dict[int, Any]) -> Optional[torch.nn.Module]:
    if module is None:
        return None
    if id(module) in memo:  # shared: one copy, as deepcopy's memo makes it
        return memo[id(module)]
    cls = type(module)
    if _copied_plainly(cls) and cls not in copyreg.dispatch_table and vars(module).keys().isdisjoint(_OWN_COPY):
        return _module_copy(module, memo)
    return copy.deepcopy(module, memo)  # deepcopy asks copyreg's table and the instance first


class Steps(torch.optim.Optimizer):
    """The framework's optimizer step as one optimizer: gradients clipped (``clip``: ``(value, "norm" | "value")``,
    or a function of the parameters that clips them itself: a Trainer subclass's own clipping),
    each optimizer stepped (by ``stepper(optimizer)`` where the framework's hook steps it), then each scheduler
    that is due (``(scheduler, every)``: every so many steps). Its
    param groups and state are its optimizers' own. ``manual``: the module steps its optimizers itself (Lightning's
    manual optimization), and this one's ``step`` and ``zero_grad`` do nothing. ``zeroed``: the step's loss zeroed
    the gradients and backpropagated itself (through the framework's own hooks around them), and ``zero_grad``
    does nothing."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], schedulers: Sequence[tuple[Any, int]] = (),
                 clip: Union[tuple[float, str], Callable[[list[torch.Tensor]], Any], None] = None,
                 manual: bool = False,
                 stepper: Optional[Callable[[torch.optim.Optimizer], None]] = None, zeroed: bool = False) -> None:
        # not Optimizer.__init__: the groups are the optimizers' own (a scheduler changes their lr in place)
        self.optimizers, self.schedulers, self.clip, self.manual = list(optimizers), list(schedulers), clip, manual
        self.stepper, self.zeroed = stepper, zeroed
        self.param_groups = [group for optimizer in self.optimizers for group in optimizer.param_groups]
        self.defaults: dict[str, Any] = {}
        self.steps = 0
        # stepped outside the emulator where its optimizers' steps are element-wise: clipping runs norms and
        # products by a scalar, schedulers Python's arithmetic on learning rates, and manual optimization none
        self.elementwise_step = manual or (stepper is None and all(elementwise_step(o) for o in self.optimizers))

    @property
    def state(self) -> dict[Any, Any]:  # type: ignore[override]
        merged: dict[Any, Any] = {}
        for optimizer in self.optimizers:
            merged.update(optimizer.state)
        return merged

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not self.manual and not self.zeroed:
            for optimizer in self.optimizers:
                optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Optional[Callable[[], Any]] = None) -> None:  # type: ignore[override]
        if self.manual:
            return
        if self.clip is not None:
            params = [p for g in self.param_groups for p in g["params"]]
            if callable(self.clip):
                self.clip(params)
            else:
                clip_gradients(params, *self.clip)
        for optimizer in self.optimizers:
            if self.stepper is not None:  # the framework's own hook steps it (and clips)
                self.stepper(optimizer)
            else:
                optimizer.step()
        self.steps += 1
        self.scheduled()

    def scheduled(self) -> None:
        """Each scheduler due after ``steps`` optimizer steps, stepped."""
        for scheduler, every in self.schedulers:
            if every and self.steps % every == 0:
                scheduler.step()  # inside run_check's quiet(): a copied scheduler's warnings are silenced there

    def __repr__(self) -> str:
        return f"Steps({', '.join(type(o).__name__ for o in self.optimizers)})"


def clip_gradients(params: Iterable[torch.Tensor], value: float, algorithm: str = "norm") -> None:
    """The frameworks' gradient clipping: by the norm of all gradients together, or each element by value."""
    grads = [p for p in params if p.grad is not None]
    if algorithm == "value":
        torch.nn.utils.clip_grad_value_(grads, value)
    else:
        torch.nn.utils.clip_grad_norm_(grads, value)


def rebound(optimizers: Sequence[torch.optim.Optimizer], schedulers: Sequence[Any],
            original: Sequence[torch.nn.Parameter], params: Sequence[torch.nn.Parameter]) -> tuple[list, list]:
    """Copies of ``optimizers`` and ``schedulers`` over ``params`` (a row's copies of ``original``, in order): the
    same classes, hyperparameters, state and schedule, the schedulers stepping the copied optimizers."""
    if len(original) != len(params):
        raise Tf32LabError(f"the run's module has {len(original)} trainable parameters, its copy {len(params)}")
    memo: dict[int, Any] = {id(o): p for o, p in zip(original, params)}
    made = [copy.deepcopy(optimizer, memo) for optimizer in optimizers]
    kept = {id(p) for p in params}
    for optimizer in made:  # a frozen parameter in a group is no row's: the check steps the trainable ones
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in kept]
        _state_as_params(optimizer)
    return made, [copy.deepcopy(scheduler, memo) for scheduler in schedulers]


def outside_the_model(optimizers: Sequence[torch.optim.Optimizer], model: torch.nn.Module,
                      owner: Any = None) -> Optional[str]:
    """Why the check cannot train this run, where its optimizers step trainable parameters that are not the
    model's (sentence-transformers' ``SoftmaxLoss`` keeps a classifier of its own, which its Trainer's optimizer
    steps beside the model): the rows train copies of the model alone, through a loss that reaches the run's own
    parameters (float32's in the float64 row, where it failed: "expected dtype Float but got double"), and would
    leave those out of every row. ``owner``: the object whose module attributes are searched for their holder
    (the Trainer: its ``loss``); None where none stepped.

    >>> model, head = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    >>> print(outside_the_model([torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.1)], model))
    ... # doctest: +ELLIPSIS
    the optimizer steps 2 trainable parameters outside the model: the check trains copies of the model alone...
    """
    own = {id(p) for p in model.parameters()}
    foreign = {id(p): p for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]
               if isinstance(p, torch.Tensor) and p.requires_grad and id(p) not in own}
    if not foreign:
        return None
    where = ""
    for name, value in (vars(owner).items() if owner is not None else ()):
        if isinstance(value, torch.nn.Module) and value is not model and \
                any(id(p) in foreign for p in value.parameters()):
            where = f" ({type(value).__name__}'s, the trainer's {name})"
            break
    return (f"the optimizer steps {len(foreign)} trainable parameters outside the model{where}: the check trains "
            f"copies of the model alone, which cannot train those beside it (the loss would reach the run's own)")


def _state_as_params(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's state (a resumed run's moments, loaded from its checkpoint) in its parameters' dtype and on
    their device, as ``Optimizer.load_state_dict`` casts it (all but ``step``): a float64 row's copy steps float64
    moments, not the run's float32 ones."""
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if key != "step" and isinstance(value, torch.Tensor) and param.is_floating_point() and \
                    value.is_floating_point() and (value.dtype, value.device) != (param.dtype, param.device):
                state[key] = value.to(dtype=param.dtype, device=param.device)


def trainable(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The framework's warnings about a step outside its loop silenced (a row's copy has no trainer)."""
    with warnings.catch_warnings():
        for message in _OUTSIDE_THE_LOOP:
            warnings.filterwarnings("ignore", message=message)
        yield


def refused(model: torch.nn.Module, name: str, optimizers: Sequence[torch.optim.Optimizer],
            policy: Optional[Policy], owner: Any = None) -> Optional[str]:
    """Why the check cannot train this run, known before a batch is read (the run's loader read again for
    nothing, before a refusal that no batch decides): an optimizer stepping parameters outside the model
    (:func:`outside_the_model`), a policy applied to the model, or the callback's policy naming modules the model
    lacks; else None."""
    for why in (outside_the_model(optimizers, model, owner), applied_refusal(model, name, _FrameworksStep.asked),
                policy.unmatched_message(model) if policy is not None else None):
        if why is not None:
            return why
    return None


def run_check(model: torch.nn.Module, name: str, batches: list[Any], loss: Callable[..., Any],
              optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], *, levels: Iterable[str],
              target: Any, tolerance: Optional[float], around: Optional[Callable[[torch.nn.Module], Any]] = None,
              notes: Sequence[str] = (), conv: Optional[str] = None, policy: Optional[Policy] = None
              ) -> TrainingReport:
    """The training check of a framework's step: ``model`` a :func:`stepping_copy`, ``batches`` its
    ``(step, micro_batches)``, ``loss(model, micro_batches, step)`` the framework's loss of one step;
    ``conv`` cuDNN's float32 math in every row and ``policy`` one more row (``check_training``'s). The caller
    keeps the random streams (``random_state_kept``) around this and the batches' reading."""
    import dataclasses

    calls = {}

    def inputs(batch: Any) -> tuple[Any, Any]:
        step, micro = batch
        if step not in calls:
            calls[step] = StepCall(step, loss, around)
        return calls[step], micro

    workload = _FrameworksStep(model, batches, loss=lambda out, batch: out, optimizer=optimizer, inputs=inputs,
                               name=name)
    with quiet():
        report = check_training(workload, levels=levels, target=target, tolerance=tolerance, conv=conv,
                                policy=policy)
    return dataclasses.replace(report, notes=(*report.notes, *notes)) if notes else report


class _FrameworksStep(TrainingWorkload):
    """The framework's own step as a workload: it is given each row's copy itself (``StepCall``), and what it
    reaches besides (the run's trainer, and through it the run's model) is no sign of a loss computed on the run's
    model, the advice ``reaching_model`` gives one who wrote a workload's functions."""

    asked = "callback"  # its report advises in a callback's words (TrainingReport.asked)

    def reaching_model(self) -> Optional[str]:
        return None


class Checked:
    """Which run a callback checked: its trainer and model, by weak reference (never kept alive by the callback,
    and left out where the callback is pickled, as a spawned DDP process gets it). The same trainer and model
    again (a second ``fit`` or ``train`` of them) is that run's continuation, not checked again; a callback kept
    for another run (a new Trainer, a cross-validation's next fold) checks that one anew, rather than keep the
    first run's report as if it were the new one's."""

    def __init__(self) -> None:
        self._refs: Optional[tuple[Callable[[], Any], Callable[[], Any]]] = None

    def same(self, trainer: Any, model: Any) -> bool:
        return self._refs is not None and self._refs[0]() is trainer and self._refs[1]() is model

    def now(self, trainer: Any, model: Any) -> None:
        self._refs = (_ref(trainer), _ref(model))

    def __getstate__(self) -> dict[str, Any]:
        return {"_refs": None}


def _ref(value: Any) -> Callable[[], Any]:
    return weakref.ref(value) if value is not None else type(None)


def headline(report: TrainingReport) -> dict[str, float]:
    """The numbers a framework's loggers get: the verdict (1 passed, 0 failed), and per level its loss drift from
    float64, that drift over float32's own, and its divergence step (0: none)."""
    out = {"tf32lab/passed": float(report.passed), "tf32lab/float32_drift": report.floor.drift}
    for row in report.levels:
        if row.level == "highest":
            continue
        out[f"tf32lab/{row.level}/passed"] = float(row.passed)
        out[f"tf32lab/{row.level}/drift"] = row.drift
        out[f"tf32lab/{row.level}/multiple"] = row.multiple
        out[f"tf32lab/{row.level}/divergence_step"] = float(row.divergence_step or 0)
    return out


def said(report: TrainingReport, on_fail: str, advice: Sequence[str] = ()) -> None:
    """The verdicts logged (a failure as a warning); ``on_fail="raise"``: a failure raises ``Tf32LabError``."""
    lines = [*report.verdicts(), *report.conclusion(), *advice]
    LOG.log(logging.INFO if report.passed else logging.WARNING, "tf32lab training check:\n%s", "\n".join(lines))
    if report.passed:
        return
    # the row of the verdict: a policy's where one ran (the report's verdict is its), else the first failed level
    failed = report.policy_row if report.policy_row is not None else next(lv for lv in report.levels
                                                                          if not lv.passed)
    message = f"tf32lab training check {_verdict_line(report, failed)}"
    if on_fail == "raise":
        raise Tf32LabError(message)
    warnings.warn(message, stacklevel=3)


def unreached(model: torch.nn.Module, where: str) -> bool:
    """Whether the run trains no float32 weight (``bf16-true``, a model loaded in bfloat16): its matmuls are not
    float32 ones, which the float32 matmul precision alone decides, and there is nothing to check. Said in one
    line (a warning), and the run goes on, whatever ``on_fail`` (it asks what a failed check does)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(dtypes) != 1 or torch.float32 in dtypes:
        return False
    dtype = str(dtypes.pop()).replace("torch.", "")
    message = (f"tf32lab training check{where}: nothing to check, the run trains its weights in {dtype}, not "
               f"float32, and the float32 matmul precision reaches only float32 matmuls")
    LOG.warning("%s", message)
    warnings.warn(message, stacklevel=3)
    return True


def not_run(where: str, error: str, on_fail: str) -> None:
    """A check that could not run: ``on_fail="raise"`` raises; ``"warn"`` logs and warns, and the run trains on
    without a verdict (the callback is advice: its own failure does not end the user's run)."""
    message = f"tf32lab training check{where} could not run: {error}"
    if on_fail == "raise":
        raise Tf32LabError(message)
    LOG.warning("%s; the run goes on without a verdict", message)
    warnings.warn(f"{message}; the run goes on without a verdict", stacklevel=3)


def _verdict_line(report: TrainingReport, failed: Any) -> str:
    return next(line for line in report.verdicts() if f"level {failed.level!r}" in line)


def default_levels(levels: Optional[Iterable[str]]) -> tuple[str, ...]:
    """The levels asked for: all of them (None), one named alone, or a collection of names; anything else refused
    in one line (``check_levels``).

    >>> default_levels("high")   # one level named alone, not its letters
    ('high',)
    >>> default_levels(5)
    Traceback (most recent call last):
    ...
    tf32lab.errors.Tf32LabError: levels must be a level's name or a collection of them (e.g. ("highest", "high")), not 5
    """
    return tuple(LEVELS) if levels is None else check_levels(levels)


def check_target(target: Any) -> Any:
    """``target`` as given, refused at once (one line) where it names no target: not when training starts, after
    the run has loaded its model and data. ``"native"`` is resolved when the check runs, on the run's machine."""
    if isinstance(target, str) and target != NATIVE:
        resolve_target(target)
    elif not isinstance(target, (str, Target)):
        raise Tf32LabError(f"target must be a target's name or a Target, not {target!r}")
    return target


def check_tolerance(tolerance: Optional[float]) -> Optional[float]:
    """``tolerance`` as given (None: the training check's default), refused at once where it is no number >= 0."""
    return None if tolerance is None else training_tolerance(tolerance)
