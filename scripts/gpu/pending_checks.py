"""The GPU checks docs/gpu-results.md lists as still waiting ("Still waiting to be checked"), one section each.

- ``sdpa_split``: is float32 memory-efficient attention 3xTF32 or IEEE? One key (softmax weight exactly 1) makes
  the output ``1 * v``: IEEE gives ``v``'s bits, 3xTF32 ``big(v) + tf32(v - big(v))``, which loses the low bits of
  values whose remainder needs more than TF32's 11 significant bits;
- ``attn_dropout``: which mask attention dropout keeps on CUDA (PyTorch's math path in float64, as the reference
  runs it, the efficient kernel in float32, the emulator's ``native_dropout`` of ones), read off with ``v = I``;
  then the training check of a small BERT with dropout, natively and emulated, on the GPU;
- ``conv_bwd``: the rounding of cuDNN's convolution backward (dgrad, wgrad; 1x1, 3x3, 7x7), read off exactly with
  delta weights and one-hot inputs, and the backward's error with cuDNN's TF32 flag on and off;
- ``depthwise``: depthwise convolutions, NCHW and channels-last, forward and backward, at each level and cuDNN flag;
- ``cudnn_off``: with ``torch.backends.cudnn.enabled = False``, a convolution, an LSTM and a channels-last depthwise
  convolution, forward and backward, at each level and cuDNN flag; and the time of a four-convolution net then
  (CUDA events) against cuDNN's;
- ``affine_grid``, ``affine_grid_bwd``: whether ``F.affine_grid``'s thin product (and its backward) takes TF32 at
  ``high``, and the emulation beside it;
- ``sdpa_bits``: the efficient kernel against the emulation, bit for bit (the one-key probe, random attention);
- ``thin_gemm``: which thin products (small K, small N; ``mm`` and ``bmm``) take TF32 at ``high``;
- ``depthwise_more``, ``depthwise_emu``: channels-last depthwise convolutions of more shapes, and the emulation of
  their forward and gradients beside the GPU's;
- ``emu_cuda``: ``emulate()`` on GPU tensors with a backward (autograd's device thread), and the training check
  emulated on the GPU.

Without a GPU it runs on the CPU on small sizes (a smoke test). Results also go to ``--json``.

    PYTHONPATH=src python3 scripts/gpu/pending_checks.py [--sections sdpa_split,depthwise] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hardware_checks as hw
from hardware_checks import CUDA, DEV, n, normwise, record, same_bits, say, sync

import tf32lab
from tf32lab.numbers import formats

FLAG_CELLS = (("highest", True), ("highest", False), ("high", True), ("high", False))  # (level, cudnn.allow_tf32)


def split3(v: torch.Tensor, mode: str) -> torch.Tensor:
    """``v`` as 3xTF32 carries it through a product with 1: ``big + small``, each rounded to TF32."""
    big = formats.round_tf32(v, mode)
    return big + formats.round_tf32(v - big, mode)


def _bits_of(got: torch.Tensor, candidates: dict[str, torch.Tensor]) -> str:
    shares = {name: same_bits(got, c) for name, c in candidates.items()}
    exact = [k for k, s in shares.items() if s == 1.0]
    return "+".join(exact) if exact else "none (" + " ".join(f"{k} {s:.4f}" for k, s in shares.items()) + ")"


# -- sdpa_split -----------------------------------------------------------------------------------------------------
def check_sdpa_split() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(500)
    for keys in (1, 2):
        q = torch.randn(4, 8, 128, 64, generator=g)
        k = torch.randn(4, 8, 1, 64, generator=g).expand(4, 8, keys, 64).contiguous()  # equal keys: equal weights
        v1 = torch.randn(4, 8, 1, 64, generator=g)
        v = v1.expand(4, 8, keys, 64).contiguous()
        want = v1.expand(4, 8, 128, 64)  # every query's output is v (weights 1, or 1/2 + 1/2)
        cands = {"ieee": want, **{f"3xtf32-{m}": split3(want, m) for m in ("rne", "rna")},
                 **{f"tf32-{m}": formats.round_tf32(want, m) for m in ("rne", "rna")}}
        for level in ("highest", "high"):
            backends = ((SDPBackend.EFFICIENT_ATTENTION, "efficient"), (SDPBackend.MATH, "math")) if CUDA else \
                ((SDPBackend.MATH, "math"),)
            for backend, label in backends:
                with tf32lab.precision(level), sdpa_kernel([backend]):
                    got = F.scaled_dot_product_attention(q.to(DEV), k.to(DEV), v.to(DEV))
                sync()
                key = f"{label} {keys} key(s) {level}"
                out[key] = _bits_of(got.cpu(), cands)
                say(f"sdpa {key:<32} output bits: {out[key]}")
            with tf32lab.precision(level), tf32lab.emulate(hw_target()):
                emu = F.scaled_dot_product_attention(q, k, v)
            out[f"emulated {keys} key(s) {level}"] = _bits_of(emu, cands)
            say(f"sdpa emulated {keys} key(s) {level:<8} output bits: {out[f'emulated {keys} key(s) {level}']}")
    record("sdpa_split", out)


# -- attention dropout ------------------------------------------------------------------------------------------------
def check_attn_dropout() -> None:
    from torch.nn.attention import SDPBackend

    from tf32lab.measure.draws import SameDraws

    out: dict[str, Any] = {}
    p, shape = 0.3, (2, 4, 64, 64)
    g = torch.Generator().manual_seed(510)
    q, k = (torch.randn(shape, generator=g).to(DEV) for _ in range(2))
    eye = torch.eye(64, device=DEV).expand(shape).contiguous()  # v = I: the output is the dropped weights

    def kept(fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        torch.manual_seed(7)
        return fn() != 0

    masks = {
        "native_dropout(ones f32) [emulator]": kept(lambda: torch.native_dropout(
            torch.ones(shape, device=DEV), p, True)[0]),
        "math f64 under SameDraws [reference]": None,
        "math f64 plain": kept(lambda: _sdpa(q.double(), k.double(), eye.double(), p, SDPBackend.MATH)),
        "math f32": kept(lambda: _sdpa(q, k, eye, p, SDPBackend.MATH)),
    }

    def reference() -> torch.Tensor:
        with SameDraws():
            return _sdpa(q.double(), k.double(), eye.double(), p, SDPBackend.MATH)

    masks["math f64 under SameDraws [reference]"] = kept(reference)
    if CUDA:
        masks["efficient f32"] = kept(lambda: _sdpa(q, k, eye, p, SDPBackend.EFFICIENT_ATTENTION))
        try:
            with tf32lab.emulate(hw_target()):
                masks["emulated f32 on cuda"] = kept(lambda: F.scaled_dot_product_attention(q, k, eye, dropout_p=p))
        except Exception as exc:
            out["emulated on cuda"] = f"failed: {type(exc).__name__}: {exc}"
    base = masks["math f64 under SameDraws [reference]"]
    for name, mask in masks.items():
        out[name] = {"kept share": float(mask.double().mean()), "same mask as reference": bool(torch.equal(mask, base))}
        say(f"dropout mask {name:<40} kept {out[name]['kept share']:.3f}  same as the reference: "
            f"{out[name]['same mask as reference']}")
    out["training"] = _bert_dropout_training()
    record("attn_dropout", out)


def _sdpa(q, k, v, p, backend) -> torch.Tensor:
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p)


def _bert_dropout_training() -> dict[str, Any]:
    from transformers import BertConfig, BertModel

    rows: dict[str, Any] = {}
    for attn_p, hidden_p in ((0.1, 0.0), (0.1, 0.1), (0.0, 0.0)):
        torch.manual_seed(0)
        config = BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                            hidden_dropout_prob=hidden_p, attention_probs_dropout_prob=attn_p)
        config._attn_implementation = "sdpa"  # F.scaled_dot_product_attention, its dropout_p in training
        model = BertModel(config, add_pooling_layer=False).to(DEV)

        def batch(step: int):
            gen = torch.Generator().manual_seed(step)
            return (torch.randint(1000, 30000, (n(16, 4), 32), generator=gen).to(DEV),
                    torch.randn(n(16, 4), 128, generator=gen).to(DEV))

        def loss(o, b):
            return (o.last_hidden_state.mean(1) - b[1]).pow(2).mean()

        for target in (("native", hw_target()) if CUDA else (hw_target(),)):
            workload = tf32lab.TrainingWorkload(model, batch, loss=loss, steps=4, inputs=lambda b: {"input_ids": b[0]},
                                                optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                                name=f"bert dropout {attn_p}/{hidden_p}")
            try:
                report = tf32lab.check_training(workload, levels=("highest", "high"), target=target, speed=False)
                floor, high = report.floor, report.level("high")
                row = {"float32 drift": floor.drift, "float32 worst step-1 gradient":
                       floor.gradients[0].normwise if floor.gradients else None,
                       "high drift": high.drift, "high multiple": high.multiple, "passed": bool(report),
                       "failures": [(r.level, r.failed_step, r.failure) for r in (floor, *report.levels)
                                    if r.failure],
                       "math-path note": any("math path" in note for note in report.notes)}
            except Exception as exc:
                row = {"failed": f"{type(exc).__name__}: {str(exc)[:300]}"}
                say(traceback.format_exc())
            key = f"attention dropout {attn_p}, hidden dropout {hidden_p}, target {target}"
            rows[key] = row
            say(f"training {key}: " + ", ".join(f"{k} {v:.3e}" if isinstance(v, float) else f"{k} {v}"
                                              for k, v in row.items()))
    return rows


# -- cuDNN convolution backward ---------------------------------------------------------------------------------------
def check_conv_bwd() -> None:
    out: dict[str, Any] = {}
    c = n(64, 8)
    for ksize in (1, 3, 7):
        pad = ksize // 2
        w = torch.zeros(c, c, ksize, ksize)
        w[:, :, pad, pad] = torch.eye(c)
        # dgrad: y = x (delta weights), so grad_x = grad_y as the kernel rounds it
        x = torch.randn(4, c, 16, 16)
        gy = hw.with_ties((4, c, 16, 16), seed=520 + ksize)
        xd = x.to(DEV).requires_grad_(True)
        y = F.conv2d(xd, w.to(DEV), padding=pad)
        (gx,) = torch.autograd.grad(y, xd, gy.to(DEV))
        sync()
        out[f"dgrad {ksize}x{ksize}"] = hw._verdict(hw.rounding_match(gx, gy))
        # wgrad: one-hot inputs at one pixel, so the weight's centre tap is one operand's values times 1
        onehot = torch.zeros(c, c, 9, 9)
        onehot[torch.arange(c), torch.arange(c), 4, 4] = 1.0
        tied = hw.with_ties((c, c, 9, 9), seed=530 + ksize)
        wd = w.to(DEV).requires_grad_(True)
        y = F.conv2d(onehot.to(DEV), wd, padding=pad)
        (gw,) = torch.autograd.grad(y, wd, tied.to(DEV))
        sync()  # grad_w[o, i, centre] = tied[i, o, 4, 4]
        out[f"wgrad {ksize}x{ksize}, grad_y operand"] = hw._verdict(
            hw.rounding_match(gw[:, :, pad, pad], tied[:, :, 4, 4].T.contiguous()))
        x_tied = torch.zeros(c, c, 9, 9)
        x_tied[:, :, 4, 4] = tied[:, :, 4, 4]
        wd = w.to(DEV).requires_grad_(True)
        y = F.conv2d(x_tied.to(DEV), wd, padding=pad)
        gy1 = torch.zeros(y.shape)
        gy1[torch.arange(c), torch.arange(c), 4, 4] = 1.0
        (gw,) = torch.autograd.grad(y, wd, gy1.to(DEV))
        sync()  # grad_w[o, i, centre] = x_tied[o, i, 4, 4]
        out[f"wgrad {ksize}x{ksize}, input operand"] = hw._verdict(
            hw.rounding_match(gw[:, :, pad, pad], tied[:, :, 4, 4]))
        for key in (f"dgrad {ksize}x{ksize}", f"wgrad {ksize}x{ksize}, grad_y operand",
                    f"wgrad {ksize}x{ksize}, input operand"):
            say(f"highest {key:<34} {out[key]}")
    # errors of the backward against float64, cuDNN's flag on and off
    torch.manual_seed(540)
    conv = nn.Conv2d(c, 2 * c, 3, padding=1)
    x = torch.randn(n(16, 2), c, 32, 32)
    ref = _grads(conv.double(), x.double())
    conv.float()
    for allow in (True, False):
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=allow):
            got = _grads(conv.to(DEV), x.to(DEV))
        conv.cpu()
        row = {name: normwise(t, ref[name]) for name, t in got.items()}
        out[f"3x3 errors, cudnn.allow_tf32={allow}"] = row
        say(f"3x3 conv {c}->{2 * c}, cudnn.allow_tf32={allow}: "
            + ", ".join(f"{k} {v:.2e}" for k, v in row.items()))
    record("conv_bwd", out)


def _grads(module: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Output and the gradients of input and parameters for a fixed upstream gradient, on the CPU."""
    x = x.detach().clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    y = module(x)
    y = y[0] if isinstance(y, tuple) else y
    up = torch.randn(y.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64).to(y.device, y.dtype)
    names = ["input", *(name for name, _ in module.named_parameters())]
    grads = torch.autograd.grad(y, [x, *module.parameters()], up)
    sync()
    return {"output": y.detach().cpu(), **{f"grad {k}": g.cpu() for k, g in zip(names, grads)}}


