"""Precision levels: the user's knob, and what each one asks of PyTorch's backends.

The mapping is what ``torch.set_float32_matmul_precision`` itself writes on PyTorch >= 2.9 (checked on 2.13):
cuBLAS never gets bf16, so ``medium`` is TF32 on CUDA; oneDNN (CPU) gets bf16 (``aten/src/ATen/Context.cpp``).
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable

from tf32lab.errors import Tf32LabError

LEVELS = ("highest", "high", "medium")

# level -> (cuda.matmul, mkldnn.matmul) values of the per-backend API
BACKEND_VALUES = {
    "highest": ("ieee", "ieee"),
    "high": ("tf32", "tf32"),
    "medium": ("tf32", "bf16"),
}


CELLS = ("cuda.matmul", "mkldnn.matmul")  # the cells a level writes (per-backend API); the rest it leaves


def level_cells(level: str) -> dict[str, str]:
    """The backend cells ``level`` writes, by cell: the one place a level is unpacked into them.

    >>> level_cells("medium")
    {'cuda.matmul': 'tf32', 'mkldnn.matmul': 'bf16'}
    """
    return dict(zip(CELLS, BACKEND_VALUES[check_level(level)]))


def check_level(level: object, where: str = "", *, also: tuple[str, ...] = (), loose: bool = False) -> str:
    """``level`` if it is one of LEVELS (or of ``also``), else a one-line ``Tf32LabError`` (a ``ValueError``) naming
    it, ``where`` it came from, and the accepted ones: the one level validator. ``loose``: text a person typed
    (a file, an option): case and surrounding blanks do not matter.

    >>> check_level("high"), check_level(" High ", loose=True)
    ('high', 'high')
    >>> check_level("fast", "policy default")
    Traceback (most recent call last):
    ...
    tf32lab.errors.Tf32LabError: policy default: unknown level 'fast'; accepted: 'highest', 'high', 'medium'
    """
    name = level.strip().lower() if loose and isinstance(level, str) else level
    if isinstance(name, str) and (name in LEVELS or name in also):
        return name
    accepted = ", ".join(map(repr, (*also, *LEVELS)))
    raise Tf32LabError(f"{where + ': ' if where else ''}unknown level {reprlib.repr(level)}; accepted: {accepted}")


# What level_of answers for cells holding a value this tf32lab does not know (a newer torch's): never a level.
UNKNOWN = "unknown"
# cuBLAS's BF16x9 (cuda.matmul only, pytorch#195301) keeps float32's accuracy: it amounts to "highest", with other
# bits. "none" all the way up (PyTorch's default on some versions) is IEEE.
_FLOAT32_ACCURATE = ("ieee", "none", "bfx9")


def level_of(cuda_matmul: str, mkldnn_matmul: str) -> str:
    """The level that effective backend values amount to: the most reduced precision in force wins.

    A value tf32lab does not know gives ``"unknown"``, never a level it might not be.

    >>> level_of("tf32", "bf16"), level_of("tf32", "ieee"), level_of("ieee", "ieee"), level_of("bfx9", "ieee")
    ('medium', 'high', 'highest', 'highest')
    >>> level_of("fp8x4", "ieee")
    'unknown'
    """
    if mkldnn_matmul == "bf16":
        return "medium"
    if "tf32" in (cuda_matmul, mkldnn_matmul):
        return "high"
    if cuda_matmul in _FLOAT32_ACCURATE and mkldnn_matmul in _FLOAT32_ACCURATE:
        return "highest"
    return UNKNOWN


def check_levels(levels: Iterable[str]) -> tuple[str, ...]:
    """The levels, validated and without repeats, in order; a one-line ``Tf32LabError`` for a bad one.

    >>> check_levels(["high", "highest", "high"])
    ('high', 'highest')
    """
    if isinstance(levels, str):
        levels = (levels,)
    chosen = []
    for level in levels:
        check_level(level)
        if level not in chosen:
            chosen.append(level)
    if not chosen:
        raise Tf32LabError(f"no levels to check; accepted: {', '.join(map(repr, LEVELS))}")
    return tuple(chosen)
