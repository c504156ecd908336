"""How a :class:`~tf32lab.control.policy.Policy` is applied to a model (``policy.apply(model)``): each module
with a level of its own has its ``forward`` wrapped (``_Pinned``) to run inside ``precision(level)`` and, where
it pins one, ``conv_math``; the autograd nodes that forward created are tagged, and a dispatch mode runs each
tagged node's backward at the same level. The handle (:class:`PolicyHandle`) re-matches the model when a module was
replaced, added or taken out, and takes everything off again.

``tf32lab.control.policy`` holds the policy as data (rules, matching, files) and re-exports what is public here
(``PolicyHandle``, ``applied_to``, ``applied_policies``, each with its example); docs/design.md ("policy") says
what it costs.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import weakref
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tf32lab.control import modestack
from tf32lab.control.scope import conv_math, is_sensitive, precision
from tf32lab.errors import Tf32LabError
from tf32lab.know import optable
from tf32lab.know.levels import ALL_LEVELS, CONV_MATHS
from tf32lab.numbers.naming import module_kind
from tf32lab.numbers.trees import named_tensors, operand_tensors

__all__ = ["PolicyHandle", "applied_policies", "applied_to", "hooked_names"]

# A ``tf32lab.control.policy.Policy`` and one of its ``Rule``s: that module applies a policy through this one, so
# they are named, not imported, not even for type checking (tests/test_layers.py: no import circle).
Policy = Rule = Any

_TAG = "tf32lab.level"  # key in an autograd node's metadata: the level its backward runs at (None: the caller's)
_CONV_TAG = "tf32lab.conv"  # and its conv math, when one is pinned
_LEAF = 1 << 63  # AccumulateGrad nodes carry the largest sequence number; they compute nothing to tag


def hooked_names(assignments: list[tuple[Any, Optional[str]]]) -> list[str]:
    """The names of the modules whose level or conv math differs from their parent's (the model: where it has one)."""
    by_name = {a.name: a for a, _ in assignments}
    return [a.name for a, parent in assignments if (a.level is not None or a.conv is not None) and (
        parent is None or (by_name[parent].level, by_name[parent].conv) != (a.level, a.conv))]


class _Frame:
    """A policy module's forward running on this thread: its level and conv math (None: the caller's), and for its
    backward tags the dispatch stack's height and the autograd sequence number when it began."""

    __slots__ = ("conv", "depth", "handle", "level", "module", "start")

    def __init__(self, handle: PolicyHandle, level: Optional[str], conv: Optional[str], depth: int,
                 start: int, module: int = 0) -> None:
        self.handle, self.level, self.conv, self.depth, self.start = handle, level, conv, depth, start
        self.module = module  # the id of the module whose forward this is


class _Open(threading.local):
    """Per thread: the policy frames open now, innermost last; and the autograd nodes of ops that ran at the level
    of their weight's module (sequence number -> level, conv math), for the frame that tags them."""

    def __init__(self) -> None:
        self.frames: list[_Frame] = []
        self.elevated: dict[int, tuple[Optional[str], Optional[str]]] = {}


_OPEN = _Open()
_APPLIED: weakref.WeakKeyDictionary[torch.nn.Module, PolicyHandle] = weakref.WeakKeyDictionary()
_APPLIED_LOCK = threading.RLock()
_dispatch_depth = torch._C._len_torch_dispatch_stack


class _Deciding(threading.local):
    active: bool = False  # set while a backward op runs under a node's level: outer nodes' modes defer


_DECIDING = _Deciding()
_CUDNN: dict[Any, bool] = {}  # op -> whether cuDNN's conv flag may decide its math (conv, rnn, ops outside aten)


def _follows_cudnn(func: Any) -> bool:
    known = _CUDNN.get(func)
    if known is None:
        name = func.name()
        known = _CUDNN[func] = optable.family(name) in ("conv", "rnn") or not name.startswith("aten::")
    return known


