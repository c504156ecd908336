"""The compiled kernels (numba, the optional extra ``tf32lab[fast]``): each module loaded once, or None where it
cannot be: numba missing, or unable to cache its code (a read-only install with no writable cache directory).

Example:

    >>> from tf32lab.numbers.compiled import kernels
    >>> kernels("rounding_kernels") is None or hasattr(kernels("rounding_kernels"), "round_bits")
    True
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Optional

__all__ = ["kernels"]


@functools.cache
def kernels(name: str) -> Optional[ModuleType]:
    """The module ``tf32lab.numbers.<name>`` of compiled kernels, or None where numba cannot give it."""
    try:
        return importlib.import_module(f"tf32lab.numbers.{name}")
    except (ImportError, RuntimeError):  # numba is an optional extra; or it cannot cache (a read-only install)
        return None
