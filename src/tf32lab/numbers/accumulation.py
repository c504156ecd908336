"""Accumulation models: how a GPU's matrix unit sums the products of one output, bit for bit.

Pure functions of their operands (no torch flags, no global state). An :class:`Accumulation` describes one
instruction family; :func:`gemm` chains it along K as a GEMM kernel without split-K does: the output starts at
zero (or ``c``) and each step fuses the next ``chunk`` products into it.

The models (MMA-Sim, Xie et al., arXiv:2511.10909, whose published algorithms these reproduce; Fasi, Higham,
Mikaitis and Pranesh, PeerJ CS 7:e330, 2021, for the NVIDIA truncation):

- ``"nvidia"``: one fused step adds ``chunk`` exact products and the accumulator. Every term is aligned to the
  largest exponent among them (a product's exponent is the sum of its operands', its significand in [1, 4)) and
  truncated toward zero to ``fraction_bits`` bits below it; the truncated terms are summed exactly and the sum is
  rounded toward zero to float32 (NaN and Inf as in IEEE float32; a sum at or above 2^128 is Inf; a zero, exact
  or rounded, is +0, as MMA-Sim's integer sum gives it).
  ``fraction_bits``: 24 on Ampere and Ada, 25 on Hopper and Blackwell; ``chunk``: 4 for TF32 on Ampere and Ada
  (the ``m16n8k8`` instruction runs as two fused halves), 8 on Hopper (``wgmma ... k8``) and Blackwell.
- ``"amd"``: CDNA3 (MI300) ``v_mfma_f32_*_xf32``: groups of 4 products aligned to their own largest exponent and
  truncated to 24 fraction bits, summed; that sum floored to 31 fraction bits and the accumulator floored to 24,
  both below the larger of the two exponents; the total rounded to nearest even in float32.
- ``"fma"``: no tensor core: one float32 fused multiply-add per product, in order along K, as an SGEMM thread
  sums its output (the float64 emulation of the FMA rounds twice, which differs from one rounding in about one
  case in 2^29).

Operands are taken as given: round them first (TF32 operands are what the instruction sees; it truncates any
further bits, which :func:`gemm` does not). Everything is computed exactly on any CPU: in float64 tensors, or by
compiled kernels where numba is installed (``pip install tf32lab[fast]``; ``nvidia`` and ``fma`` kinds: float64,
or 32-bit lanes where every product and aligned sum provably fits them, ``accumulation_kernels``); all give the
same bits.

Example:

    >>> import torch
    >>> from tf32lab.numbers import accumulation
    >>> a, b, c = torch.tensor([[2048.0, 2048.0]]), torch.tensor([[2048.0], [-2048.0]]), torch.tensor([[-1e-6]])
    >>> accumulation.gemm(a, b, accumulation.CDNA3_XF32, c=c).item()   # MMA-Sim section VI-C: c floored
    -0.25
    >>> accumulation.gemm(a, b, accumulation.HOPPER, c=c).item()       # truncated toward zero
    0.0
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Optional

import torch

from tf32lab.numbers.accumulation_models import AMPERE, BLACKWELL, CDNA3_XF32, FMA, HOPPER, KINDS, Accumulation
from tf32lab.numbers.compiled import kernels as load_kernels
from tf32lab.numbers.compiled import torch_threads

__all__ = ["AMPERE", "BLACKWELL", "CDNA3_XF32", "FMA", "HOPPER", "KINDS", "Accumulation", "compiled", "gemm"]

_F32, _F64 = torch.float32, torch.float64
_TWO_128 = 2.0 ** 128


def _exponent(x: torch.Tensor) -> torch.Tensor:
    """MMA-Sim's exponent of float32 values: floor(log2|x|), -126 for zero and subnormals, 128 for Inf/NaN."""
    return ((x.view(torch.int32) >> 23) & 0xFF).clamp_(min=1) - 127


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2.0**e in float64 for integer tensors with -1022 <= e <= 1023, exactly (built from the bits)."""
    return ((e.to(torch.int64) + 1023) << 52).view(_F64)


def _rz_f32(s: torch.Tensor) -> torch.Tensor:
    """float64 -> float32 rounded toward zero (subnormals on their grid; at or above 2^128: Inf)."""
    r = s.to(_F32)
    over = r.to(_F64).abs() > s.abs()  # rounded away from zero: step back one ulp (the bits count magnitudes)
    r.view(torch.int32).sub_(over.to(torch.int32))
    return torch.where(s.abs() >= _TWO_128, s.to(_F32), r)


def _nvidia_step(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ea: torch.Tensor, eb: torch.Tensor,
                 bits: int) -> torch.Tensor:
    # a: (..., M, c, 1) float64, b: (..., 1, c, N) float64, ea/eb: their exponents; acc: (..., M, N) float32
    emax = torch.maximum((ea + eb).amax(dim=-2), _exponent(acc))
    scale = _pow2(bits - emax)  # one unit of the aligned sum is 2^(emax - bits)
    units = (a * b).mul_(scale.unsqueeze(-2)).trunc_().sum(dim=-2)
    units += (acc.to(_F64) * scale).trunc_()
    return _rz_f32(units / scale).add_(0.0)  # a zero is +0: the aligned sum is an integer (MMA-Sim)


def _amd_step(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ea: torch.Tensor, eb: torch.Tensor,
              bits: int) -> torch.Tensor:
    ep = (ea + eb).amax(dim=-2)  # the products' own alignment, the accumulator left out
    units = (a * b).mul_(_pow2(bits - ep).unsqueeze(-2)).trunc_().sum(dim=-2)  # in 2^(ep - bits)
    emax = torch.maximum(ep, _exponent(acc))
    products = (units * _pow2(31 - bits + ep - emax)).floor_()  # in 2^(emax - 31)
    own = (acc.to(_F64) * _pow2(24 - emax)).floor_()  # in 2^(emax - 24)
    return (products * _pow2(emax - 31) + own * _pow2(emax - 24)).add_(0.0).to(_F32)  # an exact zero is +0


def _fma_chain(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    acc = acc.to(_F64)
    for k in range(a.size(-1)):
        acc = acc.add_(a[..., :, k, None] * b[..., None, k, :]).to(_F32).to(_F64)
    return acc.to(_F32)


def _kernels() -> Optional[ModuleType]:
    return load_kernels("accumulation_kernels")


def compiled() -> bool:
    """Whether :func:`gemm` has its compiled kernels (numba installed).

    >>> isinstance(compiled(), bool)
    True
    """
    return _kernels() is not None


def _work_split(batch: int, m: int, n: int, widest: int = 512) -> tuple[int, int]:
    """Columns and rows of one work item of the compiled kernels: wide (each pass over a row slice has a fixed
    cost; up to ``widest`` columns, half that beyond), and enough items to share among the threads."""
    import numba

    tile = n if n <= widest else widest // 2
    items = batch * -(-n // tile)
    want = 4 * numba.get_num_threads()
    band = m if items >= want else max(1, -(-m * items // want))
    return tile, band


_NORMAL_FROM = 1 << 18  # products in a GEMM from which the check for the faster kernel pays


def _exponent_of_smallest(x: torch.Tensor) -> float:
    """MMA-Sim's exponent (floor(log2|v|), at least -126) of the smallest nonzero |v| in ``x``; +inf if none."""
    magnitude = x.abs()
    smallest = float(torch.where(magnitude > 0, magnitude, math.inf).amin()) if x.numel() else math.inf
    return max(math.floor(math.log2(smallest)), -126) if 0 < smallest < math.inf else math.inf


