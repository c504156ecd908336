"""A tensor's elements as they lie in memory: one flat view where they fill a span of it with no gap and no overlap
(contiguous, channels-last, a transposed matrix), so that one pass reads them without a copy, and a tensor of the
same strides over those elements is the tensor again.

Example:

    >>> import torch
    >>> from tf32lab.numbers.layout import memory_order
    >>> x = torch.arange(6.0).view(2, 3).t()
    >>> memory_order(x).tolist(), memory_order(torch.arange(6.0)[::2]) is None
    ([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], True)
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["memory_order"]


def memory_order(t: torch.Tensor) -> Optional[torch.Tensor]:
    """``t``'s elements flat, as they lie in memory (a view, detached), where they fill a span of it with no gap
    and no overlap; None otherwise. Its dims ordered by stride, such a tensor is contiguous."""
    lying = t.detach().permute(sorted(range(t.dim()), key=lambda d: -t.stride(d)))
    return lying.view(-1) if lying.is_contiguous() else None
