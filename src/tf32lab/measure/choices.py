"""The discrete choices a model makes (the indices of ``topk``, ``argmax``, ``sort`` and their kin): the float64
reference's against a row's, so that a report can say how many TF32 changed, not only that the error jumped where
a choice is made (an expert router's top-k, a beam's argmax).

The reference keeps the indices of each choice op as it runs (:meth:`Kept.keep`, told by its dispatch mode: no
mode of its own), up to :data:`BUDGET` elements; a row that follows a reference with choices runs under a
:class:`ChoiceLog` and is compared one op for one, in order (:func:`compared`). A top-k is compared as a set of
indices along its dim (two near-tied experts in the other order route alike); an argmax, a sort, a max along a dim
position by position.

Example:

    >>> import torch
    >>> kept = Kept()
    >>> scores = torch.tensor([[1.0, 3.0, 2.0], [5.0, 4.0, 0.0]])
    >>> kept.keep(torch.ops.aten.argmax.default, (scores, 1), {}, scores.argmax(1))
    >>> with ChoiceLog() as row:
    ...     _ = torch.tensor([[1.0, 3.0, 2.0], [4.0, 5.0, 0.0]]).argmax(1)
    >>> compared(kept.choices, row.choices)
    Choices(changed=1, made=2, ops=('aten::argmax',), comparable=True)
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tf32lab.control import modestack

__all__ = ["BUDGET", "CHOICE_OPS", "ChoiceLog", "Choices", "Kept", "compared", "indices_of", "op_name"]

aten = torch.ops.aten
# (values, indices): max.dim; a median's or mode's index along a dim, and a running max's, are choices too
_PAIRED = frozenset((aten.topk, aten.sort, aten.max, aten.min, aten.kthvalue, aten.median, aten.nanmedian, aten.mode,
                     aten.cummax, aten.cummin))
_BARE = frozenset((aten.argmax, aten.argmin, aten.argsort))  # the indices alone
CHOICE_OPS = _PAIRED | _BARE
BUDGET = 1 << 22  # indices kept at most (32 MiB of int64): a model that sorts more is compared on the first ones


def indices_of(func: Any, args: tuple, kwargs: dict, out: Any) -> Optional[torch.Tensor]:
    """The indices a choice op chose, as compared (a top-k's sorted along its dim: a set), or None where ``func``
    chose none (a ``max`` over everything returns a value, not an index)."""
    packet = func.overloadpacket
    if packet in _BARE:
        found = out
    elif packet in _PAIRED and isinstance(out, (tuple, list)) and len(out) == 2:
        found = out[1]
    else:  # max/min over everything or of two tensors (max.other): a value, even of integers, not an index
        return None
    if not isinstance(found, torch.Tensor) or found.is_floating_point() or found.is_complex():
        return None
    if packet is aten.topk:
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        found = found.sort(dim=dim).values if found.dim() else found
    return found


def op_name(func: Any) -> str:
    """The name a choice is compared under: its op's without the overload (the reference may run ``sort.stable``
    where a row runs ``sort``), an argsort's a sort's (the reference's mode may see it decomposed into one)."""
    name = func.name().split(".")[0]
    return "aten::sort" if name == "aten::argsort" else name


class Kept:
    """The reference's choices, in order: ``(op, indices)``, within :data:`BUDGET` elements (``full``: some were
    left out)."""

    def __init__(self) -> None:
        self.choices: list[tuple[str, torch.Tensor]] = []
        self.elements = 0
        self.full = False

    def keep(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if self.full:
            return
        found = indices_of(func, args, kwargs, out)
        if found is None:
            return
        if self.elements + found.numel() > BUDGET:
            self.full = True
            return
        self.elements += found.numel()
        self.choices.append((op_name(func), found.detach().clone()))


@modestack.skips_dynamo_lazily
class ChoiceLog(TorchDispatchMode):
    """A row's choices, in order, as :class:`Kept` keeps the reference's (no budget: a row stops comparing where
    the reference's end)."""

    def __init__(self, limit: Optional[int] = None) -> None:
        super().__init__()
        self.choices: list[tuple[str, torch.Tensor]] = []
        self.limit = limit
        self.more = False  # a choice op past ``limit`` ran: the row made more than it kept

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.overloadpacket in CHOICE_OPS and not self.more:
            found = indices_of(func, args, kwargs, out)
            if found is not None and self.limit is not None and len(self.choices) >= self.limit:
                self.more = True
            elif found is not None:
                self.choices.append((op_name(func), found.detach().clone()))
        return out


class Choices(NamedTuple):
    """How a row's choices compare with the reference's: ``changed`` of the ``made`` indices differ, over the choice
    ops named in ``ops``; ``comparable`` False where the row made other choice ops (another op, count or shape:
    control flow that depends on the values), compared up to there."""

    changed: int
    made: int
    ops: tuple[str, ...]
    comparable: bool

    def to_dict(self) -> dict[str, Any]:
        return {"changed": self.changed, "made": self.made, "ops": list(self.ops), "comparable": self.comparable}


def compared(reference: list[tuple[str, torch.Tensor]], row: list[tuple[str, torch.Tensor]],
             more: bool = False) -> Optional[Choices]:
    """The row's choices against the reference's, one op for one in order; None where the reference made none.
    ``more``: the row made more choice ops than ``row`` holds (its log's limit, the reference's count), where the
    reference kept all of its own."""
    if not reference:
        return None
    changed = made = 0
    ops: list[str] = []
    comparable = len(reference) == len(row) and not more
    for (name, ours), (other, theirs) in zip(reference, row):
        if name != other or ours.shape != theirs.shape:
            comparable = False
            break
        made += ours.numel()
        differ = int((ours.to(theirs.device) != theirs).sum())
        changed += differ
        if differ and name not in ops:
            ops.append(name)
    return Choices(changed, made, tuple(ops), comparable)
