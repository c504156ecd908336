"""Does this CPU's native `medium` compute what `emulate("cpu-amx")` says (bf16 operands, float32 accumulation)?

    python scripts/check_cpu_amx.py

For a few GEMM shapes: the native `medium` product against float64 (the size of bf16 rounding if oneDNN uses bf16
here), against the exact product of bf16-rounded operands (float32 accumulation size if it does), and the emulated
product against the native one. Meaningful only on a CPU with AMX-BF16 (or AVX512-BF16, where oneDNN may or may
not use bf16); it prints what it finds either way.
"""

from __future__ import annotations

import torch

import tf32lab
from tf32lab.machine import hardware
from tf32lab.numbers import formats


def main() -> None:
    hw = hardware.detect()
    print(f"torch {torch.__version__}, {hw.cpu}, isa {' '.join(hw.isa)}, target {hw.target}")
    torch.manual_seed(0)
    print(f"{'m x k x n':>16} {'native-f64':>11} {'native-bf16':>12} {'emulated-native':>16} {'ieee-f64':>9}")
    for m, k, n in ((16, 512, 64), (256, 1024, 256), (64, 4096, 64)):
        a, b = torch.randn(m, k), torch.randn(k, n)
        with tf32lab.precision("medium"):
            native = a @ b
        with tf32lab.precision("medium"), tf32lab.emulate("cpu-amx"):
            emulated = a @ b
        with tf32lab.precision("highest"):
            ieee = a @ b
        exact = a.double() @ b.double()
        bf16 = formats.round_bf16(a).double() @ formats.round_bf16(b).double()

        def gap(x, y):
            return (x.double() - y.double()).abs().max().item()

        print(f"{m:>4} x{k:>5} x{n:>4} {gap(native, exact):11.2e} {gap(native, bf16):12.2e} "
              f"{gap(emulated, native):16.2e} {gap(ieee, exact):9.2e}")


if __name__ == "__main__":
    main()
