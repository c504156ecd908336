"""What `tune` costs, as a multiple of one `check` of the same workload (goal <= 3x when one or two layers must be
pinned): a model with three heavy layers and one small layer that TF32 breaks, tuned for an A100; interleaved
medians of wall time in this process.

    .venv/bin/python benchmarks/tune.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import tf32lab
from tf32lab.control import flags

GOAL = 3.0


def workload() -> tf32lab.Workload:
    from tf32lab.workloads import specs

    # the model the tests tune: one sensitive layer among heavy ones
    return specs.load(str(Path(__file__).resolve().parents[1] / "examples" / "tune" / "model.py") + ":make")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    before = flags.snapshot()
    w = workload()
    times: dict[str, list[float]] = {"check": [], "tune": []}
    tuning = None
    for _ in range(args.rounds):
        for name in times:
            started = time.perf_counter()
            if name == "check":
                tf32lab.check(w, target="a100")
            else:
                tuning = tf32lab.tune(w, target="a100")
            times[name].append(time.perf_counter() - started)
    check, tune = (statistics.median(times[n]) for n in ("check", "tune"))
    print(f"tune: interleaved medians of {args.rounds} rounds, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"pinned {list(tuning.pinned)}: {tuning.runs} end-to-end runs, {len(tuning.candidates)} candidates")
    print(f"check {check:.2f} s, tune {tune:.2f} s: {tune / check:.2f}x (goal <= {GOAL:g}x): "
          f"{'met' if tune / check <= GOAL else 'NOT met'}")
    assert flags.snapshot() == before
    return 0


if __name__ == "__main__":
    sys.exit(main())