def _cells(module: nn.Module, x: torch.Tensor, enabled: bool, memory_format=None) -> dict[str, Any]:
    """The module's output and gradients on the GPU in each (level, cudnn.allow_tf32) cell, and which cells give
    the bits of (highest, allow_tf32=False), per tensor."""
    ref = _grads(module.double(), x.double())
    module.float()
    xd, md = x.to(DEV), module.to(DEV)
    if memory_format is not None:
        xd, md = xd.to(memory_format=memory_format), md.to(memory_format=memory_format)
    runs = {}
    for level, allow in FLAG_CELLS:
        with torch.backends.cudnn.flags(enabled=enabled, allow_tf32=allow), tf32lab.precision(level):
            runs[(level, allow)] = _grads(md, xd)
    module.cpu()
    base = runs[("highest", False)]
    row: dict[str, Any] = {}
    for (level, allow), got in runs.items():
        cell = f"{level}/cudnn.allow_tf32={allow}"
        row[cell] = {name: (f"{normwise(t, ref[name]):.2e}" + (" =" if torch.equal(t, base[name]) else " *"))
                     for name, t in got.items()}
    return row


def _show(label: str, row: dict[str, Any]) -> None:
    say(f"{label}  (error vs float64; '=' the bits of highest/allow_tf32=False, '*' other bits)")
    for cell, cols in row.items():
        say(f"    {cell:<32} " + "  ".join(f"{k} {v}" for k, v in cols.items()))


