"""Bit-exact number formats: how a float32 becomes TF32, bf16 or fp16.

Pure functions: a float32 tensor in, a new float32 tensor out holding the rounded values; the input is never
touched, any shape, stride or device works, and no global state is read. Rounding follows IEEE 754 exactly:
NaN stays NaN whatever its payload, ±Inf stay, ±0 keep their sign, subnormals round on their own grid, and a
finite value overflows to Inf exactly when the rounding mode says so.

The rounding modes (PTX ISA ``cvt.rna.tf32.f32``; CUTLASS ``round_half_ulp_truncate``):

- ``"rna"``: to nearest, ties away from zero: what CUTLASS applies to TF32 operands, and cuBLAS on an RTX 3090
  (pytorch#53635; unmeasured on other Ampere and Ada GPUs);
- ``"rne"``: to nearest, ties to even: what ``tensor.to(torch.bfloat16)`` does, and what cuBLAS applies to TF32
  operands on an H100 (measured, docs/gpu-results.md);
- ``"rz"``: toward zero (truncation): what the raw tensor-core ``mma`` instruction does to TF32 operands.

Example:

    >>> import torch
    >>> from tf32lab import formats
    >>> x = torch.tensor([1024.5, 1.0 + 2**-12, -3.0])
    >>> formats.round_tf32(x).tolist()                  # ties away: 1024.5 -> 1025 (as on an RTX 3090)
    [1025.0, 1.0, -3.0]
    >>> formats.round_tf32(x, rounding="rne").tolist()  # ties to even: 1024.5 -> 1024
    [1024.0, 1.0, -3.0]
    >>> hi, lo = formats.split_bf16x3(torch.tensor([1 / 3]))
    >>> bool(torch.equal(hi + lo, formats.round_bf16(hi + lo)))  # hi + lo keeps more bits than hi alone
    False
"""

from __future__ import annotations

import math
import reprlib
import sys
from types import ModuleType
from typing import Callable, Optional

import torch

from tf32lab.numbers import compiled

__all__ = [
    "ROUNDINGS",
    "load_compiled",
    "round_bf16",
    "round_fp16",
    "round_tf32",
    "split_bf16x3",
    "split_bf16x9",
    "split_tf32x3",
]

ROUNDINGS = ("rna", "rne", "rz")

# Mantissa bits dropped from float32's 23 to reach each format.
_TF32_DROP = 13
_BF16_DROP = 16
MANTISSA_DROP = {"tf32": _TF32_DROP, "bf16": _BF16_DROP}  # the same, by format name


def _check_input(x: torch.Tensor, fn: str, out: Optional[torch.Tensor] = None) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn} takes a float32 torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise TypeError(f"{fn} takes a float32 tensor, got dtype {x.dtype}; convert with x.float() first")
    if out is not None and (out.dtype != torch.float32 or out.shape != x.shape or out.device != x.device):
        raise ValueError(
            f"{fn}: out= must be a float32 tensor of shape {tuple(x.shape)} on {x.device}, got "
            f"{out.dtype} {tuple(out.shape)} on {out.device}")


def _check_parts(x: torch.Tensor, fn: str, out: Optional[tuple[torch.Tensor, ...]], count: int) -> torch.Tensor:
    """``x`` checked with each of the ``count`` tensors of ``out``; detached, and copied first where a part
    shares its memory (``out=(x, ...)``: the parts are computed from ``x`` after the first one is written)."""
    _check_input(x, fn)
    if out is None:
        return x.detach()
    if not isinstance(out, (tuple, list)) or len(out) != count or \
            not all(isinstance(part, torch.Tensor) for part in out):
        raise ValueError(f"{fn}: out= must be {count} float32 tensors, got {reprlib.repr(out)}")
    for i, part in enumerate(out):
        _check_input(x, fn, part)
        if any(part.data_ptr() == other.data_ptr() and part.numel() for other in out[:i]):
            raise ValueError(f"{fn}: out= parts {i} and an earlier one are the same memory; give each its own")
    x = x.detach()
    return x.clone() if any(_overlap(x, part) for part in out) else x


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``t`` may touch: [first, last)."""
    if t.numel() == 0:
        return 0, 0
    start, last = t.data_ptr(), 1
    for n, st in zip(t.shape, t.stride()):
        last += (n - 1) * st
    return start, start + last * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` may share memory (their byte ranges meet; views that interleave count too)."""
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def _check_rounding(rounding: str, fn: str) -> None:
    if rounding not in ROUNDINGS:
        raise ValueError(f"{fn}: unknown rounding {rounding!r}; accepted: {', '.join(map(repr, ROUNDINGS))}")


