"""What a model keeps between calls, kept and put back: every run of a check starts from the state the model had.

A model may change as it runs: a buffer it updates in place (a running average, a counter), or an attribute it
sets (a streaming model's hidden state, ``self._state = h``; a cache made at the first call; a call counter).
Silero VAD keeps its LSTM state and audio context in TorchScript attributes, so the same chunk of audio gives
0.0102, then 0.0072, then 0.0089: without putting the state back, each of check's runs (the float64 reference,
then each level) would start where the last one stopped, and compare calls that differ for reasons other than
precision. What is kept:

- every buffer (its values, written back in place);
- every data attribute of every module: a tensor (the same object put back, and its values if they were written
  in place), a number, string, ``None`` or tuple (the same value put back), a list or dict (its items put back in
  the same object); one the run added is removed. Callables and other objects are the model's code and
  configuration, not its state: they are left alone (a policy's pinned ``forward`` among them);
- the attributes of a plain object a module holds that holds nothing but data, as a module's (nflows' and
  normflows' LU layers keep their eval-mode weight and inverse in such a ``_LinearCache``, empty until the first
  call: the float64 reference filled it with float64 tensors, and every float32 row then raised at its product);
- a TorchScript module's attributes likewise (parameters and buffers aside), through
  ``torch._C._jit_debug_module_iterators`` (where a torch lacks it, only the buffers).

Example:

    >>> import torch
    >>> class Counter(torch.nn.Module):
    ...     def forward(self, x):
    ...         self.calls = getattr(self, "calls", 0) + 1
    ...         return x * self.calls
    >>> model = Counter()
    >>> with state_kept(model) as reset:
    ...     first = model(torch.ones(1))
    ...     changed = reset()
    ...     second = model(torch.ones(1))
    >>> first.item() == second.item(), changed, hasattr(model, "calls")
    (True, ['calls'], False)
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Collection, Iterator
from typing import Any, Callable, Optional

import torch
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

__all__ = ["KeptState", "state_kept", "stateful_note"]

# what nn.Module.__init__ sets: hooks, parameters, buffers, submodules, the training flag (eval_mode's)
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
_SCALARS = (int, float, complex, bool, str, bytes, type(None), tuple, torch.dtype, torch.device)
_MISSING = object()
_DEPTH = 3  # how far into lists, dicts and tuples the contents are kept (a list of (h, c) pairs is two levels)


class KeptState:
    """A model's state as it was (:func:`state_kept`); calling it puts the state back now and returns the names
    of what had changed (``"encoder.calls"``; a buffer by its name); ``changed``: every name that ever had."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._kept = _kept(model)
        self.changed: list[str] = []

    def __call__(self) -> list[str]:
        with torch.no_grad():
            found = [where + name for where, restore in self._kept for name in restore()]
        self.changed += [name for name in found if name not in self.changed]
        return found


@contextlib.contextmanager
def state_kept(model: torch.nn.Module) -> Iterator[KeptState]:
    """The model's buffers and data attributes as they were, put back on every exit; yields a
    :class:`KeptState`, which puts them back when called."""
    kept = KeptState(model)
    try:
        yield kept
    finally:
        kept()


Restore = Callable[[], list[str]]  # puts some state back; the names of what had changed


def _kept(model: torch.nn.Module) -> list[tuple[str, Restore]]:
    """(prefix, restore) pairs, one for each piece of the model's state."""
    found: list[tuple[str, Restore]] = []
    copies: dict[int, torch.Tensor] = {}  # a buffer shared by several modules is copied once
    with torch.no_grad():
        holders: set[int] = set()  # a data object several modules hold (a shared config) is kept once
        for prefix, module in model.named_modules(remove_duplicate=True):
            where = f"{prefix}." if prefix else ""
            scripted = isinstance(module, torch.jit.ScriptModule)
            for key, buffer in module._buffers.items():
                if buffer is None or (scripted and buffer.is_inference()):
                    continue
                if not buffer.is_inference() and id(buffer) not in copies:
                    copies[id(buffer)] = buffer.detach().clone()
                found.append((where, _buffer(module, key, buffer, copies.get(id(buffer)), scripted)))
            if scripted:
                found += [(where, restore) for restore in _script_attributes(module)]
            else:
                found += [(where, restore) for restore in _attributes(module, holders)]
    return found