# -- depthwise ---------------------------------------------------------------------------------------------------------
def check_depthwise() -> None:
    out: dict[str, Any] = {}
    torch.manual_seed(550)
    c = n(64, 8)
    cases = [("conv1d depthwise k3 NCL", nn.Conv1d(c, c, 3, padding=1, groups=c), torch.randn(n(16, 2), c, 256), None),
             ("conv2d depthwise 3x3 NCHW", nn.Conv2d(c, c, 3, padding=1, groups=c), torch.randn(n(16, 2), c, 32, 32),
              None),
             ("conv2d depthwise 3x3 channels_last", nn.Conv2d(c, c, 3, padding=1, groups=c),
              torch.randn(n(16, 2), c, 32, 32), torch.channels_last),
             ("conv2d depthwise x2 3x3 NCHW", nn.Conv2d(c, 2 * c, 3, padding=1, groups=c),
              torch.randn(n(16, 2), c, 32, 32), None),
             ("conv3d depthwise 3 NCDHW", nn.Conv3d(c, c, 3, padding=1, groups=c), torch.randn(n(8, 2), c, 12, 12, 12),
              None),
             ("conv3d depthwise 3 channels_last_3d", nn.Conv3d(c, c, 3, padding=1, groups=c),
              torch.randn(n(8, 2), c, 12, 12, 12), torch.channels_last_3d)]
    for label, module, x, fmt in cases:
        out[label] = _cells(module, x, enabled=True, memory_format=fmt)
        _show(label, out[label])
    record("depthwise", out)


