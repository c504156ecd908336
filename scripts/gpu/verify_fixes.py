"""emulate("h100") against the H100 for what its first run corrected: TF32 operands rounded to nearest-even in
cuBLAS, products with one row or one column left IEEE, and cuBLAS solvers (trsm) following the matmul level.

Per product: the GPU's and the emulation's normwise error against float64 at `high`, their normwise and largest
difference, the share of equal bits, and the difference when the emulation is forced to round ties away (the old
assumption). Per solver: the error against float64 at both levels, on the GPU and emulated. On a CPU the "gpu"
columns are this CPU's native results (a smoke test).

    PYTHONPATH=src python scripts/gpu/verify_fixes.py
"""

from __future__ import annotations

import torch

import tf32lab

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(1, 1024, 1024), (1024, 1024, 1), (2, 1024, 1024), (64, 256, 64), (256, 1024, 256), (1024, 1024, 1024),
          (32, 4096, 4096)]


def nw(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm())


def mx(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.double() - y.double()).abs().max() / y.double().abs().max())


def products() -> None:
    torch.manual_seed(0)
    print("product               gpu err    emu err    normdiff   maxdiff   same bits | forced rna normdiff, coverage")
    for m, k, n in SHAPES:
        a, b = torch.randn(m, k), torch.randn(k, n)
        ref = a.double() @ b.double()
        with tf32lab.precision("high"):
            gpu = (a.to(DEV) @ b.to(DEV)).cpu()
            with tf32lab.emulate("h100") as emu:
                emulated = a @ b
            with tf32lab.emulate("h100", rounding="rna"):
                forced = a @ b
        print(f"mm {m}x{k}x{n:<12} {nw(gpu, ref):.3e}  {nw(emulated, ref):.3e}  {nw(gpu, emulated.double()):.3e}  "
              f"{mx(gpu, emulated):.2e}  {float((gpu == emulated).float().mean()):.4f} | "
              f"{nw(gpu, forced.double()):.3e} {dict(emu.coverage)}")


def solvers() -> None:
    g = torch.Generator().manual_seed(5)
    n = 2048
    a = torch.randn(n, n, generator=g) / n ** 0.5 + 2 * torch.eye(n)
    b = torch.randn(n, 512, generator=g)
    cases = {
        "solve_triangular": (lambda a, b: torch.linalg.solve_triangular(a, b, upper=True), torch.triu(a)),
        "linalg.solve": (torch.linalg.solve, a),
        "inv": (lambda a, b: torch.linalg.inv(a), a),
        "lstsq (tall)": (lambda a, b: torch.linalg.lstsq(a[:, :512], b).solution, a),
    }
    for name, (fn, x) in cases.items():
        ref = fn(x.double(), b.double())
        line = f"{name:<18}"
        for level in ("highest", "high"):
            with tf32lab.precision(level):
                gpu = fn(x.to(DEV), b.to(DEV)).cpu()
                with tf32lab.emulate("h100") as emu:
                    emulated = fn(x, b)
            maths = sorted({m for (_, m) in emu.coverage})
            line += f"  {level}: gpu {nw(gpu, ref):.2e} emulated {nw(emulated, ref):.2e} {maths}"
        print(line)


if __name__ == "__main__":
    products()
    solvers()
