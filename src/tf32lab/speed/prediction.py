"""What each precision level buys on a target GPU, predicted from any machine: ``predict(workload, target)``.

One forward of the workload is counted (``tf32lab.speed.counting``: per op its FLOPs, bytes and GEMMs, per layer), then
each op is timed on the target at each level, with the math ``emulate(target)`` would give it (``targets``)::

    time = max(compute, bytes / (bandwidth x 0.85)) + launch

- ``compute`` of a GEMM (matmul, conv as an implicit GEMM, attention's two products, an RNN's projections and
  steps): the kernel is taken as tiled; for each tile shape of a small set (down to the one-row tiles of
  gemv-like kernels), the tiles run in waves of one per SM, a tile costing its FLOPs at the SM's share of the
  math's peak
  (``peaks``) x 0.93 (large-GEMM efficiency) x a tile efficiency (a small tile re-reads its operands more:
  sqrt(intensity / intensity of 128x128), at most 1) x k / (k + 64) (a tile's prologue and epilogue). The best
  tile and split (1, 2, 4, ... parts of k while SMs are idle) win, as cuBLAS's heuristics pick one.
  Padding, partial waves and skinny shapes so cost what they cost.
- every other op is memory-bound: its bytes at 85% of the bandwidth.
- ``launch``: 5 µs per kernel (eager dispatch and launch; views and allocations launch none).

The model's constants come from published figures (NVIDIA datasheets, ``tf32lab.know.peaks``) and are checked against
the PyTorch CUDA notes' A100 timings (``benchmarks/predict.py``). On an H100 (docs/gpu-results.md) the speedup of
large GEMMs came out right (8192³: 7.38x predicted, 7.40x measured), but times were off by a median 56%: large GEMMs
reach ~0.75 of the datasheet peaks, not 0.93, and an eager op costs ~12 µs, not 5 µs. The
result is a :class:`SpeedReport`, the same type :func:`tf32lab.bench` returns from a real measurement, so the
two print side by side.

Example:

    >>> import torch, tf32lab
    >>> w = tf32lab.Workload(torch.nn.Linear(2048, 2048), torch.randn(4096, 2048), name="gemm")
    >>> report = tf32lab.predict(w, target="a100")
    >>> round(report.level("high").speedup, 1), round(report.level("highest").speedup, 1)
    (7.9, 1.0)
    >>> batch_of_one = tf32lab.Workload(torch.nn.Linear(4096, 4096), torch.randn(1, 4096))
    >>> tf32lab.predict(batch_of_one, "a100").level("high").speedup < 1.05      # memory-bound: nothing to gain
    True
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from tf32lab.emulation.emulator import context_cells
from tf32lab.errors import Tf32LabError
from tf32lab.know.levels import LEVELS, check_levels
from tf32lab.know.peaks import GEMM_EFFICIENCY, LAUNCH_SECONDS, MEMORY_EFFICIENCY, Peaks
from tf32lab.know.targets import Target
from tf32lab.machine.hardware import resolve_target
from tf32lab.numbers.files import write_json
from tf32lab.numbers.origin import run_error
from tf32lab.speed.counting import Counting, Counts, Gemm, OpCost, OtherThreads
from tf32lab.workloads.running import changed_note, kept_flags, refuse_applied
from tf32lab.workloads.workload import Workload, eval_mode

__all__ = ["LayerSpeed", "LevelSpeed", "SpeedReport", "op_seconds", "predict", "predict_counts", "seconds_at"]

# (rows, columns) of the output tile of a GEMM kernel: cuBLAS's and CUTLASS's usual shapes, down to the
# one-row tiles of its gemv-like kernels for a product with a single row or column
TILES = ((256, 128), (128, 256), (128, 128), (128, 64), (64, 128), (64, 64), (64, 32), (32, 64), (32, 32),
         (16, 128), (128, 16), (8, 128), (128, 8), (1, 32), (32, 1))
_REFERENCE_INTENSITY = 128 * 128 / (128 + 128)
K_OVERHEAD = 64  # a tile's prologue and epilogue, in k-steps


def _tile_efficiency(rows: int, columns: int) -> float:
    return min(1.0, math.sqrt(rows * columns / (rows + columns) / _REFERENCE_INTENSITY))


def gemm_seconds(gemm: Gemm, math_name: str, p: Peaks) -> float:
    """Compute time of ``count`` GEMMs of ``batch`` x (m x k) @ (k x n) in ``math_name`` (module docstring).
    An empty product (an MoE expert that got no tokens: ``m == 0``; or ``n``, ``k``, ``batch`` zero) multiplies
    nothing: no compute time (its bytes and launch are :func:`op_seconds`'s)."""
    count, batch, m, n, k = gemm
    if min(count, batch, m, n, k) <= 0:  # no tile to run (a wave loop over zero tiles would never end)
        return 0.0
    per_sm = p.flops(math_name) / p.sms * GEMM_EFFICIENCY
    best = math.inf
    for rows, columns in TILES:
        tiles = batch * math.ceil(m / rows) * math.ceil(n / columns)
        efficiency = per_sm * _tile_efficiency(rows, columns)
        split = 1
        while split == 1 or split * tiles <= p.sms:  # split-K, when the tiles alone leave SMs idle
            part = math.ceil(k / split)
            waves = math.ceil(tiles * split / p.sms)
            best = min(best, waves * 2.0 * rows * columns * (part + K_OVERHEAD) / efficiency)
            split *= 2
    return count * best


def op_seconds(op: OpCost, math_name: Optional[str], p: Peaks) -> float:
    """The predicted time of one op on ``p``'s GPU when its products run in ``math_name``."""
    memory = op.bytes / (p.bandwidth * 1e9 * MEMORY_EFFICIENCY)
    compute = 0.0
    if op.gemms:
        compute = sum(gemm_seconds(g, math_name or "ieee", p) for g in op.gemms)
    steps = sum(g[0] for g in op.gemms) if op.gemms else 1  # an RNN's steps are kernels of their own
    return max(compute, memory) + LAUNCH_SECONDS * steps


@dataclass(frozen=True)
class LevelSpeed:
    """The time of one forward at one level, its speedup over ``highest``, and the share of the time spent in
    matmul-family ops; ``spread`` (measured only): the interquartile range over the median."""

    level: str
    seconds: float
    speedup: float
    family_share: float
    spread: Optional[float] = None


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

    def level(self, name: str) -> LevelSpeed:
        for lv in self.levels:
            if lv.level == name:
                return lv
        raise KeyError(f"level {name!r} was not timed; timed: {', '.join(lv.level for lv in self.levels)}")

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["levels"] = [dataclasses.asdict(lv) for lv in self.levels]
        data["layers"] = [{"name": layer.name, "seconds": dict(layer.seconds)} for layer in self.layers]
        data["notes"] = list(self.notes)
        return data

    def to_json(self, path: Union[str, Path, None] = None) -> str:
        """The report as JSON text (a measurement's missing share as ``"nan"``); written to ``path`` too when given
        (whole or not at all)."""
        return write_json(path, self.to_dict())

    def lines(self, other: Optional[SpeedReport] = None) -> list[str]:
        """A plain table, one line per level; with ``other`` (a measurement of the same workload), both."""
        head = f"{'level':<8} {self.kind + ' (' + self.target + ')':>24}  speedup  matmul share"
        rows = [head + (f"  {other.kind + ' (' + other.target + ')':>24}  speedup" if other else "")]
        for lv in self.levels:
            share = "-" if math.isnan(lv.family_share) else f"{lv.family_share:.0%}"  # a measurement has none
            row = f"{lv.level:<8} {_time(lv.seconds):>24}  {lv.speedup:6.2f}x  {share:>11}"
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


def level_maths(target: Target, levels: Sequence[str]) -> dict[str, dict[str, str]]:
    """Per level, the math ``target`` gives each op family (the keys of ``targets``), in this context's cells."""
    cells = context_cells()
    return {level: target.maths_at(level, cells) for level in levels}


def seconds_at(counts: Counts, target: Target, level_of: Callable[[str], str]) -> float:
    """Predicted seconds of the counted ops on ``target`` when each layer runs at ``level_of(layer)`` (a policy)."""
    p = target.speed_peaks()
    by_level = level_maths(target, sorted({level_of(op.layer) for op in counts.ops}))
    return sum(op_seconds(op, by_level[level_of(op.layer)].get(op.family or "", "ieee"), p) for op in counts.ops)


def predict_counts(counts: Counts, workload: str, target: Target, levels: Iterable[str] = LEVELS) -> SpeedReport:
    """The :class:`SpeedReport` of counted ops (``counting.Counting``) on ``target``, per level."""
    p = target.speed_peaks()
    levels = speed_levels(levels)
    by_level = level_maths(target, levels)
    per_op = {level: [op_seconds(op, by_level[level].get(op.family or "", "ieee"), p) for op in counts.ops]
              for level in levels}
    totals = {level: sum(times) for level, times in per_op.items()}
    layers: dict[str, dict[str, float]] = {}
    for i, op in enumerate(counts.ops):
        for level in levels:
            layer = layers.setdefault(op.layer, dict.fromkeys(levels, 0.0))
            layer[level] += per_op[level][i]
    family_layers = {op.layer for op in counts.ops if op.family is not None}
    rows = tuple(LevelSpeed(level, totals[level], _ratio(totals["highest"], totals[level]),
                            _ratio(sum(t for t, op in zip(per_op[level], counts.ops) if op.family is not None),
                                   totals[level]))
                 for level in levels)
    notes = []
    if counts.uncounted:
        ops = ", ".join(f"{op} x{n}" for op, n in counts.uncounted.most_common(4))
        notes.append(f"counted by their bytes only (no FLOP formula): {ops}")
    return SpeedReport(workload, target.name, "predicted", rows,
                       tuple(LayerSpeed(name, seconds) for name, seconds in layers.items() if name in family_layers),
                       counts.flops, counts.bytes, tuple(notes))


def predict(workload: Workload, target: Union[str, Target] = "a100", levels: Iterable[str] = LEVELS) -> SpeedReport:
    """Predict one forward of ``workload`` on ``target`` at each level (module docstring); the model runs once,
    natively on this machine, to count its work. Every global setting is as it was afterwards.

    Example: see the module docstring.
    """
    if not isinstance(workload, Workload):
        raise Tf32LabError(f"predict() takes a tf32lab.Workload, not {type(workload).__name__}")
    target = resolve_target(target, speed=True)  # a target with no speed model fails before the model runs
    levels = speed_levels(levels)
    refuse_applied(workload, "predict")
    counting = Counting(workload.model)
    # a model that sets a level in its forward leaves nothing behind (KeyboardInterrupt included)
    with kept_flags() as changed:
        try:
            with eval_mode(workload.model), OtherThreads() as threads, counting as counts, torch.inference_mode():
                workload.run()
        except Tf32LabError:
            raise
        except Exception as exc:
            raise run_error(exc, workload.name, "counting the work of", "while its work was counted") from exc
    if threads.ops and not any(op.family is not None for op in counts.ops):  # else: "no gain", of nothing
        raise Tf32LabError(threads.refusal(str(workload.name)))
    report = predict_counts(counts, str(workload.name), target, levels)
    uncounted = threads.note("left out of the prediction")
    if uncounted:
        report = dataclasses.replace(report, notes=(*report.notes, uncounted))
    if changed:
        report = dataclasses.replace(report, notes=(*report.notes, changed_note(changed)))
    return report