# -- cuDNN off ------------------------------------------------------------------------------------------------------
def check_cudnn_off() -> None:
    out: dict[str, Any] = {}
    torch.manual_seed(560)
    c = n(64, 8)
    cases = [("conv2d 3x3", nn.Conv2d(c, 2 * c, 3, padding=1), torch.randn(n(16, 2), c, 32, 32), None),
             ("lstm 1 layer", nn.LSTM(c, 2 * c, batch_first=True), torch.randn(n(8, 2), 20, c), None),
             ("conv2d depthwise 3x3 channels_last", nn.Conv2d(c, c, 3, padding=1, groups=c),
              torch.randn(n(16, 2), c, 32, 32), torch.channels_last)]
    for label, module, x, fmt in cases:
        out[label] = _cells(module, x, enabled=False, memory_format=fmt)
        _show(f"cudnn off: {label}", out[label])
    out["timing"] = _cudnn_off_timing()
    record("cudnn_off", out)


def four_convs() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 64, 7, stride=2, padding=3), nn.ReLU(), nn.Conv2d(64, 128, 3, padding=1),
                         nn.ReLU(), nn.Conv2d(128, 256, 3, padding=1), nn.ReLU(), nn.Conv2d(256, 256, 1)).eval()


def _cudnn_off_timing() -> dict[str, float]:
    """Forward milliseconds of four_convs() on 64 x 3 x 112 x 112 (medians of CUDA-event timings)."""
    torch.manual_seed(570)
    model, x = four_convs().to(DEV), torch.randn(n(64, 2), 3, n(112, 32), n(112, 32), device=DEV)
    cells = {"cudnn on, tf32 flag on, highest": (True, True, "highest"),
             "cudnn on, tf32 flag off, highest": (True, False, "highest"),
             "cudnn off, highest": (False, True, "highest"), "cudnn off, high": (False, True, "high")}
    times: dict[str, float] = {}
    with torch.no_grad():
        for label, (enabled, allow, level) in cells.items():
            with torch.backends.cudnn.flags(enabled=enabled, allow_tf32=allow), tf32lab.precision(level):
                times[label] = _median_ms(lambda: model(x))
            say(f"four convolutions, batch {x.shape[0]}: {label:<34} {times[label]:.3f} ms")
    return times


