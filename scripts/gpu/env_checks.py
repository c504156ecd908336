"""autoconfig() and the environment overrides on a real GPU (docs/gpu-results.md).

Without arguments: a 4096² matmul's normwise error against float64 at the process level before
``tf32lab.autoconfig()``, after it (its decisions logged) and after ``decisions.undo()``; then the same probe in
fresh processes under each environment override (``NVIDIA_TF32_OVERRIDE=0``, ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1``)
and without one: the matmul at ``highest`` and ``high``, a cuDNN convolution at PyTorch's defaults, the
memory-efficient SDPA kernel, and what ``doctor()`` / ``autoconfig`` decide there.

``--probe`` runs that probe in this process and prints one JSON line. On a CPU it runs on small sizes.

    PYTHONPATH=src python scripts/gpu/env_checks.py
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

import tf32lab

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
SIZE = 4096 if CUDA else 256


def normwise(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    return float((x - ref).norm() / ref.norm())


def operands(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SIZE, SIZE, generator=g).to(DEV), torch.randn(SIZE, SIZE, generator=g).to(DEV)


def matmul_error(level: str | None = None) -> float:
    """The error of a SIZE² matmul; ``level`` None: at whatever the process is set to."""
    a, b = operands()
    ref = a.double() @ b.double()
    if level is None:
        c = a @ b
    else:
        with tf32lab.precision(level):
            c = a @ b
    return normwise(c, ref)


def conv_error() -> float:
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(8, 64, 56, 56, generator=g), torch.randn(128, 64, 3, 3, generator=g)
    ref = F.conv2d(x.double(), w.double(), padding=1)
    return normwise(F.conv2d(x.to(DEV), w.to(DEV), padding=1), ref)


def efficient_sdpa_error(level: str) -> float | str:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(4, 16, 512, 64, generator=g) for _ in range(3))
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    try:
        with tf32lab.precision(level), sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            out = F.scaled_dot_product_attention(q.to(DEV), k.to(DEV), v.to(DEV))
    except RuntimeError as exc:
        return f"refused: {str(exc).splitlines()[0][:100]}"
    return normwise(out, ref)


def probe() -> dict:
    # first, before tf32lab touches any flag: PyTorch's defaults as a program that never sets them sees them
    before = tf32lab.control.flags.snapshot()
    untouched = {"matmul, flags untouched": matmul_error(),
                 "legacy allow_tf32 reads": torch.backends.cuda.matmul.allow_tf32,
                 "get_float32_matmul_precision": torch.get_float32_matmul_precision()}

    def legacy_highest() -> None:
        torch.set_float32_matmul_precision("highest")  # PyTorch's own API, legacy generation

    def allow_false() -> None:
        torch.backends.cuda.matmul.allow_tf32 = False

    def new_ieee() -> None:
        torch.backends.cuda.matmul.fp32_precision = "ieee"

    for label, write in (("torch.set_float32_matmul_precision('highest')", legacy_highest),
                         ("allow_tf32 = False", allow_false), ("cuda.matmul.fp32_precision = 'ieee'", new_ieee)):
        try:
            write()
            untouched[f"matmul after {label}"] = matmul_error()
        except Exception as exc:  # a torch that refuses one of the API generations
            untouched[f"matmul after {label}"] = f"{type(exc).__name__}: {exc}"
    tf32lab.control.flags.restore(before)
    diagnosis = tf32lab.doctor().to_dict()
    return {
        "env": {k: os.environ[k] for k in ("NVIDIA_TF32_OVERRIDE", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE")
                if k in os.environ},
        **untouched,
        "matmul highest": matmul_error("highest"),
        "matmul high": matmul_error("high"),
        "conv default (cudnn tf32 flag on)": conv_error(),
        "efficient sdpa highest": efficient_sdpa_error("highest"),
        "efficient sdpa high": efficient_sdpa_error("high"),
        "doctor target": diagnosis.get("target"),
        "doctor warnings": [w["code"] for w in diagnosis["warnings"]],
        "recommended level": diagnosis["recommendation"]["level"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probe", action="store_true", help="run the probe here and print one JSON line")
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe()), flush=True)
        return 0
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name() if CUDA else 'CPU (no CUDA device)'}, "
          f"{SIZE}² matmul", flush=True)
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    print(f"process level before autoconfig: {tf32lab.get_float32_matmul_precision()!r}, matmul error "
          f"{matmul_error():.3e}", flush=True)
    decisions = tf32lab.autoconfig()
    print(decisions, flush=True)
    print(f"after autoconfig: level {tf32lab.get_float32_matmul_precision()!r}, matmul error {matmul_error():.3e}, "
          f"conv error {conv_error():.3e}, threads {torch.get_num_threads()}", flush=True)
    decisions.undo()
    print(f"after undo(): level {tf32lab.get_float32_matmul_precision()!r}, matmul error {matmul_error():.3e}, "
          f"threads {torch.get_num_threads()}", flush=True)
    cases = (("no override", {}), ("NVIDIA_TF32_OVERRIDE=0", {"NVIDIA_TF32_OVERRIDE": "0"}),
             ("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1", {"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"}))
    for label, extra in cases:
        env = {k: v for k, v in os.environ.items()
               if k not in ("NVIDIA_TF32_OVERRIDE", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE")}
        env.update(extra)
        done = subprocess.run([sys.executable, __file__, "--probe"], env=env, capture_output=True, text=True,
                              timeout=300)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        if done.returncode != 0 or not lines:
            print(f"{label}: probe failed (exit {done.returncode}): {done.stderr[-2000:]}", flush=True)
            continue
        result = json.loads(lines[-1])
        print(f"{label}: " + ", ".join(f"{k} {v:.3e}" if isinstance(v, float) else f"{k} {v}"
                                       for k, v in result.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
