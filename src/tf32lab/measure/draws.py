"""Random draws: the same values in every row of a check, the float64 reference included.

PyTorch's generators give a float64 tensor other values than a float32 one from the same state: on a CPU
``torch.rand`` draws other numbers and ``torch.randn`` rounds differently; on CUDA dropout keeps other units. A
model that samples (a VAE's ``mu + std * torch.randn_like(std)``, noise injection, diffusion noise, dropout in
training) would be compared with a reference that drew other numbers, and its error would be the noise's, not the
precision's. One rule, here, for every run:

- **one state per row**: every row (each level, the policy, float32's floor, the float64 reference, a layer's
  reruns) starts from one seed, drawn once inside :class:`Streams`, which puts the caller's random state back
  (PyTorch's CPU generator and the model's CUDA devices', NumPy's and Python's global ones, which the seed seeds
  too) on every exit;
- **drawn at float32**: in a float64 run (``Float64Run``, or a ``.double()`` copy under :class:`SameDraws`),
  each op of :data:`RANDOM_OPS` draws at float32 from the generator's state, the call a float32 row makes, and the
  values are cast up (:func:`drawn_at_float32`); where a draw is combined with the input (dropout, ``rrelu``,
  ``normal(mean, std)``) the combination is computed in float64.

PyTorch has one default generator per device for the whole process, so two checks running at once in two threads
would draw from each other's streams; :class:`Streams` refuses the second one in one line.

Lazy modules (``nn.LazyLinear``) draw their weights at their first call: :func:`materialised` makes them once,
before any row, so every row starts from the same weights.

Example:

    >>> import torch
    >>> from tf32lab.measure.draws import SameDraws
    >>> _ = torch.manual_seed(0); drawn = torch.rand(3)
    >>> _ = torch.manual_seed(0)
    >>> with SameDraws():
    ...     wide = torch.rand(3, dtype=torch.float64)
    >>> wide.dtype, torch.equal(wide, drawn.double())
    (torch.float64, True)
"""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Iterable
from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tf32lab.control import modestack
from tf32lab.control.scope import precision
from tf32lab.emulation.attention_rules import sdpa_dropout
from tf32lab.errors import Tf32LabError

__all__ = ["NARROW", "RANDOM_OPS", "WIDE", "DrawLog", "MathPathDropout", "SameDraws", "Streams", "draw_kind",
           "draw_plan", "drawn_at_float32", "lazy_note", "materialised", "random_name", "random_op", "seeded"]

aten = torch.ops.aten

# Every aten op that consumes a generator's numbers: those whose schema takes a ``Generator?`` argument (seed,
# manual_seed and initial_seed aside, which read or set the state) and native_dropout, which draws from the default
# generator without one (tests/test_random_draws.py checks this list against this torch's schemas). rrelu,
# rand and randn without a generator are composites or overloads of these.
_RANDOM_NAMES = (
    "bernoulli", "bernoulli_", "binomial", "cauchy", "cauchy_", "exponential", "exponential_", "geometric",
    "geometric_", "log_normal", "log_normal_", "multinomial", "native_dropout", "_fused_dropout", "normal", "normal_",
    "normal_functional", "_no_grad_normal_", "_no_grad_uniform_", "poisson", "rand", "rand_like", "randint",
    "randint_like", "randn", "randn_like", "random", "random_", "randperm", "rrelu", "rrelu_", "rrelu_with_noise",
    "rrelu_with_noise_", "rrelu_with_noise_functional", "_sample_dirichlet", "_standard_gamma", "uniform", "uniform_",
)
RANDOM_OPS: frozenset[Any] = frozenset(getattr(aten, name) for name in _RANDOM_NAMES if hasattr(aten, name))

_NARROW = {torch.float64: torch.float32, torch.complex128: torch.complex64}
_WIDE = {torch.float32: torch.float64, torch.complex64: torch.complex128}


def random_name(name: str) -> bool:
    """Whether a Python-level call of this name (``torch.randn``, ``Tensor.normal_``) is one of the draws."""
    return name in _RANDOM_NAMES


