"""A transformers mixture of experts run one GEMM per expert while a check runs (``experts_eager``): transformers
5 runs a model's experts through ``torch._grouped_mm`` by default, which has no float64 kernel (the float64
reference of a mixture of experts built in Python raised) and which the emulator does not round; one GEMM per
expert is what both need. A folder loaded by ``hf:`` asks for ``"eager"`` at load already."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["experts_eager"]


@contextlib.contextmanager
def experts_eager(model: torch.nn.Module) -> Iterator[None]:
    """A transformers mixture of experts runs its experts one GEMM each (``"eager"``) while the check runs, its own
    implementation put back after: transformers 5's default grouped GEMM (``torch._grouped_mm``) has no float64
    kernel, so a model built in Python (``hf.causal_lm`` loads a folder's eager) raised at the float64 reference,
    and each expert's GEMM is then one the emulator rounds as the hardware's.

    Example (a module without experts is run as it is):

        >>> import torch
        >>> from tf32lab.workloads.experts import experts_eager
        >>> with experts_eager(torch.nn.Linear(2, 2)):
        ...     pass
    """
    before = getattr(getattr(model, "config", None), "_experts_implementation", None)
    switch = getattr(model, "set_experts_implementation", None)
    if before in (None, "eager") or not callable(switch):
        yield
        return
    try:
        switch("eager")
    except (RuntimeError, ValueError):  # an implementation fixed at load time (transformers' DeepGEMM MegaMoE)
        switched = False
    else:
        switched = True
    try:
        yield
    finally:
        if switched:
            switch(before)
