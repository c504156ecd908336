"""Measurements on a real CUDA GPU behind docs/gpu-results.md: scopes, operand rounding, the emulator, solvers.

Sections (all by default, or those named with ``--sections``):

- ``scope``: a precision() scope switches real cuBLAS between IEEE and TF32 (a 4096² matmul's error against
  float64 at ``highest`` and ``high``), also in two threads at once holding different levels;
- ``rounding``: how the hardware rounds float32 operands to TF32, read off exactly: ``A @ I`` (and ``I @ A``, a
  1x1 and a 3x3 delta convolution, an RNN with identity input weights) holds the rounded operand, compared bit for
  bit with ``formats.round_tf32`` in each rounding mode, on operands with many exact ties;
- ``matmul``: ``emulate(target)`` on CPU copies against the GPU's own TF32 GEMMs, per shape (bit equality,
  max and normwise difference), beside the emulation with truncated operands;
- ``matvec``: whether mv / addmv / one-row products change between ``highest`` and ``high``;
- ``conv_rnn``: cuDNN convolutions and an LSTM at ``highest`` (cuDNN's TF32 flag on by default) against the
  emulation, and with cuDNN's TF32 off;
- ``sdpa``: which SDPA backend float32 inputs get, which accept them, and the memory-efficient kernel's error
  against float64 and against the emulation (3xTF32);
- ``encoder``: an all-MiniLM-L6-v2-sized BERT encoder (random weights) on the GPU against the emulation;
- ``linalg``: solvers at ``highest`` vs ``high`` (solve_triangular, lu_solve, lstsq, inv) and backward formulas
  (pinv, cholesky, svd, eigh, qr, lu, solve, det, inv): errors against float64, and whether the two levels give
  the same bits.

Every check is wrapped so that one failure does not lose the rest; results also go to ``--json``. Without a GPU
it runs the CPU-side parts on small sizes (a smoke test) and says so.

    PYTHONPATH=src python scripts/gpu/hardware_checks.py [--target h100] [--sections scope,matmul] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch
import torch.nn.functional as F

import tf32lab
from tf32lab.numbers import formats

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
RESULTS: dict[str, Any] = {}


def say(*parts: Any) -> None:
    print(*parts, flush=True)


def section(name: str, fn: Callable[[], None]) -> None:
    say(f"\n=== {name} ===")
    started = time.perf_counter()
    try:
        fn()
    except Exception:  # one failing check must not lose the others
        say(f"!!! section {name} FAILED:\n{traceback.format_exc()}")
        RESULTS.setdefault("failures", []).append(name)
    say(f"--- {name}: {time.perf_counter() - started:.1f} s")


def record(key: str, value: Any) -> None:
    RESULTS[key] = value


def normwise(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    return float((x - ref).norm() / ref.norm())


def maxrel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    return float((x - ref).abs().max() / ref.abs().max())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float().cpu().contiguous(), b.detach().float().cpu().contiguous()
    return float((a.view(torch.int32) == b.view(torch.int32)).double().mean())


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def n(big: int, small: int) -> int:
    return big if CUDA else small


def with_ties(shape: tuple[int, ...], seed: int, tie_share: float = 0.5) -> torch.Tensor:
    """Normal float32 values, ``tie_share`` of them with their 13 low bits exactly 0x1000 (a TF32 tie)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    bits = x.view(torch.int32)
    ties = torch.rand(shape, generator=g) < tie_share
    tied = (bits & ~0x1FFF) | 0x1000
    return torch.where(ties, tied, bits).view(torch.float32)


def rounding_match(got: torch.Tensor, x: torch.Tensor) -> dict[str, float]:
    """Share of elements of ``got`` bit-equal to ``x`` rounded to TF32 in each mode, and to ``x`` itself."""
    got = got.detach().float().cpu()
    out = {mode: same_bits(got, formats.round_tf32(x.cpu(), mode)) for mode in formats.ROUNDINGS}
    out["fp32"] = same_bits(got, x.cpu())
    return out


# -- scope ------------------------------------------------------------------------------------------------------
def matmul_error(level: str, size: int, seed: int = 0) -> float:
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(size, size, generator=g).to(DEV), torch.randn(size, size, generator=g).to(DEV)
    ref = a.double() @ b.double()
    with tf32lab.precision(level):
        c = a @ b
    sync()
    return normwise(c, ref)


