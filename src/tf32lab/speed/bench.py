"""What each precision level buys on the hardware at hand, measured: ``bench(workload)``.

One forward of the workload per call, under ``precision(level)`` in inference mode, timed by
``torch.utils.benchmark.Timer`` with every level in turn per round (A B C A B C ...: the machines are shared and
drift), after a warm-up; the report gives each level's median and its spread (interquartile range over the median).
On CUDA each call ends with a synchronize. On a CPU it measures the CPU's own modes: ``medium`` is bf16 where
oneDNN has AMX, and without it every level is IEEE and the speedups are ~1.0. The result is a
:class:`~tf32lab.speed.prediction.SpeedReport` like :func:`tf32lab.predict`'s, so the two print side by side.

Example:

    >>> import torch, tf32lab
    >>> w = tf32lab.Workload(torch.nn.Linear(64, 64), torch.randn(8, 64), name="tiny")
    >>> report = tf32lab.bench(w, levels=("highest", "high"), rounds=3, min_seconds=0.01)
    >>> [lv.level for lv in report.levels], report.kind, report.level("highest").speedup
    (['highest', 'high'], 'measured', 1.0)
"""

from __future__ import annotations

import math
import platform
import re
import statistics
import time
from collections.abc import Iterable

import torch
from torch.utils.benchmark import Timer

from tf32lab.control.scope import precision
from tf32lab.errors import Tf32LabError
from tf32lab.know.levels import LEVELS
from tf32lab.machine import hardware
from tf32lab.numbers.origin import run_error
from tf32lab.numbers.trees import named_tensors
from tf32lab.speed.prediction import LevelSpeed, SpeedReport, speed_levels
from tf32lab.workloads.running import Progress, changed_note, exits_refused, kept_flags, refuse_applied
from tf32lab.workloads.workload import Workload, not_a_workload

__all__ = ["bench", "device_name"]


def device_name(workload: Workload) -> str:
    """Where the workload runs: ``cuda:NVIDIA H100 80GB HBM3`` or ``cpu:<processor>``."""
    tensors = [t for _, t in named_tensors(workload.inputs)] or list(workload.model.parameters())
    device = tensors[0].device if tensors else torch.device("cpu")
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    if device.type == "cpu":  # the model's name (``platform.processor()`` is ``x86_64`` on Linux)
        return f"cpu:{_short(hardware.detect().cpu)}"
    return f"{device.type}:{platform.processor() or platform.machine()}"


def _short(cpu: str) -> str:
    """A CPU's model name without its marks, clock and filler words, for a column header:
    ``Intel(R) Xeon(R) Platinum 8480+ CPU @ 2.00GHz`` -> ``Intel Xeon Platinum 8480+``."""
    name = re.sub(r"\((R|TM|tm|r)\)|\bCPU\b|\bProcessor\b|@\s*[\d.]+\s*GHz", " ", cpu)
    return " ".join(name.split()) or cpu