@modestack.skips_dynamo_lazily
class _NodeLevel(TorchDispatchMode):
    """Pushed by a tagged autograd node's pre-hook, for that node only: its family ops run at the node's level,
    and its convolutions (ops cuDNN's conv flag decides) at the node's conv math."""

    def __init__(self, level: Optional[str], conv: Optional[str]) -> None:
        super().__init__()
        self.level, self.conv = level, conv

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _DECIDING.active or not is_sensitive(func):
            return func(*args, **kwargs)
        frames = _OPEN.frames
        # A policy module's forward that began inside this node (a non-reentrant checkpoint recomputing it while
        # the node unpacks what it saved) keeps its own level: the frame was opened above this mode on the stack
        # (in a handler, the stack's height is the mode's own index).
        if frames and (frames[-1].level is not None or frames[-1].conv is not None) \
                and frames[-1].depth > _dispatch_depth():
            return func(*args, **kwargs)
        level = self.level
        conv = self.conv if self.conv is not None and _follows_cudnn(func) else None
        if level is None and conv is None:  # a node that pins only convolutions, at another op
            return func(*args, **kwargs)
        _DECIDING.active = True
        try:
            if conv is None:  # the usual node: a level only, as before conv maths were pinned
                with precision(level):  # type: ignore[arg-type]  # (set: not both are None)
                    return func(*args, **kwargs)
            # (a fresh conv_math block per op: one object entered by two threads could close the other's block)
            with (precision(level) if level is not None else contextlib.nullcontext()), conv_math(conv):
                return func(*args, **kwargs)
        finally:
            _DECIDING.active = False


_PINS = [(level, conv) for level in (None, *ALL_LEVELS) for conv in (None, *CONV_MATHS)
         if level is not None or conv is not None]  # what a node may be tagged with
_NODE_MODES = {pin: _NodeLevel(*pin) for pin in _PINS}


def _node_prehook(pin: tuple[Optional[str], Optional[str]]):
    mode = _NODE_MODES[pin]
    push = torch._C._push_on_torch_dispatch_stack

    def hook(grad_outputs):
        # The engine restores this thread's modes after the node, exception or not: no pop needed (or possible).
        push(mode)

    return hook


_PREHOOKS = {pin: _node_prehook(pin) for pin in _PINS}
_PRECISION = {level: i for i, level in enumerate(ALL_LEVELS)}  # most accurate first


def _owned(tree: _Tree, args: Any, found: list) -> None:
    """The owner entries of ``tree`` for the parameters among ``args`` (a view of one included), into ``found``."""
    for a in args:
        if isinstance(a, torch.Tensor):
            base = a._base if a._base is not None else a
            entry = tree.owners.get(id(base))
            if entry is not None and entry[0]() is base:
                found.append(entry)
        elif isinstance(a, (list, tuple)):
            _owned(tree, a, found)


@modestack.skips_dynamo_lazily
class _Owners(TorchDispatchMode):
    """Pushed around a policy module's forward where ops may use another module's parameters (the first call of
    a matched tree, to find out; then only the frames where one did): an op of a flag-sensitive family whose
    operands include a parameter of a module with another level or conv math runs at that module's
    (``nn.MultiheadAttention`` hands ``out_proj.weight`` to its functional attention and never calls
    ``out_proj``). Operands of several modules: the most accurate of their levels, and IEEE convolutions if any
    pins them. Every module whose parameters an op used is noted as reached."""

    def __init__(self, tree: _Tree) -> None:
        super().__init__()
        self.tree = tree

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tree = self.tree
        if _DECIDING.active or not tree.owners or not is_sensitive(func):
            return func(*args, **kwargs)
        found: list = []
        _owned(tree, args, found)
        _owned(tree, kwargs.values(), found)
        frames = _OPEN.frames
        if not found or not frames:
            return func(*args, **kwargs)
        top = frames[-1]
        pins = {(entry[1], entry[2]) for entry in found}
        if pins == {(top.level, top.conv)}:  # run inside their own module, or at its level anyway
            tree.reached.update(entry[3] for entry in found)
            return func(*args, **kwargs)
        levels = [level for level, _ in pins if level is not None]
        level = min(levels, key=_PRECISION.__getitem__) if levels else top.level
        convs = {conv for _, conv in pins if conv is not None}
        conv = ("ieee" if "ieee" in convs else convs.pop()) if convs else top.conv
        cudnn_op = _follows_cudnn(func)
        tree.reached.update(entry[3] for entry in found  # where the op runs at its module's pin, not another's
                            if entry[1] in (None, level) and (entry[2] is None or not cudnn_op or entry[2] == conv))
        if (level, conv) == (top.level, top.conv):
            return func(*args, **kwargs)
        tree.foreign.add(top.module)  # this frame needs the mode at later calls too
        if torch.is_grad_enabled() and any(t.requires_grad for t in operand_tensors(args)):
            # autograd made this op's node just before it reached the modes: its backward runs at the same level
            _OPEN.elevated[_sequence_nr() - 1] = (level, conv)
        cudnn = conv if conv is not None and cudnn_op else None
        with (precision(level) if level is not None else contextlib.nullcontext()), \
                (conv_math(cudnn) if cudnn is not None else contextlib.nullcontext()):
            return func(*args, **kwargs)


