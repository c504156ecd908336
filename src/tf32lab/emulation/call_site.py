"""An op the emulator's function mode hands on, called so that Python's warnings take it for its caller's call.

A warning raised while a call runs is put down to a frame: PyTorch's kernels warn (``TORCH_WARN``) from the
innermost Python frame, and its Python functions warn ``stacklevel`` frames up, both natively the code that
called the op. Under ``emulate`` every torch function call is made once more by the function mode's handler, and
the warning was put down to tf32lab's frame: a filter by module (``filterwarnings("ignore", module=...)``,
``-W error`` beside pytest's ``ignore::UserWarning:mypackage``) no longer matched, and a test the filter kept
passing failed under the pytest plugin, as a precision finding. Here the call is made from a function whose
globals are the calling frame's: the warning's module (``__name__``) and registry (``__warningregistry__``, which
``"once"`` and ``"default"`` read) are the caller's, as natively; its file and line stay this module's, a line
that hands the op on (``numbers.origin.forwards``), so that the op's own error is still the caller's.

Example:

    >>> import warnings
    >>> def bare(x):
    ...     warnings.warn("from the op", stacklevel=2)
    ...     return x
    >>> with warnings.catch_warnings(record=True) as seen:
    ...     warnings.simplefilter("always")
    ...     as_called(bare, (1,), {}, depth=1)
    1
    >>> seen[0].filename.endswith("call_site.py")   # the line: this module's
    True
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any, Callable, Optional

from torch import overrides

__all__ = ["as_called"]

# frames between the call and the mode's handler: handle_torch_function's (a torch function written in Python), and
# on autograd's device thread (a GPU backward's op) the handler's first call and backward_threads.run_in's, which
# call the handler again in the block's context
_BETWEEN = frozenset((overrides.__file__, *(os.path.join(os.path.dirname(__file__), name)
                                            for name in ("backward_threads.py", "emulator.py"))))
_MOST = 512  # modules' globals kept at once: a few per model

# one line: the frame a warning is put down to shows it, and origin.forwards reads it as handing the op on
_CALL = (lambda func, args, kwargs: func(*args, **kwargs)).__code__
_MADE: dict[int, tuple[dict[str, Any], Callable[..., Any]]] = {}


def as_called(func: Callable[..., Any], args: tuple, kwargs: dict, depth: int = 2) -> Any:
    """``func(*args, **kwargs)``, with the globals of the frame that called it natively: ``depth`` frames up from
    this call (the mode's handler's caller), past the frames between (:data:`_BETWEEN`) and, for a torch function
    written in Python, its own outer frame (the call the mode intercepted); made plainly where no frame is left."""
    try:
        frame: Optional[types.FrameType] = sys._getframe(depth)
    except ValueError:  # no Python frame below (an atexit callback, a hook called from C on autograd's thread)
        frame = None
    while frame is not None and frame.f_code.co_filename in _BETWEEN:
        frame = frame.f_back
    if frame is not None and frame.f_code is getattr(func, "__code__", None):
        frame = frame.f_back
    if frame is None:
        return func(*args, **kwargs)
    found = frame.f_globals
    made = _MADE.get(id(found))
    if made is None or made[0] is not found:
        made = (found, types.FunctionType(_CALL, found, "as_called"))
        if _module_globals(found):  # alive as long as its module: kept; exec's own globals are not (their values)
            if len(_MADE) >= _MOST:
                _MADE.clear()
            _MADE[id(found)] = made
    _tf32lab_hands_on = True  # origin.HANDS_ON: what raises from here on is the op's own, as natively
    return made[1](func, args, kwargs)


def _module_globals(found: dict[str, Any]) -> bool:
    """Whether ``found`` is an imported module's namespace (not ``exec``'s or ``eval``'s own dict)."""
    module = sys.modules.get(found.get("__name__"))  # type: ignore[arg-type]
    return module is not None and getattr(module, "__dict__", None) is found