def _median_ms(fn: Callable[[], Any], rounds: int = 15) -> float:
    for _ in range(3):
        fn()
    sync()
    if not CUDA:
        import time

        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return sorted(ts)[1]
    ts = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end))
    return sorted(ts)[len(ts) // 2]


# -- affine_grid -------------------------------------------------------------------------------------------------------
def check_affine_grid() -> None:
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(580)
    for size in ((n(32, 2), 3, 256, 256), (n(8, 2), 3, 32, 64, 64)):
        theta = torch.randn(size[0], len(size) - 2, len(size) - 1, generator=g)
        for align in (False, True):
            ref = F.affine_grid(theta.double(), list(size), align_corners=align)
            got = hw._at_levels(lambda theta=theta, size=size, align=align: F.affine_grid(
                theta.to(DEV), list(size), align_corners=align).cpu())
            with tf32lab.precision("high"), tf32lab.emulate(hw_target()):
                emu = F.affine_grid(theta, list(size), align_corners=align)
            key = f"{len(size) - 2}-D {tuple(size)} align_corners={align}"
            out[key] = {"err highest": normwise(got["highest"], ref), "err high": normwise(got["high"], ref),
                        "high == highest bits": same_bits(got["high"], got["highest"]),
                        "emulated high err": normwise(emu, ref), "emulated vs gpu high": normwise(emu, got["high"])}
            say(f"affine_grid {key:<44} " + ", ".join(f"{k} {v:.3e}" for k, v in out[key].items()))
    record("affine_grid", out)


# -- follow-ups --------------------------------------------------------------------------------------------------------
def check_sdpa_bits() -> None:
    """The efficient kernel's float32 output against the emulation's, bit for bit, on the one-key probe and on
    random attention (masked and causal too)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(600)
    cases = {"1 key": (4, 8, 128, 1, 64), "random 128": (4, 8, 128, 128, 64), "random 512 d128": (2, 4, 512, 512, 128)}
    for label, (b, h, lq, lk, d) in cases.items():
        q = torch.randn(b, h, lq, d, generator=g)
        k, v = torch.randn(b, h, lk, d, generator=g), torch.randn(b, h, lk, d, generator=g)
        for causal in (False, True) if lk > 1 else (False,):
            for level in ("highest", "high"):
                backend = SDPBackend.EFFICIENT_ATTENTION if CUDA else SDPBackend.MATH
                with tf32lab.precision(level), sdpa_kernel([backend]):
                    got = F.scaled_dot_product_attention(q.to(DEV), k.to(DEV), v.to(DEV), is_causal=causal).cpu()
                with tf32lab.precision(level), tf32lab.emulate(hw_target()):
                    emu = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                key = f"{label} causal={causal} {level}"
                out[key] = {"same bits": same_bits(got, emu), "normdiff": normwise(got, emu)}
                say(f"efficient vs emulated {key:<32} same bits {out[key]['same bits']:.4f} "
                    f"normdiff {out[key]['normdiff']:.2e}")
    record("sdpa_bits", out)


def check_thin_gemm() -> None:
    """Which thin products take TF32 at ``high``: m x k @ k x n for small k and n, mm and bmm, and the aten ops
    F.affine_grid runs here."""
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(610)
    for op in ("mm", "bmm"):
        for k in (1, 2, 3, 4, 8, 16):
            cells = []
            for nn_ in (1, 2, 3, 4, 8, 64):
                a = torch.randn(8, n(65536, 64), k, generator=g).to(DEV)
                b = torch.randn(8, k, nn_, generator=g).to(DEV)
                fn = (lambda a=a, b=b: torch.bmm(a, b)) if op == "bmm" else (lambda a=a, b=b: a[0] @ b[0])
                got = hw._at_levels(fn)
                cells.append("T" if same_bits(got["high"], got["highest"]) < 1.0 else ".")
            out[f"{op} k={k}"] = "".join(cells)
            say(f"{op} m={n(65536, 64)} k={k:<3} n=1,2,3,4,8,64 at high: {' '.join(cells)}  (T: TF32, .: IEEE bits)")
    with hw._OpNames() as names:
        F.affine_grid(torch.randn(2, 2, 3, device=DEV), [2, 3, 16, 16], align_corners=False)
    out["affine_grid ops"] = names.names
    say(f"affine_grid 4-D runs: {names.names}")
    record("thin_gemm", out)


def check_depthwise_more() -> None:
    """Channels-last depthwise convolutions of more shapes: which of output, grad input, grad weight change with
    cuDNN's TF32 flag (at highest)."""
    out: dict[str, Any] = {}
    torch.manual_seed(620)
    shapes = [(2, 32, 3, 1, 56), (2, 256, 3, 1, 14), (2, 64, 5, 1, 28), (2, 64, 7, 1, 28), (2, 64, 3, 2, 28),
              (3, 32, 3, 1, 12), (3, 128, 3, 1, 8), (3, 32, 5, 1, 12)]
    for dims, c, ksize, mult, size in shapes:
        conv = (nn.Conv2d if dims == 2 else nn.Conv3d)(c, c * mult, ksize, padding=ksize // 2, groups=c)
        x = torch.randn(n(16, 2), c, *([size] * dims))
        fmt = torch.channels_last if dims == 2 else torch.channels_last_3d
        for label, f in (("channels_last", fmt), ("contiguous", None)):
            row = _cells(copy.deepcopy(conv), x, enabled=True, memory_format=f)  # .to(channels_last) stays
            on, off = row["highest/cudnn.allow_tf32=True"], row["highest/cudnn.allow_tf32=False"]
            key = f"conv{dims}d depthwise c{c} x{mult} k{ksize} {size}^{dims} {label}"
            out[key] = {name: on[name] for name in on}
            say(f"{key:<52} flag on: " + "  ".join(f"{k} {v}" for k, v in on.items())
                + " | off: " + "  ".join(f"{v}" for v in off.values()))
    record("depthwise_more", out)


def check_depthwise_emu() -> None:
    """Channels-last depthwise convolutions: the GPU's output and gradients (cuDNN's TF32 flag at its default) against
    the emulation at ``highest``, and each against float64."""
    out: dict[str, Any] = {}
    torch.manual_seed(630)
    shapes = [(2, 32, 3, 1, 56), (2, 64, 7, 1, 28), (2, 64, 3, 2, 28), (3, 32, 3, 1, 12), (3, 32, 5, 1, 12)]
    for dims, c, ksize, mult, size in shapes:
        conv = (nn.Conv2d if dims == 2 else nn.Conv3d)(c, c * mult, ksize, padding=ksize // 2, groups=c)
        x = torch.randn(n(16, 2), c, *([size] * dims))
        fmt = torch.channels_last if dims == 2 else torch.channels_last_3d
        ref = _grads(copy.deepcopy(conv).double().to(memory_format=fmt), x.double().to(memory_format=fmt))
        gpu_conv = copy.deepcopy(conv).to(DEV).to(memory_format=fmt)
        with tf32lab.precision("highest"):
            gpu = _grads(gpu_conv, x.to(DEV).to(memory_format=fmt))
        cpu_conv = copy.deepcopy(conv).to(memory_format=fmt)
        with tf32lab.precision("highest"), tf32lab.emulate(hw_target()) as emu:
            emulated = _grads(cpu_conv, x.to(memory_format=fmt))
        key = f"conv{dims}d depthwise c{c} x{mult} k{ksize} {size}^{dims}"
        out[key] = {name: {"gpu err": normwise(gpu[name], ref[name]), "emu err": normwise(emulated[name], ref[name]),
                           "gpu vs emu": normwise(gpu[name], emulated[name])} for name in gpu}
        out[key]["coverage"] = {f"{op} {m}": k for (op, m), k in emu.coverage.items()}
        say(f"{key:<36} " + "  ".join(f"{name}: gpu {v['gpu err']:.1e} emu {v['emu err']:.1e}"
                                      for name, v in out[key].items() if name != "coverage")
            + f"  coverage {out[key]['coverage']}")
    record("depthwise_emu", out)


def check_emu_cuda() -> None:
    """emulate() on CUDA tensors with a backward: where the training check's emulated rows failed on the GPU."""
    out: dict[str, Any] = {}
    torch.manual_seed(640)

    def mlp():
        net = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 1)).to(DEV)
        x = torch.randn(32, 64, device=DEV)
        net(x).pow(2).mean().backward()

    def attention():
        q = torch.randn(2, 4, 16, 8, device=DEV, requires_grad=True)
        F.scaled_dot_product_attention(q, q, q).sum().backward()

    def attention_dropout():
        q = torch.randn(2, 4, 16, 8, device=DEV, requires_grad=True)
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.1).sum().backward()

    def bert():
        from transformers import BertConfig, BertModel

        config = BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128)
        config._attn_implementation = "sdpa"
        model = BertModel(config, add_pooling_layer=False).to(DEV)
        ids = torch.randint(1000, 2000, (4, 16), device=DEV)
        model(input_ids=ids).last_hidden_state.mean().backward()

    for label, fn in (("mlp", mlp), ("sdpa", attention), ("sdpa dropout", attention_dropout), ("bert", bert)):
        try:
            with tf32lab.precision("high"), tf32lab.emulate(hw_target()) as emu:
                fn()
            sync()
            out[label] = {"ok": True, "coverage": {f"{op} {m}": k for (op, m), k in emu.coverage.items()}}
        except Exception as exc:
            out[label] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            say(traceback.format_exc())
        say(f"emulate on cuda, {label}: {'ok' if out[label]['ok'] else out[label]['error']}")
    # the backward's GEMMs emulated on the GPU as on the CPU (target a100: RNA operands, which the H200's own TF32
    # does not give), against the GPU's native backward at the same level
    torch.manual_seed(641)
    net = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
    x = torch.randn(64, 256)
    grads, coverage = {}, {}
    for label, device, emulated in (("gpu emulated", DEV, True), ("cpu emulated", "cpu", True),
                                    ("gpu native", DEV, False), ("cpu native", "cpu", False)):
        model = copy.deepcopy(net).to(device)
        with tf32lab.precision("high"), (tf32lab.emulate("a100") if emulated else contextlib.nullcontext()) as emu:
            y = model(x.to(device))
            grads[f"{label} output"] = y.detach().cpu()
            y.pow(2).sum().backward()
        coverage[label] = dict(emu.coverage) if emulated else None
        for name, p in model.named_parameters():
            grads[f"{label} {name}"] = p.grad.cpu()
    row = {}
    for name in ["output", *(key for key, _ in net.named_parameters())]:
        row[name] = {"gpu emu vs cpu emu": normwise(grads[f"gpu emulated {name}"], grads[f"cpu emulated {name}"]),
                     "gpu native vs cpu native": normwise(grads[f"gpu native {name}"], grads[f"cpu native {name}"]),
                     "gpu emu vs gpu native": normwise(grads[f"gpu emulated {name}"], grads[f"gpu native {name}"])}
    out["mlp backward"] = {"per tensor": row, "coverage": {k: str(v) for k, v in coverage.items()}}
    for name, r in row.items():
        say(f"mlp at high, emulated a100, {name:<10} " + "  ".join(f"{k} {v:.2e}" for k, v in r.items()))
    say(f"coverage gpu {coverage['gpu emulated']}\ncoverage cpu {coverage['cpu emulated']}")

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention, self.head = nn.MultiheadAttention(64, 4, batch_first=True), nn.Linear(64, 1)

        def forward(self, x):
            return self.head(self.attention(x, x, x, need_weights=False)[0])

    class Bert(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            from transformers import BertConfig, BertModel

            config = BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128)
            config._attn_implementation = "sdpa"
            self.bert, self.head = BertModel(config, add_pooling_layer=False), nn.Linear(64, 1)

        def forward(self, x):
            return self.head(self.bert(inputs_embeds=x).last_hidden_state)

    import tf32lab.measure.training as training_module

    told = training_module.described

    def described(exc):  # the training check keeps a row's exception as a line: print where it came from
        say("".join(traceback.format_exception(exc)))
        return told(exc)

    training_module.described = described
    data = [(torch.randn(4, 8, 64, device=DEV), torch.randn(4, 8, 1, device=DEV)) for _ in range(3)]
    for label, model in (("mlp", nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 1))),
                         ("attention", Attn()), ("bert", Bert())):
        workload = tf32lab.TrainingWorkload(model.to(DEV), data, loss=lambda o, b: (o - b[1]).pow(2).mean(),
                                            inputs=lambda b: b[0], name=label)
        try:
            report = tf32lab.check_training(workload, levels=("high",), target=hw_target(), speed=False)
            out[f"training {label}"] = [(r.level, r.failed_step, r.failure) for r in (report.floor, *report.levels)]
        except Exception as exc:
            out[f"training {label}"] = f"{type(exc).__name__}: {exc}"
            say(traceback.format_exc())
        say(f"emulated training check on cuda, {label}: {out[f'training {label}']}")
    training_module.described = told
    record("emu_cuda", out)


