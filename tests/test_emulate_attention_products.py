"""A fused attention kernel's products in a split math (3xTF32 on an A100, bf16x3) are emulated as one GEMM over K
doubled, ``[big | small] @ [big' + small' ; big']``, rather than two GEMMs added: the same terms in one float32
accumulation. And its boolean and causal masks are added as a bias of 0 and -inf rather than filled in: the same
scores, a masked-out score that is NaN or +inf excepted, which is computed again as PyTorch masks it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tf32lab
from tf32lab.emulation import attention_rules
from tf32lab.numbers import formats

SPLITS = {"tf32x3": formats.split_tf32x3, "bf16x3": formats.split_bf16x3}


def _two_gemms(a: torch.Tensor, b: torch.Tensor, math: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The split product as two GEMMs, big·(big' + small') + small·big' (in ``dtype``)."""
    a_big, a_small = SPLITS[math](a.contiguous())
    b_big, b_sum = SPLITS[math](b.contiguous(), summed=True)
    a_big, a_small, b_big, b_sum = (t.to(dtype) for t in (a_big, a_small, b_big, b_sum))
    return (a_big @ b_sum + a_small @ b_big).to(dtype)


def _attention(q, k, v, keep, scale, math, dtype=torch.float32):
    """softmax(q kᵀ scale, masked) v with both products as two GEMMs, as PyTorch masks (fully masked rows: 0)."""
    s = _two_gemms(q, k.transpose(-2, -1), math, dtype) * scale
    s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, -1)
    p = p.masked_fill(torch.isneginf(s).all(-1, keepdim=True), 0.0)
    return _two_gemms(p.float(), v, math, dtype)


