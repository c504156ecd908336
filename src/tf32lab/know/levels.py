"""Precision levels: the user's knob, and what each one asks of PyTorch's backends.

The mapping is what ``torch.set_float32_matmul_precision`` itself writes on PyTorch >= 2.9 (checked on 2.13):
cuBLAS never gets bf16, so ``medium`` is TF32 on CUDA; oneDNN (CPU) gets bf16 (``aten/src/ATen/Context.cpp``).

``LEVELS`` are PyTorch's own three: the defaults of every table and run, and all that
``set_float32_matmul_precision`` takes. ``EXTRA_LEVELS`` are levels PyTorch writes only through its per-backend
cells: ``bfx9`` is ``cuda.matmul = "bfx9"`` (cuBLAS's float32 from nine bf16 products, CUDA 12.9+, compute
capability 10.0; pytorch#195301) with ``mkldnn.matmul = "ieee"`` (oneDNN has no such math). Every place that
accepts a level accepts them (``check_level``); none runs them unless asked. ``ALL_LEVELS`` orders all of them by
accuracy, most accurate first: ``bfx9`` keeps float32's accuracy with other bits, so it sits between ``highest``
and ``high``.
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable, Mapping
from typing import Optional

from tf32lab.errors import Tf32LabError

LEVELS = ("highest", "high", "medium")  # PyTorch's own: torch.set_float32_matmul_precision takes these
EXTRA_LEVELS = ("bfx9",)  # written through the per-backend cells only (torch >= the release with pytorch#195301)
ALL_LEVELS = ("highest", "bfx9", "high", "medium")  # every level, most accurate first

# level -> (cuda.matmul, mkldnn.matmul) values of the per-backend API
BACKEND_VALUES = {
    "highest": ("ieee", "ieee"),
    "bfx9": ("bfx9", "ieee"),
    "high": ("tf32", "tf32"),
    "medium": ("tf32", "bf16"),
}
# The level PyTorch's own setter is given for an extra level (its cells are then written over): the legacy getter
# keeps answering one of PyTorch's levels.
TORCH_LEVEL = {"highest": "highest", "bfx9": "highest", "high": "high", "medium": "medium"}


CELLS = ("cuda.matmul", "mkldnn.matmul")  # the cells a level writes (per-backend API); the rest it leaves


def level_cells(level: str) -> dict[str, str]:
    """The backend cells ``level`` writes, by cell: the one place a level is unpacked into them.

    >>> level_cells("medium")
    {'cuda.matmul': 'tf32', 'mkldnn.matmul': 'bf16'}
    """
    return dict(zip(CELLS, BACKEND_VALUES[check_level(level)]))


def check_level(level: object, where: str = "", *, also: tuple[str, ...] = (), loose: bool = False,
                torch_only: bool = False) -> str:
    """``level`` if it is one of ALL_LEVELS (or of ``also``), else a one-line ``Tf32LabError`` (a ``ValueError``)
    naming it, ``where`` it came from, and the accepted ones: the one level validator. ``loose``: text a person
    typed (a file, an option): case and surrounding blanks do not matter. ``torch_only``: PyTorch's own LEVELS only
    (what ``set_float32_matmul_precision`` takes).

    >>> check_level("high"), check_level(" High ", loose=True), check_level("bfx9")
    ('high', 'high', 'bfx9')
    >>> check_level("fast", "policy default")
    Traceback (most recent call last):
    ...
    tf32lab.errors.Tf32LabError: policy default: unknown level 'fast'; accepted: 'highest', 'bfx9', 'high', 'medium'
    """
    name = level.strip().lower() if loose and isinstance(level, str) else level
    known = LEVELS if torch_only else ALL_LEVELS
    if isinstance(name, str) and (name in known or name in also):
        return name
    accepted = ", ".join(map(repr, (*also, *known)))
    if torch_only and name in EXTRA_LEVELS:
        raise Tf32LabError(
            f"{where + ': ' if where else ''}{name!r} is not one of PyTorch's levels (accepted: {accepted}): it is a "
            f"value of torch.backends.cuda.matmul.fp32_precision; use tf32lab.precision({name!r}) for it")
    raise Tf32LabError(f"{where + ': ' if where else ''}unknown level {reprlib.repr(level)}; accepted: {accepted}")


# cuDNN's float32 convolution math: a knob of its own beside the level (no level writes it; PyTorch's default tf32)
CONV_MATHS = ("tf32", "ieee")


def check_conv(conv: object, where: str = "") -> Optional[str]:
    """``conv`` validated: None (cuDNN's flag as the process holds it), ``"tf32"`` or ``"ieee"``; else a one-line
    ``Tf32LabError`` naming it and the accepted ones: the one conv-math validator.

    >>> check_conv("ieee"), check_conv(None)
    ('ieee', None)
    >>> check_conv("fast")
    Traceback (most recent call last):
    ...
    tf32lab.errors.Tf32LabError: unknown conv math 'fast'; accepted: 'tf32', 'ieee' (cudnn.conv's fp32_precision)
    """
    if conv is None or (isinstance(conv, str) and conv in CONV_MATHS):
        return conv
    raise Tf32LabError(f"{where + ': ' if where else ''}unknown conv math {reprlib.repr(conv)}; accepted: "
                       f"{', '.join(map(repr, CONV_MATHS))} (cudnn.conv's fp32_precision)")


def with_conv(cells: Mapping[str, str], conv: Optional[str]) -> dict[str, str]:
    """``cells`` with cuDNN's flag at ``conv`` (None: as they are): the flag sets its convolutions' and its RNNs'
    cells alike.

    >>> with_conv({"cuda.conv": "tf32", "cuda.rnn": "tf32", "cuda.matmul": "ieee"}, "ieee")
    {'cuda.conv': 'ieee', 'cuda.rnn': 'ieee', 'cuda.matmul': 'ieee'}
    """
    return dict(cells) if conv is None else {**cells, "cuda.conv": conv, "cuda.rnn": conv}


# What level_of answers for cells holding a value this tf32lab does not know (a newer torch's): never a level.
UNKNOWN = "unknown"
# "none" all the way up (PyTorch's default on some versions) is IEEE.
_IEEE = ("ieee", "none")


def level_of(cuda_matmul: str, mkldnn_matmul: str) -> str:
    """The level that effective backend values amount to: the most reduced precision in force wins.

    A value tf32lab does not know gives ``"unknown"``, never a level it might not be.

    >>> level_of("tf32", "bf16"), level_of("tf32", "ieee"), level_of("ieee", "ieee"), level_of("bfx9", "ieee")
    ('medium', 'high', 'highest', 'bfx9')
    >>> level_of("fp8x4", "ieee")
    'unknown'
    """
    if mkldnn_matmul == "bf16":
        return "medium"
    if "tf32" in (cuda_matmul, mkldnn_matmul):
        return "high"
    if mkldnn_matmul in _IEEE:
        if cuda_matmul in _IEEE:
            return "highest"
        if cuda_matmul == "bfx9":
            return "bfx9"
    return UNKNOWN


def check_levels(levels: Iterable[str]) -> tuple[str, ...]:
    """The levels, validated and without repeats, in order; a one-line ``Tf32LabError`` for a bad one.

    >>> check_levels(["high", "highest", "high"])
    ('high', 'highest')
    >>> check_levels(5)
    Traceback (most recent call last):
    ...
    tf32lab.errors.Tf32LabError: levels must be a level's name or a collection of them (e.g. ("highest", "high")), not 5
    """
    if isinstance(levels, str):
        levels = (levels,)
    elif isinstance(levels, (bytes, Mapping)) or not isinstance(levels, Iterable):  # a mapping's keys are no list
        raise Tf32LabError(f"levels must be a level's name or a collection of them (e.g. (\"highest\", \"high\")), "
                           f"not {reprlib.repr(levels)}")
    chosen = []
    for level in levels:
        check_level(level)
        if level not in chosen:
            chosen.append(level)
    if not chosen:
        raise Tf32LabError(f"no levels to check; accepted: {', '.join(map(repr, ALL_LEVELS))}")
    return tuple(chosen)
