"""Which cuDNN conv maths a tune weighs for a model, and a policy that sets the one its answer needs.

cuDNN's float32 convolution math (``torch.backends.cudnn.conv.fp32_precision``) is no level's: a tune either
searches under a math it is given or, for a forward workload, under both. Both tunes (``decide.tune`` and
``decide.tune_training``) ask here whether the math matters for a model at all, and write it into their answers.

Example:

    >>> import torch
    >>> from tf32lab.know.targets import get
    >>> from tf32lab.decide.conv_maths import conv_matters
    >>> conv_matters(torch.nn.Conv1d(2, 2, 3), get("a100")), conv_matters(torch.nn.Linear(2, 2), get("a100"))
    (True, False)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import torch

from tf32lab.control.policy import Policy
from tf32lab.know.levels import with_conv
from tf32lab.know.targets import CUDNN_CELL, Target, cudnn_cell

__all__ = ["IEEE_CONV_FLAGS", "conv_matters", "families_matter", "with_conv_math"]

# what a user sets for IEEE convolutions (and cuDNN's RNNs, which the legacy flag covers too), as advice names it
IEEE_CONV_FLAGS = ("`torch.backends.cudnn.allow_tf32 = False` (on torch 2.9 and later, "
                   "`torch.backends.cudnn.conv.fp32_precision = \"ieee\"` and "
                   "`...cudnn.rnn.fp32_precision = \"ieee\"`)")


def conv_matters(model: torch.nn.Module, target: Target) -> bool:
    """Whether ``model`` has cuDNN modules (convolutions, RNNs) that ``target`` computes differently at TF32 and
    IEEE convolutions (none where cuDNN is off). Functional convolutions outside modules are not looked for."""
    kinds = {"conv": torch.nn.modules.conv._ConvNd, "rnn": torch.nn.RNNBase}
    found = [family for family, kind in kinds.items() if any(isinstance(m, kind) for m in model.modules())]
    return families_matter(found, target)


def families_matter(families: Iterable[str], target: Target) -> bool:
    """Whether any of the cuDNN ``families`` (``"conv"``, ``"rnn"``) computes differently at TF32 and IEEE
    convolutions on ``target`` (none where cuDNN is off)."""
    cells = {CUDNN_CELL: cudnn_cell()}  # cuDNN off: the conv flag sets nothing
    return any(target.math(f, with_conv(cells, "tf32")) != target.math(f, with_conv(cells, "ieee"))
               for f in families)


def with_conv_math(policy: Optional[Policy], conv: str) -> Optional[Policy]:
    """``policy`` setting cuDNN's ``conv`` math for the model where it names none: a policy file that sets the
    flag it was found under."""
    if policy is None or policy.conv is not None:
        return policy
    return Policy(default=policy.default, rules=policy.rules, conv=conv)
