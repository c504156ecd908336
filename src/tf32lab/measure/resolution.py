"""``torch.finfo`` while the float64 reference runs: float32's resolution where the model reads it off a dtype that
is float32 in the rows.

The reference runs every op in float64, so ``h.dtype`` reads float64 there, and ``torch.finfo(h.dtype).eps`` gave
float64's eps where the rows add or clamp at float32's (torch.distributions' ``clamp_probs``, ``log(p + eps)``):
an error no level makes. While a :class:`~tf32lab.measure.reference.Float64Run` is active on some thread,
``torch.finfo`` is :class:`_finfo`: on that run's thread, right after such a dtype read with no arithmetic since
(the run's ``read_wider``), it answers :class:`_Float32Resolution`; everywhere else, PyTorch's own.

Example:

    >>> import torch
    >>> from tf32lab.measure import resolution
    >>> torch.finfo is resolution.FINFO  # no reference running: PyTorch's own
    True
    >>> resolution._Float32Resolution().eps == torch.finfo(torch.float32).eps
    True
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["FINFO", "enter", "exit", "running"]

_FLOAT64 = (torch.float64, torch.complex128)


# torch.finfo as PyTorch has it; while a Float64Run is active on some thread, torch.finfo is _finfo, which answers
# every other thread, and a paused run, as this does
FINFO = torch.finfo
_RESOLUTION = ("eps", "tiny", "smallest_normal", "resolution")
_active = threading.local()  # .runs: the Float64Runs entered on this thread, innermost last
_installed = [0]  # runs active on any thread: torch.finfo is _finfo while there is one
_installing = threading.Lock()


class _Float32Resolution:
    """``torch.finfo(torch.float64)`` where the model read the dtype off a tensor that is float32 in the rows
    (``torch.finfo(h.dtype).eps``): float32's resolution (``eps``, ``tiny``, ``smallest_normal``, ``resolution``),
    the constant the rows add or clamp at, computed with in float64; float64's limits (``max``, ``min``: held as
    limits where both hold their own, ``numbers.metrics.dtype_limits``). torch.distributions' ``clamp_probs``
    reads it so: float64's eps gave log(2.2e-16) = -36 at every zero probability where the rows have -16, and
    every level failed, `highest` too."""

    def __init__(self) -> None:
        wide, narrow = FINFO(torch.float64), FINFO(torch.float32)
        self.bits, self.dtype, self.max, self.min = wide.bits, wide.dtype, wide.max, wide.min
        self.eps, self.tiny, self.smallest_normal, self.resolution = (getattr(narrow, a) for a in _RESOLUTION)

    def __repr__(self) -> str:
        return f"finfo(float32's resolution, eps={self.eps}, float64's max={self.max}, dtype={self.dtype})"


class _FinfoType(type):
    """The type of :class:`_finfo`: ``isinstance(x, torch.finfo)`` keeps PyTorch's answer while it is swapped in
    (on any thread: a function there raised TypeError), a :class:`_Float32Resolution` counted as one."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, (FINFO, _Float32Resolution))


class _finfo(metaclass=_FinfoType):
    """``torch.finfo`` while a Float64Run is active: PyTorch's own answer, but :class:`_Float32Resolution` for a
    float64 dtype read off a tensor that is float32 in the rows, on the run's own thread."""

    def __new__(cls, type: Any = None) -> Any:
        found = FINFO() if type is None else FINFO(type)
        runs = getattr(_active, "runs", None)
        run = runs[-1] if runs else None
        if run is not None and not run.paused and run.read_wider and type in _FLOAT64 and _on_stack(run.modes[0]):
            return _Float32Resolution()
        return found


def _dynamo_folds() -> None:
    """TorchDynamo caches the classes whose calls it folds (``torch.finfo`` among them) at its first use: where it
    is loaded, that use is made now, so that it holds PyTorch's ``finfo``, not ``_finfo``."""
    module = sys.modules.get("torch._dynamo.variables.user_defined")
    folds = getattr(getattr(module, "UserDefinedClassVariable", None), "_constant_fold_classes", None)
    if callable(folds):
        with contextlib.suppress(Exception):  # primed or not, never a reason for the reference not to run
            folds()


def _on_stack(mode: TorchFunctionMode) -> bool:
    """Whether ``mode`` is on this thread's function-mode stack (not lifted off it for a layer's float32 rerun)."""
    return any(torch._C._get_function_stack_at(i) is mode for i in range(torch._C._len_torch_function_stack()))


def running() -> bool:
    """Whether a Float64Run runs on this thread now: on the mode stack (not lifted off it for a float32 rerun) and
    not paused."""
    return any(not run.paused and _on_stack(run.modes[0]) for run in getattr(_active, "runs", []))


def enter(run: Any) -> None:
    """``run`` (a Float64Run) begins on this thread: ``torch.finfo`` is :class:`_finfo` while any run is active."""
    if not hasattr(_active, "runs"):
        _active.runs = []
    _active.runs.append(run)
    with _installing:
        _installed[0] += 1
        if torch.finfo is FINFO:
            _dynamo_folds()
            torch.finfo = _finfo


def exit(run: Any) -> None:
    """``run`` ends: PyTorch's ``torch.finfo`` back once no run is active on any thread."""
    with _installing:
        _installed[0] -= 1
        if not _installed[0]:
            torch.finfo = FINFO
    runs = getattr(_active, "runs", [])
    if run in runs:
        runs.remove(run)
