"""The training check on a CUDA GPU: what CI's CPUs cannot show.

1. dropout: a model with dropout trained natively on the GPU; float32's drift from float64 must be float32's
   rounding (PyTorch's CUDA generators draw other bits for float64 tensors than float32 ones: the float64 row draws
   its masks from a float32 twin);
2. the caller's CUDA random state is as it was after a check of a model on the CPU (only the model's devices are
   seeded);
3. `high` against `highest` natively on the GPU, and a policy row (the autograd device thread enters the policy's
   scopes).

    PYTHONPATH=src python3 scripts/gpu/training_checks.py
"""

from __future__ import annotations

import torch

import tf32lab


def mse(out, batch):
    return (out - batch[1]).pow(2).mean()


def data(device: str, steps: int = 5):
    g = torch.Generator().manual_seed(0)
    return [tuple(t.to(device) for t in (torch.randn(256, 256, generator=g), torch.randn(256, 1, generator=g)))
            for _ in range(steps)]


def main() -> int:
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(512, 1)).cuda()
    workload = tf32lab.TrainingWorkload(model, data("cuda"), loss=mse, inputs=lambda b: b[0], name="dropout")
    report = tf32lab.check_training(workload, levels=("highest", "high"), target="native")
    floor, high = report.floor, report.level("high")
    print(f"1. dropout, native: float32 drift {floor.drift:.2e} (worst step-1 gradient "
          f"{floor.gradients[0].normwise:.2e}); high drift {high.drift:.2e} ({high.multiple:.1f}x), "
          f"verdict {'PASSED' if high.passed else 'FAILED'}: {'OK' if floor.drift < 1e-5 else 'MASKS DIFFER'}")
    before = torch.cuda.get_rng_state()
    cpu = tf32lab.TrainingWorkload(torch.nn.Linear(256, 1), data("cpu", 2), loss=mse, inputs=lambda b: b[0])
    tf32lab.check_training(cpu, levels=("highest",), target="a100")
    kept = torch.equal(before, torch.cuda.get_rng_state())
    print(f"2. CUDA random state kept after checking a CPU model: {kept}")
    torch.manual_seed(0)
    body = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 512))
    net = torch.nn.Sequential()
    net.add_module("body", body)
    net.add_module("head", torch.nn.Linear(512, 1))
    workload = tf32lab.TrainingWorkload(net.cuda(), data("cuda"), loss=mse, inputs=lambda b: b[0], name="net")
    report = tf32lab.check_training(workload, levels=("highest", "high"), target="native",
                                    policy=tf32lab.Policy("high", [("head", "highest")]))
    for lv in (report.floor, *report.levels):
        layers = ", ".join(f"{e.name} {e.introduced:.1e}" for e in lv.layers)
        print(f"3. {lv.level:<8} drift {lv.drift:.2e}, worst gradient {lv.gradients[0].name} "
              f"{lv.gradients[0].normwise:.2e}; backward per module: {layers}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
