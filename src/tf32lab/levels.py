"""Precision levels: the user's knob, and what each one asks of PyTorch's backends.

The mapping is what ``torch.set_float32_matmul_precision`` itself writes on PyTorch >= 2.9 (checked on 2.13):
cuBLAS never gets bf16, so ``medium`` is TF32 on CUDA; oneDNN (CPU) gets bf16 (``aten/src/ATen/Context.cpp``).
"""

from __future__ import annotations

from collections.abc import Iterable

from .errors import Tf32LabError

LEVELS = ("highest", "high", "medium")

# level -> (cuda.matmul, mkldnn.matmul) values of the per-backend API
BACKEND_VALUES = {
    "highest": ("ieee", "ieee"),
    "high": ("tf32", "tf32"),
    "medium": ("tf32", "bf16"),
}


def check_level(level: object) -> str:
    """Return ``level`` if it is one of LEVELS, else raise ValueError naming it and the accepted ones.

    >>> check_level("high")
    'high'
    >>> check_level("fast")
    Traceback (most recent call last):
    ...
    ValueError: unknown precision level 'fast'; accepted: 'highest', 'high', 'medium'
    """
    if not isinstance(level, str) or level not in LEVELS:
        accepted = ", ".join(map(repr, LEVELS))
        raise ValueError(f"unknown precision level {level!r}; accepted: {accepted}")
    return level


def level_of(cuda_matmul: str, mkldnn_matmul: str) -> str:
    """The level that effective backend values amount to: the most reduced precision in force wins.

    >>> level_of("tf32", "bf16"), level_of("tf32", "ieee"), level_of("ieee", "ieee")
    ('medium', 'high', 'highest')
    """
    if mkldnn_matmul == "bf16":
        return "medium"
    if "tf32" in (cuda_matmul, mkldnn_matmul):
        return "high"
    return "highest"


def check_levels(levels: Iterable[str]) -> tuple[str, ...]:
    """The levels, validated and without repeats, in order; a one-line ``Tf32LabError`` for a bad one.

    >>> check_levels(["high", "highest", "high"])
    ('high', 'highest')
    """
    if isinstance(levels, str):
        levels = (levels,)
    chosen = []
    for level in levels:
        try:
            check_level(level)
        except ValueError as exc:
            raise Tf32LabError(str(exc)) from None
        if level not in chosen:
            chosen.append(level)
    if not chosen:
        raise Tf32LabError(f"no levels to check; accepted: {', '.join(map(repr, LEVELS))}")
    return tuple(chosen)
