"""Activation checkpointing under emulate(): the forward recomputed inside the backward runs as the forward did."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import tf32lab
from tf32lab.emulation.emulator import RECOMPUTES_EMULATED

pytestmark = pytest.mark.skipif(not RECOMPUTES_EMULATED,
                                reason="this PyTorch has no torch.overrides.redispatch_function")


class Block(torch.nn.Module):
    """Attention, a linear, a matmul and a convolution: every family the recompute goes through."""

    def __init__(self, width=8):
        super().__init__()
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.conv = torch.nn.Conv1d(width, width, 3, padding=1)
        self.mix = torch.nn.Parameter(torch.randn(width, width) / width ** 0.5)

    def forward(self, x):
        # one head, (batch, length, width): this machine's SDPA takes its math path (bmm), not the target's kernel
        h = F.scaled_dot_product_attention(*self.qkv(x).chunk(3, -1), is_causal=True)
        h = torch.matmul(torch.tanh(h), self.mix)
        return self.conv(h.transpose(1, 2)).transpose(1, 2) + x


class Model(torch.nn.Module):
    def __init__(self, how=None, width=8):
        super().__init__()
        self.how = how  # None: no checkpoint; else use_reentrant
        self.embed = torch.nn.Linear(width, width)  # the blocks' input requires grad, as a reentrant checkpoint needs
        self.blocks = torch.nn.ModuleList([Block(width), Block(width)])
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x) if self.how is None else checkpoint(block, x, use_reentrant=self.how)
        return self.head(x)


def _grads(how, x):
    torch.manual_seed(0)
    model = Model(how)
    x = x.clone().requires_grad_()
    with tf32lab.precision("high"), tf32lab.emulate("a100") as emu:
        out = model(x)
        out.square().mean().backward()
    return out.detach(), [x.grad, *(p.grad for p in model.parameters())], emu


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpointed_attention_block_trains_as_the_plain_one(reentrant):
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    out, grads, _ = _grads(None, x)
    out_c, grads_c, emu = _grads(reentrant, x)
    assert torch.equal(out, out_c)
    # the same emulated math in the same order: the same bits (non-reentrant raised CheckpointError; reentrant
    # recomputed attention through this machine's own kernel and its gradients differed)
    assert all(torch.equal(g, h) for g, h in zip(grads, grads_c))
    assert not emu.unhandled
    assert any(op.endswith("scaled_dot_product_attention") for op, _ in emu.coverage)  # the target's kernel


def test_a_checkpointed_model_gets_the_emulated_gradients_not_the_native_ones():
    # guards the test above against an emulation that did nothing: the gradients differ from the native ones
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    _, grads, _ = _grads(False, x)
    torch.manual_seed(0)
    model = Model(False)
    model(x).square().mean().backward()
    assert any(not torch.equal(g, p.grad) for g, p in zip(grads[1:], model.parameters()))


@pytest.mark.parametrize("reentrant", [False, True])
def test_check_training_of_a_checkpointed_transformer_passes_at_highest(reentrant):
    torch.manual_seed(0)
    model = Model(reentrant)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(4, 5, 8, generator=g), torch.randn(4, 5, 1, generator=g)) for _ in range(3)]
    workload = tf32lab.TrainingWorkload(
        model, batches, loss=lambda out, b: (out - b[1]).pow(2).mean(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), inputs=lambda b: b[0], name="checkpointed")
    report = tf32lab.check_training(workload, levels=("highest", "high"), target="a100")
    assert report.floor.failure is None, report.floor.failure
    assert all(row.failure is None for row in report.levels), [row.failure for row in report.levels]
    assert report.passed