def _tag(output: Any, start: int, level: Optional[str], conv: Optional[str] = None) -> None:
    """Tag the autograd nodes created since sequence number ``start`` that lead to ``output`` and have no level yet
    (those of nested modules with a level or conv math of their own are tagged already, at their own forward's
    end) with ``level`` and ``conv`` (both None: only the nodes of ops that ran at their weight's level)."""
    todo = [t.grad_fn for _, t in named_tensors(output) if t.grad_fn is not None]
    # Each visit gets a fresh Python wrapper of the C++ node: keep the ones seen alive, or a freed wrapper's id is
    # reused by the next one and a node is skipped untagged (seen on CUDA: the default level's nodes ran untagged).
    seen: dict[int, Any] = {}
    elevated = _OPEN.elevated  # nodes of ops that ran at their weight's module's level (_Owners) get that one
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        number = node._sequence_nr()
        if number < start or number >= _LEAF:
            continue
        metadata = node.metadata
        if _TAG not in metadata:
            pin = elevated.pop(number, None) if elevated else None
            node_level, node_conv = pin if pin is not None else (level, conv)
            if node_level is not None or node_conv is not None:
                metadata[_TAG] = node_level
                if node_conv is not None:
                    metadata[_CONV_TAG] = node_conv
                node.register_prehook(_PREHOOKS[(node_level, node_conv)])
        todo.extend(fn for fn, _ in node.next_functions)


_sequence_nr = torch._C._autograd._get_sequence_nr


def _unwrapped(forward: Any) -> Any:
    return forward


