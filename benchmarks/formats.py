"""Rounding throughput on a 64 MiB float32 tensor, as a ratio to ``x.clone()`` (goal: >= 0.5).

    python benchmarks/formats.py

ratio = time(clone) / time(rounding): 1.0 means rounding runs as fast as copying the tensor.
Splits write two tensors, so their ratio counts both. ``--tensor-code`` times the tensor code alone; by default the
compiled kernel runs where numba is installed (as in a long run, ``formats.COMPILE_AFTER``).
"""

from __future__ import annotations

import sys

import torch
from _common import header, interleaved

from tf32lab.numbers import formats

GOAL = 0.5


def main() -> None:
    x = torch.randn(16 * 1024 * 1024)  # 64 MiB
    variants = {
        "clone": x.clone,
        "round_tf32 rna": lambda: formats.round_tf32(x),
        "round_tf32 rne": lambda: formats.round_tf32(x, "rne"),
        "round_tf32 rz": lambda: formats.round_tf32(x, "rz"),
        "round_bf16 rne": lambda: formats.round_bf16(x),
        "round_bf16 rna": lambda: formats.round_bf16(x, "rna"),
        "round_bf16 rz": lambda: formats.round_bf16(x, "rz"),
        "round_fp16": lambda: formats.round_fp16(x),
        "split_bf16x3": lambda: formats.split_bf16x3(x),
        "split_tf32x3": lambda: formats.split_tf32x3(x),
    }
    header("formats: 64 MiB float32, interleaved, medians of 9 rounds")
    if "--tensor-code" in sys.argv:
        formats.COMPILED_FROM = 1 << 62
    compiled = x.numel() > formats.COMPILED_FROM and formats.load_compiled()
    print("rounding: " + ("compiled kernel (numba)" if compiled else "tensor code"))
    times = interleaved(variants, rounds=9, number=3)
    clone = times["clone"]
    print(f"{'function':<16} {'ms':>7} {'ratio':>6}")
    worst = min(clone / t for name, t in times.items() if name.startswith("round"))
    for name, t in times.items():
        print(f"{name:<16} {t * 1e3:7.1f} {clone / t:6.2f}")
    print(f"worst rounding ratio {worst:.2f} (goal >= {GOAL}): {'met' if worst >= GOAL else 'NOT met'}")


if __name__ == "__main__":
    main()
