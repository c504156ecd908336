"""`tf32lab check` as a multiple of one native forward pass: wall time (goal <= 6x on the default target, a100,
for all-MiniLM-L6-v2, the LSTM and the conv net) and peak memory (goal <= 2x one forward's extra memory, peak RSS
over an idle interpreter that has imported torch and tf32lab, for the same three), on all-MiniLM-L6-v2
(64 sentences), a 200M-parameter MLP (batch 8), a conv net shaped like torchcrepe's tiny model (batch 512 x 1024
samples, random weights) and an LSTM speaker encoder (3 layers, hidden 256, 8 x 160 frames).

Times are interleaved medians in this process, timed by torch.utils.benchmark (one thread, its default); each
memory figure is the median of three fresh child processes (their VmHWM). On an A100 `medium` is computed exactly
as `high` (cuBLAS has no bf16 path), so `check` measures it once; the cpu-amx line shows MiniLM's cost when all three
levels differ.

    .venv/bin/python benchmarks/check.py [--rounds 5] [--only minilm,lstm]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from _common import header, interleaved

import tf32lab
from tf32lab.workloads import builtin


class _Encoder(torch.nn.Module):
    """A speaker encoder like resemblyzer's: 3-layer LSTM over 40 mel bands, a projection, L2-normalised."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = torch.nn.LSTM(40, 256, 3, batch_first=True)
        self.linear = torch.nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, (h, _) = self.lstm(x)
        e = torch.relu(self.linear(h[-1]))
        return e / e.norm(dim=1, keepdim=True)


class _CrepeTiny(torch.nn.Module):
    """torchcrepe's tiny pitch model (same layers and shapes), random weights."""

    def __init__(self) -> None:
        super().__init__()
        chans = [1, 128, 16, 16, 16, 32, 64]
        kernels, strides = [512, 64, 64, 64, 64, 64], [4, 1, 1, 1, 1, 1]
        layers: list[torch.nn.Module] = []
        for i in range(6):
            layers += [torch.nn.Conv2d(chans[i], chans[i + 1], (kernels[i], 1), (strides[i], 1)),
                       torch.nn.ReLU(), torch.nn.BatchNorm2d(chans[i + 1], eps=1e-3),
                       torch.nn.MaxPool2d((2, 1), (2, 1))]
        self.layers = torch.nn.ModuleList(layers)
        self.pads = [(0, 0, 254, 254)] + [(0, 0, 31, 32)] * 5
        self.classifier = torch.nn.Linear(256, 360)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, None, :, None]
        for i in range(6):
            x = torch.nn.functional.pad(x, self.pads[i])
            for layer in self.layers[4 * i:4 * i + 4]:
                x = layer(x)
        return torch.sigmoid(self.classifier(x.permute(0, 2, 1, 3).reshape(-1, 256)))


def workload(name: str) -> tf32lab.Workload:
    torch.manual_seed(0)
    if name == "minilm":
        return builtin.minilm()
    if name == "mlp200m":
        layers: list[torch.nn.Module] = []
        for _ in range(4):
            layers += [torch.nn.Linear(7000, 7000), torch.nn.ReLU()]
        return tf32lab.Workload(torch.nn.Sequential(*layers), torch.randn(8, 7000), name="mlp200m")
    if name == "crepe-tiny":
        return tf32lab.Workload(_CrepeTiny(), torch.randn(512, 1024), name="crepe-tiny")
    if name == "lstm":
        return tf32lab.Workload(_Encoder(), torch.randn(8, 160, 40), name="lstm")
    raise SystemExit(f"unknown workload {name!r}")


WORKLOADS = ("minilm", "mlp200m", "crepe-tiny", "lstm")
# the default levels on the default target; the MLP is weight-bound (its 200M weights rounded per run): no goal
TIME_GOAL, MEMORY_GOAL = 6.0, 2.0
GOALS = ("minilm", "crepe-tiny", "lstm")


def _child(name: str, what: str) -> None:
    """In a fresh process: build the workload, run ``what`` once, print the peak RSS in MiB."""
    if what != "idle":
        w = workload(name)
        if what == "forward":
            with torch.inference_mode():
                w.run()
        else:
            tf32lab.check(w)
    print(_high_water_mib())


def _high_water_mib() -> float:
    """This process's peak RSS. Not ``getrusage``'s ``ru_maxrss``: Linux carries the parent's peak across
    fork + exec into it, so a child of a big process reads the parent's number."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# fresh children per memory figure, their median taken: one child's peak swings by 5-10 MiB with the allocator's
# timing (an LSTM encoder's check read 1.9x to 2.6x its forward in single children of the same code)
MEMORY_ROUNDS = 3


def _peak(name: str, what: str) -> float:
    peaks = []
    for _ in range(MEMORY_ROUNDS):
        done = subprocess.run([sys.executable, __file__, "--child", name, what], capture_output=True, text=True,
                              check=True)
        peaks.append(float(done.stdout.strip().splitlines()[-1]))
    return statistics.median(peaks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default=",".join(WORKLOADS))
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(*args.child)
        return
    header("tf32lab check as a multiple of one native forward (time: interleaved medians; memory: peak RSS over "
           "an idle interpreter, fresh processes)")
    idle = _peak("none", "idle")
    verdicts = []
    for name in args.only.split(","):
        w = workload(name)

        def forward(w=w) -> None:
            with torch.inference_mode():
                w.run()

        variants = {"forward": forward, "check a100": lambda w=w: tf32lab.check(w)}
        if name == "minilm":
            variants["check cpu-amx"] = lambda w=w: tf32lab.check(w, target="cpu-amx")
        rounds = args.rounds if name in ("minilm", "lstm") else max(1, args.rounds // 2)
        times = interleaved(variants, rounds=rounds, number=1)
        native = _peak(name, "forward") - idle
        checked = _peak(name, "check") - idle
        base = times["forward"]
        print(f"{name:<11} forward {base * 1e3:8.1f} ms, {native:7.0f} MiB extra")
        for variant in variants:
            if variant != "forward":
                print(f"{'':<11} {variant:<14} {times[variant] / base:6.2f}x time")
        print(f"{'':<11} {'check a100':<14} {checked / native:6.2f}x memory, {checked:.0f} MiB extra")
        if name in GOALS:
            time_ratio, memory_ratio = times["check a100"] / base, checked / native
            verdicts += [f"{'PASSED' if time_ratio <= TIME_GOAL else 'FAILED'} | {name} | check {time_ratio:.2f}x "
                         f"one forward's time (goal <= {TIME_GOAL:g}x)",
                         f"{'PASSED' if memory_ratio <= MEMORY_GOAL else 'FAILED'} | {name} | check "
                         f"{memory_ratio:.2f}x one forward's memory (goal <= {MEMORY_GOAL:g}x)"]
    print("\n".join(verdicts))


if __name__ == "__main__":
    main()
