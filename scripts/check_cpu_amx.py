"""Does this CPU's native `medium` compute what `emulate("cpu-amx")` says (bf16 operands, float32 accumulation)?

    python scripts/check_cpu_amx.py

For a few GEMM shapes: the native `medium` product against float64 (the size of bf16 rounding if oneDNN uses bf16
here), against the exact product of bf16-rounded operands (float32 accumulation size if it does), and the emulated
product against the native one. Then, per op family, what `high` and `medium` do natively: the same bits as at
`highest`, or the error against float64 (relative to the largest entry) next to `highest`'s. Meaningful only on a
CPU with AMX-BF16 (or AVX512-BF16, where oneDNN may or may not use bf16); it prints what it finds either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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

    ops()


def _rnn(kind: type, grad: bool):
    torch.manual_seed(0)
    rnn, wide = kind(256, 256, num_layers=2, batch_first=True), kind(256, 256, num_layers=2, batch_first=True)
    wide.load_state_dict(rnn.state_dict())
    wide.double()

    def run(x: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_(grad)
        out = (wide if x.dtype == torch.float64 else rnn)(x)[0]
        return torch.autograd.grad(out.sum(), x)[0] if grad else out.detach()
    return run


def _error(out: torch.Tensor, exact: torch.Tensor) -> str:
    return f"{(out.double() - exact).abs().max().item() / exact.abs().max().item():9.1e}"


def ops() -> None:
    """Each op family natively at each level: 'same' (the bits of highest) or its error against float64."""
    torch.manual_seed(0)
    cases = {
        "mm 256x1024x256": (torch.mm, torch.randn(256, 1024), torch.randn(1024, 256)),
        "mm 8x256x16": (torch.mm, torch.randn(8, 256), torch.randn(256, 16)),
        "mm 1x1024x256": (torch.mm, torch.randn(1, 1024), torch.randn(1024, 256)),
        "mv 256x1024": (torch.mv, torch.randn(256, 1024), torch.randn(1024)),
        "dot 100000": (torch.dot, torch.randn(100000), torch.randn(100000)),
        "sdpa 2x4x128x64": (F.scaled_dot_product_attention, *torch.randn(3, 2, 4, 128, 64)),
        "conv2d 3x3 64ch": (F.conv2d, torch.randn(4, 64, 32, 32), torch.randn(64, 64, 3, 3)),
        "lstm fwd": (_rnn(torch.nn.LSTM, False), torch.randn(8, 50, 256)),
        "lstm grad": (_rnn(torch.nn.LSTM, True), torch.randn(8, 50, 256)),
        "gru fwd": (_rnn(torch.nn.GRU, False), torch.randn(8, 50, 256)),
        "gru grad": (_rnn(torch.nn.GRU, True), torch.randn(8, 50, 256)),
        "linalg.solve 256": (torch.linalg.solve, torch.randn(256, 256), torch.randn(256, 16)),
    }
    print(f"{'op':>18} {'highest':>9} {'high':>9} {'medium':>9}")
    for name, (fn, *args) in cases.items():
        exact = fn(*(a.double() for a in args))
        found = {}
        for level in ("highest", "high", "medium"):
            with tf32lab.precision(level):
                found[level] = fn(*args)
        cells = [_error(found["highest"], exact)]
        cells += [f"{'same':>9}" if torch.equal(found[level], found["highest"]) else _error(found[level], exact)
                  for level in ("high", "medium")]
        print(f"{name:>18} {' '.join(cells)}")


if __name__ == "__main__":
    main()
