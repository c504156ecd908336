"""Counting the work of one run: per op, its FLOPs, the bytes it moves, its GEMM shapes, its family and its layer.

A dispatch mode records every op of a run as an :class:`OpCost`; module hooks attribute it to the innermost module
that ran it (``(model)`` for the model itself). Views and allocations launch no kernel and are left out. FLOPs count
a multiply-add as two (``torch.utils.flop_counter``'s convention: ``mm`` is 2·M·N·K); matmul-family ops also carry
their GEMMs as ``(count, batch, m, n, k)`` for the speed model's tile and wave arithmetic. A family op with no
formula here is counted by its bytes only and named in ``Counts.uncounted``.

Example:

    >>> import torch
    >>> from tf32lab.speed.counting import Counting
    >>> model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU())
    >>> x = torch.randn(64, 256)
    >>> with Counting(model) as counts, torch.inference_mode():
    ...     _ = model(x)
    >>> [(c.op, c.layer, c.flops, c.gemms) for c in counts.ops]
    [('aten::linear', '0', 16777216.0, ((1, 1, 64, 512, 256),)), ('aten::relu', '1', 0.0, ())]
"""

from __future__ import annotations

import collections
import math
import sys
import threading
import weakref
from typing import Any, NamedTuple, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tf32lab.control import modestack, scope
from tf32lab.know import optable
from tf32lab.numbers.trees import named_tensors, operand_tensors
from tf32lab.report.conclusion import ON_ANOTHER_THREAD, on_other_threads
from tf32lab.speed.kinds import conv_kind, kind_of
from tf32lab.speed.unfolded_conv import Unfolded, unfolded

__all__ = ["Counting", "Counts", "OpCost", "OtherThreads", "on_other_threads"]

ROOT = "(model)"  # how the model itself is named (its module path is "") where it runs family ops directly
Gemm = tuple[int, int, int, int, int]  # (count, batch, m, n, k)

# no kernel runs: allocation and aliasing (views are known by ``func.is_view``)
_FREE = frozenset(["empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "detach_",
                   "lift_fresh", "alias", "set_", "resize_", "_reshape_alias", "_unsafe_view"])
# reads only what it gathers: its input's bytes count no more than its output's
_GATHER = frozenset(["embedding", "index_select", "gather", "index", "take"])


class OpCost(NamedTuple):
    """One op of the run: ``op`` (``aten::addmm``), the ``layer`` that ran it, its ``family`` (None: not
    precision-sensitive), FLOPs, bytes read and written, the GEMMs it amounts to, and its ``kind``: what limits it
    on a GPU (``tf32lab.speed.kinds``; empty: found from ``op`` and ``family`` when timed); ``kernels``: its kernel
    launches (0: one, or one per GEMM); ``unfolded``: for a convolution, the ops a GPU runs for it with cuDNN off
    (``speed.unfolded_conv``)."""

    op: str
    layer: str
    family: Optional[str]
    flops: float
    bytes: float
    gemms: tuple[Gemm, ...]
    kind: str = ""
    kernels: int = 0
    unfolded: tuple[Unfolded, ...] = ()


class Counts:
    """What :class:`Counting` recorded."""

    def __init__(self) -> None:
        self.ops: list[OpCost] = []
        self.uncounted: collections.Counter[str] = collections.Counter()  # family ops with no FLOP formula

    @property
    def flops(self) -> float:
        return sum(c.flops for c in self.ops)

    @property
    def bytes(self) -> float:
        return sum(c.bytes for c in self.ops)


def _shape_prod(shape: Any) -> int:
    return math.prod(int(s) for s in shape)


_CELLS = frozenset(["lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell"])


