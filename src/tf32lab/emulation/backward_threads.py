"""An ``emulate()`` block seen from autograd's device threads.

On a GPU the autograd engine runs a backward on a thread of its own per device. That thread keeps the launching
thread's dispatch and function modes (PyTorch's ``ThreadLocalState``), so the emulator's modes see every op of the
backward, but none of Python's context variables: the block (``scope.current_emulation``) and the level of its
``precision()`` scope are not there, and each op ran as if no block were open. Measured on an H200 (torch 2.11):
every emulated training row of a model with attention failed at its first step ("Cannot access storage of
TensorWrapper": the attention's backward op ran its native fallback), and the GEMMs of every other backward ran
natively, at the GPU's own math rather than the target's.

:func:`launched` makes the launching thread's context known for as long as a backward it starts on a GPU tensor
runs; :func:`launcher` gives it to an op that runs where no block is open. Each op runs in a copy of it (one
``contextvars.Context`` cannot be entered by two device threads at once).

Example:

    >>> import threading, torch
    >>> def in_a_backward(seen):  # an op of a backward, as autograd's device thread runs it
    ...     leaf = torch.zeros((), requires_grad=True)
    ...     _ = leaf.register_hook(lambda g: seen.append(launcher() is not None))
    ...     (leaf * 1).backward()
    >>> with launched():
    ...     seen = []
    ...     worker = threading.Thread(target=in_a_backward, args=(seen,))
    ...     worker.start(); worker.join()
    ...     outside = []
    ...     worker = threading.Thread(target=lambda: outside.append(launcher() is not None))
    ...     worker.start(); worker.join()
    >>> seen, outside, launcher() is None
    ([True], [False], True)
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch

from tf32lab.control import scope
from tf32lab.errors import Tf32LabError

__all__ = ["LAUNCHED", "launched", "launcher", "run_in"]

# thread id -> (the context of the backward that thread has running, the block it holds); empty but while one runs
# (read unlocked first)
LAUNCHED: dict[int, tuple[contextvars.Context, Any]] = {}
_LOCK = threading.Lock()
_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)  # -1 outside a backward's graph task
# set inside run_in's copy: an op there that still finds no block (the block closed meanwhile) is passed on, not run
# in the launcher's context again and again
_RUNNING: contextvars.ContextVar[bool] = contextvars.ContextVar("tf32lab_backward_run", default=False)


@contextlib.contextmanager
def launched(block: Any = None) -> Iterator[None]:
    """This thread's context made known to autograd's device threads while the block runs (nested: the inner);
    ``block``: what the context holds (the ``emulate()`` block), so that two threads in one block are one."""
    me = threading.get_ident()
    with _LOCK:
        outer = LAUNCHED.get(me)
        LAUNCHED[me] = (contextvars.copy_context(), block)
    try:
        yield
    finally:
        with _LOCK:
            if outer is None:
                LAUNCHED.pop(me, None)
            else:
                LAUNCHED[me] = outer


def launcher() -> Optional[contextvars.Context]:
    """The context of the backward running on this thread, for an op that finds no block open: None where no
    backward was launched from a block, or this thread launched one (its own context is the block's). Two threads
    with a backward each in two blocks at once cannot be told apart on a device thread, which both use: refused."""
    if not LAUNCHED or _RUNNING.get():
        return None
    if _graph_task_id is not None and _graph_task_id() == -1:
        # not running a backward's op: some other thread that holds the emulator's modes (a block of another task
        # of its own), not autograd's device thread, whose every op runs in a graph task
        return None
    with _LOCK:
        if threading.get_ident() in LAUNCHED:
            return None
        found = list(LAUNCHED.values())
    if not found:
        return None
    if len(found) > 1 and (any(block is None for _, block in found) or len({id(block) for _, block in found}) > 1
                           or len({id(scope._live(context.get(scope._SCOPE))) for context, _ in found}) > 1):
        # one block entered by several threads is one only at one precision() scope: the op would take the level
        # of whichever thread registered first
        raise Tf32LabError(f"{len(found)} threads run an emulated backward at once: autograd runs a GPU's on "
                           f"one device thread, where an op cannot tell whose emulate() block and precision() "
                           f"scope it belongs to; run them one after the other")
    return found[0][0]


def run_in(context: contextvars.Context, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a copy of ``context`` (one ``Context`` cannot be entered by two device threads at once),
    with the context variables this thread set itself laid over it: a ``precision()`` scope that a backward hook or
    a custom ``Function.backward`` entered here is the op's, as it would be on the launching thread."""
    run = context.copy()
    for variable, value in contextvars.copy_context().items():
        value = _open(value)
        if value is not None:  # a scope or block entered and left here leaves None (or a closed node): not laid over
            run.run(variable.set, value)
    run.run(_RUNNING.set, True)
    return run.run(fn, *args)


def _open(value: Any) -> Any:
    """``value``, or for a closed scope or block (a node with ``alive`` false) its innermost open parent, or None."""
    while value is not None and getattr(value, "alive", True) is False:
        value = getattr(value, "parent", None)
    return value