def check_affine_grid_bwd() -> None:
    """``F.affine_grid``'s backward (theta's gradient: a product over every grid point) at both levels."""
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(650)
    for size in ((n(32, 2), 3, 256, 256), (n(8, 2), 3, 32, 64, 64)):
        theta = torch.randn(size[0], len(size) - 2, len(size) - 1, generator=g)
        up = torch.randn(size[0], *size[2:], len(size) - 2, generator=g)

        def grad_of(t: torch.Tensor, grid_up: torch.Tensor, size=size) -> torch.Tensor:
            t = t.detach().requires_grad_(True)
            return torch.autograd.grad(F.affine_grid(t, list(size), align_corners=False), t, grid_up)[0]

        ref = grad_of(theta.double(), up.double())
        got = hw._at_levels(lambda theta=theta, up=up, grad_of=grad_of: grad_of(theta.to(DEV), up.to(DEV)).cpu())
        with tf32lab.precision("high"), tf32lab.emulate(hw_target()):
            emu = grad_of(theta, up)
        key = f"{len(size) - 2}-D {tuple(size)}"
        out[key] = {"err highest": normwise(got["highest"], ref), "err high": normwise(got["high"], ref),
                    "high == highest bits": same_bits(got["high"], got["highest"]),
                    "emulated high err": normwise(emu, ref)}
        say(f"affine_grid backward {key:<28} " + ", ".join(f"{k} {v:.3e}" for k, v in out[key].items()))
    record("affine_grid_bwd", out)


