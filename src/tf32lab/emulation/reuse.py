"""What one emulated run of a model hands to the next run of it at another level: the results of the family ops
that both levels compute alike, up to the first op whose math differs.

Emulation is deterministic, so two runs of one model on the same inputs agree bit for bit up to the first op
whose math the two levels set differently: every op before it got the same operands and computed the same math.
On a GPU target, cuDNN's convolutions and RNNs follow cuDNN's own flag, not the matmul level
(``torch.backends.cudnn.allow_tf32``, on by default: https://pytorch.org/docs/stable/notes/cuda.html#tensorfloat-32-tf32-on-ampere-and-later-devices),
so a conv net's or an LSTM's rows at `highest` and `high` differ only from their first matmul on. ``check`` runs
its levels one after another: the first run keeps (:meth:`Handoff.record`) the results of those leading ops, and
the next (:meth:`Handoff.replay`) takes them instead of computing them again, in the same order, each op checked
against the one kept (its name, its operands' shapes, dtypes and bits, its other arguments) and its coverage counted
as the first run counted it. The first op that does not match, or whose family the two levels compute apart,
ends the hand-off for the rest of the run (``aten::lstm_cell``: two ``aten::linear``, GEMMs at the matmul level,
so of the matmul family, ``know.optable``); so does one of a family computed alike inside which an op of a family
computed apart ran, and one that draws random numbers
(an RNN's dropout between its layers, in train mode): taken, it would not draw, and every later draw of the run
would be another; and one whose result is in an autograd graph (a gradient taken inside the forward).

Only convolutions and RNNs are kept (``KEPT``): the ops whose math cuDNN's flags set, and the costly ones a level
leaves alone. Other families computed alike are computed again (the same bits). What is kept is a copy (the model
may write into its own), within ``budget`` bytes; given a ``spill`` (the check's ``measure.spill.SpillFile``), a
large one is written out instead and read back when taken: held in memory, it would stay alive across the whole
first run, past where the model frees its own (a conv net's first activation, 64 MiB, set the check's peak).

    >>> import torch
    >>> from tf32lab.emulation.reuse import Handoff
    >>> handoff = Handoff(frozenset({"conv", "rnn"}))
    >>> handoff.record(); handoff.replay(); handoff.taken
    0
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from tf32lab.know.targets import Target, rnn_key
from tf32lab.numbers.layout import memory_order

__all__ = ["KEPT", "Handoff", "alike", "computed_alike"]

KEPT = frozenset({"conv", "rnn"})  # the families kept (see the module's docstring)
# What a run keeps for the next at most, written out and held together (what one recording adds to the spill file); a
# model whose leading convolutions make more is handed what fits, the rest computed again.
BUDGET = 256 << 20


def alike(target: Target, a: str, b: str, cells: Mapping[str, str]) -> frozenset[str]:
    """The op families ``target`` computes alike at levels ``a`` and ``b`` under ``cells`` (those a level leaves
    alone): every key of the family gets the same math at both (its sub-keys too: ``matmul.gemv``); an RNN on a CPU
    target also ``matmul``'s, whose GEMMs a GRU runs there (``know.targets.rnn_key``).

    >>> from tf32lab.know.targets import get
    >>> sorted(alike(get("a100"), "highest", "high", {"cuda.conv": "tf32", "cuda.rnn": "tf32", "sdpa": "math"}))
    ['conv', 'matvec', 'rnn']
    """
    first, second = target.maths_at(a, cells), target.maths_at(b, cells)
    families = {key.split(".")[0] for key in (*first, *second)}
    found = {f for f in families
             if all(first.get(k) == second.get(k) for k in (*first, *second) if k == f or k.startswith(f + "."))}
    # an RNN's GEMMs take the keys rnn_key gives them on this target (a CPU's GRU: matmul's): alike if those are
    if not {rnn_key(target.device, mode) for mode in ("lstm", "gru")} <= found:
        found.discard("rnn")
    return frozenset(found)


def computed_alike(target: Target, first: str, second: str, cells: Mapping[str, str],
                   ops: Iterable[tuple[str, Iterable[Optional[str]]]], families: Iterable[str] = ()) -> bool:
    """Whether a layer's call that computed ``ops`` at ``first`` (each op's family and the keys of the target's
    table its math came from, as :meth:`Handoff.watch` notes them) gives the same bits at ``second``: every key it
    met gives the same math at both (an SDPA call that ran the efficient kernel is 3xTF32 on an A100 at both
    levels, though the math kernel's GEMMs part them); an op whose math came from no key, where its family is
    computed alike. ``families``: those of the float64 reference's call, whose ops the call did not meet must be
    alike too (float32 may take another path than float64 did).

    >>> from tf32lab.know.targets import get
    >>> cells = {"cuda.conv": "tf32", "cuda.rnn": "tf32", "sdpa": "efficient"}
    >>> computed_alike(get("a100"), "highest", "high", cells, [("attention", {"attention.efficient"})])
    True
    >>> computed_alike(get("a100"), "highest", "high", cells, [("attention", {"attention.math"})])
    False
    """
    together = alike(target, first, second, cells)
    a, b = target.maths_at(first, cells), target.maths_at(second, cells)
    met = set()
    for family, keys in ops:
        met.add(family)
        keys = set(keys)
        if not keys and family not in together:
            return False
        # None: the block's own math (emulate(math=...)), the same at every level
        if any(k is not None and (k not in a or a[k] != b.get(k)) for k in keys):
            return False
    return set(families) - met <= together


class _Kept(NamedTuple):
    op: str
    signature: tuple
    result: Any
    coverage: collections.Counter
    unhandled: collections.Counter


def _signature(args: Any, kwargs: Any) -> tuple:
    """What an op's call must share with the one kept: each tensor's shape, dtype, device and a digest of its
    bits, and every other argument's value (strides, padding, flags). The digest: a model whose Python state
    outside it (a module-level step counter, which no reset puts back) changes its input before its first
    convolution feeds it other values in each run, in tensors of the same shapes."""
    leaves, spec = tree_flatten((args, kwargs))
    return (str(spec), *((tuple(v.shape), v.dtype, v.device, _digest(v)) if isinstance(v, torch.Tensor) else
                         v if isinstance(v, (int, float, bool, str, type(None), torch.dtype, torch.device))
                         else type(v).__name__ for v in leaves))


_AS_INTEGERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


_DIGEST_CHUNK = 1 << 16  # elements summed at once: an integer sum makes an int64 copy of what it sums (512 KiB)


def _digest(t: torch.Tensor) -> Optional[int]:
    """The sum of a tensor's elements read as integers of their width: any one changed bit changes it, in one
    pass over the tensor (a convolution's input, whose product costs far more), a chunk at a time (summed whole,
    torchcrepe's second convolution's input, 48 MiB, made a 96 MiB int64 copy: the check's peak); None where it
    has no plain bits to read (a sparse or meta tensor, a subclass)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided or t.is_meta or \
            t.element_size() not in _AS_INTEGERS or t.numel() == 0:
        return None
    t = t.detach().resolve_conj().resolve_neg()
    lying = memory_order(t)  # its elements flat, no copy, where they fill a span of memory; else a copy
    flat = (lying if lying is not None else t.contiguous().view(-1)).view(_AS_INTEGERS[t.element_size()])
    return sum(int(flat[i:i + _DIGEST_CHUNK].sum()) for i in range(0, flat.numel(), _DIGEST_CHUNK))


def _random_states(args: Any) -> list[torch.Tensor]:
    """The states of the generators an op on ``args`` may draw from: the CPU's, and those of its CUDA devices."""
    devices = {t.device.index if t.device.index is not None else torch.cuda.current_device()
               for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor) and t.device.type == "cuda"}
    return [torch.random.default_generator.get_state(),
            *(torch.cuda.default_generators[d].get_state() for d in sorted(devices))]


class _Written(NamedTuple):
    held: Any  # what ``spill.hold`` gave: its ``load()`` gives the tensor back


def _copied(result: Any, spill: Any) -> Any:
    leaves, spec = tree_flatten(result)
    return spec, [_kept(v, spill) if isinstance(v, torch.Tensor) else v for v in leaves]


def _kept(t: torch.Tensor, spill: Any) -> Any:
    held = spill.hold(t) if spill is not None else t
    return t.clone() if held is t else _Written(held)


def _handed(leaves: list) -> list:
    return [v.held.load() if isinstance(v, _Written) else v for v in leaves]


def _nbytes(result: Any) -> int:
    return sum(v.numel() * v.element_size() for v in tree_flatten(result)[0] if isinstance(v, torch.Tensor))


class Handoff:
    """The results one run keeps for the next; ``alike``: the op families the two runs' levels compute alike.

    The emulator calls :meth:`run` for each family op it computes; the session says which run records and which
    replays. One thread: another thread's ops are computed as they come, and none is kept or taken.
    """

    def __init__(self, alike: frozenset[str], budget: int = BUDGET, spill: Any = None) -> None:
        self.alike, self.budget, self.spill = frozenset(alike), budget, spill
        self.kept: collections.deque[_Kept] = collections.deque()
        self.state: Optional[str] = None  # "record", "replay", "watch" or None (nothing to do)
        self.taken = 0  # ops the replaying run took
        self.bytes = 0
        self.depth = 0  # inside an op being recorded: its own ops are its own
        self.parted = False  # the op being recorded ran an op of a family the levels compute apart
        self.thread: Optional[int] = None
        self.seen: set[str] = set()  # watching: the families of the ops the run computed, those inside ops too
        # watching: each op's family and the table keys its math came from (None: a math the block forces, the
        # same at every level), those of the ops inside it too; and the ops being computed now, innermost last
        self.ops: list[tuple[str, set[Optional[str]]]] = []
        self.computing: list[set[Optional[str]]] = []

    def record(self) -> None:
        """The next run keeps what it can (anything kept before is dropped: a run may be run again)."""
        self.kept, self.bytes, self.state, self.thread = collections.deque(), 0, "record", threading.get_ident()

    def replay(self) -> None:
        """The next run takes what the recorded run kept."""
        self.taken = 0
        self.state = "replay" if self.kept else None

    def watch(self) -> None:
        """The next run keeps nothing, and notes in ``seen`` the family of every op it computes, those inside ops
        too, and in ``ops`` each op's family and the keys of the target's table its math came from (a layer's
        rerun: another level computes it alike where every key it met gives the same math there, and nothing
        stopped the watch: the tracer, a jagged attention, an emulate() block of the model's own)."""
        self.kept, self.bytes, self.seen, self.ops, self.computing = collections.deque(), 0, set(), [], []
        self.state, self.thread = "watch", threading.get_ident()

    def met(self, key: Optional[str]) -> None:
        """The op being computed (watching or recording) took its math from ``key`` (None: from the block, at any
        level). Recording, a key of a family the levels compute apart parts the op (a convolution with cuDNN off
        is a GEMM at the matmul's level: kept, the next level would take this level's bits)."""
        for keys in self.computing:
            keys.add(key)
        if self.depth and key is not None and key.split(".")[0] not in self.alike:
            self.parted = True

    def close(self) -> None:
        """Nothing more is kept or taken; what was kept in memory is freed (what was written out stays in the spill
        file, which ends with the check)."""
        self.kept, self.bytes, self.state = collections.deque(), 0, None

    def run(self, op: str, family: str, args: Any, kwargs: Any, coverage: collections.Counter,
            unhandled: collections.Counter, compute: Callable[[], Any]) -> Any:
        """``compute()``'s result for this call of ``op``: the one kept for it (replaying), or computed (and kept,
        recording); ``coverage`` and ``unhandled`` are the block's counters, which the call's counts go to."""
        if self.state is None or threading.get_ident() != self.thread:
            return compute()
        if self.state == "watch":
            self.seen.add(family)
            keys: set[Optional[str]] = set()
            self.ops.append((family, keys))
            self.computing.append(keys)
            try:
                return compute()
            finally:
                self.computing.pop()
        if self.depth:  # inside an op being recorded (an RNN cell broken down into aten::linear): kept only if alike
            self.parted = self.parted or family not in self.alike
            return compute()
        if family not in self.alike:  # the levels part here: nothing after it is the same
            self.stop()
            return compute()
        if self.state == "replay":
            return self._take(op, family, args, kwargs, coverage, unhandled, compute)
        if family not in KEPT:
            return compute()
        counted, missed = collections.Counter(coverage), collections.Counter(unhandled)
        states = _random_states(args)
        self.parted = False
        self.depth += 1
        try:
            result = compute()
        finally:
            self.depth -= 1
        missed = unhandled - missed
        size = _nbytes(result)
        drew = any(not torch.equal(a, b) for a, b in zip(states, _random_states(args)))
        # an RNN computed above autograd (the function mode): its result hangs from this run's graph, which a
        # copy would hand the next run instead of its own (a gradient taken inside the forward)
        tensors = [v for v in tree_flatten(result)[0] if isinstance(v, torch.Tensor)]
        graphed = any(v.requires_grad for v in tensors)
        # a device's memory is the model's: a copy there could leave the next run short of it (an emulated CUDA
        # run is quick anyway); a CPU's holds far more than the budget
        elsewhere = any(v.device.type != "cpu" for v in tensors)
        # run natively (the level's own flags), broken down into ops the levels compute apart, drew (taken, it
        # would not), in a graph, on a device, or too much to keep
        if missed or self.parted or drew or graphed or elsewhere or self.bytes + size > self.budget:
            self.stop()
            return result
        self.bytes += size
        self.kept.append(_Kept(op, _signature(args, kwargs), _copied(result, self.spill), coverage - counted, missed))
        return result

    def _take(self, op: str, family: str, args: Any, kwargs: Any, coverage: collections.Counter,
              unhandled: collections.Counter, compute: Callable[[], Any]) -> Any:
        if family not in KEPT:
            return compute()
        kept = self.kept[0] if self.kept else None
        if kept is None or kept.op != op or kept.signature != _signature(args, kwargs):
            self.stop()
            return compute()
        self.kept.popleft()  # handed over: the run holds it now
        self.taken += 1
        coverage.update(kept.coverage)
        unhandled.update(kept.unhandled)
        spec, leaves = kept.result
        return tree_unflatten(_handed(leaves), spec)

    def stop(self) -> None:
        """The hand-off ends here for this run: replaying, what is left is freed; recording, what was kept stays."""
        if self.state == "replay":
            self.close()
        else:
            self.state = None  # recording stops; what was kept stays for the replay
