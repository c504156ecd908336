"""An actor-critic trained with its body at TF32 (`high`) and its value head at full float32 (`highest`), as
HALOs does for its value head, then checked: the head's own error drops to float32's while the body keeps TF32's.

The output 'value' still carries the body's TF32 error: pinning a module removes the error it adds, not the error
of what it is fed. The policy is the file beside this script (plain data, reviewed like code), applied in one
line. Training runs as an A100 would compute it (`tf32lab.emulate("a100")`), forward and backward, so this works
on any CPU.

    .venv/bin/python examples/value_head/train.py [--steps 20]

The same training, checked step by step against float64 (loss path, gradients, weights, Adam's moments), with the
head pinned (the policy) and not (`high` everywhere):

    tf32lab check examples/value_head/train.py:workload --train --levels highest,high \
        --policy examples/value_head/policy.json
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

import tf32lab

POLICY = Path(__file__).with_name("policy.json")


class ActorCritic(torch.nn.Module):
    def __init__(self, observations: int = 24, actions: int = 6, width: int = 256) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(observations, width), torch.nn.GELU(),
                                        torch.nn.Linear(width, width), torch.nn.GELU())
        self.pi = torch.nn.Linear(width, actions)
        self.v_head = torch.nn.Sequential(torch.nn.Linear(width, 128), torch.nn.GELU(), torch.nn.Linear(128, 1))

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.body(obs)
        return {"logits": self.pi(h), "value": self.v_head(h).squeeze(-1)}


def batch(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Observations, the actions taken and the returns seen: a synthetic environment, fixed by the seed."""
    obs = torch.randn(n, 24, generator=generator)
    actions = (obs[:, :6].argmax(dim=1) + (torch.rand(n, generator=generator) < 0.2).long()) % 6
    returns = torch.tanh(obs[:, :4].sum(dim=1)) * 10 + 0.1 * torch.randn(n, generator=generator)
    return obs, actions, returns


def train(model: ActorCritic, steps: int, generator: torch.Generator) -> list[float]:
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        obs, actions, returns = batch(256, generator)
        out = model(obs)
        loss = torch.nn.functional.cross_entropy(out["logits"], actions) + \
            0.5 * torch.nn.functional.mse_loss(out["value"], returns)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def loss(out: dict[str, torch.Tensor], batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The actor-critic loss: the policy's cross-entropy on the actions taken plus half the value's squared error."""
    _, actions, returns = batch
    return torch.nn.functional.cross_entropy(out["logits"], actions) + \
        0.5 * torch.nn.functional.mse_loss(out["value"], returns)


def workload(steps: int = 50) -> tf32lab.TrainingWorkload:
    """The training as a training workload: ``steps`` Adam steps on fresh batches of 256 (one seed per step)."""
    torch.manual_seed(0)
    return tf32lab.TrainingWorkload(
        ActorCritic(), lambda step: batch(256, torch.Generator().manual_seed(1000 + step)), loss=loss,
        optimizer=lambda params: torch.optim.Adam(params, lr=3e-3), steps=steps, name="actor-critic",
        inputs=lambda b: b[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = ActorCritic()
    policy = tf32lab.Policy.load(POLICY)

    with tf32lab.emulate("a100"), policy.applied(model):  # the one line that applies it
        losses = train(model, args.steps, generator)
    print(f"trained {args.steps} steps under {POLICY.name} on an emulated a100: loss {losses[0]:.3f} -> "
          f"{losses[-1]:.3f}")

    obs, _, _ = batch(512, generator)
    report = tf32lab.check(tf32lab.Workload(model, obs, name="actor-critic"), levels=("highest", "high"),
                           policy=policy)
    rows = {lv.level: {e.name: e.introduced for e in lv.layers} for lv in report.levels}
    print(f"\n{'layer':<10} {'highest':>9} {'high':>9} {'policy':>9}   error each layer introduces (normwise)")
    for name in rows["high"]:
        print(f"{name:<10} " + " ".join(f"{rows[lv][name]:9.1e}" for lv in ("highest", "high", "policy")))
    print()
    for lv in report.levels:
        print(f"{lv.level:<8} output 'value' off by {next(o.normwise for o in lv.outputs if o.name == 'value'):.1e}")
    for line in report.conclusion():
        print(line)

    head = [name for name in rows["policy"] if name.startswith("v_head")]
    body = [name for name in rows["policy"] if name.startswith("body")]
    fp32 = max(rows["highest"][name] for name in head)
    ok = (max(rows["policy"][name] for name in head) <= 2 * fp32 < 1e-6
          and all(rows["policy"][name] == rows["high"][name] > 1e-5 for name in body)
          and not any(math.isnan(v) for v in rows["policy"].values()))
    print("\nthe head's error is float32's, the body's is TF32's" if ok else "\nUNEXPECTED: see the table above")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
