"""`tf32lab check --train` as a multiple of the training it checks: the whole training check of
examples/value_head (50 steps, levels highest and high on a100: the float64 reference, float32's floor, `high`, and
step 1's backward per module) against 50 native float32 training steps of the same model on the same batches.

Goals: time <= 6x (interleaved medians, this process); peak extra memory <= 3x one native training step's (peak RSS
over an idle interpreter that has imported torch, tf32lab's training check and built the workload; fresh child
processes, VmHWM).

    .venv/bin/python benchmarks/check_training.py [--rounds 3] [--steps 50]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import WALL, header

import tf32lab

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "value_head"))
import train


def native(workload: tf32lab.TrainingWorkload, steps: int) -> None:
    """``steps`` float32 training steps of a fresh copy, as the user's own loop would run them."""
    model = copy.deepcopy(workload.model)
    optimizer = workload.make_optimizer(model.parameters())
    for step in range(steps):
        batch = workload.batch(step)
        loss = workload.loss_of(workload.run(model, batch), batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def check(workload: tf32lab.TrainingWorkload, steps: int) -> None:
    tf32lab.check_training(workload, levels=("highest", "high"), target="a100", steps=steps)


def _child(what: str, steps: int) -> None:
    import rich.console  # noqa: F401  (what a check imports, in the idle figure too)

    import tf32lab.measure.training  # noqa: F401

    workload = train.workload(steps)
    if what == "step":
        native(workload, 1)
    elif what == "check":
        check(workload, steps)
    print(_high_water_mib())


def _high_water_mib() -> float:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _peak(what: str, steps: int) -> float:
    done = subprocess.run([sys.executable, __file__, "--child", what, "--steps", str(steps)], capture_output=True,
                          text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.steps)
        return 0
    header(f"the training check of examples/value_head ({args.steps} steps, highest and high on a100) as a multiple "
           f"of {args.steps} native float32 training steps", WALL)
    workload = train.workload(args.steps)
    native(workload, 2)  # warm up both
    check(workload, 2)
    times: dict[str, list[float]] = {"native": [], "check": []}
    for _ in range(args.rounds):  # interleaved: native, check, native, check, ...
        for name, fn in (("native", native), ("check", check)):
            started = time.perf_counter()
            fn(workload, args.steps)
            times[name].append(time.perf_counter() - started)
    t_native, t_check = (statistics.median(times[k]) for k in ("native", "check"))
    ratio = t_check / t_native
    print(f"native {args.steps} steps {t_native:.3f} s, training check {t_check:.2f} s (medians of {args.rounds}): "
          f"{ratio:.1f}x (goal <= 6x): {'met' if ratio <= 6 else 'NOT met'}")
    idle, step, full = (_peak(what, args.steps) for what in ("idle", "step", "check"))
    extra_step, extra_check = step - idle, full - idle
    mem = extra_check / extra_step if extra_step > 0 else float("inf")
    print(f"peak RSS: idle {idle:.0f} MiB, one native step +{extra_step:.1f} MiB, training check +{extra_check:.1f} "
          f"MiB: {mem:.1f}x (goal <= 3x): {'met' if mem <= 3 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
