"""Putting tf32lab's own modes on this thread's dispatch and function mode stacks, and taking exactly them off.

PyTorch's ``mode.__exit__`` pops whatever mode is on top. When contexts interleave on one thread (asyncio tasks,
generators, a scope entered inside an ``emulate()`` block and left after it), the top may belong to someone else,
and popping it would silently remove their mode and leave ours. :func:`remove` takes a mode out by identity: the
modes above it are lifted off and put back in their order.

Example:

    >>> from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
    >>> class Quiet(TorchDispatchMode):
    ...     def __torch_dispatch__(self, func, types, args=(), kwargs=None):
    ...         return func(*args, **(kwargs or {}))
    >>> ours, theirs = Quiet(), Quiet()
    >>> push(ours); push(theirs)
    >>> remove(ours)                                # not on top: theirs stays
    True
    >>> _get_current_dispatch_mode_stack() == [theirs]
    True
    >>> remove(theirs), _get_current_dispatch_mode_stack()
    (True, [])
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import Any, TypeVar, Union

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["depth", "discard", "insert", "lifted", "push", "remove", "skips_dynamo_lazily"]

_C: Any = torch._C
Mode = Union[TorchDispatchMode, TorchFunctionMode]


M = TypeVar("M", bound=type)


def skips_dynamo_lazily(cls: M) -> M:
    """For tf32lab's dispatch mode classes: TorchDynamo skips their handler, at no cost where it compiles nothing.

    PyTorch wraps each mode's ``__torch_dispatch__`` so that Dynamo does not compile the handler's frame: on every
    call the wrapper takes Dynamo's frame callback off and puts it back, and its first call imports
    ``torch._dynamo`` (71 MiB and about a second, for a program that never compiles anything). Where no callback is
    set (no compiled code is running), there is no frame to skip, and the handler runs as it is: a few µs less on
    every op an emulated model runs. Where one is set, PyTorch's wrapper runs, as before.
    """
    handler = cls.__dict__.get("__torch_dispatch__")
    raw = getattr(handler, "__wrapped__", None)
    if raw is None:  # a PyTorch that does not wrap handlers
        return cls
    if _set_eval_frame is None:  # a PyTorch without the C hook: only the import is saved
        def handle(*args: Any, **kwargs: Any) -> Any:
            dynamo = sys.modules.get("torch._dynamo")
            if dynamo is None or not hasattr(dynamo, "disable"):
                return raw(*args, **kwargs)
            skipped = dynamo.disable(raw, True, wrapping=False)  # what torch._disable_dynamo does on first call
            setattr(raw, "__dynamo_disable", skipped)
            return skipped(*args, **kwargs)

        setattr(raw, "__dynamo_disable", handle)
        return cls

    def __torch_dispatch__(*args: Any, **kwargs: Any) -> Any:
        prior = _set_eval_frame(None)
        if prior is None:  # no callback: Dynamo sees no frame here, nothing to skip
            return raw(*args, **kwargs)
        _set_eval_frame(prior)
        return handler(*args, **kwargs)  # PyTorch's own wrapper (Dynamo is loaded: a callback is set)

    functools.update_wrapper(__torch_dispatch__, raw)
    cls.__torch_dispatch__ = __torch_dispatch__  # type: ignore[attr-defined]
    return cls


# Dynamo's C frame hook: takes a callback (None: none) and returns the one it replaced.
_set_eval_frame: Any = getattr(getattr(getattr(_C, "_dynamo", None), "eval_frame", None), "set_eval_frame", None)


def _stack(mode: Mode) -> tuple[Any, Any, Any, Any]:
    # (length, item at, pop, push) of the stack the mode lives on
    if isinstance(mode, TorchDispatchMode):
        return (_C._len_torch_dispatch_stack, _C._get_dispatch_stack_at,
                lambda: _C._pop_torch_dispatch_stack(None), _C._push_on_torch_dispatch_stack)
    return (_C._len_torch_function_stack, _C._get_function_stack_at,
            _C._pop_torch_function_stack, _C._push_on_torch_function_stack)


def push(mode: Mode) -> None:
    """Put ``mode`` on top of this thread's stack (with PyTorch's own bookkeeping)."""
    mode.__enter__()


def depth() -> int:
    """How many modes this thread's dispatch stack holds."""
    return _C._len_torch_dispatch_stack()


def insert(mode: Mode, index: int) -> None:
    """Put ``mode`` at ``index`` of this thread's stack (0: the bottom, the mode nearest the kernels); the modes at
    and above ``index`` stay above it, in their order.

    Their own ``__exit__`` pops the top of the stack: a mode pushed on top of one that exits before it would be
    popped in its place, and that one left on.
    """
    length, _, pop, put = _stack(mode)
    above = [pop() for _ in range(length() - max(0, min(index, length())))]  # topmost first
    try:
        push(mode)
    finally:
        for other in reversed(above):
            put(other)


def discard(mode: Mode) -> bool:
    """Take ``mode`` off this thread's stack without its ``__exit__`` (a mode someone else left there, perhaps
    put on raw, whose exit bookkeeping cannot be trusted); False if it is not there."""
    length, at, pop, put = _stack(mode)
    n = length()
    index = next((i for i in range(n - 1, -1, -1) if at(i) is mode), None)
    if index is None:
        return False
    above = [pop() for _ in range(n - 1 - index)]  # topmost first
    pop()
    for other in reversed(above):
        put(other)
    return True


def remove(mode: Mode) -> bool:
    """Take ``mode`` off this thread's stack wherever it is; False if it is not there (another thread's, or gone).

    While a mode's own handler runs, PyTorch has lifted it off the stack: it is then not found here.
    """
    length, at, pop, put = _stack(mode)
    n = length()
    index = next((i for i in range(n - 1, -1, -1) if at(i) is mode), None)
    if index is None:
        return False
    if index == n - 1:
        mode.__exit__(None, None, None)
        return True
    above = [pop() for _ in range(n - 1 - index)]  # topmost first
    try:
        mode.__exit__(None, None, None)
    finally:
        for other in reversed(above):
            put(other)
    return True


@contextlib.contextmanager
def lifted(mode: Mode) -> Iterator[None]:
    """``mode`` off this thread's stack for the block, then back where it was; the modes above it stay on.

    The emulator runs an RNN's recurrence without its own mode (it rounds the GEMMs itself), while a mode the user
    pushed inside the ``emulate`` block still sees every op.
    """
    length, at, pop, put = _stack(mode)
    n = length()
    index = next((i for i in range(n - 1, -1, -1) if at(i) is mode), None)
    if index is None:
        yield
        return
    remove(mode)
    try:
        yield
    finally:
        above = [pop() for _ in range(length() - index)]  # topmost first
        try:
            push(mode)
        finally:
            for other in reversed(above):
                put(other)
