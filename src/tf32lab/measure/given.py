"""What a run is given, kept and put back: the workload's inputs before each of check's runs (:class:`KeptInputs`),
and the objects a layer's call is given before each of its reruns (:class:`Held`).

A model may write into what it is given: scale its input in place, append to a list or to a cache object
(Hugging Face's ``DynamicCache``), write a static cache's rows. Each of check's runs must start from the inputs as
the caller gave them, and each rerun of a layer from what its call was given; the caller has them so again at the
end. The model's own state (its buffers and attributes) is :mod:`tf32lab.measure.state`'s.

Example:

    >>> import torch
    >>> x = torch.ones(2)
    >>> kept = KeptInputs((x,))
    >>> _ = x.mul_(3)
    >>> kept(), x.tolist()
    (True, [1.0, 1.0])
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from collections.abc import Mapping, MutableMapping
from typing import Any, Callable, Optional

import torch

from tf32lab.measure.state import (
    BITS,
    DEPTH,
    data_attributes,
    kept_contents,
    plain_object,
    put_back_contents,
    random_state,
)
from tf32lab.numbers.trees import is_dataclass_instance, named_tensors

__all__ = ["Held", "KeptInputs", "Narrowed", "inputs_note", "versions"]


def versions(tree: Any) -> list[Optional[int]]:
    """Each tensor's version counter in ``tree`` (how many in-place writes it has had); None for inference tensors.

    >>> x = torch.zeros(2)
    >>> before = versions((x,))
    >>> _ = x.add_(1)
    >>> before, versions((x,))
    ([0], [1])
    """
    # read past the float64 reference's function mode, which answers for the widened copy of an input made
    # under inference mode (not one), whose own counter then raises
    with torch._C.DisableTorchFunction():
        return [None if t.is_inference() else t._version for _, t in named_tensors(tree)]


class KeptInputs:
    """A workload's input tensors as they were; calling it puts back any that a run wrote into (a model that
    scales its input in place, ``x.mul_(2)``: each run saw the last one's result, every row failed for no
    precision reason, and the caller's tensor was changed) and returns whether one had been. A copy of each is
    kept: inputs are small beside a forward's activations, and one made under ``inference_mode`` has no version
    counter to tell a write by. The lists and dicts among the inputs are kept by their entries too (a model that
    appends to a cache it is given: each run saw the last one's entries), and so are the data attributes of the
    other objects among them, as a module's are (a Hugging Face ``DynamicCache`` given as ``past_key_values``:
    each run appended its keys and values, the float64 reference's float64 ones among them, and every row then
    raised "expected scalar type Double but found Float" at the cache's concatenation).

        >>> x = torch.ones(2)
        >>> kept = KeptInputs((x,))
        >>> _ = x.mul_(3)
        >>> kept(), x.tolist()
        (True, [1.0, 1.0])
    """

    def __init__(self, inputs: Any) -> None:
        self._kept = [(t, t.detach().clone()) for t in _plain_tensors(inputs)]
        # the lists and dicts among them, by their entries (a model that appends to a cache it is given)
        self._containers: list[tuple[Any, Any]] = []
        objects: list[Any] = []
        _containers(inputs, self._containers, set(), objects)
        holders: set[int] = set()
        self._objects = [restore for obj in objects for restore in (
            (_drawn(obj),) if random_state(obj) is not None else data_attributes(vars(obj), (), holders))]
        self.written = False

    def __call__(self) -> bool:
        changed = False
        for container, entries in self._containers:
            if isinstance(container, list):
                if len(container) != len(entries) or any(a is not b for a, b in zip(container, entries)):
                    container[:] = entries
                    changed = True
            elif container.keys() != entries.keys() or any(container[k] is not v for k, v in entries.items()):
                container.clear()
                container.update(entries)
                changed = True
        with torch.no_grad():
            for t, copy in self._kept:
                if t.shape != copy.shape or t.dtype != copy.dtype or not _same_bits(t, copy):
                    if t.shape != copy.shape:
                        t.resize_(copy.shape)
                    t.copy_(copy)
                    changed = True
            for restore in self._objects:
                changed = bool(restore()) or changed
        self.written = self.written or changed
        return changed


class Held:
    """The objects among a layer call's arguments (found as :class:`KeptInputs` finds them: a Hugging Face
    ``DynamicCache``) as they were, their attributes kept by reference, not copied; :meth:`put_back` sets them so
    again. A layer's reruns are each given them as the call was, not as it left them (an attention layer appends
    its keys to the cache it is given: its rerun, fed the reference's appended float64 keys, raised "expected
    scalar type Double but found Float"). Kept by reference, a cache costs nothing to keep; a tensor among them
    that the call wrote into in place (a static cache's ``index_copy_``) cannot be put back so: :meth:`written`.

        >>> class Cache:
        ...     def __init__(self):
        ...         self.keys = torch.zeros(1)
        >>> cache = Cache()
        >>> held = Held.among(((torch.ones(1), cache), {}))
        >>> cache.keys = torch.cat((cache.keys, torch.ones(1)))
        >>> held.put_back(), cache.keys.tolist()
        (None, [0.0])
    """

    def __init__(self, objects: list[Any]) -> None:
        self.objects = objects
        # past the float64 reference's function mode (a layer's pre-hook runs under it): it answers is_inference()
        # for a float64 copy of a float32 tensor, not an inference tensor where the cache's keys are one (prefilled
        # under torch.inference_mode()), and their version counter then raised; and each such copy cost a widening
        with torch._C.DisableTorchFunction():
            self._kept = [(obj, _by_reference(obj, 0)) for obj in objects]

    @classmethod
    def among(cls, tree: Any) -> Optional[Held]:
        """The objects among ``tree`` held, or None where it has none (the usual call: tensors alone)."""
        objects: list[Any] = []
        _containers(tree, [], set(), objects)
        return cls(objects) if objects else None

    def written(self) -> bool:
        """Whether a tensor among them, as kept, was written into in place since."""
        with torch._C.DisableTorchFunction():  # as in __init__
            return any(_written_since(kept) for _, kept in self._kept)

    def put_back(self, narrowed: Optional[Narrowed] = None) -> None:
        """Set the objects as kept; with ``narrowed``, their float64 (complex128) tensors as its float32 (complex64)
        copies, as a layer's float32 rerun is given its tensor arguments (a second decoding step's call is given
        the cache the reference appended float64 keys to: its reruns raised at their float32 product with them)."""
        for obj, kept in self._kept:
            _put_back_references(obj, kept, narrowed)


class Narrowed:
    """Float32 (complex64) copies of float64 (complex128) tensors, each made once while it lives: what a layer's
    reruns are given for the float64 tensors among its objects. One for the reference run, not one per call: each
    attention layer's call is given the whole cache, and copies made per call narrowed every earlier layer's keys
    again at every layer (quadratic in the layers, in time and in memory held).

        >>> narrowed, keys = Narrowed(), torch.ones(2, dtype=torch.float64)
        >>> narrowed(keys).dtype, narrowed(keys) is narrowed(keys)
        (torch.float32, True)
    """

    def __init__(self) -> None:
        self._copies: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def __call__(self, value: Any) -> Any:
        if type(value) is tuple:  # a pair of keys and values
            narrowed = tuple(self(item) for item in value)
            return value if all(a is b for a, b in zip(narrowed, value)) else narrowed
        if not isinstance(value, torch.Tensor) or value.dtype not in _NARROWER:
            return value
        key = id(value)
        found = self._copies.get(key)
        if found is not None and found[0]() is value:
            return found[1]
        with torch._C.DisableTorchFunction(), torch.no_grad():
            copy = value.detach().to(_NARROWER[value.dtype])
        # gone with the tensor: a decoding loop's caches replaced step by step are not held in float32 beside
        self._copies[key] = (weakref.ref(value, lambda _, key=key: self._copies.pop(key, None)), copy)
        return copy


_NARROWER = {torch.float64: torch.float32, torch.complex128: torch.complex64}


def _drawn(generator: Any) -> Callable[[], bool]:
    """Puts a random generator's state back as it is now (``torch.Generator``, ``random.Random``, NumPy's); whether
    it had drawn since."""
    state = kept_contents(generator)
    return lambda: put_back_contents(generator, state)


def _by_reference(value: Any, depth: int) -> Any:
    """``value``'s structure with its items by reference (a tensor by its version counter, a random generator by
    its state), a few levels down."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value, None if value.is_inference() else value._version)
    if random_state(value) is not None:
        return ("random", value, kept_contents(value))
    if depth >= DEPTH:
        return None
    if isinstance(value, (list, collections.deque)):  # a deque: a streaming model's ring of past frames
        return ("list", list(value), [_by_reference(item, depth + 1) for item in value])
    if isinstance(value, dict):
        return ("dict", dict(value), {key: _by_reference(item, depth + 1) for key, item in value.items()})
    if isinstance(value, tuple):
        return ("tuple", None, [_by_reference(item, depth + 1) for item in value])
    if plain_object(value):
        attributes = vars(value)
        return ("object", dict(attributes), {key: _by_reference(item, depth + 1) for key, item in attributes.items()})
    return None


