"""Make tests/data/mmasim_tf32.{npz,json}: MMA-Sim's own outputs for TF32 (and CDNA3 XF32) instructions.

    python scripts/make_mmasim_vectors.py MMA_SIM_CHECKOUT tests/data/mmasim_tf32

MMA_SIM_CHECKOUT is a checkout of github microsoft/MMA-Sim (the data in the repository: commit c785138), run, not
copied: only its outputs are kept. Per unit (Ampere and Ada ``mma m16n8k8`` TF32, Hopper ``wgmma m64n8k8``,
Blackwell ``tcgen05.mma m64n8k8``, CDNA3 ``v_mfma_f32_16x16x8_xf32``), seeded inputs of five kinds (random,
cancelling, exponent-spread, all-positive, edge: zeros, subnormals, tiny and huge) for one instruction, two kinds
chained over eight instructions along K, and the paper's section VI-C case. tests/test_accumulation.py reads them.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch


def _tensor(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(x, dtype=np.float32))


def _spread(g: np.random.Generator, shape: tuple[int, int], lo: int, hi: int) -> np.ndarray:
    sign = np.where(g.random(shape) < 0.5, -1, 1)
    return sign * (1 + g.random(shape)) * 2.0 ** g.integers(lo, hi, shape)


def kinds(g: np.random.Generator, m: int, n: int, k: int) -> dict[str, tuple[torch.Tensor, ...]]:
    out = {"random": (_tensor(g.standard_normal((m, k))), _tensor(g.standard_normal((k, n))),
                      _tensor(g.standard_normal((m, n))))}
    base, bb = g.standard_normal((m, k)) * 2.0 ** 8, g.standard_normal((k, n))
    a = base.copy()  # pairs of products that cancel up to their low bits, a small c
    a[:, 1::2] = a[:, 0::2] * (1 + g.standard_normal((m, k // 2)) * 2.0 ** -9)
    b = bb.copy()
    b[1::2, :] = -bb[0::2, :]
    out["cancel"] = (_tensor(a), _tensor(b), _tensor(g.standard_normal((m, n)) * 2.0 ** -6))
    out["spread"] = tuple(_tensor(x) for x in (_spread(g, (m, k), -30, 30), _spread(g, (k, n), -30, 30),
                                               _spread(g, (m, n), -40, 40)))
    out["positive"] = (_tensor(g.random((m, k))), _tensor(g.random((k, n))), _tensor(g.random((m, n)) * 8))
    a = g.standard_normal((m, k))
    a[g.random((m, k)) < 0.2] = 0.0
    a[g.random((m, k)) < 0.1] = 2.0 ** -135
    b = _spread(g, (k, n), -80, 60)
    b[g.random((k, n)) < 0.1] = 0.0
    c = _spread(g, (m, n), -140, 40)
    c[g.random((m, n)) < 0.1] = 0.0
    out["edge"] = (_tensor(a), _tensor(b), _tensor(c))
    return out


def main(checkout: str, out: str) -> None:
    sys.path.insert(0, checkout)
    from mmasim.simulator.amd import mfma
    from mmasim.simulator.nv_ptx import mma, tcgen05mma, wgmma

    units = {
        "ampere": lambda: mma("Ampere", "m16n8k8.f32.tf32.tf32.f32"),
        "ada": lambda: mma("Ada Lovelace", "m16n8k8.f32.tf32.tf32.f32"),
        "hopper": lambda: wgmma("Hopper", "m64n8k8.f32.tf32.tf32"),
        "blackwell": lambda: tcgen05mma("Blackwell", "m64n8k8.f32.tf32.tf32"),
        "cdna3": lambda: mfma("CDNA3", "f32_16x16x8_xf32"),
    }
    data, meta = {}, {}
    for name, make in units.items():
        unit = make()
        m, n, k = unit.m, unit.n, unit.k
        g = np.random.default_rng(2026)
        for kind, (a, b, c) in kinds(g, m, n, k).items():
            d = unit(a.clone(), b.clone(), c.clone())
            for part, value in zip("abcd", (a, b, c, d)):
                data[f"{name}/{kind}/{part}"] = value.numpy()
        # eight instructions chained along K from C = 0, as a GEMM kernel runs them
        for kind, draw in (("chain_positive", g.random), ("chain_random", g.standard_normal)):
            a, b = _tensor(draw((m, 8 * k))), _tensor(draw((8 * k, n)))
            d = torch.zeros((m, n), dtype=torch.float32)
            for s in range(8):
                d = unit(a[:, s * k:(s + 1) * k].clone(), b[s * k:(s + 1) * k].clone(), d)
            for part, value in zip("abcd", (a, b, torch.zeros((m, n)), d)):
                data[f"{name}/{kind}/{part}"] = value.numpy()
        meta[f"{name}/vi_c"] = unit.dotadd([2048.0, 2048.0], [2048.0, -2048.0], -1e-6)  # the paper's section VI-C
        meta[f"{name}/mnk"] = [m, n, k]
        print(name, "done", meta[f"{name}/vi_c"], flush=True)
    np.savez_compressed(out + ".npz", **data)
    with open(out + ".json", "w") as f:
        json.dump(meta, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
