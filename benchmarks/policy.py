"""What a per-module policy costs natively: forward+backward of all-MiniLM-L6-v2 (64 sentences) with a policy, as a
ratio to the same step without one, interleaved medians in one run (goal <= 1.05x for one pinned layer).

1. one encoder layer pinned to `highest`, the rest inheriting the caller's level: only that layer is hooked;
2. the same with a default level (`high`): the model itself is hooked too, so every autograd node of the step
   is tagged and its backward passes through the pinning mode (informational).

On this CPU `high` and `highest` compute alike (no TF32), so the ratios are the policy's own cost.

    .venv/bin/python benchmarks/policy.py [--rounds 9]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _common import header, with_policies

import tf32lab
from tf32lab.control import flags
from tf32lab.workloads import builtin

GOAL = 1.05
LAYER = "st.0.model.encoder.layer.3"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    before = flags.snapshot()
    workload = builtin.minilm()
    model = workload.model.eval()

    def step() -> None:
        model.zero_grad(set_to_none=True)
        out = workload.run()
        sum(t.float().sum() for t in (out.values() if isinstance(out, dict) else [out])).backward()

    pinned = tf32lab.Policy(None, [(LAYER, "highest")])
    with_default = tf32lab.Policy("high", [(LAYER, "highest")])

    header(f"policy: all-MiniLM-L6-v2 forward+backward, interleaved medians of {args.rounds} rounds")
    t = with_policies(model, step, {"one layer pinned": pinned, "default high + one pinned": with_default}, args.rounds)
    print(f"no policy                      {t['none'] * 1e3:7.1f} ms")
    for name in ("one layer pinned", "default high + one pinned"):
        ratio = t[name] / t["none"]
        goal = f" (goal <= {GOAL}x): {'met' if ratio <= GOAL else 'NOT met'}" if name == "one layer pinned" else ""
        print(f"{name:<30} {t[name] * 1e3:7.1f} ms  {ratio:5.3f}x{goal}")
    assert flags.snapshot() == before


if __name__ == "__main__":
    main()
