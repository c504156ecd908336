"""``emulate(target)``: compute every matmul-family op as the target GPU would, on any machine.

Inside ``with emulate("a100"):`` a thread-local ``TorchDispatchMode`` catches every float32 op of the matmul,
conv, rnn, attention and matvec families, asks ``targets`` which math the target assigns under the scope and
flags in force for this thread, and computes it: operands rounded as the hardware rounds them (``formats``),
products and accumulation in IEEE float32, as the tensor cores do (products of TF32 or bf16 values are exact in
float32). Split maths (``tf32x3``, ``bf16x3``) sum three products. Non-float32 ops pass through.

The op table lives in ``tf32lab.rules`` (one registry, filled by ``@rule``). An op that belongs to a family (by
name, ``tf32lab.families``) but has no rule is first decomposed into ops that do; if it cannot be, it runs
natively and is counted in ``unhandled`` (``strict=True``: it raises), so silence never passes for success.

Example:

    >>> import torch, tf32lab
    >>> a, b = torch.tensor([[1024.5]]), torch.tensor([[1.0]])
    >>> with tf32lab.precision("high"), tf32lab.emulate("a100") as emu:
    ...     (a @ b).item()                 # cuBLAS rounds operands to TF32, ties away from zero
    1025.0
    >>> with tf32lab.emulate("a100"):
    ...     (a @ b).item()                 # "highest": IEEE float32, as on the GPU
    1024.5
    >>> dict(emu.coverage)
    {('aten::mm', 'tf32-rna'): 1}
"""

from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from . import flags, formats, rules, scope
from .errors import Tf32LabError
from .families import family_of
from .levels import BACKEND_VALUES
from .targets import KEYS, MATHS, Math, Target, get, sdpa_kernel

__all__ = ["emulate", "maths"]

_F32 = torch.float32
_SINGLE_ROUND = {"tf32": formats.round_tf32, "bf16": formats.round_bf16}
_SPLIT = {"tf32x3": formats.split_tf32x3, "bf16x3": formats.split_bf16x3}

_local = threading.local()  # .family: a family forced on matmul ops (an RNN's GEMMs are the rnn family's)


@contextlib.contextmanager
def as_family(family: str):
    """Ops of the matmul family run inside count as ``family`` (an RNN's GEMMs run in cuDNN's RNN kernel)."""
    before = getattr(_local, "family", None)
    _local.family = family
    try:
        yield
    finally:
        _local.family = before


# -- the stance of torch.compile: compiled code would run kernels we never see ----------------------------------
_stance_lock = threading.Lock()
_stance_users = 0
_stance_before: Any = None


def _force_eager() -> None:
    global _stance_users, _stance_before
    with _stance_lock:
        if _stance_users == 0:
            try:
                from torch._dynamo import eval_frame
            except ImportError:  # a torch without dynamo has nothing to force
                eval_frame = None
            if eval_frame is not None and hasattr(eval_frame, "_set_stance"):
                _stance_before = eval_frame._set_stance(eval_frame.DynamoStance("force_eager"))
        _stance_users += 1


def _release_eager() -> None:
    global _stance_users, _stance_before
    with _stance_lock:
        _stance_users -= 1
        if _stance_users == 0 and _stance_before is not None:
            from torch._dynamo import eval_frame

            eval_frame._set_stance(_stance_before)
            _stance_before = None


# -- context cells: which flag values apply to this thread/task now ----------------------------------------------
def _context_cells() -> dict[str, str]:
    cells = flags.read_cells()
    level = scope.context_level()
    if level is not None:  # this context's scope decides the matmul cells, whatever the process flags hold
        cells["cuda.matmul"], cells["mkldnn.matmul"] = BACKEND_VALUES[level]
    cells["sdpa"] = sdpa_kernel()
    return cells


def maths(target: str | Target = "a100") -> dict[str, str]:
    """The math ``emulate(target)`` gives each key in this context (scope and flags), by key.

    >>> import tf32lab
    >>> with tf32lab.precision("high"):
    ...     tf32lab.emulator.maths("a100")["matmul"]
    'tf32-rna'
    """
    target, cells = get(target), _context_cells()
    return {key: str(target.math(key, cells)) for key in KEYS}


