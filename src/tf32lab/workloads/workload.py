"""Workloads: a model, its example inputs and, optionally, a metric (what ``check`` measures).

The spec strings that load one (``tf32lab check SPEC``) are in ``tf32lab.workloads.specs``.

Example:

    >>> import torch, tf32lab
    >>> w = tf32lab.Workload(torch.nn.Linear(4, 2), torch.ones(3, 4), name="tiny")
    >>> w.run().shape, w.name
    (torch.Size([3, 2]), 'tiny')
"""

from __future__ import annotations

import contextlib
import inspect
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from tf32lab.errors import Tf32LabError
from tf32lab.numbers.naming import module_kind

__all__ = ["Workload", "eval_mode", "not_a_workload", "training_note"]

Inputs = Union[torch.Tensor, tuple, Mapping]
Metric = Callable[[Any, Any], float]


@dataclass
class Workload:
    """What ``check`` measures: ``model(*inputs)`` for a tuple, ``model(**inputs)`` for a dict, else ``model(inputs)``.

    ``metric(output, reference_output) -> float`` is the workload's own measure of how far an output is from the
    reference (reported beside the built-in ones). ``name`` defaults to the model's class name. ``notes``: what a
    reader of its report must know about the workload (how its inputs were made), one line each.

    >>> import torch, tf32lab
    >>> w = tf32lab.Workload(torch.nn.Linear(4, 2), {"input": torch.ones(3, 4)}, name="tiny")  # model(input=...)
    >>> w.run().shape, w.name
    (torch.Size([3, 2]), 'tiny')
    """

    model: torch.nn.Module
    inputs: Inputs
    metric: Optional[Metric] = None
    name: Optional[str] = None
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.model, torch.nn.Module):
            raise Tf32LabError(f"a workload's model must be a torch.nn.Module, not {type(self.model).__name__}")
        if not isinstance(self.inputs, (torch.Tensor, tuple, Mapping)):
            raise Tf32LabError(
                f"a workload's inputs must be a tensor, a tuple (positional) or a dict (keyword), "
                f"not {type(self.inputs).__name__}")
        if self.metric is not None and not callable(self.metric):
            raise Tf32LabError(f"a workload's metric must be callable, not {type(self.metric).__name__}")
        if isinstance(self.notes, str) or not all(isinstance(note, str) for note in self.notes):
            raise Tf32LabError(f"a workload's notes must be a tuple of strings, not {self.notes!r}")
        self.notes = tuple(self.notes)
        if self.name is None:
            self.name = module_kind(self.model)
        check_float32(self.model, self.name)

    def run(self, model: Optional[torch.nn.Module] = None, inputs: Optional[Inputs] = None) -> Any:
        """Call ``model`` (default: the workload's) on ``inputs`` (default: the workload's)."""
        model = self.model if model is None else model
        inputs = self.inputs if inputs is None else inputs
        args, kwargs = ((), inputs) if isinstance(inputs, Mapping) else \
            (inputs, {}) if isinstance(inputs, tuple) else ((inputs,), {})
        try:
            return model(*args, **kwargs)
        except TypeError as exc:
            # a dict's keys or a tuple's length forward() does not take fails to bind in this frame, before any of
            # the model's: said as the inputs' error, not put down to tf32lab (numbers/origin.py)
            signature = _unbound(model, args, kwargs)
            if signature is None:
                raise
            raise Tf32LabError(f"workload {self.name!r}: its inputs do not fit the model's forward{signature}: "
                               f"{exc} (a tuple is passed as positional arguments, a dict as keyword arguments, a "
                               f"tensor as the only argument)") from exc


