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
    and each expert's GEMM is then one the emulator rounds as the hardware's. Every transformers model in
    ``model`` is switched (one held by the user's own module too), and each submodel's implementation (a
    vision-language model's text model has a config of its own) is put back as it was, on every exit.

    Example (a module without experts is run as it is):

        >>> import torch
        >>> from tf32lab.workloads.experts import experts_eager
        >>> with experts_eager(torch.nn.Linear(2, 2)):
        ...     pass
    """
    # every transformers model in it (the workload's model may be the user's module holding one), and each
    # submodel's config (a vision-language model's text model has its own): as they were, to be put back each
    configs = {id(m.config): m.config for m in model.modules()
               if callable(getattr(m, "set_experts_implementation", None)) and hasattr(m, "config")}
    before = {key: getattr(config, "_experts_implementation", None) for key, config in configs.items()}
    if all(value in (None, "eager") for value in before.values()):
        yield
        return
    try:
        for m in model.modules():
            config = getattr(m, "config", None)
            if id(config) in configs and getattr(config, "_experts_implementation", None) not in (None, "eager"):
                # an implementation fixed at load time (transformers' DeepGEMM MegaMoE) raises: kept as it is
                with contextlib.suppress(RuntimeError, ValueError):
                    m.set_experts_implementation("eager")
        yield
    finally:
        # written back as each config had it: set_experts_implementation(top's) would give every submodel the top
        # config's (transformers validated each when it was set)
        for key, config in configs.items():
            if getattr(config, "_experts_implementation", None) != before[key]:
                name = "_experts_implementation_internal"  # the property's own field, not its recursive setter
                setattr(config, name if hasattr(config, name) else "_experts_implementation", before[key])
