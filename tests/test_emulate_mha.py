"""nn.MultiheadAttention under emulate(): the SDPA that F.multi_head_attention_forward calls is the target's."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import tf32lab
from tf32lab.emulation.emulator import COMPOSITES_EMULATED

pytestmark = pytest.mark.skipif(not COMPOSITES_EMULATED,
                                reason="this PyTorch has no torch.overrides.redispatch_function")

E, HEADS, L, B = 8, 2, 5, 3
TARGET_SDPA = {"tf32lab::scaled_dot_product_attention", "tf32lab::scaled_dot_product_attention_backward"}


def by_hand(mha, x, mask=None):
    """F.multi_head_attention_forward's steps for self-attention with need_weights=False (packed in-projection,
    (L, B, E) layout), its attention written as a direct F.scaled_dot_product_attention call."""
    proj = F.linear(x, mha.in_proj_weight, mha.in_proj_bias)
    proj = proj.unflatten(-1, (3, E)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
    head = E // HEADS
    q, k, v = (t.view(L, B * HEADS, head).transpose(0, 1).view(B, HEADS, L, head) for t in proj)
    out = F.scaled_dot_product_attention(q, k, v, mask, 0.0, False)
    out = F.linear(out.permute(2, 0, 1, 3).reshape(B * L, E), mha.out_proj.weight, mha.out_proj.bias)
    return out.view(L, B, E)


def emulated(fn, mha, x):
    """fn's output and the gradients of x and mha's parameters, forward and backward under TF32 emulation."""
    with tf32lab.precision("high"), tf32lab.emulate("a100") as emu:
        y = fn(x)
        grads = torch.autograd.grad(y.square().sum(), [x, *mha.parameters()])
    return y, grads, emu


# the CPU's own pick: its fused flash kernel; with flash off, its math path (bmm GEMMs). A100's float32 SDPA is
# the memory-efficient kernel either way.
@pytest.mark.parametrize("backends", [None, [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]],
                         ids=["default", "flash-off"])
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_mha_attention_is_the_targets_sdpa(backends, masked):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(E, HEADS, dropout=0.0)
    x = torch.randn(L, B, E, requires_grad=True)
    mask = torch.randn(L, L) if masked else None
    with sdpa_kernel(backends) if backends else torch.enable_grad():
        y, grads, emu = emulated(lambda x: mha(x, x, x, attn_mask=mask, need_weights=False)[0], mha, x)
        y_hand, grads_hand, emu_hand = emulated(lambda x: by_hand(mha, x, mask), mha, x)
    assert torch.equal(y, y_hand)
    for name, g, g_hand in zip(["x", *dict(mha.named_parameters())], grads, grads_hand):
        assert torch.equal(g, g_hand), name
    assert dict(emu.coverage) == dict(emu_hand.coverage)
    assert {op for op, _ in emu.coverage if "attention" in op} == TARGET_SDPA
    assert {math for op, math in emu.coverage if op in TARGET_SDPA} == {"tf32x3"}
    assert not emu.unhandled


def test_encoder_layer_training_runs_the_targets_sdpa():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(E, HEADS, 2 * E, dropout=0.0, batch_first=True).train()
    x = torch.randn(B, L, E)
    with tf32lab.precision("high"), tf32lab.emulate("a100") as emu:
        layer(x).sum().backward()
    assert {op for op, _ in emu.coverage if "attention" in op} == TARGET_SDPA
    assert not emu.unhandled