def _unbound(model: torch.nn.Module, args: tuple, kwargs: Mapping) -> Optional[str]:
    """``"(input)"``: the signature of ``model.forward`` where ``args`` and ``kwargs`` do not bind to it; None where
    they do, or it has none to read (a TorchScript module)."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        bare = [p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()]
        return str(signature.replace(parameters=bare, return_annotation=inspect.Signature.empty))
    return None


def not_a_workload(verb: str, given: Any, accepted: str = "a tf32lab.Workload") -> Tf32LabError:
    """The error of ``verb()`` given something other than a workload; a model, or the ``(model, inputs)`` pair a
    CLI factory may return, is told how to wrap it.

    >>> str(not_a_workload("check", torch.nn.Linear(2, 2)))
    'check() takes a tf32lab.Workload, not Linear: wrap the model and its inputs as tf32lab.Workload(model, inputs)'
    >>> str(not_a_workload("check", "mymodel.py:make"))
    "check() takes a tf32lab.Workload, not str: load the spec first, tf32lab.workloads.specs.load('mymodel.py:make')"
    """
    pair = isinstance(given, tuple) and len(given) == 2 and isinstance(given[0], torch.nn.Module)
    if isinstance(given, torch.nn.Module) or pair:
        hint = ": wrap the model and its inputs as tf32lab.Workload(model, inputs)"
    elif isinstance(given, str):  # a CLI spec, given to Python as it is given to the command
        hint = f": load the spec first, tf32lab.workloads.specs.load({given!r})"
    else:
        hint = ""
    return Tf32LabError(f"{verb}() takes {accepted}, not {type(given).__name__}{hint}")


def check_float32(model: torch.nn.Module, name: str) -> None:
    held = (*model.named_parameters(), *model.named_buffers())
    # MKLDNN's opaque tensors (torch.utils.mkldnn.to_mkldnn): no GPU runs them, and no float64 copy can be made
    opaque = [key for key, t in held if t.layout == torch._mkldnn]
    if opaque:
        names = ", ".join(f"{key!r}" for key in opaque[:3]) + (f" and {len(opaque) - 3} more" if len(opaque) > 3
                                                               else "")
        raise Tf32LabError(
            f"workload {name!r}: the model holds MKLDNN tensors ({names}), as torch.utils.mkldnn.to_mkldnn makes "
            f"them; tf32lab checks the float32 model a GPU would run: give it the model before to_mkldnn")
    # named: one float64 buffer among float32 weights (nflows' StandardNormal keeps its log-normalizer so) is
    # otherwise hard to find
    found = [(key, t.dtype) for key, t in held
             if t.is_floating_point() and t.dtype != torch.float32]
    if found:
        other = sorted({str(d).replace("torch.", "") for _, d in found})
        names = ", ".join(f"{key!r}" for key, _ in found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3
                                                                  else "")
        raise Tf32LabError(
            f"workload {name!r}: the model holds {', '.join(other)} tensors ({names}); tf32lab checks float32 "
            f"models (call model.float() first)")


def training_note(model: torch.nn.Module, command: str = "check") -> Optional[str]:
    """What a report must say where ``model`` comes in training mode with modules that compute otherwise in eval
    mode (dropout, batch norm, an instance norm that tracks running statistics, an RNN with dropout between its
    layers, attention with dropout), which :func:`eval_mode` turns off; where none of PyTorch's own does, the
    user's modules whose forward reads ``self.training``; None where nothing does. ``command``: the one that ran
    the model (``"check"`` or ``"tune"``), whose ``--train`` measures a training step.

    >>> training_note(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))).split(":")[0]
    "1 module(s) in training mode compute otherwise in eval mode ('1' Dropout)"
    >>> training_note(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1)).eval()) is None
    True
    """
    training = [(name, m) for name, m in model.named_modules() if getattr(m, "training", False)]
    found = [(name, module_kind(m)) for name, m in training if _modal(m)] or \
        [(name, module_kind(m)) for name, m in training if _reads_training(m)]
    if not found:
        return None
    named = ", ".join(f"{repr(name) if name else 'the model'} {kind}" for name, kind in found[:3]) + \
        (" …" if len(found) > 3 else "")
    step = "a training step's error is `check --train`'s (tf32lab.check_training)" if command == "check" else \
        "a policy for a training step is `tune --train`'s (tf32lab.tune of a tf32lab.TrainingWorkload)"
    return (f"{len(found)} module(s) in training mode compute otherwise in eval mode ({named}): {command} runs the "
            f"model in eval mode, as inference does (no dropout, batch norm on its running statistics, and any "
            f"`if self.training` branch on its eval side); {step}")


def _reads_training(module: torch.nn.Module) -> bool:
    """Whether a module of the user's (a class from outside ``torch``) or a TorchScript one reads its training
    flag in its forward (``F.dropout(x, self.p, self.training)``, ``if self.training:``), the forward a decorator
    wraps read, and not where every dropout rate it holds is 0; a guess, taken only where no module of PyTorch's
    own says so (a Hugging Face layer reads it for gradient checkpointing too)."""
    if isinstance(module, torch.jit.ScriptModule):
        if _modal_rule(module) is not None:  # PyTorch's own, scripted: _modal's rule decided, as for the eager one
            return False
        try:
            return "training" in module.code  # TorchScript's own text of forward
        except (AttributeError, RuntimeError):  # a frozen or method-less script module
            return False
    if type(module).__module__.startswith("torch."):
        return False
    forward = getattr(type(module), "forward", None)
    # the forward a decorator wraps (functools.wraps): Hugging Face's gradient-checkpointing wrapper reads
    # self.training for itself, and a deprecation wrapper hides the attention's dropout behind it
    with contextlib.suppress(ValueError):  # a cycle of __wrapped__: the wrapper as it is
        forward = inspect.unwrap(forward) if forward is not None else None
    code = getattr(forward, "__code__", None)
    if code is None or not _names_training(code):
        return False
    # the dropout rates it holds, all 0: alike in both modes (a Hugging Face attention passes attention_dropout,
    # or its nn.Dropout's p, to the attention kernel only in training)
    rates = [v for k, v in vars(module).items() if "drop" in k.lower() and isinstance(v, (int, float))
             and not isinstance(v, bool)]
    rates += [m.p for m in module.children() if isinstance(m, torch.nn.modules.dropout._DropoutNd)]
    return not rates or any(r != 0 for r in rates)


def _names_training(code: types.CodeType) -> bool:
    return "training" in code.co_names or any(_names_training(c) for c in code.co_consts
                                              if isinstance(c, types.CodeType))  # its closures' too


def _pytorch_class(module: torch.nn.Module) -> Optional[type]:
    """The class of PyTorch's own that ``module`` is: its type, or a TorchScript module's original class where
    ``torch.nn`` has one by that name and the scripted class came from ``torch.nn``; None for a class of the
    user's (a user's ``Linear`` or ``MultiheadAttention``, scripted, is called by its name alone)."""
    if not isinstance(module, torch.jit.ScriptModule):
        return type(module)
    try:  # where the scripted class was defined: "__torch__.torch.nn.modules.linear.___torch_mangle_0.Linear"
        defined = module._c._type().qualified_name()
    except (AttributeError, RuntimeError):
        return None
    if not defined.startswith("__torch__.torch.nn."):
        return None
    cls = getattr(torch.nn, getattr(module, "original_name", "") or "", None)
    return cls if isinstance(cls, type) and issubclass(cls, torch.nn.Module) else None


def _modal(module: torch.nn.Module) -> bool:
    """Whether PyTorch makes ``module``'s forward depend on its training flag (a scripted module of PyTorch's own
    by its class and attributes, which TorchScript keeps)."""
    return bool(_modal_rule(module))


def _modal_rule(module: torch.nn.Module) -> Optional[bool]:
    """:func:`_modal`'s answer; None where PyTorch's classes cannot tell (a class of the user's)."""
    cls = _pytorch_class(module)
    if cls is None:
        return None
    try:
        if issubclass(cls, (torch.nn.modules.batchnorm._BatchNorm, torch.nn.modules.instancenorm._InstanceNorm)):
            return bool(module.track_running_stats)  # batch statistics in training, running ones in eval
        if issubclass(cls, torch.nn.modules.dropout._DropoutNd):
            return module.p > 0
        if issubclass(cls, torch.nn.RNNBase):
            return module.dropout > 0 and module.num_layers > 1
        if issubclass(cls, torch.nn.MultiheadAttention):
            return module.dropout > 0
        if issubclass(cls, torch.nn.RReLU):  # a slope drawn from [lower, upper] in training, their mean in eval
            return module.lower != module.upper  # (https://pytorch.org/docs/stable/generated/torch.nn.RReLU.html)
    except AttributeError:  # a scripted class of the user's named as one of PyTorch's: its code is read instead
        return None
    return False


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode while measuring (dropout would make runs differ), each module's own mode restored after."""
    # a frozen TorchScript module (torch.jit.freeze, optimize_for_inference) has no ``training``: frozen in eval mode
    modes = [(module, module.training) for module in model.modules() if hasattr(module, "training")]
    if hasattr(model, "training"):
        model.eval()
    else:
        for module, _ in modes:
            module.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training
