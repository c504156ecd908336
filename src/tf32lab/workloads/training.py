"""Training workloads: a model, its batches, a loss and an optimizer factory (what ``check_training`` runs).

A training workload says how one step goes: the batch of step ``k`` (from a sequence, or a ``step -> batch``
function), the model called on it (``inputs(batch)``, by default the batch itself: ``model(*batch)`` for a tuple,
``model(**batch)`` for a dict, else ``model(batch)``), the loss of the output (``loss(output, batch)``; a Hugging
Face output's own ``.loss`` when no loss is given), ``backward()`` and the optimizer's step (``optimizer(params)``
makes one; AdamW by default).

Every row of a training check trains its own copy of the model (a float64 one for the reference). A loss that
needs the model's own parts (gpytorch's marginal likelihood of its likelihood and GP) takes the copy as a third
argument, ``loss(output, batch, model)``; ``inputs(batch, model)`` likewise. A loss that closes over the
original model instead would mix the user's float32 model into every row: where the float64 reference then
fails, its error says so and what to write (:meth:`TrainingWorkload.reaching_model`).

Everything that can be checked without running the model is checked when the workload is made: a bad workload is
a one-line ``Tf32LabError`` before any run.

Example:

    >>> import torch, tf32lab
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <...>
    >>> data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)]
    >>> w = tf32lab.TrainingWorkload(torch.nn.Linear(4, 1), data, loss=lambda out, b: (out - b[1]).pow(2).mean(),
    ...                              inputs=lambda b: b[0], name="regression")
    >>> w.steps, w.name
    (3, 'regression')

    # a loss that needs the model takes the row's copy as its third argument
    >>> decayed = tf32lab.TrainingWorkload(
    ...     torch.nn.Linear(4, 1), data, inputs=lambda b: b[0],
    ...     loss=lambda out, b, model: (out - b[1]).pow(2).mean() + 1e-4 * model.weight.pow(2).sum())
    >>> decayed.reaching_model() is None   # it uses only the copy it is given
    True
"""

from __future__ import annotations

import functools
import inspect
import numbers
import traceback
import types
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from tf32lab.errors import Tf32LabError
from tf32lab.numbers.naming import module_kind
from tf32lab.workloads.workload import Inputs, Workload, check_float32

__all__ = ["TrainingWorkload", "default_optimizer"]

Batches = Union[Sequence[Any], Callable[[int], Any]]
Loss = Callable[..., torch.Tensor]  # (output, batch) or (output, batch, model)
OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


def default_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW with PyTorch's defaults (lr 1e-3, weight decay 1e-2)."""
    return torch.optim.AdamW(params)


