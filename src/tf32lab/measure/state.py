"""What a model keeps between calls, kept and put back: every run of a check starts from the state the model had.

A model may change as it runs: a buffer it updates in place (a running average, a counter), or an attribute it
sets (a streaming model's hidden state, ``self._state = h``; a cache made at the first call; a call counter).
Silero VAD keeps its LSTM state and audio context in TorchScript attributes, so the same chunk of audio gives
0.0102, then 0.0072, then 0.0089: without putting the state back, each of check's runs (the float64 reference,
then each level) would start where the last one stopped, and compare calls that differ for reasons other than
precision. What is kept:

- every buffer (its values, written back in place; whole where a run gave it another shape or dtype), and which
  buffers there are (one a run registered is removed, one registered as None is None again); a buffer or tensor
  attribute a run replaced by a float64 copy of itself (``self.mask = self.mask.to(x.device)``, which the float64
  reference's ops widen) is put back but not called state: the float32 runs keep the very same tensor;
- every module's ``training`` flag, its forward and backward hooks (one a run registers is removed), and its
  submodules and parameters as the same objects: one a run made or
  replaced is removed, the one it replaced put back (a submodule made at the first call is made in the float64
  reference run, in float64); the parameters not where FSDP manages them (it swaps them itself);
- every data attribute of every module: a tensor (the same object put back, and its values if they were written
  in place or it was given another, ``.data = ...``), a number, string, ``None`` or tuple (the same value put
  back), a list, deque, set, dict or dataclass (its items put back in the same object), a random generator
  (``torch.Generator``, NumPy's, ``random.Random``: its state put back); one the run added is removed.
  Callables and other objects are the model's code and configuration, not its state: they are left alone (a
  policy's pinned ``forward`` among them);
- the attributes of a plain object a module holds that holds nothing but data, as a module's (nflows' and
  normflows' LU layers keep their eval-mode weight and inverse in such a ``_LinearCache``, empty until the first
  call: the float64 reference filled it with float64 tensors, and every float32 row then raised at its product);
  such objects and dataclasses (slotted ones too) inside lists, dicts and each other are kept likewise, up to
  eight levels down (a per-layer cache object in a list, a list of dicts of lists of tensors);
- not the parameters' values (a copy would double the model's memory), nor those of one of them a list holds (an
  LSTM's ``_flat_weights``, which copied doubled its weights in a check), but a copy of each parameter the float64
  reference is about to write into (:meth:`KeptState.before_write`: RWKV's eval-mode rescaling, an EMA in
  forward), taken then and put back after every run; a write into another, seen by its version counter (or, for a
  write through ``.data``, by a sum of its bits: whole, or at both ends of a large one), is said
  (``KeptState.written``, :func:`written_note`), not undone; but a parameter converted to another dtype
  (``self.to(X)`` in a forward, float64 in the reference run) is given its own tensor back. A parameter the model
  does not register (one in a plain list, not a ``ParameterList``) has no version counter watched: it is kept and
  put back as any tensor attribute is;
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

import collections
import contextlib
import dataclasses
import random
import sys
import types
from collections.abc import Collection, Iterator
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from tf32lab.numbers.trees import is_dataclass_instance
from tf32lab.report.conclusion import WRITES_PARAMETERS

__all__ = ["BITS", "DEPTH", "KeptState", "data_attributes", "kept_contents", "plain_object", "put_back_contents",
           "random_state", "state_kept", "stateful_note", "written_note"]

# what nn.Module.__init__ sets: hooks, parameters, buffers, submodules, the training flag (eval_mode's)
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
_SCALARS = (int, float, complex, bool, str, bytes, type(None), tuple, torch.dtype, torch.device)
_MISSING = object()
# how far into lists, dicts, tuples and data objects the contents are kept (a list of (h, c) pairs is two levels;
# a list of per-layer dicts of lists of tensors four); it also ends a structure that holds itself
DEPTH = 8


class KeptState:
    """A model's state as it was (:func:`state_kept`); calling it puts the state back now and returns the names
    of what had changed (``"encoder.calls"``; a buffer by its name); ``changed``: every name that ever had."""

    def __init__(self, model: torch.nn.Module, parameters: bool = True) -> None:
        self._kept = _kept(model)
        self.changed: list[str] = []
        # the parameters' values are not copied (that would double the model's memory): a write into one is seen
        # by its version counter or, where it went through ``.data`` (which has a counter of its own: an EMA's
        # ``p.data.mul_(decay)``), by a digest of its bits; and said (``written``), not undone. Not watched where
        # the caller says nothing of them (``parameters=False``: a layer's rerun, inside a check whose own
        # KeptState over the whole model sees such a write at its next reset)
        parameters = [(name, p) for name, p in model.named_parameters() if not p.is_inference()] if parameters \
            else []
        self._versions = [(name, p, p._version, digest)
                          for (name, p), digest in zip(parameters, _digests([p for _, p in parameters]))]
        # each parameter's tensor as it was (an alias, no copy): one converted to another dtype as it ran, such as
        # botorch's acquisition functions' ``self.to(X)``, which in the float64 reference made the model's
        # parameters float64, is given it back
        self._originals = [p.detach() for _, p in parameters]
        self._written: list[str] = []
        self._put_back: set[int] = set()  # parameters given their values back (a dtype, a copy): not written if equal
        # copy-on-write: a parameter the reference run is about to write into (RWKV's eval-mode rescaling, an EMA in
        # forward), copied then and put back after every run; the rest are never copied
        self._copies: dict[int, torch.Tensor] = {}
        self._storages: Optional[dict[int, int]] = None

    def before_write(self, tensors: list[torch.Tensor]) -> None:
        """Told of the tensors an op is about to write into (``Float64Run``'s ``on_write``): a watched parameter
        among them (or a view of it, ``.data`` included) is copied once, before its first write."""
        if not self._versions:
            return
        if self._storages is None:
            self._storages = {}
            for i, (_, parameter, _, _) in enumerate(self._versions):
                address = _storage(parameter)
                if address is not None:
                    self._storages.setdefault(address, i)
        for t in tensors:
            i = self._storages.get(_storage(t))
            if i is not None and i not in self._copies:
                self._copies[i] = self._versions[i][1].detach().clone()

    def __enter__(self) -> KeptState:
        return self

    def __exit__(self, *exc: object) -> None:
        self()  # put back on every exit: one snapshot serves several runs in turn (a layer's rerun at each level)

    def __call__(self) -> list[str]:
        with torch.no_grad():
            found = [where + name for where, restore in self._kept for name in restore()]
            converted = set()
            for i, ((name, parameter, _, _), original) in enumerate(zip(self._versions, self._originals)):
                if parameter.dtype != original.dtype:
                    parameter.data = original
                    converted.add(i)
                    found.append(name)
                copy = self._copies.get(i)
                if copy is not None and not torch.equal(parameter.detach(), copy):
                    parameter.detach().copy_(copy)  # its values before the reference wrote: put back
                    found.append(name)
        self.changed += [name for name in found if name not in self.changed]
        self._put_back |= converted | set(self._copies)
        return found

    @property
    def written(self) -> list[str]:
        """The parameters written since the state was kept, and not put back: read off their version counters and
        digests when asked (a check asks once, after its last run), not at every reset (each digest reads every
        parameter: 5 ms on all-MiniLM-L6-v2, four times a check)."""
        if self._versions:
            digests = _digests([parameter for _, parameter, _, _ in self._versions])
            for i, ((name, parameter, version, digest), now) in enumerate(zip(self._versions, digests)):
                if i in self._put_back and digest == now:  # its values as they were: put back
                    self._versions[i] = (name, parameter, parameter._version, now)
                    continue
                if parameter._version != version or digest != now:
                    self._versions[i] = (name, parameter, parameter._version, now)
                    if name not in self._written:
                        self._written.append(name)
        return self._written


def _storage(t: torch.Tensor) -> Optional[int]:
    try:
        return t.untyped_storage().data_ptr() if t.device.type != "meta" else None
    except (RuntimeError, NotImplementedError):  # a wrapper subclass (DTensor): no storage of its own
        return None


BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # an element's bits as an integer
# elements: a parameter up to twice this is summed whole, a larger one over this many at each end. Summed whole,
# every page of every parameter was read at every row where a forward reads only the rows of an embedding it looks
# up: all-MiniLM-L6-v2's word embeddings, mapped from their file, then took 41 MiB more of the check's memory
_ENDS = 1 << 18


def _digests(tensors: list[torch.Tensor]) -> list[Optional[int]]:
    """The sum of each tensor's bits, read as integers of its elements' width and wrapping (no copy; one transfer
    per device), over the whole tensor or, past ``2 * _ENDS`` elements, over each end: a write into the whole
    tensor (an EMA's) or into either end changes it but for a collision. None where a tensor has no plain values
    (meta, sparse, nested, a wrapper)."""
    sums: list[Optional[torch.Tensor]] = []
    with torch.no_grad():
        for t in tensors:
            bits = BITS.get(t.element_size())
            try:
                usable = bits is not None and t.layout == torch.strided and not t.is_nested and not t.is_meta \
                    and type(t) in (torch.Tensor, torch.nn.Parameter)
                sums.append(_digest(t.detach().view(bits)) if usable else None)
            except (RuntimeError, TypeError, NotImplementedError):
                sums.append(None)
    found: list[Optional[int]] = [None] * len(sums)
    for device in {s.device for s in sums if s is not None}:
        where = [i for i, s in enumerate(sums) if s is not None and s.device == device]
        for i, value in zip(where, torch.stack([sums[i].to(torch.int64) for i in where]).tolist()):
            found[i] = value
    return found


def _digest(bits: torch.Tensor) -> torch.Tensor:
    # summed in the elements' own width, wrapping: a digest all the same (a sum modulo 2^n, in any order), and
    # vectorised, where an int32 tensor summed into int64 takes 20x as long (0.66 s for all-MiniLM-L6-v2's 22M
    # weights on one thread, at every row)
    if bits.numel() <= 2 * _ENDS or not bits.is_contiguous():
        return bits.sum(dtype=bits.dtype)
    flat = bits.reshape(-1)
    return torch.stack((flat[:_ENDS].sum(dtype=bits.dtype), flat[-_ENDS:].sum(dtype=bits.dtype))).sum(dtype=bits.dtype)


@contextlib.contextmanager
def state_kept(model: torch.nn.Module, parameters: bool = True) -> Iterator[KeptState]:
    """The model's buffers and data attributes as they were, put back on every exit; yields a
    :class:`KeptState`, which puts them back when called (``parameters``: writes into the parameters watched too)."""
    kept = KeptState(model, parameters)
    try:
        yield kept
    finally:
        kept()


Restore = Callable[[], list[str]]  # puts some state back; the names of what had changed


def _kept(model: torch.nn.Module) -> list[tuple[str, Restore]]:
    """(prefix, restore) pairs, one for each piece of the model's state."""
    found: list[tuple[str, Restore]] = []
    copies: dict[int, torch.Tensor] = {}  # a buffer shared by several modules is copied once
    sharded = _fsdp(model)
    weights = frozenset(id(p) for p in model.parameters())  # watched by KeptState, not copied
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
                found += [(where, restore) for restore in _script_attributes(module, weights)]
            else:
                found += [(where, _members(module._modules)), (where, _mode(module)), (where, _hooks(module)),
                          (where, _buffer_names(module._buffers))]
                if not sharded:  # FSDP swaps a module's parameters for their unsharded ones, and back, itself
                    found.append((where, _members(module._parameters)))
                found += [(where, restore) for restore in _attributes(module, holders, weights)]
    return found


def _fsdp(model: torch.nn.Module) -> bool:
    """Whether FSDP (``fully_shard``, ``FullyShardedDataParallel``) manages some of ``model``'s parameters (not
    imported here where the model's code has not)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    kinds = tuple(k for k in (getattr(fsdp, "FSDPModule", None), getattr(fsdp, "FullyShardedDataParallel", None))
                  if k is not None)
    return bool(kinds) and any(isinstance(module, kinds) for module in model.modules())


def _members(held: dict[str, Any]) -> Restore:
    """Put back a module's submodules or parameters (``_modules``, ``_parameters``) as the same objects: one made
    or replaced as it runs (``self.cache = nn.Linear(...)`` at the first call, made in float64 in the reference
    run) is removed, the one it replaced put back."""
    items = dict(held)

    def restore() -> list[str]:
        changed = [k for k in {**held, **items} if held.get(k, _MISSING) is not items.get(k, _MISSING)]
        if changed:
            held.clear()
            held.update(items)
        return changed

    return restore


# a module's forward and backward hooks (the state-dict hooks are no run's business)
_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
          "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks")


def _hooks(module: torch.nn.Module) -> Restore:
    """Put back a module's forward and backward hooks: one a run registers is removed (one it removes, put back).
    transformers 5 installs its output-capturing hooks at a model's first call and marks the model with an
    attribute; with the mark put back and the hooks left, every later row installed them again and captured each
    hidden state twice."""
    held = {name: dict(getattr(module, name)) for name in _HOOKS if isinstance(getattr(module, name, None), dict)}

    def restore() -> list[str]:
        changed = False
        for name, items in held.items():
            now = getattr(module, name)
            if len(now) != len(items) or any(items.get(k, _MISSING) is not v for k, v in now.items()):
                now.clear()
                now.update(items)
                changed = True
        return ["hooks"] if changed else []

    return restore


def _mode(module: torch.nn.Module) -> Restore:
    """Put back a module's ``training`` flag: a model that turns a dropout on as it runs had every later row
    run with it on (check's eval mode is put back only at its end)."""
    training = module.training

    def restore() -> list[str]:
        if module.training == training:
            return []
        module.training = training
        return ["training"]

    return restore


def _buffer(module: torch.nn.Module, key: str, buffer: torch.Tensor, value: Any, scripted: bool) -> Restore:
    """Put back buffer ``key`` of ``module``: the same tensor where the run registered another under its name
    (a rotary embedding's ``inv_freq`` made anew for a longer input), and the values it had (``value``; None for
    an inference tensor, which cannot be written)."""

    def restore() -> list[str]:
        changed = False
        # a scripted module's buffers are its own (TorchScript's _buffers is a wrapper, without .get())
        now = buffer if scripted else module._buffers.get(key)
        if now is not buffer:
            module._buffers[key] = buffer
            changed = not _widened(now, buffer if value is None else value)
        return [key] if _values_put_back(buffer, value) or changed else []

    return restore


def _buffer_names(held: dict[str, Optional[torch.Tensor]]) -> Restore:
    """Put back which buffers a module has: one a run registered under a new name is removed, and one registered
    as None is None again (botorch's ``MCSampler`` draws its ``base_samples`` at the first call into a buffer
    registered as None: the float64 reference's draw was kept, every row drew nothing and multiplied by float64
    samples, and a layer's rerun raised "expected m1 and m2 to have the same dtype"). The tensors a module had
    are :func:`_buffer`'s."""
    empty = {key for key, buffer in held.items() if buffer is None}
    names = set(held)

    def restore() -> list[str]:
        changed = [key for key in held if key not in names or (key in empty and held[key] is not None)]
        for key in changed:
            if key in names:
                held[key] = None
            else:
                del held[key]
        return changed

    return restore


def _values_put_back(tensor: torch.Tensor, value: Optional[torch.Tensor]) -> bool:
    """``value``'s values (a copy) in ``tensor``; whether they had changed. Another shape or dtype (``resize_``, or
    ``.data`` set to another tensor: in the reference run a float64 one) is put back whole; a meta tensor has no
    values to compare."""
    if value is None:
        return False
    same = _signature(tensor) == _signature(value)
    if same and _equal(tensor, value):
        return False
    if same and tensor.layout == torch.strided and not tensor.is_nested:
        tensor.copy_(value)
    else:
        tensor.data = value.clone()
    return True


def _signature(t: torch.Tensor) -> tuple:
    """What must agree for one tensor's values to be copied into another (a nested tensor has no shape)."""
    return t.layout, t.dtype, t.device, t.is_nested, None if t.is_nested else t.shape


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal`` of two tensors of one :func:`_signature`, for any layout (it has no sparse or nested kernel);
    meta tensors have no values."""
    if a.is_meta:
        return True
    if a.is_nested:
        return a.size(0) == b.size(0) and all(torch.equal(x, y) for x, y in zip(a.unbind(), b.unbind()))
    if a.layout != torch.strided:
        return torch.equal(a.to_dense(), b.to_dense())
    return torch.equal(a, b)


def _attributes(module: torch.nn.Module, holders: set[int], weights: Collection[int]) -> Iterator[Restore]:
    """A Python module's data attributes, and the data attributes a run adds (removed again); and those of the
    data objects it holds (``holders``: the ids of those already kept)."""
    yield from data_attributes(vars(module), _MODULE_INTERNALS | _derived(module), holders, weights)


def data_attributes(held: dict[str, Any], skip: Collection[str], holders: Optional[set[int]],
                    weights: Collection[int] = frozenset()) -> Iterator[Restore]:
    """The data entries of ``held`` (a module's or a data object's ``__dict__``) but ``skip``, and the ones a run
    adds (removed again); with ``holders``, the attributes of the data objects among them too, one level down
    (``weights``: :func:`kept_contents`'s)."""
    before = set(held)
    for key, value in list(held.items()):
        if key in skip:
            continue
        if _is_data(value) or (holders is None and _holds_only_data(value)):  # a data object in a data object
            yield _attribute(key, value, lambda key=key: held.get(key, _MISSING),
                             lambda value, key=key: held.__setitem__(key, value), weights)
        elif holders is not None and id(value) not in holders and _holds_only_data(value):
            holders.add(id(value))
            yield from (_named(key, restore) for restore in data_attributes(vars(value), (), None, weights))

    def added() -> list[str]:
        new = [key for key in held if key not in before and key not in skip and _is_data(held[key])]
        for key in new:
            del held[key]
        return new

    yield added


def plain_object(value: Any) -> bool:
    """Whether ``value`` is an object with attributes of its own (a ``__dict__``), not a module, class, function or
    other callable: its attributes are data, not code."""
    return isinstance(getattr(value, "__dict__", None), dict) and not callable(value) and \
        not isinstance(value, (torch.nn.Module, type, types.ModuleType))


def _holds_only_data(value: Any, depth: int = 0) -> bool:
    """A plain object (:func:`plain_object`) whose attributes are all data, or such objects in turn: a cache such
    as nflows' ``_LinearCache``, not an object with parts of its own (a Lightning trainer, a gpytorch prediction
    strategy)."""
    return depth < DEPTH and plain_object(value) and bool(vars(value)) and \
        all(_is_data(v) or _holds_only_data(v, depth + 1) for v in vars(value).values())


def _named(key: str, restore: Restore) -> Restore:
    """``restore`` with the names it returns under ``key``: ``cache.weight``."""
    return lambda: [f"{key}.{name}" for name in restore()]


def _derived(module: torch.nn.Module) -> set[str]:
    """The attributes a forward pre-hook makes anew from the parameters before every call, not state: the
    ``weight`` of ``torch.nn.utils.weight_norm`` and ``spectral_norm`` (their ``u`` and ``v`` are buffers)."""
    return {hook.name for hook in module._forward_pre_hooks.values() if isinstance(hook, (WeightNorm, SpectralNorm))}


def _is_data(value: Any) -> bool:
    if isinstance(value, torch.nn.Parameter):
        return False
    return isinstance(value, (torch.Tensor, np.ndarray, *_SCALARS, list, dict, collections.deque, set)) or \
        random_state(value) is not None or is_dataclass_instance(value)


class _Fields:
    """The kept contents of a data object (a dataclass, or a plain object of data: :func:`_holds_only_data`), as
    found when kept: its ``__dict__``'s, or a slotted dataclass's fields (``slots=True``: no ``__dict__``)."""

    def __init__(self, value: Any, depth: int, weights: Collection[int]) -> None:
        self.slotted = not hasattr(value, "__dict__")
        held = {f.name: getattr(value, f.name, _MISSING) for f in dataclasses.fields(value)} if self.slotted \
            else vars(value)
        self.contents = kept_contents(held, depth, weights)

    def put_back(self, value: Any) -> bool:
        if not self.slotted:
            return put_back_contents(vars(value), self.contents)
        items, inner = self.contents
        changed = [key for key, item in items.items() if getattr(value, key, _MISSING) is not item]
        for key in changed:  # object's own: a frozen dataclass's fields too
            if items[key] is _MISSING:
                object.__delattr__(value, key)
            else:
                object.__setattr__(value, key, items[key])
        return _inner_put_back(list(items.values()), list(inner.values())) or bool(changed)


def random_state(value: Any) -> Optional[tuple[Callable[[], Any], Callable[[Any], None]]]:
    """How to read and set the state of a random generator a module holds (``torch.Generator``, NumPy's
    ``Generator`` and ``RandomState``, ``random.Random``): each run draws from where the check started."""
    if isinstance(value, torch.Generator):
        return value.get_state, value.set_state
    if isinstance(value, random.Random):
        return value.getstate, value.setstate
    if type(value).__module__.startswith("numpy.random"):
        if hasattr(value, "bit_generator"):  # numpy.random.Generator
            generator = value.bit_generator
            return (lambda: generator.state), (lambda state: setattr(generator, "state", state))
        if hasattr(value, "get_state") and hasattr(value, "set_state"):  # numpy.random.RandomState
            return value.get_state, value.set_state
    return None


def _attribute(key: str, value: Any, get: Callable[[], Any], put: Callable[[Any], None],
               weights: Collection[int]) -> Restore:
    """Put back attribute ``key``'s ``value`` (``get`` reads it, ``put`` writes it): the same object, and its
    contents where it is a tensor, list or dict (``weights``: :func:`kept_contents`'s)."""
    contents = kept_contents(value, weights=weights)

    def restore() -> list[str]:
        now = get()
        changed = not _same(now, value)
        if changed:
            put(value)
            changed = not _widened(now, value)
        return [key] if put_back_contents(value, contents) or changed else []

    return restore


def _widened(now: Any, was: Any) -> bool:
    """Whether tensor ``now`` is ``was`` as float64 (complex128), its values alike: what a model that moves a
    constant to its input's device at every call (speechbrain's LiGRU: ``self.drop_mask_te =
    self.drop_mask_te.to(w.device)``) assigns in the float64 reference, whose ops return float64, where its float32
    runs keep the very same tensor. Put back all the same, but not the model's state."""
    return (isinstance(now, torch.Tensor) and isinstance(was, torch.Tensor)
            and now.dtype == {torch.float32: torch.float64, torch.complex64: torch.complex128}.get(was.dtype)
            and now.layout == was.layout == torch.strided and not (now.is_nested or was.is_nested)
            and now.device == was.device and now.device.type != "meta" and now.shape == was.shape
            and torch.equal(now, was.to(now.dtype)))


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


def kept_contents(value: Any, depth: int = 0, weights: Collection[int] = frozenset()) -> Any:
    """What :func:`put_back_contents` needs to put ``value``'s contents back: a tensor's values, a list's or
    dict's items, and the contents of the items of a list, dict or tuple (a list of tensors updated in place:
    ``self.state[0].add_(h)``), a few levels down. ``weights``: the ids of the model's parameters, whose values
    are watched, not copied (see the module's docstring); a parameter it does not register is copied as any
    tensor."""
    if id(value) in weights:
        return None
    if isinstance(value, torch.Tensor):
        return None if value.is_inference() else value.detach().clone()
    if isinstance(value, np.ndarray):  # of numbers: an array of objects is left to its objects
        return None if value.dtype.hasobject else value.copy()
    access = random_state(value)
    if access is not None:
        return access[0]()
    if depth >= DEPTH:
        return None
    if is_dataclass_instance(value) or _holds_only_data(value):
        return _Fields(value, depth + 1, weights)
    if isinstance(value, (list, collections.deque)):
        return list(value), [kept_contents(item, depth + 1, weights) for item in value]
    if isinstance(value, set):
        return list(value), [None] * len(value)
    if isinstance(value, dict):
        return dict(value), {key: kept_contents(item, depth + 1, weights) for key, item in value.items()}
    if isinstance(value, tuple):
        inner = [kept_contents(item, depth + 1, weights) for item in value]
        return inner if any(c is not None for c in inner) else None
    return None


def put_back_contents(value: Any, contents: Any) -> bool:
    """``value``'s contents as :func:`kept_contents` kept them; whether they had changed."""
    if contents is None:
        return False
    if isinstance(value, torch.Tensor):
        # compared by value, as a buffer is: a write through ``.data`` or ``.numpy()`` (``self.h.data.add_(1)``)
        # leaves the tensor's version counter alone
        return _values_put_back(value, contents)
    if isinstance(value, np.ndarray):
        return _array_put_back(value, contents)
    access = random_state(value)
    if access is not None:
        return _random_put_back(access, contents)
    if isinstance(contents, _Fields):
        return contents.put_back(value)
    if isinstance(value, tuple):
        return _inner_put_back(value, contents)
    items, inner = contents
    if isinstance(value, (list, collections.deque, set)):
        changed = not (len(value) == len(items) and all(a is b for a, b in zip(value, items)))
        if isinstance(value, set):
            changed = {id(item) for item in value} != {id(item) for item in items}
        if changed:
            value.clear()
            value.update(items) if isinstance(value, set) else value.extend(items)
        return _inner_put_back(items, inner) or changed
    changed = not (value.keys() == items.keys() and all(value[k] is items[k] for k in items))
    if changed:
        value.clear()
        value.update(items)
    return _inner_put_back(list(items.values()), list(inner.values())) or changed


def _array_put_back(array: np.ndarray, kept: np.ndarray) -> bool:
    """A NumPy array's values put back in place (the model holds the array itself); whether they had changed,
    compared bit for bit (a NaN is its own value). One resized or made read-only since is left as it is."""
    if array.shape != kept.shape or array.dtype != kept.dtype:
        return True
    if array.tobytes() == kept.tobytes():
        return False
    if array.flags.writeable:
        np.copyto(array, kept)
    return True


def _random_put_back(access: tuple[Callable[[], Any], Callable[[Any], None]], state: Any) -> bool:
    """A random generator's ``state`` put back (read and set by ``access``); whether it had drawn since."""
    now = access[0]()
    if _same_state(now, state):
        return False
    access[1](state)
    return True


def _same_state(a: Any, b: Any) -> bool:
    """Whether two random states are equal: a tensor (torch), or dicts and tuples of numbers and arrays (NumPy)."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    if hasattr(a, "tolist"):  # a NumPy array
        return a.tolist() == b.tolist()
    return a == b


def _inner_put_back(items: Any, inner: list[Any]) -> bool:
    """The contents of each of ``items`` put back; whether any had changed (each one put back, not only the
    first changed)."""
    return any([put_back_contents(item, kept) for item, kept in zip(items, inner)])


def _script_attributes(module: torch.jit.ScriptModule, weights: Collection[int]) -> Iterator[Restore]:
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
                             lambda value, name=name: module._c.setattr(name, value), weights)


def written_note(written: list[str]) -> str:
    """What a report says of a model that writes into its own parameters as it runs (``written``: their names,
    from :class:`KeptState`).

    >>> written_note(["teacher.weight"])[:70]
    'the model writes into its own parameters as it runs (teacher.weight): '
    """
    shown = ", ".join(written[:4]) + (f" and {len(written) - 4} more" if len(written) > 4 else "")
    return (f"{WRITES_PARAMETERS} ({shown}): each run started from the weights the "
            f"last one left, so the levels' differences are not precision's alone, and the model keeps the last "
            f"run's weights (an EMA or momentum update, a weight normalised in place: check a model whose forward "
            f"leaves its parameters alone)")


def stateful_note(changed: list[str]) -> str:
    """What a report says of a model whose state changed as it ran (``changed``: what :func:`state_kept`'s
    ``reset()`` put back).

    >>> stateful_note(["_state", "_context"])[:66]
    'the model keeps state between calls (_state, _context changed as i'
    """
    shown = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
    return (f"the model keeps state between calls ({shown} changed as it ran): every run started from the state it "
            f"had before the check, which it has again now")