def _written_since(kept: Any) -> bool:
    if kept is None:
        return False
    kind, items, inner = kept
    if kind == "tensor":
        return inner is not None and not items.is_inference() and items._version != inner
    if kind == "random":
        return False
    return any(_written_since(k) for k in (inner.values() if isinstance(inner, dict) else inner))


def _put_back_references(value: Any, kept: Any, cast: Optional[Callable[[Any], Any]] = None) -> None:
    if kept is None or kept[0] == "tensor":
        return
    kind, items, inner = kept
    if kind == "random":  # a generator's state, as the call found or left it
        put_back_contents(value, inner)
        return
    if kind == "list":
        wanted = items if cast is None else [cast(item) for item in items]
        if len(value) != len(wanted) or any(a is not b for a, b in zip(value, wanted)):
            if isinstance(value, list):
                value[:] = wanted
            else:  # a deque, its maxlen kept
                value.clear()
                value.extend(wanted)
        pairs = zip(items, inner)
    elif kind in ("dict", "object"):
        held = value if kind == "dict" else vars(value)
        wanted = items if cast is None else {key: cast(item) for key, item in items.items()}
        # set again only where a call changed it (a config or an enum among the arguments is left untouched)
        if held.keys() != wanted.keys() or any(held[key] is not item for key, item in wanted.items()):
            held.clear()
            held.update(wanted)
        pairs = ((items[key], k) for key, k in inner.items())
    else:  # a tuple: its items' contents only
        pairs = zip(value, inner)
    for item, k in pairs:
        _put_back_references(item, k, cast)


