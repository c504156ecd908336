"""A model run eagerly while a check runs it (:func:`eager`): what a float64 pass needs of a model that
``torch.compile`` compiled, or of a transformers mixture of experts, in ``check``, ``check_training`` and ``tune``
alike."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from tf32lab.emulation.emulator import compiled_eagerly
from tf32lab.workloads.experts import experts_eager

__all__ = ["eager"]


@contextlib.contextmanager
def eager(model: torch.nn.Module) -> Iterator[None]:
    """``model``'s compiled code run eagerly (``compiled_eagerly``: Dynamo traced a ``torch.compile``'d model into
    the float64 reference's modes) and a transformers mixture of experts one GEMM per expert (``experts_eager``: its
    grouped GEMM has no float64 kernel), while the block runs.

        >>> with eager(torch.nn.Linear(2, 2)):
        ...     pass
    """
    with experts_eager(model), compiled_eagerly():
        yield
