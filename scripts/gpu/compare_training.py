"""The training check's emulated rows against the same training on a real GPU.

`scripts/gpu/raw_data.py` (section ``training``) trains examples/value_head's actor-critic for 50 Adam steps on the
GPU in float64, at ``highest`` and at ``high``, from one initial state and one batch stream, and saves the losses,
the first step's gradients and the final weights (``training_paths.pt``). This script runs ``check_training`` on
the same workload emulated as the GPU's target here, and prints, per row, the loss path's drift from float64's and
the first step's gradient errors, GPU beside emulation.

    python scripts/gpu/compare_training.py PATH/training_paths.pt [--target h200]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
from pathlib import Path

import torch

import tf32lab

ROOT = Path(__file__).resolve().parents[2]


def _example():
    spec = importlib.util.spec_from_file_location("value_head", ROOT / "examples" / "value_head" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _normwise(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths")
    parser.add_argument("--target", default="h200")
    args = parser.parse_args()
    gpu = torch.load(args.paths)
    example = _example()
    torch.manual_seed(0)
    model = example.ActorCritic()
    generator = torch.Generator().manual_seed(0)
    steps = len(gpu["float64"]["losses"])
    batches = [example.batch(256, generator) for _ in range(steps)]
    workload = tf32lab.TrainingWorkload(model, batches, loss=example.loss, inputs=lambda b: b[0],
                                        optimizer=lambda p: torch.optim.Adam(p, lr=3e-3), name="actor-critic")
    report = tf32lab.check_training(workload, levels=("highest", "high"), target=args.target)
    ref = gpu["float64"]
    print(f"float64 final loss: GPU {ref['losses'][-1]:.9f}, here {report.reference_losses[-1]:.9f} "
          f"(largest relative difference over the steps "
          f"{max(abs(a - b) / abs(b) for a, b in zip(report.reference_losses, ref['losses'])):.1e})")
    print(f"{'row':<8} {'drift GPU':>10} {'drift emu':>10} {'worst grad GPU':>15} {'emu':>9}  "
          f"{'final weights GPU':>17} {'emu':>9}")
    for name in ("highest", "high"):
        row = gpu[name]
        drift = max(abs(a - b) / abs(b) for a, b in zip(row["losses"], ref["losses"]))
        grads = {n: _normwise(g, ref["grads"][n]) for n, g in row["grads"].items()}
        worst = max(grads, key=grads.get)
        weights = max(_normwise(w, ref["weights"][n]) for n, w in row["weights"].items())
        emu = report.level(name)
        emu_grad = next(g.normwise for g in emu.gradients if g.name == worst)
        emu_weights = emu.weights[0].normwise if emu.weights else math.nan
        print(f"{name:<8} {drift:10.2e} {emu.drift:10.2e} {worst + ' ' + format(grads[worst], '.2e'):>15} "
              f"{emu_grad:9.2e}  {weights:17.2e} {emu_weights:9.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