def bench(workload: Workload, levels: Iterable[str] = LEVELS, *, rounds: int = 7,
          min_seconds: float = 0.2, progress: bool = False) -> SpeedReport:
    """Time one forward of ``workload`` at each level on its own device (module docstring).

    Args:
        rounds: timings per level, interleaved; the median is reported.
        min_seconds: each timing repeats the forward until it lasts about this long.
        progress: show a progress bar on stderr (a measurement takes tens of seconds on a real model).

    Example:

        >>> import torch, tf32lab
        >>> workload = tf32lab.Workload(torch.nn.Linear(64, 64), torch.randn(8, 64))
        >>> report = tf32lab.bench(workload, levels=("highest", "high"), rounds=1, min_seconds=0.001)
        >>> [lv.level for lv in report.levels]
        ['highest', 'high']
    """
    if not isinstance(workload, Workload):
        raise not_a_workload("bench", workload)
    if not isinstance(rounds, int) or rounds < 1:
        raise Tf32LabError(f"rounds must be an int >= 1, not {rounds!r}")
    levels = speed_levels(levels)
    refuse_applied(workload, "bench")
    where = device_name(workload)
    # every CUDA device the workload is on, its inputs' and its parameters': a bare synchronize() waits for the
    # current device only (cuda:0), and a model on cuda:1 was timed by its launches
    cuda = sorted({t.device for t in (*(t for _, t in named_tensors(workload.inputs)), *workload.model.parameters())
                   if t.device.type == "cuda"}, key=str)

    def at(level: str):
        scope = precision(level)

        def run() -> None:
            with scope, torch.inference_mode():
                workload.run()
            for device in cuda:
                torch.cuda.synchronize(device)

        return run

    calls = {level: at(level) for level in levels}
    # a model that sets PyTorch's flags in its forward leaves nothing behind, as with check and predict
    try:
        with exits_refused(workload.name, "bench"), kept_flags() as changed, \
                Progress(progress, len(levels) * (rounds + 1)) as bar:
            for level, run in calls.items():  # warm-up: kernels chosen, caches filled
                bar.step(f"{workload.name}: warm-up at {level}")
                run()
            started = time.perf_counter()
            calls["highest"]()
            once = max(time.perf_counter() - started, 1e-6)
            number = max(1, math.ceil(min_seconds / once))
            timers = {level: Timer("run()", globals={"run": run}, num_threads=torch.get_num_threads())
                      for level, run in calls.items()}
            samples: dict[str, list[float]] = {level: [] for level in levels}
            for i in range(rounds):
                for level, timer in timers.items():
                    bar.step(f"{workload.name}: round {i + 1}/{rounds} at {level}")
                    samples[level].append(timer.timeit(number).median)
    except Tf32LabError:
        raise
    except Exception as exc:
        raise run_error(exc, workload.name, "timing", "while timed") from exc
    medians = {level: statistics.median(values) for level, values in samples.items()}
    rows = tuple(LevelSpeed(level, medians[level], medians["highest"] / medians[level], math.nan,
                            _spread(samples[level])) for level in levels)
    plural = "" if rounds == 1 else "s"
    notes = (f"{rounds} interleaved round{plural} of {number} call(s) per level, {torch.get_num_threads()} thread(s)",
             *([changed_note(changed)] if changed else []), *noise_notes(rows, rounds))
    return SpeedReport(str(workload.name), where, "measured", rows, notes=notes)


NOISY = 0.25  # a spread (interquartile range over the median) past which a machine's timings are called busy


def noise_notes(rows: Iterable[LevelSpeed], rounds: int) -> list[str]:
    """What the timings cannot tell: each level whose speedup over ``highest`` lies within the two levels' spreads
    (a difference the rounds themselves differ by), and a spread past ``NOISY`` (another job on the machine).

    >>> rows = [LevelSpeed("highest", 1e-3, 1.0, math.nan, 0.02), LevelSpeed("high", 0.99e-3, 1.01, math.nan, 0.03),
    ...         LevelSpeed("medium", 0.5e-3, 2.0, math.nan, 0.02)]
    >>> noise_notes(rows, 7)
    ["high's 1.01x is within the rounds' spread (±3%, ±2% at highest): no speedup measured, only noise"]
    """
    rows = list(rows)
    base = next((r for r in rows if r.level == "highest"), None)
    if base is None:
        return []
    notes = []
    for row in rows:
        spread = max(row.spread or 0.0, base.spread or 0.0)
        if row is not base and math.isfinite(row.speedup) and abs(row.speedup - 1.0) <= spread:
            notes.append(f"{row.level}'s {row.speedup:.2f}x is within the rounds' spread (±{row.spread or 0.0:.0%}, "
                         f"±{base.spread or 0.0:.0%} at highest): no speedup measured, only noise")
    if rounds < 2 and any(row is not base for row in rows):  # one timing per level: its spread is 0, not measured
        notes.append("one round per level: no spread measured, so no speedup can be told from noise; time again "
                     "with more rounds (rounds=, --rounds)")
    busy = max(rows, key=lambda r: r.spread or 0.0)
    if (busy.spread or 0.0) > NOISY:
        notes.append(f"the rounds spread by ±{busy.spread:.0%} at {busy.level}: the machine was busy while timed "
                     f"(another job); time again when it is idle, or with more rounds than {rounds} (rounds=, "
                     f"--rounds)")
    return notes


def _spread(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    quartiles = statistics.quantiles(values, n=4)
    return (quartiles[2] - quartiles[0]) / statistics.median(values)