def _stays_normal(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, fraction_bits: int) -> bool:
    """Whether every partial sum of ``c + a @ b`` as an "nvidia" unit with ``fraction_bits`` computes it is a normal
    float32 or zero, so that the compiled kernel may skip the subnormal and overflow cases (float32 operands).

    A step's sum is a whole number of units of 2^(emax - fraction_bits); while a nonzero product has exponent
    emax or less and at least -126 + fraction_bits, a nonzero sum is at least 2^-126, and a step whose products
    are all zero truncates a normal accumulator on a grid that holds 2^-126. Nothing overflows while
    max|c| + K max|a| max|b| < 2^127 (truncation only shrinks). No Inf or NaN anywhere, no subnormal in ``c``.

    >>> import torch
    >>> _stays_normal(torch.ones(2, 3), torch.ones(3, 2), torch.zeros(2, 2), 24)
    True
    >>> _stays_normal(torch.full((2, 3), 1e-20), torch.ones(3, 2), torch.zeros(2, 2), 24)   # products near 2^-66
    True
    >>> _stays_normal(torch.full((2, 3), 1e-20), torch.full((3, 2), 1e-20), torch.zeros(2, 2), 24)  # ~2^-133
    False
    """
    if min(a.numel(), b.numel()) == 0:
        return False
    largest = float(a.abs().amax()) * float(b.abs().amax()) * a.size(-1) + (float(c.abs().amax()) if c.numel() else 0.0)
    if not largest < 2.0**127:  # overflow possible, or an Inf or NaN somewhere
        return False
    subnormal_c = bool(((c != 0) & (c.abs() < 2.0**-126)).any()) if c.numel() else False
    return not subnormal_c and _exponent_of_smallest(a) + _exponent_of_smallest(b) >= -126 + fraction_bits


def _short(x: torch.Tensor) -> bool:
    """Whether each value in the first row of ``x`` has at most 12 significant bits (TF32 and bf16 values have 11
    and 8): a glance, not a proof (the 32-bit kernel checks every value itself), that spares unrounded operands
    the copies that kernel needs."""
    row = x[(0,) * (x.dim() - 1)][:256]
    return not bool((row.view(torch.int32) & 0xFFF).any())