def _round_bits(u: torch.Tensor, out: torch.Tensor, drop: int, rounding: str) -> None:
    """Write ``u`` (float32 bits as int32) rounded to ``23 - drop`` mantissa bits into ``out``.

    Adding the rounding bias to the whole bit pattern lets a carry ripple from the mantissa into the exponent,
    which is exactly right for normal numbers, subnormals (the encoding is linear there) and overflow to Inf.
    Only NaN can be mangled; the caller restores it.
    """
    mask = -(1 << drop)  # int32 0xFFFF...E000: clears the dropped bits
    if rounding == "rz":
        torch.bitwise_and(u, mask, out=out)
        return
    half = 1 << (drop - 1)
    if rounding == "rna":
        torch.add(u, half, out=out)
    elif out.data_ptr() != u.data_ptr():  # rne: bias half - 1, plus 1 when the lowest kept bit is odd
        # built in ``out`` itself: a fresh temporary would cost page faults (2.6x slower on 64 MiB)
        torch.bitwise_right_shift(u, drop, out=out).bitwise_and_(1).add_(u).add_(half - 1)
    else:  # in place: the odd bit must be read before ``u`` is overwritten
        odd = torch.bitwise_right_shift(u, drop).bitwise_and_(1)
        torch.add(u, odd, out=out).add_(half - 1)
    out.bitwise_and_(mask)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """``x``'s bits as an int32 view. Inside inference mode torch 2.4 cannot view a view of a normal tensor
    ("Cannot set version_counter for inference tensor"); outside it, any view of it is fine."""
    if x.is_inference() or not torch.is_inference_mode_enabled():
        return x.view(torch.int32)
    with torch.inference_mode(False):
        return x.view(torch.int32)


# Elements from which the compiled kernel rounds a tensor (where numba is installed): below, the tensor code's
# passes cost little more than the call into the kernel.
COMPILED_FROM = 1 << 14
# Loading the kernel (numba's import and its cached code: ~0.6 s here) pays for itself only in a long run: it
# saves ~0.35 ns per element (benchmarks/formats.py). So the tensor code rounds until it has spent about what the
# load costs, as many elements as this, and the kernel takes over then, or at once where numba is already loaded
# (``emulate(accumulation="hardware")``, or the user's own numba).
COMPILE_AFTER = 1 << 30
_tensor_rounded = [0]  # elements the tensor code rounded in large tensors (a race loses counts, harmlessly)


def load_compiled() -> bool:
    """Load the compiled rounding kernel now rather than when a run has shown itself long (``COMPILE_AFTER``):
    for a process that will round a lot (a benchmark, a long ``tune``). True where numba is installed.

    >>> isinstance(load_compiled(), bool)
    True
    """
    return compiled.kernels("rounding_kernels") is not None


def _kernels(count: int = 0) -> Optional[ModuleType]:
    """The compiled kernels if loaded or worth loading now (``count`` more elements to round), else None."""
    if "numba" in sys.modules or _tensor_rounded[0] >= COMPILE_AFTER:  # numba is loaded with the kernels
        return compiled.kernels("rounding_kernels")
    _tensor_rounded[0] += count
    return None


