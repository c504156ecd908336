"""Compare emulate()'s accumulation models with a GPU's own output bits (a Hopper: H100 or H200).

    python scripts/gpu_compare_accumulation.py DATA_DIR [--markdown]

DATA_DIR holds what a GPU run saved (torch.load files):

- ``gemm_inputs.pt``: ``{kind: (A 64 x 16384, B 16384 x 64)}`` float32; a GEMM of depth K uses ``A[:, :K]``,
  ``B[:K, :]``;
- ``gemm_bits.pt``: ``{"outputs": {f"{kind}/K{K}/M{side}/{level}": C 64 x 64}, "kernels": ...}``: cuBLAS's outputs
  (``side`` 64: the product as is, which cuBLAS split along K; 2048: operands padded with other rows and columns
  so that cuBLAS picks a kernel without split-K, the top-left 64 x 64 block kept);
- ``mma_inputs.pt`` / ``mma_bits.pt``: ``{key: (A, B, C)}`` and ``{"outputs": {key: D}}``: one Triton program's
  ``tl.dot(A, B, acc=C, input_precision="tf32")`` (wgmma, operands unrounded: the unit truncates them).

For each output it prints the fraction of outputs bit-identical to the model and the worst distance in units in
the last place: the "hardware" model (``highest``: the FMA chain; ``high``: operands rounded as cuBLAS rounds them
on Hopper, RNE, then the Hopper unit, 8 products fused with 25 fraction bits, truncated) and, beside it, the
"ideal" one (this CPU's float32 GEMM of the same rounded operands).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

from tf32lab.numbers import accumulation, formats


def ulps(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Distance between float32 values in units in the last place (0 for identical bits)."""
    def ordered(t: torch.Tensor) -> torch.Tensor:
        i = t.contiguous().view(torch.int32).to(torch.int64)
        return torch.where(i < 0, -(i & 0x7FFFFFFF), i)

    return (ordered(x) - ordered(y)).abs()


def compare(got: torch.Tensor, want: torch.Tensor) -> tuple[float, int]:
    d = ulps(got, want)
    return float((d == 0).double().mean()), int(d.max())


def gemm_rows(data: pathlib.Path) -> list[tuple]:
    inputs = torch.load(data / "gemm_inputs.pt")
    bits = torch.load(data / "gemm_bits.pt")["outputs"]
    rows = []
    for key, out in bits.items():
        kind, k, side, level = key.split("/")
        depth = int(k[1:])
        a, b = inputs[kind][0][:, :depth], inputs[kind][1][:depth, :]
        if level == "high":
            a, b = formats.round_tf32(a, "rne"), formats.round_tf32(b, "rne")
            model = accumulation.HOPPER
        else:
            model = accumulation.FMA
        hw = compare(accumulation.gemm(a, b, model), out)
        ideal = compare(a @ b, out)
        rows.append((kind, depth, "split-K" if side == "M64" else "no split", level, str(model), *hw, *ideal))
    return rows


def mma_rows(data: pathlib.Path) -> list[tuple]:
    inputs = torch.load(data / "mma_inputs.pt")
    bits = torch.load(data / "mma_bits.pt")["outputs"]
    rows = []
    for key, out in bits.items():
        kind, k = key.split("/")
        a, b, c = inputs[key]
        a, b = formats.round_tf32(a, "rz"), formats.round_tf32(b, "rz")
        hw = compare(accumulation.gemm(a, b, accumulation.HOPPER, c=c), out)
        ideal = compare(a @ b + c, out)
        rows.append((kind, int(k[1:]), "Triton wgmma", "tf32", str(accumulation.HOPPER), *hw, *ideal))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", type=pathlib.Path)
    parser.add_argument("--markdown", action="store_true", help="a Markdown table")
    args = parser.parse_args(argv)
    rows = sorted(gemm_rows(args.data), key=lambda r: (r[2], r[3], r[0], r[1])) + mma_rows(args.data)
    head = ("inputs", "K", "kernel", "level", "model", "hardware: identical", "worst ulp", "ideal: identical",
            "worst ulp")
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in rows:
            print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]:.4f} | {r[6]} | {r[7]:.4f} | {r[8]} |")
    else:
        print("  ".join(head))
        for r in rows:
            print(f"{r[0]:8} {r[1]:6} {r[2]:13} {r[3]:8} {r[4]:14} {r[5]:.4f} {r[6]:6} {r[7]:.4f} {r[8]:6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
