"""A Policy on CUDA: a pinned module's backward keeps its level in autograd's device threads, and torch.compile.

An actor-critic (``tests/test_policy.py``'s, wider) on the GPU with ``Policy("high", [("v_head", "highest")])``:
its outputs and gradients against the same step run by hand (each part, forward and backward, inside its own
``precision()`` scope), bit for bit; the gap to running everything at ``high`` shows that the pin is visible. Then
the same with the model under ``torch.compile`` (graph breaks at the policy's boundaries). On a CPU every level
computes alike, so it only runs through.

    PYTHONPATH=src python scripts/gpu/policy_checks.py
"""

from __future__ import annotations

import sys
import traceback

import torch

import tf32lab
from tf32lab import Policy

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class ActorCritic(torch.nn.Module):
    def __init__(self, width: int = 512) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.Tanh(), torch.nn.Linear(width, width))
        self.pi = torch.nn.Linear(width, 6)
        self.v_head = torch.nn.Sequential(torch.nn.Linear(width, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))

    def forward(self, x):
        h = self.body(x)
        return self.pi(h), self.v_head(h)


def step(model: torch.nn.Module, params: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    params.zero_grad(set_to_none=True)
    pi, v = model(x)
    (pi.square().sum() + v.square().sum()).backward()
    return [pi.detach(), v.detach(), *(p.grad.clone() for p in params.parameters())]


def by_hand(model: ActorCritic, x: torch.Tensor, body: str, head: str) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with tf32lab.precision(body):
        h = model.body(x)
        pi = model.pi(h)
    cut = h.detach().requires_grad_()
    with tf32lab.precision(head):
        v = model.v_head(cut)
        v.square().sum().backward()
    with tf32lab.precision(body):
        torch.autograd.backward([pi.square().sum(), h], [None, cut.grad])
    return [pi.detach(), v.detach(), *(p.grad.clone() for p in model.parameters())]


def gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest relative difference over outputs and gradients."""
    return max(float((u - v).abs().max() / v.abs().max().clamp_min(1e-30)) for u, v in zip(a, b))


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(u, v) for u, v in zip(a, b))


def main() -> int:
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if DEV.type == 'cuda' else 'CPU'}", flush=True)
    torch.manual_seed(0)
    model = ActorCritic().to(DEV)
    x = torch.randn(512, 64, device=DEV)
    policy = Policy("high", [("v_head", "highest")])
    hand, hand_again = by_hand(model, x, "high", "highest"), by_hand(model, x, "high", "highest")
    all_high = by_hand(model, x, "high", "high")
    with policy.applied(model):
        got = step(model, model, x)
    print(f"by hand twice: same bits {same(hand, hand_again)} (the GPU's determinism, the control)")
    print(f"policy vs by hand: same bits {same(got, hand)}, largest relative gap {gap(got, hand):.2e}")
    print(f"by hand (head pinned) vs everything at high: largest relative gap {gap(hand, all_high):.2e} "
          f"(the pin's visible effect)")
    names = ["output pi", "output v", *(f"grad {name}" for name, _ in model.named_parameters())]
    print(f"{'tensor':<24} {'policy vs hand':>15} {'hand vs all-high':>17} {'policy vs all-high':>19} "
          "(largest difference / largest value)")
    for i, name in enumerate(names):
        print(f"{name:<24} {gap([got[i]], [hand[i]]):15.2e} {gap([hand[i]], [all_high[i]]):17.2e} "
              f"{gap([got[i]], [all_high[i]]):19.2e}")
    try:
        compiled = torch.compile(model)
        with policy.applied(model):
            got_compiled = step(compiled, model, x)
            got_compiled = step(compiled, model, x)  # the second call runs the compiled code, not the tracing
        print(f"torch.compile under the policy vs by hand: largest relative gap {gap(got_compiled, hand):.2e}; "
              f"vs everything at high {gap(got_compiled, all_high):.2e}")
    except Exception:
        print(f"torch.compile FAILED:\n{traceback.format_exc()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