class _Scratch(threading.local):
    """Per-thread buffers for rounded activations, which live only while their op runs.

    Fresh multi-MB temporaries cost page faults on every op (the allocator hands large blocks back to the OS),
    measured as costly as the rounding itself; so they are reused, across ``emulate`` contexts too, up to
    ``CAP`` bytes per thread. :func:`release_buffers` frees them.
    """

    CAP = 256 << 20

    def __init__(self) -> None:
        self.free: dict[tuple, list[torch.Tensor]] = {}
        self.bytes = 0
        self.leased: list[torch.Tensor] = []  # handed out to the op running now
        self.memo: Optional[tuple] = None  # the last rounded activation (see emulate._recent)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        free = self.free.get((numel, dtype, device))
        if free:
            buf = free.pop()
            self.bytes -= buf.numel() * buf.element_size()
            return buf
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, views: list[torch.Tensor]) -> None:
        for view in views:
            buf = view._base if view._base is not None else view
            size = buf.numel() * buf.element_size()
            if buf.dim() == 1 and self.bytes + size <= self.CAP:  # only the pool's own flat buffers
                self.free.setdefault((buf.numel(), buf.dtype, buf.device), []).append(buf)
                self.bytes += size

    def forget(self) -> None:
        memo, self.memo = self.memo, None
        if memo is None:
            return
        if self.leased:  # an op is running and may still read it: back to the pool when it returns
            self.leased.extend(memo[3])
        else:
            self.give(memo[3])


_SCRATCH = _Scratch()


class _ParameterCache:
    """Rounded copies of parameters, shared by every ``emulate`` context: a model's weights are rounded once.

    An entry is valid while the parameter's version counter is unchanged (any in-place update bumps it) and
    is dropped when the parameter is garbage-collected (a weak reference's callback).
    """

    def __init__(self) -> None:
        self.slots: dict[int, tuple[weakref.ref, dict]] = {}
        self.lock = threading.Lock()

    def get(self, t: torch.Tensor, tag: str, fn: Callable) -> Any:
        base = t._base if t._base is not None else t
        ident = id(base)
        key = (t.storage_offset(), tuple(t.shape), t.stride(), t.device, tag)
        slot = self.slots.get(ident)
        if slot is None or slot[0]() is not base:
            slots = self.slots

            def forget(ref: weakref.ref, ident: int = ident) -> None:
                entry = slots.get(ident)
                if entry is not None and entry[0] is ref:
                    del slots[ident]

            with self.lock:
                slot = slots[ident] = (weakref.ref(base, forget), {})
        version = t._version
        hit = slot[1].get(key)
        if hit is not None and hit[0] == version:
            return hit[1]
        with torch.inference_mode(False):  # a copy made under inference_mode must still serve autograd later
            value = fn(t.detach())
        slot[1][key] = (version, value)
        return value

    def __len__(self) -> int:
        return sum(len(slot[1]) for slot in list(self.slots.values()))

    def clear(self) -> None:
        with self.lock:
            self.slots.clear()


_PARAMS = _ParameterCache()


def release_buffers() -> None:
    """Free the rounded parameter copies and this thread's scratch buffers, both kept between ``emulate``
    contexts (rounding every weight again, and fresh multi-MB buffers, each cost as much as the rounding of
    the activations).

    >>> release_buffers()
    """
    _PARAMS.clear()
    _SCRATCH.forget()
    _SCRATCH.free.clear()
    _SCRATCH.bytes = 0