def _gemm_compiled(kernels: ModuleType, a: torch.Tensor, b: torch.Tensor, acc: Optional[torch.Tensor],
                   shape: tuple[int, ...], model: Accumulation) -> torch.Tensor:
    short = model.kind == "nvidia" and _short(a) and _short(b)  # before the batch is broadcast
    batch = shape[:-2]
    a = a.expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b = b.expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    m, n = shape[-2:]
    if short:  # the 32-bit kernel, where it applies (it checks the rest itself); no c: zeros, not read
        tile, band = _work_split(a.size(0), m, n, widest=2048)
        c = torch.empty(0, 0, 0, dtype=_F32).numpy() if acc is None else acc.reshape(-1, m, n).numpy()
        res, fitted = kernels.nvidia_gemm_narrow(a.contiguous().numpy(), b.contiguous().numpy(), c, model.chunk,
                                                 model.fraction_bits, tile, band)
        if fitted:
            return torch.from_numpy(res).reshape(shape)
    c = (torch.zeros(shape, dtype=_F32) if acc is None else acc).reshape(-1, m, n).contiguous()
    if model.kind == "fma":
        a64, b64 = a.to(_F64).contiguous().numpy(), b.to(_F64).contiguous().numpy()
        res = kernels.fma_gemm(a64, b64, c.numpy(), min(n, 256))
    else:
        tile, band = _work_split(c.size(0), m, n)
        # the check reads every operand a few times: worth it only where the products outnumber the reads
        normal = c.numel() * a.size(-1) >= _NORMAL_FROM and _stays_normal(a, b, c, model.fraction_bits)
        # float32 operands as they are, strides included: the kernel reads them once
        res = kernels.nvidia_gemm(a.numpy(), b.numpy(), c.numpy(), model.chunk, model.fraction_bits, tile, band,
                                  normal)
    return torch.from_numpy(res).reshape(shape)


def gemm(a: torch.Tensor, b: torch.Tensor, model: Accumulation, c: Optional[torch.Tensor] = None,
         block: int = 1 << 21, use_compiled: Optional[bool] = None) -> torch.Tensor:
    """``c + a @ b`` (``c`` defaults to zeros) as ``model``'s unit computes it, K in order, no split-K.

    ``a``: (..., M, K), ``b``: (..., K, N) float32, batch dims broadcast; K is padded with zeros to a whole
    number of steps. ``block`` caps the products held at once (columns of the output are done in slices);
    ``use_compiled``: the numba kernels (None: where installed and the kind has one).

    >>> import torch
    >>> x = torch.full((1, 4096), 1.0 + 2**-10)     # each product 1 + 2^-9 + 2^-20: exact sum 4104.00390625
    >>> gemm(x, x.T, AMPERE).item(), gemm(x, x.T, FMA).item()   # same-sign terms: truncation drops the 2^-20s
    (4104.0, 4104.00048828125)
    """
    if a.dtype != _F32 or b.dtype != _F32:
        raise TypeError(f"gemm takes float32 operands, got {a.dtype} and {b.dtype}")
    if a.dim() < 2 or b.dim() < 2 or a.size(-1) != b.size(-2):
        raise ValueError(f"gemm takes (..., M, K) and (..., K, N) operands, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    m, k, n = a.size(-2), a.size(-1), b.size(-1)
    a, b = a.detach().cpu(), b.detach().cpu()
    shape = (*batch, m, n)
    acc = None
    if c is not None:  # broadcast to the product's shape, as addmm's input is
        try:
            acc = torch.broadcast_to(c.detach().cpu().to(_F32), shape).contiguous()
        except RuntimeError:
            raise ValueError(f"gemm's c of shape {tuple(c.shape)} does not broadcast to the product's "
                             f"{tuple(shape)}") from None
    if k == 0 or math.prod(shape) == 0:
        return torch.zeros(shape, dtype=_F32) if acc is None else acc
    step = model.chunk
    pad = -k % step
    if pad:
        a = torch.nn.functional.pad(a, (0, pad))
        b = torch.nn.functional.pad(b, (0, 0, 0, pad))
    kernels = _kernels() if use_compiled is not False and model.kind in ("nvidia", "fma") else None
    if use_compiled and kernels is None:
        raise RuntimeError(f"no compiled kernel for {model}: " + (
            "install numba (pip install tf32lab[fast])" if model.kind in ("nvidia", "fma") else
            f"the {model.kind!r} kind has none; use_compiled=None computes it with the tensor code"))
    if kernels is not None:
        with torch_threads():
            return _gemm_compiled(kernels, a, b, acc, shape, model)
    acc = torch.zeros(shape, dtype=_F32) if acc is None else acc
    a64, b64 = a.to(_F64), b.to(_F64)
    ea, eb = _exponent(a), _exponent(b)
    cols = max(1, block // max(1, m * step * max(1, batch.numel())))
    out = torch.empty_like(acc)
    for j0 in range(0, n, cols):
        j1 = min(n, j0 + cols)
        part = acc[..., j0:j1]
        if model.kind == "fma":
            part = _fma_chain(part, a64, b64[..., j0:j1])
        else:
            fused = _nvidia_step if model.kind == "nvidia" else _amd_step
            for k0 in range(0, k + pad, step):
                k1 = k0 + step
                part = fused(part, a64[..., :, k0:k1, None], b64[..., None, k0:k1, j0:j1],
                             ea[..., :, k0:k1, None], eb[..., None, k0:k1, j0:j1], model.fraction_bits)
        out[..., j0:j1] = part
    return out
