"""The model's own forward hooks around a layer's reruns: what a hook stored from a rerun is stored again from the
reference call (its forward hooks and pre-hooks, and the global ones).

A layer's rerun (``measure.layers``) runs the layer and everything inside it again, and with them the forward hooks
the model registered on those modules: they must run, for the rerun computes what the model computes (a hook that
scales its module's output; a parent that reads what its children's hooks gathered, as timm's ``FeatureHooks``
feeds a feature pyramid). But a hook that only keeps what it is given, ``store["b"] = output``, then holds the
rerun's float32 output, at the last level rerun, in place of the reference's: where the forward goes on to read
the store, the reference's own output was a float32 row's, and every row was measured against it (a model that
returns what its hooks gathered failed `highest` at 2.5e-4 under ``introduced="all"``; policy rows and ``tune``
likewise).

:class:`OwnHooks` wraps each such hook while a reference run that reruns layers runs (one that reruns none, as
``check``'s by default, leaves the hooks alone: an observer on every module, a NaN check, was held with each
module's last float64 input and output for nothing, all-MiniLM-L6-v2's check peaking at 925 MiB instead of 800):
forward hooks and pre-hooks, and the global ones
(``register_module_forward_hook``, called for every module), those the forward registers as it runs from the next
module call on (:meth:`OwnHooks.registered`). A hook is an observer while each of its calls in the
reference returns None and writes nothing into what it is given (a forward hook's output, a pre-hook's inputs;
version counters, and the float64 run's writes, which see one through ``output.data``); its last reference call's
arguments on each module are held. After a layer's reruns, each observer that ran in them is called once more with
those arguments (:meth:`OwnHooks.put_back`), so that what it keeps is the reference's again. A hook that returns a
value, or writes into what it is given, changes what the model computes: it is left as it is. A store that appends
keeps the reruns' entries, and one more; PyTorch's own hooks (FSDP's) and transformers' output capturing (idle in
the reruns) are not wrapped.

Example:

    >>> import torch
    >>> layer, store = torch.nn.Linear(2, 2), {}
    >>> _ = layer.register_forward_hook(lambda m, args, out: store.update(out=out))
    >>> rerunning = [False]
    >>> with OwnHooks([layer], set(), lambda: rerunning[0]) as hooks:
    ...     y = layer(torch.ones(1, 2))
    ...     rerunning[0] = True
    ...     _ = layer(torch.zeros(1, 2))  # a rerun: the hook keeps its output
    ...     rerunning[0] = False
    ...     hooks.put_back()
    >>> store["out"] is y
    True
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any, Callable

import torch
import torch.nn.modules.module as _modules

from tf32lab.measure.given import versions
from tf32lab.measure.reference import storage_address
from tf32lab.numbers.trees import named_tensors

__all__ = ["OwnHooks", "unwrapped"]


class OwnHooks:
    """The forward hooks and pre-hooks of ``modules`` and the global ones (``register_module_forward_hook``), other
    than those whose ids are in ``ours``, watched while the block runs (``rerunning()``: whether a layer's rerun is
    running now)."""

    def __init__(self, modules: Iterable[torch.nn.Module], ours: set[int], rerunning: Callable[[], bool]) -> None:
        self.modules, self.ours, self.rerunning = list(modules), ours, rerunning
        # each wrapped hook: the dict it is in, its key, the hook and its wrapper
        self.saved: list[tuple[dict, int, Callable, Callable]] = []
        # an observer's last reference call on a module: (its dict, its key, the module) -> (the hook, its arguments,
        # the call's place in the reference's order of hook calls)
        self.last: dict[tuple[int, int, int], tuple[Callable, tuple, int]] = {}
        self.calls = 0
        self.changes: set[tuple[int, int]] = set()  # hooks that returned a value or wrote into what they were given
        self.fired: list[tuple[int, int, int]] = []  # observers called in the reruns since the last put_back
        # each reference hook call running now: the storages of what it was given, and whether an op wrote into one
        self.watching: list[tuple[set[int], list[bool]]] = []
        self.wrapped: dict[int, set[int]] = {}  # each dict's keys seen (wrapped, ours or left alone)

    def __enter__(self) -> OwnHooks:
        # Wrapped in the module's own dict, not a copy: a hook's handle holds that dict, and a hook that removed
        # itself as it ran (a one-shot capture) was removed from the dict put aside, ran on at the module's next
        # call, without its with_kwargs flag (a TypeError), and came back wrapped after the run.
        seen: set[int] = set()
        self._wrap_globals()
        for module in self.modules:
            if id(module) not in seen:
                seen.add(id(module))
                self._wrap(module._forward_pre_hooks, True)
                self._wrap(module._forward_hooks, False)
        return self

    def registered(self, module: torch.nn.Module) -> None:
        """Watch the hooks registered since, global or ``module``'s, before ``module`` runs (its reference call):
        a capture the forward opens registers a global hook there, which runs before the layer's own hooks, and
        the layer's reruns left their float32 output in its store."""
        self._wrap_globals()
        self._wrap(module._forward_pre_hooks, True)
        self._wrap(module._forward_hooks, False)

    def _wrap_globals(self) -> None:
        self._wrap(_modules._global_forward_pre_hooks, True)
        self._wrap(_modules._global_forward_hooks, False)

    def _wrap(self, hooks: dict, pre: bool) -> None:
        done = self.wrapped.setdefault(id(hooks), set())
        if hooks.keys() <= done:  # the usual call: nothing new
            return
        for key, hook in list(hooks.items()):
            if key in done:
                continue
            done.add(key)
            if key in self.ours or _left_alone(hook):
                continue
            wrapped = self._watched(id(hooks), key, hook, pre)
            hooks[key] = wrapped  # an existing key: its place in the order stays
            self.saved.append((hooks, key, hook, wrapped))

    def __exit__(self, *exc: object) -> None:
        unwrapped(self.saved)
        self.saved.clear()
        self.wrapped.clear()
        self.last.clear()
        self.fired.clear()

    def written(self, tensors: list[torch.Tensor]) -> None:
        """Told of the tensors an op is about to write into (the float64 run's ``on_write``): a write through
        ``output.data``, which bumps no version counter, is a write into what the hook was given all the same."""
        if self.watching:
            addresses = _addresses(tensors)
            for given, wrote in self.watching:
                if given & addresses:
                    wrote[0] = True

    def put_back(self) -> None:
        """Call each observer that ran in the reruns since the last call once more, as the reference called it, in the
        order of those reference calls."""
        fired, self.fired = self.fired, []
        # in the order of their reference calls: where several keep into one place (hooks on b and c, b called again
        # after c), what is kept last is the reference's last, not the call that ran first in the reruns
        found = sorted((self.last[key] for key in set(fired) if key in self.last), key=lambda kept: kept[2])
        for hook, args, _ in found:
            hook(*args)

    def _watched(self, where: int, key: int, hook: Callable, pre: bool) -> Callable:
        """``hook`` (a pre-hook where ``pre``: given the call's inputs, else its output too), watched."""
        kind = (where, key)

        @functools.wraps(hook)
        def run(*args: Any) -> Any:
            call = (where, key, id(args[0]))  # a global hook's calls are told apart by their module
            given = args[1:] if pre else args[-1]
            if self.rerunning():
                if call in self.last:
                    self.fired.append(call)
                return hook(*args)
            if kind in self.changes:
                return hook(*args)
            before, wrote = versions(given), [False]
            self.watching.append((_addresses(given), wrote))
            try:
                result = hook(*args)
            finally:
                self.watching.pop()
            if result is None and not wrote[0] and versions(given) == before:
                self.calls += 1
                self.last[call] = (hook, args, self.calls)
            else:  # no observer, on any module: none of its calls is made again
                self.changes.add(kind)
                self.last = {k: v for k, v in self.last.items() if k[:2] != kind}
            return result

        return run


def unwrapped(saved: list[tuple[dict, int, Callable, Callable]]) -> None:
    """Each hook of ``saved`` (its dict, its key, the hook, its wrapper) back in place of its wrapper, where the wrapper
    still is: one removed meanwhile stays removed, one registered meanwhile stays."""
    for hooks, key, hook, wrapped in reversed(saved):
        if hooks.get(key) is wrapped:
            hooks[key] = hook


def _addresses(tree: Any) -> set[int]:
    with torch._C.DisableTorchFunction():  # past the float64 reference's function mode, as given.versions
        return {a for _, t in named_tensors(tree) if (a := storage_address(t)) is not None}


# Hooks left to run as they are: PyTorch's own (FSDP's state machine), and transformers 5's output capturing, which
# appends to a collection the forward holds and idles in the reruns (measure.layers._uncaptured): called again, it
# appended the reference's attention twice
_LEFT = ("torch.", "transformers.utils.output_capturing")


def _left_alone(hook: Callable) -> bool:
    """Whether ``hook`` is one of those :data:`_LEFT` to run as it is."""
    inner = getattr(hook, "__func__", None) or getattr(hook, "func", None) or hook
    return (getattr(inner, "__module__", None) or "").startswith(_LEFT)
