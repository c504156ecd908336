"""Outer products (an inner dimension of 1) on a GPU: whether `high` changes their bits (cuBLAS's TF32 path) or
not, from 64² to 8192², batched, and a linear layer's weight gradient for a batch of one row.

    PYTHONPATH=src python3 scripts/gpu/outer_products.py
"""

from __future__ import annotations

import torch

import tf32lab


def at_levels(fn) -> str:
    """"TF32" where `high` gives other bits than `highest`, else "same bits"."""
    out = {}
    for level in ("highest", "high"):
        with tf32lab.precision(level):
            out[level] = fn()
        torch.cuda.synchronize()
    return "TF32" if not torch.equal(out["high"], out["highest"]) else "same bits"


def main() -> None:
    torch.manual_seed(0)
    for m, n in ((64, 64), (1024, 1024), (4096, 4096), (65536, 1024), (8192, 8192)):
        a, b = torch.randn(m, 1, device="cuda"), torch.randn(1, n, device="cuda")
        print(f"mm {m}x1 @ 1x{n}: {at_levels(lambda a=a, b=b: a @ b)}")
    a, b = torch.randn(8, 4096, 1, device="cuda"), torch.randn(8, 1, 4096, device="cuda")
    print(f"bmm 8x4096x1 @ 8x1x4096: {at_levels(lambda: torch.bmm(a, b))}")
    w = torch.randn(4096, 4096, device="cuda", requires_grad=True)
    x = torch.randn(1, 4096, device="cuda")

    def weight_gradient() -> torch.Tensor:
        w.grad = None
        torch.nn.functional.linear(x, w).sum().backward()
        return w.grad.clone()

    print(f"linear weight gradient, one row, 4096x4096: {at_levels(weight_gradient)}")


if __name__ == "__main__":
    main()