class _Call:
    """One intercepted op: the math decisions (fixed at entry) and the product helpers rules use."""

    __slots__ = ("cells", "emu", "math_seen", "op")

    def __init__(self, emu: emulate, op: str, cells: dict[str, str]) -> None:
        self.emu, self.op, self.cells = emu, op, cells
        self.math_seen: Optional[Math] = None

    def math(self, key: str) -> Math:
        """The math of ``key`` ("matmul", "conv", "attention.efficient", ...) for this call."""
        emu = self.emu
        if key in ("matmul", "matvec"):
            key = getattr(_local, "family", None) or key
        math = emu.math if emu.math is not None else emu.target.math(key, self.cells)
        if emu.rounding is not None and math.rounding is not None and emu.math is None:
            math = Math(math.name, emu.rounding)
        if self.math_seen is None:
            self.math_seen = math
        return math

    def product(self, key: str, full: Callable, a: torch.Tensor, b: torch.Tensor,
                bare: Optional[Callable] = None) -> torch.Tensor:
        """``full(a, b)`` computed with the math of ``key``.

        ``full`` is bilinear in ``(a, b)`` plus any term that does not depend on them (a bias, ``beta * C``);
        ``bare`` is the same product without that term (defaults to ``full``). Split maths need it: the three
        partial products must add the term once.
        """
        math = self.math(key)
        name = math.name
        if name == "ieee" or a.dtype != _F32 or b.dtype != _F32:
            return full(a, b)
        emu = self.emu
        if name in _SINGLE_ROUND:
            return full(emu._round(a, math), emu._round(b, math))
        # The three products big·big' + big·small' + small·big' as two GEMMs: big·(big' + small') + small·big'.
        # big' + small' is exact in float32 unless small' is tiny next to big' (then off by one float32 rounding),
        # so the sum equals the three products within float32 accumulation error; small·small' stays dropped.
        a_big, a_small = emu._split(a, math)
        b_big, b_sum = emu._split(b, math, summed=True)
        return full(a_big, b_sum).add_((bare or full)(a_small, b_big))


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t._base if t._base is not None else t, torch.nn.Parameter)


def _float32_in(args: Any) -> bool:
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.dtype == _F32:
                return True
        elif isinstance(a, (list, tuple)) and _float32_in(a):
            return True
    return False


def _ieee_native(cells: dict[str, str], args: Any) -> contextlib.AbstractContextManager:
    """A context in which native float32 GEMMs of this thread are IEEE: rounded operands must not be rounded again
    (this CPU's oneDNN honours ``medium`` with bf16; a GPU honours ``high`` with TF32)."""
    device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
    cell = "mkldnn.matmul" if device == "cpu" else "cuda.matmul"
    if cells[cell] == "ieee":
        return contextlib.nullcontext()
    return scope.precision("highest")


class _Mode(TorchDispatchMode):
    """Per thread: routes family ops to their rule."""

    def __init__(self, emu: emulate) -> None:
        super().__init__()
        self.emu = emu
        self.pinned: Optional[dict[str, str]] = None  # cells of the op being emulated (nested dispatch reuses them)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        entry = _classify(func)
        if entry is None or not (_float32_in(args) or _float32_in(kwargs.values())):
            if _mutates(func):  # the last rounded activation may be the tensor written to
                _SCRATCH.forget()
            return func(*args, **kwargs)
        rule, family = entry
        emu = self.emu
        cells = self.pinned or _context_cells()
        call = _Call(emu, func.name(), cells)
        pinned, self.pinned = self.pinned, cells
        leased = emu._leased()
        mark = len(leased)
        try:
            if rule is None:
                return self._no_rule(call, func, family, args, kwargs)
            out = kwargs.pop("out", None) if "out" in kwargs else None
            with _ieee_native(cells, args):
                result = rule(call, func, args, kwargs)
            if result is NotImplemented:  # the rule declined (e.g. a layout it does not model)
                return self._no_rule(call, func, family, args, kwargs if out is None else {**kwargs, "out": out})
            if out is not None:
                out.copy_(result)
                result = out
            emu._count(call.op, call.math_seen or call.math(family))
            if _mutates(func):  # addmm_ and friends: the memo may hold the tensor they wrote
                _SCRATCH.forget()
            return result
        finally:
            self.pinned = pinned
            if len(leased) > mark:
                emu._release(leased, mark)

    def _no_rule(self, call: _Call, func, family: str, args, kwargs):
        # A composite op decomposes into ops we know; everything else is unhandled (linalg: IEEE on every target).
        with self:
            result = func.decompose(*args, **kwargs)
        if result is not NotImplemented:
            return result
        if family == "linalg":
            self.emu._count(call.op, call.math("linalg"))
            return func(*args, **kwargs)
        self.emu._unhandled(call.op)
        return func(*args, **kwargs)


_CLASSES: dict[Any, Optional[tuple[Optional[Callable], str]]] = {}
_MUTATING: dict[Any, bool] = {}


def _mutates(func) -> bool:
    known = _MUTATING.get(func)
    if known is None:
        schema = getattr(func, "_schema", None)
        known = _MUTATING[func] = schema is None or schema.is_mutable
    return known


