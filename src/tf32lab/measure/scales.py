"""The magnitudes that formed each output of the float64 reference: what an output whose reference is zero or
cancels is judged over (``metrics.Scale``, ``metrics.CANCELLED``).

A round-trip residual ``R.T @ (R @ x) - x`` is exactly zero in float64 for a rotation that float64 holds
exactly, and nearly zero for any other: its relative error is infinite, or huge, at every level, ``highest``
included, and says nothing (pytorch#79270). What such an output can be judged over is the size of what cancelled:
``|R.T @ (R @ x)| + |x|``. That is the componentwise scale of rounding-error analysis (``|A||x| + |b|`` for
``Ax + b``; Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §7.2), taken for the output's last
step.

During the reference run, :class:`Formed` keeps the last ``KEPT`` ops that sum or multiply their operands
(``SUMS``), and the ops that only move values (``MOVES``: views, copies), each with its operands. Afterwards,
:meth:`Formed.scales` finds the op that produced each output tensor, steps back over the ops that only moved it,
and computes the summing op again over the absolute values of its operands (a difference as a sum), in float64:
its norm is the output's :class:`~tf32lab.numbers.metrics.Scale`. The ops after it that scale, bound or reduce
the value without cancelling it (``TRAILS``: ``1e6 * r``, ``relu(r)``, ``r.mean(0)``, ``linalg.norm(r, dim=0)``)
are computed again over those magnitudes in place of the value's absolute values, as views are moved over them.
An output made by another op (``exp``, ``softmax``: never zero by cancellation), or earlier than the last
``KEPT`` ops (a hidden state returned beside the logits), or whose operands the model wrote into afterwards, gets
none and is judged over its own norm.

Cost: a membership test and a deque append per op, one op per output at the end. Memory: the operands of the
last ``KEPT`` summing or moving ops whose results the run still holds (an entry goes with its result); an op that
only moves, copies or trails a value is kept only where that value is a kept op's result (a ReLU after a
convolution is not: it would hold the convolution's output for nothing).

Example:

    >>> import torch
    >>> from tf32lab.measure.scales import Formed
    >>> x = torch.tensor([3.0, -4.0], dtype=torch.float64)
    >>> with Formed() as formed:
    ...     residual = (x * 2.0) - x - x
    >>> residual.tolist(), round(formed.scales({"r": residual})["r"].norm, 6)   # |2x - x| + |x|
    ([0.0, 0.0], 10.0)
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tf32lab.control import modestack
from tf32lab.numbers.metrics import Scale
from tf32lab.numbers.trees import named_leaves, operand_tensors

__all__ = ["KEPT", "Formed"]

KEPT = 16  # summing and moving ops kept: an output's last step and the views after it


def _packets(*names: str) -> frozenset:
    aten = torch.ops.aten
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


# ops whose result is a sum of products of their operands (or a quotient): over absolute values, a magnitude
SUMS = _packets("add", "sub", "rsub", "mul", "div", "neg", "sum", "mean", "mm", "bmm", "addmm", "addbmm", "baddbmm",
                "matmul", "linear", "einsum", "dot", "vdot", "mv", "addmv", "cat", "stack", "addcmul")
# ops that only move or copy values: the magnitudes move with them
MOVES = _packets("view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "squeeze", "unsqueeze",
                 "select", "slice", "flatten", "unflatten", "numpy_T", "alias", "split", "unbind", "chunk",
                 "narrow", "movedim", "view_as_real")
SAME = _packets("clone", "contiguous", "detach", "_to_copy", "lift_fresh", "lift_fresh_copy")
# ops after the summing one that scale, bound or reduce a value without cancelling it: a bound on their operands'
# magnitudes bounds their result's, so an operand's magnitudes go through them in place of its absolute values
# (|c·r| <= |c|·m, |relu(r)| <= m, |Σ r| <= Σ m, ‖r‖ <= ‖m‖ where |r| <= m)
TRAILS = _packets("mul", "div", "neg", "sum", "mean", "abs", "relu", "clamp", "clamp_min", "clamp_max",
                  "hardtanh", "linalg_vector_norm", "norm", "frobenius_norm")
_PASSED = _packets("abs", "relu", "clamp", "clamp_min", "clamp_max", "hardtanh")  # elementwise: m itself
_DIFFERENCES = _packets("sub", "rsub")
_VIEWS = _packets("view", "_unsafe_view")
_KEPT_OPS = SUMS | MOVES | SAME | TRAILS
_KEEPS: dict[Any, bool] = {}  # op overload -> whether its packet is kept (the packet is a new lookup per op)


class _Entry:
    """One op kept: its operands (held), its results (weakly: one the run drops can be no output, and its
    entry goes, operands and all)."""

    __slots__ = ("args", "func", "kwargs", "results", "versions")

    def __init__(self, func: Any, args: tuple, kwargs: dict, results: list[torch.Tensor],
                 died: Optional[Callable[[Any], None]] = None) -> None:
        self.func, self.args, self.kwargs = func, args, kwargs
        self.results = [weakref.ref(r, died) for r in results]
        self.versions = _versions(args, kwargs, results)

    def alive(self) -> bool:
        return any(r() is not None for r in self.results)

    def unchanged(self) -> bool:
        results = [r() for r in self.results]
        return None not in results and _versions(self.args, self.kwargs, results) == self.versions


def _versions(args: tuple, kwargs: dict, results: list[torch.Tensor]) -> Optional[tuple[int, ...]]:
    try:
        return tuple(t._version for t in (*operand_tensors((*args, *kwargs.values())), *results))
    except RuntimeError:  # an inference tensor keeps no version: nothing to tell a later write by
        return None


@modestack.skips_dynamo_lazily
class _Mode(TorchDispatchMode):
    def __init__(self, formed: Formed) -> None:
        super().__init__()
        self.formed = weakref.proxy(formed)  # no cycle: what it keeps goes when its owner drops it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.formed.record(func, args, kwargs, out)
        return out


class Formed:
    """A dispatch mode over a run that keeps its last summing and moving ops (see the module's docstring).
    ``active()``: whether an op now belongs to the run (False while the caller runs its own ops inside it).

    ``run``: a float64 run (``measure.reference.Float64Run``) this one sits directly above: told of each op's
    result by the run's own dispatch mode (its ``on_result``) instead of through a mode of its own, which costs
    every op of the run a second Python dispatch. It keeps the same ops: those reach the run's mode as they reach
    a mode above it."""

    def __init__(self, active: Optional[Callable[[], bool]] = None, run: Any = None) -> None:
        self.active = active or (lambda: True)
        self.run = run
        self.kept: deque[_Entry] = deque(maxlen=KEPT)
        self._dead = False  # a kept op's result went since the kept ops were last swept
        self._mode = _Mode(self)
        self._memo: dict[int, Optional[tuple[torch.Tensor, str]]] = {}  # during scales(): id(tensor) -> formed

    @property
    def mode(self) -> Any:
        """Its dispatch mode: what to lift off the stack to run without it (with a ``run``: on no stack, lifted
        with the run's own)."""
        return self._mode

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """``func`` ran on ``args`` and ``kwargs`` and gave ``out``: kept where it sums or moves values."""
        kept = _KEEPS.get(func)
        if kept is None:
            kept = _KEEPS[func] = func.overloadpacket in _KEPT_OPS
        if kept and self.active():
            results = [out] if isinstance(out, torch.Tensor) else (
                [t for t in out if isinstance(t, torch.Tensor)] if isinstance(out, (list, tuple)) else [])
            if results and (func.overloadpacket in SUMS or self._continues(func.overloadpacket, args)):
                self.keep(_Entry(func, args, kwargs, results, self.died))

    def _continues(self, packet: Any, args: tuple) -> bool:
        """Whether an op that only moves, copies or trails values ran on a result of an op kept: only then can it
        carry magnitudes to an output (:meth:`_formed` steps back through it to that op). One on anything else
        (a convolution's result, a ReLU after it) is not kept, nor its operand held: a conv net's reference held
        each ReLU's input, a float64 activation, as long as the ReLU's output lived (its check's peak memory)."""
        operands = operand_tensors(args[:1 if packet in MOVES or packet in SAME or packet in _PASSED else 2])
        if not operands:
            return False
        made = {id(r()) for e in self.kept for r in e.results if r() is not None}
        return any(id(t) in made for t in operands)

    def keep(self, entry: _Entry) -> None:
        # swept only when a result went (told by its weak reference), not every entry asked at every op: the
        # kept ops are the same, at a fraction of the cost per op (a decoder runs half again as many ops)
        if self._dead:
            self._dead = False
            self.kept = deque((e for e in self.kept if e.alive()), maxlen=KEPT)
        self.kept.append(entry)

    def died(self, _: Any) -> None:
        """A kept op's result is gone (its weak reference's callback)."""
        self._dead = True

    def __enter__(self) -> Formed:
        if self.run is None:
            modestack.push(self._mode)
        else:
            if self.run.on_result is not None:
                raise RuntimeError("the float64 run already tells another of its results")
            self.run.on_result = self.record
        return self

    def __exit__(self, *exc: object) -> None:
        if self.run is None:
            modestack.remove(self._mode)
        else:
            self.run.on_result = None

    def scales(self, outputs: Any) -> dict[str, Scale]:
        """Output name (as ``trees.named_leaves`` names it) -> the magnitudes that formed it, for the float
        outputs made by a summing op among those kept; then forgets the ops (and their operands)."""
        found, self._memo = {}, {}
        try:
            with torch.no_grad():
                for name, value in named_leaves(outputs):
                    if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
                        formed = self._magnitudes(value, 0)
                        if formed is not None:
                            magnitudes, op = formed
                            found[name] = Scale(float(torch.linalg.vector_norm(magnitudes.double())), op)
        finally:
            self.kept.clear()
            self._memo = {}
        return found

    def _magnitudes(self, t: torch.Tensor, depth: int) -> Optional[tuple[torch.Tensor, str]]:
        """|op|(|operands|) of the summing op that made ``t`` (through the ops that moved, scaled or reduced its
        values), and its name; None where no such op is kept."""
        if depth > KEPT:
            return None
        if id(t) not in self._memo:  # an operand used twice (x * x) is looked up once
            self._memo[id(t)] = self._formed(t, depth)
        return self._memo[id(t)]

    def _formed(self, t: torch.Tensor, depth: int) -> Optional[tuple[torch.Tensor, str]]:
        entry, index = next(((e, i) for e in reversed(self.kept) for i, r in enumerate(e.results) if r() is t),
                            (None, 0))
        if entry is None or not entry.unchanged():
            return None
        packet = entry.func.overloadpacket
        if packet in TRAILS:
            trailed = self._trailed(entry, depth)
            if trailed is not None:
                return trailed
        if packet in SUMS:
            try:
                return _over_absolute(entry.func, entry.args, entry.kwargs), entry.func.name()
            except (RuntimeError, TypeError, ValueError):  # an overload that takes no float64 magnitudes
                return None
        source = next(iter(operand_tensors(entry.args[:1])), None)
        inner = None if source is None else self._magnitudes(source, depth + 1)
        if inner is None:
            return None
        magnitudes, op = inner
        if packet in SAME:  # a copy: contiguous, as the copy the model views next
            return magnitudes.contiguous(), op
        try:
            # a view of magnitudes laid out otherwise than the model's tensor may need a copy: reshape
            move = torch.ops.aten.reshape if packet in _VIEWS else entry.func
            moved = move(magnitudes, *entry.args[1:], **entry.kwargs)
        except (RuntimeError, TypeError, ValueError):
            return None
        if isinstance(moved, (list, tuple)):
            moved = moved[index]
        return (moved, op) if isinstance(moved, torch.Tensor) and moved.shape == t.shape else None

    def _trailed(self, entry: _Entry, depth: int) -> Optional[tuple[torch.Tensor, str]]:
        """A trailing op (``TRAILS``) over its operands' magnitudes where one of them has some, and the ops'
        names; None where none has."""
        packet = entry.func.overloadpacket
        # a divisor, or clamp's bounds, keep their absolute values: only what is divided or bounded trails
        tensors = [a for a in entry.args[:1 if packet is torch.ops.aten.div or packet in _PASSED else 2]
                   if isinstance(a, torch.Tensor)]
        inner = [(a, self._magnitudes(a, depth + 1)) for a in tensors]
        formed = [(a, f) for a, f in inner if f is not None]
        if not formed:
            return None
        ops = " then ".join(dict.fromkeys(f[1] for _, f in formed))
        op = f"{ops} then {entry.func.name()}"
        if packet in _PASSED:
            return formed[0][1][0], op
        swap = {id(a): f[0] for a, f in formed}
        args = tuple(swap.get(id(a), a) if isinstance(a, torch.Tensor) else a for a in entry.args)
        try:
            return _over_absolute(entry.func, args, entry.kwargs), op
        except (RuntimeError, TypeError, ValueError):
            return None


def _absolute(value: Any, scalar: bool = False) -> Any:
    """A float tensor's absolute values in float64; a number's where the schema calls it a Scalar (an operand or
    a coefficient, not a dimension)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex():
            return value.detach().to(torch.complex128 if value.is_complex() else torch.float64).abs()
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_absolute(v) for v in value)
    if scalar and isinstance(value, (int, float)) and not isinstance(value, bool):
        return abs(value)
    return value


def _over_absolute(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """``func`` over the absolute values of its operands and coefficients, a difference as a sum."""
    kinds = {a.name: str(a.type) == "Scalar" for a in func._schema.arguments}
    names = [a.name for a in func._schema.arguments]
    absolute = [_absolute(a, i < len(names) and kinds[names[i]]) for i, a in enumerate(args)]
    kw = {k: _absolute(v, kinds.get(k, False)) for k, v in kwargs.items()}
    if func.overloadpacket in _DIFFERENCES:  # a - alpha·b, (rsub) b - alpha·a: |a| + |alpha|·|b|
        alpha = kw.pop("alpha", absolute[2] if len(absolute) > 2 else 1)
        first, second = absolute[0], absolute[1]
        result = first * alpha + second if func.overloadpacket is torch.ops.aten.rsub else first + second * alpha
        return result if isinstance(result, torch.Tensor) else torch.as_tensor(result, dtype=torch.float64)
    result = func(*absolute, **kw)
    return result.abs() if isinstance(result, torch.Tensor) else torch.as_tensor(abs(result), dtype=torch.float64)