@dataclass
class TrainingWorkload:
    """What ``check_training`` runs: ``steps`` optimizer steps of ``model`` on ``batches``.

    Args:
        model: a float32 ``torch.nn.Module``; never trained itself (every run works on a copy).
        batches: a sequence of batches (step ``k`` takes ``batches[k]``) or a function ``step -> batch``.
        loss: ``loss(output, batch) -> scalar tensor``, or ``loss(output, batch, model)`` to be given the model
            that made ``output`` (the row's copy: never the ``model`` given here, which no row trains); without
            one, the output's ``.loss`` (Hugging Face models given labels).
        optimizer: ``optimizer(params) -> torch.optim.Optimizer``; by default AdamW (:func:`default_optimizer`).
        steps: how many steps; by default ``len(batches)`` (a function needs it).
        name: by default the model's class name.
        inputs: ``inputs(batch)`` -> what the model is called on, or ``inputs(batch, model)`` to be given the
            row's copy of the model; by default the batch itself.

    A function takes the model when it has one more positional parameter than the short form and that one has no
    default, or when it is named ``model``.

    >>> import torch, tf32lab
    >>> data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)]  # (inputs, targets) per step
    >>> w = tf32lab.TrainingWorkload(torch.nn.Linear(4, 1), data, loss=lambda out, b: (out - b[1]).pow(2).mean(),
    ...                              inputs=lambda b: b[0])
    >>> w.steps, w.name
    (3, 'Linear')
    """

    # whose words a report on it advises in (TrainingReport.asked): a framework's callback's subclass says "callback"
    asked = "check"

    model: torch.nn.Module
    batches: Batches
    loss: Optional[Loss] = None
    optimizer: Optional[OptimizerFactory] = None
    steps: Optional[int] = None
    name: Optional[str] = None
    inputs: Optional[Callable[[Any], Inputs]] = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, torch.nn.Module):
            raise Tf32LabError(f"a training workload's model must be a torch.nn.Module, not "
                               f"{type(self.model).__name__}")
        is_sequence = isinstance(self.batches, Sequence) and not isinstance(self.batches, (str, bytes))
        if not is_sequence and not callable(self.batches):
            raise Tf32LabError(f"a training workload's batches must be a sequence of batches or a function step -> "
                               f"batch, not {type(self.batches).__name__}")
        for what in ("loss", "optimizer", "inputs"):
            value = getattr(self, what)
            if value is not None and not callable(value):
                raise Tf32LabError(f"a training workload's {what} must be callable, not {type(value).__name__}")
        if is_sequence and not len(self.batches):
            raise Tf32LabError("a training workload's batches are empty: give at least one batch")
        if self.steps is None:
            if not is_sequence:
                raise Tf32LabError("a training workload whose batches come from a function needs steps= (how many "
                                   "steps to run)")
            self.steps = len(self.batches)
        self.steps = check_steps(self.steps)
        if is_sequence and self.steps > len(self.batches):
            raise Tf32LabError(f"a training workload of {len(self.batches)} batches cannot run {self.steps} steps; "
                               f"give more batches or a function step -> batch")
        if self.name is None:
            self.name = module_kind(self.model)
        check_float32(self.model, self.name)
        if not any(p.requires_grad for p in self.model.parameters()):
            raise Tf32LabError(f"training workload {self.name!r}: the model has no parameter that requires grad: "
                               f"nothing to train")

    @property
    def available(self) -> Optional[int]:
        """How many batches there are (None: a function, any step)."""
        return None if callable(self.batches) and not isinstance(self.batches, Sequence) else len(self.batches)

    def batch(self, step: int) -> Any:
        """The batch of ``step`` (0-based)."""
        if self.available is None:
            return self.batches(step)
        return self.batches[step]

    def run(self, model: torch.nn.Module, batch: Any) -> Any:
        """``model`` called on ``batch`` (through ``inputs`` when given); a one-line error when the model's
        forward does not take what the batch gives it (a batch ``(x, y)`` with no ``inputs=``)."""
        inputs = self._inputs(batch, model)
        try:
            if isinstance(inputs, Mapping):
                return model(**inputs)
            if isinstance(inputs, tuple):
                return model(*inputs)
            return model(inputs)
        except TypeError as exc:
            if not _call_refused(exc):
                raise
            given = f"{len(inputs)} positional argument(s)" if isinstance(inputs, tuple) else \
                f"keyword argument(s) {', '.join(map(repr, inputs))}" if isinstance(inputs, Mapping) else "one argument"
            hint = "" if self.inputs is not None else \
                " (the whole batch, as no inputs= was given: inputs=lambda batch: batch[0], say)"
            raise Tf32LabError(f"training workload {self.name!r}: the model cannot be called with the batch's "
                               f"{given}{hint}: {exc}") from None

    def _inputs(self, batch: Any, model: torch.nn.Module) -> Any:
        if self.inputs is None:
            return batch
        return self.inputs(batch, model) if takes_model(self.inputs, 1) else self.inputs(batch)

    def loss_of(self, output: Any, batch: Any, model: Optional[torch.nn.Module] = None) -> torch.Tensor:
        """The step's loss: ``loss(output, batch)`` (``loss(output, batch, model)``: ``model`` is the one that made
        ``output``, by default the workload's), or the output's ``.loss``; a one-line error for anything but a real
        scalar tensor."""
        if self.loss is not None:
            value = self.loss(output, batch, self.model if model is None else model) \
                if takes_model(self.loss, 2) else self.loss(output, batch)
        else:
            value = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
            if value is None:
                raise Tf32LabError(f"training workload {self.name!r}: no loss= given and the model's output "
                                   f"({type(output).__name__}) has no .loss; give loss=lambda output, batch: ...")
        if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
            what = type(value).__name__ if not isinstance(value, torch.Tensor) else (
                f"a tensor of shape {tuple(value.shape)}" if value.is_floating_point()
                else f"a {self._users_dtype(value.dtype, model)} tensor")
            hint = " (its .real or .abs(), say)" if isinstance(value, torch.Tensor) and value.is_complex() else ""
            raise Tf32LabError(f"training workload {self.name!r}: the loss must be a real floating scalar tensor, "
                               f"not {what}{hint}")
        if not value.requires_grad:
            raise Tf32LabError(f"training workload {self.name!r}: the loss does not depend on any parameter "
                               f"(no grad): nothing to train")
        return value.reshape(())

    def _users_dtype(self, dtype: torch.dtype, model: Optional[torch.nn.Module]) -> torch.dtype:
        """``dtype`` as the user's own float32 model gives it: the float64 row widens every float32 and complex64
        tensor, and an error must name what the user wrote (complex64), not its widened twin."""
        if model is None or model is self.model or _floating_width(model) != 8 or _floating_width(self.model) != 4:
            return dtype
        return _NARROWED.get(dtype, dtype)

    def step_workload(self) -> Workload:
        """The model on its first batch's inputs, as a forward :class:`~tf32lab.Workload` (``predict(...,
        training=True)`` counts one step of it; its loss is then the sum of the outputs, or their ``.loss``)."""
        batch = self.batch(0)
        inputs = self._inputs(batch, self.model)
        if not isinstance(inputs, (torch.Tensor, tuple, Mapping)):
            inputs = (inputs,)
        return Workload(self.model, inputs, name=self.name)

    def make_optimizer(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """A fresh optimizer over ``params`` (the workload's factory, or AdamW)."""
        factory = self.optimizer or default_optimizer
        made = factory(params)
        if not isinstance(made, torch.optim.Optimizer):
            raise Tf32LabError(f"training workload {self.name!r}: optimizer(params) returned a "
                               f"{type(made).__name__}, not a torch.optim.Optimizer")
        return made


    def reaching_model(self) -> Optional[str]:
        """Where the loss or ``inputs`` reach this workload's own model rather than the copy a row gives them: its
        closure, the globals it names, a bound method's object or a partial's arguments, followed a few levels
        (an object holding the model, a module sharing its parameters: gpytorch's ``ExactMarginalLogLikelihood``
        of it). One line saying what to write instead; None where neither does.

        Example:

            >>> import torch
            >>> model = torch.nn.Linear(2, 1)
            >>> w = TrainingWorkload(model, [(torch.ones(1, 2), torch.ones(1, 1))], inputs=lambda b: b[0],
            ...                      loss=lambda out, b: (out - b[1]).pow(2).mean() + model.weight.abs().sum())
            >>> print(w.reaching_model())  # doctest: +ELLIPSIS
            the loss uses the workload's own model through 'model' (a Linear), not the copy each row trains ...
        """
        params = {id(p) for p in self.model.parameters()}
        for what, fn, usage in (("loss", self.loss, "loss=lambda output, batch, model: ..."),
                                ("inputs", self.inputs, "inputs=lambda batch, model: ...")):
            if fn is None:
                continue
            for name, value in _referents(fn):
                if _holds(value, self.model, params, depth=3, seen=set()):
                    kind = type(value).__name__
                    gpytorch = type(value).__module__.startswith("gpytorch.mlls")
                    said = "inputs function" if what == "inputs" else what
                    return (f"the {said} uses the workload's own model through {name!r} "
                            f"({'an' if kind[:1] in 'AEIOU' else 'a'} {kind}), not the copy each row trains (a "
                            f"float64 one for the reference): take the row's copy as an argument, {usage}"
                            + (f" with {kind}(model.likelihood, model) inside" if gpytorch else "")
                            + (", or compute the loss in the model's forward" if what == "loss" else ""))
        return None


def takes_model(fn: Optional[Callable[..., Any]], given: int) -> bool:
    """Whether ``fn``, called with ``given`` positional arguments in its short form, takes the model as one more:
    a positional parameter after those with no default, or one named ``model``. ``*args`` alone is no sign (the
    short form is kept)."""
    if fn is None:
        return False
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin with no signature: the short form
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) <= given:
        return False
    extra = positional[given]
    return extra.default is inspect.Parameter.empty or extra.name == "model"


