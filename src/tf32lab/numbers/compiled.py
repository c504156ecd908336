"""The compiled kernels (numba, the optional extra ``tf32lab[fast]``): each module loaded once, or None where it
cannot be: numba missing, or unable to cache its code (a read-only install with no writable cache directory).

Example:

    >>> from tf32lab.numbers.compiled import kernels
    >>> kernels("rounding_kernels") is None or hasattr(kernels("rounding_kernels"), "round_bits")
    True
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator
from types import ModuleType
from typing import Optional

__all__ = ["kernels", "torch_threads"]


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