def _gemms(name: str, family: Optional[str], a: dict[str, Any], out: Any) -> Optional[tuple[Gemm, ...]]:
    """The GEMMs of a product op (``a``: its arguments by name), or None when no formula covers it."""
    if name in ("mm", "bmm"):
        return (_gemm(a["self"], a["mat2"]),)
    if name in ("addmm", "addmm_", "_addmm_activation", "baddbmm", "baddbmm_", "addbmm", "addbmm_"):
        return (_gemm(a.get("mat1", a.get("batch1")), a.get("mat2", a.get("batch2"))),)
    if name == "linear":
        x, w = a["input"], a["weight"]
        return ((1, 1, _shape_prod(x.shape[:-1]), int(w.shape[0]), int(w.shape[-1])),)
    if name in ("matmul", "linalg_matmul"):
        x, y = a["self"] if "self" in a else a["input"], a["other"]
        m = int(x.shape[-2]) if x.dim() > 1 else 1
        n = int(y.shape[-1]) if y.dim() > 1 else 1
        batch = _shape_prod(out.shape[:-2]) if x.dim() > 1 and y.dim() > 1 else 1
        return ((1, batch, m, n, int(x.shape[-1])),)
    if name in ("mv", "addmv", "addmv_"):
        mat = a["mat"] if "mat" in a else a["self"]  # mv(self, vec); addmv(self, mat, vec)
        return ((1, 1, int(mat.shape[0]), 1, int(mat.shape[1])),)
    if name in ("dot", "vdot"):
        return ((1, 1, 1, 1, int(a["self"].shape[0])),)
    if name in ("addr", "addr_"):
        return ((1, 1, int(a["vec1"].shape[0]), int(a["vec2"].shape[0]), 1),)
    if family == "conv" and not name.endswith("backward") and "weight" in a:
        x, w = a["input"], a["weight"]
        transposed = "transpose" in name or bool(a.get("transposed", False))
        groups = int(a.get("groups", 1) or 1)
        kernel = _shape_prod(w.shape[2:])
        if transposed:  # weight (Cin, Cout/groups, k...): each input element meets Cout/groups x kernel
            flops = 2.0 * x.numel() * int(w.shape[1]) * kernel
            m = int(x.shape[0]) * _shape_prod(x.shape[2:])
        else:  # weight (Cout, Cin/groups, k...): each output element sums Cin/groups x kernel products
            flops = 2.0 * out.numel() * int(w.shape[1]) * kernel
            m = int(out.shape[0]) * _shape_prod(out.shape[2:])
        n = max(1, int(out.shape[1]) // groups)
        if flops == 0:  # an empty batch, image or channel dimension: no product to compute (and m may be 0)
            return ((1, groups, m, n, 0),)
        return ((1, groups, m, n, max(1, round(flops / (2.0 * m * n * groups)))),)
    if name == "convolution_backward":
        grad, w = a["grad_output"], a["weight"]
        groups = int(a.get("groups", 1) or 1)
        m = int(grad.shape[0]) * _shape_prod(grad.shape[2:])
        n = max(1, int(grad.shape[1]) // groups)
        return ((2, groups, m, n, int(w.shape[1]) * _shape_prod(w.shape[2:])),)  # input's and weight's gradients
    if family == "attention" and isinstance(a.get("query"), torch.Tensor):
        q, k, v = a["query"], a["key"], a["value"]
        batch = _shape_prod(q.shape[:-2])
        length, keys, e, ev = int(q.shape[-2]), int(k.shape[-2]), int(q.shape[-1]), int(v.shape[-1])
        return ((1, batch, length, keys, e), (1, batch, length, ev, keys))
    if family == "attention" and name.endswith("backward") and isinstance(a.get("query"), torch.Tensor):
        return None
    if name in _CELLS:  # one step: the input's and the hidden state's products, each ``linear`` (RNN.cpp)
        x, h, w_ih, w_hh = a["input"], a["hx"], a["w_ih"], a["w_hh"]
        h = h[0] if isinstance(h, (list, tuple)) else h  # an LSTM cell's (h, c)
        rows, gates = _shape_prod(x.shape[:-1]), int(w_ih.shape[0])
        return ((1, 1, rows, gates, int(w_ih.shape[1])), (1, 1, _shape_prod(h.shape[:-1]), gates, int(w_hh.shape[1])))
    if name in ("lstm", "gru", "rnn_tanh", "rnn_relu") and "params" in a:
        return _rnn_gemms(a)
    if name == "mkldnn_rnn_layer":  # one layer of a CPU LSTM with autograd on: what cuDNN's RNN would run
        x, w_ih, w_hh = a["input"], a["weight0"], a["weight1"]
        steps, batch = (int(x.shape[1]), int(x.shape[0])) if a.get("batch_first") else (int(x.shape[0]),
                                                                                          int(x.shape[1]))
        gates = int(w_ih.shape[0])
        return ((1, 1, steps * batch, gates, int(w_ih.shape[1])), (steps, 1, batch, gates, int(w_hh.shape[1])))
    return None


def _kind(op: str, family: Optional[str], a: dict[str, Any]) -> str:
    """``kinds``'s kind of an op; a convolution's from its groups, input channels and direction."""
    x = a.get("input", a.get("self"))
    if family != "conv" or not isinstance(x, torch.Tensor) or x.dim() < 2:
        return kind_of(op, family)
    transposed = "transpose" in op or bool(a.get("transposed", False))
    return conv_kind(int(a.get("groups", 1) or 1), int(x.shape[1]), transposed)


def _complex(out: Any) -> bool:
    """Whether an op's (first) result is complex."""
    first = out[0] if isinstance(out, (tuple, list)) and out else out
    return isinstance(first, torch.Tensor) and first.is_complex()


def _gemm(x: torch.Tensor, y: torch.Tensor) -> Gemm:
    return (1, int(x.shape[0]) if x.dim() == 3 else 1, int(x.shape[-2]), int(y.shape[-1]), int(x.shape[-1]))


def _rnn_gemms(a: dict[str, Any]) -> tuple[Gemm, ...]:
    params = list(a["params"])
    directions = 2 if a.get("bidirectional") else 1
    if "batch_sizes" in a:  # a packed sequence: the rows of every step in one tensor, fewer as sequences end
        rows, steps = int(a["data"].shape[0]), int(a["batch_sizes"].numel())
        batch = -(-rows // max(steps, 1))  # a step's rows on average (its GEMM's m)
    else:
        x = a["input"]
        steps, batch = (int(x.shape[1]), int(x.shape[0])) if a.get("batch_first") else (int(x.shape[0]),
                                                                                         int(x.shape[1]))
    per = 4 if a.get("has_biases", True) else 2
    gemms: list[Gemm] = []
    for i in range(int(a.get("num_layers", 1)) * directions):
        w_ih, w_hh = params[i * per], params[i * per + 1]
        gates = int(w_ih.shape[0])
        gemms.append((1, 1, steps * batch, gates, int(w_ih.shape[1])))  # the input projection: every step at once
        gemms.append((steps, 1, batch, gates, int(w_hh.shape[1])))  # the recurrence: one step after the other
    return tuple(gemms)


def _bytes(name: str, args: tuple, kwargs: dict, out: Any) -> float:
    # plain loops over the operands as they come (no generator, no device object per tensor): every op of the run
    # that is not a view pays this
    if isinstance(out, torch.Tensor):
        written = out.numel() * out.element_size()
    else:
        written = 0
        for t in operand_tensors((out,)):
            written += t.numel() * t.element_size()
    gather = name in _GATHER
    seen: set[tuple[int, int]] = set()
    total = 0.0
    for t in operand_tensors(args) + operand_tensors(kwargs.values()) if kwargs else operand_tensors(args):
        if t.layout is not torch.strided:  # sparse COO, CSR, CSC, BSR: no storage of their own to key by
            continue
        numel = t.numel()
        key = (id(t) if t.is_meta else t.data_ptr(), numel)  # meta: shapes, no storage
        if key in seen:
            continue
        seen.add(key)
        size = numel * t.element_size()
        total += min(size, written) if gather else size
    return total + written


@modestack.skips_dynamo_lazily
class _Mode(TorchDispatchMode):
    def __init__(self, counting: Counting) -> None:
        super().__init__()
        self.counting = weakref.proxy(counting)  # no cycle: the model it counts goes when its owner drops it
        # its Counting while on the stack (``Counting.__enter__`` gives its Counts, not itself: entered by hand, no
        # one else holds it), let go at its exit
        self.held: Optional[Counting] = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.counting.paused:
            self.counting.record(func, args, kwargs, out)
        return out


# tf32lab's own ops (``tf32lab::scaled_dot_product_attention``: how the emulator routes an attention call whole) are
# the aten op of the same name, with its arguments' names
_STANDS_FOR_ATEN = frozenset(["aten", "tf32lab"])
_ATEN_ARGUMENT = {"q": "query", "k": "key", "v": "value"}

# torch._VF.lstm & co. -> their aten ops: the ``.input`` overload (the unpacked call) and ``.data`` (a packed one)
_RNNS = {getattr(torch._C._VariableFunctions, name): (getattr(torch.ops.aten, name).input,
                                                      getattr(torch.ops.aten, name).data)
         for name in ("lstm", "gru", "rnn_tanh", "rnn_relu")}


class _Functions(TorchFunctionMode):
    """An RNN call inside ``emulate()``: the emulator runs its recurrence step by step (rounding each GEMM), where
    the target runs one cuDNN kernel. Counted as that one op; its steps are not (thousands of handler calls that
    made counting cost 5 forwards of an LSTM)."""

    passes_composites_on = True  # a backward or an MHA call below emulate()'s mode: nothing to see (emulator)

    def __init__(self, counting: Counting) -> None:
        super().__init__()
        self.counting = weakref.proxy(counting)  # no cycle: the model it counts goes when its owner drops it

    def __torch_function__(self, func, types, args=(), kwargs=None):
        ops = _RNNS.get(func) if func.__hash__ is not None else None
        kwargs = kwargs or {}
        if ops is None:  # every call but an RNN's: as it is (the hand-off origin.forwards knows: the op's errors)
            return func(*args, **kwargs)
        counting = self.counting
        if counting.paused or kwargs or len(args) < 4 or scope.current_emulation() is None:
            return func(*args, **kwargs)
        # args[3] is has_biases in the unpacked call, the params in a packed sequence's
        op = ops[0] if isinstance(args[3], bool) else ops[1]
        counting.paused = True
        try:
            # off the stack, not only paused: each step's ops through a paused mode cost a Python dispatch each
            # (an LSTM encoder's counted run: ~4600 of them, about two native forwards)
            with modestack.lifted(counting._mode):
                out = func(*args, **kwargs)
        finally:
            counting.paused = False
        counting.record(op, args, kwargs, out)
        return out


_NO_KERNEL = ("",) * 4  # a view or an allocation: not recorded


def _op_of(func: Any) -> tuple[str, str, Optional[str], Optional[str]]:
    """What :meth:`Counting.record` knows of ``func`` before its arguments: its bare name, the op it is counted as,
    its family and its kind (None: a convolution's, read from its arguments); ``_NO_KERNEL`` for a view or an
    allocation. Looked up once per op overload (every op of a run paid the string work and the op table)."""
    name = func._schema.name.split("::")[-1]
    if func.is_view or name in _FREE:
        return _NO_KERNEL
    qualified = f"aten::{name}" if func.namespace in _STANDS_FOR_ATEN else func._schema.name
    family = optable.family(qualified)
    return name, qualified, family, None if family == "conv" else kind_of(qualified, family)


_OPS: dict[Any, tuple[str, str, Optional[str], Optional[str]]] = {}


class Counting:
    """Records the ops of what runs inside it, attributed to the modules of ``model`` (see the module docstring).

    Ops of other threads are not recorded (the mode is this thread's); nor are those run while ``paused`` (a
    measurement's own arithmetic in a hook).
    """

    def __init__(self, model: Optional[torch.nn.Module] = None, backward: bool = False) -> None:
        self.model = model
        self.paused = False
        # with ``backward``: the autograd node each forward op made -> its layer, so that the backward's ops count
        # for the layer whose forward made them (the wrappers are kept alive: ids of freed ones come back)
        self.backward = backward
        self._nodes: dict[Any, str] = {}
        self._boundaries: list[set] = []
        self.counts = Counts()
        self._mode = _Mode(self)
        self._functions = _Functions(self)
        self._stack: list[str] = []
        self._handles: list[Any] = []

    def __enter__(self) -> Counts:
        if self.model is not None:
            for name, module in self.model.named_modules():
                if isinstance(module, torch.jit.ScriptModule):
                    continue  # no hooks; their ops count for the nearest module that takes them
                self._handles.append(module.register_forward_pre_hook(self._pre(name or ROOT),
                                                                      with_kwargs=self.backward))
                self._handles.append(module.register_forward_hook(self._post(), always_call=True))
        modestack.push(self._functions)
        modestack.push(self._mode)
        self._mode.held = self
        return self.counts

    def __exit__(self, *exc: object) -> None:
        self._mode.held = None
        self._nodes.clear()
        self._boundaries.clear()
        modestack.remove(self._mode)
        modestack.remove(self._functions)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre(self, name: str):
        def hook(module, args, kwargs=None):
            self._stack.append(name)
            if self.backward:  # where this module's part of the graph begins: its inputs' nodes, keyword ones too
                inputs = (args, kwargs or {})
                self._boundaries.append({t.grad_fn for _, t in named_tensors(inputs) if t.grad_fn is not None})

        return hook

    def _post(self):
        def hook(module, args, output):
            if self._stack:
                name = self._stack.pop()
                if self.backward and self._boundaries:
                    self._tag(output, name, self._boundaries.pop())

        return hook

    def _tag(self, output: Any, name: str, boundary: set) -> None:
        """Give the autograd nodes this module's forward made (those not yet given to a sublayer) its name."""
        todo = [t.grad_fn for _, t in named_tensors(output) if t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node is None or node in boundary or node in self._nodes:
                continue
            self._nodes[node] = name
            todo.extend(next_node for next_node, _ in node.next_functions)

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        known = _OPS.get(func)
        if known is None:
            known = _OPS[func] = _op_of(func)
        if known is _NO_KERNEL:
            return
        name, qualified, family, kind = known
        gemms, named = None, None
        if family is not None:  # only a family op's GEMMs and a convolution's kind read the arguments by name
            named = dict(zip((arg.name for arg in func._schema.arguments), args))
            named.update(kwargs)
            if func.namespace == "tf32lab":  # the emulator's stand-in for the aten op: counted as that op, so that
                named = {_ATEN_ARGUMENT.get(k, k): v for k, v in named.items()}  # a run under emulate() counts alike
            gemms = _gemms(name, family, named, out)
            if gemms is None:
                self.counts.uncounted[qualified] += 1
            elif _complex(out):  # a complex multiply-add is four real ones: one kernel (cuBLAS's CGEMM) of 4x the work
                gemms = tuple((c, b, m, n, 4 * k) for c, b, m, n, k in gemms)
        flops = float(sum(2 * c * b * m * n * k for c, b, m, n, k in gemms or ()))
        layer = self._stack[-1] if self._stack else self._backward_layer()
        self.counts.ops.append(OpCost(qualified, layer, family, flops, _bytes(name, args, kwargs, out),
                                      tuple(gemms or ()), kind or _kind(qualified, family, named or {}),
                                      unfolded=unfolded(name, named, out) if family == "conv" else ()))

    def _backward_layer(self) -> str:
        """The layer whose forward made the autograd node running now (backward ops), else the model's."""
        current = getattr(torch._C, "_current_autograd_node", None)
        if not self.backward or current is None:
            return ROOT
        node = current()
        return ROOT if node is None else self._nodes.get(node, ROOT)


@modestack.skips_dynamo_lazily
class _Watching(TorchDispatchMode):
    """On the stack of a thread that :class:`OtherThreads` watches: counts its matmul-family ops, changes nothing."""

    def __init__(self, watch: OtherThreads) -> None:
        super().__init__()
        self.watch = watch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        watch = self.watch
        if watch.active and optable.family(func.name()) is not None:
            with watch.lock:
                watch.ops[func.name().split(".")[0]] += 1
        kwargs = kwargs or {}
        return func(*args, **kwargs)  # the hand-off origin.forwards knows: an error here is the op's


class OtherThreads:
    """Counts the matmul-family ops of the threads started while it is open (a model that runs part of its
    forward in a helper thread of its own).

    tf32lab's modes (emulation, counting, the float64 reference) are per thread, as PyTorch's dispatch mode stack
    is: a helper thread's products run natively, unemulated, uncounted. They cannot be followed there, so they are
    counted, and a report says so instead of staying silent. Seen through ``threading.setprofile`` (the previous
    profile function is kept and chained): a thread started before (a pool made earlier) is not seen.

    Example:

        >>> import threading, torch
        >>> with OtherThreads() as watch:
        ...     t = threading.Thread(target=lambda: torch.ones(2, 2) @ torch.ones(2, 2)); t.start(); t.join()
        >>> dict(watch.ops)
        {'aten::mm': 1}
    """

    def __init__(self) -> None:
        self.ops: collections.Counter[str] = collections.Counter()
        self.active = False
        self.lock = threading.Lock()
        self._previous: Any = None

    def __enter__(self) -> OtherThreads:
        self._previous = getattr(threading, "_profile_hook", None)  # threading.getprofile() from Python 3.10
        threading.setprofile(self._started)
        self.active = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.active = False
        threading.setprofile(self._previous)

    def _started(self, frame: Any, event: str, arg: Any) -> None:
        """The first profile event of a new thread, in that thread: watch it until that frame returns."""
        previous = self._previous
        if not self.active:
            sys.setprofile(previous)
            return
        mode = _Watching(self)
        modestack.push(mode)

        def until_return(f: Any, e: str, a: Any) -> None:
            if previous is not None:
                previous(f, e, a)
            if e == "return" and f is frame:  # the thread's outermost frame is done: nothing of it is left to see
                modestack.remove(mode)
                sys.setprofile(previous)

        sys.setprofile(until_return)
        if previous is not None:
            previous(frame, event, arg)

    def note(self, what: str) -> Optional[str]:
        """The report's line about them, if any ran; ``what``: what happened to them, e.g. "not emulated"."""
        if not self.ops:
            return None
        return (f"{sum(self.ops.values())} {ON_ANOTHER_THREAD} ({self._listed()}) and were {what}; "
                f"tf32lab follows only the thread that calls the model: run them on that thread to have them "
                f"measured")

    def refusal(self, workload: str) -> str:
        """Why nothing can be said of a model whose every matmul-family op ran on other threads: its report would
        compare nothing and call that safe (or predict no gain)."""
        return (f"workload {workload!r}: nothing was measured: all its matmul-family ops ran on other threads "
                f"({sum(self.ops.values())} op(s): {self._listed()}), which tf32lab does not follow (its modes are "
                f"per thread, as PyTorch's dispatch modes are); run them in the thread that calls the model, or, "
                f"outside tf32lab's commands, enter `tf32lab.emulate(...)` inside that thread")

    def _listed(self) -> str:
        return ", ".join(f"{op} x{n}" for op, n in self.ops.most_common(4))