def _strided(x: torch.Tensor, *outs: torch.Tensor) -> Optional[tuple]:
    """For the compiled kernels: ``(src, strides, shape, out_strides, *outs)``, ``x``'s bits as a flat int32 array
    that the 4-D ``shape`` indexes with ``strides``, the row strides of the outputs (alike) in that shape's first
    three dims, and each of ``outs`` as a flat array from its first element. The dims are ordered as the outputs
    lie in memory and merged where ``x`` and the outputs allow, so that a permuted view (attention's heads) is
    read in place, row by row; the outputs' rows are dense, with gaps between them allowed (the two halves of a
    concatenated operand). None where the kernels do not apply: numba missing, a small tensor, one off the CPU,
    outputs that overlap themselves, each other or ``x`` (an output that is ``x`` itself, rounded in place,
    excepted), or an ``x`` that needs more than four dims."""
    first, numel = outs[0], x.numel()
    if (numel < max(COMPILED_FROM, 1) or x.device.type != "cpu" or any(o.device.type != "cpu" for o in outs)
            or any(o.stride() != first.stride() for o in outs)):
        return None
    if x.is_contiguous() and first.is_contiguous():  # the common case, a weight or an activation: flat, at once
        size = numel * 4
        spans = [(t.data_ptr(), t.data_ptr() + size) for t in (x, *outs)]
        if any(a0 < b1 and b0 < a1 and not (i == 0 and a0 == b0) for i, (a0, a1) in enumerate(spans)
               for b0, b1 in spans[i + 1:]) or _kernels(x.numel()) is None:
            return None
        return (_bits(x).numpy().reshape(-1), (0, 0, 0, 1), (1, 1, 1, x.numel()), (0, 0, 0),
                *(_bits(o).numpy().reshape(-1) for o in outs))
    size, stride, out = x.shape, x.stride(), first.stride()
    if any(_overlap(x, o) and (o.data_ptr() != x.data_ptr() or out != stride) for o in outs):
        return None
    shape: list[int] = []
    strides: list[int] = []
    out_strides: list[int] = []
    for d in sorted(range(len(size)), key=lambda d: -out[d]):
        n, st, ot = size[d], stride[d], out[d]
        if n == 1:
            continue
        if shape and strides[-1] == st * n and out_strides[-1] == ot * n:
            shape[-1], strides[-1], out_strides[-1] = shape[-1] * n, st, ot
        else:
            shape.append(n)
            strides.append(st)
            out_strides.append(ot)
    if not shape:  # one value
        shape, strides, out_strides = [1], [1], [1]
    # rows dense in the outputs, each dim's stride past the dims inside it (no output overlaps itself)
    if len(shape) > 4 or out_strides[-1] != 1 or any(
            out_strides[j] < out_strides[j + 1] * shape[j + 1] for j in range(len(shape) - 1)) \
            or not _apart(outs, shape, out_strides) or _kernels(numel) is None:
        return None
    pad = 4 - len(shape)
    span = 1 + sum((n - 1) * st for n, st in zip(shape, strides))
    out_span = (1 + sum((n - 1) * st for n, st in zip(shape, out_strides)),)
    src = _bits(x.as_strided((span,), (1,))).numpy()
    return (src, (0,) * pad + tuple(strides), (1,) * pad + tuple(shape), ((0,) * pad + tuple(out_strides))[:3],
            *(_bits(o.as_strided(out_span, (1,))).numpy() for o in outs))