def _heads(batch: int, tokens: int, heads: int, dim: int, seed: int) -> list[torch.Tensor]:
    """q, k, v as a BERT layer hands them over: (batch, heads, tokens, dim) views of (batch, tokens, heads, dim)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, tokens, heads, dim, generator=gen).transpose(1, 2) for _ in range(3)]


def _emulated(q, k, v, math, **options):
    with tf32lab.emulate("a100", **({} if math == "tf32x3" else {"math": math})) as emu:
        out = F.scaled_dot_product_attention(q, k, v, **options)
    assert {m for _, m in emu.coverage} == {math} and not emu.unhandled
    return out


@pytest.mark.parametrize("math", ["tf32x3", "bf16x3"])
@pytest.mark.parametrize("size", [(4, 18, 12, 32), (2, 200, 2, 64)], ids=["small", "above the kernel's threshold"])
def test_one_gemm_over_k_doubled_is_the_two_gemms_within_float32_accumulation(math, size):
    q, k, v = _heads(*size, seed=1)
    keep = torch.ones(size[0], 1, size[1], size[1], dtype=torch.bool)
    keep[0, ..., size[1] // 2:] = False  # padding, as a tokenizer's mask gives it
    scale = size[-1] ** -0.5
    out = _emulated(q, k, v, math, attn_mask=keep)
    two = _attention(q, k, v, keep, scale, math)
    exact = _attention(q, k, v, keep, scale, math, torch.float64)  # the same parts, summed exactly
    float32_error = float((two - exact).norm() / exact.norm())
    assert 0 < float32_error < 1e-5
    # as near the exact sums as the two GEMMs, within float32's bound for one sum of twice the terms
    assert float((out - exact).norm() / exact.norm()) <= 3 * float32_error
    assert not torch.equal(out, F.scaled_dot_product_attention(q, k, v, attn_mask=keep))  # not float32's own


@pytest.mark.parametrize("math", ["tf32x3", "bf16x3"])
def test_one_gemm_over_k_doubled_keeps_infinities_and_nans_where_the_two_gemms_have_them(math):
    q, k, v = _heads(2, 20, 2, 16, seed=2)
    q, k, v = q.clone(), k.clone(), v.clone()
    q[0, 0, 3, 5] = float("inf")  # a row of infinite scores: a NaN row
    q[1, 1, 7, 2] = float("nan")
    k[1, 0, 4, 0] = float("-inf")  # a column: every row of the head NaN or inf
    v[0, 1, 9, 3] = float("inf")
    keep = torch.ones(20, 20, dtype=torch.bool).tril()
    out = _emulated(q, k, v, math, attn_mask=keep)
    want = _attention(q, k, v, keep, 16 ** -0.5, math)
    assert torch.equal(torch.isnan(out), torch.isnan(want)) and torch.isnan(out).any()
    assert torch.equal(torch.isinf(out), torch.isinf(want))
    finite = torch.isfinite(want)
    # scores a float32 rounding apart may split the weights a last part's bit apart: bf16x3's is 2^-16
    assert torch.allclose(out[finite], want[finite], rtol=1e-4, atol=1e-5)


def _forward_backward(q, k, v, **options):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with tf32lab.emulate("a100"):
        out = F.scaled_dot_product_attention(*leaves, **options)
        out.pow(2).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


def _bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b))


MASKS = {
    "boolean": lambda n: {"attn_mask": torch.rand(2, 1, n, n, generator=torch.Generator().manual_seed(3)) > 0.3},
    "causal": lambda n: {"is_causal": True},
    "causal and negative scale": lambda n: {"is_causal": True, "scale": -0.3},
    "boolean, all heads": lambda n: {"attn_mask": torch.rand(2, 4, n, n, generator=torch.Generator().manual_seed(4))
                                     > 0.5},
    "boolean broadcasting the scores": lambda n: {"attn_mask": torch.rand(3, 2, 4, n, n) > 0.3},
    "grouped-query": lambda n: {"is_causal": True, "enable_gqa": True},
    "rows fully masked": lambda n: {"attn_mask": torch.ones(n, n, dtype=torch.bool).tril().index_fill(0,
                                                                                          torch.tensor([0, 5]), False)},
}


def _keys_fully_masked(n: int) -> torch.Tensor:
    keep = torch.ones(2, 1, n, n, dtype=torch.bool)
    keep[1, :, 3:7] = False  # padding's query rows: no key left, zeros from torch 2.5 (pytorch#131060)
    return keep


@pytest.mark.parametrize("name", list(MASKS))
def test_masks_added_as_a_bias_give_the_filled_masks_results_bit_for_bit(name, monkeypatch):
    q, k, v = _heads(2, 24, 4, 16, seed=5)
    if name == "grouped-query":
        k, v = k[:, :2], v[:, :2]
    options = MASKS[name](24)
    fast = _forward_backward(q, k, v, **options)
    monkeypatch.setattr(attention_rules, "_BIAS_MASKS", False)  # masked_fill, as PyTorch's math path masks
    filled = _forward_backward(q, k, v, **options)
    assert _bitwise(fast, filled), name
    assert all(torch.isfinite(t).all() for t in fast)


def test_a_masked_out_score_that_overflows_is_masked_as_pytorch_masks_it(monkeypatch):
    # q·k overflows to +inf where the mask drops it: the bias made it NaN (inf - inf), the row is computed again
    q, k, v = _heads(1, 8, 2, 16, seed=6)
    q, k = q.clone(), k.clone()
    q[0, 0, 2, 0] = 3e19
    k[0, 0, 6, 0] = 3e19  # a later token: out of the causal mask of row 2
    fast = _forward_backward(q, k, v, is_causal=True)
    assert torch.isfinite(fast[0]).all()
    monkeypatch.setattr(attention_rules, "_BIAS_MASKS", False)
    assert _bitwise(fast[:1], _forward_backward(q, k, v, is_causal=True)[:1])


def test_fully_masked_rows_take_the_bias_path_alone(monkeypatch):
    # padding's rows are -inf throughout either way: no second computation of the scores for them
    q, k, v = _heads(2, 12, 2, 16, seed=7)
    calls = []
    real = attention_rules._scores

    def counted(*args, **kwargs):
        calls.append(kwargs.get("exact", True))
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_rules, "_scores", counted)
    keep = _keys_fully_masked(12)
    out = _forward_backward(q, k, v, attn_mask=keep)
    assert calls == [False, False]  # the forward's and the backward's, each once, by the bias
    assert torch.equal(out[0][1, :, 3:7], torch.zeros_like(out[0][1, :, 3:7]))
    monkeypatch.setattr(attention_rules, "_BIAS_MASKS", False)
    assert _bitwise(out, _forward_backward(q, k, v, attn_mask=keep))
