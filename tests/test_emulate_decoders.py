"""What decoders run, emulated: SDPA with a causal mask, with a KV cache (q shorter than k), grouped-query
attention, rotary angles, RMSNorm; each against an explicitly rounded float64 reference, forward and backward."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

import tf32lab
from emulation_reference import bilinear, bound, check, emulated, randn

aten = torch.ops.aten


def causal(L, S):
    """PyTorch's is_causal mask: top-left aligned, ``ones(L, S).tril()`` (the SDPA documentation's reference)."""
    return torch.ones(L, S, dtype=torch.bool).tril()


def reference(q, k, v, keep, math, heads_k=None):
    """softmax(q kᵀ/sqrt(d) masked) v in float64 with operands rounded for ``math``; k and v shared by groups of
    query heads (grouped-query attention) where they have fewer heads."""
    if k.size(-3) != q.size(-3):
        rep = q.size(-3) // k.size(-3)
        k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    scale = q.size(-1) ** -0.5
    s = bilinear(torch.matmul, q, k.transpose(-2, -1), math) * scale
    s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, -1)
    tol_s = bound(torch.matmul, q, k.transpose(-2, -1), q.size(-1)) * scale
    out = bilinear(torch.matmul, p.float(), v, math)
    tol = bound(torch.matmul, p.float(), v, v.size(-2)) + tol_s.max() * v.abs().max().double()
    return out, tol


# a prefill of 12 tokens, and a chunk of 4 new tokens against a cache of 12 (q shorter than k)
SHAPES = {"prefill": (12, 12), "cached chunk": (4, 12), "one new token": (1, 12)}


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("mode", ["no_grad", "inference", "grad"])
def test_causal_attention_with_a_cache_and_grouped_heads(shape, gqa, mode):
    L, S = SHAPES[shape]
    q = randn(2, 4, L, 32, seed=1)
    k, v = randn(2, 2 if gqa else 4, S, 32, seed=2), randn(2, 2 if gqa else 4, S, 16, seed=3)
    extra = {"enable_gqa": True} if gqa else {}

    def call(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=L > 1, **extra)

    keep = causal(L, S) if L > 1 else torch.ones(L, S, dtype=torch.bool)
    leaves = [t.clone().requires_grad_(mode == "grad") for t in (q, k, v)]
    context = torch.inference_mode() if mode == "inference" else torch.set_grad_enabled(mode == "grad")
    with context:
        out, emu = emulated(call, *leaves)
        ieee = call(q, k, v)
    assert emu.coverage and not emu.unhandled, emu.unhandled
    assert {m for _, m in emu.coverage} == {"tf32x3"}  # the a100's fused float32 kernel, whatever the level
    ref, tol = reference(q, k, v, keep, "tf32x3")
    check(out.detach(), ieee.detach(), ref, tol, math="tf32x3")
    # the mask is PyTorch's own: at `highest` the result is PyTorch's within float32 rounding
    highest, _ = emulated(call, q, k, v, level="highest")
    assert torch.allclose(highest, ieee.detach(), atol=1e-5)


@pytest.mark.parametrize("shape", ["prefill", "cached chunk"])
def test_causal_grouped_attention_backward_sums_each_shared_head(shape):
    L, S = SHAPES[shape]
    q, k, v = randn(1, 4, L, 16, seed=4), randn(1, 2, S, 16, seed=5), randn(1, 2, S, 8, seed=6)
    g = randn(1, 4, L, 8, seed=7)

    def grads(context):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with context:
            F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True).backward(g)
        return [t.grad for t in leaves]

    with tf32lab.precision("high"), tf32lab.emulate("a100") as emu:
        got = grads(torch.enable_grad())
    assert not emu.unhandled and {m for _, m in emu.coverage} == {"tf32x3"}
    # float64: the exact gradients, to which 3xTF32 (near float32) must be as close as float32 itself
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*exact, is_causal=True, enable_gqa=True).backward(g.double())
    native = grads(torch.enable_grad())
    for emulated_grad, native_grad, t in zip(got, native, exact):
        assert emulated_grad.shape == t.shape
        floor = (native_grad.double() - t.grad).norm() / t.grad.norm()
        error = (emulated_grad.double() - t.grad).norm() / t.grad.norm()
        assert error <= 20 * floor + 1e-6, (error, floor)


def test_causal_attention_in_the_math_backend_follows_the_level():
    """Where the fused kernels are off, SDPA is two cuBLAS GEMMs: TF32 at `high`, with a cache as without."""
    L, S = SHAPES["cached chunk"]
    q, k, v = randn(2, 4, L, 32, seed=8), randn(2, 2, S, 32, seed=9), randn(2, 2, S, 16, seed=10)
    before = torch.backends.cuda.mem_efficient_sdp_enabled()
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    try:
        out, emu = emulated(lambda *a: F.scaled_dot_product_attention(*a, is_causal=True, enable_gqa=True), q, k, v)
    finally:
        torch.backends.cuda.enable_mem_efficient_sdp(before)
    assert {m for _, m in emu.coverage} == {"tf32-rna"} and not emu.unhandled
    root = 32**-0.25  # the math backend scales both operands by sqrt(scale)
    kk, vv = k.repeat_interleave(2, -3), v.repeat_interleave(2, -3)
    s = bilinear(torch.matmul, q * root, kk.transpose(-2, -1) * root, "tf32").masked_fill(~causal(L, S), -torch.inf)
    p = torch.softmax(s, -1)
    ref = bilinear(torch.matmul, p.float(), vv, "tf32")
    tol_s = bound(torch.matmul, q * root, kk.transpose(-2, -1) * root, 32)  # float32's sums in the scores
    tol = bound(torch.matmul, p.float(), vv, S) + tol_s.max() * vv.abs().max().double()
    ieee = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
    check(out, ieee, ref, tol, flips=0.02)


def test_rotary_angles_are_a_gemm_and_round_positions_beyond_2048():
    """Llama's rotary angles are ``inv_freq @ position_ids``, a float32 GEMM with K=1: at `high` its operands
    are TF32, so a position above 2048 is no longer an integer's exact angle (seen on B200 GPUs,
    huggingface/transformers#48428); at `highest` the angles are exact."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    positions = torch.arange(2040, 2060, dtype=torch.float32)

    def angles(inv, pos):
        return (inv[None, :, None].expand(2, -1, 1) @ pos[None, None, :].expand(2, 1, -1)).transpose(1, 2)

    high, emu = emulated(angles, inv_freq, positions)
    highest, _ = emulated(angles, inv_freq, positions, level="highest")
    assert not emu.unhandled and {m for _, m in emu.coverage} == {"tf32-rna"}
    ref = bilinear(lambda a, b: a @ b, inv_freq[:, None], positions[None, :], "tf32").T
    assert torch.allclose(high[0].double(), ref, rtol=0, atol=1e-12 * 2048)  # exact products of TF32 operands
    assert torch.equal(highest[0], (inv_freq[:, None] * positions[None, :]).T)
    # above 2048 TF32's integers are 2 apart: 2049 and 2051 are ties, rounded away from zero (cuBLAS's RNA)
    assert [high[0, i, 0].item() for i in (8, 9, 10, 11)] == [2048.0, 2050.0, 2050.0, 2052.0]


def test_rms_norm_is_not_a_matmul_and_runs_as_pytorch():
    x, w = randn(3, 7, 64, seed=11), randn(64, seed=12)
    out, emu = emulated(lambda x, w: F.rms_norm(x, (64,), w, 1e-6), x, w)
    assert not emu.unhandled and not emu.coverage
    assert torch.equal(out, F.rms_norm(x, (64,), w, 1e-6))


def test_a_decoding_step_with_a_cache_is_emulated_whole():
    """A tiny Llama (GQA, rotary, RMSNorm) decodes one token against its cache: every matmul-family op has a
    rule, and the logits are float64's within TF32's error."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    # transformers 5.x names the cache argument `cache`; before, `past_key_values`
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        cache = model(ids[:, :8], use_cache=True).past_key_values
        with tf32lab.precision("high"), tf32lab.emulate("a100") as emu:
            step = model(ids[:, 8:], **{name: cache}, use_cache=True).logits
        exact = model.double()(ids, use_cache=False).logits[:, 8:]
    assert emu.coverage and not emu.unhandled, emu.unhandled
    error = (step.double() - exact).norm() / exact.norm()
    assert 1e-6 < error < 1e-2, error  # TF32's projections, not float32's, not broken