def _buffer(module: torch.nn.Module, key: str, buffer: torch.Tensor, value: Any, scripted: bool) -> Restore:
    """Put back buffer ``key`` of ``module``: the same tensor where the run registered another under its name
    (a rotary embedding's ``inv_freq`` made anew for a longer input), and the values it had (``value``; None for
    an inference tensor, which cannot be written)."""

    def restore() -> list[str]:
        changed = False
        if not scripted and module._buffers.get(key) is not buffer:
            module._buffers[key] = buffer
            changed = True
        if value is not None and buffer.shape == value.shape and not torch.equal(buffer, value):
            buffer.copy_(value)
            changed = True
        return [key] if changed else []

    return restore


def _attributes(module: torch.nn.Module, holders: set[int]) -> Iterator[Restore]:
    """A Python module's data attributes, and the data attributes a run adds (removed again); and those of the
    data objects it holds (``holders``: the ids of those already kept)."""
    yield from _data_attributes(vars(module), _MODULE_INTERNALS | _derived(module), holders)


def _data_attributes(held: dict[str, Any], skip: Collection[str], holders: Optional[set[int]]) -> Iterator[Restore]:
    """The data entries of ``held`` (a module's or a data object's ``__dict__``) but ``skip``, and the ones a run
    adds (removed again); with ``holders``, the attributes of the data objects among them too, one level down."""
    before = set(held)
    for key, value in list(held.items()):
        if key in skip:
            continue
        if _is_data(value):
            yield _attribute(key, value, lambda key=key: held.get(key, _MISSING),
                             lambda value, key=key: held.__setitem__(key, value))
        elif holders is not None and id(value) not in holders and _holds_only_data(value):
            holders.add(id(value))
            yield from (_named(key, restore) for restore in _data_attributes(vars(value), (), None))

    def added() -> list[str]:
        new = [key for key in held if key not in before and key not in skip and _is_data(held[key])]
        for key in new:
            del held[key]
        return new

    yield added


def _holds_only_data(value: Any) -> bool:
    """A plain object (not a module, class or function) whose attributes are all data: a cache such as nflows'
    ``_LinearCache``, not an object with parts of its own (a Lightning trainer, a gpytorch prediction strategy)."""
    if isinstance(value, (torch.nn.Module, type, types.ModuleType)) or callable(value):
        return False
    attributes = getattr(value, "__dict__", None)
    return isinstance(attributes, dict) and bool(attributes) and all(map(_is_data, attributes.values()))


def _named(key: str, restore: Restore) -> Restore:
    """``restore`` with the names it returns under ``key``: ``cache.weight``."""
    return lambda: [f"{key}.{name}" for name in restore()]


def _derived(module: torch.nn.Module) -> set[str]:
    """The attributes a forward pre-hook makes anew from the parameters before every call, not state: the
    ``weight`` of ``torch.nn.utils.weight_norm`` and ``spectral_norm`` (their ``u`` and ``v`` are buffers)."""
    return {hook.name for hook in module._forward_pre_hooks.values() if isinstance(hook, (WeightNorm, SpectralNorm))}


def _is_data(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, *_SCALARS, list, dict)) and not isinstance(value, torch.nn.Parameter)


def _attribute(key: str, value: Any, get: Callable[[], Any], put: Callable[[Any], None]) -> Restore:
    """Put back attribute ``key``'s ``value`` (``get`` reads it, ``put`` writes it): the same object, and its
    contents where it is a tensor, list or dict."""
    contents = _contents(value)

    def restore() -> list[str]:
        changed = not _same(get(), value)
        if changed:
            put(value)
        return [key] if _put_back(value, contents) or changed else []

    return restore


