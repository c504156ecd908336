"""Scoped precision: ``precision(level)``, thread- and asyncio-task-local, nestable, exact on exit.

The level of a scope lives in a contextvar, so each thread and each asyncio task sees its own. PyTorch's flag is
process-global, so this module owns it (through ``flags``) and keeps one invariant: **a matmul-family op runs
under the level of the context that issued it.**

- Agreed (the common case: one thread, or every live scope wants the same level): the flag holds that level;
  ops are not intercepted, so a scope costs a few µs at entry and exit and nothing per op.
- Contended (live scopes disagree): every thread holding a scope runs a *guard*, a thread-local
  ``TorchDispatchMode`` that, for ops of the flag-sensitive families, takes a process lock, writes its context's
  level, runs the op and writes the process level back. Ops of those families serialise across threads then.

A thread gets its guard when it enters a scope that may need one: off the main thread, or while any other thread
or task holds a scope (``TF32LAB_SCOPE_GUARD=always``: every time). A scope that would disagree with a scope held,
unguarded, by another thread raises ``Tf32LabError`` at entry instead of letting that thread's ops run under the
wrong level. docs/design.md explains the choice and its costs.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import os
import threading
import weakref
from asyncio import current_task as _current_task
from asyncio.events import _get_running_loop
from typing import Any, Callable, Optional, TypeVar

from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from . import flags
from .errors import Tf32LabError
from .families import family_of
from .levels import LEVELS, check_level

__all__ = ["get_float32_matmul_precision", "precision", "set_float32_matmul_precision"]

F = TypeVar("F", bound=Callable[..., Any])

_GUARD_POLICIES = ("auto", "always")


def _guard_policy() -> str:
    value = os.environ.get("TF32LAB_SCOPE_GUARD", "auto")
    if value not in _GUARD_POLICIES:
        raise Tf32LabError(
            f"TF32LAB_SCOPE_GUARD={value!r} is not understood; accepted: {', '.join(map(repr, _GUARD_POLICIES))}"
        )
    return value


GUARD_POLICY = _guard_policy()


# One entered scope is a tuple (level, holder key, owner, parent node); the contextvar holds the innermost.
_LEVEL, _HOLDER, _OWNER, _PARENT = range(4)

_SCOPE: contextvars.ContextVar[Optional[tuple]] = contextvars.ContextVar("tf32lab_scope", default=None)
_MAIN = threading.main_thread().ident
_VALUES = {level: flags.level_values(level) for level in LEVELS}
_RAW = {level: flags.level_raw(level) for level in LEVELS}
_LEVEL_OF_RAW = {raw: level for level, raw in _RAW.items()}
_read_effective = flags.read_level_effective
_write_raw = flags.write_level_raw
_write_level = flags.write_level
_get_ident = threading.get_ident


class _State:
    """Process-wide bookkeeping of live scopes; every field is guarded by ``lock``.

    Flag writes are exclusive: a writer waits until no guarded op is running on the level in force
    (``readers``), so a change never lands under an op that already started.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.idle = threading.Condition(self.lock)
        self.readers = 0  # guarded ops running now on the level in force
        self.tls = threading.local()  # .reads: this thread's share of readers (a reentrant writer skips them)
        self.holders: dict[tuple[int, int], list[str]] = {}  # (thread, task) -> levels, innermost last
        # thread -> its guard, for other threads to see; weak, so a dead thread's entry cannot outlive its mode
        # stack and mislead a new thread that reuses its ident. A thread asks its own ``tls.guard``.
        self.guards: weakref.WeakValueDictionary[int, _Guard] = weakref.WeakValueDictionary()
        self.pushed = 0  # guards pushed and not yet popped, in any thread: 0 lets exits skip the lookup
        self.contended = False
        self.in_force: Optional[str] = None  # level the flags hold; None: no scope live, flags are the user's
        self.base_effective: tuple[str, ...] = ()  # effective values outside scopes
        self.base_raw: tuple[str, ...] = ()  # raw values to give back when the last scope ends
        self.base_as_level: Optional[str] = None  # the level whose explicit values base_raw is, if any
        self.cache: Optional[tuple[tuple[str, ...], tuple[str, ...]]] = None  # (effective, raw) last seen

    @property
    def base_level(self) -> str:
        return flags.level_from_effective(self.base_effective)

    def wait_writable(self) -> None:
        own = getattr(self.tls, "reads", 0)
        while self.readers > own:
            self.idle.wait()

    def write(self, level: str) -> None:
        if self.in_force != level:
            if self.readers:
                self.wait_writable()
            _write_level(level)
            self.in_force = level

    def capture_base(self) -> None:
        effective = _read_effective()
        cache = self.cache
        if cache is None or cache[0] != effective:
            # Raw values take a probe of parent cells; a cache checked against effective values skips it.
            cache = self.cache = flags.read_level_state()
        self.base_raw, self.base_effective = cache[1], effective
        self.base_as_level = _LEVEL_OF_RAW.get(cache[1])

    def release_base(self) -> None:
        # Exactly as before the first scope, as any scoped setting does; a direct write made meanwhile is undone.
        if self.in_force is None:
            return
        if self.readers:
            self.wait_writable()
        level = self.base_as_level
        if level is not None:  # explicit values of a level: one call
            _write_level(level)
        else:
            _write_raw(self.base_raw)
        self.in_force = None
        self.contended = False

    def rebalance(self) -> None:
        """Make the flags match the live scopes (see the module docstring)."""
        if not self.holders:
            self.contended = False
            self.release_base()
            return
        wanted = {stack[-1] for stack in self.holders.values()}
        self.contended = len(wanted) > 1
        self.write(self.base_level if self.contended else next(iter(wanted)))


