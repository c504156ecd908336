"""Wall time of `tf32lab.check` on all-MiniLM-L6-v2 (64 sentences, 3 levels, per-layer analysis) as a multiple of
one native forward pass. Goal: <= 10x on the default target (a100).

On an A100 `medium` is computed exactly as `high` (cuBLAS has no bf16 path), so `check` measures it once; the
cpu-amx line shows the cost when all three levels differ.

    .venv/bin/python benchmarks/check.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from _common import header, interleaved

import tf32lab
from tf32lab import builtin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    header("tf32lab check on all-MiniLM-L6-v2, 64 sentences (interleaved, medians)")
    workload = builtin.minilm()

    def forward() -> None:
        with torch.inference_mode():
            workload.run()

    times = interleaved({
        "forward": forward,
        "check a100": lambda: tf32lab.check(workload),
        "check cpu-amx": lambda: tf32lab.check(workload, target="cpu-amx"),
    }, rounds=args.rounds, number=1)
    base = times["forward"]
    print(f"one native forward           {base * 1e3:8.1f} ms")
    for name in ("check a100", "check cpu-amx"):
        goal = "  (goal <= 10x)" if name == "check a100" else ""
        print(f"{name:<28} {times[name] * 1e3:8.1f} ms   {times[name] / base:5.2f}x{goal}")


if __name__ == "__main__":
    main()
