"""Interleaved A/B timing: every variant once per round, medians over rounds (the machines here are shared)."""

from __future__ import annotations

import statistics
from typing import Callable

import torch
from torch.utils.benchmark import Timer


def interleaved(variants: dict[str, Callable[[], object]], *, rounds: int, number: int) -> dict[str, float]:
    """Median seconds per call of each variant, the variants timed in turn A B C A B C ... on one torch thread
    (the Timer's default: ratios of the work itself, steadier on a shared machine than all threads)."""
    timers = {name: Timer("fn()", globals={"fn": fn}) for name, fn in variants.items()}
    for fn in variants.values():  # warm up
        fn()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, timer in timers.items():
            samples[name].append(timer.timeit(number).median)
    return {name: statistics.median(values) for name, values in samples.items()}


TIMER = "timer"  # interleaved(): torch.utils.benchmark's Timer, one torch thread
WALL = "wall"  # time.perf_counter around whole runs, on torch's threads as the process has them
PROCESSES = "processes"  # time.perf_counter around fresh child processes (start-up included)


def header(title: str, timed: str = TIMER) -> None:
    """The title, torch's version and how the script times: ``TIMER``, ``WALL`` or ``PROCESSES``."""
    threads = torch.get_num_threads()
    how = {TIMER: f"timed on one thread (torch.utils.benchmark's Timer), {threads} on the machine",
           WALL: f"timed by the wall clock (time.perf_counter) on torch's {threads} threads",
           PROCESSES: "timed by the wall clock (time.perf_counter) around fresh child processes"}
    if timed not in how:
        raise ValueError(f"timed {timed!r}: one of {', '.join(how)}")
    print(f"{title}\ntorch {torch.__version__}; {how[timed]}")


def with_policies(model, step: Callable[[], object], policies: dict, rounds: int) -> dict[str, float]:
    """Median seconds of ``step`` alone (``"none"``) and with each of ``policies`` (name -> ``tf32lab.Policy``)
    applied to ``model``, interleaved."""
    def under(policy):
        def run() -> None:
            with policy.applied(model):
                step()

        return run

    return interleaved({"none": step, **{name: under(p) for name, p in policies.items()}}, rounds=rounds, number=3)
