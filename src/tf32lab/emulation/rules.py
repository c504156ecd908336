"""The emulator's op table: one rule per aten op (or group of ops) of the precision-sensitive families.

A rule gets ``(call, func, args, kwargs)`` and returns what ``func`` would, computed with ``call.product(key,
...)``, which applies the math the target assigns to ``key``. Rules run with native GEMMs forced to IEEE, so the
only reduced precision in a result is the one emulated. ``RULES`` is filled only by ``@rule``; it refuses an op
registered twice. Composite ops without a rule (``matmul``, ``einsum``, ``tensordot``, ``conv2d``, ``cdist`` in
inference mode) decompose into these; see ``tf32lab.emulation.emulator``.

The RNNs are re-expressed here in their GEMMs and pointwise steps, following PyTorch's own kernels, because their
GEMMs run inside one native kernel that a dispatch mode cannot see into; attention, multi-head attention and the
transformer encoder layer's fast path likewise, in ``tf32lab.emulation.attention_rules`` (registered here too, by
``@rule``).
"""

from __future__ import annotations

import contextlib
import math as _pymath
import threading
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from tf32lab.emulation import attention_rules, recurrent  # noqa: F401 (attention_rules: its rules into RULES)
from tf32lab.emulation.registry import RULES, aten, gemm_key, linear_product, op_arg, plain_gemm, rule
from tf32lab.emulation.rnn_steps import run_packed_rnn, run_rnn
from tf32lab.errors import Tf32LabError
from tf32lab.know.targets import CUDNN_CELL, IEEE, rnn_key

__all__ = ["RNN_FUNCTIONS", "RULES", "as_family", "forced_family", "no_tf32", "rnn_function", "rule",
           "scripted_rnns", "tf32_is_off"]


class _OpContext(threading.local):
    """What the op running now in this thread is part of (class attributes are the defaults)."""

    family: Optional[str] = None  # a family forced on matmul ops: an RNN's GEMMs are the rnn family's
    no_tf32 = False  # PyTorch's NoTF32Guard is on: cuBLAS computes IEEE


_local = _OpContext()


@contextlib.contextmanager
def _setting(name: str, value: Any):
    before = getattr(_local, name)
    setattr(_local, name, value)
    try:
        yield
    finally:
        setattr(_local, name, before)


def as_family(family: str) -> contextlib.AbstractContextManager:
    """Ops of the matmul family run inside count as ``family`` (an RNN's GEMMs run in cuDNN's RNN kernel)."""
    return _setting("family", family)


def no_tf32() -> contextlib.AbstractContextManager:
    """GEMMs inside run IEEE on CUDA targets, as PyTorch's ``NoTF32Guard`` makes them (``optable``'s ``no_tf32``)."""
    return _setting("no_tf32", True)


def forced_family() -> Optional[str]:
    """The family :func:`as_family` forces on matmul ops of this thread now, if any."""
    return _local.family


def tf32_is_off() -> bool:
    """Whether :func:`no_tf32` is in force in this thread."""
    return _local.no_tf32


# -- matmul and matvec ---------------------------------------------------------------------------------------
@rule(aten.mm, aten.bmm)
def _mm(call, func, args, kwargs):
    a, b = args[0], args[1]
    return call.product(gemm_key(a.size(-2), b.size(-1), a.size(-1)), lambda x, y: func(x, y), a, b, as_gemm=plain_gemm)


