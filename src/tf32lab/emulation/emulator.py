"""``emulate(target)``: compute every matmul-family op as the target GPU would, on any machine.

Inside ``with emulate("a100"):`` a thread-local ``TorchDispatchMode`` catches every float32 op of the matmul,
conv, rnn, attention and matvec families, asks ``targets`` which math the target assigns under the scope and
flags in force for this thread, and computes it: operands rounded as the hardware rounds them (``formats``),
products and accumulation in IEEE float32, as the tensor cores do (products of TF32 or bf16 values are exact in
float32). Split maths sum several products (``tf32x3``, ``bf16x3``: three; ``bfx9``: nine). Non-float32 ops
pass through.

The rules live in ``tf32lab.emulation.rules`` (one registry, filled by ``@rule``); which ops belong to a family, and
what PyTorch does with each, in ``tf32lab.know.optable`` (:func:`treatment` combines the two). An op of a family
with no rule is first decomposed into ops that have one; if it cannot be, it runs natively and is counted in
``unhandled`` (``strict=True``: it raises), so silence never passes for success.

Example:

    >>> import torch, tf32lab
    >>> a, b = torch.tensor([[1024.5]]), torch.tensor([[1.0]])
    >>> with tf32lab.precision("high"), tf32lab.emulate("a100") as emu:
    ...     (a @ b).item()                 # cuBLAS on Ampere rounds operands to TF32, ties away from zero
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
import importlib.abc
import importlib.machinery
import sys
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from tf32lab import settings
from tf32lab.control import flags, modestack, scope
from tf32lab.emulation import attention_rules, backward_threads, call_site, rules
from tf32lab.emulation.reuse import Handoff
from tf32lab.errors import Tf32LabError
from tf32lab.know import optable
from tf32lab.know.levels import level_cells
from tf32lab.know.targets import (
    CUDNN_CELL,
    IEEE,
    MATHS,
    SUMMED,
    Math,
    Target,
    check_value,
    counted_math,
    cudnn_cell,
    get,
    sdpa_kernel,
)
from tf32lab.numbers import accumulation as _accumulation
from tf32lab.numbers import formats
from tf32lab.numbers.trees import operand_tensors

__all__ = ["ACCUMULATIONS", "COMPOSITES_EMULATED", "RECOMPUTES_EMULATED", "Treatment", "check_accumulation",
           "compiled_eagerly", "counted_math", "emulate", "families_met", "maths", "treatment"]

# How emulate() sums a GEMM's products: "ideal" (exact products, float32 sums as the CPU's BLAS orders them) or
# "hardware" (the target's unit, bit for bit, chained along K: tf32lab.numbers.accumulation).
ACCUMULATIONS = ("ideal", "hardware")


def check_accumulation(value: Optional[str]) -> str:
    """``value`` if it is one of ACCUMULATIONS; None: the ``TF32LAB_ACCUMULATION`` setting (default ``"ideal"``).

    >>> check_accumulation("hardware"), check_accumulation(None)
    ('hardware', 'ideal')
    """
    if value is None:
        value = settings.get("TF32LAB_ACCUMULATION")
    if value not in ACCUMULATIONS:
        raise Tf32LabError(f"unknown accumulation {value!r}; accepted: {', '.join(map(repr, ACCUMULATIONS))}")
    return value


# keys whose products a GEMM kernel without split-K computes, in K order; for the rest the order is unknown
_GEMM_KEYS = ("matmul", "attention.math", "matmul.gemv")

_F32 = torch.float32
_C64 = torch.complex64
# complex products computed by parts: each with the real product its parts take
_COMPLEX_GEMMS = {torch.ops.aten.mm: torch.ops.aten.mm, torch.ops.aten.bmm: torch.ops.aten.bmm,
                  torch.ops.aten.addmm: torch.ops.aten.mm, torch.ops.aten.baddbmm: torch.ops.aten.bmm}
_SPARSE = frozenset({torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc})
_SINGLE_ROUND = {"tf32": formats.round_tf32, "bf16": formats.round_bf16}
_SPLIT = {"tf32x3": formats.split_tf32x3, "bf16x3": formats.split_bf16x3, "bfx9": formats.split_bf16x9}
_PAIRED = ("tf32x3", "bf16x3")  # split maths of two parts: _Call.matmul's one GEMM over K doubled

# the keys that cuBLAS computes under PyTorch's handle
_CUBLAS_KEYS = ("matmul", "matvec", "attention.math", "matmul.gemv", "linalg.trsm")


# -- the stance of torch.compile: compiled code would run kernels we never see ----------------------------------
# Dynamo skips a frame that starts while a dispatch mode is on the stack, and remembers the skip for that code
# object for good: without the eager stance, ``torch.compile(fn, fullgraph=True)`` raises inside the block ("found
# no compiled frames") and the same ``fn`` compiled natively afterwards raises too ("Compilation was not attempted").
# With it, compiled code runs eagerly under the modes and Dynamo sees none of its frames.
_stance_lock = threading.RLock()
_stance_users = 0
_stance_before: Any = None
_DYNAMO = "torch._dynamo"


def _set_eager_stance() -> None:
    """With ``_stance_lock`` held, ``torch._dynamo`` loaded and an emulation open: Dynamo's eager stance."""
    global _stance_before
    if _stance_before is not None:
        return
    try:
        from torch._dynamo import eval_frame
    except ImportError:  # a torch without dynamo has nothing to force
        return
    if hasattr(eval_frame, "_set_stance"):
        _stance_before = eval_frame._set_stance(eval_frame.DynamoStance("force_eager"))
    elif callable(getattr(eval_frame, "set_eval_frame", None)):
        # torch before 2.6 has no stance. A compiled function installs Dynamo's frame callback through this
        # module's set_eval_frame on every call; while emulations are open it installs none instead, so the
        # function's frames run eagerly (no cached graph, no new compile), as under the eager stance.
        real = eval_frame.set_eval_frame

        def eager(callback: Any) -> Any:
            return real(callback if callback is None or callback is False else None)

        eval_frame.set_eval_frame = eager
        _stance_before = ("set_eval_frame", real)


class _LoadedThenEager(importlib.abc.Loader):
    """Loads ``torch._dynamo`` with the loader found for it, then sets the eager stance (an emulation is open)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        module.__loader__ = module.__spec__.loader = self.loader  # as if we had never been there
        with _stance_lock:
            if _stance_users:
                _set_eager_stance()


class _DynamoWatch(importlib.abc.MetaPathFinder):
    """On ``sys.meta_path`` while an emulation is open and ``torch._dynamo`` is not loaded: importing it (about a
    second, 71 MiB, so not before a program compiles) inside the block sets the eager stance before anything can
    be compiled."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != _DYNAMO:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None  # found some other way: the import goes on as without us
        spec.loader = _LoadedThenEager(spec.loader)
        return spec


_WATCH = _DynamoWatch()


def _in_compiled_region() -> bool:
    """Whether this code runs under ``torch.compile`` (Dynamo's frame callback is set on this thread)."""
    if _DYNAMO not in sys.modules:
        return False
    frames = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    get = getattr(frames, "get_eval_frame_callback", None)
    if get is not None:
        callback = get()
    else:  # torch before 2.6 has no getter: the setter returns what it replaces, put back at once
        put = getattr(frames, "set_eval_frame", None)
        if put is None:
            return False
        callback = put(None)
        put(callback)
    return callback is not None and callback is not False


def _force_eager() -> None:
    global _stance_users
    with _stance_lock:
        if _stance_users == 0:
            if _DYNAMO in sys.modules:
                _set_eager_stance()
            elif _WATCH not in sys.meta_path:
                sys.meta_path.insert(0, _WATCH)
        _stance_users += 1


def _release_eager() -> None:
    global _stance_users, _stance_before
    with _stance_lock:
        _stance_users -= 1
        if _stance_users == 0:
            if _WATCH in sys.meta_path:
                sys.meta_path.remove(_WATCH)
            if _stance_before is not None:
                from torch._dynamo import eval_frame

                if isinstance(_stance_before, tuple):
                    eval_frame.set_eval_frame = _stance_before[1]
                else:
                    eval_frame._set_stance(_stance_before)
                _stance_before = None


@contextlib.contextmanager
def compiled_eagerly() -> Iterator[None]:
    """Compiled code runs eagerly while this is open (Dynamo's eager stance, as inside :func:`emulate`), and Dynamo
    compiles nothing and remembers nothing of it. For a whole check, whose float64 reference and native rows run
    outside ``emulate()`` under dispatch modes of their own: there Dynamo traced a ``torch.compile``'d model into
    the modes' handlers, and either failed (``check``: an ``InternalTorchDynamoError`` at the float64 reference) or
    gave up on its frame for good, so that the model's own compiled calls after the check ran eagerly, other
    kernels than without the check (torch 2.13, a compiled MLP: the run's weights no longer bit-identical)."""
    _force_eager()
    try:
        yield
    finally:
        _release_eager()


# -- context cells: which flag values apply to this thread/task now ----------------------------------------------
def context_cells() -> dict[str, str]:
    """The flag cells in force for this thread or task: its scope's level over the process's cells, the SDPA
    kernel PyTorch would pick, and whether cuDNN is on (read, never written)."""
    return dict(_OpCells())


class _OpCells(Mapping):
    """:func:`context_cells` for one op, each cell read when a rule first asks for it: an op consults one or two
    of them, and reading all of them costs more than a small GEMM."""

    __slots__ = ("known", "level")

    def __init__(self) -> None:
        self.level = scope.context_level()
        self.known: dict[str, str] = {}

    def __getitem__(self, name: str) -> str:
        value = self.known.get(name)
        if value is None:
            if name == "sdpa":
                value = sdpa_kernel()
            elif name == CUDNN_CELL:
                value = cudnn_cell()
            elif name in _LEVEL_CELLS:
                # this context's scope decides the matmul cells, whatever the process flags hold; outside scopes,
                # the process level, not another thread's scope that the flags may hold now
                value = (level_cells(self.level) if self.level is not None else scope.process_cells())[name]
            elif name in flags.CELL_NAMES:
                value = flags.read_cell(name)
            else:
                raise KeyError(name)
            self.known[name] = value
        return value

    def __iter__(self) -> Any:
        return iter((*flags.CELL_NAMES, "sdpa", CUDNN_CELL))

    def __len__(self) -> int:
        return len(flags.CELL_NAMES) + 2