def _classify(func) -> Optional[tuple[Optional[Callable], str]]:
    try:
        return _CLASSES[func]
    except KeyError:
        pass
    name = func.name()
    family = family_of(name)
    rule = rules.RULES.get(func.overloadpacket) if hasattr(func, "overloadpacket") else None
    entry = None if family is None and rule is None else (rule, family or "matmul")
    _CLASSES[func] = entry
    return entry


_RNN_FUNCTIONS = rules.RNN_FUNCTIONS
_SDPA = rules.SDPA_FUNCTION


class _FunctionMode(TorchFunctionMode):
    """Per thread: calls that PyTorch decomposes above the dispatcher into kernels of *this* machine: RNNs (whose
    GEMMs belong to cuDNN's RNN kernel on the target) and scaled_dot_product_attention (the target's kernel)."""

    def __init__(self, emu: emulate) -> None:
        super().__init__()
        self.emu = emu

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            if _float32_in(args) or _float32_in(kwargs.values()):
                return rules.sdpa_function(self.emu, func, args, kwargs)
        elif func in _RNN_FUNCTIONS and _float32_in(args):
            return rules.rnn_function(self.emu, func, args, kwargs)
        # Known limit: the mode is off inside its own handler, so a call made *inside* another Python-level torch
        # function (F.multi_head_attention_forward) is not seen here; the dispatch mode still emulates what it
        # decomposes into (docs/design.md).
        return func(*args, **kwargs)