def _gemm_epilogue(c: torch.Tensor, beta: Any, alpha: Any) -> Callable:
    """A GEMM kernel's epilogue after the summed product: alpha * AB + beta * C (beta=0 ignores C)."""
    def as_gemm(gemm: Callable, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        p = gemm(a, b)
        if alpha != 1:
            p = p * alpha
        if beta == 0:
            return p
        return p + (c if beta == 1 else c * beta)

    return as_gemm


@rule(aten.mv, aten.dot, aten.vdot)
def _mv(call, func, args, kwargs):
    return call.product("matvec", lambda a, b: func(a, b), args[0], args[1])


def _scaled_sum(default, key: str):
    # out-of-place: beta * C + alpha * product; ``bare`` keeps only the product (beta=0 also ignores NaN in C)
    def fn(call, func, args, kwargs):
        c, a, b = args[:3]
        beta = kwargs.get("beta", args[3] if len(args) > 3 else 1)
        alpha = kwargs.get("alpha", args[4] if len(args) > 4 else 1)
        of = gemm_key(a.size(-2), b.size(-1), a.size(-1)) if key == "matmul" else key
        gemm = default in (aten.addmm.default, aten.baddbmm.default)  # one GEMM (addbmm sums a batch of them)
        result = call.product(of, lambda x, y: default(c, x, y, beta=beta, alpha=alpha), a, b,
                              bare=lambda x, y: default(c, x, y, beta=0, alpha=alpha),
                              as_gemm=_gemm_epilogue(c, beta, alpha) if gemm else None)
        if func.overloadpacket.__name__.endswith("_"):  # addmm_ and friends write into C
            return c.copy_(result)
        return result

    return fn


rule(aten.addmm, aten.addmm_)(_scaled_sum(aten.addmm.default, "matmul"))
rule(aten.baddbmm, aten.baddbmm_)(_scaled_sum(aten.baddbmm.default, "matmul"))
rule(aten.addbmm, aten.addbmm_)(_scaled_sum(aten.addbmm.default, "matmul"))
rule(aten.addmv, aten.addmv_)(_scaled_sum(aten.addmv.default, "matvec"))
rule(aten.addr, aten.addr_)(_scaled_sum(aten.addr.default, "matvec"))  # an outer product: no GEMM on a GPU


@rule(aten._addmm_activation)
def _addmm_activation(call, func, args, kwargs):
    c, a, b = args[:3]
    beta = kwargs.get("beta", args[3] if len(args) > 3 else 1)
    alpha = kwargs.get("alpha", args[4] if len(args) > 4 else 1)
    use_gelu = kwargs.get("use_gelu", args[5] if len(args) > 5 else False)
    pre = call.product(gemm_key(a.size(-2), b.size(-1), a.size(-1)),
                       lambda x, y: aten.addmm.default(c, x, y, beta=beta, alpha=alpha), a, b,
                       bare=lambda x, y: aten.addmm.default(c, x, y, beta=0, alpha=alpha))
    return F.gelu(pre) if use_gelu else F.relu(pre)


@rule(aten.linear)
def _linear_rule(call, func, args, kwargs):
    return linear_product(call, "matmul", args[0], args[1], kwargs.get("bias", args[2] if len(args) > 2 else None))


def _euclidean(call, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    # PyTorch's _euclidean_dist: one GEMM of padded operands, |x|^2 + |y|^2 - 2 x.y; the norms are operands too
    x1_norm = x1.pow(2).sum(-1, keepdim=True)
    x2_norm = x2.pow(2).sum(-1, keepdim=True)
    x1_ = torch.cat([x1.mul(-2), x1_norm, torch.ones_like(x1_norm)], -1)
    x2_ = torch.cat([x2, torch.ones_like(x2_norm), x2_norm], -1)
    return call.product("matmul", torch.matmul, x1_, x2_.mT).clamp_min_(0).sqrt_()


@rule(aten._euclidean_dist)
def _euclidean_dist(call, func, args, kwargs):
    return _euclidean(call, args[0], args[1])


@rule(aten._cdist_forward)
def _cdist_forward(call, func, args, kwargs):
    x1, x2, p = args[:3]
    mode = args[3] if len(args) > 3 else kwargs.get("compute_mode")
    # Same choice as PyTorch's cdist_impl: p=2 uses a GEMM when asked to, or by default past 25 rows.
    if p == 2 and (mode == 1 or (mode in (None, 0) and (x1.size(-2) > 25 or x2.size(-2) > 25))):
        return _euclidean(call, x1, x2)
    call.math("linalg")  # a direct kernel, no GEMM: IEEE on every target
    return func(*args, **kwargs)


@rule(aten._cdist_backward)
def _cdist_backward(call, func, args, kwargs):
    call.math("linalg")  # computed directly from the distances, no GEMM
    return func(*args, **kwargs)


def _base_line(theta: torch.Tensor, steps: int, align_corners: bool) -> torch.Tensor:
    """ATen's ``linspace_from_neg_one`` (AffineGridGenerator.cpp): the grid's coordinates along one dim."""
    if steps <= 1:
        return theta.new_zeros(())
    line = torch.linspace(-1, 1, steps, dtype=theta.dtype, device=theta.device)
    return line if align_corners else line * (steps - 1) / steps


@rule(aten.affine_grid_generator)
def _affine_grid_generator(call, func, args, kwargs):
    """``F.affine_grid``: ATen builds the base grid (x, y[, z], 1 at each point) and multiplies it by theta's
    transpose in one ``bmm`` (aten/src/ATen/native/AffineGridGenerator.cpp), a cuBLAS GEMM on a GPU; the op has
    no CompositeImplicitAutograd kernel, so a dispatch mode never sees that ``bmm``."""
    theta, size = args[0], list(op_arg(args, kwargs, 1, "size"))
    align_corners = bool(op_arg(args, kwargs, 2, "align_corners"))
    dims = len(size) - 2
    if dims not in (2, 3) or theta.dim() != 3 or list(theta.shape) != [size[0], dims, dims + 1]:
        return func(*args, **kwargs)  # PyTorch's own error for a bad size or theta
    spatial = size[2:]
    base = theta.new_empty(size[0], *spatial, dims + 1)
    for i, steps in enumerate(reversed(spatial)):  # x along the last spatial dim (W), then y (H), z (D)
        base.select(-1, i).copy_(_base_line(theta, steps, align_corners).reshape(-1, *[1] * i))
    base.select(-1, dims).fill_(1)
    flat = base.view(size[0], -1, dims + 1)
    # a thin product (K = 3 or 4, N = 2 or 3) that cuBLAS runs without TF32 at 'high', as a one-column one: the
    # same bits at both levels on an H200 (docs/gpu-results.md)
    grid = call.product("matmul.gemv", torch.bmm, flat, theta.transpose(1, 2), as_gemm=plain_gemm)
    return grid.view(*size[:1], *spatial, dims)


_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _keep_dims(x: torch.Tensor, y: torch.Tensor, dims: list[int]) -> torch.Tensor:
    """Σ over ``dims`` of x·y (broadcast elsewhere), the summed dims kept as size 1: one batched GEMM."""
    sub = _LETTERS[:x.dim()]
    out = torch.einsum(f"{sub},{sub}->{''.join(c for d, c in enumerate(sub) if d not in dims)}", x, y)
    for d in sorted(dims):
        out = out.unsqueeze(d)
    return out


def _sumproduct(call, left: torch.Tensor, right: torch.Tensor, dims: list[int]) -> torch.Tensor:
    # PyTorch's sumproduct_pair: no summed dim is a plain product; a dim that only one side has is summed first;
    # the rest is one bmm (cuBLAS: the matmul math), whatever its length.
    if not dims:
        return left * right
    contracted = []
    for d in dims:
        in_left, in_right = left.size(d) != 1, right.size(d) != 1
        if in_left and in_right:
            contracted.append(d)
        elif in_left:
            left = left.sum(d, keepdim=True)
        elif in_right:
            right = right.sum(d, keepdim=True)
    return call.product("matmul", lambda x, y: _keep_dims(x, y, contracted), left, right)


@rule(aten._trilinear)
def _trilinear(call, func, args, kwargs):
    """nn.Bilinear's op: two pairwise products (i1·i2, then ·i3), as PyTorch's kernel computes them."""
    i1, i2, i3, expand1, expand2, expand3, sumdim = args[:7]
    unroll = op_arg(args, kwargs, 7, "unroll_dim", 1)
    total = i1.dim() + len(expand1)

    def spread(t, dims):
        for d in sorted(d % total for d in dims):
            t = t.unsqueeze(d)
        return t

    sumdim = sorted(d % total for d in sumdim)
    without3 = {d % total for d in expand3}
    first = [d for d in sumdim if d in without3 and d != unroll]  # i3 lacks them: summed with i1·i2
    second = [d for d in sumdim if d not in without3 and d != unroll]
    out = _sumproduct(call, _sumproduct(call, spread(i1, expand1), spread(i2, expand2), first), spread(i3, expand3),
                      second)
    if unroll in sumdim:  # the kernel adds its per-slice results: a plain float32 sum
        out = out.sum(unroll, keepdim=True)
    for d in reversed(sumdim):
        out = out.squeeze(d)
    return out


@rule(aten.conv_tbc)
def _conv_tbc(call, func, args, kwargs):
    """(time, batch, channels) convolution: one cuBLAS GEMM per kernel tap on a GPU, so the matmul math (not
    cuDNN's); computed as one convolution of the rounded operands."""
    x, w, bias = args[:3]
    pad = op_arg(args, kwargs, 3, "pad", 0)
    _native_conv_is_ieee(call, x)

    def full(a, b):
        return F.conv1d(a.permute(1, 2, 0), b.permute(2, 1, 0), None, padding=pad).permute(2, 0, 1)

    return call.product("matmul", full, x, w) + bias


# -- solvers: triangular solves by cuBLAS trsm ---------------------------------------------------------------
# On a GPU, solve_triangular, lu_solve, linalg.solve, inv and lstsq reach cuBLAS trsm under PyTorch's handle, which
# follows the matmul flag (measured on an H100: TF32 at 'high'); the factorizations (getrf, geqrf) do not. trsm is
# blocked: each diagonal block is solved on its own, the rest of the right-hand side updated by a GEMM, and only
# those GEMMs use TF32. Emulated the same way, with the GEMMs in the math of ``linalg.trsm``. An approximation:
# cuBLAS's block sizes and order are its own; 256 rows per block fits the H100 (the last 256 of 2048 rows, and 256
# of lstsq's 512, came out bit-identical at both levels), and on the inputs measured there the emulation's error
# against float64 equals the H100's to two digits for all five (docs/gpu-results.md). Factorizations run natively
# (IEEE), as on the GPU.
_TRSM_BLOCK = 256


def _one_block(a: torch.Tensor) -> bool:
    """Whether every trsm on ``a``'s factors is one block: no GEMM update, so the native solver's own result."""
    return a.size(-1) <= _TRSM_BLOCK


def _native_solve(call, a: torch.Tensor, info: Optional[torch.Tensor] = None) -> bool:
    """Whether the solver's native result is the target's: ``linalg.trsm``'s math IEEE there, ``a``'s trsm one block
    (no GEMM update: IEEE whatever the math), or the factorization failed (``info`` nonzero, a singular matrix:
    PyTorch's own result and info; read last, as reading it waits for a GPU). Counted as computed then: IEEE, not
    the math its updates would have had."""
    if call.math("linalg.trsm").name == "ieee":
        return True
    if _one_block(a) or (info is not None and bool((info != 0).any())):
        call.math_seen = IEEE
        return True
    return False


def _trsm(call, a: torch.Tensor, b: torch.Tensor, upper: bool, unitriangular: bool = False) -> torch.Tensor:
    """x with a x = b, ``a`` triangular: blocked as cuBLAS trsm, the updates in the math of ``linalg.trsm``."""
    solve = torch.linalg.solve_triangular
    if _native_solve(call, a):
        return solve(a, b, upper=upper, unitriangular=unitriangular)
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a, b = a.expand(*batch, *a.shape[-2:]), b.expand(*batch, *b.shape[-2:])
    n = a.size(-1)
    x = torch.empty(b.shape, dtype=b.dtype, device=b.device)
    # solved first: the bottom block of an upper-triangular a, the top one of a lower-triangular a
    starts = range(n - _TRSM_BLOCK, -_TRSM_BLOCK, -_TRSM_BLOCK) if upper else range(0, n, _TRSM_BLOCK)
    for start in starts:
        lo, hi = max(start, 0), min(start + _TRSM_BLOCK, n)
        rhs = b[..., lo:hi, :]
        done = slice(hi, n) if upper else slice(0, lo)
        if (n - hi if upper else lo) > 0:
            rhs = rhs - call.product("linalg.trsm", torch.matmul, a[..., lo:hi, done], x[..., done, :])
        x[..., lo:hi, :] = solve(a[..., lo:hi, lo:hi], rhs, upper=upper, unitriangular=unitriangular)
    return x


def _lu_solve(call, lu: torch.Tensor, pivots: torch.Tensor, b: torch.Tensor, left: bool = True,
              adjoint: bool = False) -> torch.Tensor:
    """getrs: x with op(A) x = b (``left``) or x op(A) = b, A = P L U given as ``(lu, pivots)``."""
    if not left:  # x op(A) = b  <=>  op(A)ᴴ xᴴ = bᴴ
        return _lu_solve(call, lu, pivots, b.mH, True, not adjoint).mH
    p, lower, upper = torch.lu_unpack(lu, pivots)
    if not adjoint:  # x = U⁻¹ L⁻¹ Pᵀ b; products with a permutation are exact
        y = _trsm(call, lower, p.mT @ b, upper=False, unitriangular=True)
        return _trsm(call, upper, y, upper=True)
    y = _trsm(call, upper.mT, b, upper=False)  # Aᵀ = Uᵀ Lᵀ Pᵀ
    return p @ _trsm(call, lower.mT, y, upper=True, unitriangular=True)


def _vector_rhs(a: torch.Tensor, b: torch.Tensor) -> bool:
    # PyTorch's linalg_solve_is_vector_rhs: b is a (batch of) vector(s)
    return b.dim() == 1 or (a.dim() - 1 == b.dim() and b.shape == a.shape[:-1])


@rule(aten.linalg_solve_triangular)
def _solve_triangular(call, func, args, kwargs):
    a, b = args[:2]
    upper, left = kwargs["upper"], kwargs.get("left", True)
    unit = kwargs.get("unitriangular", False)
    if call.math("linalg.trsm").name == "ieee":
        return func(*args, **kwargs)
    if left:
        return _trsm(call, a, b, upper, unit)
    return _trsm(call, a.mT, b.mT, not upper, unit).mT  # x a = b  <=>  aᵀ xᵀ = bᵀ


@rule(aten.triangular_solve)
def _triangular_solve(call, func, args, kwargs):
    b, a = args[:2]
    upper = op_arg(args, kwargs, 2, "upper", True)
    transpose = op_arg(args, kwargs, 3, "transpose", False)
    unit = op_arg(args, kwargs, 4, "unitriangular", False)
    native = func(*args, **kwargs)  # the cloned coefficient, as PyTorch returns it
    if call.math("linalg.trsm").name == "ieee":
        return native
    x = _trsm(call, a.mT, b, not upper, unit) if transpose else _trsm(call, a, b, upper, unit)
    return x, native[1]


@rule(aten.linalg_lu_solve)
def _linalg_lu_solve(call, func, args, kwargs):
    lu, pivots, b = args[:3]
    if _native_solve(call, lu):
        return func(*args, **kwargs)
    return _lu_solve(call, lu, pivots, b, kwargs.get("left", True), kwargs.get("adjoint", False))


def _solve_from_lu(call, a: torch.Tensor, b: torch.Tensor, left: bool) -> torch.Tensor:
    lu, pivots = torch.linalg.lu_factor(a)  # getrf: no TF32 on the GPU
    vector = _vector_rhs(a, b)
    if vector:
        b = b.unsqueeze(-1) if left else b.unsqueeze(-2)
    x = _lu_solve(call, lu, pivots, b, left)
    return x.squeeze(-1 if left else -2) if vector else x


@rule(aten._linalg_solve_ex)
def _linalg_solve_ex(call, func, args, kwargs):
    native = func(*args, **kwargs)  # LU, pivots and info as PyTorch returns them (its backward reads them)
    a, b = args[:2]
    if _native_solve(call, a, native[3]):
        return native
    return (_solve_from_lu(call, a, b, kwargs.get("left", True)), *native[1:])


@rule(aten.linalg_inv_ex)
def _linalg_inv_ex(call, func, args, kwargs):
    native = func(*args, **kwargs)  # PyTorch's inv is solve(A, I): getrf, then getrs
    a = args[0]
    if _native_solve(call, a, native[1]):
        return native
    eye = torch.eye(a.size(-1), dtype=a.dtype, device=a.device).expand(a.shape)
    return _solve_from_lu(call, a, eye, True), native[1]


@rule(aten.linalg_lstsq)
def _linalg_lstsq(call, func, args, kwargs):
    a, b = args[:2]
    driver = kwargs.get("driver")
    if _native_solve(call, a):
        return func(*args, **kwargs)
    if driver not in (None, "gels") or a.size(-2) < a.size(-1):
        return NotImplemented  # a CUDA target refuses it: only 'gels', only overdetermined systems
    # residuals as gels gives them: from Qᵀb's tail, no trsm in them
    native = func(*args[:3], **{**kwargs, "driver": "gels"})
    q, r = torch.linalg.qr(a)  # geqrf and Qᵀb: no TF32 on the GPU
    vector = _vector_rhs(a, b)
    rhs = q.mT @ (b.unsqueeze(-1) if vector else b)
    x = _trsm(call, r, rhs, upper=True)
    return (x.squeeze(-1) if vector else x, *native[1:])


# -- convolution ---------------------------------------------------------------------------------------------
def _native_conv_is_ieee(call, x) -> None:
    # The rounded operands must not be rounded again by cuDNN; scopes only switch the matmul flags.
    if x.device.type == "cuda" and call.cells.get("cuda.conv") != "ieee":
        raise Tf32LabError(
            "emulating convolutions of CUDA tensors needs IEEE cuDNN convolutions: set "
            "torch.backends.cudnn.conv.fp32_precision = 'ieee' (or cudnn.allow_tf32 = False) around emulate()")


OWN, CUDNN = "own", "cudnn"  # where a GPU runs a depthwise convolution: PyTorch's own kernels, or cuDNN's


def _depthwise(call, x, w, transposed: bool, groups: int) -> Optional[str]:
    """Where a GPU target runs this float32 depthwise convolution (None: not one, or not a GPU target).

    ``aten/src/ATen/native/Convolution.cpp``: ``is_depthwise`` (one input channel a group, 2-D or 3-D, a 1-D one
    as 2-D); ``use_cudnn_depthwise`` sends it to cuDNN only where cuDNN's suggested memory format is channels-last
    (or for FP16), and with cuDNN on (:data:`CUDNN`); else ``ConvBackend::CudaDepthwise2d`` / ``CudaDepthwise3d``
    (:data:`OWN`), which no TF32 flag reaches: a MobileNet's, EfficientNet's or ConvNeXt's depthwise convolutions
    in NCHW, and every depthwise one where ``torch.backends.cudnn.enabled`` is False. cuDNN's own takes the
    ``conv.depthwise`` key's math for the forward and input gradient, ``conv``'s for the weight gradient."""
    if call.emu.target.device != "cuda" or call.emu.math is not None or transposed or x.dtype != torch.float32:
        return None
    if x.dim() not in (3, 4, 5) or groups <= 1 or x.size(1) != groups or w.size(0) % groups:
        return None
    if call.cells.get(CUDNN_CELL) == "off":  # use_cudnn_depthwise needs cuDNN on: its own kernels in any format
        return OWN
    last = any(t.dim() >= 4 and _memory_format(t) in (torch.channels_last, torch.channels_last_3d) for t in (x, w))
    return CUDNN if last else OWN


def _memory_format(t: torch.Tensor) -> torch.memory_format:
    """PyTorch's ``suggest_memory_format`` of ``t`` (contiguous where it cannot tell)."""
    try:
        from torch._prims_common import suggest_memory_format  # private: read where it exists
        return suggest_memory_format(t)
    except (ImportError, RuntimeError, TypeError):  # an older torch, or a tensor whose strides it cannot read
        return torch.contiguous_format


@rule(aten.convolution, aten._convolution)
def _convolution(call, func, args, kwargs):
    x, w, bias, *rest = args
    _native_conv_is_ieee(call, x)
    where = _depthwise(call, x, w, bool(op_arg(args, kwargs, 6, "transposed")), int(op_arg(args, kwargs, 8, "groups")))
    if where == OWN:
        call.math_seen = IEEE
        return func(*args, **kwargs)
    out = call.product("conv.depthwise" if where == CUDNN else "conv", lambda a, b: func(a, b, bias, *rest, **kwargs),
                       x, w,
                       bare=lambda a, b: func(a, b, None, *rest, **kwargs))
    # The rounded operands are contiguous copies; the native convolution gives a channels-last output where
    # either operand is channels-last (cudnn_conv_suggest_memory_format, aten/src/ATen/native/ConvUtils.h; the CPU
    # kernels alike), and a next depthwise conv reads that format to pick cuDNN over PyTorch's own kernels.
    wanted = _conv_output_format(x, w)
    if wanted is not torch.contiguous_format and _memory_format(out) is not wanted:
        out = out.contiguous(memory_format=wanted)
    return out


def _conv_output_format(x: torch.Tensor, w: torch.Tensor) -> torch.memory_format:
    """The memory format of a native convolution's output: channels-last where ``x`` or ``w`` is."""
    for t in (x, w):
        if t.dim() >= 4:
            fmt = _memory_format(t)
            if fmt in (torch.channels_last, torch.channels_last_3d):
                return fmt
    return torch.contiguous_format


@rule(aten.convolution_backward)
def _convolution_backward(call, func, args, kwargs):
    grad, x, w, bias_sizes, *rest, mask = args
    _native_conv_is_ieee(call, x)
    where = _depthwise(call, x, w, bool(op_arg(args, kwargs, 7, "transposed")), int(op_arg(args, kwargs, 9, "groups")))
    if where == OWN:
        call.math_seen = IEEE  # the depthwise kernels' backward too
        return func(*args, **kwargs)

    def run(g, i, k, want):
        return func(g, i, k, bias_sizes, *rest, want)

    if where == CUDNN and mask[0] and mask[1]:  # cuDNN's depthwise: dgrad at its own key's math, wgrad at conv's
        math_w, math_x = call.math("conv"), call.math("conv.depthwise")  # the weight's first: coverage names it
        grad_weight = _conv_grads(call, run, math_w, grad, x, w, [False, True, False])[1]
        grad_input = _conv_grads(call, run, math_x, grad, x, w, [True, False, False])[0]
    else:
        math = call.math("conv.depthwise" if where == CUDNN and mask[0] else "conv")
        grad_input, grad_weight = _conv_grads(call, run, math, grad, x, w, [mask[0], mask[1], False])
    # The bias gradient is a plain sum of the incoming gradient, in float32 on every device.
    grad_bias = run(grad, x, w, [False, False, True])[2] if mask[2] else None
    return grad_input, grad_weight, grad_bias


def _conv_grads(call, run, math, grad, x, w, want):
    """A convolution's input and weight gradients (those ``want`` asks for; None for the rest) with ``math``'s
    operands: ``run(grad, x, w, want)`` is the native backward."""
    if math.name == "ieee" or not (want[0] or want[1]):
        grad_input, grad_weight, _ = run(grad, x, w, want)
    elif math.name in ("tf32", "bf16"):
        grad_input, grad_weight, _ = run(call.round(grad, math), call.round(x, math), call.round(w, math), want)
    elif math.name == "bfx9":  # every part of grad times the summed parts of x and w: all nine products
        x_sum, w_sum = call.split(x, math, summed=True)[-1], call.split(w, math, summed=True)[-1]
        parts = [run(g, x_sum, w_sum, want) for g in call.split(grad, math)]
        grad_input, grad_weight = (parts[0][i].add_(parts[1][i]).add_(parts[2][i]) if want[i] else None
                                   for i in (0, 1))
    else:  # grad_input is bilinear in (grad, w), grad_weight in (grad, x): two calls give both, as in product()
        (g_big, g_small), (x_big, x_sum), (w_big, w_sum) = (
            call.split(grad, math), call.split(x, math, summed=True), call.split(w, math, summed=True))
        full, small = run(g_big, x_sum, w_sum, want), run(g_small, x_big, w_big, want)
        grad_input, grad_weight = (full[i].add_(small[i]) if want[i] else None for i in (0, 1))
    return grad_input, grad_weight


# -- recurrent networks ----------------------------------------------------------------------------------------
_MODES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}


def _is_packed(args) -> bool:
    # input variant: (input, hx, params, has_biases, ...); packed: (data, batch_sizes, hx, params, has_biases, ...)
    return len(args) > 3 and isinstance(args[3], (list, tuple))


def _rnn_key(call, mode: str, hx) -> str:
    """The target key of this RNN call's GEMMs (``know.targets.rnn_key``): an LSTM with ``proj_size`` is known
    here by its states, whose h and c differ in size (docs/gpu-results.md)."""
    projected = mode == "lstm" and isinstance(hx, (list, tuple)) and len(hx) == 2 and hx[0].size(-1) != hx[1].size(-1)
    return rnn_key(call.emu.target.device, mode, projected)


@rule(aten.lstm, aten.gru, aten.rnn_tanh, aten.rnn_relu)
def _rnn_op(call, func, args, kwargs):
    mode = func.name().split("::")[-1].split(".")[0]  # aten::lstm.input, aten::lstm.data (packed)
    packed = _is_packed(args)
    key = _rnn_key(call, mode, args[2] if packed else args[1])

    def linear(x, w, b):
        return linear_product(call, key, x, w, b)

    call.math(key)
    return run_packed_rnn(mode, linear, *args) if packed else run_rnn(mode, linear, *args)


_MKLDNN_LSTM = 2  # mkldnn_rnn_layer's mode for an LSTM (PyTorch's RNN mode numbers: RNN_RELU, RNN_TANH, LSTM, GRU)


@rule(aten.mkldnn_rnn_layer)
def _mkldnn_rnn_layer(call, func, args, kwargs):
    """One layer and direction of an LSTM as oneDNN computes it on a CPU: what a TorchScript (scripted or traced)
    LSTM's ``aten::lstm`` decomposes into below autograd, where no function mode sees it (``nn.LSTM`` itself is
    caught whole above). Time-major whatever ``batch_first`` says; its states one layer's ``(batch, hidden)``.
    Where autograd records it (a grad-enabled call on weights that require grad), its backward reads oneDNN's
    workspace, which no emulated forward gives: run natively, and said."""
    if func._overloadname != "default":  # its out= variant writes four tensors: left to oneDNN, and said
        return NotImplemented
    x, w_ih, w_hh, b_ih, b_hh, hx, cx, reverse, batch_sizes, mode = args[:10]
    has_biases = args[12]
    if batch_sizes or mode != _MKLDNN_LSTM or (torch.is_grad_enabled() and any(
            t.requires_grad for t in (x, w_ih, w_hh, b_ih, b_hh, hx, cx))):
        return NotImplemented
    params = [w_ih, w_hh, b_ih, b_hh] if has_biases else [w_ih, w_hh]
    seq = x.flip(0) if reverse else x
    out, hy, cy = _rnn_op(call, aten.lstm.input, (seq, (hx[None], cx[None]), params, has_biases, 1, 0.0, False, False,
                                                  False), {})
    return (out.flip(0) if reverse else out), hy[0], cy[0], None


# the RNN ops a TorchScript graph calls, which PyTorch breaks into plain GEMMs below autograd outside inference mode
# (the LSTM's into mkldnn_rnn_layer on a CPU, above; the others into addmm and mm, which no rule can tell from a
# Linear's)
_SCRIPTED_RNN = ("aten::gru", "aten::rnn_tanh", "aten::rnn_relu", "aten::lstm")


def scripted_rnns(model: torch.nn.Module) -> list[str]:
    """The TorchScript parts of ``model`` (scripted or traced; their names, ``""`` for the model itself) whose
    graph calls an RNN op: outside inference mode ``emulate()`` sees their GEMMs, not the RNN.

    >>> lin = torch.jit.trace(torch.nn.Linear(2, 2), torch.ones(1, 2))
    >>> gru = torch.jit.trace(torch.nn.GRU(2, 2), torch.ones(3, 1, 2), check_trace=False)
    >>> scripted_rnns(torch.nn.ModuleDict({"proj": lin, "rnn": gru}))
    ['rnn']
    """
    found: list[str] = []
    scripts: set[str] = set()
    for name, module in model.named_modules():
        if not isinstance(module, torch.jit.ScriptModule):
            continue
        scripts.add(name)
        if name and name.rpartition(".")[0] in scripts:  # what a scripted parent calls of it is in its graphs
            continue
        graph = _methods_graphs(module)
        if any(op + "(" in graph or op + "." in graph for op in _SCRIPTED_RNN):
            found.append(name)
    return found


def _methods_graphs(module: torch.jit.ScriptModule) -> str:
    """The inlined graphs of each of ``module``'s methods: not forward's alone, for a part with no forward of its
    own may be called through an exported method (``part.run(x)``)."""
    try:
        names = module._c._method_names()
    except (AttributeError, RuntimeError):
        names = ["forward"]
    graphs = []
    for name in names:
        try:
            graphs.append(str(module._c._get_method(name).inlined_graph))
        except (AttributeError, RuntimeError):
            continue
    return "\n".join(graphs)


class _RnnLinear(torch.autograd.Function):
    """x wᵀ + b whose forward and backward GEMMs are all ops of the key ``key`` (``rnn``: cuDNN's RNN kernel). The
    forward is ``product(x, w, b)`` (rounded by the caller); the backward's GEMMs go through the emulator's mode."""

    @staticmethod
    def forward(ctx, x, w, b, product, key):
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        ctx.key = key
        return product(x, w, b)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        with as_family(ctx.key):
            grad_x = grad @ w
            grad_w = grad.reshape(-1, grad.size(-1)).t() @ x.reshape(-1, x.size(-1))
        grad_b = grad.reshape(-1, grad.size(-1)).sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None


RNN_FUNCTIONS = {getattr(torch._C._VariableFunctions, name): name for name in _MODES}


def rnn_function(call, func, args, kwargs, quietly: Callable[[Callable], Any] = lambda fn: fn()):
    """``torch._VF.lstm`` and friends, called by ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN``; ``call`` rounds each GEMM
    (the emulator runs this without its dispatch mode, and a whole-sequence layer's backward in ``quietly(fn)``,
    which runs ``fn`` so too)."""
    mode = RNN_FUNCTIONS[func]
    if kwargs:
        call.unhandled(f"{call.op} (keyword arguments)")
        return func(*args, **kwargs)
    packed = _is_packed(args)
    key = _rnn_key(call, mode, args[2] if packed else args[1])
    if call.math(key).name == "ieee":  # nothing to round: PyTorch's own fused kernel, at IEEE (the caller's scope)
        call.count(call.math(key))
        return func(*args, **kwargs)
    x, hx, params = (args[0], args[2], args[3]) if packed else (args[0], args[1], args[2])
    hx = hx if isinstance(hx, (list, tuple)) else (hx,)
    nan_free = all(_pymath.isfinite(float(t.detach().sum())) for t in (x, *hx, *params) if t.device.type == "cpu")
    product, step, done = call.many_linears(key, nan_free)
    math = call.math(key)
    grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in (x, *hx, *params))

    def linear(x, w, b):
        return _RnnLinear.apply(x, w, b, product, key)

    def count(op: str, n: int) -> None:
        call.emu._count(op, math, n)

    kit = recurrent.Kit(linear, product, lambda w: call.round(w, math), math.name, math.rounding, nan_free, count,
                        quietly)
    try:
        if packed:
            return run_packed_rnn(mode, linear, *args) if grad else run_packed_rnn(mode, product, *args, step=step)
        whole = recurrent.layers(mode, kit, *args, grad=grad)
        if whole is not None:
            return whole
        if grad:
            return run_rnn(mode, linear, *args)
        return run_rnn(mode, product, *args, step=step)
    finally:
        done()
