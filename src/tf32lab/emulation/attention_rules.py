"""The emulator's rules for attention: ``scaled_dot_product_attention`` in each of PyTorch's kernels (the math
backend's bmm calls, the fused kernels' products, CPU flash attention), forward and backward,
``nn.MultiheadAttention``'s and ``nn.TransformerEncoderLayer``'s native fast paths, and the op pair
``tf32lab::scaled_dot_product_attention`` through which ``F.scaled_dot_product_attention`` reaches the emulator whole
under autograd. Registered in the one registry, ``tf32lab.emulation.rules.RULES``, by ``@rule`` as every rule is;
a module of its own for its size (the registry's largest family).

Each re-expresses the kernel in its two products (``q kᵀ`` and ``p v``) and the softmax between, the products in the
math the target gives the kernel's key (``attention``, ``attention.math``, ``attention.efficient``): the fused
kernels' GEMMs run inside one native kernel that a dispatch mode cannot see into.
"""

from __future__ import annotations

import math as _pymath
from typing import Optional

import torch
import torch.nn.functional as F

from tf32lab.emulation.registry import aten, linear_product, op_arg, plain_gemm, rule


def _expand_gqa(q, k, v, enable_gqa):
    if enable_gqa and k.size(-3) != q.size(-3):
        rep = q.size(-3) // k.size(-3)
        k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    return k, v


def _math_backend(call, key) -> bool:
    if key == "attention.math":
        return True
    return key == "attention" and call.emu.target.device == "cuda" and call.cells.get("sdpa") == "math"


def _product(call, key, a, b):
    """a @ b, one of attention's products, in the math of ``key``. The math backend's are cuBLAS bmm calls, K in
    order: a ``"hardware"`` block sums them as the target's unit does. A fused kernel's order is not public: the
    ideal sum, as one GEMM for a split math (``_Call.matmul``)."""
    if _math_backend(call, key):
        return call.product("attention.math", torch.matmul, a, b, as_gemm=plain_gemm)
    return call.matmul(key, a, b)


def _roots(scale: float) -> tuple[float, float]:
    """The math backend's factors of ``scale`` for q and k: sqrt(|scale|) each, the sign on q's (attention.cpp)."""
    root = _pymath.sqrt(abs(scale))
    return (-root if scale < 0 else root), root


# PyTorch's softmax for attention from 2.5 (pytorch#131060): a row with every score -inf (fully masked) gives
# zeros, not NaN, in every backend; before, NaN
_SAFE_SOFTMAX = hasattr(torch.ops.aten, "_safe_softmax")
# Boolean and causal masks applied as an additive bias of 0 and -inf (_weights); needs the NaN test that
# _SAFE_SOFTMAX brings
_BIAS_MASKS = _SAFE_SOFTMAX


def _attention_softmax(s: torch.Tensor, dim: int) -> torch.Tensor:
    """Attention's softmax as PyTorch's: ``_safe_softmax``'s zeros for fully masked rows, at a softmax's cost where
    no row is (its own passes cost 3x a softmax); a NaN row it leaves is one such row, or a NaN score's."""
    p = torch.softmax(s, dim)
    if _SAFE_SOFTMAX and _pymath.isnan(p.sum().item()):  # probabilities are finite: a sum is NaN only with a NaN
        p = _zero_masked_rows(p, s, dim)
    return p


def _zero_masked_rows(p: torch.Tensor, s: torch.Tensor, dim: int) -> torch.Tensor:
    return p.masked_fill(torch.isneginf(s).all(dim, keepdim=True), 0.0)