def hw_target() -> str:
    name = torch.cuda.get_device_name() if CUDA else ""
    return "h200" if "H200" in name else "a100" if "A100" in name else "h100"


SECTIONS: dict[str, Callable[[], None]] = {
    "sdpa_split": check_sdpa_split, "attn_dropout": check_attn_dropout, "conv_bwd": check_conv_bwd,
    "depthwise": check_depthwise, "cudnn_off": check_cudnn_off, "affine_grid": check_affine_grid,
    "sdpa_bits": check_sdpa_bits, "thin_gemm": check_thin_gemm, "depthwise_more": check_depthwise_more,
    "depthwise_emu": check_depthwise_emu, "emu_cuda": check_emu_cuda,
    "affine_grid_bwd": check_affine_grid_bwd}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    name = torch.cuda.get_device_name() if CUDA else "no CUDA device"
    say(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN "
        f"{torch.backends.cudnn.version() if CUDA else '-'}, device {name}, emulated target {hw_target()!r}")
    if not CUDA:
        say("no GPU: a smoke test on small sizes, the GPU columns are this CPU's own results")
    record("env", {"torch": torch.__version__, "cuda": torch.version.cuda, "device": name})
    for section in (s.strip() for s in args.sections.split(",") if s.strip()):
        if section not in SECTIONS:
            say(f"unknown section {section!r}; accepted: {', '.join(SECTIONS)}")
            return 2
        hw.section(section, SECTIONS[section])
        if args.json:
            Path(args.json).write_text(json.dumps(hw.RESULTS, indent=1, default=str))
    say(f"\nfailed sections: {hw.RESULTS.get('failures', [])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
