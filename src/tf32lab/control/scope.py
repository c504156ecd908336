"""Scoped state of a thread or asyncio task: its ``precision(level)``, and whether ``emulate()`` is active in it.

Both live in contextvars, so each thread and each asyncio task sees its own, and scopes nest. PyTorch's flag is
process-global, so this module owns it (through ``flags``) and keeps one invariant: **a matmul-family op runs
natively under the level of the context that issued it, or is refused with a clear error.**

- Every context that holds scopes is a *holder*; its innermost scope *votes* for the flag. A context inside
  ``emulate()`` does not vote: the emulator computes its family ops from the scope's level, not from the flag.
- Agreed (the common case: one thread, or every vote the same): the flag holds that level; ops are not
  intercepted, so a scope costs a few µs at entry and exit and nothing per op.
- Contended (votes differ): every thread holding a scope runs a *guard*, a thread-local ``TorchDispatchMode``.
  For ops of the flag-sensitive families it runs the op as a *reader* of the flag in force when that is its
  context's level, else as the one *writer*: it waits until no other guarded op runs, writes its level, runs the
  op and writes the flag back. The process lock is never held while an op runs.
- A thread gets its guard when it enters a scope off the main thread, or beside other holders, or while another
  non-daemon thread runs (``TF32LAB_SCOPE_GUARD=always``: every time). So the only unguarded scope is a main-thread
  scope entered while no other non-daemon thread ran and no other context held a scope. A thread started inside
  it (or a daemon thread) that runs a native matmul at another level cannot be served (the main thread's ops would
  run under the wrong level): that matmul raises ``Tf32LabError``, which names both remedies.

A scope closes for every context that inherited it when it exits; closing out of order (generators) works, and a
scope left open by a task that ended, or a thread that died, is closed for it. A direct
``torch.set_float32_matmul_precision`` inside a scope is undone when that scope exits (the enclosing scope's level
is written again); inside ``emulate()`` tf32lab does not hold the flag, so a direct write there is the user's and
stays. A guard is put below the modes pushed since the thread's oldest open scope was entered: their own
``__exit__`` pops the top of the stack. docs/design.md explains the choices and their costs.
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
from typing import Any, Callable, NamedTuple, Optional, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tf32lab import settings
from tf32lab.control import flags, modestack
from tf32lab.errors import Tf32LabError
from tf32lab.know import optable
from tf32lab.know.levels import ALL_LEVELS, EXTRA_LEVELS, LEVELS, check_conv, check_level, level_cells

__all__ = ["conv_math", "get_float32_matmul_precision", "precision", "set_float32_matmul_precision"]

F = TypeVar("F", bound=Callable[..., Any])

_guard_choice: Optional[str] = None


def guard_policy() -> str:
    """``TF32LAB_SCOPE_GUARD`` (``auto`` or ``always``; ``tf32lab.settings``), read once: every scope entry asks,
    and one process must not guard by two rules. A bad value is a one-line ``Tf32LabError``."""
    global _guard_choice
    if _guard_choice is None:
        _guard_choice = settings.get("TF32LAB_SCOPE_GUARD")
    return _guard_choice


_MAIN = threading.main_thread().ident
_VALUES = {level: flags.level_values(level) for level in ALL_LEVELS}
_RAW = {level: flags.level_raw(level) for level in ALL_LEVELS}
_LEVEL_OF_RAW = {raw: level for level, raw in _RAW.items()}
_CELL_INDEX = {f"{b}.{o}": i for i, (b, o) in enumerate(flags.LEVEL_CELLS)}  # cells of a level
_read_effective = flags.read_level_effective
_TWO_CELLS = len(flags.LEVEL_GETTERS) == 2  # the per-backend API: read the two cells without a Python frame
_get_first, _get_second = flags.LEVEL_GETTERS if _TWO_CELLS else (None, None)
_write_raw = flags.write_level_raw
_write_level = flags.write_level
# PyTorch's own setter, called directly for its own levels (flags.write_level's first branch, without its frame)
_write_torch_level = flags.write_torch_level
_TORCH_LEVELS = frozenset(LEVELS)
_get_ident = threading.get_ident
_dispatch_depth = torch._C._len_torch_dispatch_stack
# Non-daemon threads are the ones that may hold scopes of their own (pools, plain Thread()); daemon threads are
# taken as helpers that do not (tqdm's monitor, IPython's kernel threads), so they do not make the main thread's
# scopes pay a guard on every op. CPython 3.9-3.12 keep a set with one held lock per running non-daemon thread
# (the main thread's included); elsewhere the threads are looked at one by one.
_SHUTDOWN_LOCKS: Optional[set] = getattr(threading, "_shutdown_locks", None)
_MAIN_LOCK = getattr(threading.main_thread(), "_tstate_lock", None)


_LIMBO: Optional[dict] = getattr(threading, "_limbo", None)  # threads started and not yet running
# Where both exist, "no other non-daemon thread" is told without a call: one shutdown lock (the main thread's) and
# an empty limbo (a scope entry asks this first, and _other_threads() only when it fails).
_QUICK_THREADS = _SHUTDOWN_LOCKS is not None and _MAIN_LOCK is not None and _LIMBO is not None
# How many shutdown locks there are with no other thread: the main thread's one. A forked child's main thread keeps
# its lock (reinitialised in place) but is not in the child's new set: none there.
_AT_REST = int(_SHUTDOWN_LOCKS is not None and _MAIN_LOCK in _SHUTDOWN_LOCKS)


def _other_threads() -> bool:
    """Whether a non-daemon thread other than the main thread is running (or starting)."""
    if _SHUTDOWN_LOCKS is not None and _MAIN_LOCK is not None:
        if len(_SHUTDOWN_LOCKS) > _AT_REST and any(lock is not _MAIN_LOCK and lock.locked()
                                                    for lock in list(_SHUTDOWN_LOCKS)):
            return True
        return bool(_LIMBO) and any(not t.daemon for t in list(_LIMBO.values()))
    return any(not t.daemon and t.ident != _MAIN for t in threading.enumerate())


class _Holder:
    """A context (a thread, or an asyncio task) with open scopes or emulation; its innermost scope votes."""

    __slots__ = ("emulations", "key", "nodes", "thread")

    def __init__(self, key: tuple[int, int]) -> None:
        self.key, self.thread = key, key[0]
        self.nodes: list[_Node] = []  # open scopes, innermost last
        self.emulations: list[Emulation] = []  # open emulate() blocks entered in this context

    def vote(self) -> Optional[str]:
        if self.emulations or not self.nodes:
            return None
        node = self.nodes[-1]
        return None if node.emulated() else node.level


class _Node:
    """One entered scope."""

    __slots__ = ("alive", "depth", "emulation", "holder", "level", "owner", "parent")

    def __init__(self, level: str, owner: precision, parent: Optional[_Node], holder: _Holder,
                 emulation: Optional[Emulation], depth: int) -> None:
        self.level, self.owner, self.parent, self.holder, self.emulation = level, owner, parent, holder, emulation
        self.alive = True
        self.depth = depth  # the dispatch modes this thread had when the scope was entered (see _push_guard)

    def emulated(self) -> bool:
        return self.emulation is not None and self.emulation.alive


_new_node = object.__new__  # a scope entry sets a _Node's fields itself: __init__'s frame costs a tenth of the entry


class Emulation:
    """One entered ``emulate()`` block: its ``emulate`` object (``owner``) and what the emulator keeps (``entry``)."""

    __slots__ = ("alive", "entry", "holder", "on_close", "owner", "parent")

    def __init__(self, owner: Any, entry: Any, parent: Optional[Emulation], holder: _Holder,
                 on_close: Callable) -> None:
        self.owner, self.entry, self.parent, self.holder, self.on_close = owner, entry, parent, holder, on_close
        self.alive = True


_SCOPE: contextvars.ContextVar[Optional[_Node]] = contextvars.ContextVar("tf32lab_scope", default=None)
_EMULATION: contextvars.ContextVar[Optional[Emulation]] = contextvars.ContextVar("tf32lab_emulation",
                                                                                 default=None)


# in_force when contended unscoped code runs at the user's own cell values and no level writes them
_USER = "the user's values"
_LEVEL_OF_EFFECTIVE: dict[tuple[str, ...], str] = {}
_EFFECTIVE_OF: dict[str, tuple[str, ...]] = {}  # level -> the effective cells its write leaves


def _effective() -> tuple[str, ...]:
    return (_get_first(), _get_second()) if _TWO_CELLS else _read_effective()


def _level_of_effective(effective: tuple[str, ...]) -> str:
    level = _LEVEL_OF_EFFECTIVE.get(effective)
    if level is None:
        level = _LEVEL_OF_EFFECTIVE[effective] = flags.level_from_effective(effective)
    return level


def _live(node: Any) -> Any:
    while node is not None and not node.alive:
        node = node.parent
    return node


class _Base(NamedTuple):
    """The user's level-cell values: effective, raw (to give back), the level they are the explicit values of
    (one setter call gives them back), and the level they amount to."""

    effective: tuple[str, ...]
    raw: tuple[str, ...]
    as_level: Optional[str]
    level: str

    @classmethod
    def of(cls, effective: tuple[str, ...], raw: tuple[str, ...]) -> _Base:
        return cls(effective, raw, _LEVEL_OF_RAW.get(raw), _level_of_effective(effective) if effective else "highest")


class _ThreadState(threading.local):
    """Per thread (class attributes are the defaults: a missing attribute would cost an exception each time)."""

    guard: Optional[_Guard] = None  # this thread's guard, when pushed
    holder: Optional[_Holder] = None  # this thread's own holder (outside tasks), made once
    reads = 0  # this thread's share of the readers (its own writes skip them)


class _State:
    """Process-wide bookkeeping of holders and of the flag; every field is guarded by ``lock``.

    ``public`` is the level unscoped code reads while tf32lab has the flag written (None: the flag is the user's);
    ``public`` is set before tf32lab first writes the flag and cleared after it gave the user's values back, and
    ``epoch`` counts the times it was set, so readers need no lock (see :func:`get_float32_matmul_precision`).
    """

    # slots: every scope entry and exit reads a dozen of these fields
    __slots__ = ("base", "cache", "contended", "epoch", "guards", "holders", "idle", "in_force", "live", "lock",
                 "public", "pushed", "readers", "tls", "unguarded", "writer", "written")

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.idle = threading.Condition(self.lock)
        self.readers = 0  # guarded ops running now on the flag in force
        self.writer: Optional[int] = None  # the thread whose guarded op runs at a level of its own now
        self.written: Optional[str] = None  # the level that op wrote
        self.tls = _ThreadState()
        self.holders: dict[tuple[int, int], _Holder] = {}
        # thread -> its guard, for other threads to see; weak, so a dead thread's entry cannot outlive its mode stack
        self.guards: weakref.WeakValueDictionary[int, _Guard] = weakref.WeakValueDictionary()
        self.live = 0  # open scopes and emulate() blocks, in every context
        self.pushed = 0  # guards pushed and not yet dropped (a dead thread's stays counted: only a fast check)
        self.in_force: Optional[str] = None  # level the flag holds; None: the user's values
        self.unguarded: Optional[str] = None  # the vote of the one holder whose thread has no guard
        self.contended = False
        # The user's values outside scopes, as a _Base; cache: the last one read, checked against effective values
        self.base: _Base = _Base.of((), ())
        self.cache: Optional[_Base] = None
        self.public: Optional[str] = None
        self.epoch = 0

    def wait_writable(self) -> None:
        own, me = self.tls.reads, _get_ident()
        while self.readers > own or (self.writer is not None and self.writer != me):
            self.idle.wait()

    def begin(self) -> None:
        """tf32lab takes the flag: remember the user's values (the caller writes next)."""
        effective = (_get_first(), _get_second()) if _TWO_CELLS else _read_effective()
        base = self.cache
        if base is None or base.effective != effective:
            # Raw values take a probe of parent cells; a cache checked against effective values skips it.
            base = self.cache = _Base.of(*flags.read_level_state())
        self.epoch += 1
        self.base = base
        self.public = base.level

    def give_back(self) -> None:
        """The user's values, exactly as before (a direct write made meanwhile is undone, as any scoped setting)."""
        base = self.base
        if base.as_level is not None:  # explicit values of a level: one call
            _write_level(base.as_level)
        else:
            _write_raw(base.raw)
        self.in_force = None
        self.public = None

    def busy(self) -> bool:
        """A guarded op of another thread runs (or one of this thread's, beyond its own reads)."""
        return self.readers > self.tls.reads or (self.writer is not None and
                                                                self.writer != _get_ident())

    def rebalance(self) -> None:
        """Make the flag match the votes (see the module docstring).

        Waiting for guarded ops releases the lock, so the decision is taken again after every wait.
        """
        while True:
            votes = []
            unguarded = None
            for holder in self.holders.values():
                vote = holder.vote()
                if vote is not None:
                    votes.append(vote)
                    if holder.thread not in self.guards:
                        unguarded = vote
            self.contended = len(set(votes)) > 1
            self.unguarded = unguarded
            if not votes:
                if self.in_force is None:
                    return
                if self.busy():
                    self.idle.wait()
                    continue
                self.give_back()
                return
            if unguarded is not None:
                target = unguarded
            elif not self.contended:
                target = votes[0]
            elif self.in_force is not None:
                target = self.user_target(self.base)
            else:
                target = self.user_target(_Base.of(_read_effective(), ()))
            if target == self.in_force and _effective() == _EFFECTIVE_OF.get(target):
                return  # (a direct torch write inside an inner scope: the outer one's level is written again)
            if self.busy():
                self.idle.wait()
                continue
            if self.in_force is None:
                self.begin()
            self.write(target)
            if target not in _EFFECTIVE_OF and target in _VALUES:
                _EFFECTIVE_OF[target] = _effective()
            self.in_force = target
            return

    @staticmethod
    def user_target(base: _Base) -> str:
        """What contended unscoped code runs at: the user's level, or ``_USER`` when the user's cells hold values
        that no level writes (``bfx9``, a newer torch's value): then exactly those are written back."""
        level = base.level
        return level if _VALUES.get(level) == _as_ieee(base.effective) else _USER

    def write(self, target: str) -> None:
        """Write a level, or, for ``_USER``, the user's own raw cell values."""
        if target == _USER:
            _write_raw(self.base.raw)
        else:
            _write_level(target)


_STATE = _State()
_acquire, _release = _STATE.lock.acquire, _STATE.lock.release  # for the scope's fast paths: no attribute lookups

_SENSITIVE: dict[Any, bool] = {}


def is_sensitive(func: Any) -> bool:
    """Whether the op's math follows the level: a matmul-family op, or an op from outside aten (which may run
    matmuls inside its own kernel)."""
    known = _SENSITIVE.get(func)
    if known is None:
        name = func.name()
        known = _SENSITIVE[func] = optable.family(name) is not None or not name.startswith("aten::")
    return known


def thread_name(ident: int) -> str:
    """The name of the live thread ``ident`` (its number if it has ended)."""
    return next((t.name for t in threading.enumerate() if t.ident == ident), str(ident))


def _as_ieee(values: tuple[str, ...]) -> tuple[str, ...]:
    # a cell whose whole chain inherits reads "none": IEEE
    return tuple("ieee" if value == "none" else value for value in values)


def run_at(level: str, fn: Callable[[], Any], *, cell: Optional[str] = None,
           refused: Optional[Callable[[], Any]] = None) -> Any:
    """``fn()`` with PyTorch's level cells at ``level`` for this thread (only ``cell`` compared, when given).

    As a reader when the flag in force already is that, else as the writer, exclusive with every other guarded
    op. When a thread runs unguarded under another level, writing would change its ops: ``refused()`` is called
    instead, or, without it, ``Tf32LabError`` says why and what to do.
    """
    state = _STATE
    me = _get_ident()
    tls = state.tls
    wanted = _VALUES[level]
    index = _CELL_INDEX.get(cell) if cell is not None else None
    with state.lock:
        while True:
            if state.writer is not None and state.writer != me:
                state.idle.wait()
                continue
            if state.writer is not None:  # this thread's own op, running as the writer, runs another op
                current = _VALUES[state.written]
            elif state.in_force is not None and state.in_force != _USER:
                current = _VALUES[state.in_force]
            else:
                current = _as_ieee(_read_effective())
            if (current == wanted) if index is None else (current[index] == wanted[index]):
                state.readers += 1
                tls.reads = tls.reads + 1
                mode, before = "read", None
                break
            if state.unguarded is not None and state.unguarded != level:
                if refused is not None:
                    mode, before = "refused", None
                    break
                raise _refusal(level)
            if state.readers > tls.reads:
                state.idle.wait()
                continue
            before = state.written
            if before is None:
                state.writer = me
                if state.in_force is None:
                    state.begin()
            _write_level(level)
            state.written = level
            mode = "write"
            break
    if mode == "refused":
        return refused()  # type: ignore[misc]
    try:
        return fn()
    finally:
        with state.lock:
            if mode == "read":
                state.readers -= 1
                tls.reads -= 1
            elif before is not None:  # nested: the outer op's level again
                _write_level(before)
                state.written = before
            else:
                if state.in_force is not None:
                    state.write(state.in_force)
                else:
                    state.give_back()
                state.writer = state.written = None
            state.idle.notify_all()


def _refusal(level: str) -> Tf32LabError:
    state = _STATE
    holder = next((h for h in state.holders.values() if h.thread not in state.guards and h.vote()), None)
    who = thread_name(holder.thread) if holder is not None else "another"
    me = threading.current_thread()
    if me.daemon:
        remedy = (f"Thread {me.name!r} is a daemon thread, which tf32lab takes for a helper that holds no scope: "
                  "make it a non-daemon thread (started before that scope), or set TF32LAB_SCOPE_GUARD=always.")
    else:
        remedy = "In that thread, enter that scope after starting the threads, or set TF32LAB_SCOPE_GUARD=always."
    return Tf32LabError(
        f"precision({level!r}) in thread {me.name!r} cannot run a matmul now: thread {who!r} holds "
        f"precision({state.unguarded!r}), entered while no other thread was running, so its ops are not guarded "
        f"and the flag must stay at its level. {remedy}")


@modestack.skips_dynamo_lazily
class _Guard(TorchDispatchMode):
    """Per-thread: runs flag-sensitive ops under the level of the scope that issued them."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not is_sensitive(func):
            return func(*args, **kwargs)
        node = _SCOPE.get()
        if node is not None and not node.alive:
            node = _live(node)
        emulation = _EMULATION.get()
        # unscoped code claims no level; an emulated context's family ops are computed by the emulator
        if node is None or (emulation is not None and _live(emulation) is not None):
            return func(*args, **kwargs)
        return run_at(node.level, lambda: func(*args, **kwargs))


def _push_guard(thread: int, depth: int) -> None:
    """This thread's guard onto its stack, below every mode pushed since its oldest open scope was entered
    (``depth``: the stack's height then, or now for a scope being entered): those modes exit before that scope does,
    while the guard stays, and their own exit pops the top of the stack."""
    for holder in _STATE.holders.values():
        if holder.thread == thread and holder.nodes:
            depth = min(depth, holder.nodes[0].depth)
    guard = _Guard()
    modestack.insert(guard, depth)
    _STATE.tls.guard = _STATE.guards[thread] = guard
    _STATE.pushed += 1


def _drop_guard(thread: int) -> None:
    """This thread's guard off its stack, wherever it sits, once none of its contexts holds a scope."""
    guard = _STATE.tls.guard
    if guard is None or any(h.thread == thread and h.nodes for h in _STATE.holders.values()):
        return
    if modestack.remove(guard):  # else lifted off by its own handler, which runs now: found next time
        _STATE.tls.guard = None
        _STATE.guards.pop(thread, None)
        _STATE.pushed -= 1


def _guard_wanted(thread: int, key: tuple[int, int]) -> bool:
    """Whether a thread without a guard needs one to enter a scope beside other holders (module docstring)."""
    if thread != _MAIN or guard_policy() == "always" or _other_threads():
        return True
    holders = _STATE.holders
    return bool(holders) and any(k != key and h.nodes for k, h in holders.items())


def _context_key() -> tuple[tuple[int, int], Any]:
    thread = _get_ident()
    task = _current_task() if _get_running_loop() is not None else None
    return (thread, 0 if task is None else id(task)), task


def _holder(key: tuple[int, int], task: Any) -> _Holder:
    """The holder of ``key``, made (with its clean-up when its task ends or its thread dies) if new.

    A thread's own holder (outside tasks) is made once and kept in its locals; the main thread's is
    ``_MAIN_HOLDER``.
    """
    holder = _STATE.holders.get(key)
    if holder is None:
        if task is None and key[0] == _MAIN:
            holder = _MAIN_HOLDER
        elif task is None and _STATE.tls.holder is not None:
            holder = _STATE.tls.holder
        else:
            holder = _Holder(key)
            if task is not None:
                task.add_done_callback(functools.partial(_context_ended, key, holder))
            else:  # a thread other than the main one, which outlives everything
                _STATE.tls.holder = holder
                _watch_thread(key)
        _STATE.holders[key] = holder
    return holder


# The main thread's own holder, made once: it outlives everything, and a scope entry finds it without a
# thread-local read.
_MAIN_HOLDER = _Holder((_MAIN, 0))


def _after_fork_in_child() -> None:
    """Read threading's bookkeeping again in a forked child: CPython gives the child a new set of shutdown locks,
    a new lock for the main thread and, forked from another thread, another main thread. Read at import only, the
    child's own threads went unseen and its main thread's scopes took no guard while they ran; the child's main
    thread is not in its new set (``_AT_REST``)."""
    global _MAIN, _SHUTDOWN_LOCKS, _MAIN_LOCK, _LIMBO, _QUICK_THREADS, _MAIN_HOLDER, _AT_REST
    main = threading.main_thread().ident
    if main != _MAIN:
        _MAIN, _MAIN_HOLDER = main, _Holder((main, 0))
    _SHUTDOWN_LOCKS = getattr(threading, "_shutdown_locks", None)
    _MAIN_LOCK = getattr(threading.main_thread(), "_tstate_lock", None)
    _LIMBO = getattr(threading, "_limbo", None)
    _QUICK_THREADS = _SHUTDOWN_LOCKS is not None and _MAIN_LOCK is not None and _LIMBO is not None
    _AT_REST = int(_SHUTDOWN_LOCKS is not None and _MAIN_LOCK in _SHUTDOWN_LOCKS)


if hasattr(os, "register_at_fork"):  # after threading's own (registered when it was imported, so it runs first)
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _ThreadWatch:
    """Lives in a thread's locals: when the thread dies, what it left open is closed for it."""

    def __init__(self, key: tuple[int, int]) -> None:
        weakref.finalize(self, _context_ended, key, None)


_WATCH = threading.local()


def _watch_thread(key: tuple[int, int]) -> None:
    if getattr(_WATCH, "key", None) != key:
        _WATCH.key, _WATCH.watch = key, _ThreadWatch(key)


# What a context left open when it ended, closed for it: owner -> where it was entered (for a later exit's error).
_ENDED: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def _context_ended(key: tuple[int, int], holder: Optional[_Holder], *_: Any) -> None:
    with _STATE.lock:
        current = _STATE.holders.get(key)
        if current is None or (holder is not None and current is not holder):
            return
        where = f"a task of thread {thread_name(key[0])!r}" if key[1] else f"thread {thread_name(key[0])!r}"
        for node in list(current.nodes):
            _ENDED[node.owner] = where
            _close(node, rebalance=False)
        for emulation in list(current.emulations):
            _ENDED[emulation.owner] = where
            _close_emulation(emulation, rebalance=False)
        _STATE.holders.pop(key, None)
        _STATE.rebalance()


def _not_open(owner: Any) -> Tf32LabError:
    where = _ENDED.get(owner)
    if where is not None:
        return Tf32LabError(f"{owner!r} was entered in {where}, which ended while it was open (that closed it), "
                            f"and exited in thread {threading.current_thread().name!r}; enter and exit it in the "
                            "same thread and task")
    return Tf32LabError(f"{owner!r} exited without being entered (or it was closed already)")


def _close(node: _Node, rebalance: bool = True) -> None:
    """Under the lock: ``node`` ends for every context that sees it."""
    node.alive = False
    holder = node.holder
    holder.nodes.remove(node)
    state = _STATE
    state.live -= 1
    if not holder.nodes and not holder.emulations:
        state.holders.pop(holder.key, None)
        if holder.thread == _get_ident():
            _drop_guard(holder.thread)
    if rebalance:
        state.rebalance()


class precision:
    """Run code under a float32 matmul precision level: ``"highest"``, ``"high"`` or ``"medium"``.

    A context manager and a decorator (plain and ``async def`` functions). Scopes nest; the level is local to
    the thread and the asyncio task; on exit, by exception too, every PyTorch flag is as it was. Real matmuls
    obey the scope: PyTorch's flags follow it, also when threads hold different levels at once. Exiting out of
    order (generators) works; exiting in another task or thread than the one that entered closes the scope and
    raises ``Tf32LabError``.

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

    __slots__ = ("__weakref__", "level")

    def __init__(self, level: str) -> None:
        self.level = check_level(level)

    def __repr__(self) -> str:
        # Dynamo (torch 2.6) writes the repr of a context manager it made with __new__ alone: no level yet
        return f"precision({getattr(self, 'level', '...')!r})"

    def __enter__(self) -> precision:
        # Every entry and exit pays what is written here: the common case (the process's only scope) is inlined
        # (_guard_wanted(), _holder(), begin(), give_back()), and the lock is taken by acquire() and release(),
        # cheaper than a with statement on CPython 3.11 (benchmarks/scope.py measures the whole against PyTorch's
        # own setter).
        level = self.level
        if level in EXTRA_LEVELS and _live(_EMULATION.get()) is None:
            _refuse_native(level)
        parent = _SCOPE.get()
        thread = _get_ident()
        task = _current_task() if _get_running_loop() is not None else None
        key = (thread, 0 if task is None else id(task))
        state = _STATE
        depth = _dispatch_depth()
        _acquire()
        try:
            if state.live == 0 and state.in_force is None and state.writer is None and not state.readers:
                # the only scope in the process (so no emulation either): no other holder, no guarded op
                guarded = state.pushed and state.tls.guard is not None  # none pushed: no thread-local read
                if not guarded and (thread != _MAIN or (_guard_choice or guard_policy()) == "always"
                                    or ((not _QUICK_THREADS or len(_SHUTDOWN_LOCKS) > _AT_REST or _LIMBO)
                                        and _other_threads())):
                    _push_guard(thread, depth)
                    guarded = True
                holder = _MAIN_HOLDER if task is None and thread == _MAIN else _holder(key, task)
                state.holders[key] = holder
                node = _new_node(_Node)  # _Node(level, self, parent, holder, None, depth) without its frame
                node.level, node.owner, node.parent, node.holder = level, self, parent, holder
                node.emulation, node.alive, node.depth = None, True, depth
                holder.nodes.append(node)
                state.live = 1
                effective = (_get_first(), _get_second()) if _TWO_CELLS else _read_effective()
                base = state.cache
                if base is None or base.effective != effective:  # the user changed the flag since (see begin())
                    base = state.cache = _Base.of(*flags.read_level_state())
                state.epoch += 1
                state.base = base
                state.public = base.level
                if level in _TORCH_LEVELS:
                    _write_torch_level(level)
                else:
                    _write_level(level)
                state.in_force = level
                state.contended = False
                state.unguarded = None if guarded else level
            else:
                emulation = _live(_EMULATION.get())
                if state.tls.guard is None and _guard_wanted(thread, key):
                    _push_guard(thread, depth)
                node = _Node(level, self, parent, _holder(key, task), emulation, depth)
                _opened(node.holder.nodes, node)
        finally:
            _release()
        _SCOPE.set(node)
        return self

    def __exit__(self, *exc: object) -> None:
        top = _SCOPE.get()
        state = _STATE
        if top is not None and top.owner is self and top.alive:
            _acquire()
            try:
                if state.live == 1 and state.writer is None and not state.readers and state.in_force is not None:
                    # the last scope of the process
                    top.alive = False
                    holder = top.holder
                    holder.nodes.pop()
                    del state.holders[holder.key]
                    state.live = 0
                    if state.pushed:
                        _drop_guard(holder.thread)
                    base = state.base
                    if base.as_level in _TORCH_LEVELS:
                        _write_torch_level(base.as_level)
                    elif base.as_level is not None:
                        _write_level(base.as_level)
                    else:
                        _write_raw(base.raw)
                    state.in_force = state.public = None
                    state.contended = False
                    state.unguarded = None
                else:
                    _close(top)
            finally:
                _release()
            parent = top.parent
            _SCOPE.set(parent if parent is None or parent.alive else _live(parent))
            return
        _exit(self, top, _SCOPE, "nodes", _close, "a scope applies only to the {where} that entered it")

    def __call__(self, fn: F) -> F:
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            raise TypeError(
                f"precision() cannot decorate the generator function {fn.__qualname__}: a scope open across "
                "yields would leak into the caller (a generator runs in its caller's context); enter "
                "`with precision(...)` inside the generator around the work between two yields, not across a yield"
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


# -- emulation: contexts that compute family ops themselves ----------------------------------------------------
def enter_emulation(owner: Any, entry: Any, on_close: Callable[[Emulation], None]) -> Emulation:
    """This context emulates from now on (its scopes stop voting); ``on_close(node)`` runs when it ends."""
    key, task = _context_key()
    parent = _EMULATION.get()
    with _STATE.lock:
        node = Emulation(owner, entry, parent, _holder(key, task), on_close)
        _opened(node.holder.emulations, node)
    _EMULATION.set(node)
    return node


def _opened(into: list, node: Any) -> None:
    """Under the lock: a node of a holder (a scope, or an emulate() block) is open; the flag follows the votes."""
    into.append(node)
    _STATE.live += 1
    _STATE.rebalance()


def _close_emulation(node: Emulation, rebalance: bool = True) -> None:
    node.alive = False
    holder = node.holder
    holder.emulations.remove(node)
    _STATE.live -= 1
    if not holder.nodes and not holder.emulations:
        _STATE.holders.pop(holder.key, None)
    try:
        node.on_close(node)
    finally:
        if rebalance:
            _STATE.rebalance()


def exit_emulation(owner: Any) -> None:
    """End ``owner``'s innermost block in this context (see :func:`_exit` for out of order and elsewhere)."""
    _exit(owner, _EMULATION.get(), _EMULATION, "emulations", _close_emulation,
          "emulation applies only to the {where} that entered it")


def _exit(owner: Any, top: Any, var: contextvars.ContextVar, kind: str, close: Callable, why: str) -> None:
    """Close ``owner``'s innermost open node: in this context's chain (out of order too: generators), else where it
    lives, in another task or thread, and then raise ``Tf32LabError`` (the node is closed all the same)."""
    node = top
    while node is not None and not (node.owner is owner and node.alive):
        node = node.parent
    state = _STATE
    if node is not None:
        innermost = node is _live(top)
        with state.lock:
            close(node)
        if innermost:
            var.set(_live(node.parent))
        return
    with state.lock:
        found = [n for h in state.holders.values() for n in getattr(h, kind) if n.owner is owner]
        if not found:
            raise _not_open(owner)
        node = found[-1]
        close(node)
    here = node.holder.thread == _get_ident()
    where = "task" if here else "thread"
    entered = "another task" if here else f"thread {thread_name(node.holder.thread)!r}"
    raise Tf32LabError(f"{owner!r} was entered in {entered} and exited in thread "
                       f"{threading.current_thread().name!r}; it is closed now, but {why.format(where=where)}: enter "
                       "and exit it there")


def current_emulation() -> Any:
    """What the emulator keeps for the ``emulate`` block active in this context, or None."""
    node = _EMULATION.get()
    if node is not None and not node.alive:
        node = _live(node)
    return None if node is None else node.entry


# -- reading and setting the level --------------------------------------------------------------------------------
def get_float32_matmul_precision() -> str:
    """The level in force for this thread/task: the innermost scope's, else the process level.

    Like ``torch.get_float32_matmul_precision`` but scope-aware, and it never raises for a mix of PyTorch's
    legacy and per-backend APIs (it reads the per-backend values where they exist). It takes no lock, so a
    helper thread may call it while any op runs.

    Example:

        >>> import tf32lab
        >>> tf32lab.get_float32_matmul_precision()
        'highest'
    """
    node = _SCOPE.get()
    if node is not None:
        if node.alive:
            return node.level
        node = _live(node)
        if node is not None:
            return node.level
    return _level_of_effective(_process_effective())


def _process_effective() -> tuple[str, ...]:
    """Effective level-cell values as the user set them for code outside scopes, whatever another thread's scope
    has written meanwhile. No lock: ``public`` is set before tf32lab writes the flag and cleared after it gives the
    user's values back, and ``epoch`` tells whether a write began while the flag was being read."""
    state = _STATE
    for _ in range(64):
        epoch = state.epoch
        if state.public is not None:
            return state.base.effective
        values = _read_effective()
        if state.epoch == epoch:
            return values
    with state.lock:  # a writer kept starting: wait for a quiet moment (never held while an op runs)
        return state.base.effective if state.public is not None else _read_effective()


class conv_math:
    """cuDNN's float32 convolution math for the block, ``"tf32"`` or ``"ieee"`` (None: left as it is), put back on
    every exit path. A level never sets it (``set_float32_matmul_precision`` leaves cuDNN alone); ``emulate()``
    reads it like any flag. PyTorch's cuDNN flag is process-wide: unlike a level, it applies to every thread while
    the block is open.

    Blocks of any threads and tasks stack and may close in any order: the flag holds the newest open block's math,
    and when the last one closes, the state the first one found comes back, but for each part of it (cuDNN's conv
    cell, its RNN cell, PyTorch's stored ``allow_tf32``) that no longer holds what the blocks last wrote: someone
    wrote that part meanwhile (``torch.backends.cudnn.rnn.fp32_precision = ...`` in another thread, say), and their
    write stays. A write of the very value the blocks wrote cannot be told from theirs, and is undone with them.
    While blocks are open, closing one writes the newest open block's math again.

    Example:

        >>> from tf32lab.control import flags
        >>> from tf32lab.control.scope import conv_math
        >>> with conv_math("ieee"):
        ...     flags.read_cells()["cuda.conv"]
        'ieee'
        >>> flags.read_cells()["cuda.conv"]    # PyTorch's default again
        'tf32'
    """

    __slots__ = ("_entered", "conv")

    def __init__(self, conv: Optional[str]) -> None:
        self.conv = check_conv(conv)
        self._entered: list[object] = []  # one token per entry of this object (it may be re-entered)

    def __enter__(self) -> conv_math:
        if self.conv is not None:
            token = object()
            with _STATE.lock:
                if not _CONV_OPEN:  # the first open block anywhere: what the process had, given back at the end
                    _CONV_BASE[:] = [flags.read_conv_state()]
                _CONV_OPEN.append((token, self.conv))
                _write_conv(self.conv)
            self._entered.append(token)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.conv is not None:
            token = self._entered.pop()
            with _STATE.lock:
                # Blocks of other threads or tasks may close in any order: the flag holds the newest open block's
                # math, and once none is open, what the process had before the first.
                _CONV_OPEN[:] = [(t, c) for t, c in _CONV_OPEN if t is not token]
                if _CONV_OPEN:
                    _write_conv(_CONV_OPEN[-1][1])
                else:  # each part someone wrote meanwhile (the conv cell, the RNN cell, the stored boolean) stays
                    base, written, now = _CONV_BASE.pop(), _CONV_WRITTEN.pop(), flags.read_conv_state()
                    flags.write_conv_state(tuple(b if n == w else n for b, w, n in zip(base, written, now)))


def _write_conv(conv: str) -> None:
    """Under the lock: write a block's math and remember the state it left (to tell a user's write later)."""
    flags.write_conv(conv)
    _CONV_WRITTEN[:] = [flags.read_conv_state()]


_CONV_OPEN: list[tuple[object, str]] = []  # every open conv_math block in the process, oldest first
_CONV_BASE: list[tuple[Any, ...]] = []  # the conv state before the first of them
_CONV_WRITTEN: list[tuple[Any, ...]] = []  # the conv state the blocks last wrote


def _refuse_native(level: str) -> None:
    """A one-line ``Tf32LabError`` when this torch cannot set ``level`` natively (``bfx9`` before pytorch#195301);
    nothing is written. Inside ``emulate()`` a scope never writes the flag, so it is not asked there."""
    reason = flags.native_refusal(level)
    if reason is not None:
        raise Tf32LabError(f"precision({level!r}): {reason}; inside emulate(target) it is emulated (enter emulate() "
                           f"first), e.g. tf32lab.emulate('b200')")


def set_float32_matmul_precision(level: str) -> None:
    """Set the process-wide level, as ``torch.set_float32_matmul_precision`` does, with validation.

    Works on every torch >= 2.4 whichever API generation it has, and never provokes PyTorch's "mix of legacy and
    new APIs" error, also when other code used the other API first. It sets the level that applies outside
    ``precision()`` scopes: a scope in force keeps its own level until it exits.

    Example:

        >>> import tf32lab
        >>> before = tf32lab.control.flags.snapshot()
        >>> tf32lab.set_float32_matmul_precision("high")
        >>> tf32lab.get_float32_matmul_precision()
        'high'
        >>> tf32lab.control.flags.restore(before)   # every flag exactly as it was
        >>> tf32lab.set_float32_matmul_precision("fastest")
        Traceback (most recent call last):
        ...
        tf32lab.errors.Tf32LabError: unknown level 'fastest'; accepted: 'highest', 'high', 'medium'

    Only PyTorch's own levels, as its setter: ``bfx9`` is a per-backend cell value, set in a scope
    (``tf32lab.precision("bfx9")``) or on ``torch.backends.cuda.matmul.fp32_precision``.
    """
    check_level(level, torch_only=True)
    _set_process(_VALUES[level], _RAW[level], level)


def _set_process(effective: tuple[str, ...], raw: tuple[str, ...], as_level: Optional[str]) -> None:
    state = _STATE
    with state.lock:
        state.wait_writable()
        if state.in_force is None:
            if as_level is not None:
                _write_level(as_level)  # PyTorch's own setter: its legacy getter stays consistent
            else:
                _write_raw(raw)
                state.cache = None
                return
        else:  # applies once the scopes end; meanwhile to unscoped code when the votes disagree
            state.epoch += 1
            state.base = _Base(effective, raw, as_level, _level_of_effective(effective))
            state.public = state.base.level
            state.rebalance()
        state.cache = _Base(effective, raw, as_level, _level_of_effective(effective))


def live_scopes() -> int:
    """How many ``precision()`` scopes are open now, in every thread and task."""
    with _STATE.lock:
        return sum(len(holder.nodes) for holder in _STATE.holders.values())


def write_process_state(raw: tuple[str, ...]) -> None:
    """Write raw level-cell values (from ``flags.read_level_state()``) as the process-wide setting.

    For putting back exactly what an earlier setter replaced, inheritance (``"none"``) included. Inside scopes it
    sets what applies once they end, as :func:`set_float32_matmul_precision` does.
    """
    raw = tuple(raw)
    _set_process(flags.effective_from_raw(raw), raw, _LEVEL_OF_RAW.get(raw))


def process_cells() -> dict[str, str]:
    """Effective values of the level cells as the user set them for code outside scopes (``"cuda.matmul"`` and
    ``"mkldnn.matmul"``), whatever another thread's scope has written to the flag meanwhile."""
    values = _process_effective()
    if not _CELL_INDEX:  # the legacy API: one level for every backend
        return level_cells(values[0])
    values = _as_ieee(values)
    return {name: values[i] for name, i in _CELL_INDEX.items()}


def open_nodes() -> frozenset:
    """Every open scope and ``emulate()`` block, in every thread and task (a test harness's "before")."""
    with _STATE.lock:
        return frozenset(n for h in _STATE.holders.values() for n in (*h.nodes, *h.emulations))


def close_since(before: frozenset) -> int:
    """Close every scope and ``emulate()`` block opened since ``before`` (:func:`open_nodes`) and still open: what
    a test left behind, so the next one does not run under it. Returns how many were closed."""
    with _STATE.lock:
        leaked = [n for n in open_nodes() if n not in before]
        for node in leaked:
            if isinstance(node, Emulation):
                _close_emulation(node, rebalance=False)
            else:
                _close(node, rebalance=False)
        if leaked:
            _STATE.rebalance()
    return len(leaked)


def is_guard(mode: Any) -> bool:
    """Whether ``mode`` is a thread's guard: tf32lab's own, put on and taken off by the scopes."""
    return isinstance(mode, _Guard)


def drop_idle_guard() -> bool:
    """Take this thread's guard off its stack if none of its contexts holds a scope any more (one left behind by
    a scope closed from its own handler, or by :func:`close_since`); True if it was."""
    with _STATE.lock:
        guard = _STATE.tls.guard
        if guard is None:
            return False
        _drop_guard(_get_ident())
        return _STATE.tls.guard is None


def context_level() -> Optional[str]:
    """The level of the innermost scope of this thread/task, or None outside scopes (no Python frame walk)."""
    node = _SCOPE.get()
    if node is not None and not node.alive:
        node = _live(node)
    return None if node is None else node.level


def census() -> dict[str, int]:
    """What this process holds now, for diagnostics: open ``precision()`` scopes, threads and tasks with scope
    bookkeeping (``holders``: none left once every scope has closed), and threads with a guard pushed.

    >>> census()
    {'scopes': 0, 'holders': 0, 'guards': 0}
    """
    with _STATE.lock:
        scopes = sum(len(holder.nodes) for holder in _STATE.holders.values())
        return {"scopes": scopes, "holders": len(_STATE.holders), "guards": len(_STATE.guards)}


def forget_flags_cache() -> None:
    """Read PyTorch's raw flag cells afresh next time. The user's values outside scopes are cached and checked
    against the *effective* values; code that rewrites a raw cell to another spelling of the same effective value
    (``"none"`` for an inherited ``"ieee"``) behind tf32lab's back, as a framework's set-up or a test fixture may,
    calls this so that what tf32lab puts back afterwards is exactly that spelling."""
    with _STATE.lock:
        _STATE.cache = None