class _Pinned:
    """Stands in for a module's ``forward`` while a policy is applied: the forward runs at the level the policy
    gives that module in the model as it is at call time, however the module is called (through its parent, or
    directly, as CLIP's ``encode_image`` calls ``self.visual``).

    A wrapper of ``forward`` rather than forward hooks: a hook pair cannot close a scope when a BaseException
    (KeyboardInterrupt) escapes the forward, since PyTorch runs ``always_call`` hooks on ``Exception`` only.
    A copy or a pickle of the module gets its plain ``forward`` back: a copy is not under the policy.
    """

    __slots__ = ("__weakref__", "forward", "handle", "module", "own")

    def __init__(self, handle: PolicyHandle, module: torch.nn.Module) -> None:
        own = module.__dict__.get("forward")  # someone else's wrapper (accelerate's, say) stays inside ours
        self.own = own is not None
        self.forward = own  # else the class's, bound at each call: no reference cycle through a bound method
        self.handle: Optional[PolicyHandle] = handle  # None once taken off: a wrapper kept by others calls through
        self.module = weakref.ref(module)

    @property
    def __wrapped__(self) -> Any:  # inspect.signature(module.forward) sees the real one
        module = self.module()
        return self.forward if self.own or module is None else type(module).forward.__get__(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = _CALL[0]
        if call is None:
            call = _call
            dynamo = sys.modules.get("torch._dynamo")
            if dynamo is not None and hasattr(dynamo, "disable"):
                # A compiled model graph-breaks here and each module's forward compiles on its own (Dynamo cannot
                # trace the scope's contextvars and locks). Until torch._dynamo is loaded nothing compiles, and
                # importing it (71 MiB) just for this is not ours to do.
                call = _CALL[0] = dynamo.disable(_call, recursive=False)
        return call(self, args, kwargs)

    def __reduce__(self) -> Any:
        module = self.module()
        if self.own or module is None:
            return (_unwrapped, (self.forward,))
        return (getattr, (module, "forward"))  # rebuilt before the module's state: the class's forward


def _call(pinned: _Pinned, args: tuple, kwargs: dict) -> Any:
    """A module's forward at its level (see :class:`_Pinned`)."""
    module = pinned.module()
    if module is None:  # only a copy that kept this object could call it now
        raise Tf32LabError("this forward belongs to a module that no longer exists")
    forward = pinned.forward if pinned.own else type(module).forward.__get__(module)
    handle = pinned.handle
    if handle is None:
        return forward(*args, **kwargs)
    frames = _OPEN.frames
    top = frames[-1] if frames else None
    # The outermost frame of this policy on the thread checks the model against the one it matched last.
    tree = handle._tree if top is not None and top.handle is handle else handle._current()
    entry = tree.members.get(id(module))
    if entry is None or entry[0]() is not module:  # taken out of the model: no longer the policy's
        return forward(*args, **kwargs)
    level, conv = entry[1], entry[2]
    key = id(module)
    tree.ran.add(key)
    # ops using other modules' parameters: looked for under the first call of a tree, then where one was found
    owners = _Owners(tree) if tree.owners and (key in tree.foreign or (
        not tree.probed and (top is None or top.handle is not handle))) else None
    if owners is None and top is not None and top.handle is handle and top.level == level and top.conv == conv \
            and top.depth == _dispatch_depth():
        return forward(*args, **kwargs)  # inside its parent's frame at the same level: covered by it
    # The scope and the conv block close on every exit, a BaseException (KeyboardInterrupt) included. (One frame:
    # Dynamo skips this function's own code only.)
    scope = None
    if level is not None:
        scope = precision(level)
        scope.__enter__()
    try:
        block = None
        if conv is not None:  # cuDNN's flag is the process's: conv_math stacks blocks of any thread, in any order
            block = conv_math(conv)
            block.__enter__()
        try:
            frame = _Frame(handle, level, conv, _dispatch_depth(), _sequence_nr(), key)
            frames.append(frame)
            try:
                if owners is None:
                    output = forward(*args, **kwargs)
                else:
                    with owners:
                        output = forward(*args, **kwargs)
                if (level is not None or conv is not None or _OPEN.elevated) and output is not None \
                        and torch.is_grad_enabled():
                    _tag(output, frame.start, level, conv)
                return output
            finally:
                if frames and frames[-1] is frame:
                    frames.pop()
                else:  # closed out of order (not in a plain call; never leave it behind)
                    with contextlib.suppress(ValueError):
                        frames.remove(frame)
                if owners is not None and not tree.probed and not any(f.handle is handle for f in frames):
                    tree.probed = True  # the first whole call looked: later calls push _Owners where it acted
                if not frames:
                    _OPEN.elevated.clear()
        finally:
            if block is not None:
                block.__exit__(None, None, None)
    finally:
        if scope is not None:
            scope.__exit__(None, None, None)


_CALL: list[Any] = [None]  # _call, skipped by Dynamo once it is loaded


def _wrap(module: torch.nn.Module, handle: PolicyHandle) -> _Pinned:
    pinned = _Pinned(handle, module)
    module.__dict__["forward"] = pinned
    return pinned


def _unwrap(module: torch.nn.Module, pinned: _Pinned) -> None:
    pinned.handle = None
    if module.__dict__.get("forward") is pinned:
        if pinned.own:
            module.__dict__["forward"] = pinned.forward
        else:
            del module.__dict__["forward"]


class _Tree:
    """The model as a handle matched it: each module's level and conv math (by ``id``, with a weak reference to
    tell a new module at a reused address), the modules where either changes, and each module's children to see a
    change."""

    __slots__ = ("foreign", "hooked", "members", "owners", "probed", "ran", "reached", "shape")

    def __init__(self) -> None:
        self.members: dict[int, tuple[weakref.ref, Optional[str], Optional[str]]] = {}
        self.hooked: list[str] = []
        self.shape: list[tuple[weakref.ref, tuple[str, ...], tuple[int, ...]]] = []
        # parameter id -> (its weak reference, its module's level and conv math, the module's id): where the
        # policy gives modules different pins, for ops that use a module's parameters outside its forward
        self.owners: dict[int, tuple[weakref.ref, Optional[str], Optional[str], int]] = {}
        self.probed = False  # whether a first call has looked for such ops (under _Owners)
        self.foreign: set[int] = set()  # the modules whose forward ran one: _Owners is pushed there from then on
        self.ran: set[int] = set()  # ids of the wrapped modules whose forward ran
        self.reached: set[int] = set()  # ids of the modules whose parameters an op used (seen under _Owners)

    def changed(self) -> bool:
        for ref, names, ids in self.shape:
            module = ref()
            if module is None:
                return True
            children = module._modules
            if tuple(children) != names or tuple(map(id, children.values())) != ids:
                return True
        return False


def _collected(handle_ref: weakref.ref) -> Any:
    def callback(_: Any) -> None:
        handle = handle_ref()
        if handle is not None:
            handle._stale = True

    return callback


def _on_register(parent: torch.nn.Module, name: Optional[str], child: Any) -> None:
    """PyTorch's hook for every submodule assigned (``model.head = ...``, ``add_module``), and ours for
    ``insert``: a module put into a model under a policy is wrapped at once, so a direct call of it finds the model
    changed and re-matches it, and it counts as the model's at once, so a module assigned into it in turn is too
    (``model.new = Module()``, then ``model.new.extra = ...``)."""
    handle = _APPLIED.get(parent)
    if handle is None or handle._removed or not isinstance(child, torch.nn.Module):
        return None
    with _APPLIED_LOCK:
        handle._stale = True
        for module in child.modules():
            owner = _APPLIED.get(module)
            if owner is not None and owner is not handle and not owner._removed:
                continue  # another policy's: the model's next call says so (one module takes one policy)
            if owner is None:
                _APPLIED[module] = handle
                handle._pending.append(weakref.ref(module))
            held = handle._wrapped.get(id(module))
            # (an entry of a freed module whose id came back for this one is stale: the weak reference tells)
            if (held is None or held[0]() is not module) and not isinstance(module, torch.jit.ScriptModule) \
                    and not isinstance(module.__dict__.get("forward"), _Pinned):
                handle._wrapped[id(module)] = (weakref.ref(module), _wrap(module, handle))
    return None


def _announcing(insert: Any) -> Any:
    @functools.wraps(insert)
    def announced(self: torch.nn.Module, index: int, module: torch.nn.Module) -> Any:
        out = insert(self, index, module)
        if _APPLIED:  # some policy is applied somewhere: one dictionary lookup
            _on_register(self, None, module)
        return out

    announced._tf32lab_announces = True  # type: ignore[attr-defined]
    return announced


_REGISTRATION: list[Any] = []


def _watch_registrations() -> None:
    """Once per process: PyTorch's registration hook (a dictionary lookup per submodule assigned anywhere), and
    the same announcement from ``ModuleList.insert`` and ``Sequential.insert``, which write the container's
    ``_modules`` directly, so the hook never fires for them. Wrapping those two methods costs nothing per forward
    and leaves every model's state as it is (a copy or a pickle holds no trace of it); the alternatives were a
    global forward pre-hook (every module call of every model in the process through PyTorch's slow path, and the
    call it catches already bound to the plain forward) or a watching dict in each ``_modules`` (in the model's
    state, and replaced wholesale by ``del container[i]``). Code that writes ``_modules`` itself announces nothing:
    such a module gets its level from the next call of any module of the model."""
    if _REGISTRATION:
        return
    _REGISTRATION.append(torch.nn.modules.module.register_module_module_registration_hook(_on_register))
    for container in (torch.nn.ModuleList, torch.nn.Sequential):
        insert = container.__dict__.get("insert")
        if insert is not None and not getattr(insert, "_tf32lab_announces", False):
            container.insert = _announcing(insert)  # type: ignore[method-assign]


def applied_to(module: torch.nn.Module) -> Optional[Policy]:
    """The policy applied to ``module`` or to a module inside it (or to a model it is part of), else None.

    Cheap (no forward run): for a measurement that must refuse, or lift, a policy the user applied rather than
    measure it without saying so.

    Example:

        >>> import torch, tf32lab
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        >>> with tf32lab.Policy("high").applied(model):
        ...     tf32lab.control.policy.applied_to(model[0])
        Policy(default='high', rules=())
        >>> tf32lab.control.policy.applied_to(model) is None
        True
    """
    if not isinstance(module, torch.nn.Module):
        raise Tf32LabError(f"applied_to takes a torch.nn.Module, not {type(module).__name__}")
    with _APPLIED_LOCK:
        for m in module.modules():
            handle = _owner(m)
            if handle is not None:
                return handle.policy
    return None


def applied_policies() -> list[Policy]:
    """Every policy applied in this process now (each once, in no set order): what ranks of a job compare.

    Example:

        >>> import torch, tf32lab
        >>> from tf32lab.control.policy import applied_policies
        >>> with tf32lab.Policy("high").applied(torch.nn.Linear(2, 2)):
        ...     [p.default for p in applied_policies()]
        ['high']
    """
    with _APPLIED_LOCK:
        handles = {id(h): h for h in list(_APPLIED.values()) if not h._removed}
    return [h.policy for h in handles.values()]


def _owner(module: torch.nn.Module, but: Optional[PolicyHandle] = None) -> Optional[PolicyHandle]:
    """The live handle whose model holds ``module`` now (its model re-matched first if it changed); under the lock."""
    handle = _APPLIED.get(module)
    if handle is None or handle is but or handle._removed:
        return None
    if handle._stale or handle._tree.changed():
        with contextlib.suppress(Tf32LabError):  # that model's own problem, told when it runs
            handle._current()
    handle = _APPLIED.get(module)
    return None if handle is None or handle is but or handle._removed else handle


class PolicyHandle:
    """A policy applied to a model: ``remove()`` takes it off (graphs built meanwhile keep their levels).

    The policy follows the model as it is when called: a module replaced, added or taken out after ``apply()``
    is matched again at the next call (a module taken out is the policy's no longer). ``hooked`` names the modules
    whose level or conv math differs from their parent's.
    """

    def __init__(self, policy: Policy, model: torch.nn.Module) -> None:
        self.policy, self._model = policy, weakref.ref(model)
        self._wrapped: dict[int, tuple[weakref.ref, _Pinned]] = {}
        self._tree = _Tree()
        self._stale = False
        self._removed = False
        self._pending: list[weakref.ref] = []  # modules claimed as they were put in, until the model is matched
        with _APPLIED_LOCK:
            taken = next((name for name, m in model.named_modules() if _owner(m) is not None), None)
            if taken is not None:
                raise Tf32LabError(f"module {taken or module_kind(model)!r} already has a policy applied; "
                                   "remove it (handle.remove()) before applying another")
            try:
                self._tree = self._match(model)
            except BaseException:
                self._take_off()
                raise
            _watch_registrations()

    @property
    def hooked(self) -> list[str]:
        return list(self._tree.hooked)

    def __repr__(self) -> str:
        state = "removed" if self._removed or self._model() is None else "applied"
        return f"<PolicyHandle {state}: {len(self._tree.hooked)} module(s) hooked>"

    def idle(self) -> list[Rule]:
        """The rules that have not acted in the model's calls so far: no module that takes its level or conv math
        from the rule (itself or through its parent) ran its forward, and no matmul-family op ran at its pin with
        its parameters (a module kept but never called; or weights only a fused op used, at a more accurate
        module's level: ``nn.TransformerEncoderLayer``'s eval fast path). Empty before the model's first call.

        Example:

            >>> import torch, tf32lab
            >>> class Net(torch.nn.Module):
            ...     def __init__(self):
            ...         super().__init__()
            ...         self.a, self.unused = torch.nn.Linear(4, 4), torch.nn.ReLU()
            ...     def forward(self, x):
            ...         return self.a(x)
            >>> model = Net()
            >>> with tf32lab.Policy("high", [("a", "highest"), ("unused", "highest")]).applied(model) as handle:
            ...     _ = model(torch.randn(2, 4))
            ...     handle.idle()
            [Rule(pattern='unused', level='highest')]
        """
        model, tree = self._model(), self._tree
        if model is None or not tree.ran:
            return []
        acted = tree.ran | tree.reached
        modules = dict(model.named_modules())
        origin: dict[str, tuple[Optional[int], Optional[int]]] = {}  # the rules that gave a module's level, conv
        done: set[Optional[int]] = set()
        for a, parent in self.policy._assignments(model):
            above = origin.get(parent, (None, None)) if parent is not None else (None, None)
            origin[a.name] = tuple(int(source.split(" ", 2)[1]) if source.startswith("rule ") else inherited
                                   for source, inherited in zip((a.source, a.conv_source), above))
            if id(modules[a.name]) in acted:
                done.update(origin[a.name])
        return [rule for i, rule in enumerate(self.policy.rules, 1) if i not in done]

    def _current(self) -> _Tree:
        """The model's tree, matched again if it changed since (the caller is the outermost frame of this policy
        on its thread: nested modules trust it)."""
        tree = self._tree
        if not (self._stale or tree.changed()):
            return tree
        with _APPLIED_LOCK:
            model = self._model()
            if self._removed or model is None:
                return self._tree
            self._stale = False
            try:
                self._tree = self._match(model)
            except BaseException:
                self._stale = True  # told again at the next call, until the model is fixed or the policy removed
                raise
            return self._tree

    def _match(self, model: torch.nn.Module) -> _Tree:
        """Under the lock: match the policy to the model as it is now, wrap the modules that need it, unwrap the
        others, and register every module of the model as this policy's."""
        policy = self.policy
        assignments = policy._assignments(model)
        modules = dict(model.named_modules())
        tree = _Tree()
        tree.hooked = hooked_names(assignments)
        hooked = set(tree.hooked)
        wanted: dict[int, torch.nn.Module] = {}
        on_collect = _collected(weakref.ref(self))
        for a, _ in assignments:
            module = modules[a.name]
            other = _owner(module, but=self)
            if other is not None:
                other_model = other._model()
                raise Tf32LabError(
                    f"module {a.name or module_kind(model)!r} of {module_kind(model)} is also in "
                    f"{module_kind(other_model) if other_model is not None else 'another model'}, which has "
                    "another policy applied: one module takes one policy; remove that one first")
            ref = weakref.ref(module, on_collect)
            tree.members[id(module)] = (ref, a.level, a.conv)
            if isinstance(module, torch.jit.ScriptModule):  # its submodules are fixed by the compiler
                if a.name in hooked:
                    what = " and ".join(filter(None, (a.level and f"level {a.level!r}",
                                                      a.conv and f"conv math {a.conv!r}")))
                    inside = ", ".join(filter(None, (a.level and f"tf32lab.precision({a.level!r})",
                                                     a.conv and f"tf32lab.control.scope.conv_math({a.conv!r})")))
                    raise Tf32LabError(
                        f"module {a.name or module_kind(model)!r} is TorchScript, which takes no hooks, so a "
                        f"policy cannot give it {what}: apply the policy to the eager model, or call it inside "
                        f"{inside}")
                continue  # at its parent's level: runs inside its parent's scope (called directly: the caller's)
            tree.shape.append((ref, tuple(module._modules), tuple(map(id, module._modules.values()))))
            # the model itself always: its call checks for changes
            if a.level is not None or a.conv is not None or not a.name:
                wanted[id(module)] = module
        if len({(a.level, a.conv) for a, _ in assignments}) > 1:  # modules at different pins: whose weights
            for a, _ in assignments:
                module = modules[a.name]
                for p in module._parameters.values():
                    if p is not None:
                        known = tree.owners.get(id(p))
                        if known is None or (a.level is not None and known[1] is not None
                                             and _PRECISION[a.level] < _PRECISION[known[1]]):
                            tree.owners[id(p)] = (weakref.ref(p), a.level, a.conv, id(module))  # tied: accurate
        for key, (ref, pinned) in list(self._wrapped.items()):
            module = ref()
            if module is None or wanted.get(key) is not module or module.__dict__.get("forward") is not pinned:
                if module is not None:
                    _unwrap(module, pinned)
                del self._wrapped[key]
        for key, module in wanted.items():
            if key not in self._wrapped:
                self._wrapped[key] = (weakref.ref(module), _wrap(module, self))
        for ref in [entry[0] for entry in self._tree.members.values()] + self._pending:
            module = ref()
            if module is not None and id(module) not in tree.members and _APPLIED.get(module) is self:
                del _APPLIED[module]  # taken out (or put in and taken out again before this call)
        self._pending.clear()
        for module in modules.values():
            _APPLIED[module] = self
        return tree

    def _take_off(self) -> None:
        for ref, pinned in self._wrapped.values():
            module = ref()
            pinned.handle = None
            if module is not None:
                _unwrap(module, pinned)
        self._wrapped.clear()

    def remove(self) -> None:
        """Take the policy off the model (again: nothing happens)."""
        with _APPLIED_LOCK:
            self._removed = True
            self._take_off()
            for ref in [entry[0] for entry in self._tree.members.values()] + self._pending:
                module = ref()
                if module is not None and _APPLIED.get(module) is self:
                    del _APPLIED[module]
            self._pending.clear()

    def __enter__(self) -> PolicyHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