def _scores(call, key, q, k, attn_mask, is_causal, scale, exact=True):
    """The masked scores and the scale used. ``exact=False`` masks by adding a bias of 0 and -inf (a tenth of
    ``masked_fill``'s cost with a broadcast boolean mask, and the fused kernels' scale in the same pass): the
    same scores, except that a masked-out score that is NaN or +inf becomes NaN instead of -inf, which the
    caller tells by a NaN in its softmax (:func:`_weights`)."""
    if scale is None:  # no head dim: every score is an empty sum, 0, whatever the scale (PyTorch's 1/sqrt(0))
        scale = 1.0 / _pymath.sqrt(q.size(-1)) if q.size(-1) else 1.0
    math_backend = _math_backend(call, key)
    if math_backend:  # PyTorch's math backend scales both operands by sqrt(scale) before the GEMM
        q_root, k_root = _roots(scale)
        s = _product(call, key, q * q_root, k.transpose(-2, -1) * k_root)
    else:  # the fused kernels scale the accumulator
        s = _product(call, key, q, k.transpose(-2, -1))
    if not exact:
        return _biased(s, 1.0 if math_backend else scale, _bias(s, attn_mask, is_causal), attn_mask), scale
    if not math_backend:
        s.mul_(scale)
    if is_causal:
        keep = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
        s.masked_fill_(~keep, float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
    return s, scale


def _bias(s: torch.Tensor, attn_mask: Optional[torch.Tensor], is_causal: bool) -> Optional[torch.Tensor]:
    """The causal and boolean masks as one additive bias of 0 (kept) and -inf (masked out), or None."""
    bias = None
    if is_causal:
        rows, cols = s.shape[-2:]
        bias = torch.full((rows, cols), float("-inf"), dtype=s.dtype, device=s.device).triu_(1)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        keep = torch.zeros(attn_mask.shape, dtype=s.dtype, device=s.device).masked_fill_(~attn_mask, float("-inf"))
        bias = keep if bias is None else bias + keep
    return bias


def _biased(s: torch.Tensor, scale: float, bias: Optional[torch.Tensor],
            attn_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """``s * scale + bias`` (then ``+ attn_mask``, an additive one), in place where the shapes allow. The bias is 0
    or -inf, so one fused multiply-add rounds as the product alone: the scores of :func:`_scores`'s exact path
    wherever that is not -inf."""
    if bias is None:
        s = s.mul_(scale) if scale != 1.0 else s
    elif bias.dim() <= s.dim() and all(n in (1, m) for n, m in zip(reversed(bias.shape), reversed(s.shape))):
        s = torch.add(bias, s, alpha=scale, out=s)
    else:  # the mask broadcasts the scores to more dims
        s = torch.add(bias, s, alpha=scale)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        s = s + attn_mask
    return s


def _weights(call, key, q, k, attn_mask, is_causal, scale):
    """The scores, their softmax and the scale used: (s, p, scale). The scores are masked by a bias first
    (:func:`_scores`' ``exact=False``); a NaN in the softmax (a fully masked row, or a NaN or +inf score) is
    looked into: a NaN score (one in the operands', or a masked-out one that the bias made NaN) has the scores
    computed again as PyTorch masks them (a fully masked row alone, padding's, does not: the bias gives it -inf
    throughout, as ``masked_fill``), and :func:`_attention_softmax` follows."""
    fast = _BIAS_MASKS and (is_causal or (attn_mask is not None and attn_mask.dtype == torch.bool))
    s, scale = _scores(call, key, q, k, attn_mask, is_causal, scale, exact=not fast)
    p = torch.softmax(s, -1)
    if not _SAFE_SOFTMAX or not _pymath.isnan(p.sum().item()):  # probabilities are finite: a NaN sum is a NaN
        return s, p, scale
    if fast and bool(torch.isnan(s).any()):
        s, scale = _scores(call, key, q, k, attn_mask, is_causal, scale)
        p = torch.softmax(s, -1)
    return s, _zero_masked_rows(p, s, -1), scale


def _attention(call, key, q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, lse=False,
               noise=None):
    """softmax(q kᵀ · scale + mask) v with both products in the math of ``key``: (out, logsumexp, weights);
    ``noise``: dropout's kept weights, scaled (:func:`dropout_noise`), multiplying the weights before v."""
    k, v = _expand_gqa(q, k, v, enable_gqa)
    s, p, _ = _weights(call, key, q, k, attn_mask, is_causal, scale)
    lse = torch.logsumexp(s, -1) if lse else None
    return _product(call, key, p if noise is None else p * noise, v), lse, p


def _attention_backward(call, key, grad, q, k, v, out, attn_mask, is_causal, scale, enable_gqa=False, noise=None,
                        mask_grad=False):
    """q's, k's and v's gradients; with ``mask_grad``, the additive mask's too (a learnt bias: the scores'
    gradient, summed over the dims the mask was broadcast along)."""
    heads_k = k.size(-3)
    k_full, v_full = _expand_gqa(q, k, v, enable_gqa)
    _, p, scale = _weights(call, key, q, k_full, attn_mask, is_causal, scale)
    grad_v = _product(call, key, (p if noise is None else p * noise).transpose(-2, -1), grad)
    grad_p = _product(call, key, grad, v_full.transpose(-2, -1))
    if noise is not None:  # out = (p m) v: the weights' gradient is m (grad vᵀ), and Σ p grad_p is still grad·out
        grad_p = grad_p * noise
    grad_s = p * (grad_p - (grad * out).sum(-1, keepdim=True))
    if _math_backend(call, key):
        q_root, k_root = _roots(scale)
        grad_q = _product(call, key, grad_s, k_full * k_root).mul_(q_root)
        grad_k = _product(call, key, grad_s.transpose(-2, -1), q * q_root).mul_(k_root)
    else:
        grad_q = _product(call, key, grad_s, k_full).mul_(scale)
        grad_k = _product(call, key, grad_s.transpose(-2, -1), q).mul_(scale)
    if grad_k.size(-3) != heads_k:  # grouped-query attention: sum the gradient of each shared head
        grad_k, grad_v = _shared_heads(grad_k, heads_k), _shared_heads(grad_v, heads_k)
    if mask_grad:
        return grad_q, grad_k, grad_v, grad_s.sum_to_size(attn_mask.shape).to(attn_mask.dtype)
    return grad_q, grad_k, grad_v


def _shared_heads(grad: torch.Tensor, heads: int) -> torch.Tensor:
    """A gradient over every query head's copy of k or v, summed into the ``heads`` that were shared (each by a
    group of consecutive query heads, as ``repeat_interleave`` copied them); v's head dim may differ from k's."""
    return grad.reshape(*grad.shape[:-3], heads, grad.size(-3) // heads, *grad.shape[-2:]).sum(-3)


@rule(aten.scaled_dot_product_attention)
def _sdpa(call, func, args, kwargs):
    q, k, v = args[:3]
    if op_arg(args, kwargs, 4, "dropout_p", 0.0):
        return NotImplemented  # decomposes into a kernel that draws its own mask
    out, _, _ = _attention(call, "attention", q, k, v, op_arg(args, kwargs, 3, "attn_mask"),
                           op_arg(args, kwargs, 5, "is_causal", False), kwargs.get("scale"),
                           kwargs.get("enable_gqa", False))
    return out


@rule(aten._scaled_dot_product_flash_attention_for_cpu)
def _sdpa_flash_cpu(call, func, args, kwargs):
    q, k, v = args[:3]
    if op_arg(args, kwargs, 3, "dropout_p", 0.0):
        return NotImplemented
    out, lse, _ = _attention(call, "attention", q, k, v, kwargs.get("attn_mask"),
                             op_arg(args, kwargs, 4, "is_causal", False), kwargs.get("scale"), lse=True)
    return out, lse


@rule(aten._scaled_dot_product_flash_attention_for_cpu_backward)
def _sdpa_flash_cpu_backward(call, func, args, kwargs):
    grad, q, k, v, out, _lse = args[:6]
    if op_arg(args, kwargs, 6, "dropout_p", 0.0):
        return NotImplemented
    return _attention_backward(call, "attention", grad, q, k, v, out, kwargs.get("attn_mask"),
                               op_arg(args, kwargs, 7, "is_causal", False), kwargs.get("scale"))


@rule(aten._scaled_dot_product_attention_math)
def _sdpa_math(call, func, args, kwargs):
    q, k, v = args[:3]
    if op_arg(args, kwargs, 4, "dropout_p", 0.0):
        return NotImplemented
    out, _, p = _attention(call, "attention.math", q, k, v, op_arg(args, kwargs, 3, "attn_mask"),
                           op_arg(args, kwargs, 5, "is_causal", False), kwargs.get("scale"),
                           kwargs.get("enable_gqa", False))
    return out, p


@rule(aten._scaled_dot_product_efficient_attention)
def _sdpa_efficient(call, func, args, kwargs):
    q, k, v, bias, compute_lse = args[:5]
    if op_arg(args, kwargs, 5, "dropout_p", 0.0):
        return NotImplemented
    out, lse, _ = _attention(call, "attention.efficient", q, k, v, bias,
                             op_arg(args, kwargs, 6, "is_causal", False), kwargs.get("scale"), lse=compute_lse)
    empty = torch.empty(0, dtype=torch.int64, device=q.device)
    return out, (lse if compute_lse else torch.empty(0, device=q.device)), empty, empty


@rule(aten._scaled_dot_product_efficient_attention_backward)
def _sdpa_efficient_backward(call, func, args, kwargs):
    grad, q, k, v, bias, out = args[:6]
    if op_arg(args, kwargs, 9, "dropout_p", 0.0):
        return NotImplemented
    grads = _attention_backward(call, "attention.efficient", grad, q, k, v, out, bias,
                                op_arg(args, kwargs, 11, "is_causal", False), kwargs.get("scale"))
    return (*grads, None)


# Under autograd, F.scaled_dot_product_attention decomposes before a dispatch mode sees it, into whatever kernel
# *this* machine picks (often the math path: plain bmm). The emulator's function mode routes it to this op pair
# instead, which reaches the dispatch mode whole, forward and backward, and is emulated as the target's kernel.
def _sdpa(q, k, v, attn_mask, is_causal, scale, enable_gqa, noise=None):
    if noise is not None:  # PyTorch's math path, its dropout's draw given
        k, v = _expand_gqa(q, k, v, enable_gqa)
        s = q @ k.transpose(-2, -1) * (1.0 / _pymath.sqrt(q.size(-1)) if scale is None else scale)
        if is_causal:
            s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), float("-inf"))
        if attn_mask is not None:
            s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
        return (_attention_softmax(s, -1) * noise) @ v
    # enable_gqa exists from torch 2.5; before it no caller can ask for it
    extra = {"enable_gqa": True} if enable_gqa else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal, scale=scale, **extra)