def check_scope() -> None:
    size = n(4096, 512)
    errors = {level: matmul_error(level, size) for level in ("highest", "high", "medium")}
    for level, err in errors.items():
        say(f"{size}² matmul, precision({level!r}): normwise error vs float64 {err:.3e}")
    record("scope.single", errors)
    # two threads at once, each in its own scope, many matmuls each, started together
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(size, size, generator=g).to(DEV), torch.randn(size, size, generator=g).to(DEV)
    ref = a.double() @ b.double()
    barrier = threading.Barrier(2)
    found: dict[str, list[float]] = {"highest": [], "high": []}
    failures: list[str] = []

    def worker(level: str) -> None:
        try:
            with tf32lab.precision(level):
                barrier.wait()
                outs = [a @ b for _ in range(20)]
                sync()
            found[level] = [normwise(c, ref) for c in outs]
        except Exception as exc:
            failures.append(f"{level}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(lv,)) for lv in ("highest", "high")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for level, errs in found.items():
        if errs:
            say(f"thread at {level!r}: 20 matmuls, normwise error min {min(errs):.3e} max {max(errs):.3e}")
    if failures:
        say("thread failures:", failures)
    record("scope.threads", {"errors": {lv: [min(e), max(e)] if e else None for lv, e in found.items()},
                             "failures": failures})


# -- rounding ---------------------------------------------------------------------------------------------------
def check_rounding() -> None:
    size = n(2048, 128)
    x = with_ties((size, size), seed=2)
    eye = torch.eye(size)
    xd, eyed = x.to(DEV), eye.to(DEV)
    probes: dict[str, Callable[[], torch.Tensor]] = {
        "mm A@I": lambda: xd @ eyed,
        "mm I@A": lambda: eyed @ xd,
        "mm A@I (A transposed view)": lambda: xd.t().contiguous().t() @ eyed,
        "addmm 0+A@I": lambda: torch.addmm(torch.zeros(size, device=DEV), xd, eyed),
        "linear A Iᵀ": lambda: F.linear(xd, eyed),
        "bmm 4x(A@I)": lambda: torch.bmm(xd[: size // 4].reshape(4, -1, size), eyed.expand(4, size, size))
        .reshape(size // 4, size),
    }
    wanted = {"bmm 4x(A@I)": x[: size // 4]}
    out = {}
    for level in ("highest", "high"):
        for name, fn in probes.items():
            with tf32lab.precision(level):
                got = fn()
            sync()
            match = rounding_match(got, wanted.get(name, x))
            out[f"{level} {name}"] = match
            say(f"{level:<8} {name:<28} bit-equal share: " + "  ".join(f"{k} {v:.4f}" for k, v in match.items()))
    # convolutions: 1x1 and 3x3 delta kernels copy the input through cuDNN's TF32 (or IEEE) path
    c = 64
    img = with_ties((8, c, 32, 32), seed=3)
    w1 = torch.eye(c).reshape(c, c, 1, 1)
    w3 = torch.zeros(c, c, 3, 3)
    w3[:, :, 1, 1] = torch.eye(c)
    for allow in (True, False):
        torch.backends.cudnn.allow_tf32 = allow
        try:
            for name, w, pad in (("conv 1x1 identity", w1, 0), ("conv 3x3 delta", w3, 1)):
                got = F.conv2d(img.to(DEV), w.to(DEV), padding=pad)
                sync()
                match = rounding_match(got, img)
                out[f"cudnn.allow_tf32={allow} {name}"] = match
                say(f"cudnn.allow_tf32={allow!s:<5} {name:<20} bit-equal share: "
                    + "  ".join(f"{k} {v:.4f}" for k, v in match.items()))
            # an RNN with identity input weights, no recurrence, relu: h_t = round(x_t) for x_t > 0
            rnn = torch.nn.RNN(c, c, nonlinearity="relu", batch_first=True).to(DEV)
            with torch.no_grad():
                rnn.weight_ih_l0.copy_(torch.eye(c))
                rnn.weight_hh_l0.zero_()
                rnn.bias_ih_l0.zero_()
                rnn.bias_hh_l0.zero_()
            seq = with_ties((16, 20, c), seed=4).abs()
            with torch.no_grad():
                got, _ = rnn(seq.to(DEV))
            sync()
            match = rounding_match(got, seq)
            out[f"cudnn.allow_tf32={allow} rnn identity"] = match
            say(f"cudnn.allow_tf32={allow!s:<5} {'rnn(relu) identity':<20} bit-equal share: "
                + "  ".join(f"{k} {v:.4f}" for k, v in match.items()))
        finally:
            torch.backends.cudnn.allow_tf32 = True
    record("rounding", out)


def _verdict(match: dict[str, float]) -> str:
    """Which rounding a probe's output is bit-equal to everywhere, or the shares when none is."""
    exact = [mode for mode, share in match.items() if share == 1.0]
    return "+".join(exact) if exact else "none (" + " ".join(f"{k} {v:.4f}" for k, v in match.items()) + ")"


def check_kernels() -> None:
    """The identity probe over many GEMM shapes and convolution configurations (one cuBLAS or cuDNN kernel each
    may round differently), and from how many rows a GEMM uses tensor cores at all."""
    out = {}
    shapes = [(64, 64), (256, 256), (1024, 1024), (4096, 4096), (8, 4096), (32, 4096), (8192, 64), (3, 512),
              (1, 1024)] if CUDA else [(64, 64), (3, 64)]
    for m, k in shapes:
        x = with_ties((m, k), seed=100 + m + k)
        eye = torch.eye(k, device=DEV)
        with tf32lab.precision("high"):
            left = x.to(DEV) @ eye
            right = (eye @ x.to(DEV).T).T  # I @ Aᵀ: the tied values as the second operand
        sync()
        out[f"mm ({m}x{k})@I"] = _verdict(rounding_match(left, x))
        out[f"mm I@({k}x{m})"] = _verdict(rounding_match(right, x))
        say(f"high  mm ({m}x{k}) @ I: {out[f'mm ({m}x{k})@I']:<12} I @ ({k}x{m}): {out[f'mm I@({k}x{m})']}")
    convs = [  # (label, channels in = out, kernel, stride, padding, dims, channels_last, transposed)
        ("conv2d 1x1 c64", 64, 1, 1, 0, 2, False, False), ("conv2d 1x1 c256", 256, 1, 1, 0, 2, False, False),
        ("conv2d 3x3 c64", 64, 3, 1, 1, 2, False, False), ("conv2d 3x3 c256", 256, 3, 1, 1, 2, False, False),
        ("conv2d 3x3 c8", 8, 3, 1, 1, 2, False, False), ("conv2d 3x3 c64 channels_last", 64, 3, 1, 1, 2, True, False),
        ("conv2d 1x1 c64 channels_last", 64, 1, 1, 0, 2, True, False),
        ("conv2d 5x5 c32", 32, 5, 1, 2, 2, False, False), ("conv2d 7x7 c16", 16, 7, 1, 3, 2, False, False),
        ("conv1d 3 c64", 64, 3, 1, 1, 1, False, False), ("conv3d 3 c16", 16, 3, 1, 1, 3, False, False),
        ("conv_transpose2d 3x3 c64", 64, 3, 1, 1, 2, False, True),
    ]
    for benchmark in (False, True):
        torch.backends.cudnn.benchmark = benchmark
        try:
            for label, c, ksize, stride, pad, dims, last, transposed in convs:
                spatial = {1: (64,), 2: (24, 24), 3: (10, 10, 10)}[dims]
                x = with_ties((4, c, *spatial), seed=200 + c + ksize)
                w = torch.zeros(c, c, *([ksize] * dims))
                centre = (slice(None), slice(None), *([ksize // 2] * dims))
                w[centre] = torch.eye(c)
                xd, wd = x.to(DEV), w.to(DEV)
                if last and dims == 2:
                    xd, wd = xd.to(memory_format=torch.channels_last), wd.to(memory_format=torch.channels_last)
                if transposed:
                    got = F.conv_transpose2d(xd, wd, stride=stride, padding=pad)
                else:
                    got = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[dims](xd, wd, stride=stride, padding=pad)
                sync()
                key = f"{label} (cudnn.benchmark={benchmark})"
                out[key] = _verdict(rounding_match(got.contiguous(), x))
                say(f"highest {key:<52} {out[key]}")
        finally:
            torch.backends.cudnn.benchmark = False
    # from how many rows (m) does a GEMM of m x 4096 @ 4096 x 4096 run TF32 at "high"?
    g = torch.Generator().manual_seed(300)
    w = torch.randn(4096, 4096, generator=g).to(DEV) if CUDA else torch.randn(256, 256, generator=g)
    for m in (1, 2, 3, 4, 8, 16):
        x = torch.randn(m, w.shape[0], generator=g).to(DEV)
        for label, fn in (("mm", lambda x: x @ w), ("mm transposed (n rows)", lambda x: w @ x.T),
                          ("linear", lambda x: F.linear(x, w)), ("linear+bias", lambda x: F.linear(x, w, w[0]))):
            got = _at_levels(lambda fn=fn, x=x: fn(x))
            key = f"{label} m={m}"
            out[key] = "tf32" if same_bits(got["high"], got["highest"]) < 1.0 else "same bits as highest"
            say(f"{key:<28} at high: {out[key]}")
    record("kernels", out)


def check_emu_rounding(target: str) -> None:
    """The emulation with ties-to-even operands (what the probes saw) beside the target's own rounding."""
    out = {}
    g = torch.Generator().manual_seed(400)
    cases = [("mm 512x8x512", torch.mm, [torch.randn(512, 8, generator=g), torch.randn(8, 512, generator=g)]),
             ("mm 4096x4096x4096", torch.mm, [torch.randn(n(4096, 128), n(4096, 128), generator=g),
                                              torch.randn(n(4096, 128), n(4096, 128), generator=g)]),
             ("mm 4096x4096x4096 with ties", torch.mm, [with_ties((n(4096, 128),) * 2, 401),
                                                        with_ties((n(4096, 128),) * 2, 402)]),
             ("linear 8x128x768 -> 3072", F.linear, [torch.randn(8, 128, 768, generator=g),
                                                     torch.randn(3072, 768, generator=g),
                                                     torch.randn(3072, generator=g)])]
    for label, fn, inputs in cases:
        out[label] = compare_product(label, fn, inputs, target, levels=("high",), roundings=("rna", "rne"))
    torch.manual_seed(401)
    modules = {"conv3x3 64->128 16x64x56x56": (torch.nn.Conv2d(64, 128, 3, padding=1),
                                               torch.randn(n(16, 2), 64, 56, 56)),
               "conv1x1 256->64 16x256x28x28": (torch.nn.Conv2d(256, 64, 1), torch.randn(n(16, 2), 256, 28, 28)),
               "lstm 2x512 32x64x256": (torch.nn.LSTM(256, 512, num_layers=2, batch_first=True),
                                        torch.randn(n(32, 4), n(64, 8), 256))}
    for label, (module, x) in modules.items():
        module = module.eval()
        with torch.no_grad():
            def run(x, module=module):
                return _first(module.to(device=x.device, dtype=x.dtype)(x))

            out[label] = compare_product(label, run, [x], target, levels=("highest",), roundings=("rna", "rne"))
        module.cpu()
    record("emu_rounding", out)


# -- matmul: the emulator against cuBLAS ------------------------------------------------------------------------
def compare_product(label: str, fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], target: str,
                    levels: tuple[str, ...] = ("highest", "high"),
                    roundings: tuple[str, ...] = ("rna", "rz")) -> dict[str, Any]:
    """fn on the GPU vs fn under emulate(target, rounding=...) on CPU copies (the target's own rounding for
    ``rna``, the default), per level."""
    ref = fn(*[t.double() for t in inputs]).double()
    gpu_in = [t.to(DEV) for t in inputs]
    rows = {}
    for level in levels:
        with tf32lab.precision(level):
            gpu = fn(*gpu_in)
        sync()
        gpu = gpu.float().cpu()
        row = {"gpu_err": normwise(gpu, ref)}
        text = f"{label:<34} {level:<8} gpu err {row['gpu_err']:.3e}"
        for rounding in roundings:
            with tf32lab.precision(level), tf32lab.emulate(target, rounding=rounding) as emu:
                emulated = fn(*inputs)
            tag = f"emu_{rounding}"
            row[f"{tag}_err"] = normwise(emulated, ref)
            row[f"{tag}_same_bits"] = same_bits(gpu, emulated)
            row[f"{tag}_maxdiff"] = maxrel(gpu, emulated)
            row[f"{tag}_normdiff"] = normwise(gpu, emulated)
            row[f"{tag}_coverage"] = {f"{op} {m}": k for (op, m), k in emu.coverage.items()}
            text += (f" | emu({rounding}) err {row[f'{tag}_err']:.3e} same bits {row[f'{tag}_same_bits']:.4f} "
                     f"maxdiff {row[f'{tag}_maxdiff']:.2e} normdiff {row[f'{tag}_normdiff']:.2e}")
        rows[level] = row
        say(text)
    return rows


def check_matmul(target: str) -> None:
    shapes = [(64, 256, 64), (512, 8, 512), (256, 1024, 256), (1024, 1024, 1024), (4096, 4096, 4096),
              (32, 4096, 4096), (8192, 64, 1024)] if CUDA else [(64, 256, 64), (512, 8, 512)]
    out = {}
    for i, (m, k, nn) in enumerate(shapes):
        g = torch.Generator().manual_seed(10 + i)
        a, b = torch.randn(m, k, generator=g), torch.randn(k, nn, generator=g)
        out[f"mm {m}x{k}x{nn}"] = compare_product(f"mm {m}x{k}x{nn}", torch.mm, [a, b], target)
    g = torch.Generator().manual_seed(30)
    a, w, bias = torch.randn(8, 128, 768, generator=g), torch.randn(3072, 768, generator=g), torch.randn(3072,
                                                                                                       generator=g)
    out["linear 8x128x768 -> 3072"] = compare_product("linear 8x128x768 -> 3072", F.linear, [a, w, bias], target)
    q, kk = torch.randn(96, 128, 64, generator=g), torch.randn(96, 64, 128, generator=g)
    out["bmm 96x128x64x128"] = compare_product("bmm 96x128x64x128", torch.bmm, [q, kk], target)
    record("matmul", out)


# -- matvec -----------------------------------------------------------------------------------------------------
def check_matvec() -> None:
    size = n(4096, 256)
    g = torch.Generator().manual_seed(40)
    m, v, y = torch.randn(size, size, generator=g), torch.randn(size, generator=g), torch.randn(size, generator=g)
    ops: dict[str, Callable[..., torch.Tensor]] = {
        "mv": lambda m, v, y: torch.mv(m, v),
        "addmv": lambda m, v, y: torch.addmv(y, m, v),
        "matmul 2d@1d": lambda m, v, y: m @ v,
        "mm 1xK @ KxN": lambda m, v, y: v[None] @ m,
        "linear 1 row": lambda m, v, y: F.linear(v[None], m, y),
        "mm 8xK @ KxN": lambda m, v, y: m[:8] @ m,
        "dot": lambda m, v, y: torch.dot(v, y)[None],
    }
    out = {}
    for name, fn in ops.items():
        ref = fn(m.double(), v.double(), y.double())
        got = {}
        for level in ("highest", "high"):
            with tf32lab.precision(level):
                got[level] = fn(m.to(DEV), v.to(DEV), y.to(DEV))
            sync()
        row = {"err_highest": normwise(got["highest"], ref), "err_high": normwise(got["high"], ref),
               "same_bits_high_vs_highest": same_bits(got["high"], got["highest"])}
        out[name] = row
        say(f"{name:<14} err highest {row['err_highest']:.3e}  high {row['err_high']:.3e}  "
            f"high == highest bitwise: {row['same_bits_high_vs_highest']:.4f}")
    record("matvec", out)


# -- cuDNN convolutions and RNNs ----------------------------------------------------------------------------------
def check_conv_rnn(target: str) -> None:
    out = {}
    torch.manual_seed(50)
    convs = {
        "conv3x3 64->128 16x64x56x56": (torch.nn.Conv2d(64, 128, 3, padding=1), torch.randn(n(16, 2), 64, 56, 56)),
        "conv1x1 256->64 16x256x28x28": (torch.nn.Conv2d(256, 64, 1), torch.randn(n(16, 2), 256, 28, 28)),
        "conv7x7/2 3->64 16x3x224x224": (torch.nn.Conv2d(3, 64, 7, stride=2, padding=3),
                                         torch.randn(n(16, 1), 3, 224, 224)),
    }
    lstm = torch.nn.LSTM(256, 512, num_layers=2, batch_first=True)
    lstm_in = torch.randn(n(32, 4), n(64, 8), 256)
    cases = {**convs, "lstm 2x512 32x64x256": (lstm, lstm_in)}
    for label, (module, x) in cases.items():
        module = module.eval()
        with torch.no_grad():
            ref64 = _first(module.double()(x.double()))
            module.float()
            gpu_mod = module.to(DEV)
            rows = {}
            for allow in (True, False):
                torch.backends.cudnn.allow_tf32 = allow
                try:
                    gpu = _first(gpu_mod(x.to(DEV))).float().cpu()
                finally:
                    torch.backends.cudnn.allow_tf32 = True
                rows[f"gpu cudnn.allow_tf32={allow}"] = gpu
            module.cpu()
            coverage = {}
            for rounding in ("rna", "rz"):
                with tf32lab.emulate(target, rounding=rounding) as emu:
                    rows[f"emu {rounding}"] = _first(module(x))
                coverage.update({f"{op} {m}": k for (op, m), k in emu.coverage.items()})
            row = {name: normwise(t, ref64) for name, t in rows.items()}
            gpu = rows["gpu cudnn.allow_tf32=True"]
            for rounding in ("rna", "rz"):
                row[f"gpu vs emu {rounding} normdiff"] = normwise(gpu, rows[f"emu {rounding}"])
                row[f"gpu vs emu {rounding} same bits"] = same_bits(gpu, rows[f"emu {rounding}"])
            row["coverage"] = coverage
        out[label] = row
        say(f"{label}: " + ", ".join(f"{k} {v:.3e}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    record("conv_rnn", out)


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


# -- SDPA -------------------------------------------------------------------------------------------------------
class _OpNames(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


def check_sdpa(target: str) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(60)
    for (b, h, length, d) in ((8, 12, 128, 32), (4, 16, 512, 64), (2, 8, 256, 128)):
        q, k, v = (torch.randn(b, h, length, d, generator=g) for _ in range(3))
        qd, kd, vd = q.to(DEV), k.to(DEV), v.to(DEV)
        label = f"{b}x{h}x{length}x{d}"
        with _OpNames() as names:
            F.scaled_dot_product_attention(qd, kd, vd)
        chosen = [name for name in names.names if "attention" in name or "bmm" in name or "softmax" in name]
        accepted = {}
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                        SDPBackend.MATH):
            try:
                with sdpa_kernel([backend]):
                    F.scaled_dot_product_attention(qd, kd, vd)
                sync()
                accepted[backend.name] = True
            except RuntimeError as exc:
                accepted[backend.name] = f"refused: {str(exc).splitlines()[0][:120]}"
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
        errs = {}
        for level in ("highest", "high"):
            with tf32lab.precision(level):
                errs[f"gpu default {level}"] = F.scaled_dot_product_attention(qd, kd, vd).cpu()
                if CUDA:
                    with sdpa_kernel([SDPBackend.MATH]):
                        errs[f"gpu math {level}"] = F.scaled_dot_product_attention(qd, kd, vd).cpu()
                    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
                        errs[f"gpu efficient {level}"] = F.scaled_dot_product_attention(qd, kd, vd).cpu()
            with tf32lab.precision(level), tf32lab.emulate(target) as emu:
                errs[f"emu {level}"] = F.scaled_dot_product_attention(q, k, v)
        row: dict[str, Any] = {name: normwise(t, ref) for name, t in errs.items()}
        with tf32lab.emulate(target, math="tf32"):
            row["emu forced plain tf32"] = normwise(F.scaled_dot_product_attention(q, k, v), ref)
        if CUDA:
            eff = errs["gpu efficient highest"]
            row["gpu efficient vs emu normdiff"] = normwise(eff, errs["emu highest"])
            row["gpu efficient vs emu same bits"] = same_bits(eff, errs["emu highest"])
            row["gpu efficient high == highest bits"] = same_bits(errs["gpu efficient high"], eff)
        row["emu coverage"] = {f"{op} {m}": c for (op, m), c in emu.coverage.items()}
        out[label] = {"ops": chosen, "accepted": accepted, **row}
        say(f"SDPA float32 {label}: default ran {chosen}; backends {accepted}")
        say("   " + ", ".join(f"{k} {v:.3e}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    record("sdpa", out)


# -- an all-MiniLM-L6-v2-sized encoder end to end ---------------------------------------------------------------
def minilm_sized(seed: int = 0):
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                        intermediate_size=1536, max_position_embeddings=512)
    return BertModel(config).eval()


def check_encoder(target: str) -> None:
    model = minilm_sized()
    g = torch.Generator().manual_seed(70)
    batch, tokens = n(64, 4), n(32, 16)
    ids = torch.randint(1000, 30000, (batch, tokens), generator=g)
    mask = torch.ones(batch, tokens, dtype=torch.long)
    lengths = torch.randint(tokens // 2, tokens + 1, (batch,), generator=g)
    for i, length in enumerate(lengths.tolist()):
        mask[i, length:] = 0

    def embed(m, ids, mask):
        hidden = m(input_ids=ids, attention_mask=mask).last_hidden_state
        weights = mask[..., None].to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1)  # mean pooling, as sentence-transformers does

    with torch.no_grad():
        ref = embed(model.double(), ids, mask)
        model.float()
        gpu_model = model.to(DEV)
        got = {}
        for level in ("highest", "high"):
            with tf32lab.precision(level):
                got[f"gpu {level}"] = embed(gpu_model, ids.to(DEV), mask.to(DEV)).cpu()
        model.cpu()
        for level in ("highest", "high"):
            with tf32lab.precision(level), tf32lab.emulate(target) as emu:
                got[f"emu {level}"] = embed(model, ids, mask)
            say(f"emulated {level}: coverage {dict(emu.coverage)} unhandled {dict(emu.unhandled)}")
    row: dict[str, Any] = {f"{name} err": normwise(t, ref) for name, t in got.items()}
    for level in ("highest", "high"):
        row[f"{level} gpu vs emu normdiff"] = normwise(got[f"gpu {level}"], got[f"emu {level}"])
        row[f"{level} gpu vs emu maxdiff"] = maxrel(got[f"gpu {level}"], got[f"emu {level}"])
        cos = F.cosine_similarity(got[f"gpu {level}"].double(), ref, dim=1).min()
        row[f"{level} gpu worst-row cosine"] = float(cos)
    say("MiniLM-sized encoder, mean-pooled embeddings: "
        + ", ".join(f"{k} {v:.3e}" for k, v in row.items()))
    record("encoder", row)


# -- solvers and backward formulas --------------------------------------------------------------------------------
def _at_levels(fn: Callable[[], Any]) -> dict[str, Any]:
    out = {}
    for level in ("highest", "high"):
        with tf32lab.precision(level):
            out[level] = fn()
        sync()
    return out


def _solver_row(label: str, fn64: Callable[[], torch.Tensor], fn32: Callable[[], torch.Tensor]) -> dict[str, Any]:
    ref = fn64()
    got = _at_levels(fn32)
    row = {"err_highest": normwise(got["highest"], ref), "err_high": normwise(got["high"], ref),
           "same_bits": same_bits(got["high"], got["highest"])}
    say(f"{label:<26} err highest {row['err_highest']:.3e}  high {row['err_high']:.3e}  "
        f"high == highest bitwise {row['same_bits']:.4f}")
    return row


def check_linalg() -> None:
    size, rhs = n(2048, 128), n(512, 16)
    g = torch.Generator().manual_seed(80)
    upper = torch.triu(torch.randn(size, size, generator=g)) / size ** 0.5 + 2 * torch.eye(size)
    general = torch.randn(size, size, generator=g) / size ** 0.5 + 3 * torch.eye(size)
    b = torch.randn(size, rhs, generator=g)
    tall = torch.randn(2 * size, size // 4, generator=g)
    tall_b = torch.randn(2 * size, rhs, generator=g)
    u, gen, bd, tl, tb = (t.to(DEV) for t in (upper, general, b, tall, tall_b))
    out = {}
    out["solve_triangular"] = _solver_row(
        "solve_triangular", lambda: torch.linalg.solve_triangular(upper.double(), b.double(), upper=True),
        lambda: torch.linalg.solve_triangular(u, bd, upper=True))
    lu, piv = torch.linalg.lu_factor(gen)  # factored once at the process level; lu_solve per level
    sync()
    lu64 = torch.linalg.lu_factor(general.double())[0]
    out["lu_solve"] = _solver_row("lu_solve (getrs)", lambda: torch.linalg.lu_solve(lu.double().cpu(),
                                                                                     piv.cpu(), b.double()),
                                  lambda: torch.linalg.lu_solve(lu, piv, bd))
    out["lu_factor"] = _solver_row("lu_factor (getrf)", lambda: lu64, lambda: torch.linalg.lu_factor(gen)[0])
    out["solve"] = _solver_row("linalg.solve", lambda: torch.linalg.solve(general.double(), b.double()),
                               lambda: torch.linalg.solve(gen, bd))
    out["lstsq"] = _solver_row("lstsq (gels)", lambda: torch.linalg.lstsq(tall.double(), tall_b.double()).solution,
                               lambda: torch.linalg.lstsq(tl, tb).solution)
    out["inv"] = _solver_row("inv", lambda: torch.linalg.inv(general.double()), lambda: torch.linalg.inv(gen))
    spd = (general.double() @ general.double().T).float()  # formed in float64 here, not under a level
    spd_d = spd.to(DEV)
    chol = torch.linalg.cholesky(spd_d)
    sync()
    out["cholesky"] = _solver_row("cholesky (potrf)", lambda: torch.linalg.cholesky(spd.double()),
                                  lambda: torch.linalg.cholesky(spd_d))
    out["cholesky_solve"] = _solver_row("cholesky_solve (potrs)",
                                        lambda: torch.cholesky_solve(b.double(), chol.double().cpu()),
                                        lambda: torch.cholesky_solve(bd, chol))
    out["cholesky_inverse"] = _solver_row("cholesky_inverse", lambda: torch.cholesky_inverse(chol.double().cpu()),
                                          lambda: torch.cholesky_inverse(chol))
    out["qr R"] = _solver_row("qr (geqrf) R", lambda: torch.linalg.qr(tall.double())[1].abs(),
                              lambda: torch.linalg.qr(tl)[1].abs())
    out["eigvalsh"] = _solver_row("eigvalsh (syevd)", lambda: torch.linalg.eigvalsh(spd.double()),
                                  lambda: torch.linalg.eigvalsh(spd_d))
    out["svdvals"] = _solver_row("svdvals (gesvd)", lambda: torch.linalg.svdvals(tall.double()),
                                 lambda: torch.linalg.svdvals(tl))
    out["det"] = _solver_row("det", lambda: torch.linalg.det(general.double())[None],
                             lambda: torch.linalg.det(gen)[None])
    record("solvers", out)
    record("backward", _backward())


def _backward() -> dict[str, Any]:
    size = n(256, 32)
    g = torch.Generator().manual_seed(90)
    square = torch.randn(size, size, generator=g) / size ** 0.5 + 2 * torch.eye(size)
    spd = square @ square.T + torch.eye(size)
    sym = (square + square.T) / 2
    rect = torch.randn(size, size // 2, generator=g)
    rhs = torch.randn(size, 16, generator=g)
    weights = torch.randn(size, size, generator=g)
    w_rect = torch.randn(size // 2, size, generator=g)

    def f_pinv(x):
        return (torch.linalg.pinv(x) * w_rect.to(x)).sum()

    def f_chol(x):
        return (torch.linalg.cholesky(x) * weights.to(x)).sum()

    # elementwise losses only: a matmul in the loss would put its own (TF32) backward into the gradient
    def f_svd(x):
        u, s, vh = torch.linalg.svd(x, full_matrices=False)
        return (u * u * weights[:, : x.shape[1]].to(x)).sum() + (vh * vh * w_rect[:, : vh.shape[1]].to(x)).sum() \
            + (s * weights[0, : s.shape[0]].to(x)).sum()  # squares: the signs of singular vectors drop out

    def f_eigh(x):
        vals, vecs = torch.linalg.eigh(x)
        return (vecs * vecs * weights.to(x)).sum() + (vals * weights[0].to(x)).sum()

    def f_qr(x):
        q, r = torch.linalg.qr(x)
        return (q * weights[:, : q.shape[1]].to(x)).sum() + (r * w_rect[:, : r.shape[1]].to(x)).sum()

    def f_lu(x):
        _, lower, upper = torch.linalg.lu(x)
        return (lower * weights.to(x)).sum() + (upper * weights.T.to(x)).sum()

    def f_solve(x):
        return (torch.linalg.solve(x, rhs.to(x)) * weights[:, :16].to(x)).sum()

    def f_det(x):
        return torch.linalg.det(x[:32, :32])

    def f_inv(x):
        return (torch.linalg.inv(x) * weights.to(x)).sum()

    cases = {"pinv": (f_pinv, rect), "cholesky": (f_chol, spd), "svd": (f_svd, rect), "eigh": (f_eigh, sym),
             "qr": (f_qr, rect), "lu": (f_lu, square), "solve": (f_solve, square), "det": (f_det, square),
             "inv": (f_inv, square)}
    out = {}
    for name, (f, x) in cases.items():
        try:
            x64 = x.double().requires_grad_()
            (ref,) = torch.autograd.grad(f(x64), x64)
            xd = x.to(DEV).requires_grad_()
            loss = f(xd)  # the forward at the process level (highest); only the backward changes level
            grads = {}
            for level in ("highest", "high"):
                tf32lab.set_float32_matmul_precision(level)
                try:
                    (grads[level],) = torch.autograd.grad(loss, xd, retain_graph=True)
                    sync()
                finally:
                    tf32lab.set_float32_matmul_precision("highest")
            row = {"err_highest": normwise(grads["highest"], ref), "err_high": normwise(grads["high"], ref),
                   "same_bits": same_bits(grads["high"], grads["highest"]),
                   "node": type(loss.grad_fn).__name__}
            out[name] = row
            say(f"backward {name:<9} grad err highest {row['err_highest']:.3e}  high {row['err_high']:.3e}  "
                f"high == highest bitwise {row['same_bits']:.4f}")
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
            say(f"backward {name}: FAILED {type(exc).__name__}: {exc}")
    return out


SECTIONS = ("scope", "rounding", "matmul", "matvec", "conv_rnn", "sdpa", "encoder", "linalg", "kernels",
            "emu_rounding")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help="emulated target (default: from the GPU's name, else h100)")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--json", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    name = torch.cuda.get_device_name() if CUDA else "no CUDA device"
    target = args.target or ("h200" if "H200" in name else "a100" if "A100" in name else "h100")
    say(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN "
        f"{torch.backends.cudnn.version() if CUDA else '-'}, device {name}, emulated target {target!r}, "
        f"{torch.get_num_threads()} CPU threads")
    if not CUDA:
        say("no GPU: a smoke test on small sizes, the GPU columns are this CPU's own results")
    record("env", {"torch": torch.__version__, "cuda": torch.version.cuda, "device": name, "target": target})
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    runs: dict[str, Callable[[], None]] = {
        "scope": check_scope, "rounding": check_rounding, "matmul": lambda: check_matmul(target),
        "matvec": check_matvec, "conv_rnn": lambda: check_conv_rnn(target), "sdpa": lambda: check_sdpa(target),
        "encoder": lambda: check_encoder(target), "linalg": check_linalg, "kernels": check_kernels,
        "emu_rounding": lambda: check_emu_rounding(target),
    }
    for name in wanted:
        if name not in runs:
            say(f"unknown section {name!r}; accepted: {', '.join(SECTIONS)}")
            return 2
        section(name, runs[name])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(RESULTS, f, indent=1, default=str)
    say(f"\nfailed sections: {RESULTS.get('failures', [])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
