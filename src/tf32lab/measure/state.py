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
from collections.abc import Iterator
from typing import Any, Callable

import torch

__all__ = ["KeptState", "state_kept", "stateful_note"]

# what nn.Module.__init__ sets: hooks, parameters, buffers, submodules, the training flag (eval_mode's)
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
_SCALARS = (int, float, complex, bool, str, bytes, type(None), tuple, torch.dtype, torch.device)
_MISSING = object()


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
    with torch.no_grad():
        for name, buffer in model.named_buffers(remove_duplicate=True):
            if not buffer.is_inference():
                found.append(("", _buffer(name, buffer)))
        for prefix, module in model.named_modules(remove_duplicate=True):
            where = f"{prefix}." if prefix else ""
            if isinstance(module, torch.jit.ScriptModule):
                found += [(where, restore) for restore in _script_attributes(module)]
            else:
                found += [(where, restore) for restore in _attributes(module)]
    return found


def _buffer(name: str, buffer: torch.Tensor) -> Restore:
    value = buffer.detach().clone()

    def restore() -> list[str]:
        if buffer.shape != value.shape or torch.equal(buffer, value):
            return []
        buffer.copy_(value)
        return [name]

    return restore


def _attributes(module: torch.nn.Module) -> Iterator[Restore]:
    """A Python module's data attributes, and the data attributes a run adds (removed again)."""
    held = vars(module)
    before = set(held)
    for key, value in list(held.items()):
        if key not in _MODULE_INTERNALS and _is_data(value):
            yield _attribute(key, value, lambda key=key: held.get(key, _MISSING),
                             lambda value, key=key: held.__setitem__(key, value))

    def added() -> list[str]:
        new = [key for key in held if key not in before and _is_data(held[key])]
        for key in new:
            del held[key]
        return new

    yield added


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


def _contents(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return None if value.is_inference() else (value._version, value.detach().clone())
    if isinstance(value, list):
        return list(value)
    if isinstance(value, dict):
        return dict(value)
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
    if isinstance(value, list):
        if len(value) == len(contents) and all(a is b for a, b in zip(value, contents)):
            return False
        value[:] = contents
        return True
    if value.keys() == contents.keys() and all(value[k] is contents[k] for k in contents):
        return False
    value.clear()
    value.update(contents)
    return True


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
            kept = _contents(value) if isinstance(value, (list, dict)) else value
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