def _apart(outs: tuple[torch.Tensor, ...], sizes: list[int], strides: list[int]) -> bool:
    """Whether float32 outputs laid out alike (``sizes`` at ``strides``, elements, each stride past the dims
    inside it) share no element: the gap between any two is no difference of two of their indices."""
    for i, o in enumerate(outs):
        for p in outs[i + 1:]:
            gap = p.data_ptr() - o.data_ptr()
            if (_meets(gap // 4, sizes, strides) if gap % 4 == 0 else _overlap(o, p)):
                return False
    return True


def _meets(delta: int, sizes: list[int], strides: list[int]) -> bool:
    """Whether ``delta = Σ d_j strides_j`` for some ``|d_j| < sizes_j``: of the outermost dim's ``d``, at most two
    leave what the inner dims can reach (its stride is past their span), so this looks at most 2^dims ways."""
    if len(sizes) == 1:  # the rows: dense
        return abs(delta) < sizes[0]
    n, step = sizes[0], strides[0]
    reach = sum((m - 1) * st for m, st in zip(sizes[1:], strides[1:]))
    lo, hi = max(-(n - 1), -((reach - delta) // step)), min(n - 1, (delta + reach) // step)
    return any(_meets(delta - d * step, sizes[1:], strides[1:]) for d in range(lo, hi + 1))


def _round(x: torch.Tensor, drop: int, rounding: str, out: Optional[torch.Tensor] = None,
           default_nans: bool = False) -> torch.Tensor:
    x = x.detach()
    out = torch.empty_like(x) if out is None else out
    strided = _strided(x, out)
    if strided is not None:  # one pass, NaNs kept on the way
        src, strides, shape, out_strides, dst = strided
        _kernels().round_bits(src, strides, shape, dst, drop, rounding, out_strides)
        return out
    # A NaN needs mending only where one went in (its payload may sit in the dropped bits, or carry into the
    # sign). On the CPU one read-only pass tells: a sum is finite only if no NaN is in it; otherwise (and on
    # devices, where asking would synchronise) the fix-up runs, from a copy when the result overwrites the input.
    # ``default_nans``: the caller knows every NaN in x is the default one a CPU's arithmetic makes (x86:
    # 0xffc00000, Arm: 0x7fc00000), which every rounding keeps a NaN. GPUs make 0x7fffffff: always mended there.
    mend = x.device.type != "cpu" or (not default_nans and not math.isfinite(x.sum().item()))
    source = x.clone() if mend and out.data_ptr() == x.data_ptr() else x
    _round_bits(_bits(x), out.view(torch.int32), drop, rounding)
    if mend:
        torch.where(torch.isnan(source), source, out, out=out)
    return out


def hot_rounder(name: str, rounding: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``fn(x, out)``: ``x`` rounded to ``name`` ("tf32" or "bf16") into ``out``, with no checks, for a loop that
    rounds many small tensors it made itself (an RNN's hidden states): ``x`` and ``out`` float32 of one shape on
    the CPU, every NaN in ``x`` the default one (see ``round_tf32``'s ``default_nans``)."""
    on_bits = hot_bits_rounder(name, rounding)

    def fn(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        on_bits(_bits(x), out.view(torch.int32))
        return out

    return fn


def hot_bits_rounder(name: str, rounding: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``fn(u, bits)``: :func:`hot_rounder` on int32 views made once by the caller (``u`` the float32 values'
    bits, ``bits`` the output's), for a loop whose per-call views cost as much as the rounding (an LSTM's steps).

    Example:

        >>> x = torch.tensor([1.0 + 2.0 ** -11])
        >>> out = torch.empty_like(x)
        >>> _ = hot_bits_rounder("tf32", "rna")(x.view(torch.int32), out.view(torch.int32))
        >>> out.item() == 1.0 + 2.0 ** -10
        True
    """
    drop = MANTISSA_DROP[name]
    _check_rounding(rounding, f"round_{name}")
    # ``_round_bits``'s arithmetic with 0-dim tensors: a Python number is made a tensor at every call, which
    # doubled the cost of rounding an LSTM's 8 x 256 hidden state
    mask, half, below, one, shift = (torch.tensor(v, dtype=torch.int32)
                                     for v in (-(1 << drop), 1 << (drop - 1), (1 << (drop - 1)) - 1, 1, drop))

    def fn(u: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
        if rounding == "rz":
            return torch.bitwise_and(u, mask, out=bits)
        if rounding == "rna":
            torch.add(u, half, out=bits)
        elif bits.data_ptr() != u.data_ptr():  # rne, as ``_round_bits``
            torch.bitwise_right_shift(u, shift, out=bits).bitwise_and_(one).add_(u).add_(below)
        else:
            odd = torch.bitwise_right_shift(u, shift).bitwise_and_(one)
            torch.add(u, odd, out=bits).add_(below)
        return bits.bitwise_and_(mask)

    return fn


def round_tf32(x: torch.Tensor, rounding: str = "rna", *, out: Optional[torch.Tensor] = None,
               default_nans: bool = False) -> torch.Tensor:
    """Round float32 values to TF32 (1 sign, 8 exponent, 10 mantissa bits), returned as float32.

    ``rounding`` is ``"rna"`` (default: CUTLASS, and cuBLAS on Ampere), ``"rne"`` (cuBLAS on Hopper) or ``"rz"``
    (the ``mma`` instruction). The target decides which one an emulated op gets (``tf32lab.know.targets``).
    ``out``: a float32 tensor of the same shape to write into (it may be ``x`` itself), returned.
    ``default_nans=True`` skips the scan for NaNs with payloads: only when ``x`` was computed from NaN-free
    operands (any NaN in it is then the default one, which rounding keeps).

    Example:

        >>> import torch
        >>> from tf32lab.numbers.formats import round_tf32
        >>> round_tf32(torch.tensor([1.0 + 2**-11, 1.0 + 3 * 2**-11]), rounding="rz").tolist()
        [1.0, 1.0009765625]
    """
    _check_input(x, "round_tf32", out)
    _check_rounding(rounding, "round_tf32")
    return _round(x, _TF32_DROP, rounding, out, default_nans)


def round_bf16(x: torch.Tensor, rounding: str = "rne", *, out: Optional[torch.Tensor] = None,
               default_nans: bool = False) -> torch.Tensor:
    """Round float32 values to bfloat16 (8 mantissa bits), returned as float32.

    ``rounding="rne"`` (default) equals ``x.to(torch.bfloat16).float()``; ``"rna"`` and ``"rz"`` are offered too.
    ``out``: a float32 tensor of the same shape to write into, returned. ``default_nans``: as for ``round_tf32``.

    Example:

        >>> import torch
        >>> from tf32lab.numbers.formats import round_bf16
        >>> round_bf16(torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8])).tolist()   # two ties, both to even
        [1.0, 1.015625]
    """
    _check_input(x, "round_bf16", out)
    _check_rounding(rounding, "round_bf16")
    if rounding == "rne":
        # torch's own conversion is RNE with NaN kept, and one fused pass each way.
        half = x.detach().to(torch.bfloat16)
        return half.to(torch.float32) if out is None else out.copy_(half)
    return _round(x, _BF16_DROP, rounding, out, default_nans)


def round_fp16(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values to IEEE half precision (round to nearest even), returned as float32.

    Values beyond the half-precision range overflow to ±Inf as RNE says (from 65520 up); tiny values land
    on fp16's subnormal grid (multiples of 2**-24) or on ±0.

    Example:

        >>> import torch
        >>> from tf32lab.numbers.formats import round_fp16
        >>> round_fp16(torch.tensor([65504.0, 65519.0, 65520.0, 2.0**-25])).tolist()
        [65504.0, 65504.0, inf, 0.0]
    """
    _check_input(x, "round_fp16")
    return x.detach().to(torch.float16).to(torch.float32)


def split_bf16x3(x: torch.Tensor, *, out: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                 summed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Split float32 values into ``(hi, lo)`` bf16 parts for bf16x3 products (Henry et al. 2019, arXiv:1904.06376).

    ``hi = bf16(x)`` and ``lo = bf16(x - hi)``, both RNE, the difference taken in float32 (it is exact for every
    finite ``x`` whose ``hi`` is finite). ``x·y ≈ hi·hi' + hi·lo' + lo·hi'`` keeps about 16 mantissa bits.
    As in the kernels, an infinite ``x`` gives a NaN ``lo``. ``out``: two float32 tensors to write into.
    ``summed``: the second part is ``hi + lo`` (in float32) instead, for a product written as two GEMMs,
    ``hi·(hi' + lo') + lo·hi'``.

    Example:

        >>> import torch
        >>> from tf32lab.numbers.formats import split_bf16x3
        >>> hi, lo = split_bf16x3(torch.tensor([1.0 + 2**-10]))
        >>> hi.item(), lo.item()
        (1.0, 0.0009765625)
    """
    x = _check_parts(x, "split_bf16x3", out, 2)
    hi, lo = out if out is not None else (None, None)
    hi = round_bf16(x, out=hi)
    lo = torch.sub(x, hi) if lo is None else torch.sub(x, hi, out=lo)
    lo = round_bf16(lo, out=lo)
    return hi, (lo.add_(hi) if summed else lo)


def split_bf16x9(x: torch.Tensor, *, out: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split float32 values into three bf16 parts ``(hi, mid, lo)`` for BF16x9 products (cuBLAS
    ``CUBLAS_COMPUTE_32F_EMULATED_16BFX9``, PyTorch's ``cuda.matmul.fp32_precision = "bfx9"``, pytorch#195301).

    Each part is the RNE bf16 of what the earlier parts left, the differences exact in float32; three parts of 8
    significant bits hold all 24 of a float32, so ``hi + mid + lo == x`` for every ``|x| >= 2**-110`` (below, the
    last part falls into bf16's subnormals and loses bits). The nine products ``hi·hi' ... lo·lo'`` are exact in
    float32. A value whose RNE bf16 would overflow (``|x| >= 3.3961776e38``) gets its ``hi`` toward zero instead;
    an infinite or NaN ``x`` is all in ``hi`` (``mid`` and ``lo`` 0), so special values reach the products as they
    are. ``out``: three float32 tensors.

    Example:

        >>> import torch
        >>> from tf32lab.numbers.formats import split_bf16x9
        >>> x = torch.tensor([1 / 3])
        >>> hi, mid, lo = split_bf16x9(x)
        >>> bool((hi + mid + lo == x).all()), bool((hi + mid == x).all())
        (True, False)
        >>> [p.item() for p in split_bf16x9(torch.tensor([float("inf")]))]
        [inf, 0.0, 0.0]
    """
    x = _check_parts(x, "split_bf16x9", out, 3)
    hi, mid, lo = out if out is not None else (None, None, None)
    hi = round_bf16(x, out=hi)
    special = ~torch.isfinite(hi)
    if bool(special.any()):
        finite = torch.isfinite(x)
        # an overflow: toward zero; inf and NaN: x itself
        hi.copy_(torch.where(special & finite, round_bf16(x, "rz"), torch.where(finite, hi, x)))
        special = ~finite
    mid = torch.sub(x, hi) if mid is None else torch.sub(x, hi, out=mid)
    mid.masked_fill_(special, 0.0)  # (x - hi of an infinite x is NaN)
    mid = round_bf16(mid, out=mid)
    lo = torch.sub(x, hi) if lo is None else torch.sub(x, hi, out=lo)
    lo.masked_fill_(special, 0.0).sub_(mid)
    return hi, mid, round_bf16(lo, out=lo)


def split_tf32x3(x: torch.Tensor, *, out: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                 summed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Split float32 values into ``(big, small)`` TF32 parts for 3xTF32 products (CUTLASS ``mma_tensor_op_fast_f32.h``).

    As CUTLASS's ``mma_tensor_op_fast_f32``: ``big = truncate(x)`` (rz) and ``small = rna(x - big)``, the
    difference exact in float32. An infinite ``x`` gives a NaN ``small``. ``out``: two float32 tensors to write
    into. ``summed``: the second part is ``big + small`` (in float32) instead, for a product written as two
    GEMMs, ``big·(big' + small') + small·big'``.

    Example:

        >>> import torch
        >>> from tf32lab.numbers.formats import split_tf32x3
        >>> big, small = split_tf32x3(torch.tensor([1.0 + 2**-11 + 2**-20]))
        >>> big.item(), small.item()
        (1.0, 0.0004892349243164062)
        >>> split_tf32x3(torch.tensor([1.0 + 2**-11 + 2**-20]), summed=True)[1].item()
        1.0004892349243164
    """
    x = _check_parts(x, "split_tf32x3", out, 2)
    big, small = out if out is not None else (torch.empty_like(x), torch.empty_like(x))
    strided = _strided(x, big, small)
    if strided is not None and _kernels().split_tf32x3(*strided[:3], *strided[4:], summed=summed,
                                                       out_strides=strided[3]):
        return big, small
    if x.device.type == "cpu" and math.isfinite(x.sum().item()):
        # No NaN or Inf in x, so none in big or x - big: one check instead of one per rounding.
        _round_bits(_bits(x), big.view(torch.int32), _TF32_DROP, "rz")
        torch.sub(x, big, out=small)
        _round_bits(small.view(torch.int32), small.view(torch.int32), _TF32_DROP, "rna")
    else:
        big = _round(x, _TF32_DROP, "rz", big)
        torch.sub(x, big, out=small)
        small = _round(small, _TF32_DROP, "rna", small)
    return big, (small.add_(big) if summed else small)