def random_op(func: Any) -> bool:
    """Whether the aten op ``func`` (an overload) draws from a generator (:data:`RANDOM_OPS`)."""
    return getattr(func, "overloadpacket", None) in RANDOM_OPS


def _narrowed(t: Any) -> Any:
    if isinstance(t, torch.Tensor) and t.dtype in _NARROW:
        return t.to(_NARROW[t.dtype])
    return t


def _widened(t: Any) -> Any:
    if isinstance(t, torch.Tensor) and t.dtype in _WIDE:
        return t.to(_WIDE[t.dtype])
    return t


def _wide_in(args: Iterable[Any]) -> bool:
    return any(isinstance(a, torch.Tensor) and a.dtype in _NARROW for a in args) \
        or any(isinstance(a, (list, tuple)) and _wide_in(a) for a in args)


_WRITES: dict[Any, tuple[int, ...]] = {}


def _writes(func: Any) -> tuple[int, ...]:
    """Positions of the arguments ``func`` writes into (``out=`` included), from its schema."""
    known = _WRITES.get(func)
    if known is None:
        known = tuple(i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None
                      and a.alias_info.is_write)
        _WRITES[func] = known
    return known


def drawn_at_float32(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` (one of :data:`RANDOM_OPS`) as a float32 row calls it, from the generator's present state, its
    values cast up to float64: float64 (complex128) tensors it reads are narrowed, ``dtype=torch.float64`` becomes
    float32, a float64 tensor it writes into gets the float32 draw copied in. Dropout, ``rrelu`` and ``normal`` with
    tensor moments draw their random part so and combine it with the float64 input in float64. An op that reads
    and asks for nothing in float64 runs as it is."""
    special = _SPECIAL.get(func.overloadpacket)
    if special is not None and _wide_in((*args, *kwargs.values())):
        return special(func, args, kwargs)
    return _drawn(func, args, kwargs)


def _drawn(func: Any, args: tuple, kwargs: dict) -> Any:
    """The rule of :func:`drawn_at_float32` without an op's special case."""
    dtype = kwargs.get("dtype")
    if dtype not in _NARROW and not _wide_in((*args, *kwargs.values())):
        return func(*args, **kwargs)
    names = [a.name for a in func._schema.arguments]
    written = {names[i] for i in _writes(func)}
    twins: list[tuple[torch.Tensor, torch.Tensor]] = []  # (float64 tensor written into, its float32 twin)

    def narrow(name: str, value: Any) -> Any:
        if name in written and isinstance(value, torch.Tensor) and value.dtype in _NARROW:
            twin = value.to(_NARROW[value.dtype])
            twins.append((value, twin))
            return twin
        if isinstance(value, (list, tuple)):
            return type(value)(map(_narrowed, value))
        return _narrowed(value)

    narrow_args = [narrow(names[i] if i < len(names) else "", a) for i, a in enumerate(args)]
    narrow_kwargs = {k: narrow(k, v) for k, v in kwargs.items()}
    if dtype in _NARROW:
        narrow_kwargs["dtype"] = _NARROW[dtype]
    result = func(*narrow_args, **narrow_kwargs)
    for wide, twin in twins:
        wide.copy_(twin)
    back = {id(twin): wide for wide, twin in twins}

    def widen(t: Any) -> Any:
        wide = back.get(id(t))
        return _widened(t) if wide is None else wide

    return type(result)(map(widen, result)) if isinstance(result, (list, tuple)) else widen(result)


def _dropout(func: Any, args: tuple, kwargs: dict) -> Any:
    """``native_dropout(x, p, train)`` / ``_fused_dropout(x, keep)``: the mask drawn from a float32 twin of ``x``,
    applied to ``x`` in float64 with the op's scale."""
    x = args[0]
    out, mask = func(_narrowed(x), *args[1:], **kwargs)
    if func.overloadpacket is aten.native_dropout:
        train = args[2] if len(args) > 2 else kwargs.get("train")
        if train is False:
            return _widened(out), mask
        p = args[1]
        scale = 1.0 / (1.0 - p) if p < 1 else 0.0
    else:
        keep = args[1] if len(args) > 1 else kwargs["p"]
        scale = 1.0 / keep if keep > 0 else 0.0
    return x * mask * scale, mask


def _normal(func: Any, args: tuple, kwargs: dict) -> Any:
    """``normal(mean, std)`` with a tensor moment: a standard normal draw at float32, as PyTorch's kernel makes it
    (``output.normal_(0, 1).mul_(std).add_(mean)``), scaled and shifted in float64."""
    schema = func._schema.arguments
    names = [a.name for a in schema]
    bound = {**dict(zip(names, args)), **kwargs}
    mean, std = bound.get("mean", 0.0), bound.get("std", 1.0)
    if "self" in bound or "size" in bound:  # normal_functional(self, mean, std), normal(mean, std, size): floats
        return _drawn(func, args, kwargs)
    tensors = [t for t in (mean, std) if isinstance(t, torch.Tensor)]
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    z = torch.empty(shape, dtype=torch.float32, device=tensors[0].device)
    z.normal_(0.0, 1.0, generator=bound.get("generator"))
    drawn = z.to(torch.float64) * std + mean
    out = bound.get("out")
    if isinstance(out, torch.Tensor):
        return out.copy_(drawn)
    return drawn


def _rrelu(func: Any, args: tuple, kwargs: dict) -> Any:
    """``rrelu_with_noise`` (and its in-place and functional forms): in training the slopes drawn at float32 into
    a float32 twin of ``noise`` from a float32 twin of ``x``, then ``x * noise`` in float64 (the kernel's: noise is
    1 where ``x > 0``); out of training nothing is drawn."""
    names = [a.name for a in func._schema.arguments]
    bound = {**dict(zip(names, args)), **kwargs}
    if not bound.get("training", False):
        return func(*args, **kwargs)
    x, noise = bound["self"], bound["noise"]
    narrow = {**bound, "self": _narrowed(x), "noise": _narrowed(noise)}
    narrow.pop("out", None)
    functional = func.overloadpacket is getattr(aten, "rrelu_with_noise_functional", None)
    base = aten.rrelu_with_noise.default
    twin = narrow["noise"] if narrow["noise"] is not noise else noise.clone()
    base(narrow["self"], twin, narrow.get("lower", 0.125), narrow.get("upper", 1.0 / 3.0), True,
         narrow.get("generator"))
    wide_noise = twin.to(noise.dtype)
    if functional:
        return x * wide_noise, wide_noise
    noise.copy_(wide_noise)
    if func.overloadpacket is aten.rrelu_with_noise_:
        return x.mul_(noise)
    out = bound.get("out")
    return torch.mul(x, noise, out=out) if isinstance(out, torch.Tensor) else x * noise


_SPECIAL: dict[Any, Callable[[Any, tuple, dict], Any]] = {
    aten.native_dropout: _dropout, aten._fused_dropout: _dropout, aten.normal: _normal,
    aten.rrelu_with_noise: _rrelu, aten.rrelu_with_noise_: _rrelu,
    **({aten.rrelu_with_noise_functional: _rrelu} if hasattr(aten, "rrelu_with_noise_functional") else {}),
}


@modestack.skips_dynamo_lazily
class SameDraws(TorchDispatchMode):
    """Every op of :data:`RANDOM_OPS` drawn at float32 (:func:`drawn_at_float32`), every other op as it is: the
    float64 copy of a model (``.double()``) draws the values its float32 rows draw. ``drawn`` counts the draws."""

    def __init__(self) -> None:
        super().__init__()
        self.drawn = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if random_op(func):
            self.drawn += 1
            return drawn_at_float32(func, args, kwargs)
        return func(*args, **kwargs)


class MathPathDropout(TorchFunctionMode):
    """Attention with dropout (``F.scaled_dot_product_attention(..., dropout_p > 0)``) on PyTorch's math path, the
    one a float64 reference can run: a native row on a GPU would run a fused kernel (memory-efficient, flash,
    cuDNN), which draws its dropout mask inside the kernel from its own Philox offsets. Measured on an H200 (torch
    2.11), the memory-efficient kernel kept other weights than the math path from the same state, and the training
    check of a BERT with attention dropout 0.1 then gave float32 a drift of 8.6e-05 and a step-1 gradient 1.6e-02
    from float64 (5.5e-08 and 1.4e-07 on the math path), beside which every level passed. The math path's dropout
    is ``at::dropout``, whose draw :class:`SameDraws` makes alike in float64. ``rerouted`` counts the calls,
    ``nn.MultiheadAttention``'s among them (its ``F.multi_head_attention_forward`` calls SDPA where this mode is off:
    the whole call is sent).

    Its products are then the math path's, at the level (TF32 at ``high``), where the fused float32 kernel computes
    3xTF32 at every level: attention's error at ``high`` is an upper bound.

    Example:

        >>> import torch, torch.nn.functional as F
        >>> q = torch.randn(1, 2, 4, 8)
        >>> with MathPathDropout() as route:
        ...     _ = F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
        ...     _ = F.scaled_dot_product_attention(q, q, q)
        >>> route.rerouted
        1
    """

    def __init__(self) -> None:
        super().__init__()
        self.rerouted = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is torch.nn.functional.scaled_dot_product_attention and sdpa_dropout(args, kwargs)) or \
                _mha_sdpa_dropout(func, args, kwargs):
            # nn.MultiheadAttention (nn.Transformer*'s layers) calls SDPA inside F.multi_head_attention_forward,
            # where this mode is off: the whole call goes to the math path
            from torch.nn.attention import SDPBackend, sdpa_kernel

            self.rerouted += 1
            with sdpa_kernel([SDPBackend.MATH]):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _mha_sdpa_dropout(func, args: tuple, kwargs: dict) -> bool:
    """Whether ``func(*args, **kwargs)`` is ``F.multi_head_attention_forward`` calling SDPA with dropout: in training,
    ``dropout_p > 0`` and ``need_weights=False`` (with weights it computes them with bmm and ``F.dropout``)."""
    if func is not torch.nn.functional.multi_head_attention_forward:
        return False

    def arg(i: int, name: str, default: Any) -> Any:
        return kwargs.get(name, args[i] if len(args) > i else default)

    return bool(arg(10, "dropout_p", 0.0)) and bool(arg(13, "training", True)) and not arg(15, "need_weights", True)


# -- which dtype each draw is made at ---------------------------------------------------------------------------
# A draw's dtype kind: float32 (complex64) or float64 (complex128); another dtype (float16, an integer) as its name.
NARROW, WIDE = "float32", "float64"


def draw_kind(out: Any) -> Optional[str]:
    """The kind of dtype a draw's values were made in: that of its first floating (complex) result, None where it
    has none (``randperm``)."""
    for t in (out if isinstance(out, (list, tuple)) else (out,)):
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
            if t.dtype in _WIDE:
                return NARROW
            return WIDE if t.dtype in _NARROW else str(t.dtype).removeprefix("torch.")
    return None


@modestack.skips_dynamo_lazily
class DrawLog(TorchDispatchMode):
    """Keeps each draw of a float32 row, in order: its op and dtype kind (:func:`draw_kind`), in :attr:`drawn`.
    ``check`` compares them with its float64 reference's (:func:`draw_plan`)."""

    def __init__(self) -> None:
        super().__init__()
        self.drawn: list[tuple[str, Optional[str]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)  # the hand-off origin.forwards knows: an error here is the op's
        if random_op(func):
            self.drawn.append((func.name(), draw_kind(out)))
        return out


def draw_plan(reference: list[tuple[str, Optional[str]]],
              row: list[tuple[str, Optional[str]]]) -> tuple[Optional[list[Optional[str]]], int]:
    """What the reference must draw at, learnt from a float32 row's draws: ``(plan, differing)``. ``plan`` is the
    row's dtype kind per draw, to draw the reference again with, where the two runs made the same draws and only
    ``differing`` (> 0) of them at another of float32 and float64; ``(None, 0)`` where they agree; ``(None, -1)``
    where the draws cannot be matched (other ops, another count, another dtype)."""
    if len(reference) != len(row) or any(a[0] != b[0] for a, b in zip(reference, row)):
        return None, -1
    differing = 0
    for (_, ours), (_, theirs) in zip(reference, row):
        if ours != theirs:
            if {ours, theirs} != {NARROW, WIDE}:
                return None, -1
            differing += 1
    return ([kind for _, kind in row], differing) if differing else (None, 0)


# -- one state per row, and one check at a time -----------------------------------------------------------------
_OWNER_LOCK = threading.Lock()
_owner: list[Any] = [None, 0, ""]  # the thread that holds PyTorch's generators for a check, its depth, what it runs


def cuda_devices(*trees: Any) -> list[int]:
    """The CUDA devices of the tensors in ``trees`` (modules' parameters and buffers, tensors, lists of them)."""
    found: set[int] = set()
    for tree in trees:
        if isinstance(tree, torch.nn.Module):
            tensors: Iterable[Any] = (*tree.parameters(), *tree.buffers())
        elif isinstance(tree, dict):
            tensors = tree.values()
        elif isinstance(tree, (list, tuple)):
            tensors = tree
        else:
            tensors = (tree,)
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                found.add(t.device.index or 0)
    return sorted(found)


class Streams:
    """The random streams of one check: the caller's state kept (PyTorch's CPU generator and that of each CUDA
    device in ``devices``, NumPy's and Python's global ones) and put back on every exit; a seed drawn once
    (:attr:`seed`), and :meth:`seeded` to start a row from it; :meth:`state` / :meth:`put` for a layer's reruns.

    Only one check at a time may hold them: entered while another thread's check holds them, it raises
    ``Tf32LabError`` (PyTorch's default generators are the process's, so both checks' draws would cross); a
    check nested in the same thread shares them."""

    def __init__(self, devices: Iterable[int] = (), what: str = "check") -> None:
        self.devices, self.what = sorted(set(devices)), what
        self.seed = 0
        self._fork: Any = None
        self._saved: list[tuple[Callable[[Any], None], Any]] = []

    def __enter__(self) -> Streams:
        me = threading.current_thread()
        with _OWNER_LOCK:
            if _owner[0] is not None and _owner[0] is not me:
                raise Tf32LabError(
                    f"{self.what}: another check ({_owner[2]}) is running in thread {_owner[0].name!r} of this "
                    f"process, and PyTorch's random generators are the process's: both would draw from one stream "
                    f"(their random draws would cross); run the checks one after another, or in separate processes")
            _owner[0], _owner[1] = me, _owner[1] + 1
            if _owner[1] == 1:
                _owner[2] = self.what
        try:
            self._saved = _python_states()
            self._fork = torch.random.fork_rng(devices=self.devices)
            self._fork.__enter__()
            # drawn inside the kept state: the caller's streams are as they were afterwards
            self.seed = int(torch.randint(0, 2**31 - 1, ()))
        except BaseException:
            self._release()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._fork is not None:
                self._fork.__exit__(None, None, None)
            for setter, state in self._saved:
                setter(state)
        finally:
            self._release()

    def _release(self) -> None:
        with _OWNER_LOCK:
            _owner[1] -= 1
            if _owner[1] == 0:
                _owner[0], _owner[2] = None, ""

    def seeded(self) -> None:
        """Every stream at the start of a row."""
        seeded(self.seed, self.devices)

    def state(self) -> tuple[Any, ...]:
        """The generators' present state (the CPU's, then each device's, then Python's and NumPy's global ones)."""
        return (torch.random.default_generator.get_state(),
                *(torch.cuda.default_generators[d].get_state() for d in self.devices),
                *(state for _, state in _python_states()))

    def drew_since(self, state: tuple[Any, ...]) -> bool:
        """Whether Python's or NumPy's global generator moved since ``state`` (from :meth:`state`): a call that
        drew from them runs no PyTorch random op to say so (``np.random.standard_normal`` made into a tensor)."""
        return any(not _same_state(now, then)
                   for (_, now), then in zip(_python_states(), state[1 + len(self.devices):]))

    def put(self, state: tuple[Any, ...]) -> None:
        """The generators back at ``state`` (from :meth:`state`)."""
        torch.random.default_generator.set_state(state[0])
        for device, s in zip(self.devices, state[1:]):
            torch.cuda.default_generators[device].set_state(s)
        for (setter, _), s in zip(_python_states(), state[1 + len(self.devices):]):
            setter(s)


def seeded(seed: int, devices: Iterable[int]) -> None:
    """The CPU generator and those of ``devices`` seeded with ``seed`` (never another device's: the caller's
    streams there would change), and NumPy's and Python's global generators too: a model may draw from them
    (torchsde's ``sdeint`` takes its Brownian motion's entropy from ``numpy.random.randint``), and each row must
    draw what the others draw. Called inside :class:`Streams`, which puts the caller's states back."""
    torch.random.default_generator.manual_seed(seed)
    for device in devices:
        torch.cuda.default_generators[device].manual_seed(seed)
    random.seed(seed)
    numpy = sys.modules.get("numpy")  # never imported here: a model that draws from it has imported it
    if numpy is not None:
        numpy.random.seed(seed)


def _same_state(a: tuple, b: tuple) -> bool:
    """Two states of one generator alike: ``random.getstate()``'s or ``numpy.random.get_state()``'s tuples (NumPy's
    holds an array, which ``==`` compares element by element)."""
    def same(x: Any, y: Any) -> bool:
        equal = x == y
        return bool(equal.all()) if hasattr(equal, "all") else bool(equal)

    return len(a) == len(b) and all(x is y or same(x, y) for x, y in zip(a, b))


def _python_states() -> list[tuple[Callable[[Any], None], Any]]:
    """Python's and NumPy's global random states, with their setters (a batches function may draw from them)."""
    saved: list[tuple[Callable[[Any], None], Any]] = [(random.setstate, random.getstate())]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        saved.append((numpy.random.set_state, numpy.random.get_state()))
    return saved


# -- lazy modules -----------------------------------------------------------------------------------------------
def lazy_modules(model: torch.nn.Module) -> list[str]:
    """The modules of ``model`` whose parameters or buffers are not made yet (``nn.LazyLinear`` before its first
    call)."""
    lazy = torch.nn.modules.lazy.LazyModuleMixin
    return [name or "the model" for name, m in model.named_modules()
            if isinstance(m, lazy) and m.has_uninitialized_params()]


def materialised(model: torch.nn.Module, run: Callable[[torch.nn.Module], Any], what: str) -> list[str]:
    """``model``'s lazy modules made, once, by one float32 call ``run(model)`` in eval mode without gradients, its
    buffers put back afterwards (a call must not move a running average) and the caller's random state kept;
    returns the names of the modules it made. A lazy module that the call leaves unmade is refused by name
    (``what``: the workload, for the message)."""
    lazy = lazy_modules(model)
    if not lazy:
        return []
    modes = [(m, m.training) for m in model.modules()]
    kept = [(b, b.detach().clone()) for b in model.buffers()
            if not isinstance(b, torch.nn.parameter.UninitializedBuffer)]
    try:
        with torch.random.fork_rng(devices=cuda_devices(model)), torch.no_grad(), precision("highest"):
            model.eval()
            run(model)
    except Tf32LabError:
        raise
    except Exception as exc:
        raise Tf32LabError(f"{what}: its lazy module(s) {', '.join(map(repr, lazy))} could not be made by one "
                           f"float32 call before the rows ({type(exc).__name__}: {exc}); call the model once "
                           f"yourself first") from exc
    finally:
        for m, training in modes:
            m.training = training
        with torch.no_grad():
            for b, value in kept:
                if b.shape == value.shape:
                    b.copy_(value)
    left = lazy_modules(model)
    if left:
        raise Tf32LabError(f"{what}: lazy module(s) {', '.join(map(repr, left))} still have no weights after one "
                           f"call of the model, so each row would make its own: call them once yourself first")
    return lazy


def lazy_note(made: list[str]) -> str:
    """The report's note on the lazy modules :func:`materialised` made."""
    names = ", ".join(repr(n) for n in made[:3]) + (f" and {len(made) - 3} more" if len(made) > 3 else "")
    return (f"lazy module(s) {names} made once before any row, by one float32 call in eval mode: every row, the "
            f"float64 reference included, starts from those weights")
