"""What pinning one module's conv math costs natively: forward+backward of a small CNN (8 convolutions, 32 channels,
batch 16 at 32x32) with a policy, as a ratio to the same step without one, interleaved medians in one run.

1. one block's convolutions pinned to `ieee`, the rest as the process holds them: that block enters cuDNN's conv
   block in its forward, and its backward nodes around each convolution;
2. the whole model at `tf32` (the policy's `conv`) and one block at `ieee`: every autograd node of the step is
   tagged, and each convolution of the backward enters a block (informational).

On a CPU cuDNN's flag changes no kernel, so the ratios are the policy's own cost.

    .venv/bin/python benchmarks/policy_conv.py [--rounds 9]
"""

from __future__ import annotations

import argparse

import torch
from _common import header, with_policies

import tf32lab
from tf32lab.control import flags


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.ReLU(),
                                  torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.ReLU()) for _ in range(4)]
    return torch.nn.Sequential(torch.nn.Conv2d(3, 32, 1), *blocks)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    before = flags.snapshot()
    model, x = _model(), torch.randn(16, 3, 32, 32)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()

    pinned = tf32lab.Policy(None, [("2", None, "ieee")])
    with_default = tf32lab.Policy(None, [("2", None, "ieee")], conv="tf32")

    header(f"policy conv: a small CNN forward+backward, interleaved medians of {args.rounds} rounds")
    t = with_policies(model, step, {"one block pinned": pinned, "conv tf32 + one pinned": with_default}, args.rounds)
    print(f"no policy                      {t['none'] * 1e3:7.1f} ms")
    for name in ("one block pinned", "conv tf32 + one pinned"):
        print(f"{name:<30} {t[name] * 1e3:7.1f} ms  {t[name] / t['none']:5.3f}x")
    assert flags.snapshot() == before


if __name__ == "__main__":
    main()