def _containers(tree: Any, found: list[tuple[Any, Any]], seen: set[int], objects: list[Any]) -> None:
    # each list and mutable mapping in ``tree`` with a shallow copy of its entries (each container once), and each
    # other object with attributes of its own (not a module: the model's, kept as its state; not code)
    if isinstance(tree, torch.Tensor) or id(tree) in seen:
        return
    if random_state(tree) is not None:  # a generator the model draws from: kept by its state
        seen.add(id(tree))
        objects.append(tree)
        return
    if isinstance(tree, list):
        seen.add(id(tree))
        found.append((tree, list(tree)))
        values: Any = tree
    elif isinstance(tree, MutableMapping):
        seen.add(id(tree))
        found.append((tree, dict(tree)))
        values = list(tree.values())
    elif isinstance(tree, Mapping):
        values = list(tree.values())
    elif isinstance(tree, tuple):
        values = tree
    elif is_dataclass_instance(tree):
        values = [getattr(tree, f.name) for f in dataclasses.fields(tree)]
    else:
        if plain_object(tree):
            seen.add(id(tree))
            objects.append(tree)
        return
    for value in values:
        _containers(value, found, seen, objects)


def _plain_tensors(tree: Any) -> list[torch.Tensor]:
    return [t for _, t in named_tensors(tree) if type(t) in (torch.Tensor, torch.nn.Parameter)
            and t.layout == torch.strided and not t.is_meta and not t.is_nested]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # by bits, not values: NaN is not equal to itself, and -0.0 is equal to 0.0
    # (complex128, 16 bytes an element, as twice as many 8-byte integers)
    size = a.element_size()
    bits = BITS.get(size, torch.int64 if size % 8 == 0 else None)
    if bits is None or a.dtype == torch.bool:
        return torch.equal(a, b)
    return torch.equal(a.detach().contiguous().reshape(-1).view(bits), b.contiguous().reshape(-1).view(bits))


def inputs_note() -> str:
    """What a report says of a model that wrote into its own inputs (:class:`KeptInputs`).

    >>> inputs_note()[:46]
    'the model writes into its inputs as it runs: e'
    """
    return ("the model writes into its inputs as it runs: each run was given them as they were before the check, "
            "and they are so again now")