def _referents(fn: Any) -> Iterator[tuple[str, Any]]:
    """(name, object) that ``fn`` refers to: its closure's variables, the globals its code names (the lambdas'
    too), a bound method's object, a partial's arguments; a callable object's attributes."""
    if isinstance(fn, functools.partial):
        yield from ((f"argument {i + 1} of the partial", a) for i, a in enumerate(fn.args))
        yield from fn.keywords.items()
        yield from _referents(fn.func)
        return
    if isinstance(fn, types.MethodType):
        yield "self", fn.__self__
        fn = fn.__func__
    code = getattr(fn, "__code__", None)
    if code is None:  # a callable object: what it holds
        if isinstance(fn, torch.nn.Module):  # by attribute name, not through the dicts nn.Module keeps them in
            yield from fn._modules.items()
            yield from fn._parameters.items()
            yield from fn._buffers.items()
        yield from ((name, value) for name, value in vars(fn).items()
                    if name not in ("_modules", "_parameters", "_buffers")) if hasattr(fn, "__dict__") else ()
        return
    for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
        try:
            yield name, cell.cell_contents
        except ValueError:  # a cell not filled yet
            continue
    scope = getattr(fn, "__globals__", {})
    for name in _names(code):
        if name in scope:
            yield name, scope[name]


