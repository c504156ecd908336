"""Whose exception is it: the model's, or tf32lab's own?

``check``, ``tune``, ``predict`` and ``bench`` run the model inside tf32lab's hooks and dispatch modes, so an
exception that leaves a run may come from either. A model that raises is a finding (a Cholesky that fails under
TF32) or bad input; an exception raised by tf32lab's own arithmetic (a division by an empty shape's zero while
counting) is a bug in tf32lab, and must say so instead of being put down to the model.

The traceback is read from the frame that raised outwards, PyTorch's and the standard library's frames passed
over: the first frame of anyone else's (the model, the project, a metric) decides for the model; the first frame of
tf32lab's decides for tf32lab, unless it only handed an op on (``func(*args, **kwargs)`` in a dispatch mode: the
op's own error, as it would raise natively; or a frame whose local :data:`HANDS_ON` is true) or it is a built-in
workload's model (``builtin.py``). A ``RuntimeError`` (PyTorch's kernels raise those, ``LinAlgError`` among them)
is left to the model even from a frame of tf32lab's: an emulated solve that meets a singular matrix reports what
the hardware would, a finding, and telling a kernel's complaint about the model's tensors from one about tf32lab's
is not possible from the frames.

Example:

    >>> def count(shape):
    ...     return 8 / shape[0]
    >>> try:
    ...     count((0,))
    ... except ZeroDivisionError as exc:
    ...     raised_by_tf32lab(exc) is None       # a frame of this doctest's, not tf32lab's: the caller's
    True
"""

from __future__ import annotations

import functools
import linecache
import os
import sys
import sysconfig
from typing import Any, Optional

from tf32lab.errors import Tf32LabError

__all__ = ["HANDS_ON", "LIBRARY", "OURS", "PACKAGE", "exit_call", "forwarding_line", "forwards", "innermost_first",
           "internal_error", "kind_of", "raised_by_tf32lab", "run_error"]

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # tf32lab/
# tf32lab's demo workloads: their errors are a model's
_MODELS = frozenset([os.path.join(PACKAGE, "workloads", "builtin.py")])
_FORWARD = "func(*args, **kwargs)"  # how tf32lab's modes hand an op on, unchanged, to run as it would natively
LIBRARY, OURS, _OTHER = "library", "tf32lab", "other"  # whose code a frame runs (kind_of)
_GENERATED = ("<frozen ", "<eval_with_key>")  # pseudo-files of library code: Python's, torch.fx's
# a local that a frame of tf32lab's sets true where the call it made raised as natively, though its line is not
# ``func(*args, **kwargs)`` (the emulator's backward, refused by autograd before any op of it was emulated)
HANDS_ON = "_tf32lab_hands_on"


def raised_by_tf32lab(exc: BaseException) -> Optional[str]:
    """``"tf32lab/counting.py:96"``: where tf32lab's own code raised ``exc`` (or the exception it was raised while
    handling); None when it is the model's, or a library's on the model's behalf (module docstring)."""
    seen: set[int] = set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (Tf32LabError, RuntimeError)):
            return None  # already worded for the user; or a kernel's verdict on the tensors it was given
        where = _raised_in(current)
        if where != LIBRARY:
            return where
        current = current.__cause__ or current.__context__
    return None


def internal_error(exc: BaseException, during: str) -> Optional[Tf32LabError]:
    """The error to raise instead of ``exc`` when tf32lab's own code raised it (``during``: what tf32lab was doing,
    e.g. "counting the work of workload 'x'"), else None."""
    where = raised_by_tf32lab(exc)
    if where is None:
        return None
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    message = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return Tf32LabError(f"internal error in tf32lab while {during}: {message} (at {where}); this is a bug in "
                        f"tf32lab, not in the model: please report it with the command that raised it")


def run_error(exc: BaseException, name: str, doing: str, when: str) -> Tf32LabError:
    """What to raise when running workload ``name`` raised ``exc``: tf32lab's internal error when its own code
    raised it (``doing``: "timing", ...), else the model's, said as ``workload 'x' raised E <when>: ...``."""
    return internal_error(exc, f"{doing} workload {name!r}") or Tf32LabError(
        f"workload {name!r} raised {type(exc).__name__} {when}: {exc}")


def exit_call(exc: SystemExit) -> str:
    """``sys.exit(0)``: the call that raised ``exc`` (its message is its bare code, which says nothing alone)."""
    return f"sys.exit({'' if exc.code is None else repr(exc.code)})"


def innermost_first(tb: Any) -> list[Any]:
    """A traceback's entries from the frame that raised outwards: the order in which they are read."""
    entries = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    return entries[::-1]


def _raised_in(exc: BaseException) -> Optional[str]:
    """``"tf32lab/x.py:N"``, None (someone else's), or LIBRARY (only library frames)."""
    for entry in innermost_first(exc.__traceback__):
        filename = entry.tb_frame.f_code.co_filename
        kind = kind_of(filename)
        if kind == LIBRARY:
            continue
        if kind != OURS or forwards(entry):
            return None
        return f"tf32lab/{os.path.abspath(filename)[len(PACKAGE):]}:{entry.tb_lineno}"
    return LIBRARY


@functools.cache
def kind_of(filename: str) -> str:
    """Whose code a frame of ``filename`` runs: ``OURS`` (tf32lab's, its demo models excepted), ``LIBRARY``
    (PyTorch, the standard library, generated code) or another's (a model, a test, a third-party package)."""
    if filename.startswith("<"):
        # Python's frozen modules and torch.fx's generated forward are library code; any other pseudo-file is code
        # the user typed or built: <stdin>, ``python -c`` and exec's <string>, <console>, IPython's cells, a doctest
        return LIBRARY if filename.startswith(_GENERATED) else _OTHER
    path = os.path.abspath(filename)
    if path.startswith(PACKAGE):
        return _OTHER if path in _MODELS else OURS
    torch = sys.modules.get("torch")
    if torch is not None and path.startswith(os.path.dirname(os.path.abspath(torch.__file__)) + os.sep):
        return LIBRARY
    parts = path.split(os.sep)
    if "site-packages" in parts or "dist-packages" in parts:
        return _OTHER
    stdlib = {os.path.abspath(sysconfig.get_paths()[key]) + os.sep for key in ("stdlib", "platstdlib")}
    return LIBRARY if any(path.startswith(prefix) for prefix in stdlib) else _OTHER


def forwards(entry: Any) -> bool:
    """Whether this traceback entry, a frame of tf32lab's, was handing an op on unchanged when the exception passed
    through it."""
    if entry.tb_frame.f_locals.get(HANDS_ON) is True:
        return True
    code, lineno = entry.tb_frame.f_code, entry.tb_lineno
    positions = getattr(code, "co_positions", None)
    if positions is not None:  # Python 3.11+: the very expression that was running
        try:
            start, end, first, last = list(positions())[entry.tb_lasti // 2]
        except (IndexError, ValueError):
            start = None
        if start is not None and start == end and first is not None and last is not None:
            return linecache.getline(code.co_filename, start)[first:last] == _FORWARD
    return forwarding_line(linecache.getline(code.co_filename, lineno))


def forwarding_line(line: Optional[str]) -> bool:
    """Whether a source line hands an op on unchanged (for frames known by their line only, as Dynamo keeps them)."""
    return _FORWARD in (line or "")
