"""The compiled kernels (numba, the optional extra ``tf32lab[fast]``): each module loaded once, or None where it
cannot be: numba missing, or unable to cache its code (a read-only install with no writable cache directory).
Each kernel is compiled for one signature (:func:`one_signature`), once per process, at its first call.

Example:

    >>> from tf32lab.numbers.compiled import kernels
    >>> kernels("rounding_kernels") is None or hasattr(kernels("rounding_kernels"), "round_bits")
    True
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, Optional

import numpy as np

__all__ = ["KERNEL_MODULES", "compile_all", "kernels", "one_signature", "torch_threads"]

# The modules of compiled kernels, each ``tf32lab.numbers.<name>``.
KERNEL_MODULES = ("rounding_kernels", "accumulation_kernels", "recurrent_kernels")
_KERNEL_MODULE_NAMES = frozenset(f"tf32lab.numbers.{name}" for name in KERNEL_MODULES)
# Each kernel's compile (or load from numba's cache), registered by ``one_signature`` as its module is imported.
_COMPILES: list[Callable[[], None]] = []


@functools.cache
def kernels(name: str) -> Optional[ModuleType]:
    """The module ``tf32lab.numbers.<name>`` of compiled kernels, or None where numba cannot give it."""
    try:
        return importlib.import_module(f"tf32lab.numbers.{name}")
    except (ImportError, RuntimeError):  # numba is an optional extra; or it cannot cache (a read-only install)
        return None


@contextlib.contextmanager
def torch_threads() -> Iterator[None]:
    """numba's parallel kernels run on as many threads as torch's intra-op pool, and torch's count is as it was after.

    numba's OpenMP layer sets the calling thread's OpenMP thread count to numba's own (every CPU by default) at each
    parallel launch, and ``torch.get_num_threads()`` reads that count: without this, a user's
    ``torch.set_num_threads(1)`` became 2 after the first compiled accumulation GEMM. numba's own count is put back.
    """
    import numba
    import torch

    threads, numba_threads = torch.get_num_threads(), numba.get_num_threads()
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    try:
        yield
    finally:
        numba.set_num_threads(numba_threads)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def one_signature(*argtypes: Any) -> Callable[[Any], Any]:
    """A decorator for a numba kernel (put above ``@numba.njit``): compiled for ``argtypes`` (numba types) alone,
    at its first call rather than at import, and never for another signature.

    numba compiles a dispatcher anew for each combination of argument types it meets (an array C-contiguous or
    not, read-only or not; an int or a bool): about 10 s of CPU for each GEMM kernel, in every process where its
    on-disk cache misses (a fresh clone or install: the cache is keyed on the source file's modification time).
    With compiling off after the first, numba converts what it can to that signature (an int32 to an int64, a
    writable array to a read-only one, a C array to an 'A' one), and the wrapper copies an input given in another
    layout to the C-contiguous one that a read-only C array type asks for; an output (mutable) must come as
    typed; arguments given by keyword or left to their defaults are bound to their places first (numba has no
    overload for an omitted one). A kernel that loops over an input takes it C-contiguous: numba's loops over 'A'
    arrays do not vectorise (the 32-bit GEMM kernel ran 7x slower).

    Example (where numba is installed): a strided view is copied, and the one signature serves both calls.

        >>> import importlib.util
        >>> import numpy as np
        >>> if importlib.util.find_spec("numba"):
        ...     import numba
        ...     @one_signature(numba.types.Array(numba.types.float64, 1, "C", readonly=True))
        ...     @numba.njit
        ...     def total(x):
        ...         return x.sum()
        ...     assert total(np.ones(4)) == total(np.ones(8)[::2]) == 4.0
        ...     assert len(total.dispatcher.signatures) == 1
    """
    def wrap(dispatcher: Any) -> Callable[..., Any]:
        # inputs that must come C-contiguous: made so here (numba refuses an 'A' array once compiling is off)
        dense = tuple(i for i, t in enumerate(argtypes) if getattr(t, "layout", None) == "C" and not t.mutable)
        lock = threading.Lock()
        ready = False

        def compile_once() -> None:
            nonlocal ready
            with lock:
                if not ready:
                    dispatcher.compile(argtypes)  # or loaded from numba's cache
                    dispatcher.disable_compile()
                    ready = True

        if dispatcher.py_func.__module__ in _KERNEL_MODULE_NAMES:  # not a kernel of a caller's own (a doctest's)
            _COMPILES.append(compile_once)
        signature = inspect.signature(dispatcher.py_func)

        @functools.wraps(dispatcher.py_func)
        def kernel(*args: Any, **kwargs: Any) -> Any:
            if not ready:
                compile_once()
            if kwargs or len(args) < len(argtypes):  # numba's dispatch took both; its one signature takes neither
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                args = bound.args
            for i in dense:
                if not args[i].flags.c_contiguous:
                    args = tuple(np.ascontiguousarray(x) if k in dense else x for k, x in enumerate(args))
                    break
            return dispatcher(*args)

        kernel.dispatcher = dispatcher  # type: ignore[attr-defined]  # numba's own: its signatures, its overloads
        return kernel

    return wrap


def compile_all() -> int:
    """Compile every kernel of :data:`KERNEL_MODULES` now, each into numba's on-disk cache (or load it from there),
    rather than at its first call; returns how many there are (0 where numba cannot give them). For a process
    that compiles for others: ``make test`` runs it beside pip's install, on the core that pip leaves idle, so that
    the suite of a fresh clone finds every kernel compiled (about 30 s of CPU on a cold cache; ``python -m
    tf32lab.numbers.compiled``). Needs numba and numpy only, not torch.

    Example (the modules it compiles; the call itself is left to that script: run by the docstring examples, on any
    of the suite's workers, it compiled every kernel beside the worker that compiles them for their tests):

        >>> KERNEL_MODULES
        ('rounding_kernels', 'accumulation_kernels', 'recurrent_kernels')
    """
    for name in KERNEL_MODULES:
        if kernels(name) is None:
            return 0
    for compile_once in list(_COMPILES):
        compile_once()
    return len(_COMPILES)


if __name__ == "__main__":  # run as a script, this file is not the module the kernels register with
    import sys

    from tf32lab.numbers import compiled

    count = compiled.compile_all()
    if not count:  # an image built without the extra: one line and a failure, not "0 compiled" and success
        try:
            import numba  # noqa: F401
        except ImportError:
            why = "numba is not installed (pip install 'tf32lab[fast]')"
        else:
            why = "numba cannot cache its code here (a read-only install without NUMBA_CACHE_DIR)"
        print(f"tf32lab: no kernels compiled: {why}", file=sys.stderr)
        sys.exit(1)
    print(f"tf32lab: {count} compiled kernels in numba's cache")
