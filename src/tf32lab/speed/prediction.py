"""What each precision level buys on a target GPU, predicted from any machine: ``predict(workload, target)``.

One forward of the workload (or, with ``training=True``, one training step: forward, backward and the optimizer's
update) is counted (``tf32lab.speed.counting``: per op its FLOPs, bytes and GEMMs, per layer), then each op is timed
on the target at each level, with the math ``emulate(target)`` would give it (``targets``)::

    time = max(compute, bytes / (bandwidth x 0.85)) + launch

- ``compute`` of a GEMM (matmul, conv as an implicit GEMM, attention's two products, an RNN's projections and
  steps): the kernel is taken as tiled; for each tile shape of a small set (down to the one-row tiles of
  gemv-like kernels), the tiles run in waves of one per SM, a tile costing its FLOPs at the SM's share of the
  math's peak (``peaks``) x the math's fitted efficiency x a tile efficiency (a small tile re-reads its operands
  more: sqrt(intensity / intensity of 128x128), at most 1) x k / (k + 64), and each wave a fixed cost
  (``peaks.GemmFit``: efficiency and wave cost per target and kind of math, SIMT or tensor cores, fitted to
  published timings, ``tf32lab.speed.calibration``). The best tile and split (1, 2, 3, ... parts of k while SMs
  are idle) win, as cuBLAS's heuristics pick one. Padding, partial waves and skinny shapes so cost what they cost.
- a depthwise convolution runs on the CUDA cores at every math (``tf32lab.speed.kinds``: each op's kind);
- every other op is memory-bound: its bytes at the target's achievable share of the bandwidth
  (``peaks.memory_efficiency``: fitted for the H200, else 85%).
- ``launch``: 5 µs per kernel; with ``host=`` (``peaks.HOST_SECONDS``: fitted), the host's cost per op too, in a
  queue (``queued_seconds``): a model of small kernels then takes its host's time, whatever the level.

Every predicted speedup carries a band (``LevelSpeed.band``, "2.40x, likely 2.05-2.71x") from the residuals of the
kinds its ops are of (``kinds.gain_band``, ``kinds.TIME_BAND``): each op the level speeds up may gain what the
published GEMMs were off by at most (``peaks.GEMM_BAND``), a convolution what cuDNN's per-shape choices make of it
(``peaks.CONV_BAND``, wide), a depthwise one from nothing to its bytes' time; memory-bound ops and the host's cost
may take what the H200 whole-model rows were off by (``peaks.HOST_BAND``). ``conv="tf32"|"ieee"`` sets cuDNN's
convolution flag, which no level touches. ``benchmarks/predict.py`` prints every published pair against the model
(docs/design.md). The result is a :class:`SpeedReport`, the same type :func:`tf32lab.bench` returns from a real
measurement, so the two print side by side.

Example:

    >>> import torch, tf32lab
    >>> w = tf32lab.Workload(torch.nn.Linear(2048, 2048), torch.randn(4096, 2048), name="gemm")
    >>> report = tf32lab.predict(w, target="a100")
    >>> round(report.level("high").speedup, 1), round(report.level("highest").speedup, 1)
    (5.0, 1.0)
    >>> report.level("high").likely()
    '5.02x, likely 4.32-5.83x'
    >>> batch_of_one = tf32lab.Workload(torch.nn.Linear(4096, 4096), torch.randn(1, 4096))
    >>> tf32lab.predict(batch_of_one, "a100").level("high").speedup < 1.05      # memory-bound: nothing to gain
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from tf32lab.emulation.emulator import context_cells
from tf32lab.errors import Tf32LabError
from tf32lab.know import peaks
from tf32lab.know.levels import CONV_MATHS, LEVELS, check_conv, check_levels, with_conv  # noqa: F401 (CONV_MATHS: its old home)
from tf32lab.know.peaks import GemmFit, Peaks, gemm_fit, math_kind
from tf32lab.know.targets import CUDNN_CELL, Target
from tf32lab.machine.hardware import resolve_target
from tf32lab.numbers.files import write_json
from tf32lab.numbers.origin import run_error
from tf32lab.numbers.trees import named_tensors
from tf32lab.speed.counting import ROOT, Counting, Counts, Gemm, OpCost, OtherThreads
from tf32lab.speed.kinds import TIME_BAND, gain_band, kind_of
from tf32lab.speed.unfolded_conv import as_run
from tf32lab.workloads.running import autograd_on, changed_note, exits_refused, kept_flags, refuse_applied
from tf32lab.workloads.workload import Workload, eval_mode, not_a_workload

__all__ = ["LayerSpeed", "LevelSpeed", "SpeedReport", "op_seconds", "optimizer_ops", "predict", "predict_counts",
           "seconds_at", "training_loss"]

# (rows, columns) of the output tile of a GEMM kernel: cuBLAS's and CUTLASS's usual shapes, down to the
# one-row tiles of its gemv-like kernels for a product with a single row or column
TILES = ((256, 128), (128, 256), (128, 128), (128, 64), (64, 128), (64, 64), (64, 32), (32, 64), (32, 32),
         (16, 128), (128, 16), (8, 128), (128, 8), (1, 32), (32, 1))
_REFERENCE_INTENSITY = 128 * 128 / (128 + 128)
K_OVERHEAD = 64  # a tile's prologue and epilogue, in k-steps


def _tile_efficiency(rows: int, columns: int) -> float:
    return min(1.0, math.sqrt(rows * columns / (rows + columns) / _REFERENCE_INTENSITY))


def gemm_seconds(gemm: Gemm, math_name: str, p: Peaks, fit: Optional[GemmFit] = None,
                 fallback: bool = True) -> float:
    """Compute time of ``count`` GEMMs of ``batch`` x (m x k) @ (k x n) in ``math_name`` (module docstring), with
    ``fit`` (default: the target's, ``peaks.gemm_fit``). An empty product (an MoE expert that got no tokens:
    ``m == 0``; or ``n``, ``k``, ``batch`` zero) multiplies nothing: no compute time (its bytes and launch are
    :func:`op_seconds`'s). A tensor-core math is never slower than IEEE (``fallback``): the flag allows tensor-core
    kernels, it does not force them, and cuBLAS's heuristics pick the faster (a small product's fixed costs)."""
    if fallback and math_kind(math_name) == "tensor":
        return min(gemm_seconds(gemm, math_name, p, fit, False), gemm_seconds(gemm, "ieee", p, None, False))
    fit = fit or gemm_fit(p.target, math_name)
    try:
        return _gemm_seconds(tuple(gemm), math_name, p, fit)
    except TypeError:  # a shape or peaks that cannot be a key (unhashable): computed as it is
        return _gemm_seconds.__wrapped__(tuple(gemm), math_name, p, fit)


# A model's GEMMs repeat per layer, and each is asked once per level, policy row and math: the tile search is the
# same for the same shape on the same GPU (a small Llama's check searched 193 products of 14 shapes)
@functools.lru_cache(maxsize=1 << 12)
def _gemm_seconds(gemm: Gemm, math_name: str, p: Peaks, fit: GemmFit) -> float:
    count, batch, m, n, k = gemm
    if min(count, batch, m, n, k) <= 0:  # no tile to run (a wave loop over zero tiles would never end)
        return 0.0
    per_sm = p.flops(math_name) / p.sms * fit.efficiency
    best = math.inf
    for rows, columns in TILES:
        gemv = min(rows, columns) == 1
        if gemv and min(m, n) > 1:  # one-row tiles: the gemv-like kernels of a product with one row or column
            continue
        tiles = batch * math.ceil(m / rows) * math.ceil(n / columns)
        efficiency = per_sm * _tile_efficiency(rows, columns)
        wave = 0.0 if gemv else fit.wave_seconds  # a gemv-like kernel streams its matrix: no pipeline to fill
        split = 1
        # split-K into any number of parts (cuBLAS's split-K and stream-K kernels), while the tiles alone leave SMs idle
        while split == 1 or (split * tiles <= p.sms and split <= k):
            part = math.ceil(k / split)
            waves = math.ceil(tiles * split / p.sms)
            best = min(best, waves * (2.0 * rows * columns * (part + K_OVERHEAD) / efficiency + wave))
            split += 1
    return count * best


def op_seconds(op: OpCost, math_name: Optional[str], p: Peaks) -> float:
    """The predicted time of one op on ``p``'s GPU when its products run in ``math_name``: by its kind
    (``tf32lab.speed.kinds``), the larger of its compute and its bytes at the achievable bandwidth, plus the host's
    cost of its kernels. A depthwise convolution runs on the CUDA cores whatever the math (PyTorch's own kernel)."""
    memory = op.bytes / (p.bandwidth * 1e9 * peaks.memory_efficiency(p.target))
    compute = 0.0
    if (op.kind or kind_of(op.op, op.family)) == "conv-depthwise":
        compute = op.flops / (p.flops("ieee") * peaks.DIRECT_CONV_EFFICIENCY)
    elif op.gemms:
        compute = sum(gemm_seconds(g, math_name or "ieee", p) for g in op.gemms)
    return max(compute, memory) + peaks.LAUNCH_SECONDS * _kernels(op)


@dataclass(frozen=True)
class LevelSpeed:
    """The time of one forward (or training step) at one level, its speedup over ``highest``, and the share of the
    time spent in matmul-family ops; ``spread`` (measured only): the interquartile range over the median; ``band``
    (predicted only): the speedup's likely range (low, high), from how far the model was off on published timings
    (``peaks.GEMM_BAND``, ``peaks.CONV_BAND``); ``shares`` (predicted only): ``family_share`` per op family that
    ran (``{"conv": 0.7, "matmul": 0.03}``), for a level changes only some families' math (cuDNN's flag, not the
    level, sets the convolutions' and RNNs')."""

    level: str
    seconds: float
    speedup: float
    family_share: float
    spread: Optional[float] = None
    band: Optional[tuple[float, float]] = None
    shares: dict[str, float] = dataclasses.field(default_factory=dict)

    def likely(self) -> str:
        """The speedup as text: ``"2.40x, likely 2.05-2.71x"`` (with a band), else ``"2.40x"``."""
        if self.band is None or self.band[0] == self.band[1]:
            return f"{self.speedup:.2f}x"
        return f"{self.speedup:.2f}x, likely {self.band[0]:.2f}-{self.band[1]:.2f}x"


@dataclass(frozen=True)
class LayerSpeed:
    """One layer's own ops (the ops it ran itself, not its sublayers'): seconds per level."""

    name: str
    seconds: dict[str, float]

    def speedup(self, level: str) -> float:
        return _ratio(self.seconds["highest"], self.seconds[level])


@dataclass(frozen=True)
class SpeedReport:
    """Speed per level, ``kind`` ``"predicted"`` (:func:`predict`) or ``"measured"`` (``tf32lab.bench``)."""

    workload: str
    target: str
    kind: str
    levels: tuple[LevelSpeed, ...]
    layers: tuple[LayerSpeed, ...] = ()
    flops: float = 0.0
    bytes: float = 0.0
    notes: tuple[str, ...] = ()
    step: str = "forward"  # or "training": forward, backward and the optimizer's update

    def level(self, name: str) -> LevelSpeed:
        for lv in self.levels:
            if lv.level == name:
                return lv
        raise KeyError(f"level {name!r} was not timed; timed: {', '.join(lv.level for lv in self.levels)}")

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["levels"] = [{**dataclasses.asdict(lv), "band": list(lv.band) if lv.band else None} for lv in self.levels]
        data["layers"] = [{"name": layer.name, "seconds": dict(layer.seconds)} for layer in self.layers]
        data["notes"] = list(self.notes)
        return data

    def to_json(self, path: Union[str, Path, None] = None) -> str:
        """The report as JSON text (a measurement's missing share as ``"nan"``); written to ``path`` too when given
        (whole or not at all)."""
        return write_json(path, self.to_dict())

    def lines(self, other: Optional[SpeedReport] = None, width: Optional[int] = None) -> list[str]:
        """A plain table, one line per level; with ``other`` (a measurement of the same workload), both: side by
        side, or where that is wider than ``width`` characters, this table and then ``other``'s."""
        if other is not None and width is not None:
            both = self.lines(other)
            if max(len(line) for line in both) > width:
                return [*self.lines(), "", *other.lines()]
            return both
        times = {lv.level: _time(lv.seconds) + (f" ±{lv.spread:.0%}" if lv.spread is not None else "")
                 for lv in self.levels}
        title = self.kind + " (" + self.target + ")"
        column = max([len(title)] + [len(time) for time in times.values()])
        width = max([len(lv.likely()) for lv in self.levels] + [7])
        head = f"{'level':<8} {title:>{column}}  {'speedup':<{width}}  matmul share"
        rows = [head + (f"  {other.kind + ' (' + other.target + ')':>24}  speedup" if other else "")]
        for lv in self.levels:
            share = "-" if math.isnan(lv.family_share) else f"{lv.family_share:.0%}"  # a measurement has none
            row = f"{lv.level:<8} {times[lv.level]:>{column}}  {lv.likely():<{width}}  {share:>11}"
            if other is not None:
                found = next((o for o in other.levels if o.level == lv.level), None)
                if found is not None:
                    spread = f" ±{found.spread:.0%}" if found.spread is not None else ""
                    row += f"  {_time(found.seconds) + spread:>24}  {found.speedup:6.2f}x"
            rows.append(row)
        return rows

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds < 1 else f"{seconds:.3f} s"


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


def speed_levels(levels: Iterable[str]) -> tuple[str, ...]:
    """The levels of a speed table: validated, ``highest`` first (the baseline of every speedup)."""
    asked = check_levels(levels)
    return ("highest", *[lv for lv in asked if lv != "highest"])  # highest is the baseline of every speedup


def level_maths(target: Target, levels: Sequence[str], conv: Optional[str] = None) -> dict[str, dict[str, str]]:
    """Per level, the math ``target`` gives each op family (the keys of ``targets``), in this context's cells;
    ``conv`` (``"tf32"`` / ``"ieee"``) sets cuDNN's flag, which no level touches: its convolutions and its RNNs."""
    cells = with_conv(context_cells(), check_conv(conv))
    return {level: target.maths_at(level, cells) for level in levels}


def seconds_at(counts: Counts, target: Target, level_of: Callable[[str], str],
               conv_of: Optional[Callable[[str], Optional[str]]] = None) -> float:
    """Predicted seconds of the counted ops on ``target`` when each layer runs at ``level_of(layer)`` (a policy),
    its convolutions at cuDNN's ``conv_of(layer)`` math where that gives one (None: this context's flag)."""
    p = target.speed_peaks()
    conv_of = conv_of or (lambda layer: None)
    ops = _as_run(counts.ops, target)
    pairs = {(level_of(op.layer), conv_of(op.layer)) for op in ops}
    maths = {(level, conv): level_maths(target, [level], conv)[level] for level, conv in pairs}
    return queued_seconds(ops, [op_seconds(op, maths[level_of(op.layer), conv_of(op.layer)].get(
        op.family or "", "ieee"), p) for op in ops])


def _as_run(ops: Sequence[OpCost], target: Target) -> list[OpCost]:
    """The counted ops as ``target`` runs them: on a GPU with cuDNN off, each convolution as PyTorch's own slow
    backends run it (``speed.unfolded_conv``)."""
    return as_run(ops, target.device == "cuda" and context_cells()[CUDNN_CELL] == "off")


def _kernels(op: OpCost) -> int:
    if op.kernels:
        return op.kernels
    return sum(g[0] for g in op.gemms) if op.gemms else 1  # an RNN's steps are kernels of their own


def queued_seconds(ops: Sequence[OpCost], times: Sequence[float], host: float = 0.0) -> float:
    """The time of ``ops`` run eagerly, each taking ``times`` on the GPU: the host issues them one after the other,
    ``host`` seconds per kernel (``peaks.HOST_SECONDS``: fitted on an H200's eager Hugging Face encoders; 0: the
    GPU's time alone, the default of ``predict``), and the GPU runs each once it is issued and the one before is
    done. A host-bound model (small kernels) takes its host's time, a GPU-bound one its kernels' (the host runs
    ahead during long products), as a CUDA stream does.

        >>> from tf32lab.speed.counting import OpCost
        >>> ops = [OpCost("aten::mm", "x", "matmul", 0.0, 0.0, ())] * 2
        >>> round(queued_seconds(ops, [1e-3, 1e-6], host=1e-5) * 1e6)   # the host ran ahead
        1011
        >>> round(queued_seconds(ops, [1e-6, 1e-6], host=1e-5) * 1e6)   # host-bound
        21
    """
    issued = done = 0.0
    for op, seconds in zip(ops, times):
        issued += host * _kernels(op)
        done = max(issued, done) + seconds
    return done


def _band(ops: Sequence[OpCost], base: Sequence[float], times: Sequence[float], changed: Sequence[bool],
          p: Peaks, host: float = 0.0) -> tuple[float, float]:
    """The likely range of the speedup ``queued(base) / queued(times)``, from the residuals of the kinds the ops are
    of (``kinds.gain_band``, ``kinds.TIME_BAND``): each op whose math ``changed`` may gain its kind's factors of
    what the model says; each other op, and the host's cost per op, may take its kind's factors of its time, at
    both levels alike (a step dominated by memory-bound ops and host cost is as uncertain as they are). The range
    spans every corner of those factors (a host-bound level and a GPU-bound one answer them differently)."""
    if not any(changed):
        return 1.0, 1.0
    found = [_ratio(queued_seconds(ops, base, host), queued_seconds(ops, times, host))]
    for side in (0, 1):
        for gain_side in (0, 1):
            before_all, after_all = [], []
            for op, before, after, change in zip(ops, base, times, changed):
                kind = op.kind or kind_of(op.op, op.family)
                if change:
                    before_all.append(before)
                    after_all.append(after / gain_band(kind, op, before, after, p)[gain_side])
                else:
                    factor = TIME_BAND.get(kind, (1.0, 1.0))[side]
                    before_all.append(before * factor), after_all.append(after * factor)
            cost = host * peaks.HOST_BAND[side]
            found.append(_ratio(queued_seconds(ops, before_all, cost), queued_seconds(ops, after_all, cost)))
    return min(found), max(found)


def predict_counts(counts: Counts, workload: str, target: Target, levels: Iterable[str] = LEVELS,
                   conv: Optional[str] = None, step: str = "forward", host: float = 0.0) -> SpeedReport:
    """The :class:`SpeedReport` of counted ops (``counting.Counting``) on ``target``, per level; ``conv``: the
    cuDNN convolution math (default: as this context's flags hold it)."""
    p = target.speed_peaks()
    levels = speed_levels(levels)
    ops = _as_run(counts.ops, target)
    by_level = level_maths(target, levels, conv)
    per_op = {level: [op_seconds(op, by_level[level].get(op.family or "", "ieee"), p) for op in ops]
              for level in levels}
    totals = {level: queued_seconds(ops, times, host) for level, times in per_op.items()}
    changed = {level: [by_level[level].get(op.family or "", "ieee") != by_level["highest"].get(op.family or "", "ieee")
                       for op in ops] for level in levels}
    layers: dict[str, dict[str, float]] = {}
    for i, op in enumerate(ops):
        for level in levels:
            layer = layers.setdefault(op.layer, dict.fromkeys(levels, 0.0))
            layer[level] += per_op[level][i]
    family_layers = {op.layer for op in ops if op.family is not None}
    rows = tuple(LevelSpeed(level, totals[level], _ratio(totals["highest"], totals[level]),
                            _ratio(sum(t for t, op in zip(per_op[level], ops) if op.family is not None),
                                   sum(per_op[level])),
                            band=_band(ops, per_op["highest"], per_op[level], changed[level], p, host),
                            shares=_shares(ops, per_op[level], sum(per_op[level])))
                 for level in levels)
    notes = []
    if counts.uncounted:
        named = ", ".join(f"{op} x{n}" for op, n in counts.uncounted.most_common(4))
        notes.append(f"counted by their bytes only (no FLOP formula): {named}")
    if conv is not None and any(op.family == "conv" for op in ops):
        notes.append(_conv_note(ops, target, conv, per_op["highest"], host))
    widest = max(rows, key=lambda lv: lv.band[1] / lv.band[0] if lv.band and lv.band[0] > 0 else 0.0)
    wide = _wide_note(ops, per_op["highest"], totals["highest"], widest, f"at {widest.level}")
    if wide:
        notes.append(wide)
    return SpeedReport(workload, target.name, "predicted", rows,
                       tuple(LayerSpeed(name, seconds) for name, seconds in layers.items() if name in family_layers),
                       counts.flops, counts.bytes, tuple(notes), step)


# a band wider than this (high / low) is said in words, with the kinds that make it so
WIDE_BAND = 1.5
# the kinds the model is weak on: unfitted or widely off on the rows at hand (docs/speed-model.md)
WEAK_KINDS = {"conv-depthwise": "depthwise convolutions", "conv-grouped": "grouped convolutions",
              "conv-transposed": "transposed convolutions", "conv": "convolutions (cuDNN's per-shape choices)"}


def _wide_note(ops: Sequence[OpCost], times: Sequence[float], total: float, widest: LevelSpeed, what: str) -> str:
    """Words for a wide band (``what``: where, "at high"): what share of the time the weak kinds and the host (the
    time not spent on the GPU) take; empty for a band narrower than ``WIDE_BAND``."""
    if widest.band is None or widest.band[0] <= 0 or widest.band[1] / widest.band[0] < WIDE_BAND:
        return ""
    shares: dict[str, float] = {}
    for op, seconds in zip(ops, times):
        kind = op.kind or kind_of(op.op, op.family)
        name = WEAK_KINDS.get(kind, "memory-bound ops" if kind not in ("gemm",) else "")
        if name:
            shares[name] = shares.get(name, 0.0) + seconds / total
    host = max(0.0, 1 - sum(times) / total)
    if host > 0.05:
        shares["the host's cost per op"] = host
    listed = ", ".join(f"{name} {share:.0%}" for name, share in sorted(shares.items(), key=lambda kv: -kv[1])
                       if share >= 0.05)
    return (f"wide band {what} ({widest.likely()}): the model is weak on what this workload is made of "
            f"({listed} of the predicted time); measure it (tf32lab bench) before acting on the number")


def _shares(ops: Sequence[OpCost], times: Sequence[float], total: float) -> dict[str, float]:
    """Per op family that ran, its share of ``total`` (the level's predicted time)."""
    found: dict[str, float] = {}
    for op, seconds in zip(ops, times):
        if op.family is not None:
            found[op.family] = found.get(op.family, 0.0) + seconds
    return {family: _ratio(seconds, total) for family, seconds in sorted(found.items())}


def _conv_note(ops: Sequence[OpCost], target: Target, conv: str, times: Sequence[float], host: float = 0.0) -> str:
    """What cuDNN's TF32 flag buys at ``highest``: the other conv math's time against this one's."""
    if target.device == "cuda" and context_cells()[CUDNN_CELL] == "off":
        # no cuDNN: the flag changes no op, and a band drawn around the convolutions' kinds said it might
        return (f"conv={conv!r} sets cuDNN's convolution flag, which nothing reads here: cuDNN is off "
                f"(torch.backends.cudnn.enabled = False), so the level sets the convolutions' math")
    p = target.speed_peaks()
    maths = level_maths(target, ("highest",), "ieee" if conv == "tf32" else "tf32")["highest"]
    other = [op_seconds(op, maths.get(op.family or "", "ieee"), p) for op in ops]
    ieee, tf32 = (other, list(times)) if conv == "tf32" else (list(times), other)
    ieee_total, tf32_total = queued_seconds(ops, ieee, host), queued_seconds(ops, tf32, host)
    gain = LevelSpeed("highest", tf32_total, _ratio(ieee_total, tf32_total), math.nan,
                      band=_band(ops, ieee, tf32, [op.family == "conv" for op in ops], p, host))
    wide = _wide_note(ops, ieee, ieee_total, gain, "of cuDNN's TF32 flag")
    return (f"convolutions at cudnn.conv tf32 instead of ieee (at highest): {gain.likely()} "
            f"(cuDNN picks its algorithm per shape: a wide band)" + (f"; {wide}" if wide else ""))


# bytes per float32 parameter element of one update (foreach implementations, PyTorch's default on CUDA): AdamW and
# Adam read the parameter, its gradient and two moments and write three; SGD with momentum reads three, writes two
OPTIMIZER_BYTES = {"adamw": 28, "adam": 28, "sgd": 20}
_FOREACH_OPS = {"adamw": 10, "adam": 9, "sgd": 3}  # foreach kernels per group of tensors in one update
_FOREACH_GROUP = 100  # tensors per foreach kernel launch (multi_tensor_apply's chunking, about)


def optimizer_ops(model: torch.nn.Module, optimizer: Optional[str]) -> list[OpCost]:
    """The optimizer's update of ``model``'s trainable parameters as memory-bound ops (no FLOPs worth counting):
    ``OPTIMIZER_BYTES`` per element, split over its foreach launches; none for ``optimizer=None``."""
    if optimizer is None:
        return []
    if optimizer not in OPTIMIZER_BYTES:
        raise Tf32LabError(f"unknown optimizer {optimizer!r}; accepted: {', '.join(map(repr, OPTIMIZER_BYTES))}, "
                           f"None (no update counted)")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return []
    launches = _FOREACH_OPS[optimizer] * math.ceil(len(params) / _FOREACH_GROUP)
    total = OPTIMIZER_BYTES[optimizer] * sum(p.numel() for p in params)
    return [OpCost(f"optimizer:{optimizer}", ROOT, None, 0.0, total / launches, ()) for _ in range(launches)]


def training_loss(output: Any, name: str) -> torch.Tensor:
    """The loss a training step differentiates: the output's ``loss`` (Hugging Face models given labels), else the
    sum of its floating-point tensors (what it costs is the backward, not the loss)."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss
    parts = [t.sum() for _, t in named_tensors(output) if t.is_floating_point() and t.requires_grad]
    if not parts:
        raise Tf32LabError(f"workload {name!r}: training=True needs an output that depends on parameters that "
                           f"require grad; none does")
    return torch.stack(parts).sum()


@contextlib.contextmanager
def _training(model: torch.nn.Module) -> Iterator[None]:
    """Train mode and the parameters' ``.grad`` as they were afterwards (a counted step leaves nothing behind)."""
    modes = [(module, module.training) for module in model.modules()]
    grads = [(p, p.grad) for p in model.parameters()]
    model.train()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training
        for p, grad in grads:
            p.grad = grad


def predict(workload: Workload, target: Union[str, Target] = "a100", levels: Iterable[str] = LEVELS, *,
            training: bool = False, optimizer: Optional[str] = "adamw", conv: Optional[str] = None,
            host: float = 0.0) -> SpeedReport:
    """Predict one forward of ``workload`` on ``target`` at each level (module docstring); the model runs once,
    natively on this machine, to count its work. Every global setting is as it was afterwards.

    ``training=True``: one training step instead: the forward in train mode, the backward of its loss (the
    output's ``loss``, else the sum of its outputs) and ``optimizer``'s update (``"adamw"``, ``"adam"``, ``"sgd"``
    or None), whose memory traffic dilutes the gain. The parameters' gradients are as they were afterwards.
    ``conv``: cuDNN's convolution math, ``"tf32"`` or ``"ieee"`` (no level sets it; default: as the flags hold it).
    ``host``: the host's cost per op of the eager run (``queued_seconds``); 0, the default, predicts the GPU's time
    alone; ``tf32lab.know.peaks.HOST_SECONDS`` is the one fitted on an H200's Hugging Face encoders, whose steps
    are host-bound (docs/speed-model.md).

    Example (see also the module docstring):

        >>> import torch, tf32lab
        >>> w = tf32lab.Workload(torch.nn.Linear(2048, 2048), torch.randn(4096, 2048), name="gemm")
        >>> step = tf32lab.predict(w, "a100", training=True)
        >>> step.step, 1.5 < step.level("high").speedup < tf32lab.predict(w, "a100").level("high").speedup
        ('training', True)
    """
    if not isinstance(workload, Workload):
        raise not_a_workload("predict", workload)
    target = resolve_target(target, speed=True)  # a target with no speed model fails before the model runs
    levels = speed_levels(levels)
    check_conv(conv)
    if training and optimizer is not None and optimizer not in OPTIMIZER_BYTES:
        optimizer_ops(workload.model, optimizer)  # its one-line error, before the model runs
    refuse_applied(workload, "predict")
    counting = Counting(workload.model, backward=training)
    mode = _training(workload.model) if training else eval_mode(workload.model)
    # a model that sets a level in its forward leaves nothing behind (KeyboardInterrupt included)
    with exits_refused(workload.name, "predict"), kept_flags() as changed:
        try:
            with mode, OtherThreads() as threads, counting as counts, \
                    (autograd_on() if training else torch.inference_mode()):
                output = workload.run()
                if training:
                    training_loss(output, str(workload.name)).backward()
        except Tf32LabError:
            raise
        except Exception as exc:
            raise run_error(exc, workload.name, "counting the work of", "while its work was counted") from exc
    if threads.ops and not any(op.family is not None for op in counts.ops):  # else: "no gain", of nothing
        raise Tf32LabError(threads.refusal(str(workload.name)))
    if training:
        counts.ops.extend(optimizer_ops(workload.model, optimizer))
    report = predict_counts(counts, str(workload.name), target, levels, conv, "training" if training else "forward",
                            host)
    uncounted = threads.note("left out of the prediction")
    if uncounted:
        report = dataclasses.replace(report, notes=(*report.notes, uncounted))
    if changed:
        report = dataclasses.replace(report, notes=(*report.notes, changed_note(changed)))
    return report
