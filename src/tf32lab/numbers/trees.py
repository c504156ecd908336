"""Nested inputs and outputs (tensors in tuples, lists, dicts, ``ModelOutput``s, dataclasses): name them, map
over them.

Example:

    >>> import torch
    >>> from tf32lab.numbers import trees
    >>> out = {"logits": torch.zeros(2, 3), "hidden": (torch.ones(2), None)}
    >>> [name for name, _ in trees.named_tensors(out)]
    ['logits', 'hidden.0']
    >>> trees.map_tensors(lambda t: t + 1, out)["hidden"][0].tolist()
    [2.0, 2.0]
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, Callable, Union

import torch

__all__ = ["is_dataclass_instance", "map_tensors", "named_leaves", "named_tensors", "operand_tensors"]


def named_tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in ``tree`` with a dotted name; a bare tensor is named ``output``."""
    if isinstance(tree, torch.Tensor):
        yield (prefix or "output"), tree
    elif isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from named_tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, (tuple, list)):
        for i, value in enumerate(tree):
            yield from named_tensors(value, f"{prefix}.{i}" if prefix else str(i))
    elif is_dataclass_instance(tree):
        yield from named_tensors(_fields(tree), prefix)


def named_leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Like :func:`named_tensors`, but every leaf: tensors, numbers, strings, ``None``."""
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from named_leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, (tuple, list)) and not isinstance(tree, torch.Size):
        for i, value in enumerate(tree):
            yield from named_leaves(value, f"{prefix}.{i}" if prefix else str(i))
    elif is_dataclass_instance(tree):  # compared with ==, a dataclass of tensors raised (no single truth value)
        yield from named_leaves(_fields(tree), prefix)
    else:
        yield (prefix or "output"), tree


def map_tensors(fn: Callable[[Any], Any], tree: Any, types: Union[type, tuple[type, ...]] = torch.Tensor) -> Any:
    """``tree`` with ``fn`` applied to each tensor (each leaf of ``types``); containers rebuilt with their own
    type, the rest kept."""
    if isinstance(tree, types):
        return fn(tree)
    if isinstance(tree, Mapping):
        items = {key: map_tensors(fn, value, types) for key, value in tree.items()}
        try:
            return type(tree)(items)
        except TypeError:  # a mapping type that cannot be built from a dict
            return items
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # namedtuple
        return type(tree)(*(map_tensors(fn, value, types) for value in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(map_tensors(fn, value, types) for value in tree)
    if is_dataclass_instance(tree):
        # a copy with every field mapped, its __init__ and __post_init__ not run again: dataclasses.replace ran a
        # __post_init__ that transforms a field (self.y = self.y * 3) on the mapped value once more, so a layer's
        # kept reference was three times its output; and it gave back the tree unmapped where one refused
        made = copy.copy(tree)
        for f in dataclasses.fields(tree):
            if hasattr(tree, f.name):
                object.__setattr__(made, f.name, map_tensors(fn, getattr(tree, f.name), types))
        return made
    return tree


def is_dataclass_instance(value: Any) -> bool:
    """A dataclass instance, not a dataclass itself (a ``ModelOutput`` is a Mapping, taken as one first).

    >>> import dataclasses
    >>> is_dataclass_instance(dataclasses.make_dataclass("P", ["x"])(1))
    True
    """
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _fields(value: Any) -> dict[str, Any]:
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}


def operand_tensors(args: Any) -> list[torch.Tensor]:
    """The tensors among an op's operands ``args`` (an iterable), inside lists and tuples too: what a dispatch mode
    looks at, cheaper than :func:`named_tensors` (no names, no mappings).

    >>> a = torch.ones(1)
    >>> len(operand_tensors((a, [a, 2], (a,), "x")))
    3
    """
    found = []
    for a in args:
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found += operand_tensors(a)
    return found