def dropout_noise(q: torch.Tensor, k: torch.Tensor, p: float, enable_gqa: bool = False) -> torch.Tensor:
    """Attention dropout's kept weights over 1 - p, drawn as PyTorch's math path draws them (``at::dropout``: on the
    CPU ``empty_like(attn).bernoulli_(1 - p)``, then ``div_(1 - p)``; on CUDA its fused ``native_dropout``; nothing
    drawn at p = 1), so that a run and its float64 reference draw the same weights
    (aten/src/ATen/native/Dropout.cpp). Shaped as the weights: a
    grouped-query call's keys count once per query head."""
    if enable_gqa and q.dim() >= 3 and k.dim() >= 3:
        batch = (*torch.broadcast_shapes(q.shape[:-3], k.shape[:-3]), q.size(-3))
    else:
        batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    shape = (*batch, q.size(-2), k.size(-2))
    if p >= 1:
        return torch.zeros(shape, dtype=q.dtype, device=q.device)
    if q.device.type in ("cuda", "xpu", "privateuseone"):  # at::dropout's fused kernel there: its own draws
        return torch.native_dropout(torch.ones(shape, dtype=q.dtype, device=q.device), p, True)[0]
    return torch.empty(shape, dtype=q.dtype, device=q.device).bernoulli_(1 - p).div_(1 - p)