def _same(a: Any, b: Any) -> bool:
    """The same object, or an equal value: TorchScript hands out a new int, list or dict at each read (the same
    tensor, though); a tensor is compared by identity (its values by its version counter, elsewhere)."""
    if a is b:
        return True
    if type(a) is not type(b) or isinstance(a, torch.Tensor):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return isinstance(a, _SCALARS) and a == b


def _contents(value: Any, depth: int = 0) -> Any:
    """What :func:`_put_back` needs to put ``value``'s contents back: a tensor's version and values, a list's or
    dict's items, and the contents of the items of a list, dict or tuple (a list of tensors updated in place:
    ``self.state[0].add_(h)``), a few levels down."""
    if isinstance(value, torch.Tensor):
        return None if value.is_inference() else (value._version, value.detach().clone())
    if depth >= _DEPTH:
        return None
    if isinstance(value, list):
        return list(value), [_contents(item, depth + 1) for item in value]
    if isinstance(value, dict):
        return dict(value), {key: _contents(item, depth + 1) for key, item in value.items()}
    if isinstance(value, tuple):
        inner = [_contents(item, depth + 1) for item in value]
        return inner if any(c is not None for c in inner) else None
    return None


def _put_back(value: Any, contents: Any) -> bool:
    """``value``'s contents as :func:`_contents` kept them; whether they had changed."""
    if contents is None:
        return False
    if isinstance(value, torch.Tensor):
        version, copy = contents
        if value._version == version or value.shape != copy.shape:
            return False
        value.copy_(copy)
        return True
    if isinstance(value, tuple):
        return _inner_put_back(value, contents)
    items, inner = contents
    if isinstance(value, list):
        changed = not (len(value) == len(items) and all(a is b for a, b in zip(value, items)))
        if changed:
            value[:] = items
        return _inner_put_back(items, inner) or changed
    changed = not (value.keys() == items.keys() and all(value[k] is items[k] for k in items))
    if changed:
        value.clear()
        value.update(items)
    return _inner_put_back(list(items.values()), list(inner.values())) or changed


def _inner_put_back(items: Any, inner: list[Any]) -> bool:
    """The contents of each of ``items`` put back; whether any had changed (each one put back, not only the
    first changed)."""
    return any([_put_back(item, kept) for item, kept in zip(items, inner)])


def _script_attributes(module: torch.jit.ScriptModule) -> Iterator[Restore]:
    """A TorchScript module's own data attributes (not its submodules, parameters or buffers)."""
    iterators = getattr(torch._C, "_jit_debug_module_iterators", None)
    if iterators is None:
        return
    found = iterators(module._c)
    skip = {name for name, _ in found["named_parameters"]} | {name for name, _ in found["named_buffers"]}
    skip |= {name for name, _ in found["named_children"]} | {"training"}
    for name, value in found["named_attributes"]:
        if name not in skip and _is_data(value):
            # a list or dict read from TorchScript is a copy: its kept contents are compared, and set back whole
            kept = list(value) if isinstance(value, list) else dict(value) if isinstance(value, dict) else value
            yield _attribute(name, kept, lambda name=name: module._c.getattr(name),
                             lambda value, name=name: module._c.setattr(name, value))


def stateful_note(changed: list[str]) -> str:
    """What a report says of a model whose state changed as it ran (``changed``: what :func:`state_kept`'s
    ``reset()`` put back).

    >>> stateful_note(["_state", "_context"])[:66]
    'the model keeps state between calls (_state, _context changed as i'
    """
    shown = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
    return (f"the model keeps state between calls ({shown} changed as it ran): every run started from the state it "
            f"had before the check, which it has again now")