class emulate(contextlib.ContextDecorator):
    """Compute float32 matmul-family ops as ``target`` would under the active precision scope and flags.

    Args:
        target: a name from ``tf32lab.targets.TARGETS`` (``"a100"``, ``"h100"``, ``"v100"``, ``"cpu-amx"``, ...)
            or a ``Target``.
        math: force one math for every family (``"ieee"``, ``"tf32"``, ``"bf16"``, ``"bf16x3"``, ``"tf32x3"``).
        rounding: operand rounding for ``tf32`` / ``bf16`` (``"rna"``, ``"rne"``, ``"rz"``), instead of the
            target's.
        strict: raise ``Tf32LabError`` at the first family op that ran without emulation.

    ``coverage`` counts ``(op, math)`` pairs and ``unhandled`` the family ops that ran natively. The context is
    thread-local: threads started inside it are not emulated unless they enter it themselves. Rounded copies of
    parameters are cached while the parameter is unchanged and freed with it. Inside, ``torch.compile``'d code
    runs eagerly (process-wide while any emulation is active), and TorchScript modules are emulated too.

    Example:

        >>> import torch, tf32lab
        >>> x, w = torch.randn(64, 256), torch.randn(256, 32)
        >>> with tf32lab.emulate("a100", math="tf32") as emu:
        ...     y = x @ w
        >>> bool((y - x @ w).abs().max() > 0), emu.unhandled
        (True, Counter())
    """

    def __init__(self, target: str | Target = "a100", *, math: Optional[str] = None,
                 rounding: Optional[str] = None, strict: bool = False) -> None:
        self.target = get(target)
        if math is not None and math not in MATHS:
            raise Tf32LabError(f"unknown math {math!r}; accepted: {', '.join(map(repr, MATHS))}")
        if rounding is not None and rounding not in formats.ROUNDINGS:
            raise Tf32LabError(
                f"unknown rounding {rounding!r}; accepted: {', '.join(map(repr, formats.ROUNDINGS))}")
        if math is not None:
            default = "rne" if math == "bf16" else "rna"
            self.math: Optional[Math] = Math(math, (rounding or default) if math in _SINGLE_ROUND else None)
        else:
            self.math = None
        self.rounding = rounding
        self.strict = bool(strict)
        self.coverage: collections.Counter[tuple[str, str]] = collections.Counter()
        self.unhandled: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._tls = threading.local()

    def __repr__(self) -> str:
        ops = sum(self.coverage.values())
        forced = f", math={self.math}" if self.math else ""
        return (f"<emulate {self.target.name}{forced}: {ops} ops emulated, "
                f"{sum(self.unhandled.values())} unhandled>")

    def __enter__(self) -> emulate:
        cells = flags.read_cells()
        for cell in ("mkldnn.conv", "mkldnn.rnn"):
            if cells[cell] != "ieee":
                raise Tf32LabError(
                    f"emulate() computes with IEEE CPU kernels, but {cell} is {cells[cell]!r}; set "
                    f"torch.backends.{cell}.fp32_precision = 'ieee' (or 'none') first")
        stack = getattr(self._tls, "modes", None)
        if stack is None:
            stack = self._tls.modes = []
        _force_eager()
        function_mode, dispatch_mode = _FunctionMode(self), _Mode(self)
        try:
            function_mode.__enter__()
            try:
                dispatch_mode.__enter__()
            except BaseException:
                function_mode.__exit__(None, None, None)
                raise
        except BaseException:
            _release_eager()
            raise
        stack.append((function_mode, dispatch_mode))
        _SCRATCH.forget()  # tensors may have changed outside, unseen
        return self

    def __exit__(self, *exc: object) -> None:
        function_mode, dispatch_mode = self._tls.modes.pop()
        _SCRATCH.forget()
        try:
            dispatch_mode.__exit__(None, None, None)
        finally:
            try:
                function_mode.__exit__(None, None, None)
            finally:
                _release_eager()

    # -- bookkeeping ------------------------------------------------------------------------------------------
    def _count(self, op: str, math: Math) -> None:
        with self._lock:
            self.coverage[(op, str(math))] += 1

    def _unhandled(self, op: str) -> None:
        with self._lock:
            self.unhandled[op] += 1
        if self.strict:
            raise Tf32LabError(
                f"emulate(strict=True): {op} belongs to a precision-sensitive family but has no emulation rule "
                "and does not decompose; it would run with the native math")

    # -- operands: rounded copies, cached for parameters, in reused buffers otherwise --------------------------
    def _leased(self) -> list:
        return _SCRATCH.leased

    def _release(self, leased: list, mark: int) -> None:
        _SCRATCH.give(leased[mark:])
        del leased[mark:]

    def _buffer_like(self, t: torch.Tensor, lease: bool = True) -> torch.Tensor:
        if t.is_contiguous():
            shape, transposed = t.shape, False
        elif t.dim() >= 2 and t.mT.is_contiguous():
            shape, transposed = t.mT.shape, True
        else:
            return torch.empty_like(t)
        buf = _SCRATCH.take(t.numel(), t.dtype, t.device)
        if lease:
            _SCRATCH.leased.append(buf)
        view = buf.view(shape)
        return view.mT if transposed else view

    def _round(self, t: torch.Tensor, math: Math) -> torch.Tensor:
        fn = _SINGLE_ROUND[math.name]
        if _is_parameter(t):
            return self._cached(t, str(math), lambda x: fn(x, math.rounding))
        return self._recent(t, str(math), lambda x, out: (fn(x, math.rounding, out=out[0]),), 1)[0]

    def _split(self, t: torch.Tensor, math: Math, summed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(big, small)`` of ``t`` for a split math, or ``(big, big + small)`` when ``summed``."""
        fn = _SPLIT[math.name]

        def parts(x, out=None):
            big, small = fn(x, out=out)
            return (big, small.add_(big)) if summed else (big, small)

        tag = f"{math.name}{'+' if summed else ''}"
        if _is_parameter(t):
            return self._cached(t, tag, parts)
        return self._recent(t, tag, parts, 2)

    def _recent(self, t: torch.Tensor, tag: str, fn: Callable, count: int) -> Any:
        # Consecutive ops often share an operand (the Q, K and V projections read one hidden state): the last
        # rounded activation is kept, checked by identity of its tensor and its version counter (inference
        # tensors have none: any mutating op in this thread forgets the memo, see _Mode).
        base = t._base if t._base is not None else t
        version = -1 if base.is_inference() else base._version
        key = (t.storage_offset(), tuple(t.shape), t.stride(), version, tag)
        scratch = _SCRATCH
        memo = scratch.memo
        if memo is not None and memo[0]() is base and memo[1] == key:
            return memo[2]
        bufs = [self._buffer_like(t, lease=False) for _ in range(count)]
        value = fn(t, bufs)
        if memo is not None:  # the op running now may still read it: back to the pool when the op returns
            scratch.leased.extend(memo[3])
        scratch.memo = (weakref.ref(base), key, value, bufs)
        return value

    def _cached(self, t: torch.Tensor, tag: str, fn: Callable) -> Any:
        return _PARAMS.get(t, tag, fn)