def _names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def _holds(value: Any, model: torch.nn.Module, params: set[int], depth: int, seen: set[int]) -> bool:
    """Whether ``value`` is ``model``, one of its parameters, a module sharing them, or holds one of those within
    ``depth`` steps (attributes, items, a function's referents)."""
    if value is model:
        return True
    if id(value) in seen or isinstance(value, (type, types.ModuleType, str, bytes, int, float, bool)) \
            or value is None:
        return False
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        return id(value) in params
    if isinstance(value, torch.nn.Module):
        return any(id(p) in params for p in value.parameters())
    if depth == 0:
        return False
    if isinstance(value, Mapping):
        items: Iterable[Any] = list(value.values())[:64]
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)[:64]
    elif callable(value) and (hasattr(value, "__code__") or isinstance(value, (functools.partial, types.MethodType))):
        items = [v for _, v in _referents(value)]
    elif hasattr(value, "__dict__"):
        items = list(vars(value).values())[:64]
    else:
        return False
    return any(_holds(item, model, params, depth - 1, seen) for item in items)


_NARROWED = {torch.float64: torch.float32, torch.complex128: torch.complex64}


def _floating_width(model: torch.nn.Module) -> Optional[int]:
    """The bytes of an element of the model's first floating parameter (None: it has none). Not its ``.dtype``:
    inside the float64 run a float32 tensor's dtype reads float64."""
    return next((p.element_size() for p in model.parameters() if p.is_floating_point()), None)


def _call_refused(exc: TypeError) -> bool:
    """Whether ``exc`` is Python refusing the call of the module's ``forward`` itself (wrong arguments), not a
    TypeError from inside it: the traceback ends in torch's module-call machinery."""
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and frames[-1].name in ("_call_impl", "_wrapped_call_impl") and "argument" in str(exc)


def check_steps(steps: Any) -> int:
    """A step count: a whole number >= 1, a NumPy one too (a one-line error naming the value otherwise)."""
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise Tf32LabError(f"steps must be a whole number >= 1, not {steps!r}")
    return int(steps)
