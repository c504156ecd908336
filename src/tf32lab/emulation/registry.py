"""The registry of the emulator's rules, ``RULES``, filled only by ``@rule``, and what the rule modules share: an
op's argument by position or name, and the GEMM helpers of a linear layer's product (``tf32lab.emulation.rules``
and ``tf32lab.emulation.attention_rules`` register into it; importing ``rules`` registers both)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from tf32lab.errors import Tf32LabError

__all__ = ["RULES", "aten", "gemm_key", "gemm_rows", "linear_product", "op_arg", "plain_gemm", "rule"]

aten = torch.ops.aten

RULES: dict[Any, Callable] = {}


def rule(*ops: Any) -> Callable[[Callable], Callable]:
    """Register ``fn`` as the rule of each aten op packet in ``ops``."""
    for op in ops:
        if not isinstance(op, torch._ops.OpOverloadPacket):
            raise TypeError(f"rule() takes aten op packets (aten.mm), got {op!r}")

    def register(fn: Callable) -> Callable:
        for op in ops:
            if op in RULES:
                raise Tf32LabError(f"{op} already has the rule {RULES[op].__name__}")
            RULES[op] = fn
        return fn

    return register


def op_arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    """An op's argument ``name``, given by keyword or as the ``i``-th positional one (shared by the rule modules)."""
    return kwargs.get(name, args[i] if len(args) > i else default)


def gemm_key(m: int, n: int, k: int) -> str:
    """The target key of an (m x k) @ (k x n) product (each matrix of a batch): one row, one column or an inner
    dimension of 1 (an outer product) is ``matmul.gemv``, as cuBLAS hands it to a kernel without TF32 (measured on
    an H100 and an H200), the rest ``matmul``. ``tf32lab.know.targets`` says what each target does with it."""
    return "matmul.gemv" if m == 1 or n == 1 or k == 1 else "matmul"


def gemm_rows(x: torch.Tensor) -> int:
    """Rows of ``x`` as a GEMM operand once its batch dims are flattened into rows (``linear``'s fold)."""
    return x.numel() // x.size(-1) if x.dim() > 1 and x.size(-1) else 1


def plain_gemm(gemm: Callable, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return gemm(a, b)


def linear_product(call, key: str, x, w, bias):
    """x wᵀ + bias, the product in the math of ``key`` (``matmul``: of ``matmul.gemv`` for one row or one output
    feature, batch dims folded into rows as cuBLAS gets them)."""
    if key == "matmul":
        key = gemm_key(gemm_rows(x), w.size(0) if w.dim() == 2 else 1, x.size(-1) if x.dim() else 1)
    as_gemm = None
    if w.dim() == 2 and x.dim() >= 1:
        def as_gemm(gemm: Callable, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            p = gemm(a.reshape(-1, a.size(-1)), b.t()).reshape(*a.shape[:-1], b.size(0))  # rows folded, as cuBLAS
            return p if bias is None else p + bias

    return call.product(key, lambda a, b: aten.linear.default(a, b, bias), x, w,
                        bare=lambda a, b: aten.linear.default(a, b), as_gemm=as_gemm)