_LEVEL_CELLS = frozenset(level_cells("highest"))


def maths(target: str | Target = "a100") -> dict[str, str]:
    """The math ``emulate(target)`` gives each key in this context (scope and flags), by key.

    >>> import tf32lab
    >>> with tf32lab.precision("high"):
    ...     tf32lab.emulation.emulator.maths("a100")["matmul"]
    'tf32-rna'
    """
    return get(target).maths(context_cells())


class _Scratch(threading.local):
    """Per-thread buffers for rounded activations, which live only while their op runs.

    Fresh multi-MB temporaries cost page faults on every op (the allocator hands large blocks back to the OS),
    measured as costly as the rounding itself; so they are reused, across ``emulate`` blocks too, up to ``CAP``
    bytes per thread. They hold no values between ops, only memory. :func:`release_buffers` frees them.

    Buffers come in size classes (a quarter power of two apart: at most 25% unused), and a request takes the
    smallest free buffer of its class or up to twice it, as a view of its first elements. A shape that grows a
    little at a time (a sequence one token longer at each step of a generation) so keeps taking the same buffers;
    pooled by exact size, it left one buffer per length, never taken again, piling up to the cap. A request that
    finds none drops the free buffers it has outgrown (under its class, down to half of it): what a growing shape
    held before.
    """

    CAP = 256 << 20
    REACH = 2  # a request takes a free buffer up to this many times its class

    def __init__(self) -> None:
        self.free: dict[tuple, dict[int, list[torch.Tensor]]] = {}  # (dtype, device) -> class -> buffers
        self.bytes = 0
        self.leased: list[torch.Tensor] = []  # handed out to the op running now

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat buffer of at least ``numel`` elements (its first ``numel`` serve; the holder gives back the
        buffer itself: views made below autograd, as the emulator's are, do not know their base)."""
        want = _size_class(numel)
        classes = self.free.get((dtype, device))
        if classes:
            size = want
            while size <= self.REACH * want:
                free = classes.get(size)
                if free:
                    buf = free.pop()
                    self.bytes -= buf.numel() * buf.element_size()
                    return buf
                size = _size_class(size + 1)
            for size in [s for s in classes if self.REACH * s >= want > s]:  # outgrown
                self.bytes -= sum(b.numel() * b.element_size() for b in classes.pop(size))
        # a normal tensor even under inference mode: one made there is an inference tensor, and an op outside it
        # that took it from the pool and rounded into it raised "Inplace update to inference tensor outside
        # InferenceMode" (an emulated LSTM run under inference mode, then with gradients)
        with torch.inference_mode(False):
            return torch.empty(want, dtype=dtype, device=device)

    def give(self, views: list[torch.Tensor]) -> None:
        for view in views:
            buf = view._base if view._base is not None else view
            size = buf.numel() * buf.element_size()
            # only the pool's own flat buffers, whole classes
            if buf.dim() == 1 and _size_class(buf.numel()) == buf.numel() and self.bytes + size <= self.CAP:
                self.free.setdefault((buf.dtype, buf.device), {}).setdefault(buf.numel(), []).append(buf)
                self.bytes += size

    def release(self, mark: int) -> None:
        if len(self.leased) > mark:
            self.give(self.leased[mark:])
            del self.leased[mark:]


def _size_class(numel: int) -> int:
    """The size of the pooled buffer that serves ``numel`` elements: ``numel`` rounded up to a quarter power of
    two (5, 6, 7 or 8 times a power of two), itself below 8.

    >>> [_size_class(n) for n in (3, 9, 10, 11, 100, 1000, 1024, 1025)]
    [3, 10, 10, 12, 112, 1024, 1024, 1280]
    """
    if numel <= 8:
        return numel
    step = 1 << ((numel - 1).bit_length() - 3)
    return -(-numel // step) * step


_SCRATCH = _Scratch()


def release_buffers() -> None:
    """Free this thread's scratch buffers for rounded activations, kept between ``emulate`` blocks (fresh
    multi-MB buffers cost as much as the rounding itself). Rounded weights never outlive their block.

    >>> release_buffers()
    """
    _SCRATCH.free.clear()
    _SCRATCH.bytes = 0


# emulate(weight_cache=REUSED): a parameter's rounded copy kept from its second use in the block on
REUSED = "reused"


def _dead() -> None:  # what a dead weak reference gives
    return None


def _version(t: torch.Tensor) -> int:
    return -1 if t.is_inference() else t._version


class _WeightCache:
    """Rounded copies of parameters for one ``emulate`` block: a weight used by several ops is rounded once. With
    ``from_second``, a weight is rounded for its first op alone and kept from its second use on (rounded twice): a
    block that reads each weight once (``check``'s rows and reruns, one forward each) keeps no copy of the model.

    An entry is valid while the parameter's version counter and storage are unchanged (``p.data = other`` swaps
    the storage and keeps the counter) and no write to its storage was seen.
    ``.data`` (which has a version counter of its own) and inference tensors (which have none) are covered by the
    second rule: every mutating op in the block passes through the emulator, which calls :meth:`written`. Writes
    between blocks cannot be seen, so nothing is kept past the block; writes that bypass PyTorch inside a block
    (a numpy view of a weight) are the one thing not seen (docs/design.md).
    """

    __slots__ = ("buffers", "entries", "from_second", "recent", "recent_bytes", "seen", "storages")

    # Other operands: inside one backward formula, the last few rounded copies are kept too, as long as they are
    # small (a linear layer's backward reads its output gradient in both of its GEMMs).
    RECENT, RECENT_BYTES = 4, 32 << 20

    def __init__(self, from_second: bool = False) -> None:
        self.entries: dict[tuple, tuple[weakref.ref, int, Any]] = {}
        self.from_second = from_second
        # with from_second, the keys rounded once already (a weight a block uses once is not kept: see get)
        self.seen: dict[tuple, weakref.ref] = {}
        self.storages: dict[int, set[tuple]] = {}  # storage address -> keys of entries made from it
        # Copies live in scratch buffers (fresh multi-MB tensors cost page faults: 3x the rounding of MiniLM's
        # weights); they go back to the thread's pool when the block ends, never earlier (an op may hold one).
        self.buffers: list[torch.Tensor] = []
        # key -> (the tensor, version, value, its buffers, bytes, storage address, backward node), oldest first
        self.recent: collections.OrderedDict[tuple, tuple[torch.Tensor, int, Any, list, int, int, Any]] = \
            collections.OrderedDict()
        self.recent_bytes = 0

    def get(self, t: torch.Tensor, tag: str, fn: Callable, parts: int = 1) -> Any:
        """``fn(t, out)``'s value for parameter ``t``, ``out`` being ``parts`` buffers shaped like ``t``."""
        base = t._base if t._base is not None else t
        # a transposed view (``linear``'s forward reads W.T, its backward W) shares the copy of what it views
        read, flipped = _read_view(t)
        key = (id(base), t.storage_offset(), tuple(read.shape), read.stride(), t.device, tag)
        # the storage's address too: ``p.data = other`` swaps it without touching the version counter
        version = (_version(base), base.untyped_storage().data_ptr())
        hit = self.entries.get(key)
        if hit is not None and hit[0]() is base and hit[1] == version:
            value = hit[2]
        elif self.from_second and self.seen.get(key, _dead)() is not base:
            # the first use in the block: rounded for this op alone, and kept from the second use on. A block that
            # uses each weight once (a check's row, a layer's rerun) held a rounded copy of every weight of the
            # model until its end (all-MiniLM-L6-v2's check: 838 -> 812 MiB peak without them).
            self.seen[key] = weakref.ref(base)
            with torch.inference_mode(False):
                value = fn(read.detach(), [torch.empty(read.shape, dtype=read.dtype, device=read.device)
                                           for _ in range(parts)])
        else:
            with torch.inference_mode(False):  # a copy made under inference_mode must still serve autograd later
                out = [_buffer_like(read, self.buffers) for _ in range(parts)]
                value = fn(read.detach(), out)
            self.entries[key] = (weakref.ref(base), version, value)
            self.storages.setdefault(base.untyped_storage().data_ptr(), set()).add(key)
        return _as_viewed(value, flipped)

    def written(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            if t.layout is not torch.strided:
                # a sparse tensor has no storage of its own: its values may share a parameter's
                if t.layout not in _SPARSE:
                    continue
                t = t._values() if t.layout is torch.sparse_coo else t.values()
            keys = self.storages.pop(t.untyped_storage().data_ptr(), None)
            for key in keys or ():
                self.entries.pop(key, None)
                self._forget(key)

    def get_recent(self, t: torch.Tensor, tag: str, fn: Callable, parts: int = 1) -> Any:
        """``fn(t, out)``'s value for an operand that is not a parameter: inside one backward formula (a linear
        layer's rounds its output gradient for both of its GEMMs), kept for the formula's next GEMMs while it is
        small; else computed in buffers leased to the op running now. A custom ``autograd.Function``'s backward
        is the user's code, which may write between its GEMMs where no op sees it (a numpy view): none kept there."""
        node = _current_node()
        base = t._base if t._base is not None else t
        size = t.numel() * t.element_size() * parts
        if node is None or isinstance(node, _PYTHON_NODE) or t.is_inference() \
                or size + base.numel() * base.element_size() > self.RECENT_BYTES:
            return fn(t, [_buffer_like(t) for _ in range(parts)])
        # A transposed view (the gradient is one GEMM's left operand and the other's right) shares the copy of what
        # it views. Keyed by the memory read; the entry holds the tensor (no other can take that memory meanwhile)
        # and the formula (no user code runs inside it: a write through a numpy view cannot come between).
        read, flipped = _read_view(t)
        key = (t.data_ptr(), tuple(read.shape), read.stride(), t.dtype, t.device, tag)
        version = base._version
        hit = self.recent.get(key)
        if hit is not None and hit[1] == version and hit[6] is node:
            self.recent.move_to_end(key)
            value = hit[2]
        else:
            self._forget(key)
            buffers: list[torch.Tensor] = []
            value = fn(read.detach(), [_buffer_like(read, buffers) for _ in range(parts)])
            storage = base.untyped_storage().data_ptr()
            self.recent[key] = (base, version, value, buffers, size, storage, node)
            self.recent_bytes += size
            self.storages.setdefault(storage, set()).add(key)
            while len(self.recent) > self.RECENT or self.recent_bytes > self.RECENT_BYTES:
                self._forget(next(iter(self.recent)))
        return _as_viewed(value, flipped)

    def _forget(self, key: tuple) -> None:
        gone = self.recent.pop(key, None)
        if gone is not None:
            self.recent_bytes -= gone[4]
            self.storages.get(gone[5], set()).discard(key)
            _SCRATCH.leased.extend(gone[3])  # back to the pool when the op running now ends (it may use them)

    def clear(self) -> None:
        self.entries.clear()
        self.seen.clear()
        self.storages.clear()
        buffers, self.buffers = self.buffers, []
        for entry in self.recent.values():
            buffers += entry[3]
        self.recent.clear()
        self.recent_bytes = 0
        _SCRATCH.give(buffers)

    def __len__(self) -> int:
        return len(self.entries) + len(self.recent)


class _Entry:
    """One entered ``emulate`` block: its ``emulate`` object, weight cache and the modes of its thread."""

    __slots__ = ("cache", "emu", "modes", "thread")

    def __init__(self, emu: emulate, modes: _ThreadModes) -> None:
        self.emu, self.modes, self.thread = emu, modes, threading.get_ident()
        self.cache = _WeightCache(emu.from_second)  # this block's rounded parameter copies; emptied at its end


class _Call:
    """One intercepted op: the math decisions (fixed at entry), the product helpers rules use, and rounding."""

    __slots__ = ("cells", "emu", "entry", "math_seen", "no_tf32", "op", "summed")

    def __init__(self, entry: _Entry, op: str, cells: dict[str, str]) -> None:
        self.entry, self.emu, self.op, self.cells = entry, entry.emu, op, cells
        self.math_seen: Optional[Math] = None
        self.no_tf32: bool = rules.tf32_is_off()
        self.summed: Optional[str] = None  # the accumulation model a "hardware" block applied, if any

    def count(self, math: Math, n: int = 1) -> None:
        """Count ``n`` of this call's op, computed in ``math``, in the block's ``coverage``."""
        self.emu._count(self.op, math, n, self.summed)

    def unhandled(self, what: Optional[str] = None) -> None:
        """This call's op (``what``: it, said more precisely) runs natively: counted in the block's ``unhandled``,
        or ``Tf32LabError`` under ``strict=True``."""
        self.emu._unhandled(what or self.op)

    def math(self, key: str) -> Math:
        """The math of ``key`` ("matmul", "conv", "attention.efficient", ...) for this call."""
        emu = self.emu
        if key in ("matmul", "matvec", "matmul.gemv"):
            key = rules.forced_family() or key
        if self.no_tf32 and emu.math is None and emu.target.device == "cuda" and key in _CUBLAS_KEYS:
            key = "linalg"  # PyTorch's NoTF32Guard: the cuBLAS handle computes IEEE here
        math = emu.math if emu.math is not None else emu.target.math(key, self.cells)
        if emu.handoff is not None and (emu.handoff.computing or emu.handoff.depth):  # watched or recorded
            # the key whose entry gives the math (a convolution with cuDNN off: the matmul's)
            emu.handoff.met(emu.target.table_key(key, self.cells) if emu.math is None else None)
        if emu.rounding is not None and math.rounding is not None and emu.math is None:
            math = Math(math.name, emu.rounding)
        if self.math_seen is None:
            self.math_seen = math
        return math

    def product(self, key: str, full: Callable, a: torch.Tensor, b: torch.Tensor,
                bare: Optional[Callable] = None, as_gemm: Optional[Callable] = None) -> torch.Tensor:
        """``full(a, b)`` computed with the math of ``key``.

        ``full`` is bilinear in ``(a, b)`` plus any term that does not depend on them (a bias, ``beta * C``);
        ``bare`` is the same product without that term (defaults to ``full``). Split maths need it: the three
        partial products must add the term once. ``as_gemm(gemm, a, b)``: ``full(a, b)`` written with
        ``gemm(x, y)`` (= ``x @ y``) for its one GEMM, so that a ``"hardware"`` block can sum it as the target's
        unit does.
        """
        math = self.math(key)
        name = math.name
        if as_gemm is not None and a.dtype == _F32 and b.dtype == _F32:
            model = self._summed_by(key, math)
            if model is not None:
                if name in _SINGLE_ROUND:
                    a, b = self.round(a, math), self.round(b, math)
                return as_gemm(lambda x, y: _accumulation.gemm(x, y, model).to(x.device), a, b)
        if name == "ieee" or a.dtype != _F32 or b.dtype != _F32:
            return full(a, b)
        if name in _SINGLE_ROUND:
            return full(self.round(a, math), self.round(b, math))
        if name == "bfx9":  # all nine products, as three GEMMs: each part of a times the parts of b summed
            hi, mid, lo = self.split(a, math)
            b_sum = self.split(b, math, summed=True)[-1]
            out = full(hi, b_sum).add_((bare or full)(mid, b_sum)).add_((bare or full)(lo, b_sum))
            if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
                # special values propagate as in IEEE float32 (NVIDIA's BF16x9 emulation docs): the parts of a
                # finite operand times an infinite one could otherwise meet as inf - inf
                ieee = full(a, b)
                out = torch.where(torch.isfinite(ieee), out, ieee)
            return out
        # The three products big·big' + big·small' + small·big' as two GEMMs: big·(big' + small') + small·big'.
        # big' + small' is exact in float32 unless small' is tiny next to big' (then off by one float32 rounding),
        # so the sum equals the three products within float32 accumulation error; small·small' stays dropped.
        a_big, a_small = self.split(a, math)
        b_big, b_sum = self.split(b, math, summed=True)
        return full(a_big, b_sum).add_((bare or full)(a_small, b_big))

    def matmul(self, key: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a @ b`` (batches of matrices, broadcast as ``torch.matmul``) computed with the math of ``key``: a fused
        kernel's product, no epilogue, no ``"hardware"`` sum (attention's on the memory-efficient and flash
        kernels).

        A two-part split math (3xTF32, bf16x3) is one GEMM over K doubled, ``[big | small] @ [big' + small' ;
        big']``: the terms of :meth:`product`'s two GEMMs summed in one accumulation (float32 accumulation order
        apart, the same sum; an Inf or NaN gives what it gives there, a NaN or Inf term being in either). The parts
        are split straight into the halves of the two operands, read as they lie: the right one is laid out by
        columns where ``b`` is (an attention's keys, ``k.transpose(-2, -1)``), as splitting them into rows would
        transpose them, which cost more than the GEMM loses reading them so (docs/design.md).
        """
        math = self.math(key)
        if math.name not in _PAIRED or a.dtype != _F32 or b.dtype != _F32 or a.dim() < 2 or b.dim() < 2 \
                or a.size(-1) != b.size(-2):  # other maths, and torch.matmul's own error for a mismatch
            return self.product(key, torch.matmul, a, b)
        k = a.size(-1)
        split = _SPLIT[math.name]
        left = _concatenated(a, a.shape[:-1], 2 * k)
        right = _concatenated(b, (*b.shape[:-2], 2 * k), b.size(-1))
        split(a.detach(), out=(left[..., :k], left[..., k:]))
        split(b.detach(), out=(right[..., k:, :], right[..., :k, :]), summed=True)
        return torch.matmul(left, right)

    def _summed_by(self, key: str, math: Math) -> Optional[_accumulation.Accumulation]:
        """The target's accumulation model for a GEMM of ``key`` in ``math``, in a ``"hardware"`` block."""
        emu = self.emu
        if emu.accumulation != "hardware" or key not in _GEMM_KEYS or (key == "matmul.gemv" and math == IEEE):
            return None  # gemv kernels sum in their own order
        model = emu.target.accumulation_of(math)
        if model is not None:
            self.summed = str(model)
        return model

    def many_linears(self, key: str, nan_free: bool = False) -> tuple[Callable, Callable, Callable]:
        """For the many small GEMMs of one op (an RNN's steps), in the math of ``key``: ``linear(x, w, b)``,
        ``step(acc, h, w)`` = acc + h wᵀ as one GEMM, and ``done()`` to count them. Weights are rounded once
        (cached, and transposed once for ``step``), each activation into a buffer reused across the steps.
        ``nan_free``: the op's inputs hold no NaN, so the hidden states ``step`` rounds hold only default NaNs
        and need no scan."""
        math = self.math(key)
        emu, name = self.emu, math.name
        gemms = [0]

        def done() -> None:
            if gemms[0]:
                emu._count("aten::linear", math, gemms[0])
                gemms[0] = 0

        if name != "ieee" and name not in _SINGLE_ROUND:  # a split math: the general product
            def split_linear(x, w, b):
                return self.step_product(key, lambda p, q: F.linear(p, q, b), x, w, bare=lambda p, q: F.linear(p, q))

            return split_linear, lambda acc, h, w: split_linear(h, w, None).add_(acc), done
        round_fn = _SINGLE_ROUND.get(name)
        hot = formats.hot_rounder(name, math.rounding) if round_fn is not None and nan_free else None
        buffers: dict[tuple, torch.Tensor] = {}
        transposed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def operands(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            gemms[0] += 1
            if round_fn is None or x.dtype != _F32 or w.dtype != _F32:
                return x, w
            w = self.round(w, math) if _is_parameter(w) else round_fn(w, math.rounding)
            return round_fn(x, math.rounding, out=buffer(x)), w

        last: list = [None]  # the buffer asked for last: every step asks for the hidden state's again

        def buffer(x: torch.Tensor) -> torch.Tensor:
            buf = last[0]
            if buf is not None and buf.shape == x.shape and buf.device == x.device:
                return buf
            where = (tuple(x.shape), x.device)
            buf = buffers.get(where)
            if buf is None:
                buf = buffers[where] = torch.empty(x.shape, dtype=_F32, device=x.device)
            last[0] = buf
            return buf

        def linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
            x, w = operands(x, w)
            return F.linear(x, w, b)

        def step(acc: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            held = transposed.get(id(w))
            if held is None or held[0] is not w:  # (w, its rounded copy transposed), kept for this op
                h, w_rounded = operands(h, w)
                held = transposed[id(w)] = (w, w_rounded.t().contiguous())
                return torch.addmm(acc, h, held[1])
            gemms[0] += 1
            if round_fn is not None and h.dtype == _F32:
                if hot is not None and h.is_cpu and h.is_contiguous():
                    h = hot(h, buffer(h))
                else:
                    h = round_fn(h, math.rounding, out=buffer(h), default_nans=nan_free)
            return torch.addmm(acc, h, held[1])

        return linear, step, done

    def step_product(self, key: str, full: Callable, a: torch.Tensor, b: torch.Tensor,
                     bare: Optional[Callable] = None) -> torch.Tensor:
        """:meth:`product` for one of many GEMMs inside one op (an RNN's steps): counted as ``aten::linear``
        of its math, its rounded activation's buffer given back at once."""
        mark = len(_SCRATCH.leased)
        try:
            result = self.product(key, full, a, b, bare)
        finally:
            _SCRATCH.release(mark)
        self.emu._count("aten::linear", self.math(key))
        return result

    # -- operands: rounded copies, cached for parameters, in reused buffers otherwise -----------------------
    def round(self, t: torch.Tensor, math: Math) -> torch.Tensor:
        fn = _SINGLE_ROUND[math.name]

        def rounded(x, out):
            return fn(x, math.rounding, out=out[0])

        if _is_parameter(t) and self.emu.weight_cache:
            return self.entry.cache.get(t, str(math), rounded)
        return self.entry.cache.get_recent(t, str(math), rounded)

    def split(self, t: torch.Tensor, math: Math, summed: bool = False) -> tuple[torch.Tensor, ...]:
        """The parts of ``t`` for a split math, biggest first (``(big, small)`` for x3, three for bfx9); when
        ``summed``, the last part holds the sum of all of them."""
        fn = _SPLIT[math.name]
        count = 3 if math.name == "bfx9" else 2

        def parts(x, out):
            if count == 2:  # the x3 splits sum their parts on the way
                return fn(x, out=tuple(out), summed=summed)
            split = fn(x, out=tuple(out))
            if summed:
                for part in split[-2::-1]:
                    split[-1].add_(part)
            return split

        tag = f"{math.name}{'+' if summed else ''}"
        if _is_parameter(t) and self.emu.weight_cache:
            return self.entry.cache.get(t, tag, parts, count)
        return self.entry.cache.get_recent(t, tag, parts, count)


def _read_view(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(t.mT, True)`` for a transposed view of a contiguous tensor (its copy is the copy of what it views), else
    ``(t, False)``."""
    flipped = not t.is_contiguous() and t.dim() >= 2 and t.mT.is_contiguous()
    return (t.mT if flipped else t), flipped


def _as_viewed(value: Any, flipped: bool) -> Any:
    """A copy made from :func:`_read_view`'s tensor, seen as the operand was (transposed back when flipped)."""
    if not flipped:
        return value
    return tuple(v.mT for v in value) if isinstance(value, tuple) else value.mT


def _buffer_like(t: torch.Tensor, holder: Optional[list] = None) -> torch.Tensor:
    """A scratch tensor shaped like ``t`` (or its transpose), leased to the op running now (or kept in
    ``holder`` until its owner gives it back)."""
    if t.is_contiguous():
        shape, transposed = t.shape, False
    elif t.dim() >= 2 and t.mT.is_contiguous():
        shape, transposed = t.mT.shape, True
    else:  # a layout no GEMM reads as it is (attention's heads): dense batches of matrices by rows or columns as t
        transposed = t.dim() >= 2 and t.stride(-2) == 1 and t.stride(-1) != 1  # has them, which GEMMs read uncopied
        shape = t.mT.shape if transposed else t.shape
    buf = _SCRATCH.take(t.numel(), t.dtype, t.device)
    (_SCRATCH.leased if holder is None else holder).append(buf)
    view = buf[:t.numel()].view(shape)
    return view.mT if transposed else view


def _concatenated(t: torch.Tensor, rows: tuple, cols: int) -> torch.Tensor:
    """A scratch operand of ``(*rows, cols)`` for ``t``'s parts side by side, laid out by columns where ``t`` is
    (a transposed view), so that the split reads ``t`` as it lies."""
    buf = _leased(t.numel() * 2, t.device)
    if t.stride(-2) == 1 and t.stride(-1) != 1:
        return buf.view(*rows[:-1], cols, rows[-1]).mT
    return buf.view(*rows, cols)


def _leased(numel: int, device: torch.device) -> torch.Tensor:
    """A flat float32 scratch buffer of ``numel`` elements, leased to the op running now."""
    buf = _SCRATCH.take(numel, _F32, device)
    _SCRATCH.leased.append(buf)
    return buf[:numel]


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t._base if t._base is not None else t, torch.nn.Parameter)


def _on_meta(args: Any) -> bool:
    """Whether the first tensor among ``args`` is a meta tensor (an op's operands are on one device)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type == "meta"
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            return a[0].device.type == "meta"
    return False


def _holds(args: Any, dtype: torch.dtype = _F32) -> bool:
    """Whether a tensor of ``dtype`` is among ``args`` (lists and tuples of them included)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.dtype == dtype:
                return True
        elif isinstance(a, (list, tuple)) and _holds(a, dtype):
            return True
    return False


def _complex_gemm(call: _Call, func, args: tuple, kwargs: dict) -> torch.Tensor:
    """A complex64 ``mm`` / ``bmm`` (or ``addmm`` / ``baddbmm``: ``beta C + alpha AB``) by parts, each real
    product computed by the real op's rule."""
    real = _COMPLEX_GEMMS[func.overloadpacket]
    rule, plain = rules.RULES[real], real.default

    def product(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return rule(call, plain, (x, y), {})

    if func.overloadpacket is real:
        return _by_parts(product, args[0], args[1])
    c, a, b = args[:3]
    alpha, beta = kwargs.get("alpha", 1), kwargs.get("beta", 1)
    p = _by_parts(product, a, b)
    p = p if alpha == 1 else p * alpha
    return p if beta == 0 else p + (c if beta == 1 else c * beta)


def _by_parts(product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], a: torch.Tensor,
              b: torch.Tensor) -> torch.Tensor:
    """The complex product ``a b`` from four real ``product``s of the parts, as a complex GEMM's tensor cores take
    them (each part rounded to the math on its own). A lazily conjugated or negated operand (autograd's backward
    multiplies by the conjugate) is read as its values first: its ``.imag`` alone would drop the sign."""
    a, b = a.resolve_conj().resolve_neg(), b.resolve_conj().resolve_neg()
    real = product(a.real, b.real) - product(a.imag, b.imag)
    return torch.complex(real, product(a.real, b.imag) + product(a.imag, b.real))


def _native_layout(args: Any) -> Optional[str]:
    """``"sparse"`` where a sparse tensor is among ``args``, ``"nested"`` where a nested tensor of the strided layout
    is (``torch.nested.nested_tensor``'s default: a C++ tensor, no Python subclass, whose ``shape`` raises), else
    None: the operands no rule reads, in one pass over them (every family op asks)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            layout = a.layout
            if layout in _SPARSE:
                return "sparse"
            if layout is torch.strided and a.is_nested:
                return "nested"
        elif isinstance(a, (list, tuple)):
            found = _native_layout(a)
            if found is not None:
                return found
    return None


def _native_cell(args: Any) -> str:
    """The flag cell a native GEMM on these operands obeys."""
    device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
    return "mkldnn.matmul" if device == "cpu" else "cuda.matmul"


@modestack.skips_dynamo_lazily
class _Float64(TorchDispatchMode):
    """Native GEMMs in float64, rounded back to float32: immune to any reduced-precision flag.

    For the rare moment a rule needs IEEE GEMMs but the flag in force must stay reduced (an unguarded scope of
    another thread holds it). Products of rounded operands are exact either way; only the accumulation is
    better than float32, which the emulator's results never promise to match bit for bit.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if optable.family(func.name()) is None or _mutates(func):
            return func(*args, **kwargs)

        def up(t):
            return t.double() if isinstance(t, torch.Tensor) and t.dtype == _F32 else t

        result = func(*[up(a) if not isinstance(a, (list, tuple)) else type(a)(map(up, a)) for a in args],
                      **{k: up(v) for k, v in kwargs.items()})

        def down(t):
            return t.float() if isinstance(t, torch.Tensor) and t.dtype == torch.float64 else t

        return tuple(map(down, result)) if isinstance(result, (tuple, list)) else down(result)


def _in_float64(fn: Callable[[], Any]) -> Any:
    with _Float64():
        return fn()


@modestack.skips_dynamo_lazily
class _Mode(TorchDispatchMode):
    """Per thread: routes family ops of an emulating context to their rule; the rest pass through."""

    def __init__(self) -> None:
        super().__init__()
        self.pinned: Optional[dict[str, str]] = None  # cells of the op being emulated (nested dispatch reuses them)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        entry = scope.current_emulation()
        if entry is None:
            context = backward_threads.launcher()  # autograd's device thread, in a block's backward on a GPU
            if context is not None:
                return backward_threads.run_in(context, self.__torch_dispatch__, func, types, args, kwargs)
            return _passed_on(func, args, kwargs)
        if types:
            names = {t.__name__ for t in types}
            if "DTensor" in names or "NestedTensor" in names:
                # A tensor subclass that computes through its own dispatch (DTensor: a sharded model's parameters;
                # a jagged nested tensor, NaViT's images of several sizes): it runs the op on its local shards or
                # packed values, which come back here as plain tensors and are emulated.
                return NotImplemented
            if "FakeTensor" in names:  # shapes without values (DTensor infers a sharding on them): as it is
                return _passed_on(func, args, kwargs)
        classified = _TREATMENTS.get(func, _UNSEEN)
        if classified is _UNSEEN:
            classified = treatment(func)
        if classified is None or not (_holds(args) or _holds(kwargs.values())):
            if classified is not None and _get_tracing_state() is None and \
                    (_holds(args, _C64) or _holds(kwargs.values(), _C64)):
                if entry.emu.handoff is not None:
                    return entry.emu.handoff.run(func.name(), classified.family, args, kwargs, entry.emu.coverage,
                                                 entry.emu.unhandled,
                                                 lambda: self._complex(entry, classified, func, args, kwargs))
                return self._complex(entry, classified, func, args, kwargs)
            cache = entry.cache
            if (cache.entries or cache.recent) and _mutates(func):  # a write (maybe via .data): copies go
                cache.written(operand_tensors(args) + operand_tensors(kwargs.values()))
            if _get_tracing_state() is None:  # _passed_on's usual case, inline: most ops a model runs end here
                try:
                    return func(*args, **kwargs)
                except RuntimeError as error:
                    return _with_numbers_unwrapped(func, args, kwargs, error)
            return _passed_on(func, args, kwargs)  # under the tracer: the one place that knows what it needs
        if _on_meta(args):  # shapes without values (DTensor's sharding propagation): as it is, and not counted
            return _passed_on(func, args, kwargs)
        tracing = _get_tracing_state()
        if tracing is None:
            handoff = entry.emu.handoff
            if handoff is not None:
                return handoff.run(func.name(), classified.family, args, kwargs, entry.emu.coverage,
                                   entry.emu.unhandled, lambda: self._emulated(entry, classified, func, args, kwargs))
            return self._emulated(entry, classified, func, args, kwargs)
        if entry.emu.handoff is not None:  # the tracer's own run of the op: nothing handed over past it
            entry.emu.handoff.stop()
        # Under torch.jit.trace. The tracer records most ops above this mode and clears its state for what runs
        # below (then ``tracing`` is None here). For the few it leaves to their kernel (convolution records the
        # ``_convolution`` it calls), the native op runs first, so that the user's graph holds what PyTorch
        # records; its output then gets the emulated values. The rule itself runs with the tracer's state off: what
        # it computes is no part of the user's graph, traced sizes would trip the tracer's INTERNAL ASSERT (a view of
        # a scratch buffer), and our own ``.item()`` would warn the user with TracerWarnings.
        traced = _recorded(func, args, kwargs)
        _put_tracing_state(None)
        try:
            value = self._emulated(entry, classified, func, args, kwargs)
            outs, values = operand_tensors((traced,)), operand_tensors((value,))
            if len(outs) != len(values):
                raise Tf32LabError(f"emulating {func.name()} under torch.jit.trace: {len(values)} outputs where "
                                   f"the native op gave {len(outs)}")
            for out, v in zip(outs, values):
                if out is not v:
                    out.copy_(v)
        finally:
            _put_tracing_state(tracing)
        return traced

    def _complex(self, entry: _Entry, classified: Treatment, func, args, kwargs):
        """A family op on complex64 operands. cuBLAS's CGEMM follows the matmul flag as SGEMM does (PyTorch's own
        tests run complex64 matmuls under TF32 at TF32's tolerance: ``tf32_on_and_off``, torch/testing/_internal/
        common_cuda.py): ``mm``, ``bmm``, ``addmm`` and ``baddbmm`` (what complex ``@``, ``matmul``, ``linear``
        and ``einsum`` come to) are computed from their real and imaginary parts, four real products each in the
        target's math; a composite (``einsum`` as ``inference_mode`` dispatches it) broken down into them. On a
        CPU, MKL's CGEMM, which no oneDNN flag reaches, and a GPU's CGEMV (no tensor-core path): IEEE. Any other
        op of a family: broken down where it can be, else unhandled, and said."""
        emu = entry.emu
        call = _Call(entry, func.name(), self.pinned or _OpCells())
        if emu.math is None and (emu.target.device != "cuda" or
                                 (classified.family == "matvec" and call.math("matvec") == IEEE)):
            call.count(IEEE)  # a CPU's CGEMM, a GPU's CGEMV: IEEE, as natively here
            return func(*args, **kwargs)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if func.overloadpacket in _COMPLEX_GEMMS and len(tensors) == len(args) and \
                all(t.dtype == _C64 and t.layout == torch.strided for t in tensors):
            return self._emulated(entry, classified, func, args, kwargs, parts=True)
        # broken down where it is a composite (einsum, matmul: into the products above), else unhandled
        return self._no_rule(call, func, classified.family, classified.how, args, kwargs)

    def _emulated(self, entry: _Entry, classified: Treatment, func, args, kwargs, parts: bool = False):
        family, how, rule, _ = classified
        emu = entry.emu
        cells = self.pinned or _OpCells()
        call = _Call(entry, func.name(), cells)
        pinned, self.pinned = self.pinned, cells
        mark = len(_SCRATCH.leased)
        try:
            layout = _native_layout(args) or (_native_layout(kwargs.values()) if kwargs else None)
            if layout == "sparse":
                # A sparse operand (COO, CSR, CSC, BSR, BSC): on a GPU PyTorch hands the product to cuSPARSE
                # (SpMM / SpGEMM, computed in the operands' type, CUDA_R_32F for float32), which the TF32 flags
                # do not reach (they govern cuBLAS and cuDNN); on a CPU to MKL's sparse BLAS or its own loops, not
                # oneDNN. IEEE float32 on every target, whatever the math asked for, and counted so.
                call.count(IEEE)
                return scope.run_at("highest", lambda: func(*args, **kwargs), cell=_native_cell(args),
                                    refused=lambda: _in_float64(lambda: func(*args, **kwargs)))
            if layout == "nested":
                # A strided nested tensor: PyTorch computes in the nested tensor's own kernel, on sizes that a rule
                # (or a composite's decomposition) cannot read, and raised there. Native, and said.
                call.unhandled(f"{call.op} (nested tensor)")
                return func(*args, **kwargs)
            if how == "no_tf32" and emu.math is None and emu.target.device == "cuda":
                # an op inside which PyTorch turns TF32 off: counted, IEEE
                call.count(call.math("linalg"))
                return scope.run_at("highest", lambda: func(*args, **kwargs), cell=_native_cell(args),
                                    refused=lambda: _in_float64(lambda: func(*args, **kwargs)))
            if how == "unhandled" or rule is None:
                return self._no_rule(call, func, family, how, args, kwargs)
            out = kwargs.pop("out", None) if "out" in kwargs else None
            # the rule computes the value, which ``out`` then gets: it calls the overload without ``out``
            ruled = getattr(func.overloadpacket, "default", func) if out is not None and \
                func._overloadname == "out" else func
            if _no_tf32_backward():
                call.no_tf32 = True

            def run():
                if parts:
                    return _complex_gemm(call, ruled, args, kwargs)
                return rule(call, ruled, args, kwargs)

            # The rounded operands must not be rounded again by the native GEMM: IEEE for this device's cell.
            # a rule that raises: the op's own error where it refuses these operands natively too
            result = _or_natively(func, args, kwargs if out is None else {**kwargs, "out": out}, lambda: scope.run_at(
                "highest", run, cell=_native_cell(args), refused=lambda: _in_float64(run)))
            if result is NotImplemented:  # the rule declined (e.g. a layout it does not model)
                return self._no_rule(call, func, family, "unknown", args,
                                     kwargs if out is None else {**kwargs, "out": out})
            if out is not None:
                _into(out, result, func, args, kwargs)
                result = out
            call.count(call.math_seen or call.math(family))
            if (entry.cache.entries or entry.cache.recent) and (out is not None or _mutates(func)):
                entry.cache.written(operand_tensors(args) + ([out] if out is not None else []))  # addmm_ writes C
            return result
        finally:
            self.pinned = pinned
            _SCRATCH.release(mark)

    def _no_rule(self, call: _Call, func, family: str, how: str, args, kwargs):
        # A composite op decomposes into ops we know (with IEEE GEMMs where PyTorch turns TF32 off inside it);
        # everything else is unhandled (an op outside the table named like a solver: IEEE on every target).
        if how != "unhandled":
            def decomposed():
                with self, (rules.no_tf32() if how == "no_tf32" else contextlib.nullcontext()):
                    return func.decompose(*args, **kwargs)

            # outside this mode: the op checked natively, where its parts raised
            result = _or_natively(func, args, kwargs, decomposed)
            if result is not NotImplemented:
                return result
        if family == "linalg" and how == "unknown":
            call.count(call.math("linalg"))
            return func(*args, **kwargs)
        call.unhandled()
        return func(*args, **kwargs)


def _into(out: torch.Tensor, result: torch.Tensor, func: Any, args: tuple, kwargs: dict) -> None:
    """``result`` written into the caller's ``out=`` as the op writes it natively: an ``out`` of another dtype or
    device checked by the op itself (refused as natively, or cast), one of another shape resized by PyTorch's own
    ``resize_output`` (with its warning where it held elements), through an exact ``mul`` by 1: the emulator's copy
    had refused an empty ``out``."""
    if out.dtype != result.dtype or out.device != result.device:
        _refused_natively(func, args, {**kwargs, "out": out})  # raises where the op refuses it
    if out.shape != result.shape:
        torch.mul(result, 1, out=out)
    else:
        out.copy_(result)


def _or_natively(func: Any, args: tuple, kwargs: dict, compute: Callable[[], Any],
                 outside: Callable[[], Any] = contextlib.nullcontext) -> Any:
    """``compute()``, the emulated ``func``; where it raises, the error the op raises natively on these operands
    (:func:`_refused_natively`, inside ``outside()``: the emulator's modes lifted, for a function mode's call), or
    its own when the op runs natively."""
    try:
        return compute()
    except Tf32LabError:
        raise
    except Exception as exc:
        if not _out_of_memory(exc):
            with outside():
                _refused_natively(func, args, kwargs)
        raise


def _refused_natively(func: Any, args: tuple, kwargs: dict) -> None:
    """Where a rule or a decomposition raised, the op run natively on the caller's own operands.

    An op that refuses them natively too (shapes that do not multiply, a size that does not broadcast) raises its
    own error here, worded as PyTorch words it without tf32lab (the rule's rounded copies had met the same check,
    worded by the kernel the rule called), from a frame that only hands the op on (``func(*args, **kwargs)``:
    ``numbers.origin.forwards``), so that it is the caller's error, not put down to tf32lab. An op that runs
    natively returns here, and the caller raises the rule's error: tf32lab's own. An op that writes its operands
    (``out=``, ``addmm_``) runs on copies of them, so that a caller who catches tf32lab's error finds them as they
    were. Not where the emulation ran out of memory (:func:`_out_of_memory`): the native op, run while the rule's
    buffers are held, would run out too, and a failure the emulation's own memory caused be put down to the
    caller."""
    if "out" in kwargs or _mutates(func):
        args, kwargs = pytree.tree_map_only(torch.Tensor, torch.clone, (args, kwargs))
    try:
        func(*args, **kwargs)
    except Exception as native:
        native.__suppress_context__ = True  # the rule's attempt is no part of the op's own error
        raise


def _out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says an allocation failed (CUDA's ``OutOfMemoryError``; the CPU allocator's RuntimeError)."""
    return isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError)) or (
        isinstance(exc, RuntimeError) and ("can't allocate memory" in str(exc) or "out of memory" in str(exc)))


@contextlib.contextmanager
def _outside_the_emulation(entry: _Entry) -> Iterator[None]:
    """A function mode's call run as it runs natively: the dispatch mode lifted (its rules would count the call and,
    ``strict``, refuse it) and the block's hand-off stopped (a nested tensor's attention, an emulation's native
    check)."""
    if entry.emu.handoff is not None:
        entry.emu.handoff.stop()
    with modestack.lifted(_thread_modes().dispatch):
        yield


_get_tracing_state = torch._C._get_tracing_state
_TRACER = torch._C._parse_dispatch_key("Tracer")


def _put_tracing_state(state: Any) -> None:
    """Set this thread's ``torch.jit.trace`` state from inside an op the tracer dispatched.

    The tracer's kernel excludes its dispatch key while the op runs below it, and PyTorch refuses to set a state
    (even none) while the key is excluded; which keys are included or excluded is put back as it was.
    """
    included = torch._C._dispatch_tls_is_dispatch_key_included(_TRACER)
    excluded = torch._C._dispatch_tls_is_dispatch_key_excluded(_TRACER)
    torch._C._dispatch_tls_set_dispatch_key_excluded(_TRACER, False)
    try:
        torch._C._set_tracing_state(state)
    finally:
        torch._C._dispatch_tls_set_dispatch_key_included(_TRACER, included)
        torch._C._dispatch_tls_set_dispatch_key_excluded(_TRACER, excluded)
_WRAPPED_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}


def _recorded(func, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` natively, with the tracer's dispatch key on, as it is when no mode runs."""
    included = torch._C._dispatch_tls_is_dispatch_key_included(_TRACER)
    excluded = torch._C._dispatch_tls_is_dispatch_key_excluded(_TRACER)
    torch._C._dispatch_tls_set_dispatch_key_excluded(_TRACER, False)
    torch._C._dispatch_tls_set_dispatch_key_included(_TRACER, True)
    try:
        return _native(func, args, kwargs)
    finally:
        torch._C._dispatch_tls_set_dispatch_key_included(_TRACER, included)
        torch._C._dispatch_tls_set_dispatch_key_excluded(_TRACER, excluded)


def _passed_on(func, args: tuple, kwargs: dict) -> Any:
    """An op this mode does not emulate (no float32 operand, not of a family, or no emulation in this context),
    run as it would run without the mode.

    Under ``torch.jit.trace`` that includes the tracer: an op that reaches the mode with the tracing state still
    set is one the tracer leaves to its kernel to record (``aten::convolution`` records the ``_convolution`` it
    calls), but the tracer's key is excluded below its own kernel, so called plainly the kernel's ops would go
    unrecorded and the user's graph would lose the op (a float64 conv model failed to trace: "Cannot insert a
    Tensor that requires grad as a constant", or an output with no "observable data dependence").
    """
    if _get_tracing_state() is not None:
        return _recorded(func, args, kwargs)
    return _native(func, args, kwargs)


def _native(func, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)``, with the tensors PyTorch handed this mode as Python numbers made tensors again.

    PyTorch gives a mode a *wrapped number* (the 0-dim tensor a Python scalar becomes, e.g. a traced module's
    ``prim::Constant``) as a Python number. Ops that take numbers for tensors accept it back (``aten::mul``); the
    others (``aten::view``, ``aten::_local_scalar_dense``) raise. Only then, the number goes back as the 0-dim
    tensor it was (its dtype as PyTorch wraps a Python scalar: float64, int64, bool or complex128).
    """
    try:
        return func(*args, **kwargs)
    except RuntimeError as error:
        return _with_numbers_unwrapped(func, args, kwargs, error)


def _with_numbers_unwrapped(func, args: tuple, kwargs: dict, error: RuntimeError) -> Any:
    """After ``func`` raised ``error``: call it again with the numbers at its tensor arguments made tensors, or
    raise ``error`` if there are none."""
    fixed = _unwrapped_numbers(func, args, kwargs)
    if fixed is None:
        raise error
    return func(*fixed[0], **fixed[1])


def _unwrapped_numbers(func, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
    """``(args, kwargs)`` with the Python numbers at tensor arguments of ``func`` made 0-dim tensors, or None
    if there are none."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return None
    maybe_tensor = torch._C.OptionalType.ofTensor()
    positions = {a.name: i for i, a in enumerate(schema.arguments) if a.type.isSubtypeOf(maybe_tensor)}
    if not positions:
        return None

    def tensor(value: Any) -> Any:
        if type(value) in _WRAPPED_DTYPES:
            return torch.scalar_tensor(value, dtype=_WRAPPED_DTYPES[type(value)])
        return value

    new_args = tuple(tensor(a) if i in positions.values() else a for i, a in enumerate(args))
    new_kwargs = {k: tensor(v) if k in positions else v for k, v in kwargs.items()}
    if all(a is b for a, b in zip(new_args, args)) and all(new_kwargs[k] is v for k, v in kwargs.items()):
        return None
    return new_args, new_kwargs


class Treatment(NamedTuple):
    """What the emulator does with an op of a family: its ``family`` and ``how`` it is computed, the ``rule`` of
    ``rules.RULES`` (None: no rule) and, for an op it cannot compute, ``why`` when the op table says.

    ``how`` is ``rule`` (the rule computes it), ``decomposes`` (broken down into ops with rules), ``no_tf32`` (IEEE
    on CUDA targets, PyTorch's ``NoTF32Guard``; broken down on a CPU target), ``unhandled`` (runs natively, counted
    in ``unhandled``) or ``unknown`` (an op the table does not list, named like a family's: broken down if it can be,
    else a linalg op is counted IEEE and any other is unhandled).
    """

    family: str
    how: str
    rule: Optional[Callable] = None
    why: Optional[str] = None


_TREATMENTS: dict[Any, Optional[Treatment]] = {}
_UNSEEN = object()  # an op not yet in _TREATMENTS (None there: an op no target's math changes)
_MUTATING: dict[Any, bool] = {}


def _mutates(func) -> bool:
    known = _MUTATING.get(func)
    if known is None:
        schema = getattr(func, "_schema", None)
        known = _MUTATING[func] = schema is None or schema.is_mutable
    return known


def treatment(func: Any) -> Optional[Treatment]:
    """How ``emulate()`` computes the op ``func`` (an ``OpOverload``), or None for an op no target's math changes.

    The op table (``tf32lab.know.optable``) says what PyTorch does with the op; ``rules.RULES`` alone says whether
    there is a rule for it.

    >>> import torch
    >>> aten = torch.ops.aten
    >>> [treatment(op)[:2] for op in (aten.mm.default, aten.matmul.default, aten.cudnn_convolution.default)]
    [('matmul', 'rule'), ('matmul', 'decomposes'), ('conv', 'unhandled')]
    >>> treatment(aten.cudnn_convolution.default).why, treatment(aten.cholesky.default)
    ("a backend's own kernel, reached directly", None)
    """
    try:
        return _TREATMENTS[func]
    except KeyError:
        pass
    name = func.name()
    rule = rules.RULES.get(func.overloadpacket) if hasattr(func, "overloadpacket") else None
    op = optable.lookup(name)
    found: Optional[Treatment]
    if op is not None:
        if op.family is None or op.how == "solver":
            found = None
        elif op.how == "kernel":
            found = Treatment(op.family, "unhandled" if rule is None else "rule", rule, op.why)
        else:
            found = Treatment(op.family, op.how, rule, op.why)
    else:  # not in the table: another namespace (a custom op), or an op of a newer torch that looks like a product
        family = optable.family(name)
        found = None if family is None and rule is None else Treatment(family or "matmul",
                                                                        "rule" if rule else "unknown", rule)
    _TREATMENTS[func] = found
    return found


_current_node = getattr(torch._C, "_current_autograd_node", lambda: None)
_PYTHON_NODE = torch.autograd.function.BackwardCFunction  # a custom Function's backward: Python, the user's own


def _no_tf32_backward() -> bool:
    """Whether the op runs inside a backward formula in which PyTorch turns TF32 off (``optable``)."""
    node = _current_node()
    return node is not None and node.name() in optable.NO_TF32_BACKWARD


_RNN_FUNCTIONS = rules.RNN_FUNCTIONS
_SDPA = attention_rules.SDPA_FUNCTION
# The entries of a backward pass. A mode is off inside its own handler, and the autograd engine keeps the function
# mode stack it was called with: a backward started from the handler ran without this mode, so the forward that
# torch.utils.checkpoint recomputes inside it took PyTorch's own SDPA path, not the forward's op (other tensors
# saved: CheckpointError; reentrant: other gradients). ``redispatch_function`` (newer PyTorch, pytorch#177530)
# calls the function past this one handler, so the mode can stay on for the whole backward.
_BACKWARDS = frozenset({torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad})
_redispatch: Optional[Callable] = getattr(torch.overrides, "redispatch_function", None)
RECOMPUTES_EMULATED = _redispatch is not None
"""Whether a checkpointed forward recomputed inside an emulated backward runs as the forward did (this PyTorch)."""
# Python-level torch functions that call F.scaled_dot_product_attention themselves (nn.MultiheadAttention and
# nn.TransformerEncoderLayer with autograd on, need_weights=False). Called from the handler with the mode off, their
# SDPA took this machine's path (the CPU's fused flash kernel, or its math path's bmm GEMMs); kept on, it is the
# target's attention kernel, as a direct call. Only these: every call the mode sees inside costs a handler.
_CALLS_SDPA = frozenset({F.multi_head_attention_forward})
_KEEP_ON = _BACKWARDS | _CALLS_SDPA
COMPOSITES_EMULATED = _redispatch is not None
"""Whether an SDPA inside ``F.multi_head_attention_forward`` is emulated as a direct call is (this PyTorch)."""


_function_mode_stack = getattr(torch.overrides, "_get_current_function_mode_stack", lambda: ())
# torch.device(...) as a context manager: a function mode that changes factory calls only
try:
    from torch.utils._device import DeviceContext as _DeviceContext
except ImportError:  # older PyTorch: no such mode
    _DeviceContext = None


def _skips_none_but_this(types) -> bool:
    """Whether ``redispatch_function`` skips only this mode. It skips every ``__torch_function__`` of the call: a
    tensor subclass's and those of the user's modes below this one would not see a backward or an MHA call they
    may handle, as they do outside ``emulate()``. Then the call goes on as any other, under the known limit below.
    A mode that only passes such calls on (``torch.device`` as a context, or one marked ``passes_composites_on``)
    loses nothing."""
    return all(t is torch.Tensor for t in types) and all(
        getattr(mode, "passes_composites_on", False) or (_DeviceContext is not None and type(mode) is _DeviceContext)
        for mode in _function_mode_stack())


class _FunctionMode(TorchFunctionMode):
    """Per thread: calls that PyTorch decomposes above the dispatcher into kernels of *this* machine: RNNs (whose
    GEMMs belong to cuDNN's RNN kernel on the target) and scaled_dot_product_attention (the target's kernel)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if backward_threads.LAUNCHED and scope.current_emulation() is None:
            context = backward_threads.launcher()  # autograd's device thread, in a block's backward on a GPU
            if context is not None:
                return backward_threads.run_in(context, self.__torch_function__, func, types, args, kwargs)
        if func in _BACKWARDS and _through_a_device(args, kwargs) and scope.current_emulation() is not None:
            # a GPU's backward runs on autograd's device thread: the block is made known there (backward_threads)
            with backward_threads.launched(scope.current_emulation()):
                if _redispatch is not None and _skips_none_but_this(types):
                    return _backward(self, func, types, args, kwargs, judged=False)
                return func(*args, **kwargs)
        # Under torch.jit.trace this mode runs above the tracer, which would record the emulation's own ops in the
        # user's graph: the call goes on to PyTorch, which records it, and the dispatch mode emulates its kernels.
        if (func is _SDPA or func in _RNN_FUNCTIONS) and _get_tracing_state() is None:
            entry = scope.current_emulation()
            if entry is not None:
                if func is _SDPA:
                    if _holds(args) or _holds(kwargs.values()):
                        call = _Call(entry, "aten::scaled_dot_product_attention", _OpCells())
                        strided = (_native_layout(args) or _native_layout(kwargs.values())) == "nested"
                        if strided or any(t.__name__ == "NestedTensor" for t in types):
                            # jagged: the target runs a fused kernel on the packed values, a CPU PyTorch's math
                            # path on each sequence; neither is the target's kernel: native, and said. Strided
                            # nested tensors (no Python subclass) have no sizes a rule could read.
                            call.unhandled(f"{call.op} (nested tensor)" if strided else None)
                            with _outside_the_emulation(entry):  # computed natively, at this thread's own flags
                                return func(*args, **kwargs)
                        return _or_natively(func, args, kwargs, lambda: _handed(
                            entry, call.op, "attention", args, kwargs,
                            lambda: attention_rules.sdpa_function(call, func, args, kwargs)),
                            lambda: _outside_the_emulation(entry))
                elif _holds(args):
                    entry.emu.rnns_met = True  # its GEMMs are counted as aten::linear / aten::mm (families_met)
                    return _or_natively(func, args, kwargs, lambda: _handed(
                        entry, f"aten::{rules.RNN_FUNCTIONS[func]}", "rnn", args, kwargs,
                        lambda: _rnn(entry, func, args, kwargs)), lambda: _outside_the_emulation(entry))
        if func in _KEEP_ON and _redispatch is not None and _skips_none_but_this(types):
            # a backward, and any forward it recomputes, under this mode as the forward was; a composite's SDPA seen
            # here as a direct call is
            if func not in _CALLS_SDPA:
                return _backward(self, func, types, args, kwargs)

            def redispatched():
                with self:
                    return _redispatch(func, types, args, kwargs)

            # multi-head attention asserts its operands' shapes in Python, below this frame
            met = scope.current_emulation()
            return _or_natively(func, args, kwargs, redispatched, lambda: _outside_the_emulation(met)
                                if met is not None else contextlib.nullcontext())
        # Known limit without redispatch_function (older PyTorch): the mode is off inside its own handler, so a call
        # made *inside* another Python-level torch function (F.multi_head_attention_forward) is not seen here; the
        # dispatch mode still emulates what it decomposes into (docs/design.md). Made as the caller's call, for
        # the warnings it raises (call_site); this frame hands it on (origin.HANDS_ON), as call_site's does.
        _tf32lab_hands_on = True
        return call_site.as_called(func, args, kwargs)


def _backward(mode: _FunctionMode, func, types, args: tuple, kwargs: dict, judged: bool = True) -> Any:
    """A backward call under ``mode``, as the forward ran. Not rerun natively where it raises: it has run part of
    its graph (and freed it). ``judged`` (a backward on this thread, as a CPU graph's runs): an error autograd's
    engine raised before any op was emulated on this thread during the call (a loss that does not require grad, a
    non-scalar loss with no gradient given) is the caller's own, as natively, and this frame says it handed the
    call on (``origin.HANDS_ON``). Once one was, the engine's error (a gradient of the wrong shape) may be an
    emulated op's result, and stays tf32lab's; so does every error of a backward on autograd's device threads."""
    before = _EMULATED_HERE.count
    try:
        with mode:
            return _redispatch(func, types, args, kwargs)
    except Exception:
        _tf32lab_hands_on = judged and _EMULATED_HERE.count == before  # origin.HANDS_ON, read from this frame
        raise


class _EmulatedHere(threading.local):
    """How many ops this thread has emulated, in any block (:class:`_Coverage` counts them): a backward tells from it
    whether an op of its own was emulated, whatever other threads of its block do meanwhile."""

    count = 0


_EMULATED_HERE = _EmulatedHere()


class _Coverage(collections.Counter):
    """A block's coverage, ``(op, math) -> ops``; each op counted (by ``_count``, or taken from a hand-off) is
    counted for its thread too (:data:`_EMULATED_HERE`)."""

    def __setitem__(self, key: Any, value: int) -> None:
        _EMULATED_HERE.count += 1
        super().__setitem__(key, value)

    def update(self, *args: Any, **kwargs: Any) -> None:  # an empty Counter's update is dict's, not item by item
        _EMULATED_HERE.count += 1
        super().update(*args, **kwargs)


def _through_a_device(args: tuple, kwargs: dict) -> bool:
    """Whether a backward call may run on autograd's device threads: its first tensors (``Tensor.backward``'s self,
    ``autograd.backward``'s and ``grad``'s outputs) are on a device other than the CPU, or, on a GPU machine,
    whatever they are (``loss.cpu().backward()`` goes back through a GPU's graph)."""
    first = args[0] if args else kwargs.get("tensors", kwargs.get("outputs"))
    return any(t.device.type != "cpu" for t in operand_tensors((first,))) or torch.cuda.is_initialized()


def _handed(entry: _Entry, op: str, family: str, args: Any, kwargs: Any, compute: Callable[[], Any]) -> Any:
    """``compute()``, or what the block's hand-off gives for it (``tf32lab.emulation.reuse``)."""
    handoff = entry.emu.handoff
    if handoff is None:
        return compute()
    return handoff.run(op, family, args, kwargs, entry.emu.coverage, entry.emu.unhandled, compute)


def _rnn(entry: _Entry, func, args, kwargs):
    """An RNN call, its recurrence run without the dispatch mode: the rule rounds each GEMM's operands itself
    (``_Call.many_linears``), so the per-step pointwise ops cost what they cost natively, not a Python handler
    each (an LSTM ran 6x slower than native through the mode)."""
    call = _Call(entry, f"aten::{rules.RNN_FUNCTIONS[func]}", _OpCells())
    modes = _thread_modes()

    def quietly(fn: Callable[[], Any]) -> Any:
        def run():
            with modestack.lifted(modes.dispatch):
                return fn()

        # the rounded operands must not be rounded again by the native GEMM: IEEE for this device's cell
        return scope.run_at("highest", run, cell=_native_cell(args), refused=lambda: _in_float64(run))

    # the backward of a whole-sequence layer runs ``quietly`` too (``rules.recurrent``)
    return quietly(lambda: rules.rnn_function(call, func, args, kwargs, quietly))


class _ThreadModes:
    """The two modes of one thread, on its stacks while any ``emulate`` block of the thread is open."""

    __slots__ = ("dispatch", "function", "open")

    def __init__(self) -> None:
        self.function, self.dispatch = _FunctionMode(), _Mode()
        self.open = 0

    def acquire(self) -> None:
        if self.open == 0:
            # Still on the stacks if a block was last closed from another thread; else push them.
            on_stack = any(m is self.dispatch for m in _get_current_dispatch_mode_stack())
            if not on_stack:
                modestack.push(self.function)
                try:
                    modestack.push(self.dispatch)
                except BaseException:
                    modestack.remove(self.function)
                    raise
        self.open += 1

    def release(self, here: bool) -> None:
        self.open -= 1
        if self.open == 0 and here:  # another thread cannot reach this thread's stacks
            modestack.remove(self.dispatch)
            modestack.remove(self.function)


class _ThreadLocalModes(threading.local):
    modes: Optional[_ThreadModes] = None


_THREAD = _ThreadLocalModes()


def _thread_modes() -> _ThreadModes:
    modes = _THREAD.modes
    if modes is None:
        modes = _THREAD.modes = _ThreadModes()
    return modes


class emulate(contextlib.ContextDecorator):
    """Compute float32 matmul-family ops as ``target`` would under the active precision scope and flags.

    Args:
        target: a name from ``tf32lab.know.targets.TARGETS`` (``"a100"``, ``"h100"``, ``"v100"``, ``"cpu-amx"``, ...)
            or a ``Target``.
        math: force one math for every family (``"ieee"``, ``"tf32"``, ``"bf16"``, ``"bf16x3"``, ``"tf32x3"``,
            ``"bfx9"``).
        rounding: operand rounding for ``tf32`` / ``bf16`` (``"rna"``, ``"rne"``, ``"rz"``), instead of the
            target's.
        strict: raise ``Tf32LabError`` at the first family op that ran without emulation.
        accumulation: ``"ideal"`` (products exact, sums in float32 as this CPU's BLAS orders them) or
            ``"hardware"`` (None: the ``TF32LAB_ACCUMULATION`` setting, ``"ideal"`` by default): GEMMs (mm,
            bmm, addmm, baddbmm, linear, matmul) summed as the target's matrix unit does, bit for bit on its
            inputs, chained along K as a kernel without split-K would (``tf32lab.numbers.accumulation``;
            float32 at ``highest`` as an SGEMM's FMA chain). Slower (the compiled kernels of ``tf32lab[fast]``
            help); ops whose kernel order is unknown (convolutions, gemv, split maths) stay ideal, and their
            coverage line says ``ideal sum``.
        weight_cache: keep a rounded copy of each parameter for the block (True); ``"reused"``: keep one from a
            parameter's second use in the block on, its first use rounded for that op alone (for a block that runs
            one forward: it then holds no rounded copy of the model, and a weight it reads twice is rounded twice);
            or round it at every use and keep nothing (False): for a model sharded with FSDP2, whose gathered
            parameters are freed after each module, where copies kept for the block would hold the whole model on
            every rank.
        handoff: a ``tf32lab.emulation.reuse.Handoff`` that two blocks at different levels share, one after the
            other: the second takes the first's results of the leading ops both compute alike.

    ``coverage`` counts ``(op, math)`` pairs and ``unhandled`` the family ops that ran natively. The block is local
    to its thread and asyncio task, like ``precision()``: another task on the same thread, and threads started
    inside it, run natively unless they enter it themselves (tasks created inside it inherit it). Rounded copies
    of parameters are kept for the block and dropped at its end, or as soon as a write to them is seen. Inside,
    ``torch.compile``'d code runs eagerly (process-wide while any emulation is active, ``fullgraph=True`` too), and
    TorchScript modules are emulated too; ``torch.jit.trace`` records the model's own ops, not the emulation's.
    Results match the GPU within float32 accumulation error, not bit for bit; convolutions and RNNs only within
    rounding-mode noise too, as cuDNN picks each kernel's operand rounding (RNE, RNA or no TF32) and a target
    models one (``tf32lab.know.targets``). Products with a sparse operand compute IEEE on every target (cuSPARSE: the
    TF32 flags do not reach it) and are counted as ``ieee``. complex64 GEMMs compute from their real and imaginary
    parts in the target's math (cuBLAS's CGEMM follows the matmul flag; a CPU target's MKL CGEMM: IEEE).
    Exiting in another thread than the one that entered
    raises ``Tf32LabError`` (the block is closed all the same).

    Example:

        >>> import torch, tf32lab
        >>> x, w = torch.randn(64, 256), torch.randn(256, 32)
        >>> with tf32lab.emulate("a100", math="tf32") as emu:
        ...     y = x @ w
        >>> bool((y - x @ w).abs().max() > 0), emu.unhandled
        (True, Counter())
    """

    def __init__(self, target: str | Target = "a100", *, math: Optional[str] = None,
                 rounding: Optional[str] = None, strict: bool = False, accumulation: Optional[str] = None,
                 weight_cache: bool | str = True, handoff: Optional[Handoff] = None) -> None:
        if weight_cache not in (True, False, REUSED):
            raise Tf32LabError(f"unknown weight_cache {weight_cache!r}; accepted: True, False, {REUSED!r}")
        self.target = get(target)
        self.handoff = handoff
        self.weight_cache = bool(weight_cache)
        self.from_second = weight_cache == REUSED  # rounded copies kept from a weight's second use in the block
        self.accumulation = check_accumulation(accumulation)
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
        self.coverage: collections.Counter[tuple[str, str]] = _Coverage()
        self.unhandled: collections.Counter[str] = collections.Counter()
        self.rnns_met = False  # an RNN ran whole: at the rnn key's math, its GEMMs in coverage as aten::linear/mm
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        if not hasattr(self, "unhandled"):  # made by Dynamo (torch 2.6) with __new__ alone, for its messages
            return "<emulate>"
        ops = sum(self.coverage.values())
        forced = f", math={self.math}" if self.math else ""
        if self.accumulation != "ideal":
            forced += f", accumulation={self.accumulation}"
        return (f"<emulate {self.target.name}{forced}: {ops} ops emulated, "
                f"{sum(self.unhandled.values())} unhandled>")

    def __enter__(self) -> emulate:
        cells = flags.read_cells()
        for cell in ("mkldnn.conv", "mkldnn.rnn"):
            if cells[cell] != "ieee":
                raise Tf32LabError(
                    f"emulate() computes with IEEE CPU kernels, but {cell} is {cells[cell]!r}; set "
                    f"torch.backends.{cell}.fp32_precision = 'ieee' (or 'none') first")
        if self.math is None:  # a value no target row knows, or bfx9 on a GPU without it: no guessing
            for cell in sorted({e.cell for e in self.target.entries.values() if e.cell and e.cell in cells}):
                check_value(self.target, cell, cells[cell])
        if _in_compiled_region():
            raise Tf32LabError(
                "emulate() was entered inside a torch.compile'd function: the block cannot make the function run "
                "eagerly from there; enter emulate() around the call (compiled code then runs eagerly, emulated)")
        modes = _thread_modes()
        _force_eager()
        try:
            modes.acquire()
        except BaseException:
            _release_eager()
            raise
        outer = scope.current_emulation()
        if outer is not None and outer.emu.handoff is not None:  # its ops are this block's, unseen by the outer's
            outer.emu.handoff.stop()
        entry = _Entry(self, modes)
        try:
            scope.enter_emulation(self, entry, _closed)
        except BaseException:
            _closed_entry(entry)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        scope.exit_emulation(self)

    # -- bookkeeping ------------------------------------------------------------------------------------------
    def _count(self, op: str, math: Math, n: int = 1, summed: Optional[str] = None) -> None:
        label = str(math)
        if self.accumulation == "hardware":  # say how the products were summed, known order or not (counted_math)
            label = f"{label}{SUMMED}{summed}" if summed else f"{label}{SUMMED}ideal sum"
        with self._lock:
            self.coverage[(op, label)] += n

    def _unhandled(self, op: str) -> None:
        with self._lock:
            self.unhandled[op] += 1
        if self.strict:
            raise Tf32LabError(
                f"emulate(strict=True): {op} belongs to a precision-sensitive family but has no emulation rule "
                "and does not decompose; it would run with the native math")


def families_met(emu: emulate) -> set[Optional[str]]:
    """The op families a block computed (None: an op of no family, unhandled): those of its ``coverage`` and
    ``unhandled`` ops, and ``rnn`` where an RNN ran whole, whose GEMMs its coverage counts as ``aten::linear`` and
    ``aten::mm`` at the RNN's math (cuDNN's flag on a GPU), not the matmul level's.

    >>> import torch
    >>> lstm = torch.nn.LSTM(4, 8)
    >>> with emulate("a100") as emu:
    ...     _ = lstm(torch.randn(3, 2, 4))
    >>> sorted(families_met(emu)), sorted(op for op, _ in emu.coverage)
    (['matmul', 'rnn'], ['aten::linear'])
    """
    found = {optable.family(op) for op, _ in emu.coverage} | {optable.family(op.split()[0]) for op in emu.unhandled}
    return found | {"rnn"} if emu.rnns_met else found


def _closed(node: scope.Emulation) -> None:
    """A block ended (its exit, its task's end, or its thread's death): drop its weights, modes and stance."""
    _closed_entry(node.entry)


def _closed_entry(entry: _Entry) -> None:
    entry.cache.clear()
    try:
        entry.modes.release(here=entry.thread == threading.get_ident())
    finally:
        _release_eager()