_STATE = _State()

_SENSITIVE: dict[Any, bool] = {}


def _sensitive(func: Any) -> bool:
    known = _SENSITIVE.get(func)
    if known is None:
        name = func.name()
        # An op from outside aten may run matmuls inside its own kernel: guard it too.
        known = _SENSITIVE[func] = family_of(name) is not None or not name.startswith("aten::")
    return known


class _Guard(TorchDispatchMode):
    """Per-thread: runs flag-sensitive ops under the level of the scope that issued them."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _sensitive(func):
            return func(*args, **kwargs)
        state = _STATE
        node = _SCOPE.get()
        with state.lock:
            shared = (
                node is None  # unscoped code claims no level: it runs under the one in force
                or state.in_force is None
                or (not state.contended and state.in_force == node[_LEVEL])
            )
            if not shared:
                outside = state.in_force
                state.write(node[_LEVEL])
                try:
                    return func(*args, **kwargs)
                finally:
                    state.write(outside)
            state.readers += 1
            state.tls.reads = getattr(state.tls, "reads", 0) + 1
        try:
            return func(*args, **kwargs)
        finally:
            with state.lock:
                state.readers -= 1
                state.tls.reads -= 1
                state.idle.notify_all()


def _has_guard() -> bool:
    return getattr(_STATE.tls, "guard", None) is not None


def _push_guard(thread: int) -> None:
    guard = _Guard()
    guard.__enter__()
    _STATE.tls.guard = _STATE.guards[thread] = guard
    _STATE.pushed += 1


def _pop_guard(thread: int) -> None:
    guard = getattr(_STATE.tls, "guard", None)
    # Only ours on top can go; under someone else's mode it stays (harmless) and is reused next time.
    if guard is not None and _get_current_dispatch_mode() is guard:
        guard.__exit__(None, None, None)
        _STATE.tls.guard = None
        _STATE.guards.pop(thread, None)
        _STATE.pushed -= 1


def _needs_guard(thread: int) -> bool:
    return thread != _MAIN or GUARD_POLICY == "always"


class precision:
    """Run code under a float32 matmul precision level: ``"highest"``, ``"high"`` or ``"medium"``.

    A context manager and a decorator (plain and ``async def`` functions). Scopes nest; the level is local to
    the thread and the asyncio task; on exit, by exception too, every PyTorch flag is as it was. Real matmuls
    obey the scope: PyTorch's flags follow it, also when threads hold different levels at once.

    Example:

        >>> import tf32lab
        >>> with tf32lab.precision("high"):
        ...     tf32lab.get_float32_matmul_precision()
        'high'
        >>> @tf32lab.precision("medium")
        ... def encode():
        ...     return tf32lab.get_float32_matmul_precision()
        >>> encode(), tf32lab.get_float32_matmul_precision()
        ('medium', 'highest')
    """

    __slots__ = ("level",)

    def __init__(self, level: str) -> None:
        self.level = check_level(level)

    def __repr__(self) -> str:
        return f"precision({self.level!r})"

    def __enter__(self) -> precision:
        level = self.level
        parent = _SCOPE.get()
        thread = _get_ident()
        key = (thread, id(_current_task()) if _get_running_loop() is not None else 0)
        state = _STATE
        with state.lock:
            if state.holders or state.readers:
                _enter_beside_others(level, key)
            else:  # the first scope in the process: the common case, kept short
                if _needs_guard(thread) and not _has_guard():
                    _push_guard(thread)
                state.capture_base()
                state.holders[key] = [level]
                _write_level(level)
                state.in_force = level
        _SCOPE.set((level, key, self, parent))
        return self

    def __exit__(self, *exc: object) -> None:
        node = _SCOPE.get()
        if node is None or node[_OWNER] is not self:
            raise Tf32LabError(
                f"{self!r} exited without being the innermost scope of this context "
                "(a scope left open across a yield or an await into another task?)"
            )
        _SCOPE.set(node[_PARENT])
        key = node[_HOLDER]
        state = _STATE
        with state.lock:
            holders = state.holders
            stack = holders[key]
            stack.pop()
            if stack:
                state.rebalance()
                return
            del holders[key]
            if state.pushed and _has_guard() and not any(k[0] == key[0] for k in holders):
                _pop_guard(key[0])
            if holders or state.readers or state.in_force is None:
                state.rebalance()
            else:  # the last scope: give the user's values back
                state.release_base()

    def __call__(self, fn: F) -> F:
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            raise TypeError(
                f"precision() cannot decorate the generator function {fn.__qualname__}: a scope open across "
                "yields would leak into the caller; enter it inside the generator with `with precision(...)`"
            )
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                with self:
                    return await fn(*args, **kwargs)

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


def _enter_beside_others(level: str, key: tuple[int, int]) -> None:
    """Enter a scope while others are live (called under the lock); nothing changes if it raises."""
    state = _STATE
    holders = state.holders
    thread = key[0]
    others = [(k, stack[-1]) for k, stack in holders.items() if k != key]
    contended = any(other != level for _, other in others)
    if contended:
        for k, other in others:
            if k[0] != thread and k[0] not in state.guards and other != level:
                name = next((t.name for t in threading.enumerate() if t.ident == k[0]), str(k[0]))
                raise Tf32LabError(
                    f"precision({level!r}) cannot start in thread {threading.current_thread().name!r}: thread "
                    f"{name!r} holds precision({other!r}), entered while it was the only scope, so its matmuls "
                    "are not guarded. Enter that scope after the threads start, or set TF32LAB_SCOPE_GUARD=always."
                )
    if not _has_guard() and (others or _needs_guard(thread)):
        _push_guard(thread)
    if not holders:  # only guarded ops of unscoped code were running
        state.capture_base()
    holders.setdefault(key, []).append(level)
    state.rebalance()


def get_float32_matmul_precision() -> str:
    """The level in force for this thread/task: the innermost scope's, else the process level.

    Like ``torch.get_float32_matmul_precision`` but scope-aware, and it never raises for a mix of PyTorch's
    legacy and per-backend APIs (it reads the per-backend values where they exist).

    Example:

        >>> import tf32lab
        >>> tf32lab.get_float32_matmul_precision()
        'highest'
    """
    node = _SCOPE.get()
    if node is not None:
        return node[_LEVEL]
    state = _STATE
    with state.lock:
        return state.base_level if state.holders else flags.read_level()


def set_float32_matmul_precision(level: str) -> None:
    """Set the process-wide level, as ``torch.set_float32_matmul_precision`` does, with validation.

    Works on every torch >= 2.4 whichever API generation it has, and never provokes PyTorch's "mix of legacy and
    new APIs" error, also when other code used the other API first. It sets the level that applies outside
    ``precision()`` scopes: a scope in force keeps its own level until it exits.

    Example:

        >>> import tf32lab
        >>> before = tf32lab.flags.snapshot()
        >>> tf32lab.set_float32_matmul_precision("high")
        >>> tf32lab.get_float32_matmul_precision()
        'high'
        >>> tf32lab.flags.restore(before)   # every flag exactly as it was
        >>> tf32lab.set_float32_matmul_precision("fastest")
        Traceback (most recent call last):
        ...
        ValueError: unknown precision level 'fastest'; accepted: 'highest', 'high', 'medium'
    """
    check_level(level)
    state = _STATE
    values, raw = _VALUES[level], _RAW[level]
    with state.lock:
        state.wait_writable()
        if not state.holders:
            _write_level(level)  # PyTorch's own setter: its legacy getter stays consistent
        else:  # applies once the scopes end; meanwhile to unscoped code when the scopes disagree
            state.base_effective, state.base_raw = values, raw
            state.base_as_level = level
            if state.contended:
                state.write(level)
        state.cache = (values, raw)


def live_scopes() -> int:
    """How many ``precision()`` scopes are open now, in every thread and task."""
    with _STATE.lock:
        return sum(len(stack) for stack in _STATE.holders.values())


def write_process_state(raw: tuple[str, ...]) -> None:
    """Write raw level-cell values (from ``flags.read_level_state()``) as the process-wide setting.

    For putting back exactly what an earlier setter replaced, inheritance (``"none"``) included. Refused while
    scopes are open: their exit would give back the values they captured on entry, not these.
    """
    with _STATE.lock:
        if _STATE.holders:
            raise Tf32LabError(f"cannot restore the process-wide level while {live_scopes()} precision() "
                               "scope(s) are open; close them first")
        _STATE.wait_writable()
        _write_raw(tuple(raw))
        _STATE.cache = None


def context_level() -> Optional[str]:
    """The level of the innermost scope of this thread/task, or None outside scopes (no Python frame walk)."""
    node = _SCOPE.get()
    return None if node is None else node[_LEVEL]


def _active_guards() -> int:
    """Threads with a guard pushed now (for tests and diagnostics)."""
    return len(_STATE.guards)


def _reset_for_tests() -> None:
    """Forget the raw-value cache (tests that write PyTorch's flags behind tf32lab's back)."""
    with _STATE.lock:
        _STATE.cache = None