# Explicit schemas: this module's annotations are strings (``from __future__ import annotations``), which schema
# inference before torch 2.5 cannot read.
@torch.library.custom_op("tf32lab::scaled_dot_product_attention", mutates_args=(), schema=(
    "(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, bool is_causal, float? scale, bool enable_gqa, "
    "Tensor? noise) -> Tensor"))
def _sdpa_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
             is_causal: bool, scale: Optional[float], enable_gqa: bool, noise: Optional[torch.Tensor]) -> torch.Tensor:
    return _sdpa(q, k, v, attn_mask, is_causal, scale, enable_gqa, noise)


@torch.library.custom_op("tf32lab::scaled_dot_product_attention_backward", mutates_args=(), schema=(
    "(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor? attn_mask, bool is_causal, float? scale, "
    "bool enable_gqa, Tensor? noise, bool mask_grad) -> (Tensor, Tensor, Tensor, Tensor)"))
def _sdpa_backward_op(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      attn_mask: Optional[torch.Tensor], is_causal: bool, scale: Optional[float],
                      enable_gqa: bool, noise: Optional[torch.Tensor],
                      mask_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # the native backward, outside emulate() (a forward emulated, its backward run after the block): a custom
    # op's implementation runs below autograd, where torch.autograd.grad finds no graph; torch.func's vjp has its own
    if mask_grad:
        _, vjp = torch.func.vjp(lambda q, k, v, m: _sdpa(q, k, v, m, is_causal, scale, enable_gqa, noise), q, k, v,
                                attn_mask)
        return vjp(grad)
    _, vjp = torch.func.vjp(lambda *qkv: _sdpa(*qkv, attn_mask, is_causal, scale, enable_gqa, noise), q, k, v)
    return (*vjp(grad), grad.new_empty(0))


def _sdpa_setup(ctx, inputs, output):
    q, k, v, attn_mask, is_causal, scale, enable_gqa, noise = inputs
    ctx.save_for_backward(q, k, v, output)
    # a learnt additive mask (a relative-position bias) has a gradient too; the op's fourth, else an empty tensor
    mask_grad = attn_mask is not None and attn_mask.requires_grad and attn_mask.is_floating_point()
    ctx.options = (attn_mask, is_causal, scale, enable_gqa, noise, mask_grad)


def _sdpa_backward(ctx, grad):
    q, k, v, out = ctx.saved_tensors
    grad_q, grad_k, grad_v, grad_mask = torch.ops.tf32lab.scaled_dot_product_attention_backward(
        grad, q, k, v, out, *ctx.options)
    return grad_q, grad_k, grad_v, (grad_mask if ctx.options[-1] else None), None, None, None, None


_sdpa_op.register_autograd(_sdpa_backward, setup_context=_sdpa_setup)


@rule(torch.ops.tf32lab.scaled_dot_product_attention)
def _tf32lab_sdpa(call, func, args, kwargs):
    q, k, v, attn_mask, is_causal, scale, enable_gqa, noise = args
    return _attention(call, "attention", q, k, v, attn_mask, is_causal, scale, enable_gqa, noise=noise)[0]


@rule(torch.ops.tf32lab.scaled_dot_product_attention_backward)
def _tf32lab_sdpa_backward(call, func, args, kwargs):
    grad, q, k, v, out, attn_mask, is_causal, scale, enable_gqa, noise, mask_grad = args
    grads = _attention_backward(call, "attention", grad, q, k, v, out, attn_mask, is_causal, scale, enable_gqa,
                                noise, mask_grad)
    return grads if mask_grad else (*grads, grad.new_empty(0))


SDPA_FUNCTION = torch._C._nn.scaled_dot_product_attention
_SDPA_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


def sdpa_dropout(args: tuple, kwargs: dict) -> float:
    """The ``dropout_p`` of an ``F.scaled_dot_product_attention(*args, **kwargs)`` call (0.0 where none is given).

    >>> sdpa_dropout((None, None, None, None, 0.1), {}), sdpa_dropout((), {"dropout_p": 0.2}), sdpa_dropout((), {})
    (0.1, 0.2, 0.0)
    """
    return float(dict(zip(_SDPA_NAMES, args), **kwargs).get("dropout_p", 0.0) or 0.0)


def sdpa_function(call, func, args, kwargs):
    """``F.scaled_dot_product_attention``: through ``tf32lab::scaled_dot_product_attention``. With dropout (a
    transformer in training: BERT's attention dropout), its weights are drawn first, as PyTorch's CPU kernel (the
    math path) draws them, and the products are the target's kernel's."""
    bound = dict(zip(_SDPA_NAMES, args), **kwargs)
    mask = bound.get("attn_mask")
    q, k, v = bound["query"], bound["key"], bound["value"]
    p = sdpa_dropout(args, kwargs)
    enable_gqa = bool(bound.get("enable_gqa", False))
    noise = dropout_noise(q, k, p, enable_gqa) if p > 0 else None
    return torch.ops.tf32lab.scaled_dot_product_attention(
        q, k, v, mask, bool(bound.get("is_causal", False)), bound.get("scale"), enable_gqa, noise)


def _mha_mask(mask, mask_type, batch, heads):
    # _native_multi_head_attention: True means "do not attend"; mask_type 0: (L, S), 1: (B, S), 2: (B, H, L, S)
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(mask, float("-inf"))
    if mask_type == 1:
        mask = mask.view(batch, 1, 1, mask.size(-1))
    return mask


def _mha(call, query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias,
         mask=None, need_weights=True, average_attn_weights=True, mask_type=None):
    batch, length = query.size(0), query.size(1)
    head_dim = embed_dim // num_head

    def linear(x, w, b):
        return linear_product(call, "matmul", x, w, b)

    if query is key and key is value:
        q, k, v = linear(query, qkv_weight, qkv_bias).chunk(3, -1)
    else:
        (wq, wk, wv), (bq, bk, bv) = qkv_weight.chunk(3), qkv_bias.chunk(3)
        q, k, v = linear(query, wq, bq), linear(key, wk, bk), linear(value, wv, bv)

    def heads(t):
        return t.reshape(batch, -1, num_head, head_dim).transpose(1, 2)

    q, k, v = heads(q), heads(k), heads(v)
    additive = _mha_mask(mask, mask_type, batch, num_head)
    if need_weights:
        # PyTorch's explicit path: q rescaled before the GEMM, softmax, a second GEMM (the matmul flag)
        q = q / _pymath.sqrt(head_dim)
        out, _, weights = _attention(call, "attention.math", q, k, v, additive, False, 1.0)
        weights = weights.mean(1) if average_attn_weights else weights
    else:  # the fused kernel PyTorch picks for SDPA
        out, _, _ = _attention(call, "attention", q, k, v, additive, False, None)
        weights = torch.empty(0, dtype=query.dtype, device=query.device)
    out = out.transpose(1, 2).reshape(batch, length, embed_dim)
    return linear(out, proj_weight, proj_bias), weights


@rule(aten._native_multi_head_attention)
def _native_mha(call, func, args, kwargs):
    if any(isinstance(a, torch.Tensor) and a.is_nested for a in args[:3]):
        return NotImplemented
    names = ("mask", "need_weights", "average_attn_weights", "mask_type")
    extra = {n: kwargs[n] for n in names if n in kwargs}
    return _mha(call, *args, **extra)


@rule(aten._transformer_encoder_layer_fwd)
def _encoder_layer(call, func, args, kwargs):
    (src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, use_gelu, norm_first, eps,
     norm_w1, norm_b1, norm_w2, norm_b2, ffn_w1, ffn_b1, ffn_w2, ffn_b2) = args[:18]
    mask = op_arg(args, kwargs, 18, "mask")
    mask_type = op_arg(args, kwargs, 19, "mask_type")
    if src.is_nested:
        return NotImplemented

    def norm(x, w, b):
        return F.layer_norm(x, (embed_dim,), w, b, eps)

    def linear(x, w, b):
        return linear_product(call, "matmul", x, w, b)

    # PyTorch's transformer_encoder_layer_forward, step by step
    x = norm(src, norm_w1, norm_b1) if norm_first else src
    x = _mha(call, x, x, x, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask, False,
             True, mask_type)[0] + src
    if not norm_first:
        x = norm(x, norm_w1, norm_b1)
    residual = x
    if norm_first:
        x = norm(x, norm_w2, norm_b2)
    hidden = linear(x, ffn_w1, ffn_b1)
    hidden = F.gelu(hidden) if use_gelu else F.relu(hidden)
    x = linear(hidden, ffn_w2, ffn_b2) + residual
    return x if norm_first else norm(x, norm_w2, norm_b2)
